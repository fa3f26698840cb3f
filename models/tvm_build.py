"""Compile the Relax model (models/tvm_model.py) for a board and write the tvm backend's files.

    files, graph_info, tvm_fields, report = build_tvm_files(src, out_dir, profile)

CUDA boards (Jetson Orin, sm_87): the device code is one fatbin per library with sm_87 SASS **and**
compute_87 PTX (``nvcc -gencode arch=compute_87,code=[sm_87,compute_87]``), so the same artifact also
runs on newer GPUs through the driver's PTX JIT. The host code is built twice, for the board's CPU
(aarch64) and for x86_64 (a development machine with a GPU, where the artifact is proven): the loader
picks the library of the machine it runs on. On a build machine without an NVIDIA driver, TVM's CUDA
runtime library cannot load and its codegen would silently embed CUDA C instead of a fatbin: a stub
``libcuda.so.1`` (compiled here, every entry returns "no device") is loaded first, at build time only.
Other boards get an LLVM (CPU) build: slow, meant for tests of the backend on machines without a GPU.

Weights: the GGUF's blocks split into arrays, bytes unchanged (see models/tvm_model.py), in one file
``tvm_weights.bin`` with its index ``tvm.json`` (architecture, parameter order, dtype, shape, offset).
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

NVCC = os.environ.get("BOARDTALK_NVCC") or shutil.which("nvcc") or "/usr/local/cuda-13.0/bin/nvcc"
INSTALL_HINT = "pip install 'boardtalk[tvm]' (apache-tvm 0.27)"
STUB_SYMBOLS = ("cuDeviceGetName", "cuFuncSetAttribute", "cuGetErrorName", "cuGetErrorString", "cuLaunchKernelEx",
                "cuModuleGetFunction", "cuModuleLoadData", "cuModuleUnload", "cuTensorMapEncodeTiled")
HOSTS = {"aarch64-linux-gnu": ("aarch64-linux-gnu-gcc", {"mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a78"}),
         "x86_64-linux-gnu": ("gcc", {"mtriple": "x86_64-linux-gnu"})}


class TvmBuildError(RuntimeError):
    pass


def _cuda_home() -> Path:
    return Path(NVCC).resolve().parent.parent


def _prepare_cuda_runtime() -> None:
    """Make TVM's CUDA runtime library loadable before ``import tvm`` (which loads it once): the real
    driver if present, else a build-time stub libcuda.so.1; and libcudart.so.13 from the toolkit."""
    if "tvm" in sys.modules:
        return
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        stub_dir = Path(tempfile.mkdtemp(prefix="boardtalk-cudastub-"))
        src = stub_dir / "stub.c"
        src.write_text("".join(f"int {s}(void) {{ return 100; }}\n" for s in STUB_SYMBOLS))
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(stub_dir / "libcuda.so.1"), "-Wl,-soname,libcuda.so.1",
                        str(src)], check=True, capture_output=True)
        ctypes.CDLL(str(stub_dir / "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)
        log.info("no NVIDIA driver here: build-time stub libcuda.so.1 in %s", stub_dir)
    for d in ("lib64", "lib"):
        p = _cuda_home() / d / "libcudart.so.13"
        if p.exists():
            ctypes.CDLL(str(p), mode=ctypes.RTLD_GLOBAL)
            break


def _tvm():
    _prepare_cuda_runtime()
    try:
        import tvm
    except ImportError as e:
        raise ImportError(f"building for the tvm backend needs TVM: {INSTALL_HINT}") from e
    return tvm


def nvcc_version() -> tuple[int, int]:
    out = subprocess.run([NVCC, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise TvmBuildError(f"cannot read the CUDA version from {NVCC} --version")
    return int(m.group(1)), int(m.group(2))


def _register_nvcc(arch: str, record: dict) -> None:
    """TVM calls tvm_callback_cuda_compile for each module's CUDA source: compile it into a fatbin with
    SASS for ``arch`` and PTX of the same compute capability (JIT on newer GPUs). No --use_fast_math:
    exp, division and rounding stay IEEE, as on the CPU backends."""
    import tvm_ffi

    cc = arch.split("_")[1]

    def compile_cuda(code):
        with tempfile.TemporaryDirectory(prefix="boardtalk-nvcc-") as tmp:
            cu = Path(tmp) / "k.cu"
            cu.write_text(code)
            base = [NVCC, "-O3", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "--expt-relaxed-constexpr"]
            r = subprocess.run(base + ["--ptx", f"-arch=compute_{cc}", "-o", str(Path(tmp) / "k.ptx"), str(cu)],
                               capture_output=True, text=True)
            if r.returncode:
                raise TvmBuildError(f"nvcc failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
            m = re.search(r"^\.version\s+(\S+)", (Path(tmp) / "k.ptx").read_text(), re.M)
            record["ptx_isa"] = m.group(1) if m else "?"
            r = subprocess.run(base + ["--fatbin", "-gencode", f"arch=compute_{cc},code=[sm_{cc},compute_{cc}]",
                                       "-o", str(Path(tmp) / "k.fatbin"), str(cu)], capture_output=True, text=True)
            if r.returncode:
                raise TvmBuildError(f"nvcc failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
            data = (Path(tmp) / "k.fatbin").read_bytes()
            if os.environ.get("BOARDTALK_KEEP_FATBIN"):  # for inspection (cuobjdump --list-elf --list-ptx)
                shutil.copy(Path(tmp) / "k.fatbin", os.environ["BOARDTALK_KEEP_FATBIN"])
            record["fatbin_bytes"] = record.get("fatbin_bytes", 0) + len(data)
            return bytearray(data)

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", compile_cuda, override=True)


def compile_library(dims, out: Path, *, cuda_arch: str | None, host: str, max_ctx: int,
                    use_cuda_graph: bool = True) -> dict:
    """Compile the model into out (a shared library holding the Relax VM executable); returns facts."""
    tvm = _tvm()
    from tvm import relax

    from .tvm_model import build_ir, windows_for

    if host not in HOSTS:
        raise TvmBuildError(f"tvm backend: no host toolchain for {host} (known: {', '.join(HOSTS)})")
    cc, host_target = HOSTS[host]
    if not shutil.which(cc):
        raise TvmBuildError(f"tvm backend: {cc} is needed to link the {host} host code "
                            f"({'apt install gcc-aarch64-linux-gnu' if 'aarch64' in host else 'apt install gcc'})")
    facts: dict = {}
    if cuda_arch:
        if not Path(NVCC).exists():
            raise TvmBuildError(f"tvm backend: nvcc not found ({NVCC}); install the CUDA toolkit or set BOARDTALK_NVCC")
        if not tvm.runtime.enabled("cuda"):
            raise TvmBuildError("TVM's CUDA runtime did not load (libcudart.so.13 missing?): the build would embed "
                                "CUDA source instead of a fatbin")
        _register_nvcc(cuda_arch, facts)
        target = tvm.target.Target({"kind": "cuda", "arch": cuda_arch, "max_threads_per_block": 1024,
                                    "max_shared_memory_per_block": 49152, "thread_warp_size": 32,
                                    "registers_per_block": 65536, "max_num_threads": 1024,
                                    "host": {"kind": "llvm", **host_target}})
    else:
        target = tvm.target.Target({"kind": "llvm", **host_target})
    t0 = time.monotonic()
    windows = windows_for(max_ctx)
    hand = bool(cuda_arch) and not os.environ.get("BOARDTALK_TVM_NO_HAND_KERNELS")  # diagnosis: TE ops only
    mod, params = build_ir(dims, max_ctx, windows, cuda=hand)
    for gv in list(mod.get_global_vars()):
        if gv.name_hint.startswith("decode"):
            # every argument of a decode step (ids, position, cache, tables, weights) is a buffer the session keeps
            # for its life: num_input 0 tells RewriteCUDAGraph they are all static, so the whole step is captured
            # as one CUDA graph (the runtime must pass the same tensors each call: runtime/backends/tvm.py does)
            mod[gv] = mod[gv].with_attr("num_input", 0)
    cfg = {"relax.backend.use_cuda_graph": bool(cuda_arch and use_cuda_graph)}
    with tvm.transform.PassContext(opt_level=3, config=cfg):
        ex = relax.build(mod, target=target, relax_pipeline=_cuda_pipeline(tvm, target) if cuda_arch else "default")
    if cuda_arch and "fatbin_bytes" not in facts:
        raise TvmBuildError("the CUDA build produced no fatbin (TVM fell back to CPU code or CUDA source)")
    ex.export_library(str(out), cc=cc)
    facts.update(seconds=round(time.monotonic() - t0, 1), params=[n for n, _ in params], windows=windows,
                 shapes={n: [list(map(int, p.shape)), p.dtype] for n, p in params})
    log.info("tvm: compiled %s for %s/%s in %.1f s", out.name, cuda_arch or "cpu", host, facts["seconds"])
    return facts


MATMUL_TILE = (8, 16, 4, 4, 16)  # dlight's CUDA default: threads x, y; micro tile x, y; k step


def _matmul_rule(dl):
    """dlight's Matmul with its CUDA tile from MATMUL_TILE ($BOARDTALK_TVM_MATMUL="bx,by,mx,my,mk" to try others)."""
    env = os.environ.get("BOARDTALK_TVM_MATMUL")
    bx, by, mx, my, mk = tuple(int(x) for x in env.split(",")) if env else MATMUL_TILE

    class Matmul(dl.gpu.Matmul):
        def get_configs(self, target):
            cfg = super().get_configs(target)
            if target.kind.name == "cuda":
                cfg.block_size_x, cfg.block_size_y, cfg.micro_size_x, cfg.micro_size_y, cfg.micro_size_k = \
                    bx, by, mx, my, mk
            return cfg

    return Matmul()


