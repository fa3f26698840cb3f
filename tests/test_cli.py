"""The ``boardtalk`` CLI as a user runs it: subprocesses (signals, pipes, a pty) on the tiny model,
and main() in-process for parsing and error reporting."""
import argparse
import importlib.util
import json
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import runtime
from runtime.cli import BUILD_EXTRA, build_parser, main

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("build", "generate", "chat", "perplexity", "keygen", "sign", "voice", "verify", "deploy", "serve",
            "install-service")
STATS = rb"\[(\d+) prompt tokens \((\d+) cached\), (\d+) new; [^\]\n]*; ([a-z ]+)\]"


def _env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if k != "BOARDTALK_TRUSTED_KEYS"}
    env.update(PYTHONPATH=str(ROOT), BOARDTALK_CACHE=str(tmp_path / "cache"), BOARDTALK_BOARD="host", **extra)
    return env


def _cli(tmp_path, *args, env=None, code=None, input=None):
    """Run boardtalk (or, with code, a python -c wrapper that ends by calling runtime.cli.main)."""
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "runtime.cli"]
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, cwd=ROOT, input=input,
                          env=_env(tmp_path, **(env or {})), timeout=300)


def _popen(tmp_path, *args, env=None, code=None, **kw):
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "runtime.cli"]
    return subprocess.Popen([*cmd, *map(str, args)], cwd=ROOT, env=_env(tmp_path, **(env or {})), **kw)


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def long_artifact(tiny_gguf, tmp_path_factory):
    """The tiny model on the native backend with its whole 512-position context, built for 'host':
    long gibberish replies (no end-of-turn id comes) at a few ms a token, time to interrupt them."""
    from models.build import build_artifact

    out = tmp_path_factory.mktemp("cli") / "long"
    build_artifact(str(tiny_gguf), out, board="host", backend="native", max_context=512)
    return out


# ---- build, generate, perplexity -------------------------------------------------------------

@pytest.mark.parametrize("backend,progress,summary", [("native", "regroup weights", "copied as stored"),
                                                      ("onnxruntime", "layer 1", "graph nodes")])
