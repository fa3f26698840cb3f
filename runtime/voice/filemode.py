"""File mode: a WAV played into the voice loop as a microphone would, the replies written to a WAV.

    report = run_file(model, vad, asr, tts, "in.wav", "out.wav", VoiceConfig())

IN.wav (any sample rate, mono or stereo, 16/24/32-bit PCM or float) is resampled to 16 kHz and fed in
512-sample windows at real-time pace; after it ends the loop keeps receiving silence, as from a live
microphone, until the last reply has been spoken. Every time in the report is seconds on IN.wav's
timeline (0 = its first sample), read from one monotonic clock started when the first window is due;
a reply's samples are written into OUT.wav at the time they were handed to the output.
"""
from __future__ import annotations

import json
import logging
import time
import wave
from pathlib import Path

import numpy as np

from .engines import SAMPLE_RATE, VAD_WINDOW
from .pipeline import WINDOW_S, VoiceConfig, VoiceLoop

log = logging.getLogger(__name__)
MAX_WAV_S = 3600.0  # an input longer than an hour is refused before it is read


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """(mono float32 in [-1, 1], sample rate) of a PCM (8/16/24/32-bit) or IEEE-float WAV."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(12)
            if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
                raise ValueError(f"{path} is not a WAV file")
            fmt = data = None
            while True:
                ck = f.read(8)
                if len(ck) < 8:
                    break
                cid, size = ck[:4], int.from_bytes(ck[4:], "little")
                if cid == b"fmt ":
                    fmt = f.read(size)
                elif cid == b"data":
                    if fmt is None:
                        raise ValueError(f"{path}: data before fmt")
                    rate, ch, bits = (int.from_bytes(fmt[4:8], "little"), int.from_bytes(fmt[2:4], "little"),
                                      int.from_bytes(fmt[14:16], "little"))
                    if not rate or not ch or size / max(1, rate * ch * bits // 8) > MAX_WAV_S:
                        raise ValueError(f"{path}: {size} bytes at {rate} Hz is longer than {MAX_WAV_S:.0f} s")
                    data = f.read(size)
                    break
                else:
                    f.seek(size + (size & 1), 1)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    if fmt is None or data is None:
        raise ValueError(f"{path}: no fmt or data chunk")
    tag = int.from_bytes(fmt[0:2], "little")
    if tag == 0xFFFE and len(fmt) >= 26:  # WAVE_FORMAT_EXTENSIBLE: the subformat's first two bytes
        tag = int.from_bytes(fmt[24:26], "little")
    ch, rate, bits = int.from_bytes(fmt[2:4], "little"), int.from_bytes(fmt[4:8], "little"), int.from_bytes(fmt[14:16], "little")
    width = bits // 8
    n = len(data) // (width * ch)
    raw = data[: n * width * ch]
    if tag == 3 and bits in (32, 64):
        x = np.frombuffer(raw, "<f4" if bits == 32 else "<f8").astype(np.float32)
    elif tag == 1 and bits == 8:
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128) / 128
    elif tag == 1 and bits in (16, 32):
        x = np.frombuffer(raw, f"<i{width}").astype(np.float32) / float(2 ** (bits - 1))
    elif tag == 1 and bits == 24:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        x = ((b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8).astype(np.float32) / 2**23
    else:
        raise ValueError(f"{path}: WAV format {tag} with {bits}-bit samples is not supported (PCM or float)")
    x = x.reshape(n, ch).mean(1) if ch > 1 else x
    return np.ascontiguousarray(x, np.float32), rate


def write_wav(path: str | Path, audio: np.ndarray, rate: int) -> None:
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())


def resample(x: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """Band-limited resampling (soxr when installed, else scipy's polyphase filter, else a windowed-sinc
    polyphase filter in numpy)."""
    if rate_in == rate_out:
        return x.astype(np.float32, copy=False)
    try:
        import soxr

        return soxr.resample(x, rate_in, rate_out).astype(np.float32)
    except ImportError:
        pass
    from math import gcd

    g = gcd(rate_in, rate_out)
    up, down = rate_out // g, rate_in // g
    try:
        from scipy.signal import resample_poly

        return resample_poly(x, up, down).astype(np.float32)
    except ImportError:
        pass
    taps = 24 * max(up, down) + 1  # windowed sinc at the lower Nyquist, applied polyphase-style
    t = np.arange(taps) - taps // 2
    cutoff = 0.5 / max(up, down)
    h = (2 * cutoff * np.sinc(2 * cutoff * t) * np.kaiser(taps, 8.0) * up).astype(np.float64)
    y = np.zeros(len(x) * up, np.float64)
    y[::up] = x
    return np.convolve(y, h, mode="same")[::down].astype(np.float32)


class FileOutput:
    """The loop's output in file mode: each chunk is written where, on IN.wav's timeline, it was handed over."""

    def __init__(self, clock):
        self.clock = clock
        self.rate: int | None = None
        self.parts: list[tuple[float, np.ndarray]] = []
        self.cut_at: float | None = None

    def __call__(self, audio: np.ndarray, rate: int, t: float) -> float:
        self.rate = self.rate or rate
        if rate != self.rate:
            audio = resample(audio, rate, self.rate)
        self.parts.append((t, audio))
        return t + len(audio) / self.rate

    def stop(self, t: float) -> float:
        """Barge-in: everything after t is not played."""
        self.parts = [(s, a[: max(0, int((t - s) * self.rate))]) for s, a in self.parts if s < t]
        return t

    def render(self, length_s: float) -> tuple[np.ndarray, int]:
        rate = self.rate or SAMPLE_RATE
        end = max([length_s] + [s + len(a) / rate for s, a in self.parts])
        out = np.zeros(int(end * rate) + 1, np.float32)
        for s, a in self.parts:
            i = int(round(s * rate))
            out[i : i + len(a)] += a[: len(out) - i]
        return out, rate


class PacedInput:
    """IN.wav as a microphone would hand it over: 16 kHz windows of VAD_WINDOW samples at real-time pace,
    stamped on IN.wav's timeline (0 = its first sample, one monotonic clock), then silence, as a live microphone
    keeps giving, until ``done()`` or ``tail_s`` past the end. Any rate, mono or stereo (read_wav, resample)."""

    def __init__(self, in_wav, realtime: bool = True):
        self.audio, self.rate = read_wav(in_wav)  # as read, for the output's length and the report
        x = resample(self.audio, self.rate, SAMPLE_RATE)
        self.n_win = -(-len(x) // VAD_WINDOW)
        self.x = np.concatenate([x, np.zeros(self.n_win * VAD_WINDOW - len(x), np.float32)])
        self.realtime = realtime
        self.late = 0  # windows handed over more than a window late (the machine could not keep up)
        self._t0 = time.monotonic()

    @property
    def seconds(self) -> float:
        return len(self.audio) / self.rate

    def clock(self) -> float:
        """Seconds on IN.wav's timeline (monotonic)."""
        return time.monotonic() - self._t0

    def windows(self, done, tail_s: float):
        """Yields (window, t): t is the window's last sample on the timeline; the clock starts at the first."""
        silence = np.zeros(VAD_WINDOW, np.float32)
        self._t0 = time.monotonic()
        i = 0
        while True:
            t = (i + 1) * WINDOW_S
            if i >= self.n_win and (done() or t > self.n_win * WINDOW_S + tail_s):
                return
            if self.realtime:
                wait = t - self.clock()
                if wait > 0:
                    time.sleep(wait)
                elif wait < -WINDOW_S:
                    self.late += 1
            yield (self.x[i * VAD_WINDOW : (i + 1) * VAD_WINDOW] if i < self.n_win else silence), t
            i += 1


