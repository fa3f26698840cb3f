"""Native backend: one C call per forward pass over the GGUF's Q4_1/Q8_0 blocks (runtime/native/bt_native.c).

The artifact carries ``weights.bin`` (memory-mapped; the GGUF's blocks regrouped 8 rows at a
time, never re-rounded: models/quant.py ``interleave_*``), its index (``native.json``: the
architecture it was built for and every tensor's offset, size and type) and the kernel library
compiled for the target CPU. Before a pointer reaches C, the index must describe exactly the
tensors the manifest's architecture implies, each inside the weights file, and the file must end
where the last tensor does. K/V are written by C straight into the session's int8 cache.
"""
from __future__ import annotations

import ctypes
import json
import logging
from pathlib import Path

import numpy as np

from ..artifact import ArtifactError
from ..config import ModelConfig, rope_tables
from ..kv_cache import KVCache

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
INDEX_FORMAT = 3  # native.json: 2 indexed weights.bin; 3 adds the architecture it was built for
WEIGHTS_FILE = "weights.bin"
INDEX_FILE = "native.json"
ALIGN = 64  # every tensor starts on a 64-byte boundary of weights.bin
SOURCE_TYPE = {"Q4_1x8": "Q4_1", "Q8_0x8": "Q8_0", "F32": "F32"}  # the GGUF type each is made from
X8_BYTES = {"Q4_1x8": 8 * 20, "Q8_0x8": 8 * 34}  # bytes of one 8-row group of one 32-column block


