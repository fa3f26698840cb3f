"""Board profiles and board detection.

A profile is a small overlay on an artifact's manifest: where it runs (triple, CUDA
arch), how (threads, execution provider, max context) and the audio devices the voice
demo should use. It is also the one place that says how the native kernels are compiled for
the board (``cflags``) and which CPU features that build needs (``cpu_features``): the
artifact builder compiles with the first, the runtime checks the second before loading.
``detect()`` names the board this process runs on.
"""
from __future__ import annotations

import logging
import os
import platform
from dataclasses import dataclass, replace
from pathlib import Path

log = logging.getLogger(__name__)
MAX_THREADS = 256  # the most threads a model may run with (the native scratch holds per-thread state)


@dataclass(frozen=True)
class BoardProfile:
    name: str
    description: str
    triple: str  # target triple of the host CPU
    cpu: str  # LLVM mcpu / tuning name
    cpu_features: tuple[str, ...]  # what a build for this board needs: x86 avx2/fma/f16c, aarch64 neon/dotprod/fullfp16
    threads: int  # 0 = number of usable cores (at most MAX_THREADS)
    provider: str  # onnxruntime execution provider
    max_context: int  # KV cache positions preallocated
    cuda_arch: str | None = None
    audio_input: str | None = None  # sounddevice name or index; None = system default
    audio_output: str | None = None
    cflags: tuple[str, ...] = ()  # gcc target flags of the native kernels (with -O3 -fopenmp, models/native_build.py)
    # Better builds, best first: (cpu name, features, cflags), used when the machine building the kernels has the
    # board's architecture and every one of those features (the artifact then records and requires them).
    cflag_tiers: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = ()

    def build_flags(self, have: frozenset[str] | None) -> tuple[str, tuple[str, ...]]:
        """(cpu name, cflags) for a build on a machine with CPU features ``have`` (None: another architecture)."""
        for cpu, features, flags in self.cflag_tiers:
            if have is not None and set(features) <= have:
                return cpu, flags
        return self.cpu, self.cflags

    @property
    def arch(self) -> str:
        return self.triple.split("-")[0]

    def resolved_threads(self) -> int:
        """threads if set (validated), else the usable cores, at most MAX_THREADS."""
        if self.threads:
            return validate_threads(self.threads)
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - non-Linux
            cores = os.cpu_count() or 1
        return min(MAX_THREADS, max(1, cores))


def validate_threads(n: object) -> int:
    """n if it is a usable thread count (an int from 1 to MAX_THREADS), else ValueError."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_THREADS:
        raise ValueError(f"threads must be an integer from 1 to {MAX_THREADS}, got {n!r}")
    return n


# cflags: x86-64-v3 is AVX2 + FMA + F16C (the kernels' AVX2 path needs all three); on a host with AVX-512
# the kernels are built for x86-64-v4: the same AVX2 intrinsics, but with 32 vector registers the 8-row
# matmul tiles stop spilling (prefill 15-20 % faster on this Zen 4 dev VM, measured). The Orin's CPU is a
# Cortex-A78AE; aarch64-linux-gnu-gcc 12 (Debian 12, the CI cross compiler) accepts -mcpu=cortex-a78ae.
# cpu stays "cortex-a78" for the Jetsons: it is the LLVM tuning name other backends read.
AVX512 = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")  # x86-64-v4's
PROFILES: dict[str, BoardProfile] = {
    "host": BoardProfile("host", "x86-64 development host (CPU)", "x86_64-linux-gnu", "x86-64-v3", ("avx2", "fma", "f16c"),
                         0, "CPUExecutionProvider", 2048, cflags=("-march=x86-64-v3",),
                         cflag_tiers=(("x86-64-v4", AVX512, ("-march=x86-64-v4",)),)),
    "pi5": BoardProfile("pi5", "Raspberry Pi 5 (Cortex-A76, NEON + dotprod, CPU only)", "aarch64-linux-gnu", "cortex-a76",
                        ("neon", "dotprod", "fullfp16"), 4, "CPUExecutionProvider", 2048, cflags=("-mcpu=cortex-a76",)),
    "jetson-orin-nano": BoardProfile("jetson-orin-nano", "NVIDIA Jetson Orin Nano (Cortex-A78AE host, CUDA sm_87)",
                                     "aarch64-linux-gnu", "cortex-a78", ("neon", "dotprod", "fullfp16"), 6,
                                     "CUDAExecutionProvider", 4096, cuda_arch="sm_87", cflags=("-mcpu=cortex-a78ae",)),
    "jetson-agx-orin": BoardProfile("jetson-agx-orin", "NVIDIA Jetson AGX Orin (Cortex-A78AE host, CUDA sm_87)",
                                    "aarch64-linux-gnu", "cortex-a78", ("neon", "dotprod", "fullfp16"), 8,
                                    "CUDAExecutionProvider", 8192, cuda_arch="sm_87", cflags=("-mcpu=cortex-a78ae",)),
}


def _read(path: str) -> str:
    try:
        return Path(path).read_bytes().replace(b"\x00", b"").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def detect() -> BoardProfile:
    """The profile of this machine: $BOARDTALK_BOARD if set, else from the device tree / CPU."""
    forced = os.environ.get("BOARDTALK_BOARD")
    if forced:
        return get(forced)
    model = _read("/proc/device-tree/model").lower()
    if "raspberry pi 5" in model:
        return PROFILES["pi5"]
    if "orin" in model or os.path.exists("/etc/nv_tegra_release"):
        return PROFILES["jetson-agx-orin" if "agx" in model else "jetson-orin-nano"]
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return PROFILES["host"]
    # An unknown aarch64 board: behave like a Pi 5 class CPU, but say so.
    log.warning("unknown board (machine %s, model %r); using the pi5 profile", machine, model)
    return PROFILES["pi5"]


def get(name: str) -> BoardProfile:
    if name not in PROFILES:
        raise ValueError(f"unknown board {name!r}; known: {', '.join(PROFILES)}")
    return PROFILES[name]


def overlay(profile: BoardProfile, **overrides) -> BoardProfile:
    """Apply per-run overrides (None = keep), logging each one."""
    changes = {k: v for k, v in overrides.items() if v is not None and getattr(profile, k) != v}
    for k, v in changes.items():
        log.info("board %s: %s overridden %r -> %r", profile.name, k, getattr(profile, k), v)
    return replace(profile, **changes) if changes else profile
