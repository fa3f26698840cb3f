"""Whisper tiny.en (CTranslate2, MIT) on a trimmed log-mel: the default ASR.

faster-whisper pads every utterance to 30 s (3000 mel frames) and pays the encoder for all of them; the raw
``ctranslate2.models.Whisper`` accepts a shorter mel, so we feed the audio plus PAD_S of silence
(DESIGN.md §6: 681 ms encoder at 3000 frames, 95 ms at 1000). Trimmed Whisper must decode in timestamp mode:
without timestamps it repeats itself, and even with them it can emit a segment past the end of the speech or
say the first segment again, so those segments are dropped (``clean_segments``). Worse, on a mel trimmed
just after the speech (as the voice loop's final pass is) the decoder often never closes its segment: it
says the sentence again and again until the length cap ("Go forward 10 meters. Go forward 10 meters. Go
forward 10"), 16 of 153 such cuts of real and espeak speech (human WER 42 % vs 8 % for the padded mel).
A decode that ends without its closing timestamp is a loop, and its repeating tail is cut
(``drop_repeated_tail``): human WER 8.7 %, as the 30 s padded mel.

Prefix reuse between passes (``reuse_prefix=True``, off by default): the longest prefix on which the
utterance's last two passes agree (LocalAgreement-2, as whisper_streaming commits text) is forced as the
next pass's decoder prompt. Measured, it does not pay with CTranslate2: a forced prompt token costs the
decoder as much CPU as a decoded one (~3 ms each on the dev host: the 51,864-word output projection is
computed for every position), so forcing 8 of 10 tokens saved ~2 of 36 ms, and a partial pass's mistake
gets locked in (WER 11.8 % -> 13.8 % on 51 clips). It pays only with a decoder that runs the forced
tokens without the vocabulary projection (our own kernels; not done).

The log-mel is computed here in numpy (no torch): Whisper's STFT (400-point periodic Hann, hop 160, reflect
padding), power spectrum, 80 slaney mel bands (``mel_filters``), log10 clamped to 8 below its max, scaled.
Token ids are decoded with the model's own vocabulary.txt (GPT-2 byte-level BPE), no tokenizer package.
"""
from __future__ import annotations

import logging
import re
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

from runtime.tokenizer import _byte_decoder
from runtime.voice.assets import asset_dir
from runtime.voice.engines import SAMPLE_RATE, Transcript

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'boardtalk[voice]'"
N_FFT = 400  # samples, 25 ms window
HOP = 160  # samples, 10 ms per mel frame
N_MELS = 80
CHUNK_S = 30  # Whisper's context, seconds
N_FRAMES = CHUNK_S * SAMPLE_RATE // HOP  # 3000 mel frames in 30 s
FRAMES_PER_TOKEN = 2  # the encoder halves the frame rate: one position = 20 ms
SECONDS_PER_TIMESTAMP = FRAMES_PER_TOKEN * HOP / SAMPLE_RATE  # 0.02 s per timestamp token step
PAD_S = 2.0  # seconds of silence after the audio in the trimmed mel
# The trimmed mel's length is rounded up to a multiple of this many frames (0.5 s): CTranslate2 keeps memory for
# every input length it has seen (the service's soak grew +38 MiB over 120 random lengths and kept climbing);
# with buckets a 2-30 s utterance is one of 56 shapes, and the extra silence costs ~2.5 ms of encoder on average.
MEL_BUCKET = 50
NO_SPEECH_PROB = 0.6  # a pass whose <|nospeech|> probability is above this ...
MIN_AVG_LOGPROB = -1.0  # ... and whose mean token log-probability is below this gives no text

# Special token ids of the English-only vocabulary (vocabulary.txt line number - 1); checked at load.
EOT = 50256  # <|endoftext|>
SOT = 50257  # <|startoftranscript|>
NO_TIMESTAMPS = 50362  # <|notimestamps|>
TIMESTAMP_BEGIN = 50363  # <|0.00|>


