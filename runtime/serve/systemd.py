"""systemd integration of ``boardtalk serve``: sd_notify, the watchdog, the unit file and ``install-service``.

    notify("READY=1")                      # False (a no-op) when not started by systemd with Type=notify
    wd = Watchdog.from_env()               # None unless systemd set WATCHDOG_USEC for this process
    wd.start(); ...; wd.beat(); ...; wd.stop()
    print(render_unit(UnitOptions(exec_start=..., board="pi5")))

sd_notify is a datagram of ``KEY=VALUE`` lines sent to the AF_UNIX socket named by $NOTIFY_SOCKET (a path, or
an abstract name written with a leading '@'); no libsystemd is needed.

The watchdog proves progress, not liveness: the serving loop calls ``beat()`` on every decode step, every
prefill chunk and every idle tick, and a pinger thread sends WATCHDOG=1 every interval/2 only while the last
beat is younger than interval/2. A generation that hangs inside one step stops the beats, the pings stop, and
systemd kills and restarts the service after WatchdogSec; a long generation that keeps stepping keeps beating.
"""
from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

UNIT_NAME = "boardtalk.service"
CONFIG_PATH = "/etc/boardtalk/config.yaml"
WATCHDOG_SEC = 30  # seconds without a beat before systemd restarts the service (the slowest step is ~1 s on a Pi 5)


