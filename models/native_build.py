"""Compile the native kernels (runtime/native/bt_native.c) for a board, into an artifact.

    info = build_library("pi5", out_dir)   # out_dir/bt_native-cortex-a76.so, cross-compiled on x86

The flags come from one place, the board profile (boards.BoardProfile.cflags), never -march=native:
the library must run on the board, not on the machine that builds it. What the build needs from the
CPU and which kernels it selected are read from the compiler itself (its predefined macros for those
flags), so the manifest states what is true of the library and the board can refuse it up front
(runtime.native.check_cpu). Builds are cached under runtime.artifact.cache_dir() / "kernels", keyed by
the source, the compiler's version and the flags, so building many artifacts compiles once.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import boards
import runtime.native
from runtime.artifact import cache_dir
from runtime.native import machine_arch

log = logging.getLogger(__name__)

BASE_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared")  # then the board's cflags; -lm links last
INSTALL_HINT = {"aarch64": "apt install gcc-aarch64-linux-gnu", "x86_64": "apt install gcc-x86-64-linux-gnu"}
# predefined macro -> CPU feature (boards' names) the compiled code may use
FEATURE_MACROS = {"__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c", "__AVX512F__": "avx512f",
                  "__AVX512BW__": "avx512bw", "__AVX512CD__": "avx512cd", "__AVX512DQ__": "avx512dq",
                  "__AVX512VL__": "avx512vl", "__ARM_NEON": "neon", "__ARM_FEATURE_DOTPROD": "dotprod",
                  "__ARM_FEATURE_FP16_SCALAR_ARITHMETIC": "fullfp16"}


class NativeBuildError(RuntimeError):
    """The native kernels cannot be compiled for this board here (no compiler, or it failed)."""


def compiler_for(profile: boards.BoardProfile) -> str:
    """$CC (or cc) when this machine has the board's architecture, else the board's cross gcc."""
    if profile.arch == machine_arch():
        return os.environ.get("CC") or "cc"
    return f"{profile.triple}-gcc"  # aarch64-linux-gnu-gcc for the Pi 5 and the Jetsons


def can_build(board: str) -> bool:
    """Whether this machine has the compiler build_library needs for the board."""
    return shutil.which(compiler_for(boards.get(board))) is not None


def library_name(profile: boards.BoardProfile, cpu: str | None = None) -> str:
    """bt_native-<cpu>.so, with anything but letters, digits, '.', '_' and '-' replaced."""
    return f"bt_native-{re.sub(r'[^A-Za-z0-9._-]', '_', cpu or profile.cpu)}.so"


def _compiler(profile: boards.BoardProfile) -> tuple[str, str]:
    """(path, full --version output) of the board's compiler, or NativeBuildError with the install hint."""
    cc = compiler_for(profile)
    path = shutil.which(cc)
    if path is None:
        hint = "apt install gcc" if profile.arch == machine_arch() else INSTALL_HINT.get(profile.arch, f"install {cc}")
        raise NativeBuildError(f"cannot build the native kernels for {profile.name}: no {cc} on this machine "
                               f"({hint}), or build with --backend onnxruntime")
    res = subprocess.run([path, "--version"], capture_output=True, text=True)
    if res.returncode != 0:
        raise NativeBuildError(f"{cc} --version failed: {res.stderr.strip()[-300:]}")
    return path, res.stdout


def target_macros(cc: str, cflags: tuple[str, ...]) -> set[str]:
    """The macros the compiler predefines for these flags (what the kernels' #ifs see)."""
    res = subprocess.run([cc, *cflags, "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True)
    if res.returncode != 0:
        raise NativeBuildError(f"{cc} {' '.join(cflags)} rejects the flags: {res.stderr.strip()[-500:]}")
    return {line.split()[1] for line in res.stdout.splitlines() if line.startswith("#define ")}


def simd_for(macros: set[str]) -> str:
    """What bt_simd() returns for a build with these macros (the same #if chain as bt_native.c)."""
    if {"__AVX2__", "__F16C__", "__FMA__"} <= macros:
        return "avx2"
    if {"__ARM_NEON", "__aarch64__"} <= macros:
        return "neon+dotprod" if "__ARM_FEATURE_DOTPROD" in macros else "neon"
    return "scalar"


def _compile(cc: str, flags: list[str], out: Path) -> None:
    """Compile into out atomically (a temporary file next to it, then os.replace)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *flags, "-o", tmp, str(runtime.native.SOURCE), "-lm"], capture_output=True, text=True)
        if res.returncode != 0:
            raise NativeBuildError(f"compiling {runtime.native.SOURCE.name} with {cc} {' '.join(flags)} failed:\n"
                                   f"{res.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_library(board: str, out_dir: Path, progress: Callable[[int, int, str], None] | None = None) -> dict:
    """Compile the kernels for the board into out_dir; returns what the manifest records of the library:
    {"file", "cflags", "cpu_features" (what the board's CPU must have), "simd" (its bt_simd()), "compiler"}."""
    profile = boards.get(board)
    if not profile.cflags:
        raise NativeBuildError(f"board {board} has no native build flags (boards.PROFILES[{board!r}].cflags)")
    cc, version = _compiler(profile)
    here = runtime.native.cpu_features() if profile.arch == machine_arch() else None
    cpu, cflags = profile.build_flags(here)
    flags = [*BASE_FLAGS, *cflags]
    macros = target_macros(cc, cflags)
    features = sorted(f for m, f in FEATURE_MACROS.items() if m in macros)
    if cflags == profile.cflags and set(features) - set(profile.cpu_features):
        log.warning("board %s: %s implies CPU features %s beyond the profile's %s; the artifact records what the "
                    "build needs", board, " ".join(cflags), ", ".join(features), ", ".join(profile.cpu_features))
    name = library_name(profile, cpu)
    key = hashlib.sha256(runtime.native.SOURCE.read_bytes() + b"\0" + version.encode() + b"\0" +
                         " ".join(flags).encode()).hexdigest()
    cached = cache_dir() / "kernels" / f"{key[:24]}-{name}"
    if cached.exists():
        log.info("native kernels for %s: cached %s", board, cached)
    else:
        if progress:
            progress(0, 1, "compile native kernels")
        log.info("compiling native kernels for %s: %s %s", board, Path(cc).name, " ".join(cflags))
        _compile(cc, flags, cached)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(cached, out_dir / name)
    if progress:
        progress(1, 1, "compile native kernels")
    simd = simd_for(macros)
    if profile.arch == machine_arch():  # a library for this machine can also say it itself
        built = runtime.native.load_library(cached).bt_simd().decode()
        if built != simd:
            raise NativeBuildError(f"{name}: bt_simd() is {built!r}, expected {simd!r} from {' '.join(cflags)}")
    return {"file": name, "cflags": list(cflags), "cpu_features": features, "simd": simd,
            "compiler": version.splitlines()[0].strip() if version else Path(cc).name}