# -- features -------------------------------------------------------------------------------------------
def _hz_to_mel(f):
    """Slaney mel scale: linear below 1 kHz (3 mel per 200 Hz), logarithmic above."""
    f = np.asarray(f, np.float64)
    mel = f / (200.0 / 3)
    log_t = f >= 1000.0
    return np.where(log_t, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0), mel)


def _mel_to_hz(m):
    m = np.asarray(m, np.float64)
    return np.where(m >= 15.0, 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0)), m * (200.0 / 3))


@lru_cache(maxsize=4)
def mel_filters(n_mels: int = N_MELS, sr: int = SAMPLE_RATE, n_fft: int = N_FFT) -> np.ndarray:
    """(n_mels, n_fft // 2 + 1) float32 slaney-normalized triangular filters from 0 Hz to sr/2
    (librosa.filters.mel(sr, n_fft, n_mels), which Whisper's mel_filters.npz was made with)."""
    fft_hz = np.fft.rfftfreq(n_fft, 1.0 / sr)
    hz = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(sr / 2), n_mels + 2))
    ramps = hz[:, None] - fft_hz[None, :]
    fdiff = np.diff(hz)
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (hz[2:] - hz[:-2]))[:, None]  # constant energy per band
    return weights.astype(np.float32)


@lru_cache(maxsize=1)
def _hann() -> np.ndarray:
    return (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)).astype(np.float32)  # periodic, as torch


