"""The voice turn loop: VAD -> partial and final ASR -> speculative LLM -> clause chunks -> TTS -> output.

    loop = VoiceLoop(model, vad, asr, tts, VoiceConfig(system="You are Pip..."), output=sink)
    for window, t in windows:          # 512 samples of 16 kHz float32, t = time of its last sample (s)
        loop.process(window, t)
    loop.turns                         # one Turn per answered utterance, every time on the same clock

Never wait for what can already be done:
- while the user speaks, a partial ASR pass runs every ``partial_every_s`` and its text is prefilled
  into the session's KV cache (prefix reuse makes the final prefill a few tokens);
- at the first silent VAD window the final ASR pass starts at once, and the LLM and the TTS of its first
  clause start as soon as the transcript is there, speculatively; a window earlier still where the last
  voiced window's tail has gone quiet (``early_final``: Silero reports the end one window late);
- speech out is released only when the end of turn is confirmed (``hangover_s`` of silence, or, opt-in,
  only ``hangover_complete_s`` once the speculative transcript reads as a finished sentence: "Why is the
  sky blue?" but not "What is the capital of"), so a speculation never talks over the user; if the user
  speaks again first, the speculation is cancelled (counted in ``Turn.speculative_restarts``) and the
  session's prefix reuse rewinds to what still holds.

Work runs on three single-thread workers (ASR, LLM, TTS) so that each engine keeps one thread and the
three do not oversubscribe a 2-core board; ``process`` itself only runs the VAD (~0.2 ms) and the state
machine. Every timestamp is ``clock()`` seconds on one monotonic clock (file mode sets its zero at the
input's first sample).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from .chunker import Chunker
from .engines import SAMPLE_RATE, VAD_WINDOW

log = logging.getLogger(__name__)
WINDOW_S = VAD_WINDOW / SAMPLE_RATE  # 0.032 s


@dataclass(frozen=True)
class VoiceConfig:
    system: str = "You are a friendly voice assistant. Answer in one or two short sentences."
    max_new_tokens: int = 64  # reply length cap (tokens)
    vad_on: float = 0.5  # a window at or above this starts speech
    vad_off: float = 0.35  # during speech, a window below this is silence
    hangover_s: float = 0.25  # silence that confirms the end of a turn (pure latency: keep it short)
    # silence that is enough once the speculative transcript is a complete sentence (ends in . ? ! and not
    # in a word that cannot end one); None (default): always hangover_s. 0.15 gave first audio ~96 ms sooner
    # on 36 of 43 bench turns but cut 2 of 8 users who paused 0.2-0.3 s after a complete clause ("Remind me
    # to call my sister." ... "tomorrow morning"): opt-in (docs/voice.md)
    hangover_complete_s: float | None = None
    min_speech_s: float = 0.2  # voiced time below which an utterance is noise
    preroll_s: float = 0.3  # audio kept from before the speech onset
    partial_every_s: float = 0.5  # a partial ASR pass (and prefill) this often during speech
    # start the final pass in a voiced window whose last 16 ms are 30 dB below the utterance's loudest 4 ms
    # and whose VAD probability is falling (< 0.9): one window (32 ms) before Silero calls it silence
    early_final: bool = True
    barge_in: bool = False  # speech during playback stops it (needs echo cancellation or file mode)
    barge_in_s: float = 0.15  # voiced time during playback that counts as barge-in

    def __post_init__(self) -> None:
        for name in ("hangover_s", "hangover_complete_s", "min_speech_s", "preroll_s", "partial_every_s",
                     "barge_in_s"):
            v = getattr(self, name)
            if v is None and name == "hangover_complete_s":
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= 10:
                raise ValueError(f"{name} must be a number of seconds from 0 to 10, got {v!r}")
        if not 0 < self.vad_off <= self.vad_on < 1:
            raise ValueError(f"need 0 < vad_off <= vad_on < 1, got {self.vad_off}, {self.vad_on}")
        if self.hangover_complete_s is not None and self.hangover_complete_s > self.hangover_s:
            raise ValueError(f"hangover_complete_s ({self.hangover_complete_s}) must not exceed hangover_s "
                             f"({self.hangover_s})")
        if not isinstance(self.early_final, bool):
            raise ValueError(f"early_final must be True or False, got {self.early_final!r}")
        if not isinstance(self.max_new_tokens, int) or not 1 <= self.max_new_tokens <= 4096:
            raise ValueError(f"max_new_tokens must be an integer from 1 to 4096, got {self.max_new_tokens!r}")


@dataclass
class Turn:
    """One answered utterance. Times are seconds on the loop's clock; None = did not happen."""
    transcript: str = ""
    reply_text: str = ""  # what was handed to the speaker (all of it, or up to a barge-in)
    speech_start_s: float | None = None
    speech_end_s: float | None = None  # the last voiced sample
    final_start_s: float | None = None  # the kept final ASR pass started (first silent window, or later if queued)
    transcript_final_s: float | None = None  # the kept final ASR pass finished
    first_token_s: float | None = None  # first token of the kept reply
    first_audio_s: float | None = None  # its first sample handed to the output
    end_of_turn_s: float | None = None  # silence confirmed the end of the turn
    end_of_turn_rule: str = ""  # "complete" (hangover_complete_s after a finished sentence) or "hangover"
    reply_done_s: float | None = None  # the last sample of the reply handed to the output
    speculative_restarts: int = 0  # speculations cancelled because the user went on speaking
    early_finals: int = 0  # final passes started on a quiet window tail (early_final), kept or not
    partial_passes: int = 0
    asr_final_ms: float | None = None  # wall time of the kept final ASR pass
    tts_first_ms: float | None = None  # wall time of the first chunk's synthesis
    prefill_reused_tokens: int = 0  # prompt tokens whose KV came from partial prefills / earlier turns
    interrupted: bool = False  # barge-in cut the reply
    partials: list = field(default_factory=list)  # (time, text) of partial passes

    def latencies_ms(self) -> dict:
        """The stage latencies after the end of speech, in ms."""
        def d(t):
            return None if t is None or self.speech_end_s is None else round((t - self.speech_end_s) * 1e3, 1)
        return {"transcript": d(self.transcript_final_s), "first_token": d(self.first_token_s),
                "end_of_turn": d(self.end_of_turn_s), "first_audio": d(self.first_audio_s)}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["latency_ms"] = self.latencies_ms()
        return d


