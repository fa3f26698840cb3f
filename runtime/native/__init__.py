"""Loads the native kernel library an artifact ships, after checking it can run on this CPU. Never compiles.

The artifact builder compiles bt_native.c (shipped next to this file) for the artifact's board with that
board's flags (boards.BoardProfile.cflags, models/native_build.py) and puts the library in the artifact,
where it is sha256-checked like every other file. Here we only check that the library is for this
machine's architecture (its ELF header, before dlopen) and that this CPU has the features the build
needs (``check_cpu``), then load it with ctypes.

C API (bt_native.c): the run state lives in a scratch object, one per model instance; no globals.
    void *bt_scratch_new(const bt_config *c, int max_t, int n_threads)  NULL on bad args / no memory
    void bt_scratch_free(void *s)
    int bt_forward(const bt_config *c, const bt_weights *w, void *s, const int64_t *ids, int T, int start,
                   int8_t *kv, float *kv_scale, float *logits, int logits_from)  0 or an error code
    void bt_profile(void *s, int on, double *out)  out: len(PHASES) doubles, seconds
    double bt_read_bandwidth(size_t bytes, int n_threads, int passes)  GB/s
    const char *bt_simd(void)  "avx2", "neon+dotprod", "neon" or "scalar"
"""
from __future__ import annotations

import ctypes
import functools
import logging
import platform
import threading
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("bt_native.c")  # compiled by the build side, never here
PHASES = ("qkv", "attention", "o_proj", "gate_up", "down", "lm_head", "other")  # bt_profile's output, in order

ELF_MACHINES = {3: "i386", 40: "arm", 62: "x86_64", 183: "aarch64"}  # e_machine -> platform.machine() name
_ARCH_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}
# aarch64 getauxval(AT_HWCAP) bits (linux/arch/arm64/include/uapi/asm/hwcap.h), in our feature names
_AT_HWCAP = 16
_HWCAP_BITS = {"neon": 1 << 1, "fullfp16": 1 << 10, "dotprod": 1 << 20}  # ASIMD, ASIMDHP, ASIMDDP
_X86_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")  # as /proc/cpuinfo


class NativeError(RuntimeError):
    """The native kernel library cannot be used on this machine (wrong architecture, missing CPU features,
    not loadable)."""


class BtConfig(ctypes.Structure):
    """bt_config of bt_native.c, field for field."""

    _fields_ = [(n, ctypes.c_int32) for n in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn", "vocab",
                                               "max_seq")] + [("norm_eps", ctypes.c_float), ("q_scale", ctypes.c_float),
                                                              ("kv_layer_major", ctypes.c_int32)]


def machine_arch() -> str:
    """This machine's architecture as an ELF / target-triple name: "x86_64", "aarch64", ..."""
    m = platform.machine().lower()
    return _ARCH_ALIASES.get(m, m)


