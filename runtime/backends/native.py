"""Native backend: one C call per forward pass over the GGUF's Q4_1/Q8_0 blocks (runtime/native/bt_native.c).

The artifact carries ``weights.bin`` (memory-mapped; the GGUF's blocks regrouped 8 rows at a
time, never re-rounded: models/quant.py ``interleave_*``) and ``native.json``, the byte offset
and type of every tensor in it. K/V are written straight into the runtime's int8 cache.
"""
from __future__ import annotations

import ctypes
import json
import logging
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)
MAX_T = 128  # tokens per native call (scratch ~4 MB); longer calls are split, at no measurable cost


class _Config(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn", "vocab",
                                               "max_seq")] + [("norm_eps", ctypes.c_float), ("q_scale", ctypes.c_float),
                                                              ("kv_layer_major", ctypes.c_int32)]


class _Weights(ctypes.Structure):
    _fields_ = [("tok_embd", ctypes.c_void_p), ("output_norm", ctypes.c_void_p), ("rope_cos", ctypes.c_void_p),
                ("rope_sin", ctypes.c_void_p)] + [(n, ctypes.POINTER(ctypes.c_void_p)) for n in (
                    "attn_norm", "ffn_norm", "wq", "wk", "wv", "wo", "wgate", "wup", "wdown")]


LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")  # _Weights order
INDEX_FORMAT = 2  # native.json: 1 indexed a copied GGUF; 2 indexes weights.bin with 8-row groups
WEIGHTS_FILE = "weights.bin"
SOURCE_TYPE = {"Q4_1x8": "Q4_1", "Q8_0x8": "Q8_0", "F32": "F32"}  # the GGUF type each is made from


