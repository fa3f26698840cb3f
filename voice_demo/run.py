"""Driving the toy: from a WAV at real-time pace (file mode, how the tests run it) or from the sound card.

File mode reads and writes WAVs with runtime/voice/filemode.py's helpers and its FileOutput (each reply chunk
and earcon is written where, on IN.wav's timeline, it was handed over); the loop it drives is the same
VoiceLoop as live mode's. Live mode uses runtime/voice/audio.py's Microphone and Speaker, which retry a
missing or vanished device with backoff instead of failing.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import select
import sys
import threading
import time
from pathlib import Path

import numpy as np

from runtime.voice.engines import VAD_WINDOW
from runtime.voice.filemode import FileOutput, PacedInput, write_wav
from runtime.voice.pipeline import WINDOW_S

from .persona import KEYS, Persona
from .toy import Toy

log = logging.getLogger(__name__)


def run_file(model, vad, asr, tts, persona: Persona, in_wav, out_wav=None, report_json=None, presses=(),
             face=None, tail_s: float = 30.0, realtime: bool = True) -> dict:
    """Play in_wav into the toy at real-time pace (presses: seconds on its timeline at which the push-to-talk
    key is pressed), then silence until the toy is done (at most tail_s); write the replies and earcons to
    out_wav and the report to report_json, only if given. Returns the report."""
    src = PacedInput(in_wav, realtime)
    audio, rate = src.audio, src.rate
    sink = FileOutput(src.clock)
    toy = Toy(model, vad, asr, tts, persona, output=sink, clock=src.clock, face=face, keep_turns=True)
    pending = sorted(presses)
    try:
        for window, t in src.windows(lambda: not toy.busy and not pending, tail_s):
            while pending and pending[0] <= t:
                toy.press(pending.pop(0))
            toy.feed(window, t)
    finally:
        toy.close()
    if out_wav is not None:
        write_wav(out_wav, *sink.render(len(audio) / rate))
    report = {"persona": persona.name, "mode": persona.activation.mode,
              "input": {"file": str(in_wav), "seconds": round(len(audio) / rate, 3), "sample_rate": rate},
              "turns": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in tr.items()} for tr in toy.turns],
              "events": toy.events,
              "remembered_messages": len(toy.loop.history) - 1,  # besides the system prompt, at the end
              "engines": {"vad": getattr(vad, "name", "?"), "asr": getattr(asr, "name", "?"),
                          "tts": getattr(tts, "name", "?"), "llm": model.manifest.model_name},
              "windows_late": src.late}
    if report_json is not None:
        Path(report_json).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return report


class KeyReader:
    """Push-to-talk from the terminal: stdin in cbreak mode (keys arrive without Enter, not echoed; Ctrl-C
    still interrupts); a thread puts the monotonic time of each press of ``key`` on a queue. The terminal's
    settings are restored on exit, whatever happened."""

    def __init__(self, key: str, stream=None):
        self.char = KEYS.get(key, key)
        self.stream = stream or sys.stdin
        self.presses: queue.Queue[float] = queue.Queue()
        self._stop = threading.Event()
        self._saved = None

    def __enter__(self) -> "KeyReader":
        import termios
        import tty

        try:
            fd = self.stream.fileno()
        except (AttributeError, ValueError, OSError):
            fd = -1
        if fd < 0 or not os.isatty(fd):
            raise ValueError("push_to_talk needs a terminal on standard input for its key; run it in a terminal, "
                             "or use a persona with activation.mode: wake")
        self._fd = fd
        self._saved = termios.tcgetattr(fd)
        tty.setcbreak(fd)
        self._thread = threading.Thread(target=self._read, name="keys", daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._fd], [], [], 0.2)
            if not ready:
                continue
            try:
                ch = os.read(self._fd, 1).decode("utf-8", "replace")
            except OSError:
                return
            if ch == "":  # end of input
                return
            if ch == self.char or (self.char == "\n" and ch == "\r"):
                self.presses.put(time.monotonic())

    def drain(self) -> list[float]:
        out = []
        while True:
            try:
                out.append(self.presses.get_nowait())
            except queue.Empty:
                return out

    def __exit__(self, *exc) -> None:
        import termios

        self._stop.set()
        if self._saved is not None:
            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)


def run_live(model, vad, asr, tts, persona: Persona, input_device=None, output_device=None, face=None,
             stop: threading.Event | None = None, ready: threading.Event | None = None) -> int:
    """The toy on the sound card until Ctrl-C (KeyboardInterrupt propagates, after everything is closed and
    the terminal restored) or until ``stop`` is set. While the microphone is missing (audio.py retries it),
    the toy is fed silence on the clock, so a reply being spoken still ends and the timers still run.
    ``ready`` is set once the first microphone window has reached the toy."""
    from runtime.voice.audio import Microphone, Speaker
    from runtime.voice.live import SpeakerSink

    stop = stop or threading.Event()
    ptt = persona.activation.mode == "push_to_talk"
    keys = KeyReader(persona.activation.key) if ptt else None
    silence = np.zeros(VAD_WINDOW, np.float32)
    with keys or contextlib.nullcontext(), Microphone(input_device) as mic, Speaker(output_device) as spk:
        toy = Toy(model, vad, asr, tts, persona, output=SpeakerSink(spk), clock=time.monotonic, face=face,
                  keep_turns=False)
        t_start = t_last = time.monotonic()
        missing_shown = False
        try:
            while not stop.is_set():
                if keys is not None:
                    for tp in keys.drain():
                        toy.press(tp)
                got = mic.read(timeout=0.1)
                if got is not None:
                    t_last = got[1]
                    toy.feed(*got)
                    if ready is not None:
                        ready.set()
                    missing_shown = False
                elif not mic.connected.is_set():
                    if not missing_shown and face is not None and time.monotonic() - t_start > 3.0:
                        face.say(f"[microphone {input_device if input_device is not None else '(default)'} "
                                 "not available: retrying]")
                        missing_shown = True
                    now = time.monotonic()
                    while t_last + WINDOW_S <= now:
                        t_last += WINDOW_S
                        toy.feed(silence, t_last)
        finally:
            toy.close()
            log.info("audio: microphone %s, speaker %s", mic.stats, spk.stats)
    return 0
