"""The toy: the voice loop (runtime/voice/pipeline.py, used unchanged) behind a wake phrase or a
push-to-talk key, with earcons, a face, a content guard, and a memory that forgets.

    toy = Toy(model, vad, asr, tts, persona, output=sink, clock=clock, face=face)
    for window, t in windows:     # 512 samples of 16 kHz float32; t = seconds of its last sample
        toy.feed(window, t)       # (push-to-talk: toy.press(t) when the key is pressed)
    toy.close()

How it sits around the loop, without forking it:
- the loop's ASR engine is a WakeGate (voice_demo/wake.py): asleep, an utterance without the wake phrase
  transcribes to "" and gets no reply; the loop answers only the question after the phrase;
- the loop's TTS engine is a GuardedTTS (voice_demo/guard.py): reply chunks with a blocked word are not said;
- the loop's output is a ToySink: earcons and replies share one timeline and never overlap;
- push-to-talk: while the microphone is closed the loop is fed silence (so its clock still runs);
- while an earcon plays the loop is fed silence too (a live microphone would hear the beep);
- the loop's state callback drives the face, the follow-up window and the memory.
Every method runs on the caller's (main) thread, except ToySink.__call__ and GuardedTTS.synthesize,
which the loop also calls from its TTS thread.
"""
from __future__ import annotations

import logging
import math
import threading
import time

import numpy as np

import runtime
from runtime.voice.engines import VAD_WINDOW
from runtime.voice.pipeline import VoiceConfig, VoiceLoop

from .earcons import earcon
from .guard import ContentGuard, GuardedTTS
from .persona import Persona
from .wake import WakeGate

log = logging.getLogger(__name__)
MIN_QUESTION_TOKENS = 32  # context a persona must leave for the child's question (besides prompt and reply)


class ToySink:
    """The loop's output (FileOutput in file mode, live.SpeakerSink live) with earcons on the same timeline:
    nothing starts before what was handed over earlier has ended. ``earcon_until``: when the last earcon ends."""

    def __init__(self, output, on_audio=None):
        self.output, self.on_audio = output, on_audio
        self.until = 0.0  # seconds on the loop's clock: the end of everything handed over so far
        self.earcon_until = -math.inf
        self._lock = threading.Lock()
        self._before = None  # once per reply: a callable giving (earcon audio, rate) to play first, or None

    def arm(self, before) -> None:
        with self._lock:
            self._before = before

    def take_armed(self):
        """Disarm, returning what was armed (None: nothing)."""
        with self._lock:
            before, self._before = self._before, None
            return before

    def _hand(self, audio: np.ndarray, rate: int, t: float) -> float:
        start = max(t, self.until)
        self.until = self.output(audio, rate, start) if self.output else start + len(audio) / rate
        return start

    def __call__(self, audio: np.ndarray, rate: int, t: float) -> float:
        with self._lock:
            before, self._before = self._before, None
            pre = before(t) if before else None
            if pre is not None:
                self._hand(*pre, t)
            self._hand(audio, rate, t)
            end = self.until
        if self.on_audio and len(audio):
            self.on_audio()
        return end

    def earcon(self, audio: np.ndarray, rate: int, t: float) -> float:
        """Play an earcon at t (or after what is playing); returns when it ends."""
        with self._lock:
            self._hand(audio, rate, t)
            self.earcon_until = self.until
            return self.until

    def stop(self, t: float) -> float:
        stop = getattr(self.output, "stop", None)
        with self._lock:
            self.until = t
        return stop(t) if stop else t

    def end_reply(self):
        """The loop's reply is over: passed on (live.SpeakerSink counts underruns inside a reply only)."""
        end = getattr(self.output, "end_reply", None)
        return end() if end else None


