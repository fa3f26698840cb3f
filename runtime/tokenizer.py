"""Tokenizer, streaming detokenizer and chat template of a loaded artifact.

``encode(text)`` treats special-token text such as ``<|im_end|>`` as plain text: user
input can never inject control tokens. Only the chat template's own markup is parsed
for special tokens (``encode_chat``).
"""
from __future__ import annotations

import codecs
import threading
from functools import lru_cache

_PLACEHOLDER = "\ue000boardtalk-msg-{}\ue001"  # private-use code points: no template emits them


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable char standing for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class Tokenizer:
    def __init__(self, tokenizer_json: str, special_ids: set[int] | None = None):
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as e:  # pragma: no cover
            raise ImportError("the runtime needs 'tokenizers': pip install tokenizers") from e
        self._hf = HFTokenizer.from_str(tokenizer_json)
        self._lock = threading.Lock()  # encode_special_tokens is a switch on the shared object
        self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        added = self._hf.get_added_tokens_decoder()
        self.special_ids = set(special_ids or ()) | {i for i, t in added.items() if t.special}
        self._bytes: dict[int, bytes] = {}  # id -> bytes, filled lazily (an eager table costs ~0.1 s at load)

    def token_bytes(self, i: int) -> bytes:
        """The bytes a token stands for; b"" for control tokens."""
        b = self._bytes.get(i)
        if b is None:
            if i in self.special_ids:
                b = b""
            else:
                piece = self._hf.id_to_token(i)
                if piece is None:
                    raise ValueError(f"token id {i} is not in the vocabulary")
                bd = _byte_decoder()
                try:
                    b = bytes(bd[c] for c in piece)
                except KeyError:  # not a byte-level symbol string
                    b = piece.encode("utf-8")
            self._bytes[i] = b
        return b

    def _encode(self, text: str, specials: bool) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        with self._lock:
            self._hf.encode_special_tokens = not specials
            return self._hf.encode(text, add_special_tokens=False).ids

    def encode(self, text: str) -> list[int]:
        """Ids of plain text; special-token strings are encoded as ordinary text."""
        return self._encode(text, specials=False)

    def encode_with_specials(self, text: str) -> list[int]:
        """Ids of trusted text (template markup) where special-token strings become their ids."""
        return self._encode(text, specials=True)

    def id_to_piece(self, i: int) -> str:
        return self._hf.id_to_token(i)

    def decode(self, ids) -> str:
        """Text of ids, control tokens left out; invalid UTF-8 becomes U+FFFD."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def detokenizer(self) -> "Detokenizer":
        return Detokenizer(self)


class Detokenizer:
    """Turns ids into text deltas one at a time; a delta never ends inside a UTF-8 character."""

    def __init__(self, tok: Tokenizer):
        self._bytes = tok.token_bytes
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._dec.decode(self._bytes(token_id))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class ChatTemplate:
    """A model's Jinja chat template, rendered in a sandbox, tokenized without letting content inject specials."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:  # pragma: no cover
            raise ImportError("chat templates need jinja2: pip install jinja2") from e
        import jinja2

        def raise_exception(msg):
            raise ValueError(f"chat template: {msg}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
        env.globals["raise_exception"] = raise_exception
        self._t = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self._t.render(messages=messages, add_generation_prompt=add_generation_prompt,
                              bos_token=self.bos_token, eos_token=self.eos_token)

    def encode(self, tok: Tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Render with placeholders for the contents, then encode markup with specials and contents as plain text."""
        messages = validate_messages(messages)
        holders = [dict(m, content=_PLACEHOLDER.format(i)) for i, m in enumerate(messages)]
        text = self.render(holders, add_generation_prompt)
        ids: list[int] = []
        for i, m in enumerate(messages):
            ph = _PLACEHOLDER.format(i)
            before, sep, text = text.partition(ph)
            if not sep:
                raise ValueError(f"chat template dropped or altered message {i}'s content")
            if before:
                ids += tok.encode_with_specials(before)
            if m["content"]:
                ids += tok.encode(m["content"])
        if text:
            ids += tok.encode_with_specials(text)
        return ids


ROLES = ("system", "user", "assistant")


def validate_messages(messages) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} must be a dict with string 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise ValueError(f"message {i}: role {m['role']!r} is not one of {', '.join(ROLES)}")
        out.append({"role": m["role"], "content": m["content"]})
    return out
