"""boardtalk serve with the voice loop on virtual PulseAudio devices (tests/pulse.py), the real engines and
SmolLM2: a spoken turn and API requests share the one model; the mic vanishing and returning is survived."""
import subprocess
import threading
import time

import pytest

import runtime
from pulse import pulse, write_wav  # noqa: F401  (pulse: the session fixture)
from runtime.serve.config import from_dict
from runtime.serve.scheduler import VOICE
from runtime.serve.service import Background

pytestmark = [pytest.mark.slow, pytest.mark.voice]
openai = pytest.importorskip("openai", reason="the API tests use the official client: pip install 'boardtalk[dev]'")
pytest.importorskip("aiohttp", reason="boardtalk serve needs aiohttp: pip install 'boardtalk[serve]'")
SYSTEM = "You are a helpful assistant."
QUESTION = "Name three colours."


def _speech(text, tmp_path):
    from runtime.voice.filemode import read_wav, resample

    raw = tmp_path / "espeak.wav"
    try:
        subprocess.run(["espeak-ng", "-v", "en-us", "-w", str(raw), text], check=True, capture_output=True)
    except FileNotFoundError:
        pytest.skip("needs espeak-ng for test speech: apt-get install espeak-ng")
    x, rate = read_wav(raw)
    return write_wav(tmp_path / "q16k.wav", resample(x, rate, 16000))


def _wait(cond, timeout, what):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_voice_turn_and_api_share_the_model_and_survive_mic_loss(pulse, real_artifacts, tmp_path):  # noqa: F811
    artifact = real_artifacts["native"]
    model = runtime.load(artifact)
    ids = model.chat_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    alone = "".join(model.new_session().stream(ids, runtime.GenerationConfig(max_new_tokens=40)))
    model.close()
    cfg = from_dict({"api": {"port": 0, "max_tokens": 40},
                     "audio": {"input": "virtual_mic", "output": "speaker", "max_new_tokens": 16},
                     "model": {"system_prompt": SYSTEM}})
    wav = _speech("What is the capital of France?", tmp_path)
    with Background(cfg, lambda sec: runtime.load(artifact)) as svc:
        assert svc.voice is not None and svc.voice.error is None, svc.voice and svc.voice.error
        assert svc.voice.mic.wait_connected(5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{svc.api_port}/v1", api_key="x", max_retries=0,
                               timeout=120)
        replies, stop = [], threading.Event()

        def ask():  # API requests back to back while the user speaks and the voice turn runs
            while not stop.is_set():
                r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": QUESTION}])
                replies.append(r.choices[0].message.content)

        th = threading.Thread(target=ask)
        th.start()
        try:
            pulse.play_into_mic(wav)
            _wait(lambda: svc.metrics.turns.value() >= 1, 60, "the voice turn")
        finally:
            stop.set()
            th.join(120)
        assert replies and all(r == alone for r in replies)  # a pre-empted generation resumes intact
        assert svc.gate.steps[VOICE] > 0 and svc.voice.loop.turns[0].reply_text
        text = svc.metrics.render()
        assert 'boardtalk_voice_stage_seconds_count{stage="first_token"} 1' in text
        assert 'boardtalk_ttft_seconds_count{source="voice"} 1' in text

        # the microphone goes away: the API keeps answering, the device is retried and comes back
        pulse.remove_mic()
        _wait(lambda: not svc.voice.mic.connected.is_set(), 5, "the mic loss to be noticed")
        r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": QUESTION}])
        assert r.choices[0].message.content == alone
        time.sleep(1.0)
        t_back = time.monotonic()
        pulse.restore_mic()
        assert svc.voice.mic.wait_connected(5)
        back_s = time.monotonic() - t_back
        print(f"MEASURED mic back in service {back_s * 1e3:.0f} ms after the device returned")
        text = svc.metrics.render()
        assert 'boardtalk_audio_events_total{device="input",event="reconnects"} 1' in text
        assert 'boardtalk_audio_connected{device="input"} 1' in text
        assert back_s < 2.5  # audio.py's backoff is capped at 2 s


def test_wyoming_handle_goes_through_the_scheduler(real_artifacts):
    """serve with wyoming on: a Home Assistant transcript is answered by the service's model through the queue,
    the same text as in-process; hanging up mid-reply cancels the generation."""
    pytest.importorskip("wyoming", reason="needs the wyoming package: pip install 'boardtalk[serve]'")
    import asyncio

    from wyoming.asr import Transcript
    from wyoming.client import AsyncTcpClient

    artifact = real_artifacts["native"]
    model = runtime.load(artifact)
    ids = model.chat_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    alone = "".join(model.new_session().stream(ids, runtime.GenerationConfig(max_new_tokens=24)))
    model.close()
    cfg = from_dict({"api": {"enabled": False}, "wyoming": {"enabled": True, "port": 0},
                     "audio": {"enabled": False, "max_new_tokens": 24}, "model": {"system_prompt": SYSTEM}})
    with Background(cfg, lambda sec: runtime.load(artifact)) as svc:
        async def talk(hang_up_after=None):
            c = AsyncTcpClient("127.0.0.1", svc.wyoming_port)
            await c.connect()
            await c.write_event(Transcript(text=QUESTION).event())
            text = []
            while True:
                e = await asyncio.wait_for(c.read_event(), 120)
                if e is None or e.type == "handled-stop":
                    break
                if e.type == "handled-chunk":
                    text.append(e.data["text"])
                    if hang_up_after is not None and len(text) >= hang_up_after:
                        break
            await c.disconnect()
            return "".join(text)

        assert asyncio.run(talk()) == alone
        asyncio.run(talk(hang_up_after=2))
        _wait(lambda: svc.metrics.cancellations.value("disconnect") >= 1, 30, "the cancellation")
        job = svc.scheduler.finished[-1]
        assert job.source == "wyoming" and job.stats.finish_reason == "cancelled" and job.steps_after_cancel <= 1


def test_missing_audio_device_at_start_keeps_the_api_serving(pulse, real_artifacts):  # noqa: F811
    """No such microphone or speaker: the service gets ready, answers the API, retries the devices with
    backoff and shows it in /metrics."""
    artifact = real_artifacts["native"]
    cfg = from_dict({"api": {"port": 0, "max_tokens": 8},
                     "audio": {"input": "no-such-mic", "output": "no-such-speaker"}})
    with Background(cfg, lambda sec: runtime.load(artifact)) as svc:
        assert svc.ready and svc.voice.error is None
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{svc.api_port}/v1", api_key="x", max_retries=0,
                               timeout=120)
        r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": QUESTION}])
        assert r.usage.completion_tokens == 8
        _wait(lambda: svc.voice.mic.stats["open_failures"] >= 2, 10, "retries")
        text = svc.metrics.render()
        assert 'boardtalk_audio_connected{device="input"} 0' in text
        assert 'boardtalk_audio_events_total{device="input",event="open_failures"}' in text
