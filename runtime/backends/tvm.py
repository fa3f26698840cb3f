"""TVM backend: a compiled Relax VM executable (models/tvm_model.py) with the weights and int8 KV cache on a GPU.

Board side needs only the TVM *runtime*: ``tvm_ffi`` (pip install apache-tvm-ffi) and TVM's
``libtvm_runtime.so`` + ``libtvm_runtime_cuda.so`` (found in an installed ``tvm`` package, or in the
directory $BOARDTALK_TVM_RUNTIME), never TVM's compiler. The artifact carries:
  tvm_weights.bin   the GGUF's Q4_1/Q8_0 blocks split into arrays (bytes unchanged), uploaded once
  tvm.json          its index: the architecture it was built for, each parameter's dtype, shape, offset
  model-<arch>.so   the executable, host code for <arch> (aarch64 on the board, x86_64 on a dev GPU
                    machine) with a fatbin of sm_87 SASS + compute_87 PTX (JIT on newer GPUs)
Before anything is loaded the backend checks what a CUDA artifact needs of this machine (driver,
CUDA 13 runtime, a GPU of compute capability >= the artifact's) and names what is missing.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import platform
import threading
from pathlib import Path

import numpy as np

from ..artifact import ArtifactError
from ..config import rope_tables
from ..kv_cache import KVCache

log = logging.getLogger(__name__)
INDEX_FORMAT = 1
INDEX_FILE = "tvm.json"
WEIGHTS_FILE = "tvm_weights.bin"
MAX_T = 256  # tokens per prefill call; longer calls are split
KDL_CPU, KDL_CUDA = 1, 2
POOLED_ALLOCATOR = 2
HINT = ("the tvm backend needs the TVM runtime: pip install apache-tvm-ffi, plus libtvm_runtime.so and "
        "libtvm_runtime_cuda.so (pip install 'apache-tvm==0.27.*', or their directory in $BOARDTALK_TVM_RUNTIME)")


def library_name(triple: str) -> str:
    return f"model-{triple.split('-')[0]}.so"


class TvmUnavailable(ImportError):
    """This machine lacks what the artifact needs (GPU, driver, CUDA runtime, TVM runtime): nothing a rebuild fixes."""


_RT: dict = {}


def _runtime_dir() -> Path:
    env = os.environ.get("BOARDTALK_TVM_RUNTIME")
    if env:
        return Path(env)
    import importlib.util

    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        raise TvmUnavailable(HINT)
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def _load_runtime(cuda: bool, cuda_major: int = 13):
    """tvm_ffi plus TVM's runtime libraries (once per process); raises TvmUnavailable naming what is missing.
    cuda_major: the CUDA runtime the artifact's TVM runtime links (the manifest's tvm.cuda_runtime_major)."""
    if _RT.get("cuda") or (_RT and not cuda):
        return _RT["ffi"]
    try:
        import tvm_ffi
    except ImportError:
        raise TvmUnavailable(HINT) from None
    d = _runtime_dir()
    rt = d / "libtvm_runtime.so"
    if not rt.is_file():
        raise TvmUnavailable(f"{rt} not found; {HINT}")
    if "ffi" not in _RT:
        ctypes.CDLL(str(rt), mode=ctypes.RTLD_GLOBAL)
        _RT["ffi"] = tvm_ffi
    if cuda:
        cudart = f"libcudart.so.{cuda_major}"
        for lib, what in (("libcuda.so.1", "the NVIDIA driver (libcuda.so.1) is not installed: this machine has no "
                                          "usable NVIDIA GPU"),
                          (cudart, f"the CUDA {cuda_major} runtime ({cudart}) is missing: the artifact was built with "
                                   f"CUDA {cuda_major} (docs/gpu.md says which JetPack runs it)")):
            try:
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                if lib == cudart and _preload_pip_cudart(cudart):
                    continue
                raise TvmUnavailable(f"cannot run a CUDA artifact here: {what}") from None
        try:
            ctypes.CDLL(str(d / "libtvm_runtime_cuda.so"), mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise TvmUnavailable(f"TVM's CUDA runtime did not load ({e}); {HINT}") from None
        _RT["cuda"] = True
    return _RT["ffi"]


def _preload_pip_cudart(name: str) -> bool:
    """libcudart.so.N from the nvidia-cuda-runtime wheel, if installed (it is not on the loader's path)."""
    import importlib.util

    for pkg in ("nvidia.cu13", "nvidia.cuda_runtime"):
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            continue
        for loc in (spec.submodule_search_locations or []) if spec else []:
            for p in Path(loc).rglob(name):
                ctypes.CDLL(str(p), mode=ctypes.RTLD_GLOBAL)
                return True
    return False


def check_gpu(ffi, cuda_arch: str) -> str:
    """The GPU's compute capability, after checking it can run code built for cuda_arch (sm_87: 8.7 SASS, or
    its compute_87 PTX by JIT on a newer GPU)."""
    attr = ffi.get_global_func("runtime.GetDeviceAttr")
    if not attr(KDL_CUDA, 0, 0):  # kExist
        raise TvmUnavailable("cannot run a CUDA artifact here: no CUDA GPU is visible (driver loaded, no device)")
    have = str(attr(KDL_CUDA, 0, 4))  # kComputeVersion, "8.7"
    need = cuda_arch.split("_")[1]
    hv, nv = tuple(map(int, have.split("."))), (int(need[:-1]), int(need[-1]))
    if hv < nv:
        raise ArtifactError(f"this GPU is compute capability {have}; the artifact is built for {cuda_arch} "
                             f"(needs >= {nv[0]}.{nv[1]}): rebuild for this board")
    if hv != nv:
        log.info("GPU compute capability %s: the artifact's compute_%s PTX is JIT-compiled (cached after the "
                 "first load)", have, need)
    return have


class TvmCache(KVCache):
    """One session's int8 KV cache on the device: per layer kv (R, 2*KVH, D) int8 and sc (R, 2*KVH) float32, R the
    artifact's cache rows (static shapes; the session uses the first max_seq), plus the session's own VM and the
    (1,) id and position buffers its decode steps read: a CUDA graph captured on the first decode step replays
    on exactly these buffers. ``kv`` and ``scale`` read back host copies of the first max_seq rows, layer-major
    (for tests and the context shift)."""

    def __init__(self, backend: "TvmBackend", max_seq: int):
        a = backend.cfg
        self.max_seq, self.n_kv_heads, self.layer_major = max_seq, a.n_kv_heads, True
        self.tokens = []
        self.owner = backend
        vm = backend.new_vm()
        self.prefill_fn = vm["prefill"]
        rows, kvh2 = backend.cache_rows, 2 * a.n_kv_heads
        self.kvs = [backend.empty((rows, kvh2, a.head_dim), "int8") for _ in range(a.n_layers)]
        self.scs = [backend.empty((rows, kvh2), "float32") for _ in range(a.n_layers)]
        zero = np.zeros((rows, kvh2), np.float32)
        for s in self.scs:
            backend.upload(s, zero)
        self.ids_t, self.pos_t = backend.empty((1,), "int32"), backend.empty((1,), "int32")  # a step's id, position
        # each decode function saved with all its arguments bound (every one a buffer of this session or the
        # model): a step passes nothing, so the ~430 arguments are converted once, not per token
        self.decode_fns = []
        for w in backend.windows:
            vm["save_function"](f"decode{w}", f"step{w}", 1, self.ids_t, self.pos_t, backend.cos, backend.sin,
                                self.kvs, self.scs, *backend.params)
            self.decode_fns.append((w, vm[f"step{w}"]))

    @property
    def kv(self) -> np.ndarray:
        a, rows = self.owner.cfg, self.owner.cache_rows
        return np.stack([self.owner.download(t, (rows, 2 * a.n_kv_heads, a.head_dim), np.int8)[: self.max_seq]
                         for t in self.kvs])

    @property
    def scale(self) -> np.ndarray:
        a, rows = self.owner.cfg, self.owner.cache_rows
        return np.stack([self.owner.download(t, (rows, 2 * a.n_kv_heads), np.float32)[: self.max_seq]
                         for t in self.scs])[..., None]

    def append(self, ids, kv, scale) -> None:
        raise ValueError("a tvm cache is written in place by its backend")

    def shift(self, keep: int, drop: int, rotate) -> None:
        """The base class's shift on host copies, then uploaded (a rare step: long chats only)."""
        host = KVCache.__new__(KVCache)
        host.max_seq, host.n_kv_heads, host.layer_major = self.max_seq, self.n_kv_heads, True
        host.kv, host.scale, host.tokens = self.kv, self.scale, list(self.tokens)
        KVCache.shift(host, keep, drop, rotate)
        pad = self.owner.cache_rows - self.max_seq
        for i, (k, s) in enumerate(zip(self.kvs, self.scs)):
            self.owner.upload(k, np.pad(host.kv[i], ((0, pad), (0, 0), (0, 0))))
            self.owner.upload(s, np.pad(host.scale[i, ..., 0], ((0, pad), (0, 0))))
        self.tokens = host.tokens

    def close(self) -> None:
        self.kvs, self.scs, self.prefill_fn, self.decode_fns = [], [], None, []


class TvmBackend:
    name = "tvm"
    kv_layout = "layer-major"

    def __init__(self, manifest, art_dir: Path, threads: int, provider: str = ""):
        self.cfg = arch = manifest.architecture
        self.threads = threads
        self.vocab = arch.vocab
        info = manifest.tvm or {}
        self.cuda_arch = info.get("cuda_arch")
        host = _host_triple()
        libs = info.get("libraries") or {}
        if host not in libs:
            raise ArtifactError(f"this artifact has host code for {', '.join(libs) or 'nothing'}, not for this "
                                 f"{host} machine: rebuild it for this board")
        ffi = _load_runtime(cuda=bool(self.cuda_arch), cuda_major=int(info.get("cuda_runtime_major") or 13))
        self.ffi = ffi
        # One GPU step at a time: the device runs them one after another anyway, and a CUDA graph being captured
        # for one session must not see another thread's copies (cudaStreamCaptureModeGlobal forbids them).
        self._gpu_lock = threading.Lock() if self.cuda_arch else None
        if self.cuda_arch:
            self.gpu = check_gpu(ffi, self.cuda_arch)
            self.dev = ffi.device("cuda", 0)
        else:
            self.gpu = None
            self.dev = ffi.device("cpu", 0)
        meta = self._read_index(art_dir / manifest.graph_index, manifest)
        self._alloc = ffi.get_global_func("runtime.TVMTensorAllocWithScope")
        self._from = ffi.get_global_func("runtime.TVMTensorCopyFromBytes")
        self._to = ffi.get_global_func("runtime.TVMTensorCopyToBytes")
        self._sync = ffi.get_global_func("runtime.Device_StreamSync", allow_missing=True)
        data = np.memmap(art_dir / manifest.graph_file, dtype=np.uint8, mode="r")
        self.params = []
        for name, dtype, shape, off, nbytes in meta["params"]:
            if off < 0 or off + nbytes > data.size or nbytes != int(np.prod(shape)) * np.dtype(dtype).itemsize:
                raise ArtifactError(f"{INDEX_FILE}: {name} does not fit {manifest.graph_file}")
            t = self.empty(shape, dtype)
            self.upload(t, data[off : off + nbytes])
            self.params.append(t)
        del data
        try:
            self.lib = ffi.load_module(str(art_dir / libs[host]))
            vm = self.new_vm()  # the CUDA module loads here (the PTX JIT on a GPU newer than the artifact's arch)
        except Exception as e:  # noqa: BLE001 - TVM raises its own error types
            raise TvmUnavailable(f"{libs[host]}: TVM cannot load it ({(str(e).splitlines() or [''])[0][:200]})") from None
        windows = info.get("decode_windows")
        if not (isinstance(windows, list) and windows and all(isinstance(w, int) and not isinstance(w, bool)
                                                                for w in windows) and windows == sorted(set(windows))):
            raise ArtifactError(f"manifest tvm.decode_windows {windows!r:.60} is not an ascending list of ints")
        for name in ["prefill"] + [f"decode{w}" for w in windows]:
            try:
                vm[name]
            except Exception:  # noqa: BLE001 - a function the library does not have
                raise ArtifactError(f"{libs[host]} has no function {name}: the manifest was edited or belongs to "
                                    "another artifact") from None
        self.max_seq = manifest.max_context
        self.cache_rows, self.windows = info.get("cache_rows"), info.get("decode_windows")
        if self.cache_rows != self.max_seq or not self.windows or self.windows[-1] != self.cache_rows:
            raise ArtifactError(f"manifest tvm.cache_rows {self.cache_rows} / decode_windows {self.windows} do not "
                                f"match max_context {self.max_seq}")
        cos, sin = rope_tables(arch, self.max_seq)
        self.cos, self.sin = self.empty(cos.shape, "float32"), self.empty(sin.shape, "float32")
        self.upload(self.cos, cos)
        self.upload(self.sin, sin)
        log.info("tvm backend: %s (%s), %d parameters", "CUDA " + (self.gpu or "") if self.cuda_arch else "CPU",
                 libs[host], len(self.params))

    def _read_index(self, path: Path, manifest) -> dict:
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ArtifactError(f"{path.name}: not readable JSON ({e})") from None
        if not isinstance(meta, dict) or meta.get("format") != INDEX_FORMAT or meta.get("file") != manifest.graph_file:
            raise ArtifactError(f"{path.name}: format {meta.get('format') if isinstance(meta, dict) else '?'}; this "
                                f"runtime reads format {INDEX_FORMAT}: rebuild the artifact with this boardtalk")
        if meta.get("architecture") != self.cfg.to_dict():
            raise ArtifactError(f"manifest architecture does not match {path.name}'s; the manifest was edited or "
                                "belongs to another artifact")
        params = meta.get("params")
        if not isinstance(params, list) or len(params) != 3 + 14 * self.cfg.n_layers:
            raise ArtifactError(f"{path.name}: parameter table does not match the architecture")
        return meta

    def new_vm(self):
        """A Relax VM over the executable: one per session (a VM's registers are its run state, so two
        sessions never share one and can run in two threads)."""
        vm = self.lib["vm_load_executable"]()
        init = [KDL_CUDA, 0, POOLED_ALLOCATOR] if self.cuda_arch else []
        vm["vm_initialization"](*init, KDL_CPU, 0, POOLED_ALLOCATOR)
        return vm

    # ---- device helpers -----------------------------------------------------------------------------
    def empty(self, shape, dtype: str):
        return self._alloc(self.ffi.Shape([int(x) for x in shape]), self.ffi.dtype(dtype), self.dev, None)

    def upload(self, t, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr)
        self._from(t, arr.ctypes.data_as(ctypes.c_void_p), arr.nbytes)

    def download(self, t, shape, dtype) -> np.ndarray:
        out = np.empty(shape, dtype)
        self._to(t, out.ctypes.data_as(ctypes.c_void_p), out.nbytes)
        return out

    # ---- contract -----------------------------------------------------------------------------------
    def new_cache(self, max_seq: int) -> TvmCache:
        if not 1 <= max_seq <= self.max_seq:
            raise ValueError(f"context {max_seq} is outside [1, {self.max_seq}] (the artifact's RoPE tables)")
        return TvmCache(self, max_seq)

    def forward(self, cache: TvmCache, ids: np.ndarray, logits_from: int) -> np.ndarray:
        if getattr(cache, "owner", None) is not self or not cache.kvs:
            raise ValueError("this cache belongs to another backend or was closed")
        start, T = len(cache), int(ids.shape[0])
        if start + T > cache.max_seq:
            raise ValueError(f"{start} cached + {T} new positions exceed the cache's {cache.max_seq}")
        if self._gpu_lock is not None:
            with self._gpu_lock:
                out = self._forward(cache, ids, logits_from, start, T)
        else:
            out = self._forward(cache, ids, logits_from, start, T)
        cache.tokens.extend(int(i) for i in ids)
        return out

    def _forward(self, cache: TvmCache, ids: np.ndarray, logits_from: int, start: int, T: int) -> np.ndarray:
        out = np.empty((T - logits_from, self.vocab), np.float32)
        ids32 = np.ascontiguousarray(ids, np.int32)
        c0 = 0
        while c0 < T:
            c1 = min(T, c0 + MAX_T)
            if c1 - c0 == 1:  # a decode step: one captured CUDA graph (GPU)
                pos = start + c0
                fn = next(f for w, f in cache.decode_fns if w > pos)
                self.upload(cache.ids_t, ids32[c0:c1])
                self.upload(cache.pos_t, np.array([pos], np.int32))
                res = fn()
                if c0 >= logits_from:
                    out[c0 - logits_from] = self.download(res[0], (1, self.vocab), np.float32)[0]
            else:
                lf = max(logits_from - c0, 0)
                wanted = c1 - 1 >= logits_from
                rows = np.arange(lf, c1 - c0, dtype=np.int32) if wanted else np.array([c1 - c0 - 1], np.int32)
                ids_t, rows_t = self.empty((c1 - c0,), "int32"), self.empty((len(rows),), "int32")
                self.upload(ids_t, ids32[c0:c1])
                self.upload(rows_t, rows)
                res = cache.prefill_fn(ids_t, rows_t, self.cos, self.sin, cache.kvs, cache.scs,
                                       self.ffi.Shape([start + c0]), *self.params)
                if wanted:
                    out[c0 + lf - logits_from : c1 - logits_from] = self.download(res[0], (len(rows), self.vocab),
                                                                                   np.float32)
            c0 = c1
        return out

    def rewind(self, cache: KVCache, n: int) -> None:
        cache.rewind_to(n)

    def close(self) -> None:
        self.params, self.lib = [], None


def _host_triple() -> str:
    m = platform.machine().lower()
    return {"x86_64": "x86_64-linux-gnu", "amd64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu",
            "arm64": "aarch64-linux-gnu"}.get(m, m)
