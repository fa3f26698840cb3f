"""boardtalk serve against a careless or hostile user, without the model: the service is held in its loading
state (a loader that blocks), which is enough for the config, reload, signal and authentication paths."""
import argparse
import socket
import threading
import time

import pytest

from runtime.serve.cli import effective_config
from runtime.serve.config import ConfigError, from_dict, load_config
from runtime.serve.service import Background, Service

BOMB = "".join(f"    - &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))


def test_yaml_alias_bomb_is_refused_quickly(tmp_path):
    """Bug: a billion-laughs YAML (anchors/aliases) under a valid key hung the loader: safe_load builds it
    cheaply as shared references, but the error message repr'd the value, expanding it to gigabytes."""
    p = tmp_path / "c.yaml"
    p.write_text('model:\n  system_prompt:\n    - &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
                 + BOMB)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"model.system_prompt: expected a string, got a list of 9 items"):
        load_config(p)
    assert time.monotonic() - t0 < 5


def _args(**kw):
    base = dict(config=None, api=None, no_api=False, api_key=None, wyoming=None, no_audio=True, artifact=None,
                board=None, threads=None, max_context=None, trusted_keys=None)
    return argparse.Namespace(**{**base, **kw})


def test_empty_api_key_variable_does_not_clear_the_files_key(tmp_path, monkeypatch):
    """Bug: BOARDTALK_API_KEY set but empty (e.g. a unit's 'Environment=BOARDTALK_API_KEY=') replaced the
    config file's api.api_key with none: the API served without a key."""
    p = tmp_path / "c.yaml"
    p.write_text("api:\n  api_key: filekey\n")
    monkeypatch.setenv("BOARDTALK_API_KEY", "")
    assert effective_config(_args(config=p)).api.api_key == "filekey"
    monkeypatch.setenv("BOARDTALK_API_KEY", "envkey")
    assert effective_config(_args(config=p)).api.api_key == "envkey"
    assert effective_config(_args(config=p, api_key="flagkey")).api.api_key == "flagkey"
    with pytest.raises(ConfigError, match="api.api_key: expected a non-empty string"):
        effective_config(_args(config=p, api_key=""))


def test_sighup_keeps_the_command_lines_key_and_the_rules(tmp_path):
    """Bug: started with '--api 0.0.0.0:PORT --api-key K' and a config file without a key, a SIGHUP reloaded
    the file alone: the service kept listening on 0.0.0.0 (host needs a restart) and took the file's
    api_key (none), serving everyone without a key."""
    p = tmp_path / "c.yaml"
    p.write_text("audio:\n  enabled: false\n")
    args = _args(config=p, api=("0.0.0.0", 18080), api_key="K")
    from runtime.serve.cli import overrides

    svc = Service(effective_config(args), loader=None, config_path=p, overrides=overrides(args))
    p.write_text("audio:\n  enabled: false\napi:\n  max_tokens: 7\n")
    assert svc.reload()
    assert svc.config.api.api_key == "K" and svc.config.api.host == "0.0.0.0" and svc.config.api.max_tokens == 7
    # the file gave the key and the address; a reload drops the key but not the address (it needs a restart)
    p.write_text("api:\n  host: 0.0.0.0\n  api_key: K2\naudio:\n  enabled: false\n")
    svc = Service(load_config(p), loader=None, config_path=p)
    p.write_text("audio:\n  enabled: false\n")
    assert not svc.reload() and svc.config.api.api_key == "K2"


def _serve_loading(**api):
    """The service with its API up and the model never loading; returns (Background, release)."""
    gate = threading.Event()

    def loader(section):
        gate.wait(60)
        raise RuntimeError("test loader released")

    bg = Background(from_dict({"api": {"port": 0, "body_limit_kib": 1, **api}, "audio": {"enabled": False}}), loader)
    bg._thread.start()
    t0 = time.monotonic()
    while bg.service.api_port is None:
        assert time.monotonic() - t0 < 30 and bg._thread.is_alive()
        time.sleep(0.01)
    return bg, gate.set