def _cuda_pipeline(tvm, target):
    """TVM's default CUDA pipeline with one change: dlight's rules are tried per function and a schedule is kept
    only if it also lowers (dlight's Reduction rule yields cross-thread reductions that do not lower for some
    attention shapes; the next rule is taken instead of failing the build)."""
    from tvm import relax, s_tir, tirx
    from tvm.relax.backend.cuda import pipeline as cp
    from tvm.s_tir import dlight as dl

    @tvm.transform.module_pass(opt_level=0, name="ScheduleGPU")
    def schedule(mod, _ctx):
        skip = set(filter(None, os.environ.get("BOARDTALK_TVM_SKIP_RULES", "").split(",")))  # diagnosis only
        rules = [r for r in (_matmul_rule(dl), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
                             dl.gpu.Fallback()) if type(r).__name__ not in skip]
        done = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc) or (func.attrs and "tirx.is_scheduled" in func.attrs):
                continue
            for rule in rules:
                try:
                    f = dl.ApplyDefaultSchedule(rule)(tvm.IRModule({gv: func}))[gv]
                    if not (f.attrs and "tirx.is_scheduled" in f.attrs):
                        continue
                    s_tir.transform.LowerCrossThreadReduction()(tvm.IRModule({gv: f}))
                except Exception as e:  # noqa: BLE001 - a rule that does not fit: try the next
                    log.debug("dlight %s on %s: %s", type(rule).__name__, gv.name_hint, str(e).strip()[-200:])
                    continue
                done[gv] = f
                break
            else:
                raise TvmBuildError(f"no dlight GPU schedule fits {gv.name_hint} (it would run as CPU code)")
        for gv, f in done.items():
            mod[gv] = f
        return mod

    @tvm.transform.module_pass(opt_level=0, name="DropDecodeArgChecks")
    def drop_checks(mod, _ctx):
        """Decode steps are called through closures whose ~430 arguments the backend bound once (its own
        buffers, shapes fixed by the artifact): the per-call shape/dtype checks of every argument (~100 us of VM
        interpretation per token, measured) are dropped there. Prefill keeps them."""
        from tvm.relax.expr_functor import PyExprMutator, mutator

        checks = {"vm.builtin.check_tensor_info", "vm.builtin.check_tuple_info", "vm.builtin.check_shape_info",
                  "vm.builtin.match_shape"}

        @mutator
        class Drop(PyExprMutator):
            def visit_var_binding_(self, binding):
                v = binding.value
                if isinstance(v, relax.Call) and isinstance(v.op, relax.ExternFunc) and v.op.global_symbol in checks:
                    return
                super().visit_var_binding_(binding)

        for gv, func in list(mod.functions_items()):
            if gv.name_hint.startswith("decode") and isinstance(func, relax.Function):
                if "alloc_shape_heap" in str(func.body) and "vm.builtin.match_shape" in str(func.body) \
                        and "store" in str(func.body):
                    continue  # symbolic shapes to bind: keep everything
                mod[gv] = Drop().visit_expr(func)
        return mod

    legalize = [p for p in cp.legalize_passes(target) if "ApplyDefaultSchedule" not in type(p).__name__
                and "ApplyDefaultSchedule" not in str(getattr(p, "info", ""))]

    @tvm.transform.module_pass(opt_level=0, name="BoardtalkCUDAPipeline")
    def pipeline(mod, _ctx):
        with target:
            seq = tvm.transform.Sequential(cp.library_dispatch_passes(target) + legalize + [schedule]
                                           + cp.dataflow_lower_passes(target) + cp.finalize_passes(target)
                                           + [drop_checks])
            return seq(mod)

    return pipeline