def log_mel(audio: np.ndarray, n_frames: int | None = None) -> np.ndarray:
    """(N_MELS, n_frames) float32 Whisper log-mel of 16 kHz mono audio. ``audio`` is zero-padded (or cut)
    to n_frames * HOP samples first; n_frames=None keeps every frame of the audio as it is."""
    audio = np.asarray(audio, np.float32).reshape(-1)
    if n_frames is not None:
        want = n_frames * HOP
        audio = np.pad(audio, (0, max(0, want - len(audio))))[:want]
    x = np.pad(audio, (N_FFT // 2, N_FFT // 2), mode="reflect")  # torch.stft(center=True)
    n = 1 + (len(x) - N_FFT) // HOP
    frames = np.lib.stride_tricks.as_strided(x, (n, N_FFT), (x.strides[0] * HOP, x.strides[0]))
    power = np.abs(np.fft.rfft(frames * _hann(), axis=1)) ** 2  # (n, N_FFT // 2 + 1)
    mel = mel_filters() @ power[:-1].T.astype(np.float32)  # Whisper drops the last STFT frame
    logspec = np.log10(np.maximum(mel, 1e-10))
    logspec = np.maximum(logspec, logspec.max() - 8.0)
    return ((logspec + 4.0) / 4.0).astype(np.float32)


# -- tokens -----------------------------------------------------------------------------------------------
class Vocabulary:
    """Token id -> text for Whisper's byte-level BPE, from CTranslate2's vocabulary.txt (one token a line)."""

    def __init__(self, path: str | Path):
        self.tokens = Path(path).read_text(encoding="utf-8").split("\n")
        if self.tokens and self.tokens[-1] == "":
            self.tokens.pop()
        expect = {EOT: "<|endoftext|>", SOT: "<|startoftranscript|>", NO_TIMESTAMPS: "<|notimestamps|>",
                  TIMESTAMP_BEGIN: "<|0.00|>"}
        for i, tok in expect.items():
            if i >= len(self.tokens) or self.tokens[i] != tok:
                raise ValueError(f"{path}: token {i} should be {tok}, found "
                                 f"{self.tokens[i] if i < len(self.tokens) else 'nothing'} (not Whisper English-only)")
        self._bytes = _byte_decoder()  # GPT-2's byte-level spelling, the LLM tokenizer's table

    def decode(self, ids) -> str:
        data = bytearray()
        for i in ids:
            if i < EOT:
                data.extend(self._bytes.get(ch, 32) for ch in self.tokens[i])
        return data.decode("utf-8", errors="replace")


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def clean_segments(segments: list[tuple[float, float, str]], audio_s: float) -> list[tuple[float, float, str]]:
    """Drop what trimmed Whisper hallucinates: segments that start at or after the end of the audio's speech
    (it saw PAD_S of silence there), empty ones, and later segments that repeat the first one or restart it
    (a later segment that is the first one's beginning: "Go forward 10 meters." then "Go")."""
    out = []
    for start, end, text in segments:
        if start >= audio_s or not _norm(text):
            continue
        if out and (_norm(out[0][2]) + " ").startswith(_norm(text) + " "):
            continue
        out.append((start, end, text))
    return out


def drop_repeated_tail(ids: list[int], min_tokens: int = 3) -> list[int]:
    """Cut a decoding loop: if the text tokens after the last timestamp end in a unit said twice or more
    (and repeated up to the end, the last copy possibly unfinished), keep the text up to its first copy.
    Only for a decode that ran into the length cap (no closing timestamp): a finished segment may repeat a
    word on purpose ("five five")."""
    k = max((j for j, i in enumerate(ids) if i >= EOT), default=-1)
    head, tail = ids[: k + 1], ids[k + 1 :]
    n = len(tail)
    for i in range(n):
        for p in range(1, (n - i) // 2 + 1):
            if n - i >= max(2 * p, min_tokens) and all(tail[j] == tail[i + (j - i) % p] for j in range(i + p, n)):
                return head + tail[: i + p]
    return ids


def agreed_prefix(a: list[int], b: list[int]) -> list[int]:
    """The ids two passes agree on from the start, within the first segment (a timestamp after the first
    token ends it; Whisper's later timestamps depend on how much audio a pass saw), without trailing
    punctuation (a pass cut mid-sentence ends one where the speech goes on)."""
    n = 0
    for x, y in zip(a, b):
        if x != y or (n > 0 and x >= EOT):
            break
        n += 1
    return a[:n]


def split_segments(ids: list[int], vocab: Vocabulary) -> list[tuple[float, float, str]]:
    """(start_s, end_s, text) segments from a timestamp-mode token sequence (<|t0|> text <|t1|> ...)."""
    segs, start, text_ids = [], 0.0, []
    for i in ids:
        if i >= TIMESTAMP_BEGIN:
            t = (i - TIMESTAMP_BEGIN) * SECONDS_PER_TIMESTAMP
            if text_ids:
                segs.append((start, t, vocab.decode(text_ids).strip()))
                text_ids = []
            start = t
        elif i < EOT:
            text_ids.append(i)
    if text_ids:  # text after the last timestamp (the decoder stopped without closing it)
        segs.append((start, start, vocab.decode(text_ids).strip()))
    return segs


# -- the engine -------------------------------------------------------------------------------------------
class WhisperASR:
    """Whisper tiny.en through ctranslate2 on a trimmed mel (audio + PAD_S), greedy, timestamp mode.

    threads: CTranslate2 intra-op threads (1: under load on 2 cores, 2 threads ran slower than 1).
    compute_type: CTranslate2's weight type on the CPU. "int8" (default) quantizes the float16 weights at
    load: 2.5x faster than "float32" on the dev host (~90 vs ~220 ms per utterance) with the same transcripts
    on the test clips.
    reuse_prefix: force the words the utterance's last two passes agree on as the decoder prompt (see the
    module docstring: measured not to pay with CTranslate2, so off).
    """

    name = "whisper-tiny-en"
    trimmed = True  # False: pad to 30 s as faster-whisper does

    def __init__(self, threads: int = 1, compute_type: str = "int8", max_tokens_per_s: float = 15.0,
                 reuse_prefix: bool = False):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        try:
            import ctranslate2
        except ImportError:
            raise ImportError(f"the Whisper ASR engine needs ctranslate2: {INSTALL_HINT}") from None
        model_dir = asset_dir("whisper-tiny-en")
        self.vocab = Vocabulary(model_dir / "vocabulary.txt")
        self.model = ctranslate2.models.Whisper(str(model_dir), device="cpu", compute_type=compute_type,
                                                intra_threads=threads, inter_threads=1)
        self._ctranslate2 = ctranslate2
        self.max_tokens_per_s = max_tokens_per_s  # decode length cap: a loop cannot run past it
        self.reuse_prefix = reuse_prefix  # force the last two passes' agreed words as the next pass's prompt
        self._passes: list[list[int]] = []  # decoded ids of this utterance's passes, oldest first
        self._punct = {i for i, t in enumerate(self.vocab.tokens[:EOT]) if t.strip("Ġ") in (".", "?", "!", ",")}
        self.last_prefix_tokens = 0  # ids the last pass took from earlier passes instead of decoding them

    def features(self, audio: np.ndarray) -> np.ndarray:
        """(1, N_MELS, frames) float32 mel the encoder sees."""
        if self.trimmed:
            frames = int(np.ceil((len(audio) / SAMPLE_RATE + PAD_S) * SAMPLE_RATE / HOP))
            frames = min(N_FRAMES, -(-frames // MEL_BUCKET) * MEL_BUCKET)  # even: the encoder's stride-2 conv
        else:
            frames = N_FRAMES
        return log_mel(audio, frames)[None]

    def transcribe(self, audio: np.ndarray) -> Transcript:
        audio = np.asarray(audio, np.float32).reshape(-1)
        audio_s = len(audio) / SAMPLE_RATE
        if audio_s > CHUNK_S:
            raise ValueError(f"utterance of {audio_s:.1f} s is longer than Whisper's {CHUNK_S} s window")
        t0 = time.perf_counter()
        mel = self._ctranslate2.StorageView.from_array(np.ascontiguousarray(self.features(audio)))
        max_len = int(min(448, 8 + self.max_tokens_per_s * max(audio_s, 1.0)))
        prefix = self._prefix()
        result = self.model.generate(mel, [[SOT] + prefix], beam_size=1, max_length=max_len, suppress_blank=True,
                                     suppress_tokens=[-1], max_initial_timestamp_index=50, return_scores=True,
                                     return_no_speech_prob=True)[0]
        ids = list(result.sequences_ids[0])  # the forced prefix included
        if ids and ids[-1] < EOT:  # no closing timestamp: the decoder ran into the cap, saying it again
            ids = drop_repeated_tail(ids)
        self.last_prefix_tokens = len(prefix)
        if result.no_speech_prob > NO_SPEECH_PROB and result.scores[0] < MIN_AVG_LOGPROB and not prefix:
            segments = []  # silence or noise: Whisper would say "you" (faster-whisper's rule)
        else:
            segments = clean_segments(split_segments(ids, self.vocab), audio_s)
        if self.trimmed:
            self._passes = (self._passes + [ids])[-2:]
        text = " ".join(s[2] for s in segments).strip()
        return Transcript(text=text, seconds=time.perf_counter() - t0, audio_s=audio_s, segments=segments)

    def _prefix(self) -> list[int]:
        """Ids to force: what this utterance's last two passes agree on (at least 2 words, else nothing)."""
        if not self.reuse_prefix or len(self._passes) < 2:
            return []
        p = agreed_prefix(*self._passes)
        while p and p[-1] in self._punct:
            p = p[:-1]
        return p if sum(1 for i in p if i < EOT) >= 2 else []

    def reset(self) -> None:
        """A new utterance: forget the earlier passes' words."""
        self._passes = []

    def warmup(self) -> None:
        rng = np.random.default_rng(0)
        self.transcribe((0.01 * rng.standard_normal(SAMPLE_RATE)).astype(np.float32))


class PaddedWhisperASR(WhisperASR):
    """The same model on a mel padded to 30 s, as faster-whisper runs it: the slow, well-trodden anchor
    (~5x the encoder time of the trimmed mel on a short utterance)."""

    name = "whisper-tiny-en-padded"
    trimmed = False