def library_arch(path: Path) -> str:
    """The architecture a shared library was built for, from its ELF header's e_machine."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError as e:
        raise NativeError(f"cannot read the native kernel library {path}: {e}") from e
    if len(head) < 20 or head[:4] != b"\x7fELF":
        raise NativeError(f"{path.name} is not an ELF shared library (the native kernels are built for Linux)")
    e_machine = int.from_bytes(head[18:20], "little" if head[5] == 1 else "big")
    return ELF_MACHINES.get(e_machine, f"ELF machine {e_machine}")


@functools.lru_cache(maxsize=1)
def cpu_features() -> frozenset[str]:
    """The CPU features of this machine, in the board profiles' names (boards.BoardProfile.cpu_features).

    x86: from /proc/cpuinfo's flags. aarch64: from getauxval(AT_HWCAP), which is also right under
    qemu-user (where /proc/cpuinfo describes the host)."""
    arch = machine_arch()
    if arch == "x86_64":
        try:
            text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return frozenset()
        flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
        return frozenset(f for f in _X86_FLAGS if f in flags)
    if arch == "aarch64":
        try:
            libc = ctypes.CDLL(None)
            libc.getauxval.restype = ctypes.c_ulong
            libc.getauxval.argtypes = [ctypes.c_ulong]
            hwcap = int(libc.getauxval(_AT_HWCAP))
        except (OSError, AttributeError):
            return frozenset()
        return frozenset(name for name, bit in _HWCAP_BITS.items() if hwcap & bit)
    return frozenset()


def _this_board() -> str:
    try:
        import boards

        return boards.detect().name
    except (ImportError, ValueError):
        return "<this board>"


def check_cpu(required: Iterable[str], what: str, board: str | None = None) -> None:
    """Raise NativeError naming the features `what` (a library's name, built for `board`) needs that this CPU
    lacks. When the artifact was built for this board's profile, rebuilding for it would not help: the CPU
    is not the one the profile describes."""
    have = cpu_features()
    missing = sorted(set(required) - have)
    if not missing:
        return
    here = _this_board()
    msg = (f"{what} needs CPU features {', '.join(missing)}, which this CPU lacks "
           f"(has {', '.join(sorted(have)) or 'none of those we check'}); ")
    if board is not None and board == here:
        msg += (f"this CPU is not the one the {board} profile describes: use --backend onnxruntime, or run "
                "with $BOARDTALK_BOARD set to the board this really is")
    else:
        msg += f"rebuild the artifact with --board {here} or use --backend onnxruntime"
    raise NativeError(msg)


def check_arch(path: Path) -> None:
    """Raise NativeError unless the library at path was built for this machine's architecture."""
    built, here = library_arch(path), machine_arch()
    if built != here:
        raise NativeError(f"{Path(path).name} is built for {built}, but this machine is {here}; rebuild the artifact "
                          f"with --board {_this_board()} or use --backend onnxruntime")


_libs: dict[Path, ctypes.CDLL] = {}
_lock = threading.Lock()


def load_library(path: Path, required: Iterable[str] = ()) -> ctypes.CDLL:
    """The prebuilt kernel library at path (the one an artifact ships), with the C API's types set.

    Checks its architecture and the CPU features `required` (the artifact's) before dlopen; one
    CDLL per resolved path."""
    path = Path(path).resolve()
    check_arch(path)
    check_cpu(required, path.name)
    with _lock:
        lib = _libs.get(path)
        if lib is not None:
            return lib
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise NativeError(f"cannot load the native kernel library {path.name}: {e}") from e
        c_int, c_void_p = ctypes.c_int, ctypes.c_void_p
        lib.bt_simd.restype = ctypes.c_char_p
        lib.bt_simd.argtypes = []
        lib.bt_scratch_new.restype = c_void_p
        lib.bt_scratch_new.argtypes = [c_void_p, c_int, c_int]
        lib.bt_scratch_free.restype = None
        lib.bt_scratch_free.argtypes = [c_void_p]
        lib.bt_profile.restype = None
        lib.bt_profile.argtypes = [c_void_p, c_int, c_void_p]
        lib.bt_read_bandwidth.restype = ctypes.c_double
        lib.bt_read_bandwidth.argtypes = [ctypes.c_size_t, c_int, c_int]
        lib.bt_forward.restype = c_int
        lib.bt_forward.argtypes = [c_void_p, c_void_p, c_void_p, c_void_p, c_int, c_int, c_void_p, c_void_p, c_void_p,
                                   c_int]
        _libs[path] = lib
    log.info("native kernels: %s (%s)", path.name, lib.bt_simd().decode())
    return lib


def read_bandwidth(path: Path, threads: int, nbytes: int = 256 << 20, passes: int = 5) -> float:
    """Streaming read GB/s of this machine with `threads` threads, measured by the library at path."""
    return float(load_library(path).bt_read_bandwidth(nbytes, threads, passes))