def tensor_bytes(typ: str, rows: int, cols: int) -> int:
    if typ == "F32":
        return rows * cols * 4
    return -(-rows // 8) * (cols // 32) * X8_BYTES[typ]


def tensor_spec(arch: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Every tensor the C code reads: name -> (type, rows, cols). The builder checks a GGUF against
    it; the loader checks the artifact's index against it before handing pointers to C."""
    C, F, V = arch.hidden, arch.ffn, arch.vocab
    HD, KD = arch.n_heads * arch.head_dim, arch.n_kv_heads * arch.head_dim
    shapes = {"attn_q": (HD, C), "attn_k": (KD, C), "attn_v": (KD, C), "attn_output": (C, HD), "ffn_gate": (F, C),
              "ffn_up": (F, C), "ffn_down": (C, F)}
    if any(w % 32 for w in (C, F, HD)):
        raise ValueError(f"native backend: hidden, ffn and heads x head_dim must be multiples of 32, got {C}, {F}, {HD}")
    if any(shapes[n][0] % 8 for n in ("attn_q", "attn_k", "ffn_gate")):  # the C code stacks QKV and gate|up by groups
        raise ValueError(f"native backend: q, k and gate widths must be multiples of 8, got {shapes}")
    spec = {"token_embd.weight": ("Q8_0x8", V, C), "output_norm.weight": ("F32", 1, C)}
    for i in range(arch.n_layers):
        spec.update({f"blk.{i}.{n}.weight": ("F32", 1, C) for n in ("attn_norm", "ffn_norm")})
        spec.update({f"blk.{i}.{n}.weight": ("Q4_1x8",) + shapes[n] for n in LINEARS})
    return spec


class NativeCache(KVCache):
    """A session's layer-major int8 cache plus its C run state (scratch sized for the backend's threads,
    phase timers): two sessions never share either, so they can run in two threads at once."""

    def __init__(self, backend: "NativeBackend", max_seq: int):
        a = backend.cfg
        super().__init__(max_seq, a.n_layers, a.n_kv_heads, a.head_dim, layer_major=True)
        self._lib = backend.lib
        self.owner = backend
        self.ccfg = _Config(a.n_layers, a.hidden, a.n_heads, a.n_kv_heads, a.head_dim, a.ffn, a.vocab, max_seq,
                            a.norm_eps, 1.0 / np.sqrt(a.head_dim), 1)
        self.scratch = self._lib.bt_scratch_new(ctypes.byref(self.ccfg), MAX_T, backend.threads)
        if not self.scratch:
            raise MemoryError(f"native backend: could not allocate scratch for {backend.threads} threads, "
                              f"context {max_seq}")

    def close(self) -> None:
        if getattr(self, "scratch", None):
            self._lib.bt_scratch_free(self.scratch)
            self.scratch = None

    __del__ = close

    PHASES = ("qkv", "attention", "o_proj", "gate_up", "down", "lm_head", "other")

    def profile(self, enable: bool = True) -> dict[str, float]:
        """Seconds per phase of this session's forward passes since the last call (timers on while enabled)."""
        out = np.zeros(len(self.PHASES), np.float64)
        self._lib.bt_profile(self.scratch, int(enable), out.ctypes.data)
        return dict(zip(self.PHASES, out.tolist()))


class NativeBackend:
    name = "native"
    kv_layout = "layer-major"  # attention streams one layer's positions: they must be contiguous

    def __init__(self, manifest, art_dir: Path, threads: int, provider: str = ""):
        from ..native import check_cpu, load_library

        self.cfg = arch = manifest.architecture
        self.threads = threads
        self.vocab = arch.vocab
        weights, index = art_dir / manifest.graph_file, art_dir / manifest.graph_index
        try:
            meta = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ArtifactError(f"{index.name}: not readable JSON ({e})") from None
        if not isinstance(meta, dict) or meta.get("format") != INDEX_FORMAT or meta.get("file") != weights.name:
            found = meta.get("format", "?") if isinstance(meta, dict) else "?"
            raise ArtifactError(f"{index.name}: format {found} for {weights.name}; this runtime reads format "
                                f"{INDEX_FORMAT}: rebuild the artifact with this boardtalk")
        if meta.get("architecture") != arch.to_dict():
            raise ArtifactError(f"manifest architecture does not match {index.name}'s "
                                f"({_diff(meta.get('architecture'), arch.to_dict())}); the manifest was edited or "
                                "belongs to another artifact")
        self.data = np.memmap(weights, dtype=np.uint8, mode="r")
        self._check_index(meta.get("tensors"), tensor_spec(arch), weights.name)
        kern = manifest.kernels
        check_cpu(kern.cpu_features, kern.file, manifest.target.board)
        self.lib = load_library(art_dir / kern.file)
        self.cos, self.sin = rope_tables(arch, manifest.max_context)
        base, tensors, L = self.data.ctypes.data, meta["tensors"], arch.n_layers
        self._keep = []

        def layer_ptrs(what: str):
            arr = (ctypes.c_void_p * L)(*[base + tensors[f"blk.{i}.{what}.weight"][0] for i in range(L)])
            self._keep.append(arr)
            return ctypes.cast(arr, ctypes.POINTER(ctypes.c_void_p))

        self.w = _Weights(base + tensors["token_embd.weight"][0], base + tensors["output_norm.weight"][0],
                          self.cos.ctypes.data, self.sin.ctypes.data, layer_ptrs("attn_norm"), layer_ptrs("ffn_norm"),
                          *[layer_ptrs(t) for t in LINEARS])
        self.max_seq = manifest.max_context
        log.info("native backend: %s kernels (%s), %d threads", self.lib.bt_simd().decode(), kern.file, threads)

    def _check_index(self, tensors, spec: dict, fname: str) -> None:
        """The index lists exactly the spec's tensors, each where, what and as large as C will read, and the
        weights file ends where they do: an index or manifest that disagrees never yields a pointer."""
        if not isinstance(tensors, dict):
            raise ArtifactError(f"{INDEX_FILE}: no tensor table")
        extra, missing = sorted(set(tensors) - set(spec)), sorted(set(spec) - set(tensors))
        if extra or missing:
            raise ArtifactError(f"{INDEX_FILE} does not match the manifest's architecture: "
                                f"{len(missing)} tensors missing ({', '.join(missing[:3])}), "
                                f"{len(extra)} unexpected ({', '.join(extra[:3])})")
        end = 0
        for name, (want, rows, cols) in spec.items():
            entry = tensors[name]
            if not (isinstance(entry, list) and len(entry) == 3 and all(isinstance(x, int) for x in entry[:2])):
                raise ArtifactError(f"{INDEX_FILE}: {name} entry is malformed: {entry!r:.60}")
            off, nbytes, typ = entry
            need = tensor_bytes(want, rows, cols)
            if typ != want or nbytes != need or off < 0 or off % ALIGN or off + nbytes > self.data.size:
                raise ArtifactError(f"{INDEX_FILE}: {name} is {typ}, {nbytes} bytes at {off}; expected {want}, {need} "
                                    f"bytes, {ALIGN}-byte aligned inside the {self.data.size}-byte {fname}")
            end = max(end, off + nbytes)
        if end != self.data.size:
            raise ArtifactError(f"{fname} is {self.data.size} bytes but its tensors end at {end}")

    def new_cache(self, max_seq: int) -> NativeCache:
        if not 1 <= max_seq <= self.max_seq:
            raise ValueError(f"context {max_seq} is outside [1, {self.max_seq}] (the artifact's RoPE tables)")
        return NativeCache(self, max_seq)

    def forward(self, cache: NativeCache, ids: np.ndarray, logits_from: int) -> np.ndarray:
        """Writes the K/V of ids into the cache at positions [len(cache), +T) in place; returns their logits
        from logits_from on."""
        if cache.owner is not self or not cache.scratch:
            raise ValueError("this cache belongs to another backend or was closed")
        start, T = len(cache), int(ids.shape[0])
        if start + T > cache.max_seq:
            raise ValueError(f"{start} cached + {T} new positions exceed the cache's {cache.max_seq}")
        out = np.empty((T - logits_from, self.vocab), np.float32)
        ids = np.ascontiguousarray(ids, np.int64)
        for c0 in range(0, T, MAX_T):
            c1 = min(T, c0 + MAX_T)
            if c1 - 1 < logits_from:
                lf, dst = -1, out  # no logits wanted from this chunk: the output layer is skipped
            else:
                lf = max(logits_from - c0, 0)
                dst = out[c0 + lf - logits_from : c1 - logits_from]
            rc = self.lib.bt_forward(ctypes.byref(cache.ccfg), ctypes.byref(self.w), cache.scratch,
                                     ids[c0:c1].ctypes.data, c1 - c0, start + c0, cache.kv.ctypes.data,
                                     cache.scale.ctypes.data, dst.ctypes.data, lf)
            if rc:
                raise RuntimeError(f"native forward failed (code {rc}) at positions {start + c0}..{start + c1 - 1}")
        cache.tokens.extend(int(i) for i in ids)
        return out

    def rewind(self, cache: KVCache, n: int) -> None:
        cache.rewind_to(n)

    def close(self) -> None:
        """Drop the weights mapping (sessions must be closed first: Model.close does that)."""
        self.w = None
        self._keep = []
        self.data = None


def _diff(a, b) -> str:
    if not isinstance(a, dict):
        return "the index records none: rebuild the artifact with this boardtalk"
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return ", ".join(f"{k}: manifest {b.get(k)!r}, index {a.get(k)!r}" for k in keys[:4])
