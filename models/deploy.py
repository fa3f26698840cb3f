"""``boardtalk deploy``: one command from the build machine to a board (docs/deploy.md).

    steps = plan(DeployOptions(board="pi5", to=parse_target("pi@raspberrypi")))
    for step in steps: step.run()

The plan is a list of named steps, each printable (``--dry-run``) and each failing with one line that
names the step and ends with the tail of the remote's stderr:

    probe    ssh: the board's Python (>= 3.10), machine, glibc, rsync, systemctl
    build    the artifact for the board (models.build.build_artifact: kernels cross-compiled for its CPU)
    wheels   here: this checkout's wheel (pip wheel --no-deps) and the runtime's dependencies as wheels for the
             board's Python and platform (pip download --only-binary), plus pip's own wheel
    copy     wheels and artifact to DIR/wheels and DIR/artifacts/NAME.new (rsync over ssh; tar over ssh
             when either side lacks rsync); unchanged artifact files are hard links to the live copy
    install  DIR/runtime from those wheels only (pip run from its wheel, --no-index --target): the board
             needs no internet, no compiler and no pip; skipped when the same wheels are installed; writes
             the launcher DIR/bin/boardtalk
    verify   DIR/bin/boardtalk verify --json on the new copy (checksums, greedy smoke test, speed)
    switch   NAME.new becomes NAME (a rename: a running service keeps its mapped files); DIR/current -> it
    restart  systemctl restart SERVICE if it is enabled (system unit, else the login's user unit)

Board layout under DIR (default ``boardtalk`` in the login's home):
    bin/boardtalk   runtime/   wheels/   artifacts/NAME/   current -> artifacts/NAME
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]  # the checkout whose runtime is shipped (setup.py beside runtime/)
DEFAULT_DIR = "boardtalk"  # on the board, relative to the login's home
SSH_OPTIONS = ("BatchMode=yes", "ConnectTimeout=10", "ServerAliveInterval=15", "ServerAliveCountMax=4")
MIN_PYTHON = (3, 10)  # setup.py's python_requires
BACKEND_EXTRAS = {"onnxruntime": "onnxruntime", "tvm": "tvm"}  # backend -> setup.py extra the board needs
_SAFE_DIR = re.compile(r"[A-Za-z0-9._/+-]+")  # board paths are used in remote shells and rsync: no quoting games
_HOST = re.compile(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]")
_USER = re.compile(r"[A-Za-z0-9._][A-Za-z0-9._-]*")
PROBE = ("import ctypes, json, os, platform, shutil, sys\n"
         "def lib(n):\n"
         "    try:\n        ctypes.CDLL(n)\n        return True\n"
         "    except OSError:\n        return False\n"
         "print(json.dumps({'python': list(sys.version_info[:3]), 'machine': platform.machine(), "
         "'glibc': platform.libc_ver()[1], 'rsync': bool(shutil.which('rsync')), "
         "'systemctl': bool(shutil.which('systemctl')), 'gomp': lib('libgomp.so.1'), "
         "'home': os.path.expanduser('~')}))")


class DeployError(RuntimeError):
    """A step failed; the message is one line naming the step."""


@dataclass(frozen=True)
class Target:
    """USER@HOST[:DIR] (scp's form); the port is --port (a colon already means DIR)."""
    host: str
    user: str | None = None
    dir: str = DEFAULT_DIR  # relative to the login's home, or absolute
    port: int | None = None

    @property
    def dest(self) -> str:
        host = self.host.strip("[]")
        return f"{self.user}@{host}" if self.user else host

    def __str__(self) -> str:
        return f"{self.dest}:{self.dir}" + (f" (port {self.port})" if self.port else "")


def parse_target(spec: str, port: int | None = None) -> Target:
    """Parse --to; ValueError with the accepted form for anything else (a host starting with '-' would be
    an ssh option; board paths must be plain so no remote shell re-reads them)."""
    form = "expected USER@HOST[:DIR] (e.g. pi@raspberrypi.local:boardtalk; the port goes in --port)"
    user, _, rest = spec.rpartition("@") if "@" in spec else (None, "", spec)
    if rest.startswith("["):
        end = rest.find("]")
        host, tail = (rest[: end + 1], rest[end + 1:]) if end > 0 else (rest, "")
        if tail and not tail.startswith(":"):
            raise ValueError(f"--to {spec!r}: {form}")
        d = tail[1:] if tail else ""
    else:
        host, _, d = rest.partition(":")
    if user is not None and not _USER.fullmatch(user):
        raise ValueError(f"--to {spec!r}: user {user!r} is not a plain login name; {form}")
    if not _HOST.fullmatch(host) or host.startswith("-"):
        raise ValueError(f"--to {spec!r}: host {host!r} is not a host name or address; {form}")
    d = d or DEFAULT_DIR
    if d == "~" or d.startswith("~/"):
        d = d[2:] or "."  # ssh and rsync start in the home directory
    d = d.rstrip("/") or "/"
    if not _SAFE_DIR.fullmatch(d) or d == "/" or ".." in d.split("/"):
        raise ValueError(f"--to {spec!r}: board directory {d!r} must be a plain path (letters, digits, . _ - + /, "
                         "no '..', not /)")
    return Target(host, user, d, port)


@dataclass
class DeployOptions:
    board: str
    to: Target | None = None
    model: str = "smollm2-135m-instruct"
    backend: str = "native"
    max_context: int | None = None
    sign_key: str | None = None
    artifact: str | None = None  # deploy this built artifact instead of building
    wheels: str | None = None  # ship the wheels in this directory instead of making them
    out: str | None = None  # build into this directory or .tar/.tar.gz/.tgz
    identity: str | None = None
    ssh_options: list[str] = field(default_factory=list)
    remote_python: str = "python3"
    transfer: str = "auto"  # auto, rsync, tar
    service: str = "boardtalk"
    progress: Callable[[int, int, str], None] | None = None


@dataclass
class Step:
    name: str
    what: str  # one line: what it does
    commands: list[str]  # what it runs, as a person would type it (printed by --dry-run)
    run: Callable[[], str | None]  # returns a one-line result note, or None


# ---------------------------------------------------------------------------------------------
# ssh

def ssh_base(opts: DeployOptions) -> list[str]:
    """ssh and its options, without the destination."""
    cmd = ["ssh"]
    for o in (*SSH_OPTIONS, *opts.ssh_options):
        cmd += ["-o", o]
    if opts.to and opts.to.port:
        cmd += ["-p", str(opts.to.port)]
    if opts.identity:
        cmd += ["-i", str(opts.identity)]
    return cmd


def _tail(text: str, n: int = 3) -> str:
    """The last n lines of a program's stderr in one line, its error lines first (pip ends with hints)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"(error|fatal|[\w.-]+error)\b", ln, re.I)]
    return " | ".join((errors or lines)[-n:])[-400:] or "no output"


def remote(opts: DeployOptions, step: str, script: str, stdin=None, timeout: float = 1800) -> str:
    """Run a POSIX sh script on the board; its stdout, or DeployError naming the step with stderr's tail."""
    cmd = [*ssh_base(opts), "--", opts.to.dest, script]
    log.debug("ssh: %s", script)
    try:
        res = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise DeployError(f"deploy step '{step}': no ssh on this machine (apt install openssh-client)") from None
    except subprocess.TimeoutExpired:
        raise DeployError(f"deploy step '{step}' on {opts.to.dest}: no answer in {timeout:.0f} s") from None
    if res.returncode != 0:
        what = "ssh could not connect" if res.returncode == 255 else f"exit {res.returncode}"
        raise DeployError(f"deploy step '{step}' failed on {opts.to.dest} ({what}): {_tail(res.stderr)}")
    return res.stdout


def _run_local(step: str, cmd: list[str], timeout: float = 1800) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise DeployError(f"deploy step '{step}': {cmd[0]} is not installed here") from None
    if res.returncode != 0:
        raise DeployError(f"deploy step '{step}' failed here ({shlex.join(cmd[:4])} ...: exit {res.returncode}): "
                          f"{_tail(res.stderr or res.stdout)}")
    return res.stdout


# ---------------------------------------------------------------------------------------------
# The plan

@dataclass
class _State:
    """What earlier steps found out, for later ones."""
    board_info: dict | None = None
    artifact: Path | None = None
    name: str | None = None
    wheels: Path | None = None  # the wheelhouse to copy
    runtime_wheel: str | None = None  # its boardtalk wheel's file name
    pip_wheel: str | None = None
    stamp: str | None = None
    verify: dict | None = None
    service: str | None = None


def plan(opts: DeployOptions) -> tuple[list[Step], _State]:
    """The steps for these options, in order (nothing runs yet)."""
    import boards
    import runtime

    profile = boards.get(opts.board)
    if opts.artifact and opts.out:
        raise ValueError("--artifact deploys an artifact already built; --out is where to build one: give one")
    if opts.out and opts.to and _tarball(opts.out):
        raise ValueError("--out must be a directory when deploying (--to); a tarball is for build-only runs")
    if opts.artifact and not Path(opts.artifact).exists():
        raise ValueError(f"--artifact {opts.artifact}: no such file or directory")
    if opts.transfer not in ("auto", "rsync", "tar"):
        raise ValueError(f"transfer must be auto, rsync or tar, got {opts.transfer!r}")
    st = _State()
    steps: list[Step] = []
    to, py = opts.to, shlex.split(opts.remote_python)
    if not py:
        raise ValueError("--remote-python is empty")
    pyq = shlex.join(py)
    stem = opts.model if "/" not in opts.model and not opts.model.endswith(".gguf") else Path(opts.model).stem
    build_dir = Path(opts.out) if opts.out and not _tarball(opts.out) else runtime.default_artifact(
        stem, opts.board, opts.backend)

    if to:
        def probe() -> str:
            out = remote(opts, "probe", f"{pyq} -c {shlex.quote(PROBE)}", timeout=120)
            try:
                info = json.loads(out.strip().splitlines()[-1])
            except (ValueError, IndexError):
                raise DeployError(f"deploy step 'probe': {opts.remote_python} on {to.dest} printed "
                                  f"{_tail(out, 1)!r}, not the probe's JSON") from None
            if tuple(info["python"][:2]) < MIN_PYTHON:
                raise DeployError(f"deploy step 'probe': {to.dest} has Python {'.'.join(map(str, info['python']))}; "
                                  f"the runtime needs >= {'.'.join(map(str, MIN_PYTHON))} (--remote-python)")
            machine = {"arm64": "aarch64", "amd64": "x86_64"}.get(info["machine"].lower(), info["machine"].lower())
            if machine != profile.arch:
                raise DeployError(f"deploy step 'probe': {to.dest} is {machine}, but board {profile.name} is "
                                  f"{profile.arch}: wrong --board or wrong host")
            if opts.backend == "native" and not info.get("gomp"):
                raise DeployError(f"deploy step 'probe': {to.dest} has no libgomp.so.1, the OpenMP runtime the native "
                                  "kernels link: install it there (apt install libgomp1), or --backend onnxruntime")
            info["machine"] = machine
            st.board_info = info
            return (f"Python {'.'.join(map(str, info['python']))}, {machine}, glibc {info['glibc'] or '?'}, "
                    f"rsync {'yes' if info['rsync'] else 'no'}, systemctl {'yes' if info['systemctl'] else 'no'}")

        steps.append(Step("probe", f"ask {to.dest} for its Python, machine, glibc, rsync and systemctl",
                          [f"{shlex.join([*ssh_base(opts), '--', to.dest])} {pyq} -c '<probe script>'"], probe))

    if opts.artifact:
        def check_artifact() -> str:
            from runtime.artifact import ArtifactError, load_manifest, open_artifact

            art = open_artifact(opts.artifact)
            try:
                m = load_manifest(art)  # every file against the manifest before it travels
            except ArtifactError as e:
                raise DeployError(f"deploy step 'build': --artifact {opts.artifact}: {e}") from None
            if m.target.board != opts.board:
                raise DeployError(f"deploy step 'build': --artifact {opts.artifact} is for board {m.target.board}, "
                                  f"not {opts.board}")
            st.artifact, st.name = art, _artifact_name(m)
            return f"{art}: {m.model_name}, {m.backend}, {len(m.files)} files checked"

        steps.append(Step("build", f"use the built artifact {opts.artifact} (every file checked first)", [], check_artifact))
    else:
        def build() -> str:
            from models.build import build_artifact
            from runtime.artifact import load_manifest

            build_artifact(opts.model, build_dir, board=opts.board, backend=opts.backend,
                           max_context=opts.max_context, sign_key=opts.sign_key, progress=opts.progress)
            m = load_manifest(build_dir, verify_files=False)
            st.artifact, st.name = build_dir, _artifact_name(m)
            note = f"{build_dir} ({sum(f['size'] for f in m.files.values()) / 2**20:.1f} MiB"
            if m.kernels:
                note += f", kernels {m.kernels.file} ({m.kernels.simd}, {' '.join(m.kernels.cflags)})"
            if opts.out and _tarball(opts.out):
                pack_tarball(build_dir, Path(opts.out))
                note += f"; packed into {opts.out}"
            return note + ")"

        cmd = ["boardtalk", "build", "--model", opts.model, "--backend", opts.backend, "--board", opts.board,
               "--out", str(build_dir)]
        cmd += ["--max-context", str(opts.max_context)] if opts.max_context else []
        cmd += ["--sign-key", str(opts.sign_key)] if opts.sign_key else []
        cmds = [shlex.join(cmd)] + ([f"pack {build_dir} into {opts.out}"] if opts.out and _tarball(opts.out) else [])
        steps.append(Step("build", f"build {opts.model} ({opts.backend}) for {profile.name}: {profile.description}",
                          cmds, build))
    if not to:
        return steps, st

    d = to.dir
    extra = BACKEND_EXTRAS.get(opts.backend)

    def wheels() -> str:
        info = st.board_info
        pyver = f"{info['python'][0]}.{info['python'][1]}"
        if opts.wheels:
            st.wheels, st.runtime_wheel, st.pip_wheel = given_wheelhouse(Path(opts.wheels))
        else:
            st.wheels, st.runtime_wheel, st.pip_wheel = make_wheelhouse(pyver, info["machine"], info["glibc"], extra)
        st.stamp = wheelhouse_stamp(st.wheels)
        n = len(list(st.wheels.glob("*.whl")))
        mib = sum(p.stat().st_size for p in st.wheels.glob("*.whl")) / 2**20
        return f"{n} wheels ({mib:.1f} MiB) for cp{pyver.replace('.', '')} {info['machine']} in {st.wheels}"

    steps.append(Step("wheels", f"use the wheels in {opts.wheels}" if opts.wheels else
                      "make the runtime's wheels here for the board's Python and platform (needs PyPI or pip's cache "
                      "here; the board needs neither)", [] if opts.wheels else
                      [f"{sys.executable} -m pip wheel --no-deps -w WHEELS {REPO}",
                       f"{sys.executable} -m pip download --only-binary=:all: --platform manylinux_2_<glibc>_"
                       f"{profile.arch} --python-version <board's> -d WHEELS WHEELS/boardtalk-*.whl"
                       f"{f'[{extra}]' if extra else ''} pip"], wheels))

    def copy() -> str:
        use_rsync = _use_rsync(opts, st.board_info)
        name = st.name
        remote(opts, "copy", f"mkdir -p {shlex.quote(d)}/wheels {shlex.quote(d)}/artifacts/{name}.new "
                             f"{shlex.quote(d)}/bin", timeout=120)
        if use_rsync:
            rsh = shlex.join(ssh_base(opts))
            _run_local("copy", ["rsync", "-a", "--delete", "-e", rsh, f"{st.wheels}/", f"{to.dest}:{d}/wheels/"])
            _run_local("copy", ["rsync", "-a", "--delete", f"--link-dest=../{name}", "-e", rsh, f"{st.artifact}/",
                                f"{to.dest}:{d}/artifacts/{name}.new/"])
        else:
            tar_over_ssh(opts, "copy", st.wheels, f"{d}/wheels")
            tar_over_ssh(opts, "copy", st.artifact, f"{d}/artifacts/{name}.new")
        return f"with {'rsync' if use_rsync else 'tar over ssh'} to {to.dest}:{d}"

    steps.append(Step("copy", f"copy the wheels to {d}/wheels and the artifact to {d}/artifacts/NAME.new (rsync over "
                              "ssh, unchanged files hard-linked to the live copy; tar over ssh without rsync)",
                      [f"rsync -a --delete -e '{shlex.join(ssh_base(opts))}' WHEELS/ {to.dest}:{d}/wheels/",
                       f"rsync -a --delete --link-dest=../NAME -e '...' ARTIFACT/ {to.dest}:{d}/artifacts/NAME.new/"],
                      copy))

    def install() -> str:
        out = remote(opts, "install", install_script(d, pyq, st.pip_wheel, st.runtime_wheel, extra, st.stamp))
        return out.strip().splitlines()[-1] if out.strip() else "installed"

    steps.append(Step("install", f"install the runtime into {d}/runtime from the copied wheels only (pip run from its "
                                 "wheel, --no-index --target); write the launcher bin/boardtalk",
                      [f"ssh {to.dest} '{opts.remote_python} {d}/wheels/pip-*.whl/pip install --no-index --find-links "
                       f"{d}/wheels --target {d}/runtime.new boardtalk{f'[{extra}]' if extra else ''} && mv ...'"],
                      install))

    def verify_step() -> str:
        out = remote(opts, "verify", f"{shlex.quote(d)}/bin/boardtalk verify --json --artifact "
                                     f"{shlex.quote(d)}/artifacts/{st.name}.new")
        try:
            st.verify = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise DeployError(f"deploy step 'verify': the board printed {_tail(out, 1)!r}, not verify's JSON") from None
        v = st.verify
        kern = f", kernels {v['kernels']}" if v.get("kernels") else ""
        return (f"backend {v['backend']}{kern}, {v['threads']} threads, {v['files']} files ok; TTFT "
                f"{v['ttft_ms']:.0f} ms, {v['decode_tokens_per_s']:.1f} tok/s; ids {v['token_ids']}")

    steps.append(Step("verify", "on the board: checksums, a greedy smoke test, backend, threads, TTFT, tok/s "
                                "(the live artifact is untouched if this fails)",
                      [f"ssh {to.dest} {d}/bin/boardtalk verify --json --artifact {d}/artifacts/NAME.new"],
                      verify_step))

    def switch() -> str:
        remote(opts, "switch", switch_script(d, st.name), timeout=120)
        return f"{d}/artifacts/{st.name} is live; {d}/current -> it"

    steps.append(Step("switch", "NAME.new becomes NAME by renames (a running service keeps its mapped files); "
                                "current -> artifacts/NAME",
                      [f"ssh {to.dest} 'cd {d}/artifacts && mv NAME NAME.old; mv NAME.new NAME; rm -rf NAME.old'"],
                      switch))

    def restart() -> str:
        out = remote(opts, "restart", restart_script(opts.service), timeout=180).strip()
        st.service = out.splitlines()[-1] if out else "none"
        return {"restarted": f"systemctl restart {opts.service}", "restarted-user":
                f"systemctl --user restart {opts.service}"}.get(st.service, f"no enabled {opts.service} unit: nothing "
                                                                            "to restart")

    steps.append(Step("restart", f"restart the {opts.service} service if it is enabled there",
                      [f"ssh {to.dest} 'systemctl is-enabled {opts.service} && systemctl restart {opts.service}'"],
                      restart))
    return steps, st


def _tarball(path: str) -> bool:
    return str(path).endswith((".tar", ".tar.gz", ".tgz"))


def _artifact_name(m) -> str:
    """The artifact's directory name on the board: registry-name-backend-board, plain characters only."""
    model = str(m.source.get("registry_name") or m.model_name)
    model = Path(model).stem if model.endswith(".gguf") else model
    return re.sub(r"[^A-Za-z0-9._-]", "_", f"{model}-{m.backend}-{m.target.board}")


def _use_rsync(opts: DeployOptions, info: dict) -> bool:
    here = shutil.which("rsync") is not None
    if opts.transfer == "rsync" and not (here and info["rsync"]):
        raise DeployError(f"deploy step 'copy': --transfer rsync, but rsync is missing "
                          f"{'here' if not here else 'on ' + opts.to.dest} (apt install rsync, or --transfer tar)")
    return opts.transfer == "rsync" or (opts.transfer == "auto" and here and info["rsync"])


# ---------------------------------------------------------------------------------------------
# What the steps do

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


def tar_over_ssh(opts: DeployOptions, step: str, src: Path, dest: str) -> None:
    """src's files into dest on the board (emptied first) as one tar stream through ssh."""
    q = shlex.quote(dest)
    cmd = [*ssh_base(opts), "--", opts.to.dest, f"rm -rf {q} && mkdir -p {q} && tar -C {q} -xf -"]
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err)
        try:
            with tarfile.open(fileobj=proc.stdin, mode="w|") as tf:
                for p in sorted(src.iterdir()):
                    if p.is_file() and not p.name.endswith(".lock"):
                        tf.add(p, arcname=p.name, recursive=False)
        except BrokenPipeError:
            pass  # ssh ended early: its status and stderr say why
        finally:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
        rc = proc.wait()
        err.seek(0)
        if rc != 0:
            raise DeployError(f"deploy step '{step}' failed on {opts.to.dest} (tar over ssh, exit {rc}): "
                              f"{_tail(err.read().decode('utf-8', 'replace'))}")


