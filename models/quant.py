"""Weight quantization for ONNX Runtime's ``com.microsoft.MatMulNBits``.

MatMulNBits stores a (K -> N) linear layer as
  B            uint8  (N, K/block, block*bits/8)  element 2i in the low nibble of byte i
  scales       float  (N * K/block,)
  zero_points  uint8  (N * ceil(K/block*bits/8),)  packed like B; default 2**(bits-1)
and computes W[n, k] = (q - zp) * scale.

Schemes (the registry ``SCHEMES``; CLI choices come from its keys):
  q4_1-exact  GGUF Q4_1 block (d, m, 32 nibbles; w = d*q + m) mapped with no re-rounding:
              nibbles repacked, scale = d, the default zp = 8, and the per-block offset
              c = m + 8d kept as a separate (N, K/32) float32 term that the graph adds
              as blocksum(x) @ c.T:  w = d*(q - 8) + c = d*q + m.
              c is exact in float32 when d and m are f16 values of similar exponent
              (true for every block of SmolLM2; the packer counts any that are not).
              Why zp = 8 and not 0: with int8 activations (accuracy_level 4) the
              activation rounding error multiplies d*(q - zp); centring it cuts the
              logit error ~10x. Float zero points would avoid the extra term, but ORT
              takes a slow dequantize-every-call path for them (measured 17x slower).
  q4_1-intzp  the same nibbles and scale, with m re-rounded into an integer zero point
              zp = clip(round(-m/d), 0, 15): one op less per linear layer, lossy.
  rtn-int4    round-to-nearest asymmetric int4, block 32, from float weights
              (F32/F16 GGUF or any dequantized source). Lossy; reports its error.
  q8_0        GGUF Q8_0 (d, 32 int8; w = d*q) as 8-bit MatMulNBits, exact (u = q + 128, zp 128).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

BLOCK = 32


@dataclass
class PackedLinear:
    """One linear layer in MatMulNBits form. Computes y = x @ W.T with W (N, K)."""

    K: int
    N: int
    bits: int
    block_size: int
    qweight: np.ndarray  # (N, K/block, block*bits/8) uint8
    scales: np.ndarray  # (N * K/block,) float32
    zero_points: np.ndarray | None  # (N * ceil(K/block*bits/8),) uint8, None = default 2**(bits-1)
    block_offset: np.ndarray | None  # (N, K/block) float32: W = (q - zp)*scale + offset

    @property
    def n_blocks(self) -> int:
        return self.K // self.block_size

    def dequantize(self) -> np.ndarray:
        """(N, K) float32: the exact value of (q - zp)*scale + offset, rounded once to float32."""
        q = unpack_bits(self.qweight, self.bits).astype(np.float64)  # (N, nb, block)
        nb = self.n_blocks
        if self.zero_points is None:
            zp = np.full((self.N, nb), 2 ** (self.bits - 1), np.float64)
        else:
            zp = unpack_bits(self.zero_points.reshape(self.N, -1), self.bits)[:, :nb].astype(np.float64)
        w = (q - zp[..., None]) * self.scales.reshape(self.N, nb, 1).astype(np.float64)
        if self.block_offset is not None:
            w = w + self.block_offset[..., None].astype(np.float64)
        return w.reshape(self.N, self.K).astype(np.float32)

    def nbytes(self) -> int:
        n = self.qweight.nbytes + self.scales.nbytes
        n += 0 if self.zero_points is None else self.zero_points.nbytes
        n += 0 if self.block_offset is None else self.block_offset.nbytes
        return n


@dataclass(frozen=True)
class QuantError:
    max_abs: float
    mean_abs: float


def unpack_bits(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 (..., nbytes) -> uint8 (..., nbytes*8/bits), low bits first."""
    if bits == 8:
        return packed
    assert bits == 4
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """uint8 (..., n) with values < 2**bits -> packed (..., ceil(n*bits/8)), low bits first."""
    if bits == 8:
        return values.astype(np.uint8)
    assert bits == 4
    v = values.astype(np.uint8)
    if v.shape[-1] % 2:
        v = np.concatenate([v, np.zeros(v.shape[:-1] + (1,), np.uint8)], axis=-1)
    return (v[..., 0::2] | (v[..., 1::2] << 4)).astype(np.uint8)


def _split_q4_1(raw: np.ndarray, K: int):
    """GGUF Q4_1 rows (N, nb*20 bytes) -> d (N, nb) f32, m (N, nb) f32, q (N, nb, 32) uint8."""
    N = raw.shape[0]
    nb = K // BLOCK
    blocks = raw.reshape(N, nb, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]  # byte j: q[j] low nibble, q[j+16] high nibble
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return d, m, q


