"""A session: one conversation's KV cache and the generate loop over it.

    prefill(ids)        -> logits of the last id   (chunked; cancel checked between chunks)
    decode_step(id)     -> logits of that id
    generate(ids, cfg)  -> Generation: iterator of new ids (reuses the cached KV of the longest common prefix)
    stream(ids, cfg)    -> iterator of text deltas (UTF-8 safe, stop strings held back and cut)
    chat(messages, cfg) -> iterator of text deltas; a conversation that outgrows the context keeps its
                           system prompt, drops its oldest whole turns and shifts the cache (no recompute)

A loaded ``Model`` holds the weights and is shared; each ``Session`` (``model.new_session()``)
owns a KV cache and the backend's per-session run state, so sessions run in parallel threads
independently. One session serves one generation at a time: a step while another thread is in a
step of the same session raises ``SessionBusy``, and starting a new generation (or ``reset``)
supersedes an unfinished one, which raises ``SessionBusy`` if it is resumed, never yields ids
computed over a cache that changed under it. Arguments are validated when a call is made, not at
the first ``next()``.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .kv_cache import ContextOverflow, common_prefix
from .sampling import GenerationConfig, Sampler
from .tokenizer import validate_messages

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


class SessionBusy(RuntimeError):
    """A session was used by two generations (or threads) at once."""


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose KV was already cached
    new_tokens: int = 0
    prefill_s: float = 0.0  # seconds, monotonic
    ttft_s: float = 0.0  # from generate() call to the first new id
    decode_s: float = 0.0  # from the first new id to the last
    finish_reason: str = ""  # "stop", "stop_string", "length", "context", "cancelled"
    dropped_messages: int = 0  # chat: oldest messages left out so the conversation fits
    shifted_tokens: int = 0  # positions dropped by a context shift instead of a recompute
    prefill_chunks: int = 0  # forward passes of the prompt (cancel is checked before each)
    token_ids: list[int] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.new_tokens > 1 and self.decode_s > 0 else 0.0


class Generation:
    """The ids of one reply as they are made: iterate it; ``stats`` fills in as it runs; ``close()``
    abandons it. ``texts()`` gives the text deltas instead of ids (not both)."""

    def __init__(self, steps, stats: GenerationStats):
        self._steps = steps  # generator of (id or None, text delta)
        self.stats = stats

    def __iter__(self) -> Iterator[int]:
        for tok, _ in self._steps:
            if tok is not None:
                yield tok

    def __next__(self) -> int:
        while True:
            tok, _ = next(self._steps)
            if tok is not None:
                return tok

    def texts(self) -> Iterator[str]:
        for _, text in self._steps:
            if text:
                yield text

    def close(self) -> None:
        self._steps.close()


class Session:
    def __init__(self, model, max_context: int | None = None):
        self.model = model
        ctx = model.max_context if max_context is None else max_context
        if not isinstance(ctx, int) or isinstance(ctx, bool) or not 2 <= ctx <= model.max_context:
            raise ValueError(f"max_context must be an integer from 2 to {model.max_context} (the model's), got {ctx!r}")
        self.cache = model.backend.new_cache(ctx)
        self.last_stats = GenerationStats()
        self._lock = threading.Lock()  # held during each step
        self._owner: object | None = None  # the generation allowed to step; a new one supersedes it
        self._closed = self._closing = False

    @property
    def max_context(self) -> int:
        return self.cache.max_seq

    # ---- ownership: one generation at a time ------------------------------------------------
    def _enter(self, owner: object | None = None) -> None:
        if not self._lock.acquire(blocking=False):
            if self._closing:
                raise ValueError("session is closed")
            raise SessionBusy("session is busy: another thread is running a step on it (give each thread its own "
                              "model.new_session(), or cancel the running generation first)")
        if self._closed:  # checked under the lock: close() cannot free the cache while a step runs
            self._lock.release()
            raise ValueError("session is closed")
        if owner is not None and self._owner is not owner:
            self._lock.release()
            raise SessionBusy("this generation was superseded: a newer generate/chat/reset on the same session "
                              "changed its KV cache (finish or close a generation before starting the next)")

    @contextlib.contextmanager
    def _exclusive(self):
        """A standalone step (prefill, logits, rewind, ...): supersedes any unfinished generation and holds
        the session while it runs, in one acquisition of the lock."""
        self._enter(None)
        try:
            self._owner = object()
            yield
        finally:
            self._lock.release()

    def _claim(self) -> object:
        """Make a new owner (superseding any unfinished generation) while no step is running."""
        self._enter()
        try:
            self._owner = token = object()
        finally:
            self._lock.release()
        return token

    # ---- named steps -------------------------------------------------------------------------
    def _forward(self, ids: list[int], logits_from: int) -> np.ndarray:
        n = len(self.cache)
        if n + len(ids) > self.cache.max_seq:
            raise ContextOverflow(f"{n} cached + {len(ids)} new tokens exceed the context of {self.cache.max_seq}")
        return self.model.backend.forward(self.cache, np.asarray(ids, np.int64), logits_from)

    def _prefill(self, ids: list[int], chunk: int, cancel: CancelToken | None, st: GenerationStats | None = None):
        logits = None
        for i in range(0, len(ids), chunk):
            if cancel is not None and cancel.cancelled:
                raise Cancelled()
            part = ids[i : i + chunk]
            logits = self._forward(part, len(part) - 1)
            if st is not None:
                st.prefill_chunks += 1
        return logits[-1]

    def prefill(self, ids, chunk: int = 256, cancel: CancelToken | None = None) -> np.ndarray:
        """Feed ids after what is cached; returns the logits (vocab,) of the last one."""
        ids = self.model.check_ids(ids)
        with self._exclusive():
            return self._prefill(ids, chunk, cancel)

    def logits(self, ids) -> np.ndarray:
        """Feed ids after what is cached; returns the logits (len(ids), vocab) float32 of every one."""
        ids = self.model.check_ids(ids)
        with self._exclusive():
            return self._forward(ids, 0)

    def decode_step(self, token_id: int) -> np.ndarray:
        ids = self.model.check_ids([token_id])
        with self._exclusive():
            return self._forward(ids, 0)[-1]

    def rewind_to(self, n: int) -> None:
        with self._exclusive():
            self.model.backend.rewind(self.cache, n)

    def reset(self) -> None:
        """Forget all cached KV (an unfinished generation on this session is superseded)."""
        self.rewind_to(0)

    def close(self) -> None:
        """Free the cache's run state now; the session is unusable afterwards. Waits for a step running in
        another thread to end (at most one decode step or prefill chunk); that generation then raises
        ``ValueError("session is closed")`` at its next step instead of touching freed memory."""
        self._closing = True  # a step that finds the lock taken by close() says "closed", not "busy"
        with self._lock:
            if not self._closed:
                self._closed = True
                self._owner = None
                self.cache.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- generation --------------------------------------------------------------------------
    def _fit(self, ids: list[int], config: GenerationConfig) -> list[int]:
        room = self.max_context - 1  # at least one position to generate into
        if len(ids) <= room:
            return ids
        if not config.truncate_prompt:
            raise ContextOverflow(f"prompt of {len(ids)} tokens does not fit the context of {self.max_context} "
                                  f"(truncate_prompt=True keeps only the newest tokens; chat() drops old turns)")
        keep = max(1, room - min(config.max_new_tokens, self.max_context // 2))
        log.warning("prompt truncated from %d to its newest %d tokens", len(ids), keep)
        return ids[-keep:]

    def generate(self, prompt_ids, config: GenerationConfig = GenerationConfig(),
                 cancel: CancelToken | None = None) -> Generation:
        """Ids of the reply. Stop ids are not yielded; nor is the id that completes a stop string."""
        _check_args(config, cancel, self.model.vocab)
        ids = self.model.check_ids(prompt_ids)
        return self._start(self._fit(ids, config), config, cancel, want_text=bool(config.stop_strings), before=ids)

    def stream(self, prompt_ids, config: GenerationConfig = GenerationConfig(),
               cancel: CancelToken | None = None) -> Iterator[str]:
        """Text deltas of the reply; a delta never splits a UTF-8 character and stop strings never show."""
        _check_args(config, cancel, self.model.vocab)
        ids = self.model.check_ids(prompt_ids)
        return self._start(self._fit(ids, config), config, cancel, want_text=True, before=ids).texts()

    def _start(self, ids: list[int], config: GenerationConfig, cancel, want_text: bool, before: list[int],
               stats: GenerationStats | None = None) -> Generation:
        """before: the prompt before old tokens were cut out of it (== ids when nothing was)."""
        st = self.last_stats = stats or GenerationStats()
        st.prompt_tokens = len(ids)
        owner = self._claim()
        return Generation(self._run(owner, ids, config, cancel, want_text, before, st), st)

    def _reuse(self, ids: list[int], before: list[int], st: GenerationStats) -> int:
        """Make the cache a prefix of ids and return its length. When old tokens were cut out of the prompt
        (before = ids with a run of tokens more) and the cache holds them, shift the cache instead of
        computing everything after the cut again."""
        drop = len(before) - len(ids)
        if drop > 0:
            p = common_prefix(before, ids)
            m = self.cache.common_prefix(before)
            if m > p + drop and before[:p] == ids[:p] and before[p + drop :] == ids[p:]:
                self.model.backend.rewind(self.cache, m)
                self.cache.shift(p, drop, self.model.rope_rotate)
                st.shifted_tokens = drop
        n = self.cache.common_prefix(ids)
        if n == len(ids):
            n -= 1  # the last prompt id must be fed again to get its logits
        self.model.backend.rewind(self.cache, n)
        return n

    def _run(self, owner, ids, config: GenerationConfig, cancel, want_text: bool, before, st: GenerationStats):
        """Yields (id, text) per new id, then (None, text) for what remains; see Generation."""
        t0 = time.monotonic()
        stops = config.stop_strings
        detok = self.model.tokenizer.detokenizer() if want_text else None
        stop_ids = set(self.model.stop_ids if config.stop_ids is None else config.stop_ids)
        sampler = Sampler(config)
        history = list(ids)
        pending = ""  # text not yet handed out: it may be the start of a stop string
        self._enter(owner)
        try:
            st.reused_tokens = n = self._reuse(ids, before, st)
            log.debug("prompt %d tokens, %d reused from cache, %d shifted out", len(ids), n, st.shifted_tokens)
            if config.max_new_tokens == 0:
                st.finish_reason = "length"
                return
            logits = self._prefill(ids[n:], config.prefill_chunk, cancel, st)
        except Cancelled:
            st.finish_reason = "cancelled"
            return
        finally:
            self._lock.release()
        st.prefill_s = time.monotonic() - t0
        t_first = None
        while True:
            if cancel is not None and cancel.cancelled:
                st.finish_reason = "cancelled"
                break
            tok = sampler(logits, history)
            if tok in stop_ids:
                st.finish_reason = "stop"
                break
            text = ""
            if detok is not None:
                # pending never holds a whole stop string, so a stop ends in the new text: search all of buf
                buf = pending + detok.push(tok)
                cut = _find_stop(buf, stops)
                if cut is not None:
                    st.finish_reason = "stop_string"
                    if t_first is None and buf[:cut]:  # the first text came with the stop: that is the TTFT
                        st.ttft_s = time.monotonic() - t0
                    yield None, buf[:cut]  # the text before the stop, even inside the same token
                    return
                hold = _stop_prefix_len(buf, stops)
                text, pending = buf[: len(buf) - hold], buf[len(buf) - hold :]
            now = time.monotonic()
            if t_first is None:
                t_first = now
                st.ttft_s = now - t0
            st.decode_s = now - t_first
            st.new_tokens += 1
            st.token_ids.append(tok)
            history.append(tok)
            yield tok, text
            if st.new_tokens >= config.max_new_tokens:
                st.finish_reason = "length"
                break
            if len(self.cache) >= self.max_context:
                st.finish_reason = "context"
                log.warning("context of %d tokens is full; stopping", self.max_context)
                break
            self._enter(owner)
            try:
                logits = self._forward([tok], 0)[-1]
            finally:
                self._lock.release()
        if detok is not None:
            tail = pending + detok.flush()
            if tail:
                yield None, tail

    # ---- chat --------------------------------------------------------------------------------
    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.model.chat_ids(messages, add_generation_prompt)

    def chat(self, messages: list[dict], config: GenerationConfig = GenerationConfig(),
             cancel: CancelToken | None = None) -> Iterator[str]:
        """Text deltas of the assistant's reply to ``messages`` ([{"role": ..., "content": ...}, ...]).

        When the conversation and room for the reply (min(max_new_tokens, context/4)) do not fit, the
        system message stays, the oldest whole turns are left out (at least half of what follows the
        system message, so this happens rarely and a cached row is shifted at most once), and the
        cached KV of the turns that remain is shifted down instead of computed again.
        ``last_stats.dropped_messages`` says how many messages were left out: drop them from your
        history too, so the next call renders only what the model still sees."""
        _check_args(config, cancel, self.model.vocab)
        msgs = validate_messages(messages)
        ids = before = self.chat_ids(msgs)
        st = GenerationStats()
        reserve = min(config.max_new_tokens, self.max_context // 4)
        if len(ids) + reserve > self.max_context:
            ids, st.dropped_messages = self._drop_turns(msgs, ids, self.max_context - reserve)
        return self._start(ids, config, cancel, want_text=True, before=before, stats=st).texts()

    def _drop_turns(self, msgs: list[dict], ids: list[int], budget: int) -> tuple[list[int], int]:
        """(ids of the conversation without its oldest turns, number of messages left out)."""
        first = 1 if msgs[0]["role"] == "system" else 0
        n_sys = len(self.chat_ids(msgs[:first], False)) if first else 0
        target = min(budget, n_sys + (len(ids) - n_sys) // 2)
        # a kept conversation starts at a user message, and keeps the last one
        cuts = [i for i in range(first + 1, len(msgs)) if msgs[i]["role"] == "user"]
        new_ids = ids
        for cut in cuts:
            new_ids = self.chat_ids(msgs[:first] + msgs[cut:])
            if len(new_ids) <= target:
                break
        if len(new_ids) > budget:
            raise ContextOverflow(f"the system prompt and the last message take {len(new_ids)} tokens; with room for "
                                  f"the reply the context of {self.max_context} holds {budget}")
        log.info("conversation of %d tokens outgrew the context of %d: left out the %d oldest messages (%d tokens)",
                 len(ids), self.max_context, cut - first, len(ids) - len(new_ids))
        return new_ids, cut - first

    def warm_prefix(self, messages: list[dict]) -> int:
        """Prefill the template's rendering of fixed leading messages (a system prompt) so turns start from it."""
        ids = self.chat_ids(messages, add_generation_prompt=False)
        with self._exclusive():
            n = self.cache.common_prefix(ids)
            self.model.backend.rewind(self.cache, n)
            if n < len(ids):
                self._prefill(ids[n:], 256, None)
        return len(ids)

    def perplexity(self, ids, chunk: int = 256) -> tuple[float, int]:
        """(perplexity, n_predicted) of ids as one window from position 0; leaves them cached."""
        ids = self.model.check_ids(ids)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be an integer >= 1, got {chunk!r}")
        if len(ids) < 2:
            raise ValueError("perplexity needs at least 2 tokens")
        if len(ids) > self.max_context:
            raise ContextOverflow(f"{len(ids)} tokens exceed the context of {self.max_context}")
        with self._exclusive():
            self.model.backend.rewind(self.cache, 0)
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


def _check_args(config, cancel, vocab: int) -> None:
    if not isinstance(config, GenerationConfig):
        raise TypeError(f"config must be a GenerationConfig, got {type(config).__name__}")
    if config.stop_ids is not None and any(not 0 <= i < vocab for i in config.stop_ids):
        raise ValueError(f"stop_ids must be token ids in [0, {vocab}), got {config.stop_ids!r:.60}")
    if cancel is not None and not isinstance(cancel, CancelToken):
        raise TypeError(f"cancel must be a CancelToken or None, got {type(cancel).__name__}")


def _find_stop(text: str, stops) -> int | None:
    """Where the earliest stop string in text starts, or None."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def _stop_prefix_len(text: str, stops) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
