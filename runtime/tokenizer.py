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


BPE_MAGIC = "boardtalk-bpe 1"  # first line of tokenizer.bpe (written by models/tokenizer.py bpe_file_text)
# llama.cpp's pre-tokenizer names -> the two this module implements
PRE_TOKENIZERS = {"smollm": "smollm", "starcoder": "smollm", "refact": "smollm", "codeshell": "smollm",
                  "gpt2": "gpt2", "gpt-2": "gpt2", "default": "gpt2"}
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class Tokenizer:
    """Byte-level BPE over an artifact's ``tokenizer.bpe`` (models/tokenizer.py ``bpe_file_text``).

    Gives the ids llama.cpp and Hugging Face ``tokenizers`` give (tests hold both as references):
    added tokens split out first (leftmost, longest), then the pre-tokenizer (``smollm``: every
    number character alone, then the GPT-2 pattern on each piece; ``gpt2``: the pattern), then
    merges by rank with the same priority-queue order as ``tokenizers``' BPE. Loading is a split()
    and two dicts (~30 ms for 49k tokens, against ~0.2 s to build a ``tokenizers`` object).
    """

    def __init__(self, bpe_text: str):
        try:
            import regex
        except ImportError as e:  # pragma: no cover
            raise ImportError("the runtime needs 'regex' (pip install regex)") from e
        lines = bpe_text.split("\n")
        try:
            if lines[0] != BPE_MAGIC:
                raise ValueError(f"first line {lines[0][:40]!r} is not {BPE_MAGIC!r}")
            kw, pre = lines[1].split(" ")
            control = [int(i) for i in lines[2].split(" ")[1:]]
            user = [int(i) for i in lines[3].split(" ")[1:]]
            n = int(lines[4].split(" ")[1])
            self._pieces = lines[5 : 5 + n]
            m = int(lines[5 + n].split(" ")[1])
            merges = lines[6 + n : 6 + n + m]
            if kw != "pre" or len(self._pieces) != n or len(merges) != m or pre not in ("smollm", "gpt2"):
                raise ValueError("truncated or unknown sections")
        except IndexError:
            raise ValueError("tokenizer file is malformed: truncated") from None
        except ValueError as e:
            raise ValueError(f"tokenizer file is malformed: {e}") from None
        self.vocab_size = n
        self._ids = {p: i for i, p in enumerate(self._pieces)}
        self._ranks = dict(zip(merges, range(m)))
        self.special_ids = set(control)
        self._split = regex.compile(_GPT2_SPLIT)
        self._numbers = regex.compile(r"(\p{N})") if pre == "smollm" else None
        self._user = self._added_pattern(regex, user)
        self._all = self._added_pattern(regex, user + control)
        self._byte_chr = {b: c for c, b in _byte_decoder().items()}
        self._cache: dict[str, list[int]] = {}
        self._lock = threading.Lock()  # the word cache is shared between threads
        self._bytes: dict[int, bytes] = {}  # id -> bytes, filled lazily

    def _added_pattern(self, regex, ids):
        if not ids:
            return None
        texts = sorted({self._pieces[i] for i in ids}, key=len, reverse=True)  # longest first at one position
        return regex.compile("(" + "|".join(regex.escape(t) for t in texts) + ")")

    def token_bytes(self, i: int) -> bytes:
        """The bytes a token stands for; b"" for control tokens."""
        b = self._bytes.get(i)
        if b is None:
            if i in self.special_ids:
                b = b""
            else:
                if not 0 <= i < self.vocab_size:
                    raise ValueError(f"token id {i} is not in the vocabulary")
                piece, bd = self._pieces[i], _byte_decoder()
                try:
                    b = bytes(bd[c] for c in piece)
                except KeyError:  # an added token written as plain text
                    b = piece.encode("utf-8")
            self._bytes[i] = b
        return b

    def _encode(self, text: str, specials: bool, limit: int | None = None) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        added = self._all if specials else self._user
        ids: list[int] = []
        for k, part in enumerate(added.splititer(text) if added else (text,)):
            if k % 2:  # a captured added token
                ids.append(self._ids[part])
            elif part:
                pieces = self._numbers.splititer(part) if self._numbers else (part,)
                for piece in pieces:
                    for word in self._split.finditer(piece):
                        ids += self._word(word.group())
                        if limit is not None and len(ids) > limit:
                            return ids[: limit + 1]
        return ids

    def _word(self, word: str) -> list[int]:
        """Ids of one pre-token: its UTF-8 bytes as byte-level symbols, merged by rank."""
        hit = self._cache.get(word)
        if hit is not None:
            return hit
        bc = self._byte_chr
        sym = [bc[b] for b in word.encode("utf-8")]
        if len(sym) > 1:
            sym = self._merge(sym)
        ids = [self._ids[s] for s in sym]
        with self._lock:
            if len(self._cache) > 50_000:
                self._cache.clear()
            self._cache[word] = ids
        return ids

    def _merge(self, sym: list[str]) -> list[str]:
        """tokenizers' Word::merge_all: pop the lowest (rank, position) pair; skip it if its symbols
        changed since it was queued; merge; queue the new neighbour pairs."""
        import heapq

        ranks, n = self._ranks, len(sym)
        prev, nxt = list(range(-1, n - 1)), list(range(1, n + 1))
        nxt[-1] = -1
        heap = []
        for i in range(n - 1):
            r = ranks.get(sym[i] + " " + sym[i + 1])
            if r is not None:
                heap.append((r, i, sym[i] + sym[i + 1]))
        heapq.heapify(heap)
        while heap:
            r, i, merged = heapq.heappop(heap)
            j = nxt[i]
            if not sym[i] or j < 0 or sym[i] + sym[j] != merged or ranks.get(sym[i] + " " + sym[j]) is None:
                continue
            sym[i], sym[j] = merged, ""
            nxt[i] = nxt[j]
            if nxt[j] >= 0:
                prev[nxt[j]] = i
            p, q = prev[i], nxt[i]
            if p >= 0:
                rp = ranks.get(sym[p] + " " + merged)
                if rp is not None:
                    heapq.heappush(heap, (rp, p, sym[p] + merged))
            if q >= 0:
                rq = ranks.get(merged + " " + sym[q])
                if rq is not None:
                    heapq.heappush(heap, (rq, i, merged + sym[q]))
        return [s for s in sym if s]

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        """Ids of plain text; special-token strings are encoded as ordinary text. With ``limit``, stops
        once it has more than limit ids (returns limit + 1 of them): a prompt that cannot fit the
        context is refused after tokenizing only what fits, however long the text."""
        return self._encode(text, specials=False, limit=limit)

    def encode_with_specials(self, text: str) -> list[int]:
        """Ids of trusted text (template markup) where special-token strings become their ids."""
        return self._encode(text, specials=True)

    def id_to_piece(self, i: int) -> str:
        return self._pieces[i]

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
        try:
            self._t = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template does not parse: {e}") from None
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self._t.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                  bos_token=self.bos_token, eos_token=self.eos_token)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001  a template is data: whatever it raises is its error, in one line
            raise ValueError(f"chat template failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                             ) from None

    def encode(self, tok: Tokenizer, messages: list[dict], add_generation_prompt: bool = True,
               limit: int | None = None) -> list[int]:
        """Render with placeholders for the contents, then encode markup with specials and contents as plain text.
        With ``limit``, stops once it has more than limit ids (a prompt that cannot fit is known after
        tokenizing only what fits, however long a client's message is); the ids are then a prefix."""
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
                ids += tok.encode(m["content"], limit=None if limit is None else max(0, limit - len(ids)))
            if limit is not None and len(ids) > limit:
                return ids
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
