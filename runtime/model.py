"""A loaded model and its generate loop.

    prefill(ids)        -> logits of the last id   (chunked; cancel checked between chunks)
    decode_step(id)     -> logits of that id
    generate(ids, cfg)  -> iterator of new ids     (reuses the cached KV of the longest common prefix)
    stream(ids, cfg)    -> iterator of text deltas (UTF-8 safe, stop strings held back and cut)
    chat(messages, cfg) -> iterator of text deltas
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .kv_cache import ContextOverflow, KVCache
from .sampling import GenerationConfig, Sampler
from .tokenizer import ChatTemplate, Tokenizer

log = logging.getLogger(__name__)


class CancelToken:
    """Set from any thread; generation stops within one decode step or one prefill chunk."""

    def __init__(self):
        self._e = threading.Event()

    def cancel(self) -> None:
        self._e.set()

    @property
    def cancelled(self) -> bool:
        return self._e.is_set()

    def reset(self) -> None:
        self._e.clear()


class Cancelled(Exception):
    pass


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose KV was already cached
    new_tokens: int = 0
    prefill_s: float = 0.0  # seconds, monotonic
    ttft_s: float = 0.0  # from generate() call to the first new id
    decode_s: float = 0.0  # from the first new id to the last
    finish_reason: str = ""  # "stop", "stop_string", "length", "context", "cancelled"
    token_ids: list[int] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.new_tokens > 1 and self.decode_s > 0 else 0.0


class Model:
    def __init__(self, manifest, backend, tokenizer: Tokenizer, max_context: int, profile=None):
        self.manifest = manifest
        self.backend = backend
        self.tokenizer = tokenizer
        self.profile = profile
        a = manifest.architecture
        self.vocab = int(a["vocab"])
        self.cache = KVCache(max_context, int(a["n_layers"]), int(a["n_kv_heads"]), int(a["head_dim"]),
                             layer_major=getattr(backend, "kv_layer_major", False))
        self.stop_ids = tuple(manifest.stop_ids)
        self.template = None
        if manifest.chat_template:
            bos = tokenizer.id_to_piece(manifest.bos_id) if manifest.bos_id is not None else ""
            self.template = ChatTemplate(manifest.chat_template, bos_token=bos or "",
                                         eos_token=tokenizer.id_to_piece(manifest.eos_id) or "")
        self.last_stats = GenerationStats()

    @property
    def max_context(self) -> int:
        return self.cache.max_seq

    # ---- named steps -------------------------------------------------------------------------
    def _forward(self, ids: list[int], logits_from: int) -> np.ndarray:
        start = len(self.cache)
        if start + len(ids) > self.cache.max_seq:
            raise ContextOverflow(f"{start} cached + {len(ids)} new tokens exceed the context of {self.cache.max_seq}")
        arr = np.asarray(ids, np.int64)
        logits, kv, scale = self.backend.forward(arr, start, self.cache.kv, self.cache.scale, logits_from)
        self.cache.append(ids, kv, scale)
        return logits

    def prefill(self, ids: list[int], chunk: int = 256, cancel: CancelToken | None = None) -> np.ndarray:
        """Feed ids after what is cached; returns the logits (vocab,) of the last one."""
        if not ids:
            raise ValueError("prefill needs at least one token")
        logits = None
        for i in range(0, len(ids), chunk):
            if cancel is not None and cancel.cancelled:
                raise Cancelled()
            part = ids[i : i + chunk]
            logits = self._forward(part, len(part) - 1)
        return logits[-1]

    def decode_step(self, token_id: int) -> np.ndarray:
        return self._forward([token_id], 0)[-1]

    def reset(self) -> None:
        """Forget all cached KV."""
        self.cache.reset()

    # ---- generation --------------------------------------------------------------------------
    def _check_ids(self, ids) -> list[int]:
        try:
            ids = [int(i) for i in ids]
        except (TypeError, ValueError):
            raise ValueError("prompt ids must be a sequence of ints") from None
        if not ids:
            raise ValueError("empty prompt: give at least one token id")
        bad = [i for i in ids if not 0 <= i < self.vocab]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab}): {bad[:5]}")
        return ids

    def _fit(self, ids: list[int], config: GenerationConfig) -> list[int]:
        room = self.max_context - 1  # at least one position to generate into
        if len(ids) <= room:
            return ids
        if not config.truncate_prompt:
            raise ContextOverflow(f"prompt of {len(ids)} tokens does not fit the context of {self.max_context} "
                                  f"(set truncate_prompt=True to keep only the newest tokens)")
        keep = max(1, room - min(config.max_new_tokens, self.max_context // 2))
        log.warning("prompt truncated from %d to its newest %d tokens", len(ids), keep)
        return ids[-keep:]

    def generate(self, prompt_ids, config: GenerationConfig = GenerationConfig(),
                 cancel: CancelToken | None = None) -> Iterator[int]:
        """Yield new token ids. Stop ids are not yielded; nor is the id that completes a stop string."""
        t0 = time.monotonic()
        ids = self._fit(self._check_ids(prompt_ids), config)
        st = self.last_stats = GenerationStats(prompt_tokens=len(ids))
        stop = set(self.stop_ids if config.stop_ids is None else config.stop_ids)
        n = self.cache.common_prefix(ids)
        if n == len(ids):
            n -= 1  # the last prompt id must be fed again to get its logits
        self.cache.rewind_to(n)
        st.reused_tokens = n
        log.debug("prompt %d tokens, %d reused from cache", len(ids), n)
        sampler = Sampler(config)
        history = list(ids)
        detok = self.tokenizer.detokenizer() if config.stop_strings else None
        text = ""
        longest_stop = max((len(s) for s in config.stop_strings), default=0)
        try:
            if config.max_new_tokens == 0:
                st.finish_reason = "length"
                return
            logits = self.prefill(ids[n:], config.prefill_chunk, cancel)
            st.prefill_s = time.monotonic() - t0
            t_first = None
            while True:
                if cancel is not None and cancel.cancelled:
                    st.finish_reason = "cancelled"
                    return
                tok = sampler(logits, history)
                if tok in stop:
                    st.finish_reason = "stop"
                    return
                if detok is not None:
                    text = (text + detok.push(tok))[-(longest_stop + 16):]
                    if any(s in text for s in config.stop_strings):
                        st.finish_reason = "stop_string"
                        return
                now = time.monotonic()
                if t_first is None:
                    t_first = now
                    st.ttft_s = now - t0
                st.decode_s = now - t_first
                st.new_tokens += 1
                st.token_ids.append(tok)
                history.append(tok)
                yield tok
                if st.new_tokens >= config.max_new_tokens:
                    st.finish_reason = "length"
                    return
                if len(self.cache) >= self.max_context:
                    st.finish_reason = "context"
                    log.warning("context of %d tokens is full; stopping", self.max_context)
                    return
                logits = self.decode_step(tok)
        except Cancelled:
            st.finish_reason = "cancelled"

    def stream(self, prompt_ids, config: GenerationConfig = GenerationConfig(),
               cancel: CancelToken | None = None) -> Iterator[str]:
        """Yield text deltas of the reply; a delta never splits a UTF-8 character and stop strings never show."""
        detok = self.tokenizer.detokenizer()
        stops = config.stop_strings
        pending = ""
        for tok in self.generate(prompt_ids, config, cancel):
            pending += detok.push(tok)
            if not stops:
                if pending:
                    yield pending
                    pending = ""
                continue
            hold = _stop_prefix_len(pending, stops)
            if len(pending) > hold:
                yield pending[: len(pending) - hold]
                pending = pending[len(pending) - hold :]
        # generate() never yields the id that completes a stop string, so what is held back
        # after such a stop is the stop string's beginning: drop it.
        tail = "" if self.last_stats.finish_reason == "stop_string" else pending + detok.flush()
        if tail:
            yield tail

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if self.template is None:
            raise ValueError("this artifact has no chat template; use generate() with your own prompt")
        return self.template.encode(self.tokenizer, messages, add_generation_prompt)

    def chat(self, messages: list[dict], config: GenerationConfig = GenerationConfig(),
             cancel: CancelToken | None = None) -> Iterator[str]:
        """Text deltas of the assistant's reply to ``messages`` ([{"role": ..., "content": ...}, ...])."""
        return self.stream(self.chat_ids(messages), config, cancel)

    def warm_prefix(self, messages: list[dict]) -> int:
        """Prefill the template's rendering of fixed leading messages (a system prompt) so turns start from it."""
        ids = self.chat_ids(messages, add_generation_prompt=False)
        n = self.cache.common_prefix(ids)
        self.cache.rewind_to(n)
        if n < len(ids):
            self.prefill(ids[n:])
        return len(ids)

    def perplexity(self, ids, chunk: int = 256) -> tuple[float, int]:
        """(perplexity, n_predicted) of ids as one window from position 0; leaves them cached."""
        ids = self._check_ids(ids)
        if len(ids) < 2:
            raise ValueError("perplexity needs at least 2 tokens")
        if len(ids) > self.max_context:
            raise ContextOverflow(f"{len(ids)} tokens exceed the context of {self.max_context}")
        self.reset()
        nll = 0.0
        for i in range(0, len(ids), chunk):
            part = ids[i : i + chunk]
            logits = self._forward(part, 0).astype(np.float64)  # (len(part), vocab)
            targets = ids[i + 1 : i + 1 + len(part)]
            lg = logits[: len(targets)]
            m = lg.max(-1, keepdims=True)
            lse = (m + np.log(np.exp(lg - m).sum(-1, keepdims=True)))[:, 0]
            nll += float((lse - lg[np.arange(len(targets)), targets]).sum())
        n = len(ids) - 1
        return float(np.exp(nll / n)), n


def _stop_prefix_len(text: str, stops) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string (or contains one)."""
    for s in stops:
        if s in text:
            return len(text) - text.find(s)
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
