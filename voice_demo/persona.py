"""A toy's persona: a small YAML file, validated strictly into one frozen dataclass.

    persona = load_persona("coco")            # a shipped persona (voice_demo/personas/coco.yaml) or a path
    persona.activation.mode                    # "wake" or "push_to_talk"

Every key has a type, a range and a default (``SCHEMA`` below, also the table in docs/voice_demo.md).
Unknown keys, duplicate keys, wrong types and out-of-range values are refused with one line that names
the file, the key and what was expected: a typo in a child's toy must not silently fall back to a default.
"""
from __future__ import annotations

import math
import os
import re
import stat
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

PERSONA_DIR = Path(__file__).parent / "personas"
MAX_PERSONA_BYTES = 64 << 10  # a persona is a few hundred bytes; a larger file is refused unread
KEYS = {"space": " ", "enter": "\n", "tab": "\t"}  # push-to-talk key names besides one printable character


class PersonaError(ValueError):
    """A persona file that cannot be used; the message is one line naming the file and the key."""


# ---- the schema: (type, default, check) per key; check(value) -> None or what was expected ----------------
def _num(lo: float, hi: float, integer: bool = False):
    def check(v):
        ok = isinstance(v, int) if integer else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok or not math.isfinite(v) or not lo <= v <= hi:
            return f"{'an integer' if integer else 'a number'} from {lo:g} to {hi:g}"
        return None
    return check


def _text(lo: int, hi: int, pattern: str | None = None, what: str = ""):
    def check(v):
        if not isinstance(v, str) or not lo <= len(v.strip()) <= hi or (pattern and not re.fullmatch(pattern, v)):
            return what or f"a string of {lo} to {hi} characters"
        return None
    return check


def _bool(v):
    return None if isinstance(v, bool) else "true or false"


def _words(v):
    if not isinstance(v, list) or not all(isinstance(w, str) and 0 < len(w.strip()) <= 40 for w in v) or len(v) > 500:
        return "a list of at most 500 words or phrases (strings of 1 to 40 characters)"
    return None


def _key(v):
    if isinstance(v, str) and (v in KEYS or (len(v) == 1 and v.isprintable() and not v.isspace())):
        return None
    return f"one printable character or one of {', '.join(KEYS)}"


@dataclass(frozen=True)
class Voice:
    engine: str = "hibari"  # TTS engine name in runtime/voice/engines.py's registry
    speed: float | None = None  # speaking rate, 1.0 = the engine's normal pace (only engines that have one: hibari)


@dataclass(frozen=True)
class Activation:
    mode: str = "wake"  # "wake": a wake phrase starts a question; "push_to_talk": a key opens the microphone
    wake_phrase: str = ""  # wake mode: matched at the start of what the ASR heard (default: "hey <name>")
    wake_match: float = 0.75  # wake mode: similarity (0.5-1) that counts as the phrase; 1 = exact words only
    follow_up_s: float = 8.0  # wake mode: after a reply (or the phrase alone) it listens this long without it
    key: str = "space"  # push_to_talk mode: the key that opens (and, pressed again, closes) the microphone
    listen_s: float = 8.0  # push_to_talk mode: the microphone closes if no speech starts within this


@dataclass(frozen=True)
class Earcons:
    enabled: bool = True  # a rising two-tone when it starts listening, a falling one when it goes to sleep
    volume: float = 0.25  # peak amplitude, 0-1


@dataclass(frozen=True)
class Privacy:
    forget_after_s: float = 30.0  # the conversation is forgotten after this long with no turn (and asleep)
    memory_turns: int = 3  # at most this many earlier exchanges are remembered at all


@dataclass(frozen=True)
class Guard:
    extra_words: tuple[str, ...] = ()  # blocked in replies, on top of voice_demo/blocklist.txt
    redirect: str = "Let's talk about something else!"  # said instead of a reply chunk that has a blocked word


@dataclass(frozen=True)
class Persona:
    name: str
    system_prompt: str
    description: str = ""
    voice: Voice = Voice()
    max_reply_tokens: int = 40
    activation: Activation = Activation()
    earcons: Earcons = Earcons()
    privacy: Privacy = Privacy()
    guard: Guard = Guard()
    source: str = ""  # the file it came from (not a YAML key)

    @property
    def wake_phrase(self) -> str:
        return self.activation.wake_phrase or f"hey {self.name}"


SECTIONS = {"voice": Voice, "activation": Activation, "earcons": Earcons, "privacy": Privacy, "guard": Guard}
CHECKS: dict[str, Any] = {
    "name": _text(1, 32, r"[A-Za-z][A-Za-z0-9 '-]*", "a name of 1 to 32 letters, digits, spaces, ' or -, "
                                                     "starting with a letter"),
    "system_prompt": _text(1, 4000),
    "description": _text(0, 200),
    "max_reply_tokens": _num(1, 256, integer=True),
    "voice.engine": _text(1, 64),
    "voice.speed": _num(0.5, 2.0),
    "activation.mode": lambda v: None if v in ("wake", "push_to_talk") else "wake or push_to_talk",
    "activation.wake_phrase": _text(3, 64, r"[A-Za-z][A-Za-z0-9 ',-]*", "a phrase of 3 to 64 letters, digits, "
                                                                          "spaces, ' or -, starting with a letter"),
    "activation.wake_match": _num(0.5, 1.0),
    "activation.follow_up_s": _num(0, 600),
    "activation.key": _key,
    "activation.listen_s": _num(1, 600),
    "earcons.enabled": _bool,
    "earcons.volume": _num(0, 1),
    "privacy.forget_after_s": _num(0, 3600),
    "privacy.memory_turns": _num(0, 20, integer=True),
    "guard.extra_words": _words,
    "guard.redirect": _text(1, 200),
}
REQUIRED = ("name", "system_prompt")
MODE_KEYS = {"wake": ("wake_phrase", "wake_match", "follow_up_s"), "push_to_talk": ("key", "listen_s")}


