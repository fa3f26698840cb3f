"""Sampling: generation options and the Sampler that turns logits into the next id."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256  # generated ids at most (stop ids not counted as output)
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely ids; 0 = off
    top_p: float = 1.0  # nucleus: smallest set with this much probability; 1 = off
    repetition_penalty: float = 1.0  # >1 discourages ids already in prompt or output (CTRL-style)
    seed: int | None = None  # sampling seed; None = fresh entropy
    stop_ids: tuple[int, ...] | None = None  # None = the model's own end-of-turn ids
    stop_strings: tuple[str, ...] = ()  # text that ends generation (not included in the output)
    prefill_chunk: int = 256  # prompt tokens per forward pass; cancel is checked between chunks
    truncate_prompt: bool = False  # drop the oldest prompt tokens instead of failing when it does not fit

    def __post_init__(self) -> None:
        validate(self)


def _int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _num(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_)) and math.isfinite(v)


def validate(c: GenerationConfig) -> None:
    """The one place that checks the options' types, ranges and how they combine."""
    if not _int(c.max_new_tokens) or c.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {c.max_new_tokens!r}")
    if not _num(c.temperature) or not (c.temperature == 0 or 1e-3 <= c.temperature <= 100):
        raise ValueError(f"temperature must be 0 (greedy) or a number from 0.001 to 100, got {c.temperature!r}")
    if not _int(c.top_k) or c.top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0, got {c.top_k!r}")
    if not _num(c.top_p) or not 0 < c.top_p <= 1:
        raise ValueError(f"top_p must be a number in (0, 1], got {c.top_p!r}")
    if not _num(c.repetition_penalty) or not 0.01 <= c.repetition_penalty <= 100:
        raise ValueError(f"repetition_penalty must be a number from 0.01 to 100 (1 = off), got {c.repetition_penalty!r}")
    if c.seed is not None and (not _int(c.seed) or not 0 <= c.seed < 2**64):
        raise ValueError(f"seed must be an integer in [0, 2**64) or None, got {c.seed!r}")
    if not _int(c.prefill_chunk) or c.prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be an integer >= 1, got {c.prefill_chunk!r}")
    if (not isinstance(c.stop_strings, (tuple, list)) or any(not isinstance(s, str) or not s for s in c.stop_strings)):
        raise ValueError(f"stop_strings must be a tuple of non-empty strings, got {c.stop_strings!r:.60}")
    if c.stop_ids is not None and (not isinstance(c.stop_ids, (tuple, list)) or any(not _int(i) for i in c.stop_ids)):
        raise ValueError(f"stop_ids must be a tuple of ints or None, got {c.stop_ids!r:.60}")
    if not isinstance(c.truncate_prompt, bool):
        raise ValueError(f"truncate_prompt must be True or False, got {c.truncate_prompt!r}")


class Sampler:
    def __init__(self, config: GenerationConfig):
        self.c = config
        self.rng = np.random.default_rng(config.seed)

    def __call__(self, logits: np.ndarray, history: list[int] | None = None) -> int:
        """logits (vocab,) float32 -> next id. history: ids seen so far (for the repetition penalty)."""
        c = self.c
        x = logits.astype(np.float32, copy=c.repetition_penalty != 1.0)
        if c.repetition_penalty != 1.0 and history:
            seen = np.unique(np.asarray(history, np.int64))
            v = x[seen]
            x[seen] = np.where(v > 0, v / c.repetition_penalty, v * c.repetition_penalty)
        if c.temperature == 0:
            return int(np.argmax(x))
        x = x.astype(np.float64) / c.temperature
        if c.top_k and c.top_k < x.size:
            kth = np.partition(x, -c.top_k)[-c.top_k]
            x = np.where(x < kth, -np.inf, x)
        p = np.exp(x - x.max())
        p /= p.sum()
        if c.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            cum = np.cumsum(p[order])
            keep = order[: int(np.searchsorted(cum, c.top_p)) + 1]
            q = np.zeros_like(p)
            q[keep] = p[keep]
            p = q / q.sum()
        return int(self.rng.choice(p.size, p=p))
