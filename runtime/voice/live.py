"""Live mode: the voice loop on a microphone and a speaker (runtime/voice/audio.py).

The microphone's reader hands 512-sample windows stamped with their capture time (monotonic) to the
loop on this thread; the speaker's callback pulls the replies from its ring buffer. A device that is
missing or vanishes is retried with backoff by audio.py and reported; the loop keeps running.
"""
from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger(__name__)
STATES = {"listening": "listening", "speech": "hearing you", "speaking": "speaking"}


class SpeakerSink:
    """The loop's output on a Speaker: play() queues, stop() cuts (barge-in)."""

    def __init__(self, speaker):
        self.speaker = speaker

    def __call__(self, audio, rate: int, t: float) -> float:
        self.speaker.play(audio, rate, last=False)
        return self.speaker.played_until

    def stop(self, t: float) -> float:
        self.speaker.stop()
        return time.monotonic()


def run_live(model, vad, asr, tts, config, input_device=None, output_device=None, print_turn=None,
             status=sys.stderr) -> int:
    from .audio import Microphone, Speaker
    from .pipeline import VoiceLoop

    shown = [0]

    def on_state(state: str) -> None:
        print(f"[{STATES.get(state, state)}]", file=status, flush=True)
        if state == VoiceLoop.IDLE and print_turn:
            while shown[0] < len(loop.turns):
                print_turn(loop.turns[shown[0]])
                shown[0] += 1

    with Microphone(input_device) as mic, Speaker(output_device) as spk:
        loop = VoiceLoop(model, vad, asr, tts, config, output=SpeakerSink(spk), clock=time.monotonic,
                         on_state=on_state)
        print("[listening] speak; Ctrl-C quits", file=status, flush=True)
        try:
            for window, t in mic:
                loop.process(window, t)
        finally:
            loop.close()
            log.info("audio: microphone %s, speaker %s", mic.stats, spk.stats)
    return 0