def _shown(v: Any) -> str:
    s = repr(v)
    return f"{type(v).__name__} {s[:40]}{'...' if len(s) > 40 else ''}"


def from_dict(d: Any, where: str = "persona") -> Persona:
    """The persona a parsed YAML mapping describes; PersonaError (one line) for anything wrong in it."""
    def fail(msg: str):
        raise PersonaError(f"{where}: {msg}")

    if not isinstance(d, dict):
        fail(f"expected a mapping of persona keys, found {_shown(d)}")
    top = [f.name for f in fields(Persona) if f.name != "source"]
    kw: dict[str, Any] = {}
    for k, v in d.items():
        if k not in top:
            fail(f"unknown key {k!r} (known: {', '.join(top)})")
        if k in SECTIONS:
            cls = SECTIONS[k]
            if not isinstance(v, dict):
                fail(f"{k}: expected a mapping of {', '.join(f.name for f in fields(cls))}, found {_shown(v)}")
            sub = {}
            for sk, sv in v.items():
                known = [f.name for f in fields(cls)]
                if sk not in known:
                    fail(f"unknown key '{k}.{sk}' (known in {k}: {', '.join(known)})")
                want = CHECKS[f"{k}.{sk}"](sv)
                if want:
                    fail(f"{k}.{sk}: expected {want}, found {_shown(sv)}")
                sub[sk] = tuple(sv) if isinstance(sv, list) else sv
            kw[k] = cls(**sub)
        else:
            want = CHECKS[k](v)
            if want:
                fail(f"{k}: expected {want}, found {_shown(v)}")
            kw[k] = v.strip() if isinstance(v, str) else v
    for k in REQUIRED:
        if k not in kw:
            fail(f"missing key {k!r} (required: {', '.join(REQUIRED)})")
    act = d.get("activation") or {}
    mode = act.get("mode", Activation.mode)
    for other, keys in MODE_KEYS.items():
        if other != mode:
            for k in keys:
                if k in act:
                    fail(f"activation.{k} is for mode {other}, this persona's mode is {mode}")
    _check_voice(kw.get("voice", Voice()), fail)
    return Persona(**kw, source=where)


def _check_voice(voice: Voice, fail) -> None:
    """voice.engine is a registered TTS engine; voice.speed only for one whose class takes a speed (read from
    the registry and the class's signature, not guessed)."""
    import importlib
    import inspect

    from runtime.voice.engines import ENGINES, names

    info = ENGINES.get(("tts", voice.engine))
    if info is None:
        fail(f"voice.engine: expected one of {', '.join(names('tts'))}, found {voice.engine!r}")
    if voice.speed is None:
        return
    cls = getattr(importlib.import_module(f"runtime.voice.{info.module}"), info.cls)
    if "speed" not in inspect.signature(cls.__init__).parameters:
        fail(f"voice.speed: the {voice.engine} TTS engine has no speed option (leave voice.speed out)")


def _loader():
    """yaml.SafeLoader that refuses duplicate keys (PyYAML keeps the last one silently)."""
    import yaml

    class Strict(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        seen = set()
        for k, _ in node.value:
            key = loader.construct_object(k, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", k.start_mark)
            seen.add(key)
        return loader.construct_mapping(node, deep)

    Strict.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return Strict


def shipped() -> dict[str, Path]:
    """Persona name (file stem) -> path of the personas shipped with the demo."""
    return {p.stem: p for p in sorted(PERSONA_DIR.glob("*.yaml"))}


def resolve(name_or_path: str) -> Path:
    """A shipped persona's name, or a path to a YAML file."""
    if "/" not in name_or_path and name_or_path in shipped():
        return shipped()[name_or_path]
    p = Path(name_or_path)
    if p.exists() or "/" in name_or_path or p.suffix in (".yaml", ".yml"):
        return p
    raise PersonaError(f"no persona {name_or_path!r}: the shipped ones are {', '.join(shipped())}; or give the "
                       "path of a .yaml file")


def load_persona(name_or_path: str) -> Persona:
    import yaml

    path = resolve(name_or_path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the open
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise PersonaError(f"persona {path} is not a regular file")
            data = os.read(fd, MAX_PERSONA_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as e:
        raise PersonaError(f"cannot read persona {path}: {e.strerror or e}") from None
    if len(data) > MAX_PERSONA_BYTES:
        raise PersonaError(f"{path}: larger than {MAX_PERSONA_BYTES >> 10} KiB; a persona is a few lines of YAML")
    try:
        d = yaml.load(data.decode("utf-8"), Loader=_loader())  # noqa: S506  a SafeLoader subclass
    except UnicodeDecodeError as e:
        raise PersonaError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e).split("\n")[0]
        raise PersonaError(f"{path}: not valid YAML: {problem}{at}") from None
    return from_dict(d, str(path))