# ---- weights ----------------------------------------------------------------------------------------
def _q4_1(raw: np.ndarray, K: int):
    """GGUF Q4_1 rows (N, K/32*20) -> qs (N, K/8) uint32 (element k in bits 4*(k%8) of word k//8), d, m (N, K/32)
    float16: the blocks' nibbles and f16 bits moved, nothing re-rounded."""
    N = raw.shape[0]
    b = raw.reshape(N, K // 32, 20)
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0]
    m = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0]
    qb = b[..., 4:]  # (N, nb, 16): byte j = element j (low nibble), element j + 16 (high nibble)
    q = np.concatenate([qb & 15, qb >> 4], axis=-1).astype(np.uint32).reshape(N, K // 8, 8)  # element order
    words = np.bitwise_or.reduce(q << (4 * np.arange(8, dtype=np.uint32)), axis=-1).astype(np.uint32)
    return np.ascontiguousarray(words), np.ascontiguousarray(d), np.ascontiguousarray(m)


def _q8_0(raw: np.ndarray, K: int):
    N = raw.shape[0]
    b = raw.reshape(N, K // 32, 34)
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0]
    return np.ascontiguousarray(b[..., 2:]).reshape(N, K).view(np.int8), np.ascontiguousarray(d)


def model_arrays(src) -> dict[str, np.ndarray]:
    """Every parameter of models/tvm_model.py, by its exported name, from the GGUF's blocks."""
    from .arch import layer_tensor

    cfg = src.config
    if not cfg.tie_embeddings:
        raise NotImplementedError("the tvm backend supports tied output layers only (as SmolLM2)")

    def raw(name, want):
        typ, data = src.raw(name)
        if typ != want:
            raise ValueError(f"tvm backend needs {name} as {want}, the GGUF has {typ}; use --backend onnxruntime")
        return np.asarray(data).view(np.uint8).reshape(data.shape[0], -1)

    out = {}
    out["embd_qs"], out["embd_d"] = _q8_0(raw("token_embd.weight", "Q8_0"), cfg.hidden)
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        groups = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
                  "down": ("ffn_down",)}
        for g, names in groups.items():
            parts = [_q4_1(raw(layer_tensor(i, n), "Q4_1"), _cols(src, layer_tensor(i, n))) for n in names]
            for j, what in enumerate(("qs", "d", "m")):
                out[p + g + "." + what] = np.ascontiguousarray(np.concatenate([x[j] for x in parts], axis=0))
        out[p + "attn_norm"] = np.asarray(src.dequantized(layer_tensor(i, "attn_norm")), np.float32).reshape(-1)
        out[p + "ffn_norm"] = np.asarray(src.dequantized(layer_tensor(i, "ffn_norm")), np.float32).reshape(-1)
    out["out_norm"] = np.asarray(src.dequantized("output_norm.weight"), np.float32).reshape(-1)
    return out


