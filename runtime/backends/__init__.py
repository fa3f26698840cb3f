"""The backend contract and the one registry of backends.

A backend runs the model's forward pass over an int8 KV cache that it allocates and owns (a CUDA
backend would keep it in device memory). The session drives it; nothing else touches the cache.

    backend = open_backend(manifest, art_dir, threads=2, provider="CPUExecutionProvider")
    cache = backend.new_cache(max_seq)           # one per session, with any per-session run state
    logits = backend.forward(cache, ids, logits_from)
        # ids (T,) int64 go at positions [len(cache), len(cache) + T); their K/V are written into
        # the cache and the ids appended to cache.tokens; returns logits (T - logits_from, vocab)
        # float32 of ids[logits_from:] (logits_from = T - 1: the last one only)
    backend.rewind(cache, n)                     # forget positions >= n (prefix reuse)
    cache.close(); backend.close()               # free run state now, not at garbage collection

Adding a backend (TVM, an NPU) is a new module here with a class implementing ``Backend`` and
a constructor ``(manifest, art_dir, threads, provider)``, plus one ``BackendInfo`` line in
``BACKENDS``. docs/backends.md says what each method must guarantee.
"""
from __future__ import annotations

import importlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ..kv_cache import KVCache


class Backend(Protocol):
    name: str
    kv_layout: str  # "layer-major" (L, max_seq, 2*KVH, D) or "token-major" (max_seq, L, 2*KVH, D)
    threads: int

    def new_cache(self, max_seq: int) -> KVCache: ...

    def forward(self, cache: KVCache, ids: np.ndarray, logits_from: int) -> np.ndarray: ...

    def rewind(self, cache: KVCache, n: int) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class BackendInfo:
    name: str
    module: str  # runtime.backends.<module>
    cls: str
    kv_layout: str
    description: str
    needs: str  # what a board must have installed, for error messages

    def open(self, manifest, art_dir: Path, threads: int, provider: str) -> Backend:
        try:
            mod = importlib.import_module(f"{__name__}.{self.module}")
        except ImportError as e:
            raise ImportError(f"the {self.name} backend needs {self.needs} ({e})") from e
        return getattr(mod, self.cls)(manifest, Path(art_dir), threads, provider)


BACKENDS: dict[str, BackendInfo] = {
    "native": BackendInfo("native", "native", "NativeBackend", "layer-major",
                          "C kernels over the GGUF's own Q4_1/Q8_0 blocks, shipped in the artifact for the board's "
                          "CPU (fastest, least memory)", "only numpy (its kernels travel in the artifact)"),
    "onnxruntime": BackendInfo("onnxruntime", "onnxruntime", "OrtBackend", "token-major",
                               "one portable INT4 ONNX graph (MatMulNBits); the route to other execution providers",
                               "onnxruntime (pip install onnxruntime)"),
    "tvm": BackendInfo("tvm", "tvm", "TvmBackend", "layer-major", "a TVM Relax executable for the board's GPU (CUDA sm_87 "
                       "fatbin + compute_87 PTX), weights and int8 KV cache on the GPU",
                       "the TVM runtime (pip install apache-tvm-ffi + libtvm_runtime*.so; docs/gpu.md)"),
}
DEFAULT_BACKEND = "native"


def open_backend(manifest, art_dir, *, threads: int, provider: str) -> Backend:
    info = BACKENDS.get(manifest.backend)
    if info is None:  # parse_manifest already refuses unknown names; this guards direct callers
        raise ValueError(f"backend {manifest.backend!r} is not in this runtime (known: {', '.join(BACKENDS)})")
    return info.open(manifest, art_dir, threads, provider)


def default_backend() -> str:
    """The backend the CLI builds its default artifact with: native where its kernels can be compiled
    for this machine (a C compiler is present), else the portable onnxruntime graph."""
    import os

    if os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"):
        return DEFAULT_BACKEND
    return "onnxruntime"
