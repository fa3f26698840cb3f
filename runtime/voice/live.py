"""Live mode: the voice loop on a microphone and a speaker (runtime/voice/audio.py).

    live = LiveVoice(model, vad, asr, tts, VoiceConfig(), "virtual_mic", "speaker")
    live.run(stop)                     # until stop (a threading.Event) is set or Ctrl-C; returns 0

The microphone's reader hands 512-sample windows stamped with their capture time (monotonic) to the loop on
the calling thread; the speaker's callback pulls the replies from its ring buffer. A device that is missing
or vanishes is retried with backoff by audio.py; this module reports it and keeps the loop running: while
the microphone is gone the loop is fed silence on the clock, so a reply being spoken still finishes and the
loop is listening again when the microphone returns.

Status lines (``status``: stderr in the CLI): the state (``[listening]``, ``[hearing you]``, ``[thinking]``:
the end of the turn is confirmed and nothing is played yet, ``[speaking]``: the reply's first audio went to
the speaker), devices lost and back, one line per turn (``print_turn``), an ``[audio: ...]`` line for a reply
that had gaps, and the audio totals at the end.

Echo: with ``VoiceConfig.barge_in`` the microphone must not hear the speaker: use an echo-cancelled
source/sink pair (PulseAudio/PipeWire ``module-echo-cancel``, docs/voice_live.md); what the canceller leaves
is gated by level (EchoGate). Without barge-in (the default) the loop is half-duplex: what the microphone
hears while the bot speaks is ignored.
"""
from __future__ import annotations

import logging
import sys
import threading
import time

import numpy as np

log = logging.getLogger(__name__)
STATES = {"listening": "listening", "speech": "hearing you", "speaking": "thinking"}  # VoiceLoop state -> shown
DEVICE_GRACE_S = 3.0  # a device not open this long after start is reported as missing


class SpeakerSink:
    """The loop's output on a Speaker: each chunk is queued as part of a stream (``last=False``), the reply's
    end is ``end_reply()`` (so only real gaps count as underruns), ``stop()`` cuts at once (barge-in)."""

    def __init__(self, speaker, on_first_audio=None):
        self.speaker = speaker
        self.on_first_audio = on_first_audio  # called when a reply's first chunk is queued
        self.stops: list[float] = []  # monotonic seconds of each stop() call (barge-in)
        self.replies: list[dict] = []  # the audio counters of each reply that played something (end_reply)
        self._base: dict | None = None  # speaker.stats when the reply's first chunk was queued

    def __call__(self, audio, rate: int, t: float) -> float:
        if self._base is None:
            self._base = dict(self.speaker.stats)
            if self.on_first_audio is not None:
                self.on_first_audio()
        self.speaker.play(audio, rate, last=False)
        return self.speaker.played_until

    def stop(self, t: float) -> float:
        self.stops.append(self.speaker.stop())
        return time.monotonic()

    def end_reply(self) -> dict | None:
        """The reply is over: its audio counters, also appended to ``replies`` (None when it played nothing;
        calling it twice is harmless). Underruns are gaps between two chunks of the reply, not its end: a
        caller that never calls this gets every reply's end counted as one at the next reply."""
        self.speaker.finish()
        base, self._base = self._base, None
        if base is None:
            return None
        s = self.speaker.stats
        self.replies.append({"underruns": s["underruns"] - base["underruns"],
                             "underrun_ms": round(s["underrun_ms"] - base["underrun_ms"], 1),
                             "xruns": s["xruns"] - base["xruns"], "reconnects": s["reconnects"] - base["reconnects"]})
        return self.replies[-1]


class EchoGate:
    """A residual-echo gate for barge-in. An echo canceller leaves some of the bot's voice in the microphone,
    quiet but speech-like: the VAD calls it speech (measured through PulseAudio's webrtc canceller: up to 8
    windows in a row, more than barge-in's 0.15 s). While the bot speaks, a window quieter than the user's own
    speech by more than ``margin_db`` is passed on as silence. The user's level is learned from their turns
    (the 75th percentile of the window levels while they speak, no bot audio then); until ``min_windows``
    are known nothing is gated."""

    def __init__(self, margin_db: float = 12.0, min_windows: int = 16, keep: int = 600):
        self.margin_db = margin_db
        self.min_windows = min_windows
        self._levels = np.full(keep, np.nan)  # dBFS of windows heard during the user's turns (a ring)
        self._n = 0
        self.gated = 0  # windows passed on as silence

    @staticmethod
    def level_db(window: np.ndarray) -> float:
        return float(10 * np.log10(np.mean(np.square(window, dtype=np.float64)) + 1e-12))

    def learn(self, window: np.ndarray) -> None:
        db = self.level_db(window)
        if db > -70:  # digital silence says nothing about the user's voice
            self._levels[self._n % len(self._levels)] = db
            self._n += 1

    @property
    def floor_db(self) -> float | None:
        """Windows below this (dBFS) are echo while the bot speaks; None until the user's level is known."""
        if self._n < self.min_windows:
            return None
        return float(np.nanpercentile(self._levels, 75)) - self.margin_db

    def __call__(self, window: np.ndarray, silence: np.ndarray) -> np.ndarray:
        floor = self.floor_db
        if floor is not None and self.level_db(window) < floor:
            self.gated += 1
            return silence
        return window