def run_file(model, vad, asr, tts, in_wav, out_wav=None, config: VoiceConfig = VoiceConfig(), report_json=None,
             tail_s: float = 30.0, realtime: bool = True, on_state=None) -> dict:
    """Play in_wav into a VoiceLoop at real-time pace, then silence until the last reply is spoken (at most
    tail_s); write the replies to out_wav and the report to report_json. Returns the report."""
    src = PacedInput(in_wav, realtime)
    audio, rate = src.audio, src.rate
    sink = FileOutput(src.clock)
    loop = VoiceLoop(model, vad, asr, tts, config, output=sink, clock=src.clock, on_state=on_state)
    try:
        for window, t in src.windows(lambda: loop.idle, tail_s):
            loop.process(window, t)
    finally:
        loop.close()
    if out_wav is not None:
        write_wav(out_wav, *sink.render(len(audio) / rate))
    report = {"input": {"file": str(in_wav), "seconds": round(len(audio) / rate, 3), "sample_rate": rate},
              "turns": [_rounded(tr.to_dict()) for tr in loop.turns],
              "engines": {"vad": getattr(vad, "name", "?"), "asr": getattr(asr, "name", "?"),
                          "tts": getattr(tts, "name", "?"), "llm": model.manifest.model_name,
                          "llm_backend": model.manifest.backend, "llm_threads": model.backend.threads},
              "config": {k: getattr(config, k) for k in config.__dataclass_fields__},
              "windows_late": src.late}
    if report_json is not None:
        Path(report_json).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return report


def _rounded(d: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}
