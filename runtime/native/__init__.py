"""Finds (or, in a source checkout, compiles) the native kernel library bt_native.c."""
from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("bt_native.c")


def compile_flags() -> list[str]:
    arch = "-mcpu=native" if platform.machine().lower() in ("aarch64", "arm64") else "-march=native"
    return ["-O3", arch, "-fopenmp", "-fPIC", "-shared", "-Wall"]


def _jit_build() -> Path | None:
    """Compile into the cache when the package was not built by pip (a plain source checkout)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    from models.sources import cache_dir

    import hashlib

    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(compile_flags()).encode()).hexdigest()[:16]
    out = cache_dir() / "native" / f"bt_native-{platform.machine()}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.so")
    res = subprocess.run([cc, *compile_flags(), "-o", str(tmp), str(SOURCE), "-lm"], capture_output=True, text=True)
    if res.returncode != 0:
        log.warning("could not compile the native kernels: %s", res.stderr[-500:])
        return None
    os.replace(tmp, out)
    log.info("compiled native kernels: %s", out)
    return out


_lib = None


def library() -> ctypes.CDLL:
    global _lib
    if _lib is not None:
        return _lib
    spec = importlib.util.find_spec("runtime._bt_native")  # built by setup.py (pip install)
    built = Path(spec.origin) if spec and spec.origin else None
    if built is not None and built.stat().st_mtime < SOURCE.stat().st_mtime:
        log.info("installed native kernels are older than %s; compiling the current source", SOURCE.name)
        built = None
    path = built or _jit_build()
    if path is None:
        raise ImportError("the native backend's kernels are not built: reinstall boardtalk with a C compiler "
                          "(pip install -e .), or use an onnxruntime artifact")
    lib = ctypes.CDLL(str(path))
    lib.bt_simd.restype = ctypes.c_char_p
    lib.bt_scratch_new.restype = ctypes.c_void_p
    lib.bt_scratch_new.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.bt_scratch_free.argtypes = [ctypes.c_void_p]
    lib.bt_profile.argtypes = [ctypes.c_int, ctypes.c_void_p]
    lib.bt_read_bandwidth.restype = ctypes.c_double
    lib.bt_read_bandwidth.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    lib.bt_forward.restype = ctypes.c_int
    lib.bt_forward.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                               ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    _lib = lib
    log.info("native kernels: %s (%s)", path.name, lib.bt_simd().decode())
    return lib