class LiveVoice:
    """A VoiceLoop on live devices. After ``run()`` starts: ``loop`` (its turns and history), ``sink``,
    ``mic``, ``speaker``; ``audio`` maps a turn's index to its reply's audio counters; ``events`` lists
    (monotonic seconds, status text) of everything shown."""

    def __init__(self, model, vad, asr, tts, config, input_device=None, output_device=None, print_turn=None,
                 status=sys.stderr):
        self.model, self.vad, self.asr, self.tts, self.config = model, vad, asr, tts, config
        self.input_device, self.output_device = input_device, output_device
        self.print_turn = print_turn
        self.status = status
        self.loop = self.sink = self.mic = self.speaker = None
        self.audio: dict[int, dict] = {}
        self.echo_gate = EchoGate()  # used with barge-in only
        self.events: list[tuple[float, str]] = []
        self.ready = threading.Event()  # set once the loop takes windows
        self._shown = 0  # turns printed
        self._replies = 0  # sink.replies already given to a turn
        self._state = None
        self._up: dict[str, bool | None] = {}

    def _say(self, text: str) -> None:
        self.events.append((time.monotonic(), text))
        print(text, file=self.status, flush=True)

    def _on_state(self, state: str) -> None:
        from .pipeline import VoiceLoop

        if self._state == VoiceLoop.REPLY and state != VoiceLoop.REPLY:  # the loop called sink.end_reply()
            if len(self.sink.replies) > self._replies and self.loop.turns:
                self.audio[len(self.loop.turns) - 1] = self.sink.replies[-1]
            self._replies = len(self.sink.replies)
        self._state = state
        self._say(f"[{STATES.get(state, state)}]")
        if state == VoiceLoop.IDLE:
            while self._shown < len(self.loop.turns):
                i = self._shown
                self._shown += 1
                if self.print_turn is not None:
                    self.print_turn(self.loop.turns[i])
                a = self.audio.get(i)
                if a and (a["underruns"] or a["xruns"] or a["reconnects"]):
                    self._say(f"[audio: {a['underruns']} underruns ({a['underrun_ms']:.0f} ms of gaps), "
                              f"{a['xruns']} xruns, {a['reconnects']} speaker reconnects in this reply]")

    def _watch(self, dev, name: str, t_start: float) -> None:
        """Report a device going away, coming back, or missing since the start."""
        up = dev.connected.is_set()
        was = self._up.get(name)
        if was is None:
            if up:
                self._up[name] = True
            elif time.monotonic() - t_start > DEVICE_GRACE_S:
                self._up[name] = False
                self._say(f"[{name} {dev.device if dev.device is not None else '(default)'} not available: "
                          f"retrying]")
        elif up != was:
            self._up[name] = up
            self._say(f"[{name} back]" if up else f"[{name} lost: reconnecting]")

    def run(self, stop: threading.Event | None = None) -> int:
        from .audio import Microphone, Speaker
        from .engines import VAD_WINDOW
        from .pipeline import WINDOW_S, VoiceLoop

        stop = stop or threading.Event()
        silence = np.zeros(VAD_WINDOW, np.float32)
        with Microphone(self.input_device) as mic, Speaker(self.output_device) as spk:
            self.mic, self.speaker = mic, spk
            self.sink = SpeakerSink(spk, on_first_audio=lambda: self._say("[speaking]"))
            self.loop = loop = VoiceLoop(self.model, self.vad, self.asr, self.tts, self.config, output=self.sink,
                                         clock=time.monotonic, on_state=self._on_state)
            self._state = loop.state
            self._say("[listening] speak; Ctrl-C quits")
            self.ready.set()
            t_start = t_last = time.monotonic()
            try:
                while not stop.is_set():
                    self._watch(mic, "microphone", t_start)
                    self._watch(spk, "speaker", t_start)
                    got = mic.read(timeout=0.1)
                    if got is not None:
                        window, t_last = got
                        if loop.state == VoiceLoop.REPLY and self.config.barge_in:
                            window = self.echo_gate(window, silence)
                        loop.process(window, t_last)
                        if loop.state == VoiceLoop.SPEECH:
                            self.echo_gate.learn(got[0])
                    elif not mic.connected.is_set():  # keep the turn logic going on silence, on the clock
                        now = time.monotonic()
                        while t_last + WINDOW_S <= now:
                            t_last += WINDOW_S
                            loop.process(silence, t_last)
            except KeyboardInterrupt:  # Ctrl-C is how live mode ends
                print(file=self.status)
            finally:
                loop.close()
                self.sink.end_reply()
                s, m = spk.stats, mic.stats
                self._say(f"[audio overall: {len(loop.turns)} turns, {s['underruns']} underruns "
                          f"({s['underrun_ms']:.0f} ms of gaps), xruns: speaker {s['xruns']} microphone "
                          f"{m['xruns']}, reconnects: microphone {m['reconnects']} speaker {s['reconnects']}"
                          + (f", echo gate: {self.echo_gate.gated} windows]" if self.config.barge_in else "]"))
                log.info("audio: microphone %s, speaker %s", m, s)
        return 0


def run_live(model, vad, asr, tts, config, input_device=None, output_device=None, print_turn=None,
             status=sys.stderr, stop: threading.Event | None = None) -> int:
    """The loop on live devices until Ctrl-C (or ``stop`` is set); returns 0."""
    return LiveVoice(model, vad, asr, tts, config, input_device, output_device, print_turn, status).run(stop)