def _cuda_boards() -> list[str]:
    import boards

    return [n for n, p in boards.PROFILES.items() if p.cuda_arch]


def _cols(src, name: str) -> int:
    return int(src.tensors[name].shape[0])  # gguf lists dims innermost first: shape[0] = columns (K)


def write_weights(arrays: dict, order: list[str], shapes: dict, out: Path, align: int = 64) -> dict:
    """One file with every parameter, 64-byte aligned, in the functions' order; returns the index."""
    index, off = [], 0
    with open(out, "wb") as f:
        for name in order:
            a = arrays[name]
            want_shape, want_dtype = shapes[name]
            if list(a.shape) != want_shape or str(a.dtype) != want_dtype:
                raise TvmBuildError(f"{name}: {a.shape} {a.dtype}, the model wants {want_shape} {want_dtype}")
            pad = -off % align
            f.write(b"\0" * pad)
            off += pad
            f.write(a.tobytes())
            index.append([name, want_dtype, want_shape, off, int(a.nbytes)])
            off += int(a.nbytes)
    return {"params": index, "size": off}


def build_tvm_files(src, out_dir: Path, profile, max_ctx: int, progress=None):
    """The tvm backend's files in out_dir; returns (files, graph_info, tvm_fields, ExportReport)."""
    from runtime.backends.tvm import INDEX_FILE, INDEX_FORMAT, WEIGHTS_FILE, library_name

    from .export_onnx import ExportReport
    from .tvm_model import Dims

    dims = Dims.of(src.config)
    arch = profile.cuda_arch
    if not arch and profile.name != "host":
        raise ValueError(f"the tvm backend targets CUDA boards ({', '.join(b for b in _cuda_boards())}); for "
                         f"{profile.name} use --backend native")
    hosts = [profile.triple] + (["x86_64-linux-gnu"] if arch and profile.triple != "x86_64-linux-gnu" else [])
    libs, facts = {}, {}
    for i, host in enumerate(hosts):
        if progress:
            progress(i, len(hosts) + 1, f"compile for {arch or 'cpu'} / {host}")
        name = library_name(host)
        facts = compile_library(dims, out_dir / name, cuda_arch=arch, host=host, max_ctx=max_ctx)
        libs[host] = name
    arrays = model_arrays(src)
    idx = write_weights(arrays, facts["params"], facts["shapes"], out_dir / WEIGHTS_FILE)
    if progress:
        progress(len(hosts) + 1, len(hosts) + 1, "weights")
    (out_dir / INDEX_FILE).write_text(json.dumps({"format": INDEX_FORMAT, "file": WEIGHTS_FILE,
                                                  "architecture": src.config.to_dict(), **idx}, indent=0),
                                      encoding="utf-8")
    import tvm

    fields = {"tvm_version": tvm.__version__, "device": "cuda" if arch else "cpu", "libraries": libs,
              "cache_rows": max_ctx, "decode_windows": facts["windows"], "cuda_graph": bool(arch)}
    if arch:
        major, minor = nvcc_version()
        fields.update(cuda_arch=arch, ptx_arch=f"compute_{arch.split('_')[1]}", ptx_isa=facts.get("ptx_isa"),
                      cuda_runtime_major=major, nvcc=f"{major}.{minor}")
    files = [WEIGHTS_FILE, INDEX_FILE, *libs.values()]
    report = ExportReport(weight_bytes=idx["size"], n_nodes=0, exact=True)
    return files, {"file": WEIGHTS_FILE, "index": INDEX_FILE}, fields, report