def notify(*states: str) -> bool:
    """Send sd_notify states (e.g. "READY=1", "STATUS=warming up") to $NOTIFY_SOCKET. True when sent;
    False without $NOTIFY_SOCKET (not under systemd) or when the socket cannot be reached (logged)."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr or not states:
        return False
    if addr[0] not in "@/":
        log.warning("NOTIFY_SOCKET=%r is neither a path nor an abstract socket name; not notifying", addr)
        return False
    target = "\0" + addr[1:] if addr[0] == "@" else addr  # '@name' is Linux's abstract namespace
    msg = "\n".join(states).encode("utf-8")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(target)
            s.sendall(msg)
        return True
    except OSError as e:
        log.warning("sd_notify to %s failed: %s", addr, e)
        return False


class Watchdog:
    """WATCHDOG=1 pings while the serving loop makes progress (see the module docstring).

    interval: systemd's WatchdogSec in seconds. A beat counts for interval/2 seconds; the pinger wakes every
    interval/4, so at most interval/2 + interval/4 pass between two pings while beats continue (systemd
    restarts after a whole interval without one)."""

    def __init__(self, interval: float, clock=time.monotonic):
        if not interval > 0:
            raise ValueError(f"watchdog interval must be > 0 seconds, got {interval!r}")
        self.interval = float(interval)  # seconds
        self._clock = clock
        self._last_beat = clock()  # monotonic seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pings = 0  # WATCHDOG=1 messages sent
        self.missed = 0  # pinger wake-ups that found no recent beat (a stall)

    @classmethod
    def from_env(cls) -> "Watchdog | None":
        """A Watchdog for systemd's WATCHDOG_USEC, or None when it is unset/invalid or WATCHDOG_PID names
        another process (the variable was inherited by a child)."""
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec:
            return None
        if pid and pid.strip() != str(os.getpid()):
            return None
        try:
            value = int(usec)
        except ValueError:
            log.warning("WATCHDOG_USEC=%r is not an integer; watchdog off", usec)
            return None
        return cls(value / 1e6) if value > 0 else None

    def beat(self) -> None:
        """The serving loop made progress (a decode step, a prefill chunk, an idle tick). Cheap: one store."""
        self._last_beat = self._clock()

    def start(self) -> "Watchdog":
        if self._thread is None:
            self.beat()
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="systemd-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        fresh = self.interval / 2  # seconds a beat keeps the pings going
        while True:
            if self._clock() - self._last_beat < fresh:
                if notify("WATCHDOG=1"):
                    self.pings += 1
            else:
                self.missed += 1
                if self.missed == 1 or self.missed % 20 == 0:
                    log.warning("no progress for %.1f s: not pinging the watchdog (systemd restarts the service "
                                "after %.0f s)", self._clock() - self._last_beat, self.interval)
            if self._stop.wait(self.interval / 4):
                return


# -- the unit file --------------------------------------------------------------------------------------------
SOUND_DEVICES = ("char-alsa",)  # every ALSA node (/dev/snd/*): a glob is not allowed in DeviceAllow's paths
# Jetson (L4T): the iGPU's nvgpu nodes (/dev/nvhost-*, /dev/nvgpu/igpu0/*), nvmap (a misc device: named by
# path, "char-misc" would allow every misc device) and, on JetPack 6's OpenRM driver, /dev/nvidia*. Groups
# that a board lacks are ignored by systemd; install-service adds the nodes it finds on the board.
JETSON_DEVICES = ("char-nvidia*", "char-nvhost*", "char-nvgpu*", "char-host1x*", "/dev/nvmap")


@dataclass(frozen=True)
class BoardUnit:
    memory_max: str  # MemoryMax=: the model, the voice engines and Python fit with room to spare
    groups: tuple[str, ...]  # SupplementaryGroups= (the device nodes' owners)
    devices: tuple[str, ...]  # DeviceAllow= (read-write)


BOARD_UNITS: dict[str, BoardUnit] = {
    "host": BoardUnit("2G", ("audio",), SOUND_DEVICES),
    "pi5": BoardUnit("1G", ("audio",), SOUND_DEVICES),
    # CUDA's context and the unified memory it maps count against the cgroup on a Jetson
    "jetson-orin-nano": BoardUnit("3G", ("audio", "video", "render"), SOUND_DEVICES + JETSON_DEVICES),
    "jetson-agx-orin": BoardUnit("6G", ("audio", "video", "render"), SOUND_DEVICES + JETSON_DEVICES),
}


@dataclass(frozen=True)
class UnitOptions:
    exec_start: tuple[str, ...]  # argv of the service: the installed boardtalk, "serve", "--config", CONFIG
    board: str = "host"  # BOARD_UNITS key; also exported as BOARDTALK_BOARD
    user: str = "boardtalk"  # dedicated system user (created by install-service through sysusers.d)
    memory_max: str | None = None  # None: the board's
    groups: tuple[str, ...] | None = None  # None: the board's
    devices: tuple[str, ...] | None = None  # None: the board's
    bind_read_only: tuple[str, ...] = ()  # paths under /home or /root the service needs (a venv there)
    watchdog_sec: int = WATCHDOG_SEC
    stop_timeout_s: int = 10  # SIGKILL after this; the service itself exits within ~2 s of SIGTERM


_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,30}\Z")
_MEM = re.compile(r"[1-9][0-9]*[KMGT]?\Z|[1-9][0-9]?%\Z|100%\Z")


def _quote(arg: str) -> str:
    """One ExecStart= word: quoted when it has spaces or quotes; '%' and '$' escaped (systemd expands them)."""
    if "\n" in arg or not arg:
        raise ValueError(f"ExecStart argument {arg!r} is empty or has a newline")
    a = arg.replace("%", "%%").replace("$", "$$")
    if re.search(r'[\s"\'\\;]', a):
        a = '"' + a.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return a


def render_unit(o: UnitOptions) -> str:
    """The boardtalk.service unit file for these options (validated: a bad user, group or memory cap raises)."""
    if o.board not in BOARD_UNITS:
        raise ValueError(f"unknown board {o.board!r}; known: {', '.join(BOARD_UNITS)}")
    b = BOARD_UNITS[o.board]
    memory_max = o.memory_max or b.memory_max
    groups = b.groups if o.groups is None else o.groups
    devices = b.devices if o.devices is None else o.devices
    for name in (o.user, *groups):
        if not _NAME.match(name):
            raise ValueError(f"{name!r} is not a valid user or group name")
    if not _MEM.match(memory_max):
        raise ValueError(f"MemoryMax {memory_max!r}: give bytes with an optional K/M/G/T suffix or a percentage")
    if not o.exec_start or not os.path.isabs(o.exec_start[0]):
        raise ValueError(f"ExecStart must start with an absolute path, got {o.exec_start!r}")
    for d in devices:
        if not (d.startswith(("char-", "block-")) or (d.startswith("/dev/") and not re.search(r"[\s*?]", d))):
            raise ValueError(f"device {d!r}: give a /dev/ path (no wildcards) or char-GROUP")
    for p in o.bind_read_only:
        if not os.path.isabs(p) or re.search(r"\s", p):
            raise ValueError(f"path {p!r} must be absolute and without spaces")
    home = ["ProtectHome=yes"]
    if o.bind_read_only:  # an empty tmpfs over /home, /root and /run/user, with only these paths put back
        home = ["ProtectHome=tmpfs", "BindReadOnlyPaths=" + " ".join(o.bind_read_only)]
    lines = [
        "# boardtalk: written by 'boardtalk install-service' (docs/systemd.md explains every line).",
        "[Unit]",
        "Description=boardtalk on-device LLM service (voice loop, HTTP API, Wyoming)",
        "After=sound.target network-online.target",
        "Wants=network-online.target",
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        "ExecStart=" + " ".join(_quote(a) for a in o.exec_start),
        "ExecReload=/bin/kill -HUP $MAINPID",
        "Restart=on-failure",
        "RestartSec=2s",
        "# the first start may build this board's default artifact before READY=1",
        "TimeoutStartSec=15min",
        f"TimeoutStopSec={o.stop_timeout_s}s",
        f"WatchdogSec={o.watchdog_sec}s",
        f"User={o.user}",
        f"Group={o.user}",
        *([f"SupplementaryGroups={' '.join(groups)}"] if groups else []),
        "StateDirectory=boardtalk",
        "CacheDirectory=boardtalk",
        "ConfigurationDirectory=boardtalk",
        f"Environment=BOARDTALK_BOARD={o.board} BOARDTALK_CACHE=/var/cache/boardtalk HOME=/var/lib/boardtalk",
        "Environment=PYTHONUNBUFFERED=1",
        "UMask=0077",
        "# hardening: systemd-analyze security boardtalk.service",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        *home,
        "PrivateTmp=yes",
        "PrivateUsers=yes",
        "PrivateMounts=yes",
        "DevicePolicy=closed",
        *(f"DeviceAllow={d} rw" for d in devices),
        "CapabilityBoundingSet=",
        "AmbientCapabilities=",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "ProtectProc=invisible",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        "RemoveIPC=yes",
        "KeyringMode=private",
        "SystemCallArchitectures=native",
        "SystemCallFilter=@system-service",
        "# not ~@resources: OpenMP and onnxruntime may pin threads (sched_setaffinity)",
        "SystemCallFilter=~@privileged",
        "SystemCallErrorNumber=EPERM",
        "# not MemoryDenyWriteExecute: under it sounddevice's cffi audio callbacks and CTranslate2's oneDNN JIT",
        "# (Whisper on x86) fail (measured with prctl(PR_SET_MDWE), the same rule)",
        f"MemoryMax={memory_max}",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return "\n".join(lines)


# -- boardtalk install-service ---------------------------------------------------------------------------------
def deployed_dir() -> Path | None:
    """The directory 'boardtalk deploy' installed us into (runtime/, artifacts/, current, voice-assets/), when
    its launcher ($BOARDTALK_LAUNCHER = DIR/bin/boardtalk) runs us; else None."""
    launcher = os.environ.get("BOARDTALK_LAUNCHER")
    if launcher and os.path.isabs(launcher) and os.access(launcher, os.X_OK):
        return Path(launcher).resolve().parents[1]
    return None


def entry_point() -> tuple[list[str], list[str]]:
    """(ExecStart argv, paths to bind read-only): $BOARDTALK_LAUNCHER (a deployed board's launcher), else the
    ``boardtalk`` script beside this Python (a venv's bin/, not resolved through its symlinks), else this
    Python with -m runtime.cli. Paths under /home or /root are
    hidden by ProtectHome=, so the venv (and an editable checkout) are bound back read-only."""
    launcher = os.environ.get("BOARDTALK_LAUNCHER")  # set by the launcher 'boardtalk deploy' writes on a board
    script = Path(sys.executable).with_name("boardtalk")
    if launcher and os.path.isabs(launcher) and os.access(launcher, os.X_OK):
        argv = [launcher]  # it sets PYTHONPATH to the deployed runtime; bare python -m would not find it
    else:
        argv = [str(script)] if os.access(script, os.X_OK) else [sys.executable, "-m", "runtime.cli"]
    argv += ["serve", "--config", CONFIG_PATH]
    import runtime

    binds = []
    deployed = deployed_dir()  # all of it: the runtime, the live artifact and the voice model files
    for p in ((deployed,) if deployed else ()) + (Path(sys.prefix), Path(runtime.__file__).resolve().parents[1],
                                                  Path(argv[0]).parent):
        if p.parts[1:2] in (("home",), ("root",)) and not any(str(p).startswith(b + "/") or str(p) == b for b in binds):
            binds.append(str(p))
    return argv, binds


def _existing_groups(root: Path, wanted: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(groups in root's /etc/group, those missing); all of them when root has no /etc/group (a packaging
    root: the target system has them). A missing supplementary group would stop the unit from starting."""
    try:
        names = {line.split(":", 1)[0] for line in (root / "etc/group").read_text().splitlines() if ":" in line}
    except FileNotFoundError:
        return list(wanted), []
    return [g for g in wanted if g in names], [g for g in wanted if g not in names]


def _jetson_nodes() -> list[str]:
    """The nvgpu/nvmap/host1x device nodes present on this machine (empty off a Jetson)."""
    found = set()
    for pattern in ("/dev/nvhost-*", "/dev/nvgpu/*/*", "/dev/nvmap", "/dev/host1x-fence", "/dev/nvidia*"):
        found.update(p for p in glob.glob(pattern) if Path(p).is_char_device())
    return sorted(found)


def _write(path: Path, text: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def sysusers(user: str, groups: list[str]) -> str:
    """sysusers.d(5) lines: the service's system user (home = its StateDirectory, no login) in its groups."""
    lines = ["# boardtalk service user: written by 'boardtalk install-service'",
             f'u {user} - "boardtalk service" /var/lib/boardtalk /usr/sbin/nologin']
    return "\n".join(lines + [f"m {user} {g}" for g in groups]) + "\n"


def cmd_install_service(args) -> int:
    import boards

    # ValueError/PermissionError, not runtime.cli.CliError: under 'python -m runtime.cli' that module is __main__
    board = args.board or boards.detect().name
    if board not in BOARD_UNITS:
        raise ValueError(f"no unit defaults for board {board!r}; known: {', '.join(BOARD_UNITS)} (pass --board)")
    if not _NAME.match(args.user):
        raise ValueError(f"--user {args.user!r} is not a valid user name (lower case letters, digits, _ and -)")
    root = Path(args.root or "/")
    if not root.is_dir():
        raise ValueError(f"--root {root} is not a directory (create it first)")
    if not args.dry_run and args.root is None and os.geteuid() != 0:
        raise PermissionError("install-service writes /etc/systemd/system and creates a system user: run it as root "
                       "(sudo boardtalk install-service), or see the unit with --dry-run")
    argv, binds = entry_point()
    b = BOARD_UNITS[board]
    devices = list(b.devices)
    if board.startswith("jetson"):
        devices += [n for n in _jetson_nodes() if n not in devices]
    groups, missing = _existing_groups(root if args.root else Path("/"), b.groups)
    opts = UnitOptions(exec_start=tuple(argv), board=board, user=args.user, memory_max=args.memory_max,
                       groups=tuple(groups), devices=tuple(devices), bind_read_only=tuple(binds))
    unit = render_unit(opts)  # validates --memory-max before anything is written
    if args.dry_run:
        sys.stdout.write(unit)
        return 0
    note = lambda msg: print(f"install-service: {msg}", file=sys.stderr)  # noqa: E731
    if missing:
        note(f"group(s) {', '.join(missing)} do not exist on this system: left out of SupplementaryGroups=")
    for p in binds:
        note(f"{p} is under a home directory: bound read-only into the service; user {args.user} must be able to "
             f"read it (a system-wide install, e.g. a venv in /opt/boardtalk, avoids this)")
    unit_path = root / "etc/systemd/system" / UNIT_NAME
    existed = unit_path.exists()
    _write(unit_path, unit, 0o644)
    note(f"{'replaced' if existed else 'wrote'} {unit_path}")
    _write(root / "etc/sysusers.d/boardtalk.conf", sysusers(args.user, groups), 0o644)
    config = root / CONFIG_PATH.lstrip("/")
    if config.exists():
        note(f"kept the existing {config} (never overwritten; 'boardtalk serve --print-config' shows the defaults)")
    else:
        from runtime.serve.config import render_default

        deployed = deployed_dir()
        artifact = deployed / "current" if deployed and (deployed / "current").exists() else None
        _write(config, render_default(artifact=str(artifact) if artifact else None), 0o640)
        note(f"wrote the default config {config}" + (f" (model.artifact: {artifact}, the deployed artifact)"
                                                     if artifact else ""))
    (root / "etc/boardtalk/trusted_keys").mkdir(parents=True, exist_ok=True)
    if args.root is not None:
        note(f"--root {root}: no user created, systemctl not run")
        return 0
    _run(["systemd-sysusers", "/etc/sysusers.d/boardtalk.conf"], note)
    try:
        shutil.chown(config, group=args.user)  # the config may hold api_key: readable by root and the service only
    except (LookupError, OSError) as e:
        note(f"could not give {config} to group {args.user}: {e}")
    if Path("/run/systemd/system").is_dir():
        _run(["systemctl", "daemon-reload"], note)
        note(f"start it: systemctl enable --now {UNIT_NAME}; logs: journalctl -u {UNIT_NAME} -f")
    else:
        note("systemd is not running here: the unit takes effect on the next boot with systemd")
    return 0


def _run(cmd: list[str], note) -> None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        note(f"{cmd[0]} failed: {e}")
        return
    if r.returncode:
        note(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()[:300]}")


def add_commands(sub) -> None:
    from runtime.cli import _path

    p = sub.add_parser("install-service", help="install boardtalk serve as a systemd service",
                       description="Write /etc/systemd/system/boardtalk.service (Type=notify, watchdog, hardened: "
                                   "see docs/systemd.md), a sysusers.d entry for the service user (created now, in "
                                   "group audio) and, if none exists, the default /etc/boardtalk/config.yaml. An "
                                   "existing config is never overwritten. Needs root, except with --dry-run.")
    p.add_argument("--user", default="boardtalk", metavar="NAME",
                   help="system user the service runs as; created if missing (default: %(default)s)")
    p.add_argument("--board", choices=list(BOARD_UNITS),
                   help="board whose devices and memory cap the unit gets (default: $BOARDTALK_BOARD or detected)")
    p.add_argument("--memory-max", metavar="SIZE",
                   help="MemoryMax= of the unit, e.g. 1536M (default: the board's: "
                        + ", ".join(f"{k} {v.memory_max}" for k, v in BOARD_UNITS.items()) + ")")
    p.add_argument("--dry-run", action="store_true",
                   help="print the unit file to stdout and write nothing (default: install)")
    p.add_argument("--root", metavar="DIR", type=_path,
                   help="install into DIR instead of / (packaging, tests): no root needed, no user created, "
                        "systemctl not run (default: /)")
    p.set_defaults(func=cmd_install_service)
