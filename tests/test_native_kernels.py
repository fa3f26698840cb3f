"""The native SIMD kernels against scalar arithmetic, for every instruction set we ship.

x86 AVX2 and the portable scalar path run here; the Pi 5 / Jetson paths (NEON with and without
dotprod) are cross-compiled and run under qemu-user when gcc-aarch64-linux-gnu and
qemu-user-static are installed (.ci/run installs them). Emulated timings mean nothing; results do.
"""
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

CHECK = Path(__file__).parent / "native" / "kernel_check.c"
X86 = platform.machine().lower() in ("x86_64", "amd64")


def _run(cc, flags, tmp_path, runner=(), expect=None):
    exe = tmp_path / ("kc" + str(abs(hash(" ".join(flags)))))
    res = subprocess.run([cc, "-O2", *flags, "-fopenmp", "-o", str(exe), str(CHECK), "-lm"], capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stderr
    out = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    simd, counts = out.stdout.strip().split(": ")
    assert counts.endswith(" 0 failed") and int(counts.split()[0]) > 500
    if expect:
        assert simd == expect
    return simd


@pytest.mark.skipif(not shutil.which("cc"), reason="needs a C compiler")
def test_host_kernels(tmp_path):
    _run("cc", ["-march=native"] if X86 else ["-mcpu=native"], tmp_path)
    _run("cc", [], tmp_path, expect="scalar" if X86 else None)


AARCH64 = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")


@pytest.mark.skipif(not (AARCH64 and QEMU), reason="install gcc-aarch64-linux-gnu and qemu-user-static to run")
@pytest.mark.parametrize("flags,expect", [(["-mcpu=cortex-a76"], "neon+dotprod"),  # Raspberry Pi 5
                                          (["-mcpu=cortex-a78ae"], "neon+dotprod"),  # Jetson Orin host CPU
                                          (["-march=armv8-a"], "neon")])
def test_aarch64_kernels_under_qemu(tmp_path, flags, expect):
    _run(AARCH64, [*flags, "-static"], tmp_path, runner=(QEMU,), expect=expect)