class _Speculation:
    """One attempt at answering the utterance as heard so far: final ASR -> LLM -> TTS."""

    def __init__(self, sid: int, audio: np.ndarray):
        import runtime

        self.sid = sid
        self.audio = audio
        self.cancel = runtime.CancelToken()
        self.transcript: str | None = None
        self.transcript_s = self.asr_ms = self.start_s = None
        self.first_token_s = None
        self.reused = 0
        self.chunks: list[tuple[str, np.ndarray, float]] = []  # (text, audio, ready time), in order
        self.tts_first_ms = None
        self.llm_done = False
        self.released = 0  # chunks handed to the output so far
        self.lock = threading.Lock()


class VoiceLoop:
    IDLE, SPEECH, REPLY = "listening", "speech", "speaking"

    def __init__(self, model, vad, asr, tts, config: VoiceConfig = VoiceConfig(),
                 output: Callable[[np.ndarray, int, float], float] | None = None,
                 clock: Callable[[], float] = time.monotonic, on_state: Callable[[str], None] | None = None):
        """output(audio, rate, t) hands audio to the speaker at time t and returns when its last sample will
        have been played; stop_output() (if the sink has .stop) cuts playback for barge-in."""
        import runtime

        self.model, self.vad, self.asr, self.tts, self.cfg = model, vad, asr, tts, config
        self.output = output
        self.clock = clock
        self.on_state = on_state
        self.session = model.new_session()
        self.history = [{"role": "system", "content": config.system}] if config.system else []
        if self.history:
            self.session.warm_prefix(self.history)
        self.gen_cfg = runtime.GenerationConfig(max_new_tokens=config.max_new_tokens)
        self._asr = ThreadPoolExecutor(1, thread_name_prefix="asr")
        self._llm = ThreadPoolExecutor(1, thread_name_prefix="llm")
        self._tts = ThreadPoolExecutor(1, thread_name_prefix="tts")
        self.turns: list[Turn] = []
        self.state = self.IDLE
        self._preroll = np.zeros(0, np.float32)
        self._utt: list[np.ndarray] = []
        self._turn: Turn | None = None
        self._spec: _Speculation | None = None
        self._sid = 0
        self._silence = 0.0
        self._voiced = 0.0
        self._peak = 0.0  # loudest 4 ms block RMS of the utterance so far
        self._last_voiced_t = 0.0
        self._last_partial_t = 0.0
        self._partial_busy = False
        self._playing_until = 0.0
        self._barge = 0.0
        self._out_lock = threading.Lock()  # _release runs on the main and the TTS thread
        self._spec_of_turn: _Speculation | None = None
        self._turn_of_spec: Turn | None = None
        self.vad.reset()

    # ---- input ------------------------------------------------------------------------------
    def process(self, window: np.ndarray, t: float) -> None:
        """One VAD window (VAD_WINDOW samples, float32 16 kHz) whose last sample is at time t."""
        p = float(self.vad(window))
        if self.state == self.REPLY:
            self._during_reply(window, p, t)
            return
        if self.state == self.IDLE:
            if p >= self.cfg.vad_on:
                self._start_speech(window, t)
            else:
                keep = int(self.cfg.preroll_s * SAMPLE_RATE)
                self._preroll = np.concatenate([self._preroll, window])[-keep:] if keep else self._preroll
            return
        # in speech
        self._utt.append(window)
        if p >= self.cfg.vad_off:
            self._voiced += WINDOW_S
            self._last_voiced_t = t - WINDOW_S + _last_loud(window) / SAMPLE_RATE
            self._silence = 0.0
            blocks = _block_rms(window)
            quiet_tail = blocks[-EARLY_TAIL_BLOCKS:].max() < EARLY_QUIET * self._peak
            self._peak = max(self._peak, float(blocks.max()))
            if self._spec is not None:  # the user went on: the speculation is void
                self._abandon_speculation()
                self._turn.speculative_restarts += 1
            if (self.cfg.early_final and p < EARLY_MAX_P and quiet_tail and self._voiced >= self.cfg.min_speech_s):
                self._turn.early_finals += 1
                self._speculate()  # the next window decides: voiced abandons it, silent keeps it
            elif t - self._last_partial_t >= self.cfg.partial_every_s and not self._partial_busy:
                self._partial_pass(t)
            return
        self._silence += WINDOW_S
        if self._spec is None and self._voiced >= self.cfg.min_speech_s:
            self._speculate()
        complete = (self.cfg.hangover_complete_s is not None and self._silence >= self.cfg.hangover_complete_s
                    and self._spec is not None and complete_sentence(self._spec.transcript))
        if self._silence >= self.cfg.hangover_s or complete:
            if self._voiced < self.cfg.min_speech_s:
                self._set_state(self.IDLE)  # a click or a cough
                self._reset_utterance()
                return
            self._confirm(t, "complete" if complete and self._silence < self.cfg.hangover_s else "hangover")

    def _start_speech(self, window: np.ndarray, t: float) -> None:
        self._utt = [self._preroll, window]
        self._preroll = np.zeros(0, np.float32)
        self._turn = Turn(speech_start_s=t - WINDOW_S)
        self._voiced, self._silence = WINDOW_S, 0.0
        self._peak = float(_block_rms(window).max())
        self._last_voiced_t = t
        self._last_partial_t = t
        self._asr.submit(self.asr.reset)  # a new utterance: forget what the last one's passes kept
        self._set_state(self.SPEECH)

    def _reset_utterance(self) -> None:
        self._utt, self._turn, self._spec = [], None, None
        self._voiced = self._silence = 0.0

    # ---- partial passes during speech ---------------------------------------------------------
    def _partial_pass(self, t: float) -> None:
        self._last_partial_t = t
        self._partial_busy = True
        audio = np.concatenate(self._utt)
        turn = self._turn

        def run():
            try:
                text = self.asr.transcribe(audio).text.strip()
                turn.partials.append((round(self.clock(), 3), text))
                turn.partial_passes += 1
                if text:  # prefill history + the words so far: the final prefill then reuses them.
                    # Not waited for here: the ASR worker must be free the moment the final pass is due.
                    self._llm.submit(self._prefill_partial, text)
                    return
            except Exception:  # noqa: BLE001  a failed partial only costs latency
                log.exception("partial ASR pass failed")
            self._partial_busy = False

        self._asr.submit(run)

    def _prefill_partial(self, text: str) -> None:
        try:
            if self.state == self.SPEECH and self._spec is None:  # else a final pass is under way or done: the
                # reply's own prefill covers this
                self.session.warm_prefix(self.history + [{"role": "user", "content": text}])
        except Exception:  # noqa: BLE001  (a context overflow is handled when the turn is answered)
            log.debug("partial prefill skipped", exc_info=True)
        finally:
            self._partial_busy = False  # one partial (pass and prefill) at a time

    # ---- speculation: final ASR -> LLM -> TTS, released at the confirmed end of turn ----------
    def _speculate(self) -> None:
        self._sid += 1
        spec = self._spec = _Speculation(self._sid, np.concatenate(self._utt))
        self._asr.submit(self._final_pass, spec)

    def _abandon_speculation(self) -> None:
        spec, self._spec = self._spec, None
        spec.cancel.cancel()

    def _final_pass(self, spec: _Speculation) -> None:
        if spec.cancel.cancelled:
            return
        t0 = time.monotonic()
        spec.start_s = self.clock()
        try:
            text = self.asr.transcribe(spec.audio).text.strip()
        except Exception:  # noqa: BLE001
            log.exception("final ASR pass failed")
            text = ""
        spec.asr_ms = (time.monotonic() - t0) * 1e3
        spec.transcript, spec.transcript_s = text, self.clock()
        if not text or spec.cancel.cancelled:
            spec.llm_done = True
            return
        self._llm.submit(self._generate, spec)

    def _generate(self, spec: _Speculation) -> None:
        import runtime

        chunker = Chunker()
        messages = self.history + [{"role": "user", "content": spec.transcript}]
        try:
            for delta in self.session.chat(messages, self.gen_cfg, spec.cancel):
                if spec.first_token_s is None:
                    spec.first_token_s = self.clock()
                    spec.reused = self.session.last_stats.reused_tokens
                for chunk in chunker.push(delta):
                    self._tts.submit(self._synthesize, spec, chunk)
            if not spec.cancel.cancelled:
                for chunk in chunker.flush():
                    self._tts.submit(self._synthesize, spec, chunk)
            st = self.session.last_stats
            if st.dropped_messages:  # the model no longer sees them: neither does the next turn
                first = 1 if self.history and self.history[0]["role"] == "system" else 0
                self.history = self.history[:first] + self.history[first + st.dropped_messages :]
        except (runtime.ContextOverflow, ValueError) as e:
            log.warning("no reply to %r: %s", spec.transcript[:60], e)
        finally:
            self._tts.submit(self._llm_finished, spec)  # after every chunk queued before it

    def _synthesize(self, spec: _Speculation, text: str) -> None:
        if spec.cancel.cancelled:
            return
        t0 = time.monotonic()
        try:
            audio = np.asarray(self.tts.synthesize(text), np.float32)
        except Exception:  # noqa: BLE001
            log.exception("TTS failed for %r", text[:60])
            return
        if spec.tts_first_ms is None:
            spec.tts_first_ms = (time.monotonic() - t0) * 1e3
        with spec.lock:
            spec.chunks.append((text, audio, self.clock()))
        self._release(spec)

    def _llm_finished(self, spec: _Speculation) -> None:
        spec.llm_done = True

    # ---- end of turn and output ---------------------------------------------------------------
    def _confirm(self, t: float, rule: str = "hangover") -> None:
        if self._spec is None:
            self._speculate()
        turn, spec = self._turn, self._spec
        turn.speech_end_s = self._last_voiced_t
        turn.end_of_turn_s = t
        turn.end_of_turn_rule = rule
        self.turns.append(turn)
        self._spec_of_turn = spec
        self._turn_of_spec = turn
        self._utt, self._spec, self._turn = [], None, None
        self._set_state(self.REPLY)
        spec.confirmed = True
        self._release(spec)

    def _release(self, spec: _Speculation) -> None:
        """Hand the spec's ready chunks to the output, in order, once its turn is confirmed."""
        if not getattr(spec, "confirmed", False) or spec.cancel.cancelled:
            return
        with self._out_lock:
            self._release_locked(spec, self._turn_of_spec)

    def _release_locked(self, spec: _Speculation, turn: Turn) -> None:
        with spec.lock:
            ready = spec.chunks[spec.released :]
            spec.released += len(ready)
        for text, audio, _ in ready:
            now = self.clock()
            start = max(now, self._playing_until)
            if turn.first_audio_s is None:
                turn.first_audio_s = start
                turn.transcript, turn.transcript_final_s = spec.transcript, spec.transcript_s
                turn.final_start_s = spec.start_s
                turn.first_token_s, turn.asr_final_ms = spec.first_token_s, spec.asr_ms
                turn.tts_first_ms, turn.prefill_reused_tokens = spec.tts_first_ms, spec.reused
            self._playing_until = self.output(audio, self.tts.sample_rate, start) if self.output else start
            turn.reply_text = (turn.reply_text + " " + text).strip()
            turn.reply_done_s = self._playing_until

    def _during_reply(self, window: np.ndarray, p: float, t: float) -> None:
        spec, turn = self._spec_of_turn, self._turn_of_spec
        if self.cfg.barge_in and p >= self.cfg.vad_on:
            self._barge += WINDOW_S
            if self._barge >= self.cfg.barge_in_s:
                self._barge_in(window, t)
                return
        else:
            self._barge = 0.0
        done = spec.llm_done and spec.released == len(spec.chunks) and t >= self._playing_until
        if done:
            self._finish_reply(turn)

    def _barge_in(self, window: np.ndarray, t: float) -> None:
        spec, turn = self._spec_of_turn, self._turn_of_spec
        spec.cancel.cancel()
        stop = getattr(self.output, "stop", None)
        heard_until = stop(t) if stop else t  # the output says up to when audio was really heard
        turn.interrupted = True
        turn.reply_text = self._heard_text(spec, heard_until if heard_until is not None else t)
        self._playing_until = t
        self._finish_reply(turn)
        self._start_speech(window, t)
        self._turn.speech_start_s = t - self.cfg.barge_in_s

    def _heard_text(self, spec: _Speculation, until: float) -> str:
        """The words of the released chunks heard before ``until`` (a chunk cut midway: its first words,
        in proportion to the time it played)."""
        words, t = [], self._turn_of_spec.first_audio_s
        for text, audio, _ in spec.chunks[: spec.released]:
            dur = len(audio) / self.tts.sample_rate
            if t >= until:
                break
            part = text.split()
            frac = min(1.0, (until - t) / dur) if dur else 1.0
            words += part[: int(round(len(part) * frac))]
            t += dur
        return " ".join(words)

    def _finish_reply(self, turn: Turn) -> None:
        spec = self._spec_of_turn
        if not turn.transcript and spec is not None and spec.transcript:  # a reply with no audio
            turn.transcript, turn.transcript_final_s, turn.asr_final_ms = spec.transcript, spec.transcript_s, spec.asr_ms
            turn.final_start_s = spec.start_s
            turn.first_token_s = spec.first_token_s
        if turn.transcript:
            self.history += [{"role": "user", "content": turn.transcript},
                             {"role": "assistant", "content": turn.reply_text}]
        self._barge = 0.0
        self.vad.reset()
        end = getattr(self.output, "end_reply", None)  # the reply's last sample is out: not an underrun after it
        if end is not None:
            end()
        self._set_state(self.IDLE)

    def _set_state(self, state: str) -> None:
        self.state = state
        if self.on_state:
            self.on_state(state)

    @property
    def idle(self) -> bool:
        """No utterance in progress and nothing left to say."""
        return self.state == self.IDLE

    def close(self) -> None:
        for spec in (self._spec, self._spec_of_turn):  # also a reply being spoken: Ctrl-C must not wait for it
            if spec is not None:
                spec.cancel.cancel()
        for ex in (self._asr, self._llm, self._tts):
            ex.shutdown(wait=True, cancel_futures=True)
        self.session.close()


