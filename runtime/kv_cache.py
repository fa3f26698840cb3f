"""The 8-bit KV cache: preallocated once, written in place.

One array for K and V of every layer, in the layout the backend reads best:
  token-major (onnxruntime):  kv (max_seq, layers, 2*kv_heads, head_dim) int8, scale (max_seq, layers, 2*kv_heads, 1)
      the live prefix kv[:n] is one contiguous view, passed to the graph without a copy;
  layer-major (native):       kv (layers, max_seq, 2*kv_heads, head_dim) int8, scale (layers, max_seq, 2*kv_heads, 1)
      each layer's positions are contiguous, so attention streams them (token-major rows are
      11.5 KB apart for SmolLM2; layer-major measured ~10 % faster attention at context ~128).
K heads come first, V heads after; scales are symmetric absmax/127 per (token, layer, head).
A step writes only its own rows. ``tokens`` remembers which ids produced the cached rows,
which is what prefix reuse compares against.

A cache belongs to one session and is made by the session's backend (``Backend.new_cache``),
which may keep per-session run state beside it (the native backend's scratch) and free it in
``close()``. ``shift`` is the context shift of long conversations: it drops a run of positions
and moves the later ones down, re-rotating their keys (see its docstring for the error bound).
"""
from __future__ import annotations

import numpy as np

KV_SCALE_FLOOR = 1e-30  # smallest scale: an all-zero (token, head) stays exactly zero (also in bt_native.c)


def _lazy_zeros(shape, dtype) -> np.ndarray:
    """Zeros in an anonymous mapping: a page becomes resident when a position on it is first written,
    so memory follows the context actually used. (np.zeros would do the same, but NumPy asks for
    transparent huge pages on large arrays, and in a layer-major cache every layer's first positions
    then pull in whole 2 MiB pages: the full 22 MiB cache resident after a few hundred tokens.)"""
    import mmap

    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(buf, dtype, count=int(np.prod(shape))).reshape(shape)


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ContextOverflow(ValueError):
    """A prompt (plus what is already cached) does not fit the cache."""


class KVCache:
    def __init__(self, max_seq: int, n_layers: int, n_kv_heads: int, head_dim: int, layer_major: bool = False):
        self.max_seq = max_seq
        self.n_kv_heads = n_kv_heads
        self.layer_major = layer_major
        lead = (n_layers, max_seq) if layer_major else (max_seq, n_layers)
        self.kv = _lazy_zeros(lead + (2 * n_kv_heads, head_dim), np.int8)
        self.scale = _lazy_zeros(lead + (2 * n_kv_heads, 1), np.float32)
        self.tokens: list[int] = []  # ids whose K/V fill rows [0, len(tokens))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def bytes_per_position(self) -> int:
        return (self.kv.nbytes + self.scale.nbytes) // self.max_seq

    def view(self) -> tuple[np.ndarray, np.ndarray]:
        """The live prefix and its scales, as views (no copy); contiguous when token-major."""
        n = len(self.tokens)
        if self.layer_major:
            return self.kv[:, :n], self.scale[:, :n]
        return self.kv[:n], self.scale[:n]

    def append(self, ids, kv: np.ndarray, scale: np.ndarray) -> None:
        """Write the rows produced for ``ids`` right after the live prefix."""
        n, t = len(self.tokens), len(ids)
        if n + t > self.max_seq:
            raise ContextOverflow(f"KV cache full: {n} + {t} tokens > max context {self.max_seq}")
        if not np.may_share_memory(kv, self.kv):  # a backend that wrote the rows in place needs no copy
            if self.layer_major:
                raise ValueError("a layer-major cache is written in place by its backend")
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

    def close(self) -> None:
        """Free what the backend keeps beside the cache (nothing here); the arrays go with the object."""

    def shift(self, keep: int, drop: int, rotate) -> None:
        """Context shift: forget positions [keep, keep + drop) and move the later ones down by ``drop``.

        V rows move as they are. K rows were stored after RoPE at their old positions, so each is
        dequantized, rotated back by ``drop`` positions (``rotate(k (..., head_dim) float, -drop)``
        -> float64) and quantized again with a fresh absmax/127 scale: one extra rounding of at most
        half a quantization step per element, the same size as the error the int8 cache already has.
        The caller drops at least half of what follows ``keep`` each time (Session.chat does), so a
        row is shifted at most once before it is itself dropped: the error never compounds.
        """
        n = len(self.tokens)
        if keep < 0 or drop < 1 or keep + drop > n:
            raise ValueError(f"cannot shift: keep {keep}, drop {drop}, cache holds {n}")
        m = n - keep - drop
        kvh = self.n_kv_heads
        pos = (lambda a, b: (slice(None), slice(a, b))) if self.layer_major else (lambda a, b: (slice(a, b),))
        src, dst = pos(keep + drop, n), pos(keep, keep + m)
        if m:
            k = self.kv[src][..., :kvh, :].astype(np.float32) * self.scale[src][..., :kvh, :]
            k = rotate(k, -drop)
            s = np.maximum(np.abs(k).max(-1, keepdims=True) / 127.0, KV_SCALE_FLOOR)
            q = np.clip(np.rint(k / s), -127, 127).astype(np.int8)  # rint: half to even, as the kernels
            self.kv[dst][..., kvh:, :] = self.kv[src][..., kvh:, :]
            self.scale[dst][..., kvh:, :] = self.scale[src][..., kvh:, :]
            self.kv[dst][..., :kvh, :] = q
            self.scale[dst][..., :kvh, :] = s.astype(np.float32)
        del self.tokens[keep : keep + drop]

    def common_prefix(self, ids) -> int:
        """Length of the longest common prefix of ``ids`` and the cached tokens."""
        return common_prefix(self.tokens, ids)
