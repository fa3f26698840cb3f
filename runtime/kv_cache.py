"""The 8-bit KV cache: preallocated once, token-major, written in place.

Layout (one array for K and V of every layer, token-major over everything):
  kv     (max_seq, layers, 2*kv_heads, head_dim) int8     K heads [0, kv_heads), V heads after
  scale  (max_seq, layers, 2*kv_heads, 1)        float32  symmetric absmax/127 per (token, layer, head)
so the live prefix kv[:n] is one contiguous view, passed to the backend without a copy,
and a step writes only its own rows. ``tokens`` remembers which ids produced the cached
rows, which is what prefix reuse compares against.
"""
from __future__ import annotations

import numpy as np

KV_SCALE_FLOOR = 1e-30  # smallest scale: an all-zero (token, head) stays exactly zero (also in bt_native.c)


class ContextOverflow(ValueError):
    """A prompt (plus what is already cached) does not fit the cache."""


class KVCache:
    def __init__(self, max_seq: int, n_layers: int, n_kv_heads: int, head_dim: int):
        self.max_seq = max_seq
        self.kv = np.zeros((max_seq, n_layers, 2 * n_kv_heads, head_dim), np.int8)
        self.scale = np.zeros((max_seq, n_layers, 2 * n_kv_heads, 1), np.float32)
        self.tokens: list[int] = []  # ids whose K/V fill rows [0, len(tokens))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def bytes_per_position(self) -> int:
        return self.kv[0].nbytes + self.scale[0].nbytes

    def view(self) -> tuple[np.ndarray, np.ndarray]:
        """The live prefix (n, layers, 2*kv_heads, head_dim) int8 and its scales; views, no copy."""
        n = len(self.tokens)
        return self.kv[:n], self.scale[:n]

    def append(self, ids, kv: np.ndarray, scale: np.ndarray) -> None:
        """Write the rows produced for ``ids`` right after the live prefix."""
        n, t = len(self.tokens), len(ids)
        if n + t > self.max_seq:
            raise ContextOverflow(f"KV cache full: {n} + {t} tokens > max context {self.max_seq}")
        if not np.may_share_memory(kv, self.kv):  # a backend that wrote the rows in place needs no copy
            self.kv[n : n + t] = kv
            self.scale[n : n + t] = scale
        self.tokens.extend(int(i) for i in ids)

    def rewind_to(self, n: int) -> None:
        """Forget everything after the first n positions (their rows are simply overwritten later)."""
        if not 0 <= n <= len(self.tokens):
            raise ValueError(f"cannot rewind to {n}: cache holds {len(self.tokens)} tokens")
        del self.tokens[n:]

    def reset(self) -> None:
        self.tokens.clear()

    def common_prefix(self, ids) -> int:
        """Length of the longest common prefix of ``ids`` and the cached tokens."""
        n = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            n += 1
        return n