# Words a finished English sentence rarely ends in: articles, conjunctions, possessives and prepositions that
# are seldom particles. A transcript ending in one (even with Whisper's full stop) is a pause mid-sentence.
# Auxiliaries and pronouns are not here: questions end in them ("How many legs does a spider have?").
_OPEN_ENDINGS = frozenset("""a an the and or but nor because if than of to for from with by into onto at my your
his her its our their very""".split())


def complete_sentence(text: str | None) -> bool:
    """True when ``text`` reads as a finished sentence: it ends in . ? or ! and its last word is not one a
    sentence cannot end in ("What is the capital of." is a pause, not a question)."""
    if not text:
        return False
    text = text.strip()
    if not text.endswith((".", "?", "!")) or text.endswith("..."):
        return False
    words = text.lower().rstrip(".?!").replace(",", " ").split()
    return bool(words) and words[-1] not in _OPEN_ENDINGS


EARLY_TAIL_BLOCKS = 4  # 4 ms blocks at a window's end that must be quiet for an early final pass (16 ms)
EARLY_QUIET = 0.03  # quiet = block RMS below this fraction of the utterance's loudest block (-30 dB)
EARLY_MAX_P = 0.9  # and the window's VAD probability below this (speech fading, not a stop consonant)


def _block_rms(window: np.ndarray, block: int = 64) -> np.ndarray:
    """(len // block,) float64 RMS of consecutive 4 ms blocks of a window."""
    n = len(window) // block
    return np.sqrt((window[: n * block].reshape(n, block).astype(np.float64) ** 2).mean(1))


def _last_loud(window: np.ndarray, block: int = 64) -> int:
    """Index just past the last 4 ms block of a voiced window whose RMS is at least 10 % of its loudest
    block's: the last voiced sample, finer than the VAD's 32 ms."""
    n = len(window) // block
    rms = np.sqrt((window[: n * block].reshape(n, block).astype(np.float64) ** 2).mean(1))
    loud = np.nonzero(rms >= 0.1 * rms.max())[0] if rms.max() > 0 else []
    return int((loud[-1] + 1) * block) if len(loud) else len(window)