def from_q4_1(raw: np.ndarray, K: int, integer_zero_point: bool = False) -> PackedLinear:
    N = raw.shape[0]
    if K % BLOCK or raw.shape[1] != K // BLOCK * 20:
        raise ValueError(f"not Q4_1 rows of K={K}: raw shape {raw.shape}")
    d, m, q = _split_q4_1(raw, K)
    qweight = pack_bits(q, 4)  # (N, nb, 16)
    nb = K // BLOCK
    if integer_zero_point:
        with np.errstate(divide="ignore", invalid="ignore"):
            zp = np.where(d == 0, 0, np.rint(-m / d))
        zp = np.clip(zp, 0, 15).astype(np.uint8)
        # d == 0 means every weight is m: keep it as well as an integer zp can (scale stays 0 -> w = 0).
        return PackedLinear(K, N, 4, BLOCK, qweight, d.reshape(-1), pack_bits(zp, 4).reshape(-1), None)
    offset = (m + np.float32(8) * d).astype(np.float32)
    inexact = int(np.count_nonzero(offset.astype(np.float64) != m.astype(np.float64) + 8 * d.astype(np.float64)))
    if inexact:
        log.warning("Q4_1 -> MatMulNBits: %d of %d block offsets m+8d round in float32", inexact, offset.size)
    return PackedLinear(K, N, 4, BLOCK, qweight, d.reshape(-1), None, offset)


def from_q8_0(raw: np.ndarray, K: int) -> PackedLinear:
    N = raw.shape[0]
    if K % BLOCK or raw.shape[1] != K // BLOCK * 34:
        raise ValueError(f"not Q8_0 rows of K={K}: raw shape {raw.shape}")
    blocks = raw.reshape(N, K // BLOCK, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].view(np.int8)
    u = (q.astype(np.int16) + 128).astype(np.uint8)  # zp default for 8 bits is 128
    return PackedLinear(K, N, 8, BLOCK, np.ascontiguousarray(u), d.reshape(-1), None, None)


def rtn_int4(w: np.ndarray, block: int = BLOCK, symmetric: bool = False) -> PackedLinear:
    """Round-to-nearest int4 of float weights (N, K), one scale (and zero point) per block."""
    w = np.asarray(w, np.float32)
    N, K = w.shape
    if K % block:
        raise ValueError(f"K={K} is not a multiple of block={block}")
    nb = K // block
    b = w.reshape(N, nb, block)
    if symmetric:
        amax = np.abs(b).max(-1)
        scale = amax / 7.0
        zp = np.full((N, nb), 8, np.float32)
    else:
        lo = np.minimum(b.min(-1), 0.0)
        hi = np.maximum(b.max(-1), 0.0)
        scale = (hi - lo) / 15.0
        with np.errstate(divide="ignore", invalid="ignore"):
            zp = np.where(scale == 0, 0, np.rint(-lo / scale))
        zp = np.clip(zp, 0, 15)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(scale == 0, 0, 1.0 / scale)
    q = np.clip(np.rint(b * inv[..., None]) + zp[..., None], 0, 15).astype(np.uint8)
    zpp = pack_bits(zp.astype(np.uint8), 4).reshape(-1)
    return PackedLinear(K, N, 4, block, pack_bits(q, 4), scale.astype(np.float32).reshape(-1), zpp, None)


def error(packed: PackedLinear, reference: np.ndarray) -> QuantError:
    diff = np.abs(packed.dequantize().astype(np.float64) - np.asarray(reference, np.float64))
    return QuantError(float(diff.max()), float(diff.mean()))


def concat(parts: list[PackedLinear]) -> PackedLinear:
    """Stack linears that share an input along N (fused QKV, gate|up)."""
    p0 = parts[0]
    for p in parts[1:]:
        if (p.K, p.bits, p.block_size) != (p0.K, p0.bits, p0.block_size):
            raise ValueError("cannot fuse linears of different K, bits or block size")
        if (p.zero_points is None) != (p0.zero_points is None) or (p.block_offset is None) != (p0.block_offset is None):
            raise ValueError("cannot fuse linears of different schemes")
    cat = lambda xs: None if xs[0] is None else np.concatenate(xs, axis=0)  # noqa: E731
    return PackedLinear(
        p0.K,
        sum(p.N for p in parts),
        p0.bits,
        p0.block_size,
        np.concatenate([p.qweight for p in parts], axis=0),
        np.concatenate([p.scales for p in parts]),
        cat([p.zero_points for p in parts]),
        cat([p.block_offset for p in parts]),
    )


@dataclass(frozen=True)
class Scheme:
    name: str
    bits: int
    block_size: int
    symmetric: bool
    exact_for: str | None  # GGUF type it maps without re-rounding, if any
    description: str


SCHEMES: dict[str, Scheme] = {
    "q4_1-exact": Scheme("q4_1-exact", 4, BLOCK, False, "Q4_1", "GGUF Q4_1 as-is: nibbles, scale d, zp 8, separate block-offset term"),
    "q4_1-intzp": Scheme("q4_1-intzp", 4, BLOCK, False, None, "GGUF Q4_1 nibbles and d, min re-rounded to an integer zero point"),
    "rtn-int4": Scheme("rtn-int4", 4, BLOCK, False, None, "round-to-nearest asymmetric int4 from float weights"),
}
EMBEDDING_SCHEMES = ("q8_0", "rtn-int4")


def pack_tensor(ggml_type: str, raw: np.ndarray, K: int, scheme: str, dequantize) -> PackedLinear:
    """Pack one GGUF weight (rows of raw blocks) by scheme; dequantize() gives its float32 values if needed."""
    if scheme not in SCHEMES and scheme not in EMBEDDING_SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; known: {', '.join(list(SCHEMES) + list(EMBEDDING_SCHEMES))}")
    if scheme in ("q4_1-exact", "q4_1-intzp"):
        if ggml_type != "Q4_1":
            raise ValueError(f"scheme {scheme} needs Q4_1 weights, this tensor is {ggml_type}; use rtn-int4")
        return from_q4_1(raw, K, integer_zero_point=scheme == "q4_1-intzp")
    if scheme == "q8_0":
        if ggml_type != "Q8_0":
            raise ValueError(f"scheme q8_0 needs Q8_0 weights, this tensor is {ggml_type}")
        return from_q8_0(raw, K)
    return rtn_int4(dequantize())


# ---------------------------------------------------------------- native backend layouts
# The native kernels (runtime/native/bt_native.c) read weights 8 rows at a time, interleaved per
# block of 32 columns, so one pass makes 8 outputs and each activation load serves 8 rows. The
# regrouping only moves bytes: every d, m and nibble is the GGUF's own.
#   Q4_1x8 (160 B per group block): f16 d[8], f16 m[8], 4 chunks of 32 B; byte 4r+i of chunk k
#          is GGUF byte 4k+i of row r's block (q[4k+i] low nibble, q[16+4k+i] high nibble)
#   Q8_0x8 (272 B): f16 d[8], 8 chunks of 32 B; byte 4r+i of chunk k is q[4k+i] of row r
# Rows are padded with zero blocks to a multiple of 8.
X8_BYTES = {"Q4_1x8": 160, "Q8_0x8": 272}
GGUF_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}