def test_cli_build_generate_perplexity(tiny_gguf, tmp_path, backend, progress, summary):
    """build's line used to say '0 graph nodes; worst weight error 0' of native artifacts (which have no
    graph): it now prints the export report's own summary."""
    out = tmp_path / "art"
    r = _cli(tmp_path, "build", "--model", tiny_gguf, "--board", "host", "--backend", backend, "--out", out,
             "--max-context", "128")
    assert r.returncode == 0, r.stderr
    assert progress in r.stderr and r.stdout.strip() == str(out)  # progress went to stderr, the path to stdout
    assert summary in r.stderr and (backend == "onnxruntime" or "0 graph nodes" not in r.stderr)
    r = _cli(tmp_path, "generate", "--artifact", out, "--prompt", "the cat", "--max-new-tokens", "5", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert len(res["token_ids"]) == 5 and res["prompt_ids"] and isinstance(res["text"], str)
    assert res["ttft_ms"] > 0 and res["decode_tokens_per_s"] > 0
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat " * 10)
    r = _cli(tmp_path, "perplexity", "--artifact", out, "--text-file", text, "--max-tokens", "64", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["n_tokens"] == 63 and res["ppl"] > 1


def test_cli_errors_are_clear(tmp_path):
    r = _cli(tmp_path, "generate", "--artifact", tmp_path / "missing", "--prompt", "x")
    line = _one_error_line(r.stderr)
    assert r.returncode == 2 and "artifact not found" in line and "boardtalk build" in line
    r = _cli(tmp_path, "build", "--model", "no-such-model", "--out", tmp_path / "o")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[-1].startswith("boardtalk: error: unknown model 'no-such-model'")
    r = _cli(tmp_path, "--help")
    assert r.returncode == 0 and "build" in r.stdout and "perplexity" in r.stdout


# ---- defect 10: Ctrl-C and closed pipes ------------------------------------------------------

def test_ctrl_c_in_generate_is_one_line_and_130(long_artifact, tmp_path):
    """Ctrl-C in generate printed a 24-42-line traceback; now one line 'boardtalk: interrupted', exit 130."""
    p = _popen(tmp_path, "generate", "--artifact", long_artifact, "--prompt", "the cat", "--max-new-tokens", "400",
               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert os.read(p.stdout.fileno(), 16)  # the reply has started
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130
    assert err.decode().strip().splitlines() == ["boardtalk: interrupted"], err.decode()


@pytest.mark.parametrize("command", ["perplexity", "build"])
def test_ctrl_c_in_perplexity_and_build_is_one_line_and_130(tiny_gguf, tmp_path, monkeypatch, capsys, command):
    """Ctrl-C in perplexity and build printed a traceback; now one line and exit 130 (the interrupt is
    raised where the model would load or build, as a signal there would)."""
    import models.build

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(runtime, "load", interrupted)
    monkeypatch.setattr(models.build, "build_artifact", interrupted)
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat")
    argv = {"perplexity": ["perplexity", "--artifact", tmp_path, "--text-file", text],
            "build": ["build", "--model", tiny_gguf, "--board", "host", "--out", tmp_path / "o"]}[command]
    assert main([str(a) for a in argv]) == 130
    err = capsys.readouterr().err  # build first says what it builds
    assert err.endswith("\nboardtalk: interrupted\n" if command == "build" else "boardtalk: interrupted\n"), err
    assert err.count("\n") == (2 if command == "build" else 1)


def test_closed_stdout_exits_quietly(long_artifact, tmp_path):
    """'boardtalk generate | head' gave a BrokenPipeError traceback and exit 1; now nothing is printed and
    the status is 141 (128 + SIGPIPE), what cat or grep report when the reader goes away."""
    p = _popen(tmp_path, "generate", "--artifact", long_artifact, "--prompt", "the cat", "--max-new-tokens", "400",
               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert len(os.read(p.stdout.fileno(), 5)) > 0  # head -c 5
        p.stdout.close()
        err = p.stderr.read().decode()
        p.wait(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 141 and err == "", err


def test_ctrl_c_at_the_chat_prompt_is_130(long_artifact, tmp_path):
    """Ctrl-C at the chat prompt exited 0 as if the user had quit; now 'boardtalk: interrupted', 130."""
    p = _popen(tmp_path, "chat", "--artifact", long_artifact, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
               stderr=subprocess.PIPE)
    try:
        assert b"quits" in p.stderr.readline()  # the banner: the prompt comes next
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130 and err.decode().strip().splitlines()[-1] == "boardtalk: interrupted"
    assert "Traceback" not in err.decode()


# ---- defects 11 and 13: chat keeps going -----------------------------------------------------

def test_chat_keeps_the_conversation_when_it_outgrows_the_context(long_artifact, tmp_path):
    """Long conversations: the CLI chat quit and lost the history when the conversation outgrew the context.
    Now it goes on, drops what the model left out from its own history and says so in one line."""
    r = _cli(tmp_path, "chat", "--artifact", long_artifact, "--max-context", "256", "--max-new-tokens", "200",
             "--system", "be brief", input="hello\ntell me more\nand again\n")
    assert r.returncode == 0, r.stderr
    assert len(re.findall(STATS.decode(), r.stderr)) == 3, r.stderr
    notes = re.findall(r"\[context full: left out the (\d+) oldest messages\]", r.stderr)
    # the history the CLI keeps is what the model sees: each time the oldest turn (2 messages) goes;
    # without trimming its own copy, the third turn would leave out 4
    assert notes and set(notes) == {"2"}, r.stderr


class _Term:
    """Reads a pty until a pattern shows up."""

    def __init__(self, fd: int):
        self.fd, self.buf = fd, b""

    def expect(self, pattern: bytes, timeout: float = 120):
        rx, deadline = re.compile(pattern), time.monotonic() + timeout
        while True:
            m = rx.search(self.buf)
            if m:
                self.buf = self.buf[m.end() :]
                return m
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {pattern!r}; last output {self.buf[-300:]!r}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    data = os.read(self.fd, 4096)
                except OSError:  # EIO: the child closed the pty
                    data = b""
                assert data, f"chat ended while waiting for {pattern!r}; last output {self.buf[-300:]!r}"
                self.buf += data

    def read_some(self, timeout: float = 60) -> bytes:
        assert select.select([self.fd], [], [], timeout)[0], "no output"
        data = os.read(self.fd, 4096)
        self.buf += data
        return data

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)


def test_chat_in_a_terminal(long_artifact, tmp_path):
    """Ctrl-C in chat should cancel the turn and keep the session (the generator was already dead when
    cancel() ran, and the chat ended). In a pty: a reply and its stats line; the context fills and the
    oldest turn is left out; Ctrl-C during a long reply brings the prompt back with the reply cut
    ('cancelled'); the next message gets a reply; Ctrl-D exits 0."""
    env = _env(tmp_path)
    argv = [sys.executable, "-m", "runtime.cli", "chat", "--artifact", str(long_artifact), "--max-context", "256",
            "--max-new-tokens", "200"]
    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its controlling terminal, so \x03 is SIGINT
        try:
            os.chdir(ROOT)
            os.execve(sys.executable, argv, env)
        finally:
            os._exit(127)
    term = _Term(fd)
    try:
        term.expect(rb"Ctrl-D quits\.")
        term.expect(rb"> ")
        term.send(b"hello\r")
        m = term.expect(STATS)
        assert m.group(4) == b"length" and int(m.group(3)) == 200
        term.expect(rb"> ")
        term.send(b"tell me more\r")
        term.expect(rb"\[context full: left out the 2 oldest messages\]")
        term.read_some()  # the reply is streaming
        term.send(b"\x03")
        m = term.expect(STATS)
        assert m.group(4) == b"cancelled" and int(m.group(3)) < 200
        term.expect(rb"> ")
        term.send(b"and again\r")
        m = term.expect(STATS)
        assert int(m.group(3)) > 0 and m.group(4) != b"cancelled"
        term.expect(rb"> ")
        term.send(b"\x04")
        _, status = os.waitpid(pid, 0)
        pid = 0
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, term.buf[-500:]
        assert b"Traceback" not in term.buf
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)


# ---- defect 13: options ----------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "x", "--max-context", "-5"],
    ["generate", "--prompt", "x", "--max-context", "1"],
    ["generate", "--prompt", "x", "--threads", "0"],
    ["generate", "--prompt", "x", "--threads", "257"],
    ["generate", "--prompt", "x", "--temperature", "inf"],
    ["generate", "--prompt", "x", "--temperature", "nan"],
    ["generate", "--prompt", "x", "--temperature", "-1"],
    ["generate", "--prompt", "x", "--top-p", "0"],
    ["generate", "--prompt", "x", "--top-p", "1.5"],
    ["generate", "--prompt", "x", "--top-k", "-1"],
    ["generate", "--prompt", "x", "--max-new-tokens", "0"],
    ["generate", "--prompt", "x", "--repetition-penalty", "0"],
    ["generate", "--prompt", "x", "--seed", "-1"],
    ["generate", "--prompt", "x", "--stop", ""],
    ["chat", "--threads", "two"],
    ["perplexity", "--text-file", "t", "--max-tokens", "1"],
    ["build", "--max-context", "-5"],
])
def test_numeric_options_are_checked_when_parsed(argv, capsys):
    """--max-context -5 ended in a numpy reshape error, --temperature inf/nan reached the sampler: every
    numeric option is now checked by argparse, in one line that names it."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"boardtalk {argv[0]}: error: argument {argv[-2]}"), line


def test_prompt_errors_name_the_fix(tiny_artifact, tmp_path, capsys):
    """'set truncate_prompt=True' named no CLI flag, --prompt '' talked about token ids and --system without
    --chat was silently ignored. Now: --truncate-prompt exists and the over-long error names it (with the
    numbers), an empty prompt is 'the prompt is empty', and --system needs --chat."""
    art = ["--artifact", str(tiny_artifact), "--max-new-tokens", "3"]
    assert main(["generate", *art, "--prompt", "the cat sat " * 200]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "more than 128 tokens" in line and "--truncate-prompt" in line and "context holds 128" in line
    assert main(["generate", *art, "--prompt", "the cat sat " * 200, "--truncate-prompt", "--json"]) == 0
    capsys.readouterr()
    assert main(["generate", *art, "--prompt", ""]) == 2
    assert _one_error_line(capsys.readouterr().err) == "boardtalk: error: the prompt is empty"
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["generate", *art, "--prompt-file", str(empty)]) == 2
    assert "the prompt is empty" in _one_error_line(capsys.readouterr().err)
    assert main(["generate", *art, "--prompt", "hi", "--system", "be brief"]) == 2
    assert "--system needs --chat" in _one_error_line(capsys.readouterr().err)
    assert main(["generate", *art, "--prompt", "hi", "--system", "be brief", "--chat", "--json"]) == 0


def test_every_option_has_help_with_its_default():
    """Most options had no help text: now every option of every command explains itself and its default,
    and 'boardtalk --help' lists every command with one line each."""
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(COMMANDS)
    for name, sp in sub.choices.items():
        for a in sp._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            assert a.help and len(a.help) > 20, (name, a.option_strings)
            assert "default" in a.help or "required" in a.help, (name, a.option_strings, a.help)
    text = p.format_help()
    for name in COMMANDS:
        assert re.search(rf"^    {name}(?: +|\n +)\S", text, re.M), text  # a long name's help starts below it


# ---- loading: the default artifact, the user's artifact, signatures ---------------------------

# Builds the tiny model in place of the default one (counting builds), then runs the CLI.
TINY_DEFAULT = """
import os, sys, time
import models.build as mb
real = mb.build_artifact
def build(model, out, **kw):
    with open(os.environ["BUILD_LOG"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(1.0)  # a long build: the other run arrives meanwhile
    return real(os.environ["TINY_GGUF"], out, **kw)
mb.build_artifact = build
from runtime.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_default_artifact_is_built_once_and_rebuilt_when_damaged(tiny_gguf, tmp_path):
    """Two first runs at once build the default artifact once (the second waits and reuses it); a damaged
    cached manifest gave a raw yaml.YAMLError traceback: now the default artifact is rebuilt once, saying why."""
    log = tmp_path / "builds.log"
    env = {"BUILD_LOG": str(log), "TINY_GGUF": str(tiny_gguf)}
    args = ["generate", "--prompt", "the cat", "--max-new-tokens", "3"]
    runs = [_popen(tmp_path, *args, env=env, code=TINY_DEFAULT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                   text=True) for _ in range(2)]
    results = [(p.communicate(timeout=300), p.returncode) for p in runs]
    assert [rc for _, rc in results] == [0, 0], [err for (_, err), _ in results]
    assert len(log.read_text().split()) == 1
    assert sum("no artifact yet; building the default one" in err for (_, err), _ in results) == 1

    (art,) = [p for p in (tmp_path / "cache" / "artifacts").iterdir() if not p.name.startswith(".")]
    (art / "manifest.yaml").write_text("files: [not closed\n")
    r = _cli(tmp_path, *args, env=env, code=TINY_DEFAULT)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "the default artifact does not load" in r.stderr
    assert "not valid YAML" in r.stderr and len(log.read_text().split()) == 2
    with open(art / "tokenizer.bpe", "r+b") as f:  # tampered with: its sha256 no longer matches
        f.seek(100)
        c = f.read(1)
        f.seek(100)
        f.write(bytes([c[0] ^ 1]))
    r = _cli(tmp_path, *args, env=env, code=TINY_DEFAULT)
    assert r.returncode == 0 and "sha256" in r.stderr and len(log.read_text().split()) == 3, r.stderr
    r = _cli(tmp_path, *args, env=env, code=TINY_DEFAULT)  # and now it simply loads
    assert r.returncode == 0 and len(log.read_text().split()) == 3, r.stderr
    if importlib.util.find_spec("cryptography"):  # trusting only signed artifacts: a rebuild would not help
        from runtime.signing import generate_key

        generate_key(tmp_path / "k.key", tmp_path / "k.pub")
        r = _cli(tmp_path, *args, env=dict(env, BOARDTALK_TRUSTED_KEYS=str(tmp_path / "k.pub")), code=TINY_DEFAULT)
        assert r.returncode == 2 and "built unsigned" in _one_error_line(r.stderr)
        assert len(log.read_text().split()) == 3


def test_a_users_artifact_is_never_rebuilt(tiny_artifacts, tmp_path):
    """A damaged --artifact is reported with the exact command that rebuilds it, and left as it is."""
    art = tmp_path / "mine"
    shutil.copytree(tiny_artifacts["native"], art)
    (art / "manifest.yaml").write_text("files: [not closed\n")
    r = _cli(tmp_path, "generate", "--artifact", art, "--prompt", "hi")
    line = _one_error_line(r.stderr)
    assert r.returncode == 2 and "not valid YAML" in line
    assert "boardtalk build --model" in line and f"--out {art}" in line and "--board host" in line
    assert (art / "manifest.yaml").read_text() == "files: [not closed\n"


def test_keygen_sign_and_trusted_keys(tiny_gguf, tiny_artifacts, tmp_path):
    """keygen, build --sign-key and sign make signed artifacts; --trusted-keys and $BOARDTALK_TRUSTED_KEYS
    load only those."""
    pytest.importorskip("cryptography")
    prefix = tmp_path / "fleet"
    r = _cli(tmp_path, "keygen", "--out", prefix)
    assert r.returncode == 0, r.stderr
    key, pub = tmp_path / "fleet.key", tmp_path / "fleet.pub"
    assert key.stat().st_mode & 0o777 == 0o600 and pub.read_text().startswith("boardtalk-ed25519 ")
    assert r.stdout.strip() in r.stderr  # the key id
    r = _cli(tmp_path, "keygen", "--out", prefix)
    assert r.returncode == 2 and "refusing to overwrite" in _one_error_line(r.stderr)

    signed = tmp_path / "signed"
    r = _cli(tmp_path, "build", "--model", tiny_gguf, "--board", "host", "--backend", "native", "--out", signed,
             "--max-context", "128", "--sign-key", key)
    assert r.returncode == 0 and (signed / "manifest.sig").is_file(), r.stderr
    gen = ["generate", "--prompt", "hi", "--max-new-tokens", "2"]
    r = _cli(tmp_path, *gen, "--artifact", signed, "--trusted-keys", pub)
    assert r.returncode == 0, r.stderr

    unsigned = tmp_path / "unsigned"
    shutil.copytree(tiny_artifacts["native"], unsigned)
    r = _cli(tmp_path, *gen, "--artifact", unsigned, "--trusted-keys", pub)
    assert r.returncode == 2 and "not signed" in _one_error_line(r.stderr)
    r = _cli(tmp_path, *gen, "--artifact", unsigned, env={"BOARDTALK_TRUSTED_KEYS": str(pub)})
    assert r.returncode == 2 and "not signed" in _one_error_line(r.stderr)
    r = _cli(tmp_path, "sign", "--artifact", unsigned, "--key", key)
    assert r.returncode == 0, r.stderr
    r = _cli(tmp_path, *gen, "--artifact", unsigned, env={"BOARDTALK_TRUSTED_KEYS": str(pub)})
    assert r.returncode == 0, r.stderr
    r = _cli(tmp_path, "sign", "--artifact", tmp_path, "--key", key)
    assert r.returncode == 2 and "not an artifact directory" in _one_error_line(r.stderr)


# ---- without models/ ---------------------------------------------------------------------------

NO_MODELS = """
import sys
class NoModels:  # a board without the build side: 'import models' fails
    def find_spec(self, name, path=None, target=None):
        if name == "models" or name.startswith("models."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None
sys.meta_path.insert(0, NoModels())
from runtime.cli import main
code = main(sys.argv[1:])
assert not any(m == "models" or m.startswith("models.") for m in sys.modules), "models/ was imported"
sys.exit(code)
"""


def test_runs_without_the_build_side(long_artifact, tmp_path):
    """models/ is the build side and may be absent on a board: help, generate, chat and perplexity work
    without it; build says which extra to install."""
    r = _cli(tmp_path, "--help", code=NO_MODELS)
    assert r.returncode == 0 and "generate" in r.stdout, r.stderr
    art = ["--artifact", long_artifact]
    r = _cli(tmp_path, "generate", *art, "--prompt", "the cat", "--max-new-tokens", "5", code=NO_MODELS)
    assert r.returncode == 0 and "5 new" in r.stderr, r.stderr
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat " * 10)
    r = _cli(tmp_path, "perplexity", *art, "--text-file", text, "--max-tokens", "32", code=NO_MODELS)
    assert r.returncode == 0 and "ppl" in r.stdout, r.stderr
    r = _cli(tmp_path, "chat", *art, "--max-new-tokens", "5", code=NO_MODELS, input="hi\n")
    assert r.returncode == 0 and "5 new" in r.stderr, r.stderr
    r = _cli(tmp_path, "build", "--out", tmp_path / "o", code=NO_MODELS)
    assert r.returncode == 2 and _one_error_line(r.stderr) == f"boardtalk: error: {BUILD_EXTRA}"
    r = _cli(tmp_path, "generate", "--prompt", "hi", code=NO_MODELS)  # no default artifact, none can be built
    assert r.returncode == 2 and "pip install 'boardtalk[build]'" in _one_error_line(r.stderr)


# ---- main(): user errors are one line --------------------------------------------------------

def _errors():
    from models.sources import SourceError
    from runtime.native import NativeError
    from runtime.signing import SignatureError
    from runtime.store import StoreError

    return [runtime.ArtifactError("bad artifact"), runtime.ContextOverflow("too long"), runtime.ConfigError("bad cfg"),
            runtime.SessionBusy("busy"), ValueError("bad value"), StoreError("not an artifact"),
            SignatureError("not signed"), NativeError("kernels"), SourceError("no such model"),
            FileNotFoundError(2, "No such file or directory", "x.txt")]


@pytest.mark.parametrize("error", _errors(), ids=lambda e: type(e).__name__)
def test_user_errors_are_one_line_exit_2(error, monkeypatch, capsys, caplog):
    """Every user error is 'boardtalk: error: <one line>' and exit 2, never a traceback; -vv logs it."""
    def fail(args):
        raise error

    monkeypatch.setattr("runtime.cli._load", fail)
    assert main(["generate", "--artifact", "a", "--prompt", "hi"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("boardtalk: error: ") and len(line) > len("boardtalk: error: ") + 3
    caplog.set_level("DEBUG", logger="runtime.cli")
    assert main(["-vv", "generate", "--artifact", "a", "--prompt", "hi"]) == 2
    assert any(r.exc_info and r.exc_info[1] is error for r in caplog.records)


# ---- the hostile-user review -------------------------------------------------------------------

def test_review_inputs_are_refused_in_one_line(tiny_artifacts, tmp_path):
    """Review: --prompt-file /dev/zero read until the OOM killer came; --out "" and --artifact "" silently
    meant the default (a build went into the real cache); perplexity's default 512 tokens failed on a
    smaller context; a closed stdout swallowed the reply with exit 0."""
    art = tiny_artifacts["native"]
    cases = [(["generate", "--artifact", art, "--prompt-file", "/dev/zero"], "is not a regular file"),
             (["build", "--out", ""], "argument --out: an empty path"),
             (["generate", "--artifact", "", "--prompt", "x"], "argument --artifact: an empty path")]
    for argv, msg in cases:
        res = _cli(tmp_path, *argv)
        assert res.returncode == 2 and msg in res.stderr and "Traceback" not in res.stderr, (argv, res.stderr)
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat. " * 400)
    res = _cli(tmp_path, "perplexity", "--artifact", art, "--text-file", text, "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["n_tokens"] == 127  # the 128-token context
    res = subprocess.run(f"{sys.executable} -m runtime.cli generate --artifact {art} --prompt hi --max-new-tokens 2 >&-",
                         shell=True, capture_output=True, text=True, cwd=ROOT, env=_env(tmp_path))
    assert res.returncode == 2 and "standard output is closed" in res.stderr


def test_truncate_prompt_reads_only_the_end_of_a_huge_file(tiny_artifacts, tmp_path):
    """Review: --truncate-prompt tokenized a whole 67 MB file (minutes), and with --chat cut the template's
    start off. Now only the file's end is read, and the template stays whole."""
    big = tmp_path / "big.txt"
    with open(big, "w") as f:
        for _ in range(80):
            f.write("words and more words. " * 50_000)  # ~88 MB
    t0 = time.monotonic()
    res = _cli(tmp_path, "generate", "--artifact", tiny_artifacts["native"], "--prompt-file", big, "--truncate-prompt",
               "--chat", "--max-new-tokens", "3", "--json")
    assert res.returncode == 0, res.stderr
    assert time.monotonic() - t0 < 60  # was linear in the file: minutes for this one
    ids = json.loads(res.stdout)["prompt_ids"]
    assert ids[0] == 1 and len(ids) <= 128  # <|im_start|> first: the template is whole
    res = _cli(tmp_path, "generate", "--artifact", tiny_artifacts["native"], "--prompt-file", big)
    assert res.returncode == 2 and "MiB; at most 64 MiB" in res.stderr
