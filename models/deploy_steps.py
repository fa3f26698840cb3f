"""What deploy's steps run (models/deploy.py plans them): the wheelhouse made here, the tarball of a
build-only run, and the POSIX sh scripts run on the board (install, switch, restart).

Everything the board runs is plain sh plus the board's Python, and reads only what deploy copied.
"""
from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the checkout whose runtime is shipped (setup.py beside runtime/)


class DeployError(RuntimeError):
    """A step failed; the message is one line naming the step."""


def _tail(text: str, n: int = 3) -> str:
    """The last n lines of a program's stderr in one line, its error lines first (pip ends with hints)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"(error|fatal|[\w.-]+error)\b", ln, re.I)]
    return " | ".join((errors or lines)[-n:])[-400:] or "no output"


def _run_local(step: str, cmd: list[str], timeout: float = 1800) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise DeployError(f"deploy step '{step}': {cmd[0]} is not installed here") from None
    if res.returncode != 0:
        raise DeployError(f"deploy step '{step}' failed here ({shlex.join(cmd[:4])} ...: exit {res.returncode}): "
                          f"{_tail(res.stderr or res.stdout)}")
    return res.stdout


def pack_tarball(art: Path, out: Path) -> Path:
    """art packed as out (.tar, or gzip for .tar.gz/.tgz): NAME/manifest.yaml first, then its files; written
    to a temporary file beside out and renamed, so a half-written tarball is never seen."""
    from runtime.artifact import load_manifest

    m = load_manifest(art)  # only a verified artifact is packed
    names = ["manifest.yaml", *(["manifest.sig"] if (art / "manifest.sig").exists() else []), *sorted(m.files)]
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        with tarfile.open(tmp, "w:gz" if str(out).endswith(("gz", ".tgz")) else "w") as tf:
            for n in names:
                tf.add(art / n, arcname=f"{art.name}/{n}", recursive=False)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def make_wheelhouse(pyver: str, machine: str, glibc: str, extra: str | None) -> tuple[Path, str, str]:
    """(wheelhouse dir, boardtalk wheel name, pip wheel name): this checkout's wheel and every runtime
    dependency as a binary wheel for CPython pyver on manylinux <machine> with the board's glibc (pip also
    takes the older manylinux tags). Dependency wheels are kept in the cache, keyed by the platform."""
    from runtime.artifact import cache_dir

    if not (REPO / "setup.py").is_file():
        raise DeployError(f"deploy step 'wheels': no setup.py beside {REPO / 'runtime'}: deploy ships the runtime from "
                          "a source checkout (git clone, then pip install -e '.[build]')")
    m = re.fullmatch(r"2\.(\d+)", glibc or "")
    minor = max(17, int(m.group(1))) if m else 17
    tag = f"manylinux_2_{minor}_{machine}"
    # pip takes only the tags it is given: every manylinux glibc level the board can run, newest first
    platforms = [a for k in range(minor, 16, -1) for a in ("--platform", f"manylinux_2_{k}_{machine}")]
    platforms += ["--platform", f"manylinux2014_{machine}"]
    wh = cache_dir() / "deploy-wheels" / f"cp{pyver.replace('.', '')}-{tag}{'-' + extra if extra else ''}"
    shutil.rmtree(wh, ignore_errors=True)  # exactly this deploy's wheels (pip's own cache makes refilling it quick)
    wh.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip"]
    isolation = ["--no-build-isolation"] if _has_setuptools() else []  # offline when setuptools is here
    _run_local("wheels", [*pip, "wheel", "-q", "--no-deps", *isolation, "-w", str(wh), str(REPO)], timeout=600)
    built = sorted(wh.glob("boardtalk-*.whl"))
    if len(built) != 1:
        raise DeployError(f"deploy step 'wheels': expected one boardtalk wheel in {wh}, found {len(built)}")
    req = f"{built[0]}[{extra}]" if extra else str(built[0])
    _run_local("wheels", [*pip, "download", "-q", "--only-binary=:all:", *platforms, "--python-version", pyver,
                          "--implementation", "cp", "-d", str(wh), req, "pip"], timeout=1200)
    pips = list(wh.glob("pip-*.whl"))
    if len(pips) != 1:
        raise DeployError(f"deploy step 'wheels': expected one pip wheel in {wh}, found {len(pips)}")
    return wh, built[0].name, pips[0].name


def given_wheelhouse(wh: Path) -> tuple[Path, str, str]:
    """--wheels DIR: (DIR, its boardtalk wheel, its pip wheel); one of each, or DeployError."""
    found = {k: sorted(p.name for p in wh.glob(f"{k}-*.whl")) for k in ("boardtalk", "pip")}
    for k, names in found.items():
        if len(names) != 1:
            raise DeployError(f"deploy step 'wheels': --wheels {wh} must hold one {k} wheel, it holds {len(names)} "
                              "(a deploy leaves its wheels in the cache's deploy-wheels/ directory)")
    return wh, found["boardtalk"][0], found["pip"][0]


def _has_setuptools() -> bool:
    """Whether this Python can build the wheel without fetching a build environment (setuptools + wheel)."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("setuptools", "wheel"))


