"""systemd integration: sd_notify on real datagram sockets, the progress watchdog, the unit file checked by
systemd-analyze (verify, and the security exposure score <= 2.0), and install-service's files."""
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.serve import systemd
from runtime.serve.systemd import BOARD_UNITS, UnitOptions, Watchdog, notify, render_unit

ROOT = Path(__file__).resolve().parents[1]


def _listener(tmp_path, abstract: bool):
    """(bound AF_UNIX datagram socket, the NOTIFY_SOCKET value naming it)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"boardtalk-test-{os.getpid()}-{time.monotonic_ns()}"
        s.bind("\0" + name)
        addr = "@" + name
    else:
        addr = str(tmp_path / "notify.sock")
        s.bind(addr)
    return s, addr


def _drain(s: socket.socket, seconds: float) -> list[bytes]:
    """Every datagram that arrives within ``seconds``."""
    out, end = [], time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        s.settimeout(left)
        try:
            out.append(s.recv(4096))
        except socket.timeout:
            break
    return out


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_notify_reaches_a_datagram_socket(tmp_path, monkeypatch, abstract):
    s, addr = _listener(tmp_path, abstract)
    with s:
        monkeypatch.setenv("NOTIFY_SOCKET", addr)
        assert notify("READY=1", "STATUS=serving")
        assert notify("WATCHDOG=1")
        assert notify("STOPPING=1")
        assert _drain(s, 1.0) == [b"READY=1\nSTATUS=serving", b"WATCHDOG=1", b"STOPPING=1"]


def test_notify_without_systemd_is_a_no_op(tmp_path, monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens.sock"))
    assert notify("READY=1") is False  # logged, never raised: a service must not die on a missing socket
    monkeypatch.setenv("NOTIFY_SOCKET", "relative/path")
    assert notify("READY=1") is False


def test_watchdog_from_env(monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert Watchdog.from_env() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert Watchdog.from_env().interval == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert Watchdog.from_env().interval == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # inherited from a parent: not ours to ping
    assert Watchdog.from_env() is None
    monkeypatch.delenv("WATCHDOG_PID")
    for bad in ("abc", "0", "-5"):
        monkeypatch.setenv("WATCHDOG_USEC", bad)
        assert Watchdog.from_env() is None


def test_watchdog_pings_while_beats_continue_and_stops_when_they_stop(tmp_path, monkeypatch):
    """A long busy generation (beats every step) keeps the pings going; a hung one (no beats) stops them,
    so systemd restarts the service."""
    s, addr = _listener(tmp_path, abstract=False)
    monkeypatch.setenv("NOTIFY_SOCKET", addr)
    wd = Watchdog(interval=1.0).start()  # a beat counts for 0.5 s; the pinger wakes every 0.25 s
    try:
        busy = []
        t_end = time.monotonic() + 2.0
        while time.monotonic() < t_end:  # "decode steps" for 2 s: far longer than the interval
            wd.beat()
            busy += _drain(s, 0.05)
        assert len(busy) >= 3 and set(busy) == {b"WATCHDOG=1"}, busy
        _drain(s, 1.0)  # beats stopped: pings already decided may still arrive within ~0.5 s
        hung = _drain(s, 1.5)
        assert hung == [], f"pinged {len(hung)} times without progress"
        assert wd.missed >= 3
        wd.beat()  # progress again: pings resume
        assert _drain(s, 0.6)
    finally:
        wd.stop()
        s.close()


# -- the unit file ------------------------------------------------------------------------------------------
def _analyze():
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is missing (apt-get install systemd)")
    return exe


def _unit(tmp_path, board: str) -> Path:
    argv, _ = systemd.entry_point()
    path = tmp_path / "boardtalk.service"
    path.write_text(render_unit(UnitOptions(exec_start=tuple(argv), board=board)))
    return path


@pytest.mark.parametrize("board", list(BOARD_UNITS))
def test_unit_passes_systemd_analyze_verify(tmp_path, board):
    exe = _analyze()
    r = subprocess.run([exe, "verify", str(_unit(tmp_path, board))], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and "boardtalk" not in r.stderr, r.stderr


@pytest.mark.parametrize("board", list(BOARD_UNITS))
def test_unit_exposure_is_at_most_2(tmp_path, board):
    exe = _analyze()
    r = subprocess.run([exe, "security", "--offline=true", "--threshold=20", str(_unit(tmp_path, board))],
                       capture_output=True, text=True, cwd=tmp_path)
    line = [ln for ln in r.stdout.splitlines() if "Overall exposure level" in ln]
    assert line, r.stdout + r.stderr
    score = float(line[0].split(":")[1].split()[0])
    print(f"{board}: exposure {score}")
    assert score <= 2.0, r.stdout


def test_unit_keeps_the_sound_card_and_the_promised_settings():
    text = render_unit(UnitOptions(exec_start=("/opt/bt/bin/boardtalk", "serve"), board="pi5"))
    for line in ("Type=notify", "Restart=on-failure", "After=sound.target network-online.target", "NoNewPrivileges=yes",
                 "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes", "SystemCallFilter=@system-service",
                 "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", "DevicePolicy=closed", "DeviceAllow=char-alsa rw",
                 "SupplementaryGroups=audio", "MemoryMax=1G", "User=boardtalk", f"WatchdogSec={systemd.WATCHDOG_SEC}s",
                 "StateDirectory=boardtalk", "CacheDirectory=boardtalk"):
        assert line in text.splitlines(), line
    assert "PrivateDevices=yes" not in text  # it would hide /dev/snd
    jetson = render_unit(UnitOptions(exec_start=("/opt/bt/bin/boardtalk",), board="jetson-orin-nano"))
    assert "DeviceAllow=/dev/nvmap rw" in jetson and "DeviceAllow=char-nvidia* rw" in jetson
    assert "SupplementaryGroups=audio video render" in jetson


def test_unit_rejects_bad_values():
    ok = ("/usr/bin/boardtalk", "serve")
    with pytest.raises(ValueError, match="MemoryMax"):
        render_unit(UnitOptions(exec_start=ok, memory_max="lots"))
    with pytest.raises(ValueError, match="user or group"):
        render_unit(UnitOptions(exec_start=ok, user="root\nExecStartPre=/bin/sh"))
    with pytest.raises(ValueError, match="absolute"):
        render_unit(UnitOptions(exec_start=("boardtalk",)))
    with pytest.raises(ValueError, match="wildcards"):
        render_unit(UnitOptions(exec_start=ok, devices=("/dev/snd/*",)))
    with pytest.raises(ValueError, match="unknown board"):
        render_unit(UnitOptions(exec_start=ok, board="toaster"))


def test_exec_start_quotes_and_escapes():
    """A path with a space or a '%' must reach the service as one argument, unexpanded."""
    text = render_unit(UnitOptions(exec_start=("/opt/my boards/bin/boardtalk", "serve", "--config", "/etc/100%.yaml")))
    assert 'ExecStart="/opt/my boards/bin/boardtalk" serve --config /etc/100%%.yaml' in text


def test_a_venv_under_home_is_bound_back_read_only(tmp_path):
    argv, _ = systemd.entry_point()
    text = render_unit(UnitOptions(exec_start=tuple(argv), bind_read_only=("/home/pi/venv", "/home/pi/boardtalk")))
    assert "ProtectHome=tmpfs" in text and "BindReadOnlyPaths=/home/pi/venv /home/pi/boardtalk" in text
    assert "ProtectHome=yes" not in text
    path = tmp_path / "boardtalk.service"
    path.write_text(text)
    exe = _analyze()
    assert subprocess.run([exe, "verify", str(path)], capture_output=True, cwd=tmp_path).returncode == 0


# -- install-service ---------------------------------------------------------------------------------------
def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_install_service_dry_run_prints_the_unit_and_writes_nothing(tmp_path):
    before = sorted(tmp_path.rglob("*"))
    r = _cli("install-service", "--dry-run", "--board", "pi5", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("# boardtalk") and "[Service]" in r.stdout and "MemoryMax=1G" in r.stdout
    assert "serve --config /etc/boardtalk/config.yaml" in r.stdout
    assert sorted(tmp_path.rglob("*")) == before


def test_install_service_writes_unit_and_config_and_keeps_an_existing_config(tmp_path):
    r = _cli("install-service", "--root", str(tmp_path), "--board", "pi5", "--user", "bt")
    assert r.returncode == 0, r.stderr
    unit = (tmp_path / "etc/systemd/system/boardtalk.service").read_text()
    assert "User=bt" in unit and "MemoryMax=1G" in unit
    config = tmp_path / "etc/boardtalk/config.yaml"
    from runtime.serve.config import render_default

    assert config.read_text() == render_default()
    assert oct(config.stat().st_mode & 0o777) == "0o640"  # it may hold api_key
    assert "u bt -" in (tmp_path / "etc/sysusers.d/boardtalk.conf").read_text()
    assert (tmp_path / "etc/boardtalk/trusted_keys").is_dir()

    config.write_text("api:\n  port: 9999\n")  # the user's edits
    r = _cli("install-service", "--root", str(tmp_path), "--board", "host")
    assert r.returncode == 0, r.stderr
    assert config.read_text() == "api:\n  port: 9999\n"
    assert "kept the existing" in r.stderr
    assert "MemoryMax=2G" in (tmp_path / "etc/systemd/system/boardtalk.service").read_text()


def test_install_service_refuses_without_root_and_on_bad_input(tmp_path, monkeypatch, capsys):
    from runtime.cli import main

    monkeypatch.setattr(systemd.os, "geteuid", lambda: 1000)  # an ordinary user, also when the tests run as root
    assert main(["install-service"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run it as root" in err, err
    r = _cli("install-service", "--dry-run", "--memory-max", "lots")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "MemoryMax" in r.stderr, r.stderr
    r = _cli("install-service", "--root", str(tmp_path), "--user", "Bad User")
    assert r.returncode == 2 and "--user" in r.stderr, r.stderr
    assert not any(tmp_path.iterdir())


# -- boardtalk serve under a notify socket, for real ----------------------------------------------------------
def test_serve_reports_ready_pings_the_watchdog_and_stops_on_sigterm(tmp_path, tiny_artifact):
    """Type=notify as systemd runs it: READY=1 once warm, WATCHDOG=1 pings while idle (the serving loop's idle
    ticks beat), SIGHUP reloads without stopping, SIGTERM gives STOPPING=1 and exit status 0."""
    import signal

    s, addr = _listener(tmp_path, abstract=True)
    config = tmp_path / "config.yaml"
    config.write_text("audio:\n  enabled: false\n")
    env = {**os.environ, "NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "2000000"}
    env.pop("WATCHDOG_PID", None)
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--config", str(config), "--api",
                             "127.0.0.1:0", "--artifact", str(tiny_artifact)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        end = time.monotonic() + 180
        while b"READY=1" not in b"\n".join(seen) and time.monotonic() < end and proc.poll() is None:
            seen += _drain(s, 0.5)
        assert any(m.startswith(b"READY=1") for m in seen), (seen, proc.poll())
        pings = [m for m in _drain(s, 3.0) if m == b"WATCHDOG=1"]
        assert len(pings) >= 2, pings  # every ~0.5 s with WatchdogSec=2s while idle
        proc.send_signal(signal.SIGHUP)
        assert [m for m in _drain(s, 2.0) if m == b"WATCHDOG=1"] and proc.poll() is None  # reloaded, still up
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
        rest = _drain(s, 0.5)
        print(f"SIGTERM -> exit {proc.returncode} in {took:.2f} s")
        assert proc.returncode == 0, err[-2000:]
        assert b"STOPPING=1" in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        s.close()


def test_a_long_generation_feeds_the_watchdog_and_a_hung_step_starves_it(tmp_path, monkeypatch, tiny_artifact):
    """With the service's scheduler: every decode step beats, so a generation far longer than the watchdog
    interval keeps the pings going; a forward pass that never returns stops them (systemd would restart)."""
    import threading

    import runtime
    from runtime.serve import scheduler as sch

    s, addr = _listener(tmp_path, abstract=False)
    monkeypatch.setenv("NOTIFY_SOCKET", addr)
    plain = sch.GatedSession._forward
    hang, release = threading.Event(), threading.Event()

    def slow_forward(self, ids, logits_from):  # a slow board: 50 ms a step; or a hung kernel
        if hang.is_set():
            release.wait(30)
        time.sleep(0.05)
        return plain(self, ids, logits_from)

    monkeypatch.setattr(sch.GatedSession, "_forward", slow_forward)
    model = runtime.load(tiny_artifact)
    wd = Watchdog(interval=1.0)
    sched = sch.Scheduler(model, sch.ComputeGate(on_step=wd.beat), queue_bound=2, beat=wd.beat)
    wd.start()
    sched.start()
    try:
        busy = sch.Job([{"role": "user", "content": "hi"}], runtime.GenerationConfig(max_new_tokens=60))
        sched.submit(busy)
        _drain(s, 0.3)
        during = _drain(s, 2.0)  # steps of 50 ms for 2 s: twice the interval
        assert not busy.done.is_set() and len(during) >= 3, (len(during), busy.done.is_set())
        busy.done.wait(30)
        hang.set()
        stuck = sch.Job([{"role": "user", "content": "hello"}], runtime.GenerationConfig(max_new_tokens=4))
        sched.submit(stuck)
        _drain(s, 1.2)  # the last beats age out
        silent = _drain(s, 1.5)
        assert silent == [] and not stuck.done.is_set(), silent
        release.set()
        assert stuck.done.wait(30)
    finally:
        release.set()
        sched.stop(1.0)
        wd.stop()
        s.close()


def test_entry_point_is_the_deployed_launcher_when_one_runs_us(tmp_path, monkeypatch):
    """Deploy review: install-service on a deployed board wrote ExecStart=python -m runtime.cli, whose
    PYTHONPATH lacks the deployed runtime; the launcher exports $BOARDTALK_LAUNCHER and must be used."""
    launcher = tmp_path / "bin" / "boardtalk"
    launcher.parent.mkdir()
    launcher.write_text("#!/bin/sh\n")
    launcher.chmod(0o755)
    monkeypatch.setenv("BOARDTALK_LAUNCHER", str(launcher))
    argv, _ = systemd.entry_point()
    assert argv[0] == str(launcher) and argv[1:] == ["serve", "--config", systemd.CONFIG_PATH]
    monkeypatch.setenv("BOARDTALK_LAUNCHER", "relative/boardtalk")  # not absolute: ignored
    assert systemd.entry_point()[0][0] != "relative/boardtalk"


def test_install_service_on_a_deployed_board_serves_the_deployed_artifact(tmp_path, monkeypatch):
    """Review: on a board set up by 'boardtalk deploy' the default config said model.artifact: null (this
    board's default artifact, which a board without models/ cannot build) and only DIR/bin was bound past
    ProtectHome; the config now names DIR/current and the whole deployed DIR is bound."""
    deployed = tmp_path / "home" / "boardtalk"
    (deployed / "bin").mkdir(parents=True)
    (deployed / "artifacts" / "smollm2").mkdir(parents=True)
    (deployed / "current").symlink_to("artifacts/smollm2")
    launcher = deployed / "bin" / "boardtalk"
    launcher.write_text("#!/bin/sh\n")
    launcher.chmod(0o755)
    monkeypatch.setenv("BOARDTALK_LAUNCHER", str(launcher))
    assert systemd.deployed_dir() == deployed.resolve()
    root = tmp_path / "root"
    root.mkdir()
    from runtime.cli import main

    assert main(["install-service", "--root", str(root), "--board", "pi5"]) == 0
    config = (root / "etc/boardtalk/config.yaml").read_text()
    assert f'artifact: "{deployed.resolve() / "current"}"' in config
    from runtime.serve.config import load_config

    assert load_config(root / "etc/boardtalk/config.yaml").model.artifact == str(deployed.resolve() / "current")