def tensor_bytes(typ: str, rows: int, cols: int) -> int:
    if typ == "F32":
        return rows * cols * 4
    from models.quant import X8_BYTES

    return -(-rows // 8) * (cols // 32) * X8_BYTES[typ]


def tensor_spec(arch: dict) -> dict[str, tuple[str, int, int]]:
    """Every tensor the C code reads: name -> (GGUF type, rows, cols). The builder checks a GGUF against
    it; the loader checks the artifact's index against it before handing pointers to C."""
    C, F, V = int(arch["hidden"]), int(arch["ffn"]), int(arch["vocab"])
    HD, KD = int(arch["n_heads"]) * int(arch["head_dim"]), int(arch["n_kv_heads"]) * int(arch["head_dim"])
    shapes = {"attn_q": (HD, C), "attn_k": (KD, C), "attn_v": (KD, C), "attn_output": (C, HD), "ffn_gate": (F, C),
              "ffn_up": (F, C), "ffn_down": (C, F)}
    spec = {"token_embd.weight": ("Q8_0x8", V, C), "output_norm.weight": ("F32", 1, C)}
    for i in range(int(arch["n_layers"])):
        spec.update({f"blk.{i}.{n}.weight": ("F32", 1, C) for n in ("attn_norm", "ffn_norm")})
        spec.update({f"blk.{i}.{n}.weight": ("Q4_1x8",) + shapes[n] for n in LINEARS})
    if any(shapes[n][0] % 8 for n in ("attn_q", "attn_k", "ffn_gate")):  # the C code stacks QKV and gate|up by groups
        raise ValueError(f"native backend: q, k and gate widths must be multiples of 8, got {shapes}")
    return spec


class NativeBackend:
    kv_layer_major = True  # attention streams one layer's positions: they must be contiguous

    def __init__(self, weights: Path, index: Path, arch: dict, max_seq: int, threads: int):
        from runtime.native import library

        meta = json.loads(index.read_text(encoding="utf-8"))
        if not isinstance(meta, dict) or meta.get("format") != INDEX_FORMAT or meta.get("file") != weights.name:
            found = meta.get("format", 1) if isinstance(meta, dict) else "?"
            raise ValueError(f"native.json: format {found} for {weights.name}; this runtime reads format {INDEX_FORMAT} "
                             f"({WEIGHTS_FILE}): rebuild the artifact with this boardtalk")
        tensors = meta["tensors"]
        self.lib = library()
        self.threads = threads
        self.vocab = int(arch["vocab"])
        self.data = np.memmap(weights, dtype=np.uint8, mode="r")
        base = self.data.ctypes.data
        L = int(arch["n_layers"])

        spec = tensor_spec(arch)

        def ptr(name: str) -> int:
            """Address of a tensor, after checking it is where, what and as large as the C code will read."""
            if name not in tensors:
                raise ValueError(f"native.json: no tensor {name}")
            off, nbytes, typ = tensors[name]
            want, rows, cols = spec[name]
            need = tensor_bytes(want, rows, cols)
            if typ != want or nbytes != need or off < 0 or off + nbytes > self.data.size:
                raise ValueError(f"native.json: {name} is {typ}, {nbytes} bytes at {off}; expected {want}, {need} bytes "
                                 f"inside the {self.data.size}-byte {weights.name}")
            return base + off

        self.cfg = _Config(L, arch["hidden"], arch["n_heads"], arch["n_kv_heads"], arch["head_dim"], arch["ffn"],
                           self.vocab, max_seq, arch["norm_eps"], 1.0 / np.sqrt(arch["head_dim"]), 1)
        from models.arch import LlamaConfig, rope_tables  # the same tables as the ONNX graph

        self.cos, self.sin = rope_tables(LlamaConfig.from_dict(arch), max_seq)
        self._keep = []

        def layer_ptrs(what: str):
            arr = (ctypes.c_void_p * L)(*[ptr(f"blk.{i}.{what}.weight") for i in range(L)])
            self._keep.append(arr)
            return ctypes.cast(arr, ctypes.POINTER(ctypes.c_void_p))

        self.w = _Weights(ptr("token_embd.weight"), ptr("output_norm.weight"), self.cos.ctypes.data, self.sin.ctypes.data,
                          layer_ptrs("attn_norm"), layer_ptrs("ffn_norm"), *[layer_ptrs(t) for t in LINEARS])
        self.scratch = self.lib.bt_scratch_new(ctypes.byref(self.cfg), MAX_T)
        if not self.scratch:
            raise MemoryError("native backend: could not allocate scratch buffers")
        log.info("native backend: %s kernels, %d threads", self.lib.bt_simd().decode(), threads)

    def __del__(self):
        if getattr(self, "scratch", None):
            self.lib.bt_scratch_free(self.scratch)
            self.scratch = None

    PHASES = ("qkv", "attention", "o_proj", "gate_up", "down", "lm_head", "other")

    def profile(self, enable: bool = True) -> dict[str, float]:
        """Seconds per phase of the forward passes since the last call (timers on while enabled)."""
        out = np.zeros(len(self.PHASES), np.float64)
        self.lib.bt_profile(int(enable), out.ctypes.data)
        return dict(zip(self.PHASES, out.tolist()))

    def forward(self, ids: np.ndarray, start: int, kv: np.ndarray, scale: np.ndarray, logits_from: int):
        """Writes the K/V of ids into kv/scale positions [start, start+T) in place (layer-major cache);
        returns (logits, views of those positions)."""
        T = int(ids.shape[0])
        out = np.empty((T - logits_from, self.vocab), np.float32)
        ids = np.ascontiguousarray(ids, np.int64)
        for c0 in range(0, T, MAX_T):
            c1 = min(T, c0 + MAX_T)
            if c1 - 1 < logits_from:
                lf, dst = -1, out  # no logits wanted from this chunk: the output layer is skipped
            else:
                lf = max(logits_from - c0, 0)
                dst = out[c0 + lf - logits_from : c1 - logits_from]
            rc = self.lib.bt_forward(ctypes.byref(self.cfg), ctypes.byref(self.w), self.scratch, ids[c0:c1].ctypes.data,
                                     c1 - c0, start + c0, kv.ctypes.data, scale.ctypes.data, dst.ctypes.data, lf,
                                     self.threads)
            if rc:
                raise RuntimeError(f"native forward failed (code {rc}) at positions {start + c0}..{start + c1 - 1}")
        return out, kv[:, start : start + T], scale[:, start : start + T]