class Toy:
    def __init__(self, model, vad, asr, tts, persona: Persona, output=None, clock=time.monotonic, face=None,
                 keep_turns: bool = True):
        """keep_turns: keep every turn's record (transcripts included) for a report; False (live mode): keep
        none once it has been shown."""
        p = self.persona = persona
        self.wake = p.activation.mode == "wake"
        self.gate = WakeGate(asr, p.wake_phrase if self.wake else None, p.activation.wake_match)
        self.tts = GuardedTTS(tts, ContentGuard(p.guard.extra_words, p.guard.redirect))
        self.sink = ToySink(output, on_audio=self._on_audio)
        self.face, self.clock, self.keep_turns = face, clock, keep_turns
        self._earcons = {k: earcon(k, tts.sample_rate, p.earcons.volume) for k in ("listen", "sleep")}
        self.events: list[dict] = []  # {"t": s, "event": ...}: earcons, wake, sleep, forget, push-to-talk
        self.turns: list[dict] = []  # finished turns (keep_turns)
        self.listening = False  # awake: follow-up window (wake) or microphone open (push-to-talk)
        self.listen_until = -math.inf  # when listening ends if no speech starts
        self.last_turn_end: float | None = None  # when the last answered turn ended (forgetting counts from it)
        self.t = 0.0  # the current window's time
        self._prev = VoiceLoop.IDLE
        self._silence = np.zeros(VAD_WINDOW, np.float32)
        self._system = [{"role": "system", "content": p.system_prompt}]
        cfg = VoiceConfig(system=p.system_prompt, max_new_tokens=p.max_reply_tokens)
        try:
            self.loop = VoiceLoop(model, vad, self.gate, self.tts, cfg, output=self.sink, clock=clock,
                                  on_state=self._on_state)
        except runtime.ContextOverflow:
            self.loop = None
        n = len(model.tokenizer.encode(p.system_prompt)) if self.loop is None else \
            len(self.loop.session.chat_ids(self._system, add_generation_prompt=False))
        if self.loop is None or n + p.max_reply_tokens + MIN_QUESTION_TOKENS > model.max_context:
            if self.loop is not None:
                self.loop.close()
            raise ValueError(f"persona {p.name}: the system prompt ({n} tokens) and a reply of max_reply_tokens "
                             f"{p.max_reply_tokens} leave less than {MIN_QUESTION_TOKENS} tokens for a question in "
                             f"the model's context of {model.max_context}: shorten the prompt")
        self._show("sleeping")

    # ---- input ---------------------------------------------------------------------------------
    def feed(self, window: np.ndarray, t: float) -> None:
        """One microphone window (VAD_WINDOW float32 samples at 16 kHz) whose last sample is at t."""
        self.t = t
        if self.loop.idle:
            self._timers(t)
        mic = (self.wake or self.listening) and t >= self.sink.earcon_until
        self.loop.process(window if mic else self._silence, t)

    def press(self, t: float) -> None:
        """The push-to-talk key, pressed at t: opens the microphone (after the listen earcon), or closes it
        again if no speech has started."""
        if self.wake:
            return
        if not self.loop.idle:
            return  # mid-utterance or mid-reply: the key does nothing
        if self.listening:
            self._event(t, "mic closed (key)")
            self._sleep(t, earcon=False)
            return
        end = self._earcon("listen", t)
        self.listening, self.listen_until = True, end + self.persona.activation.listen_s
        self._event(t, "mic open (key)")
        self._show("listening")

    def _timers(self, t: float) -> None:
        if self.listening and t >= self.listen_until and t >= self.sink.until:
            self._sleep(t, earcon=True)
        forget = self.persona.privacy.forget_after_s
        if not self.listening and self.last_turn_end is not None and t - self.last_turn_end >= forget:
            self.forget(t)

    # ---- the loop's state changes (main thread, inside loop.process) ---------------------------
    def _on_state(self, state: str) -> None:
        prev, self._prev = self._prev, state
        if state == VoiceLoop.SPEECH:
            self.gate.begin(awake=self.listening)
            self.tts.new_reply()
            self.sink.arm(self._before_reply)
            if self.listening:
                self._show("hearing")
        elif state == VoiceLoop.REPLY:
            if not self.wake:
                self.listening = False  # push-to-talk: one utterance per press
            if self.listening or self.gate.heard.woke or not self.wake:
                self._show("thinking")
            if self.sink.take_armed() is not None:  # the end of turn is confirmed: beep now if it is known
                before = self._before_reply(self.t)  # that the phrase woke the toy, else before the reply
                if before is None:
                    self.sink.arm(self._before_reply)
                else:
                    self.sink.earcon(*before, self.t)
        elif prev == VoiceLoop.REPLY:
            self._after_turn(self.t)
        else:  # a noise burst, not a turn
            self._show("listening" if self.listening else "sleeping")

    def _before_reply(self, t: float):
        """The listen earcon (audio, rate) when this utterance woke the toy up (it was asleep), else None. Asked
        when the end of the turn is confirmed and, if the transcript did not know it yet, (under the sink's
        lock) before the reply's first audio."""
        h = self.gate.heard
        if not (self.wake and h.woke and not h.awake and self.persona.earcons.enabled):
            return None
        if h.question:  # "hey coco, what color is the sky?": the answer itself says it heard; a beep first
            return None  # would only delay it (by the earcon's 200 ms, measured)
        self._event(t, "earcon listen")
        return self._earcons["listen"], self.tts.sample_rate

    def _on_audio(self) -> None:
        self._show("speaking")

    def _after_turn(self, t: float) -> None:
        turn, h = self.loop.turns[-1], self.gate.heard
        spoken = " ".join(self.tts.spoken)
        if self.tts.blocked:  # what was said and what is remembered is the guarded text
            turn.reply_text = spoken
            if self.loop.history and self.loop.history[-1]["role"] == "assistant":
                self.loop.history[-1] = {"role": "assistant", "content": spoken}
        asked = bool(turn.transcript)
        if asked and self.face:
            self.face.say(f"you: {turn.transcript}")
            if turn.reply_text:
                self.face.say(f"{self.persona.name.lower()}: {turn.reply_text}")
        if self.keep_turns:
            d = turn.to_dict()
            d.update(heard=h.raw, woke=h.woke, was_listening=h.awake, blocked_words=list(self.tts.blocked))
            self.turns.append(d)
        if not self.keep_turns:  # live: nothing of the conversation is kept beyond the model's short history
            self.loop.turns.clear()
        h.raw = h.question = ""
        if asked:
            self.last_turn_end = t
            self._trim_memory()
        if self.wake:
            if asked:
                self._listen_more(t)
            elif h.woke:  # the phrase alone: "I am listening"
                self._event(t, "wake")
                self._listen_more(self._earcon("listen", t))
        if self.listening:
            self._show("listening")
        else:
            self._show("sleeping")

    def _listen_more(self, t: float) -> None:
        self.listening, self.listen_until = True, t + self.persona.activation.follow_up_s

    def _sleep(self, t: float, earcon: bool) -> None:
        self.listening = False
        if earcon:
            self._earcon("sleep", t)
        self._event(t, "asleep")
        self._show("sleeping")

    # ---- memory ----------------------------------------------------------------------------------
    def _trim_memory(self) -> None:
        keep = 2 * self.persona.privacy.memory_turns  # messages: a user and an assistant one per exchange
        rest = self.loop.history[len(self._system):]
        if len(rest) > keep:
            self.loop.history = self._system + (rest[-keep:] if keep else [])

    def forget(self, t: float) -> bool:
        """Forget the conversation: the history back to the system prompt and the KV cache rewound to it.
        False (try again later) while the loop's session is busy."""
        import runtime

        try:
            self.loop.session.warm_prefix(self._system)  # rewinds the cache to the system prompt's end
        except runtime.SessionBusy:
            return False
        self.loop.history = list(self._system)
        if not self.keep_turns:
            self.loop.turns.clear()
        self.last_turn_end = None
        self._event(t, "forgot the conversation")
        return True

    # ---- helpers ---------------------------------------------------------------------------------
    def _earcon(self, kind: str, t: float) -> float:
        if not self.persona.earcons.enabled:
            return t
        self._event(t, f"earcon {kind}")
        return self.sink.earcon(self._earcons[kind], self.tts.sample_rate, t)

    def _event(self, t: float, what: str) -> None:
        self.events.append({"t": round(t, 3), "event": what})
        log.info("%.3f s: %s", t, what)

    def _show(self, state: str) -> None:
        if self.face:
            self.face.show(state)

    @property
    def busy(self) -> bool:
        """Something is still going on: an utterance, a reply, or an earcon playing."""
        return not self.loop.idle or self.t < self.sink.until

    def close(self) -> None:
        self.loop.close()
        if self.face:
            self.face.close()
