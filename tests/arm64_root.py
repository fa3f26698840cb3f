"""An arm64 Debian root to run the board side under qemu-user, built once and cached (tests/test_deploy.py).

    root = build_root()                          # ~/.cache/boardtalk-tests/arm64-root/<key>/ (or $BOARDTALK_TEST_CACHE)
    subprocess.run([*python_cmd(root), "-c", "import platform; print(platform.machine())"])   # aarch64

No debootstrap (its second stage takes ~20 min under emulation): apt-get, with a private configuration
(its own sources list for the arm64 architecture, state and cache under the cache dir, an empty dpkg
status, so the system's apt is not touched), downloads PACKAGES and their dependencies as arm64 .debs,
and ``dpkg -x`` unpacks them into one directory. Programs then run as ``qemu-aarch64-static -L ROOT``:
qemu looks up the dynamic loader and libraries under ROOT first. The root holds Python and the C
libraries only; pip itself and the Python packages come as wheels (the deploy's wheelhouse).

Measured on the 2-core dev VM: apt-get update 2.6 s, download of 40 .debs (16 MB) 1.6 s, unpacking 1.3 s;
75 MB on disk.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

SUITE = "bookworm"  # Debian 12: Python 3.11, glibc 2.36, as Raspberry Pi OS (bookworm) ships
MIRRORS = (f"http://deb.debian.org/debian {SUITE} main", f"http://deb.debian.org/debian-security {SUITE}-security main")
KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
# python3.11-minimal + libpython3.11-stdlib: the interpreter and the standard library; libgomp1: the native
# kernels' OpenMP runtime; libstdc++6: numpy's C++ parts (manylinux wheels do not bundle it)
PACKAGES = ("python3.11-minimal", "libpython3.11-stdlib", "libgomp1", "libstdc++6")
PYTHON = "usr/bin/python3.11"


def qemu() -> str | None:
    return shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")


def missing() -> str | None:
    """Why an arm64 root cannot be built or run here (a skip reason saying what to install), or None."""
    need = [("qemu-aarch64-static", qemu(), "qemu-user-static"), ("apt-get", shutil.which("apt-get"), "apt"),
            ("dpkg", shutil.which("dpkg"), "dpkg"), (str(KEYRING), KEYRING.exists() or None, "debian-archive-keyring")]
    gone = [f"{what} ({pkg})" for what, have, pkg in need if not have]
    return f"needs {', '.join(gone)}: apt install {' '.join(p for _, h, p in need if not h)}" if gone else None


def cache_root() -> Path:
    env = os.environ.get("BOARDTALK_TEST_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "boardtalk-tests"
    return base / "arm64-root"


def _key() -> str:
    return hashlib.sha256(" ".join((SUITE, *MIRRORS, *PACKAGES)).encode()).hexdigest()[:16]


def build_root(cache: Path | None = None, log=print) -> Path:
    """The arm64 root (built on first call, under a lock: concurrent test runs build it once)."""
    cache = cache or cache_root()
    root = cache / _key()
    if (root / ".complete").exists():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / ".complete").exists():
            return root
        t0 = time.monotonic()
        work = cache / f"apt-{_key()}"
        shutil.rmtree(work, ignore_errors=True)
        for d in ("state/lists/partial", "cache/archives/partial", "etc"):
            (work / d).mkdir(parents=True)
        (work / "state/status").touch()
        (work / "etc/sources.list").write_text("".join(f"deb [arch=arm64 signed-by={KEYRING}] {m}\n" for m in MIRRORS))
        opts = [f"-o{k}={v}" for k, v in {
            "APT::Architecture": "arm64", "APT::Architectures": "arm64", "Dir::State": work / "state",
            "Dir::State::status": work / "state/status", "Dir::Cache": work / "cache",
            "Dir::Etc::SourceList": work / "etc/sources.list", "Dir::Etc::SourceParts": "/dev/null",
            "Dir::Etc::Preferences": "/dev/null", "Dir::Etc::PreferencesParts": "/dev/null",
            "Debug::NoLocking": "1", **({"APT::Sandbox::User": "root"} if os.geteuid() == 0 else {}),
        }.items()]  # the sandbox user _apt could not write to root's cache dir
        _run(["apt-get", *opts, "-q", "update"])
        _run(["apt-get", *opts, "-q", "-y", "--download-only", "--no-install-recommends", "install", *PACKAGES])
        tmp = cache / f"{_key()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        debs = sorted((work / "cache/archives").glob("*.deb"))
        for deb in debs:
            _run(["dpkg", "-x", str(deb), str(tmp)])
        (tmp / ".complete").write_text(" ".join(d.name for d in debs) + "\n")
        shutil.rmtree(root, ignore_errors=True)
        os.replace(tmp, root)
        shutil.rmtree(work, ignore_errors=True)
        log(f"arm64 root: {len(debs)} .debs unpacked into {root} in {time.monotonic() - t0:.1f} s")
    return root


def _run(cmd: list[str]) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:2])} ... {cmd[-1]} failed: {(res.stderr or res.stdout)[-1500:]}")


def python_cmd(root: Path, cpu: str | None = None) -> list[str]:
    """The arm64 Python of root under qemu (cpu: a qemu -cpu model, e.g. cortex-a53 has no dotprod)."""
    return [qemu(), *(["-cpu", cpu] if cpu else []), "-L", str(root), str(root / PYTHON)]


def write_python_wrapper(root: Path, path: Path, cpu: str | None = None, board: str = "pi5") -> Path:
    """A shell script at path that runs root's Python under qemu as the given board would (BOARDTALK_BOARD:
    qemu has no device tree to detect a Pi 5 from): the 'python3' of a board reached over ssh."""
    import shlex

    path.write_text(f"#!/bin/sh\nBOARDTALK_BOARD={board} exec {shlex.join(python_cmd(root, cpu))} \"$@\"\n")
    path.chmod(0o755)
    return path