def wheelhouse_stamp(wh: Path) -> str:
    """What the wheels contain (names and CRCs of their members, not the zip timestamps that change with
    each 'pip wheel'): the board skips the install when its runtime was made from the same."""
    h = hashlib.sha256()
    for whl in sorted(wh.glob("*.whl")):
        h.update(whl.name.encode() + b"\0")
        with zipfile.ZipFile(whl) as z:
            for i in sorted(z.infolist(), key=lambda i: i.filename):
                if not i.filename.endswith(".dist-info/RECORD"):
                    h.update(f"{i.filename}:{i.CRC:08x}:{i.file_size}\n".encode())
    return h.hexdigest()[:32]


def install_script(d: str, pyq: str, pip_wheel: str, runtime_wheel: str, extra: str | None, stamp: str) -> str:
    """Board side: install the runtime from d/wheels into d/runtime (skipped when the stamp matches), and
    write d/bin/boardtalk. Only sh, the board's Python and the copied wheels are used."""
    q = shlex.quote(d)
    req = shlex.quote(f"wheels/{runtime_wheel}" + (f"[{extra}]" if extra else ""))
    launcher = ("#!/bin/sh\n# written by boardtalk deploy: the runtime in ../runtime, run by the board's Python\n"
                'DIR=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)\n'
                # for 'boardtalk install-service': the unit's ExecStart must be this launcher, not bare python
                'BOARDTALK_LAUNCHER="$DIR/bin/boardtalk"; export BOARDTALK_LAUNCHER\n'
                # the voice engines' model files deploy copied (--with voice/serve): the board fetches nothing
                'if [ -d "$DIR/voice-assets" ] && [ -z "$BOARDTALK_VOICE_ASSETS" ]; then '
                'BOARDTALK_VOICE_ASSETS="$DIR/voice-assets"; export BOARDTALK_VOICE_ASSETS; fi\n'
                f'PYTHONPATH="$DIR/runtime${{PYTHONPATH:+:$PYTHONPATH}}" exec {pyq} -m runtime.cli "$@"\n')
    return f"""set -e
cd {q}
DIR=$(pwd)
if [ -f runtime/.boardtalk-stamp ] && [ "$(cat runtime/.boardtalk-stamp)" = {stamp} ]; then
  note="runtime unchanged ($DIR/runtime)"
else
  rm -rf runtime.new
  {pyq} wheels/{shlex.quote(pip_wheel)}/pip install --isolated -q --disable-pip-version-check --no-index \\
    --find-links wheels --target runtime.new --no-warn-script-location --root-user-action=ignore {req} >&2
  echo {stamp} > runtime.new/.boardtalk-stamp
  rm -rf runtime.old
  if [ -d runtime ]; then mv runtime runtime.old; fi
  mv runtime.new runtime
  rm -rf runtime.old
  note="runtime installed in $DIR/runtime ($(du -sm runtime | cut -f1) MB)"
fi
mkdir -p bin
cat > bin/boardtalk.new <<'BOARDTALK_EOF'
{launcher}BOARDTALK_EOF
chmod 755 bin/boardtalk.new
mv bin/boardtalk.new bin/boardtalk
bin/boardtalk --version >&2
echo "$note"
"""


def switch_script(d: str, name: str) -> str:
    q = shlex.quote(d)
    return f"""set -e
cd {q}/artifacts
rm -rf {name}.old
if [ -e {name} ]; then mv {name} {name}.old; fi
mv {name}.new {name}
rm -rf {name}.old
cd ..
ln -sfn artifacts/{name} current.new
mv -T current.new current
"""


def restart_script(service: str) -> str:
    s = shlex.quote(service)
    return f"""if command -v systemctl >/dev/null 2>&1 && systemctl is-enabled --quiet {s} 2>/dev/null; then
  if [ "$(id -u)" = 0 ]; then systemctl restart {s}; else sudo -n systemctl restart {s}; fi
  echo restarted
elif command -v systemctl >/dev/null 2>&1 && systemctl --user is-enabled --quiet {s} 2>/dev/null; then
  systemctl --user restart {s}
  echo restarted-user
else
  echo none
fi
"""