def test_stop_during_load_exits_at_once():
    """Bug: SIGTERM/Ctrl-C while the model loaded (or the default artifact was built, minutes) waited for the
    load to finish, then reported ready (READY=1) and only then stopped."""
    bg, release = _serve_loading()
    try:
        took = bg.stop()
        assert bg.exit_code == 0 and not bg._thread.is_alive() and not bg.service.ready
        assert took < 10  # the loader still blocks (up to 60 s): stopping did not wait for it
    finally:
        release()


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while b := s.recv(65536):
            out += b
            if data.count(b"Expect:"):
                break  # the first answer is all these tests read
        return out


def test_authorization_header_variants():
    """Bug: an Authorization header that is not UTF-8 answered 500 (with a traceback in the log per request)
    instead of 401; 'bearer' in lower case (RFC 7235: the scheme is case-insensitive) was refused."""
    bg, release = _serve_loading(api_key="sekret")
    port = bg.service.api_port
    try:
        def status(header: bytes) -> bytes:
            r = _raw(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + header + b"\r\n")
            return r.split(b" ", 2)[1]

        assert status(b"Authorization: Bearer \xff\xfe\r\n") == b"401"
        assert status(b"Authorization: Bearer sekretX\r\n") == b"401"
        assert status(b"Authorization: Basic c2VrcmV0\r\n") == b"401"
        assert status(b"") == b"401"
        assert status(b"Authorization: bearer sekret\r\n") == b"200"
        assert status(b"Authorization: Bearer sekret\r\n") == b"200"
    finally:
        bg.stop()
        release()


def test_expect_100_continue_refuses_before_the_body():
    """Bug: 'Expect: 100-continue' was answered '100 Continue' (inviting the body) before the key and the
    Content-Length were checked: a client without the key, or with a body past the limit, was asked to send it."""
    bg, release = _serve_loading(api_key="sekret")
    port = bg.service.api_port
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
    try:
        assert _raw(port, head + b"Content-Length: 10\r\n\r\n").startswith(b"HTTP/1.1 401 ")
        r = _raw(port, head + b"Authorization: Bearer sekret\r\nContent-Length: 99999999\r\n\r\n")
        assert r.startswith(b"HTTP/1.1 413 ")
        r = _raw(port, head + b"Authorization: Bearer sekret\r\nContent-Length: 10\r\n\r\n")
        assert r.startswith(b"HTTP/1.1 100 Continue")
    finally:
        bg.stop()
        release()


def test_half_sent_headers_are_dropped(monkeypatch):
    """Bug: a connection that never finished its request line and headers was kept for aiohttp's 75 s
    keep-alive; ~1000 of them (slowloris) held every descriptor of a service under systemd's default limit
    (1024 open files) and locked every client out. Now they are dropped after api.read_timeout_s (>= 5 s)."""
    import runtime.serve.api as api

    assert api.header_timeout_s(from_dict({}).api) == 10.0
    monkeypatch.setattr(api, "header_timeout_s", lambda cfg: 0.5)
    bg, release = _serve_loading()
    try:
        with socket.create_connection(("127.0.0.1", bg.service.api_port), timeout=20) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and nothing more
            t0 = time.monotonic()
            assert s.recv(100) == b"" and time.monotonic() - t0 < 15  # closed by the server
    finally:
        bg.stop()
        release()


def test_serve_raises_the_open_files_soft_limit():
    """systemd gives services a soft limit of 1024 open files: serve raises it toward the hard limit, so a
    client's connections exhaust its own ports (~28k per address) before the service's descriptors."""
    import resource
    import subprocess
    import sys

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"the hard open-files limit here is {hard}: nothing to raise to")
    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit("
            "resource.RLIMIT_NOFILE)[1])); from runtime.serve.cli import raise_fd_limit; print(raise_fd_limit())")
    got = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert got == (65536 if hard == resource.RLIM_INFINITY else min(65536, hard))
