"""Earcons: short tones synthesized with numpy, so the toy needs no sound files.

    listen = earcon("listen", 24000)   # rising two-tone (E5 -> A5), 0.2 s: "I am listening"
    sleep = earcon("sleep", 24000)     # falling two-tone (A5 -> E5): "I stopped listening"

Each tone has 10 ms raised-cosine fades (no clicks); the two tones are separated by 20 ms of silence.
"""
from __future__ import annotations

import numpy as np

TONES = {"listen": (659.25, 880.0), "sleep": (880.0, 659.25)}  # Hz: E5 and A5, a fourth apart
TONE_S = 0.09  # seconds per tone
GAP_S = 0.02  # seconds of silence between the two tones
FADE_S = 0.01  # seconds of fade in and out of each tone


def _tone(freq: float, rate: int, volume: float) -> np.ndarray:
    n = int(TONE_S * rate)
    t = np.arange(n) / rate
    x = np.sin(2 * np.pi * freq * t)
    k = int(FADE_S * rate)
    ramp = 0.5 - 0.5 * np.cos(np.linspace(0, np.pi, k))
    x[:k] *= ramp
    x[n - k :] *= ramp[::-1]
    return (volume * x).astype(np.float32)


def earcon(kind: str, rate: int, volume: float = 0.25) -> np.ndarray:
    """Mono float32 audio at ``rate`` Hz of the ``kind`` earcon ("listen" or "sleep"), peak ``volume``."""
    if kind not in TONES:
        raise ValueError(f"unknown earcon {kind!r}; known: {', '.join(TONES)}")
    a, b = TONES[kind]
    gap = np.zeros(int(GAP_S * rate), np.float32)
    return np.concatenate([_tone(a, rate, volume), gap, _tone(b, rate, volume)])


def duration_s() -> float:
    return 2 * TONE_S + GAP_S