def _row_groups(raw: np.ndarray, K: int, block_bytes: int) -> np.ndarray:
    """(N, K/32*block_bytes) rows -> (G, K/32, 8, block_bytes), zero rows appended up to a multiple of 8."""
    N, nb = raw.shape[0], K // BLOCK
    if K % BLOCK or raw.shape[1] != nb * block_bytes:
        raise ValueError(f"not rows of {nb} blocks of {block_bytes} bytes: raw shape {raw.shape}")
    blocks = raw.reshape(N, nb, block_bytes)
    if N % 8:
        blocks = np.concatenate([blocks, np.zeros((8 - N % 8, nb, block_bytes), np.uint8)])
    return blocks.reshape(-1, 8, nb, block_bytes).transpose(0, 2, 1, 3)


def interleave_q4_1(raw: np.ndarray, K: int) -> np.ndarray:
    """GGUF Q4_1 rows (N, K/32*20) -> Q4_1x8 groups (ceil(N/8), K/32, 160) uint8."""
    g = _row_groups(raw, K, 20)
    G, nb = g.shape[:2]
    qs = g[..., 4:].reshape(G, nb, 8, 4, 4).transpose(0, 1, 3, 2, 4).reshape(G, nb, 128)  # (k, r, i)
    return np.concatenate([g[..., 0:2].reshape(G, nb, 16), g[..., 2:4].reshape(G, nb, 16), qs], axis=-1)


def interleave_q8_0(raw: np.ndarray, K: int) -> np.ndarray:
    """GGUF Q8_0 rows (N, K/32*34) -> Q8_0x8 groups (ceil(N/8), K/32, 272) uint8."""
    g = _row_groups(raw, K, 34)
    G, nb = g.shape[:2]
    qs = g[..., 2:].reshape(G, nb, 8, 8, 4).transpose(0, 1, 3, 2, 4).reshape(G, nb, 256)
    return np.concatenate([g[..., 0:2].reshape(G, nb, 16), qs], axis=-1)


def deinterleave(groups: np.ndarray, typ: str, N: int) -> np.ndarray:
    """The inverse: x8 groups -> the GGUF rows they came from (N, K/32*block bytes)."""
    G, nb, _ = groups.shape
    if typ == "Q4_1x8":
        d = groups[..., 0:16].reshape(G, nb, 8, 2)
        m = groups[..., 16:32].reshape(G, nb, 8, 2)
        qs = groups[..., 32:].reshape(G, nb, 4, 8, 4).transpose(0, 1, 3, 2, 4).reshape(G, nb, 8, 16)
        rows = np.concatenate([d, m, qs], axis=-1)
    elif typ == "Q8_0x8":
        d = groups[..., 0:16].reshape(G, nb, 8, 2)
        qs = groups[..., 16:].reshape(G, nb, 8, 8, 4).transpose(0, 1, 3, 2, 4).reshape(G, nb, 8, 32)
        rows = np.concatenate([d, qs], axis=-1)
    else:
        raise ValueError(f"not an interleaved type: {typ}")
    return rows.transpose(0, 2, 1, 3).reshape(G * 8, -1)[:N]
