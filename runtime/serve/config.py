"""The service's configuration: frozen dataclasses loaded from YAML, validated once, at start.

    cfg = load_config("/etc/boardtalk/config.yaml")   # or None: the default path if it exists, else defaults
    cfg = with_overrides(cfg, api={"port": 9000})     # command-line flags, validated the same way
    render(cfg)                                       # the effective config as commented YAML
    render_default()                                  # every key with its default and a comment

Every key is declared once, with its default, a check and the comment that documents it (``_key``);
the loader refuses unknown keys and wrong types with ``ConfigError`` naming the key and what was expected.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

DEFAULT_PATH = Path("/etc/boardtalk/config.yaml")
MAX_CONFIG_BYTES = 1 << 20  # a config file larger than this is refused before it is read
DEFAULT_SYSTEM = "You are a friendly voice assistant. Answer in one or two short sentences."


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message is one line naming the key."""


# ---- checks: each returns the value (normalized) or raises ValueError("expected ...") -------------

def _int(lo: int, hi: int, none: bool = False) -> Callable:
    def check(v):
        if v is None and none:
            return v
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"expected an integer from {lo} to {hi}{' or null' if none else ''}")
        return v
    return check


def _num(lo: float, hi: float) -> Callable:
    def check(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
            raise ValueError(f"expected a number from {lo:g} to {hi:g}")
        return float(v)
    return check


def _bool(v):
    if not isinstance(v, bool):
        raise ValueError("expected true or false")
    return v


def _str(none: bool = False, nonempty: bool = True, choices: tuple[str, ...] = ()) -> Callable:
    def check(v):
        if v is None and none:
            return v
        if not isinstance(v, str) or (nonempty and not v.strip()) or "\0" in v:
            raise ValueError("expected a " + ("non-empty " if nonempty else "") + "string" + (" or null" if none else ""))
        if choices and v not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return v
    return check


def _device(v):
    """A sounddevice name (substring) or index, or null for the board's / system default."""
    if v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
        return v
    if isinstance(v, str) and v.strip():
        return v
    raise ValueError("expected a device name, an index >= 0 or null")


def _host(v):
    if not isinstance(v, str) or not v.strip() or any(c.isspace() for c in v) or "/" in v:
        raise ValueError("expected a host name or IP address such as 127.0.0.1, ::1 or 0.0.0.0")
    return v


def _shown(v) -> str:
    """v for an error message, bounded: a list or mapping is described, never repr'd (a YAML alias bomb
    (billion laughs) is cheap to parse, as shared references, but its repr would expand to gigabytes)."""
    if isinstance(v, (list, dict)):
        return f"a {'list' if isinstance(v, list) else 'mapping'} of {len(v)} items"
    return f"{v!r:.60}" if not isinstance(v, str) else repr(v[:60])


def _key(default, check: Callable, doc: str):
    """One config key: its default, its check and the comment that documents it."""
    return field(default=default, metadata={"check": check, "doc": doc})


# ---- sections ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSection:
    """The model the service loads once at start."""
    artifact: str | None = _key(None, _str(none=True), "artifact directory or .tar.gz; null = this board's default "
                                "artifact (built on first use under ~/.cache/boardtalk)")
    board: str | None = _key(None, _str(none=True), "board profile to run as; null = detect this machine")
    threads: int | None = _key(None, _int(1, 256, none=True), "compute threads; null = the board profile's")
    max_context: int | None = _key(None, _int(2, 1 << 20, none=True), "KV cache positions per session; null = the "
                                   "board profile's, capped by the artifact's")
    system_prompt: str = _key(DEFAULT_SYSTEM, _str(nonempty=False), "system prompt of voice turns and of API requests "
                              "that send none; prefilled before the service reports ready")
    trusted_keys: str | None = _key(None, _str(none=True), "public key file or directory; when set only artifacts "
                                    "signed by one of its keys load")


@dataclass(frozen=True)
class ApiSection:
    """The OpenAI-compatible HTTP API (POST /v1/chat/completions, GET /v1/models, /health, /metrics)."""
    enabled: bool = _key(True, _bool, "serve the HTTP API")
    host: str = _key("127.0.0.1", _host, "address to listen on; anything but loopback requires api_key")
    port: int = _key(8080, _int(0, 65535), "TCP port (0 = any free port, logged at start)")
    api_key: str | None = _key(None, _str(none=True), "when set, requests need 'Authorization: Bearer <key>' "
                               "(required when host is not loopback); keep this file readable by the service only")
    max_tokens: int = _key(512, _int(1, 1 << 20), "cap on a request's max_tokens (larger asks are cut to it); "
                           "also the default when a request gives none")
    queue: int = _key(8, _int(0, 4096), "requests that may wait while one generates; past it: 503 with Retry-After")
    body_limit_kib: int = _key(256, _int(1, 1 << 20), "largest request body in KiB; larger ones get 413")
    read_timeout_s: float = _key(10.0, _num(0.1, 3600), "seconds a client may take to send its request body; its "
                                 "headers get this too (at least 5 s; set at start), as does an idle keep-alive "
                                 "connection; slower ones (slowloris) are dropped")


@dataclass(frozen=True)
class WyomingSection:
    """The Wyoming protocol server (Home Assistant's voice pipeline: ASR, TTS and the LLM as a handler)."""
    enabled: bool = _key(False, _bool, "serve Wyoming")
    host: str = _key("127.0.0.1", _host, "address to listen on")
    port: int = _key(10700, _int(0, 65535), "TCP port (10700 is Wyoming's usual one)")


@dataclass(frozen=True)
class AudioSection:
    """The voice loop on this board's microphone and speaker."""
    enabled: bool = _key(True, _bool, "run the voice loop (needs the voice extra: pip install 'boardtalk[voice]'); "
                         "a missing device is retried with backoff while the API keeps serving")
    input: str | int | None = _key(None, _device, "microphone: a sounddevice name (substring) or index; null = the "
                                   "board profile's, else the system default")
    output: str | int | None = _key(None, _device, "speaker, as input")
    vad: str | None = _key(None, _str(none=True), "VAD engine; null = the default (silero)")
    asr: str | None = _key(None, _str(none=True), "ASR engine; null = the default (whisper-tiny-en)")
    tts: str | None = _key(None, _str(none=True), "TTS engine; null = the default (hibari)")
    max_new_tokens: int = _key(64, _int(1, 4096), "reply length cap of a voice turn (tokens)")
    hangover_s: float = _key(0.25, _num(0, 10), "silence (seconds) that ends a turn; pure latency")
    barge_in: bool = _key(False, _bool, "speech during a reply stops it (needs echo cancellation)")
    hold_api: bool = _key(True, _bool, "while the user speaks, API generations pause (at most 10 s) so the ASR "
                          "passes get the cores; voice model steps always go first")


@dataclass(frozen=True)
class ServiceSection:
    """How the process runs under systemd."""
    watchdog: bool = _key(True, _bool, "ping systemd's watchdog (WatchdogSec= in the unit) while the model makes "
                          "progress, so a hung generation gets the service restarted")
    log_level: str = _key("info", _str(choices=("debug", "info", "warning", "error")), "stderr (journald) log level")
    stop_timeout_s: float = _key(1.5, _num(0, 60), "on SIGTERM, seconds the running turn may take before it is "
                                 "cancelled")


@dataclass(frozen=True)
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    api: ApiSection = field(default_factory=ApiSection)
    wyoming: WyomingSection = field(default_factory=WyomingSection)
    audio: AudioSection = field(default_factory=AudioSection)
    service: ServiceSection = field(default_factory=ServiceSection)


SECTIONS: dict[str, type] = {f.name: f.type if isinstance(f.type, type) else globals()[f.type]
                             for f in dataclasses.fields(Config)}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve to anything


def _section(name: str, cls: type, data, where: str):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}{name}: expected a mapping of keys, got {type(data).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    kw = {}
    for k, v in data.items():
        f = known.get(k)
        if f is None:
            raise ConfigError(f"{where}{name}.{k}: unknown key; {name} has {', '.join(known)}")
        try:
            kw[k] = f.metadata["check"](v)
        except ValueError as e:
            raise ConfigError(f"{where}{name}.{k}: {e}, got {_shown(v)}") from None
    return cls(**kw)


def from_dict(data, where: str = "") -> Config:
    """A validated Config from a parsed YAML document (None or {} = all defaults)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}expected a mapping with sections {', '.join(SECTIONS)}, got {type(data).__name__}")
    for k in data:
        if k not in SECTIONS:
            raise ConfigError(f"{where}{k}: unknown section; known: {', '.join(SECTIONS)}")
    cfg = Config(**{name: _section(name, cls, data.get(name), where) for name, cls in SECTIONS.items()})
    check(cfg, where)
    return cfg


def check(cfg: Config, where: str = "") -> None:
    """The rules between keys."""
    api = cfg.api
    if api.enabled and not is_loopback(api.host) and not api.api_key:
        raise ConfigError(f"{where}api.host: {api.host} listens beyond loopback, which requires api.api_key "
                          "(or --api-key KEY); or listen on 127.0.0.1")
    if not (api.enabled or cfg.wyoming.enabled or cfg.audio.enabled):
        raise ConfigError(f"{where}nothing to serve: api.enabled, wyoming.enabled and audio.enabled are all false")


def load_config(path=None) -> Config:
    """The config at path; path None: DEFAULT_PATH when it exists, else the defaults."""
    import yaml

    if path is None:
        if not DEFAULT_PATH.exists():
            return from_dict({})
        path = DEFAULT_PATH
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read config {p}: {e.strerror or e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config {p} is larger than {MAX_CONFIG_BYTES >> 10} KiB")
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"config {p} is not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config {p} is not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
    return from_dict(data, f"config {p}: ")


def with_overrides(cfg: Config, **sections: dict[str, Any]) -> Config:
    """cfg with some keys replaced (e.g. from command-line flags), checked like the file's."""
    data = {name: {**dataclasses.asdict(getattr(cfg, name)), **sections.get(name, {})} for name in SECTIONS}
    for name in sections:
        if name not in SECTIONS:
            raise ConfigError(f"{name}: unknown section; known: {', '.join(SECTIONS)}")
    return from_dict(data)


def _yaml_value(v) -> str:
    import json

    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v, ensure_ascii=False)  # a JSON string is a YAML double-quoted scalar


def render(cfg: Config, redact: bool = False) -> str:
    """cfg as YAML with every key's comment; redact: the API key is shown as "***"."""
    lines = ["# boardtalk serve configuration (boardtalk serve --print-config shows the effective one).",
             "# Every key is optional; a missing key takes the default shown here.", ""]
    for name, cls in SECTIONS.items():
        lines.append(f"# {cls.__doc__}")
        lines.append(f"{name}:")
        sec = getattr(cfg, name)
        for f in dataclasses.fields(cls):
            v = getattr(sec, f.name)
            if redact and f.name == "api_key" and v:
                v = "***"
            lines.append(f"  # {f.metadata['doc']} (default: {_yaml_value(f.default)})")
            lines.append(f"  {f.name}: {_yaml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def render_default(artifact: str | None = None) -> str:
    """The commented default config: what install-service writes to /etc/boardtalk/config.yaml (on a board
    set up by 'boardtalk deploy', with model.artifact the deployed artifact)."""
    return render(Config(model=ModelSection(artifact=artifact)))
