"""A loaded model: weights, tokenizer and chat template, shared by any number of sessions.

    model = runtime.load(artifact_dir)
    with model.new_session() as s:             # its own KV cache: sessions run in parallel threads
        for delta in s.chat(messages, GenerationConfig(max_new_tokens=64)):
            ...
    model.chat(...)                            # the same, on the model's default session

The generate loop lives in runtime/session.py.
"""
from __future__ import annotations

import logging
import numbers
import weakref
from typing import Iterator

import numpy as np

from .config import rope_rotate
from .sampling import GenerationConfig
from .session import CancelToken, Generation, GenerationStats, Session
from .tokenizer import ChatTemplate, Tokenizer

log = logging.getLogger(__name__)


class Model:
    def __init__(self, manifest, backend, tokenizer: Tokenizer, max_context: int, profile=None):
        self.manifest = manifest
        self.backend = backend
        self.tokenizer = tokenizer
        self.profile = profile
        self.config = manifest.architecture
        self.vocab = self.config.vocab
        self.max_context = max_context
        self.stop_ids = tuple(manifest.stop_ids)
        self.template = None
        if manifest.chat_template:
            bos = tokenizer.id_to_piece(manifest.bos_id) if manifest.bos_id is not None else ""
            try:
                self.template = ChatTemplate(manifest.chat_template, bos_token=bos or "",
                                             eos_token=tokenizer.id_to_piece(manifest.eos_id) or "")
            except ValueError as e:
                from .artifact import ArtifactError

                raise ArtifactError(f"manifest chat_template: {e}") from None
        self._sessions: list = []
        self.session = self.new_session()  # the default session behind model.generate/chat/...

    def new_session(self, max_context: int | None = None, session_cls: type[Session] = Session, **kw) -> Session:
        """A conversation with its own KV cache (max_context positions, default the model's); session_cls: a
        Session subclass (the service's gated sessions), given kw. close() frees it too."""
        if self.backend is None:
            raise ValueError("model is closed")
        s = session_cls(self, max_context, **kw)
        self._sessions = [r for r in self._sessions if r() is not None]
        self._sessions.append(weakref.ref(s))
        return s

    def close(self) -> None:
        """Free every session's run state and the weights now (not at garbage collection). A generation
        running in another thread finishes its current step first, then raises "session is closed"."""
        for ref in self._sessions:
            s = ref()
            if s is not None:
                s.close()
        self._sessions.clear()
        if self.backend is not None:
            self.backend.close()
            self.backend = None

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- what sessions share -----------------------------------------------------------------
    def check_ids(self, ids) -> list[int]:
        """A non-empty sequence of int token ids in range; anything else is a ValueError saying what it was."""
        if isinstance(ids, (str, bytes, bytearray, dict)) or not hasattr(ids, "__iter__"):
            raise ValueError(f"token ids must be a sequence of ints, got {type(ids).__name__}")
        if isinstance(ids, np.ndarray) and ids.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got an array of {ids.dtype}")
        out = []
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, numbers.Integral):
                raise ValueError(f"token ids must be ints, got {type(i).__name__} {i!r:.20}")
            out.append(int(i))
        if not out:
            raise ValueError("empty prompt: give at least one token id")
        bad = [i for i in out if not 0 <= i < self.vocab]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab}): {bad[:5]}")
        return out

    def rope_rotate(self, x: np.ndarray, delta: int) -> np.ndarray:
        return rope_rotate(x, delta, self.config)

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True, limit: int | None = None) -> list[int]:
        """The conversation's prompt ids; with ``limit``, tokenizing stops past limit ids (see Template.encode)."""
        if self.template is None:
            raise ValueError("this artifact has no chat template; use generate() with your own prompt")
        return self.template.encode(self.tokenizer, messages, add_generation_prompt, limit)

    # ---- the default session -----------------------------------------------------------------
    @property
    def cache(self):
        return self.session.cache

    @property
    def last_stats(self) -> GenerationStats:
        return self.session.last_stats

    def prefill(self, ids, chunk: int = 256, cancel: CancelToken | None = None) -> np.ndarray:
        return self.session.prefill(ids, chunk, cancel)

    def decode_step(self, token_id: int) -> np.ndarray:
        return self.session.decode_step(token_id)

    def reset(self) -> None:
        """Forget the default session's cached KV."""
        self.session.reset()

    def generate(self, prompt_ids, config: GenerationConfig = GenerationConfig(),
                 cancel: CancelToken | None = None) -> Generation:
        return self.session.generate(prompt_ids, config, cancel)

    def stream(self, prompt_ids, config: GenerationConfig = GenerationConfig(),
               cancel: CancelToken | None = None) -> Iterator[str]:
        return self.session.stream(prompt_ids, config, cancel)

    def chat(self, messages: list[dict], config: GenerationConfig = GenerationConfig(),
             cancel: CancelToken | None = None) -> Iterator[str]:
        return self.session.chat(messages, config, cancel)

    def warm_prefix(self, messages: list[dict]) -> int:
        return self.session.warm_prefix(messages)

    def perplexity(self, ids, chunk: int = 256) -> tuple[float, int]:
        return self.session.perplexity(ids, chunk)
