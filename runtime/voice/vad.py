"""Silero VAD v6 (ONNX, MIT) run with onnxruntime: a speech probability per 32 ms window.

The model is recurrent: each call sees the last CONTEXT samples of the previous window in front of the new
one and carries an LSTM state; both live on the instance and reset() forgets them (a new stream).
"""
from __future__ import annotations

import logging

import numpy as np

from runtime.voice.assets import asset
from runtime.voice.engines import SAMPLE_RATE, VAD_WINDOW

log = logging.getLogger(__name__)

CONTEXT = 64  # samples of the previous window the model sees in front of each new one (at 16 kHz)
INSTALL_HINT = "pip install 'boardtalk[voice]'"


def _ort():
    try:
        import onnxruntime as ort
    except ImportError:
        raise ImportError(f"the voice engines need onnxruntime: {INSTALL_HINT}") from None
    return ort


def ort_session(path, threads: int):
    ort = _ort()
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


class SileroVAD:
    name = "silero"

    def __init__(self, threads: int = 1):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.session = ort_session(asset("silero_vad.onnx"), threads)
        self._sr = np.array(SAMPLE_RATE, dtype=np.int64)
        self.reset()

    def reset(self) -> None:
        self._state = np.zeros((2, 1, 128), np.float32)  # LSTM (h, c), batch 1
        self._context = np.zeros(CONTEXT, np.float32)  # tail of the previous window

    def __call__(self, window: np.ndarray) -> float:
        window = np.asarray(window, dtype=np.float32).reshape(-1)
        if window.shape[0] != VAD_WINDOW:
            raise ValueError(f"VAD window must be {VAD_WINDOW} samples at {SAMPLE_RATE} Hz, got {window.shape[0]}")
        x = np.concatenate([self._context, window])[None, :]  # (1, CONTEXT + VAD_WINDOW) float32
        prob, self._state = self.session.run(None, {"input": x, "state": self._state, "sr": self._sr})
        self._context = window[-CONTEXT:].copy()
        return float(prob.reshape(-1)[0])

    def probabilities(self, audio: np.ndarray) -> np.ndarray:
        """One probability per whole window of ``audio`` (a trailing partial window is dropped); keeps state."""
        audio = np.asarray(audio, dtype=np.float32).reshape(-1)
        n = audio.shape[0] // VAD_WINDOW
        return np.array([self(audio[i * VAD_WINDOW:(i + 1) * VAD_WINDOW]) for i in range(n)], np.float32)

    def warmup(self) -> None:
        self(np.zeros(VAD_WINDOW, np.float32))
        self.reset()


def speech_segments(probs: np.ndarray, threshold: float = 0.5, neg_threshold: float = 0.35,
                    min_silence_windows: int = 4) -> list[tuple[float, float]]:
    """(start_s, end_s) of speech from per-window probabilities: a hysteresis (enter at ``threshold``, leave
    after ``min_silence_windows`` windows below ``neg_threshold``). The end is the first quiet window."""
    win_s = VAD_WINDOW / SAMPLE_RATE
    segs, start, quiet = [], None, 0
    for i, p in enumerate(probs):
        if start is None:
            if p >= threshold:
                start, quiet = i, 0
        elif p < neg_threshold:
            quiet += 1
            if quiet >= min_silence_windows:
                segs.append((start * win_s, (i - quiet + 1) * win_s))
                start = None
        else:
            quiet = 0
    if start is not None:
        segs.append((start * win_s, len(probs) * win_s))
    return segs