def install_script(d: str, pyq: str, pip_wheel: str, runtime_wheel: str, extra: str | None, stamp: str) -> str:
    """Board side: install the runtime from d/wheels into d/runtime (skipped when the stamp matches), and
    write d/bin/boardtalk. Only sh, the board's Python and the copied wheels are used."""
    q = shlex.quote(d)
    req = shlex.quote(f"wheels/{runtime_wheel}" + (f"[{extra}]" if extra else ""))
    launcher = ("#!/bin/sh\n# written by boardtalk deploy: the runtime in ../runtime, run by the board's Python\n"
                'DIR=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)\n'
                # for 'boardtalk install-service': the unit's ExecStart must be this launcher, not bare python
                'BOARDTALK_LAUNCHER="$DIR/bin/boardtalk"; export BOARDTALK_LAUNCHER\n'
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


# ---------------------------------------------------------------------------------------------
# CLI (boardtalk deploy, scripts/cross_compile.py)

def options_from_args(args) -> DeployOptions:
    return DeployOptions(
        board=args.board, to=parse_target(args.to, args.port) if args.to else None, model=args.model,
        backend=args.backend, max_context=args.max_context, sign_key=args.sign_key, artifact=args.artifact,
        out=args.out, wheels=args.wheels, identity=args.identity, ssh_options=list(args.ssh_option), remote_python=args.remote_python,
        transfer=args.transfer, service=args.service)


def main(args) -> int:
    """The deploy command: print each step as it runs (or, with --dry-run, only print them)."""
    import time

    if args.port and not args.to:
        raise ValueError("--port is for --to")
    opts = options_from_args(args)
    if not args.dry_run:
        from runtime.cli import _progress

        opts.progress = _progress
    steps, st = plan(opts)
    where = f"to {opts.to}" if opts.to else "(build only: no --to)"
    what = f"artifact {opts.artifact}" if opts.artifact else f"{opts.model} ({opts.backend})"
    print(f"deploy {what} for {opts.board} {where}: {len(steps)} step{'s' if len(steps) > 1 else ''}"
          f"{' (dry run: nothing is run)' if args.dry_run else ''}", file=sys.stderr)
    t_all = time.monotonic()
    for i, s in enumerate(steps, 1):
        print(f"[{i}/{len(steps)}] {s.name}: {s.what}", file=sys.stderr, flush=True)
        if args.dry_run:
            for c in s.commands:
                print(f"    $ {c}", file=sys.stderr)
            continue
        t0 = time.monotonic()
        note = s.run()
        print(f"    {note} ({time.monotonic() - t0:.1f} s)" if note else f"    done ({time.monotonic() - t0:.1f} s)",
              file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    if opts.to:
        print(f"deployed in {time.monotonic() - t_all:.1f} s: {opts.to.dest}:{opts.to.dir}/current -> "
              f"artifacts/{st.name}; run it there with {opts.to.dir}/bin/boardtalk chat --artifact "
              f"{opts.to.dir}/current", file=sys.stderr)
        print(json.dumps({"target": str(opts.to), "artifact": f"{opts.to.dir}/artifacts/{st.name}",
                          "service": st.service, "verify": st.verify}))
    else:
        print(opts.out if opts.out else st.artifact)
    return 0
