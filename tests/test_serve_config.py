"""boardtalk serve: config loading and validation, request parsing, the compute gate (no model needed)."""
import subprocess
import sys
import threading
import time

import pytest
import yaml

from runtime.serve.config import Config, ConfigError, from_dict, load_config, render, render_default, with_overrides
from runtime.serve.openai_schema import BadRequest, parse_chat_request
from runtime.serve.scheduler import API, VOICE, ComputeGate


def test_render_default_round_trips_and_documents_every_key():
    text = render_default()
    assert from_dict(yaml.safe_load(text)) == Config()
    lines = text.splitlines()
    keys = [i for i, ln in enumerate(lines) if ln.startswith("  ") and not ln.startswith("  #")]
    assert len(keys) > 20
    for i in keys:  # every key is preceded by its comment, which shows its default
        assert lines[i - 1].startswith("  # ") and "(default: " in lines[i - 1], lines[i]


@pytest.mark.parametrize("data, where", [
    ({"api": {"port": "x"}}, "api.port: expected an integer from 0 to 65535"),
    ({"api": {"port": 70000}}, "api.port"),
    ({"api": {"prot": 1}}, "api.prot: unknown key"),
    ({"apx": {}}, "apx: unknown section"),
    ({"api": {"queue": True}}, "api.queue"),
    ({"audio": {"input": 1.5}}, "audio.input"),
    ({"service": {"log_level": "loud"}}, "service.log_level: expected one of debug, info, warning, error"),
    ({"api": {"host": "0.0.0.0"}}, "api.host: 0.0.0.0 listens beyond loopback, which requires api.api_key"),
    ({"api": {"host": "::"}}, "requires api.api_key"),
    ({"api": {"enabled": False}, "audio": {"enabled": False}}, "nothing to serve"),
    ({"model": []}, "model: expected a mapping"),
    ([1, 2], "expected a mapping with sections"),
])
def test_bad_config_names_the_key(data, where):
    with pytest.raises(ConfigError, match=None) as e:
        from_dict(data)
    assert where in str(e.value) and "\n" not in str(e.value)


def test_loopback_and_keyed_hosts_are_accepted():
    assert from_dict({"api": {"host": "::1"}}).api.host == "::1"
    assert from_dict({"api": {"host": "localhost"}}).api.host == "localhost"
    assert from_dict({"api": {"host": "0.0.0.0", "api_key": "k"}}).api.api_key == "k"


def test_load_config_file_errors(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("api:\n  port: [1\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+"):
        load_config(p)
    p.write_bytes(b"api:\n  host: \xff\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(p)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    p.write_text("wyoming:\n  enabled: true\n")
    assert load_config(p).wyoming.port == 10700


def test_overrides_are_validated_and_render_redacts_the_key():
    cfg = with_overrides(Config(), api={"host": "0.0.0.0", "api_key": "s3cret"})
    assert "s3cret" not in render(cfg, redact=True) and "s3cret" in render(cfg)
    with pytest.raises(ConfigError, match="api.port"):
        with_overrides(Config(), api={"port": -1})


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "runtime.cli", "serve", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_print_config_and_one_line_errors(tmp_path):
    r = _cli("--print-config", "--config", str(tmp_path / "none.yaml"))
    assert r.returncode == 2 and r.stderr.startswith("boardtalk: error: cannot read config") and r.stderr.count("\n") == 1
    p = tmp_path / "c.yaml"
    p.write_text("api:\n  max_tokens: 64\n")
    r = _cli("--print-config", "--config", str(p), "--api", "127.0.0.1:9001", "--no-audio", "--wyoming", ":10701")
    assert r.returncode == 0, r.stderr
    got = yaml.safe_load(r.stdout)
    assert got["api"]["port"] == 9001 and got["api"]["max_tokens"] == 64 and got["audio"]["enabled"] is False
    assert got["wyoming"] == {"enabled": True, "host": "127.0.0.1", "port": 10701}
    r = _cli("--print-config", "--config", str(p), "--api", "0.0.0.0:9001")
    assert r.returncode == 2 and "requires api.api_key" in r.stderr
    r = _cli("--print-config", "--config", str(p), "--api", "nonsense")
    assert r.returncode == 2 and "HOST:PORT" in r.stderr


# ---- request parsing -----------------------------------------------------------------------------

def _parse(**body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_chat_request(body, max_tokens_cap=100, system_prompt="SYS")


def test_parse_defaults_cap_and_system_prompt():
    r = _parse(max_tokens=1000, stop="x", seed=-1, temperature=0.7, top_p=0.9)
    assert r.config.max_new_tokens == 100 and r.asked_max_tokens == 1000  # capped, not refused
    assert r.config.stop_strings == ("x",) and r.config.temperature == 0.7 and r.config.seed == 2**64 - 1
    assert r.messages[0] == {"role": "system", "content": "SYS"}
    r = _parse(messages=[{"role": "developer", "content": "own"}, {"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert r.messages == [{"role": "system", "content": "own"}, {"role": "user", "content": "ab"}]
    assert _parse().config.temperature == 0 and _parse().stream is False


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"seed": 1.5}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": 3}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "a\0b"}]}, "messages[0].content"),
    ({"stop": ["\udfff"]}, "stop"),
    ({"n": 2}, "n"),
    ({"tools": [{"type": "function"}]}, "tools"),
])
def test_parse_rejects_with_the_field(body, param):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    with pytest.raises(BadRequest) as e:
        parse_chat_request(body, max_tokens_cap=100, system_prompt="")
    assert e.value.param == param


# ---- the compute gate ----------------------------------------------------------------------------

def test_gate_gives_waiting_voice_steps_priority_over_api_steps():
    """Voice and API steps queued behind a running step: every voice step runs before the API's."""
    gate = ComputeGate(grace_s=0.0)
    order = []
    gate.acquire(API)  # a running API step

    def worker(prio, tag):
        with gate.step(prio):
            order.append(tag)

    ts = [threading.Thread(target=worker, args=(API, "api"))]
    ts[0].start()
    time.sleep(0.05)
    ts += [threading.Thread(target=worker, args=(VOICE, f"voice{i}")) for i in range(3)]
    for t in ts[1:]:
        t.start()
    time.sleep(0.05)
    gate.release()
    for t in ts:
        t.join(5)
    assert order[-1] == "api" and sorted(order[:3]) == ["voice0", "voice1", "voice2"]
    assert gate.steps == [3, 2]


def test_gate_reserves_the_model_for_voice_between_its_steps():
    """An API step waits grace_s after a voice step, so it cannot slip between a voice turn's decode steps."""
    gate = ComputeGate(grace_s=0.3)
    with gate.step(VOICE):
        pass
    t0 = time.monotonic()
    with gate.step(API):
        waited = time.monotonic() - t0
    assert waited >= 0.2


def test_gate_holds_api_steps_while_the_user_speaks_and_the_hold_expires():
    gate = ComputeGate(grace_s=0.0)
    gate.hold_api(True)
    threading.Timer(0.3, gate.hold_api, (False,)).start()
    t0 = time.monotonic()
    with gate.step(API):
        assert time.monotonic() - t0 >= 0.2
    with gate.step(VOICE):  # voice steps are never held
        pass
    gate.hold_api(True, max_s=0.2)  # a hold nobody ends (a stuck state) lapses
    t0 = time.monotonic()
    with gate.step(API):
        assert 0.1 <= time.monotonic() - t0 < 5
