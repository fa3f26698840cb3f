"""The voice loop inside the service: microphone -> VoiceLoop (runtime/voice/pipeline.py) -> speaker.

The loop gets the model through ``GatedModel``: its session's steps take the compute gate at voice
priority, so a voice turn goes ahead of API requests (scheduler.py explains why). A microphone or speaker
that is missing at start or vanishes is reopened with backoff by runtime/voice/audio.py; this thread
keeps reading (nothing arrives meanwhile) and the API keeps serving. Each answered turn is one log line
and feeds /metrics (turns, stage latencies, TTFT from the end of speech); the devices' counters (xruns,
reconnects, open failures) are read at each scrape.
"""
from __future__ import annotations

import logging
import threading
import time

from .scheduler import GatedModel

log = logging.getLogger(__name__)
READ_TIMEOUT_S = 0.2  # how often the reader looks at the stop flag when no audio arrives


class VoiceService:
    def __init__(self, model, gate, config, metrics):
        self.model, self.gate, self.cfg, self.metrics = model, gate, config, metrics
        self.loop = self.mic = self.spk = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._shown = 0
        self.error: str | None = None

    def describe(self) -> str:
        if self.error:
            return f"unavailable ({self.error})"
        return f"on (input {self.mic.device!r}, output {self.spk.device!r})"

    def start(self) -> None:
        """Open the engines and the devices and build the loop (prefills its system prompt); a failure
        (the voice extra missing, an unknown engine) is logged and the service runs without voice."""
        from ..voice.audio import Microphone, Speaker
        from ..voice.engines import open_engine
        from ..voice.live import SpeakerSink
        from ..voice.pipeline import VoiceConfig, VoiceLoop

        a, profile = self.cfg.audio, getattr(self.model, "profile", None)
        try:
            vad, asr, tts = open_engine("vad", a.vad), open_engine("asr", a.asr), open_engine("tts", a.tts)
            for e in (asr, tts):
                getattr(e, "warmup", lambda: None)()
            self.mic = Microphone(a.input if a.input is not None else getattr(profile, "audio_input", None))
            self.spk = Speaker(a.output if a.output is not None else getattr(profile, "audio_output", None))
            vcfg = VoiceConfig(system=self.cfg.model.system_prompt, max_new_tokens=a.max_new_tokens,
                               hangover_s=a.hangover_s, barge_in=a.barge_in)
            self.loop = VoiceLoop(GatedModel(self.model, self.gate), vad, asr, tts, vcfg,
                                  output=SpeakerSink(self.spk), clock=time.monotonic, on_state=self._on_state)
        except (ImportError, ValueError, OSError, RuntimeError) as e:
            self.error = str(e).splitlines()[0] if str(e) else type(e).__name__
            log.error("voice loop unavailable: %s; serving without it", self.error)
            self._close_devices()
            return
        self.mic.start()
        self.spk.start()
        self.metrics.collectors.append(self._collect)
        self._thread = threading.Thread(target=self._run, name="boardtalk-voice", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                got = self.mic.read(timeout=READ_TIMEOUT_S)
                if got is not None:
                    self.loop.process(*got)
            except Exception:  # noqa: BLE001 - one bad window or turn never ends the voice loop
                log.exception("voice loop error; continuing")
                time.sleep(0.1)

    def _on_state(self, state: str) -> None:
        if self.cfg.audio.hold_api:
            self.gate.hold_api(state == "speech")
        if state != "listening" or self.loop is None:
            return
        turns = self.loop.turns
        while self._shown < len(turns):
            t = turns[self._shown]
            self._shown += 1
            lat = t.latencies_ms()
            self.metrics.turns.inc()
            for stage, ms in lat.items():
                if ms is not None:
                    self.metrics.stage.observe(ms / 1e3, stage)
            if lat.get("first_token") is not None:
                self.metrics.ttft.observe(lat["first_token"] / 1e3, "voice")
            if t.interrupted:
                self.metrics.cancellations.inc(1, "barge_in")
            log.info("turn n=%d speech_s=%.2f transcript_ms=%s first_token_ms=%s end_of_turn_ms=%s first_audio_ms=%s "
                     "asr_ms=%s tts_first_ms=%s reused=%d restarts=%d interrupted=%s words=%d", self._shown,
                     (t.speech_end_s or 0) - (t.speech_start_s or 0), lat["transcript"], lat["first_token"],
                     lat["end_of_turn"], lat["first_audio"], t.asr_final_ms, t.tts_first_ms,
                     t.prefill_reused_tokens, t.speculative_restarts, t.interrupted, len(t.transcript.split()))

    def _collect(self, m) -> None:
        for name, dev in (("input", self.mic), ("output", self.spk)):
            if dev is None:
                continue
            for event, n in dict(dev.stats).items():
                m.audio.set(n, name, event)
            m.audio_up.set(1 if dev.connected.is_set() else 0, name)

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop reading, let the running turn end (the loop cancels its speculation), release the devices."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=grace_s)
        if self.loop is not None:
            self.loop.close()
        self._close_devices()

    def _close_devices(self) -> None:
        for dev in (self.mic, self.spk):
            if dev is not None:
                dev.close()
