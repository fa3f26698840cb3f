"""The Wyoming server against the real ``wyoming`` client on 127.0.0.1: describe, transcribe (streamed), synthesize
(plain and streamed) and handle (streamed), each checked against the event order of the protocol (wyoming 1.10's
README, "Event Flow"); a client that disconnects mid-stream; malformed input.

The voice tests run the real engines on espeak-ng speech (tests/test_voice_engines.py makes it); one handle test
runs the real SmolLM2-135M.
"""
import asyncio
import json
import re
import threading

import numpy as np
import pytest

pytest.importorskip("wyoming", reason="needs the wyoming package: pip install 'boardtalk[serve]'")

from wyoming.asr import Transcribe, Transcript  # noqa: E402
from wyoming.audio import AudioChunk, AudioStart, AudioStop  # noqa: E402
from wyoming.client import AsyncTcpClient  # noqa: E402
from wyoming.event import Event  # noqa: E402
from wyoming.info import Describe, Info  # noqa: E402
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop  # noqa: E402

from runtime.serve.wyoming import AudioBuffer, agreed_prefix, pcm_to_float, serve_wyoming  # noqa: E402
from runtime.voice.engines import SAMPLE_RATE, Transcript as AsrTranscript  # noqa: E402
from test_voice_engines import _open, espeak, resample, wer  # noqa: E402,F401  (espeak: a fixture)

TIMEOUT = 120.0  # seconds any one read may take (a loaded 2-core CI machine)


# -- harness ------------------------------------------------------------------------------------------------
class FakeASR:
    """Stands in where the test is about the protocol, not about speech."""
    name = "fake-asr"

    def transcribe(self, audio):
        return AsrTranscript(text=f"{len(audio)} samples")


class FakeTTS:
    name = "fake-tts"
    sample_rate = 22050

    def synthesize(self, text):
        return np.full(len(text) * 100, 0.1, np.float32)


async def _words(text="one two three four", delay=0.0):
    for w in text.split():
        await asyncio.sleep(delay)
        yield w + " "


def serve(scenario, asr=None, tts=None, llm=_words):
    """Run serve_wyoming on an ephemeral port, await scenario(port), stop the server; return the scenario's
    result. The server must stop within 5 s of the stop event."""

    async def main():
        stop, port = asyncio.Event(), []
        server = asyncio.create_task(serve_wyoming("127.0.0.1", 0, asr=asr or FakeASR(), tts=tts or FakeTTS(), llm=llm,
                                                   stop=stop, on_listen=port.append))
        while not port:
            if server.done():
                server.result()
            await asyncio.sleep(0.01)
        try:
            return await scenario(port[0])
        finally:
            stop.set()
            await asyncio.wait_for(server, 5.0)

    return asyncio.run(main())


def client(port):
    return AsyncTcpClient("127.0.0.1", port, read_timeout=TIMEOUT)


async def read_until(c, last: str) -> list[Event]:
    events = []
    while True:
        e = await c.read_event()
        assert e is not None, f"connection closed after {[x.type for x in events]}"
        events.append(e)
        if e.type == last:
            return events


def types(events) -> str:
    return " ".join(e.type for e in events)


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


def hear(asr, audio, rate) -> str:
    asr.reset()  # a new utterance for an engine that reuses work between passes of one
    return asr.transcribe(resample(audio, rate)).text


def audio_of(events) -> tuple[np.ndarray, int]:
    chunks = [AudioChunk.from_event(e) for e in events if e.type == "audio-chunk"]
    assert chunks and {(c.width, c.channels) for c in chunks} == {(2, 1)}
    pcm = np.frombuffer(b"".join(c.audio for c in chunks), "<i2").astype(np.float32) / 32768
    return pcm, chunks[0].rate


# -- units --------------------------------------------------------------------------------------------------
def test_pcm_conversion_every_width_and_channel_count():
    x = np.array([0.5, -0.25, 0.0, 0.75], np.float32)
    for width in (1, 2, 3, 4):
        scale = 2 ** (8 * width - 1)
        ints = np.round(x * scale).astype(np.int64)
        data = b"".join(int(v).to_bytes(width, "little", signed=True) for v in ints)
        np.testing.assert_allclose(pcm_to_float(data, width, 1), x, atol=1.5 / scale)
    stereo = np.stack([x, -x], 1).reshape(-1)  # left x, right -x: the mono mix is 0
    np.testing.assert_allclose(pcm_to_float(pcm16(stereo), 2, 2), 0, atol=1e-4)
    with pytest.raises(ValueError, match="whole number"):
        pcm_to_float(b"\x00\x01\x02", 2, 1)


def test_audio_buffer_resamples_each_rate_run_and_caps_the_length():
    buf = AudioBuffer(max_s=2.0)
    t = np.arange(48000) / 48000
    buf.add(np.sin(2 * np.pi * 440 * t).astype(np.float32), 48000)  # 1 s at 48 kHz
    buf.add(np.zeros(8000, np.float32), 8000)  # 1 s at 8 kHz
    buf.add(np.zeros(16000, np.float32), 16000)  # past the cap: dropped
    audio = buf.snapshot()()
    assert len(audio) == 2 * SAMPLE_RATE and buf.dropped_s == pytest.approx(1.0)
    spectrum = np.abs(np.fft.rfft(audio[:SAMPLE_RATE]))
    assert abs(np.argmax(spectrum) - 440) <= 1  # the tone survived the resampling at its pitch


def test_agreed_prefix_ignores_case_and_punctuation():
    assert agreed_prefix("Turn on the kitchen".split(), "turn on the kitchen lights.".split()) == 4
    assert agreed_prefix("Turn on the".split(), "Turn off the".split()) == 1
    assert agreed_prefix([], ["a"]) == 0


# -- describe -----------------------------------------------------------------------------------------------
def test_describe_advertises_stt_tts_and_a_streaming_handler():
    async def scenario(port):
        async with client(port) as c:
            await c.write_event(Describe().event())
            return Info.from_event(await c.read_event())

    info = serve(scenario)
    (asr,), (tts,), (handle,) = info.asr, info.tts, info.handle
    assert asr.installed and asr.supports_transcript_streaming and asr.models[0].name == "fake-asr"
    assert tts.installed and tts.supports_synthesize_streaming and tts.voices[0].name == "fake-tts"
    assert handle.installed and handle.supports_handled_streaming and handle.models[0].installed
    assert "en" in asr.models[0].languages and "en" in tts.voices[0].languages and "en" in handle.models[0].languages


# -- transcribe ---------------------------------------------------------------------------------------------
TRANSCRIPT_ORDER = re.compile(r"transcript-start( transcript-chunk)* transcript transcript-stop")


@pytest.fixture(scope="module")
def asr():
    return _open("asr")


@pytest.fixture(scope="module")
def tts():
    return _open("tts")


@pytest.mark.voice
def test_transcribe_streams_chunks_before_audio_stop(asr, espeak):
    """48 kHz stereo 16-bit audio sent at twice real time: words that two partial passes agree on arrive as
    transcript-chunks before the client sends audio-stop; then transcript (the final text) and transcript-stop."""
    text = "Please turn on the kitchen lights. Then open the garage door and turn off the radio."
    speech = resample(np.concatenate([espeak(text), np.zeros(SAMPLE_RATE // 2, np.float32)]), SAMPLE_RATE, 48000)
    step = 4800  # 100 ms at 48 kHz

    async def scenario(port):
        events, early = [], []
        async with client(port) as c:
            async def reader():
                while (e := await c.read_event()) is not None:
                    events.append(e)
                    if e.type == "transcript-stop":
                        return

            task = asyncio.create_task(reader())
            await c.write_event(Transcribe(language="en").event())
            await c.write_event(AudioStart(rate=48000, width=2, channels=2).event())
            for i in range(0, len(speech), step):
                frame = np.repeat(speech[i:i + step], 2)  # the same signal in both channels
                await c.write_event(AudioChunk(rate=48000, width=2, channels=2, audio=pcm16(frame)).event())
                await asyncio.sleep(0.05)
            for _ in range(80):  # trailing silence, as a satellite sends until its VAD ends the turn (<= 8 s)
                if any(e.type == "transcript-chunk" for e in events):
                    break
                await c.write_event(AudioChunk(rate=48000, width=2, channels=2, audio=bytes(step * 4)).event())
                await asyncio.sleep(0.05)
            early = [e.type for e in events]
            await c.write_event(AudioStop().event())
            await asyncio.wait_for(task, TIMEOUT)
        return events, early

    events, early = serve(scenario, asr=asr)
    assert TRANSCRIPT_ORDER.fullmatch(types(events)), types(events)
    assert "transcript-chunk" in early, f"nothing streamed before audio-stop: {early}"
    final = Transcript.from_event(next(e for e in events if e.type == "transcript")).text
    streamed = "".join(e.data["text"] for e in events if e.type == "transcript-chunk")
    print(f"final {final!r}; streamed {streamed!r}; before audio-stop: {early.count('transcript-chunk')} chunks")
    assert wer(text, final) <= 0.35, final
    assert wer(final, streamed) <= 0.15, (final, streamed)


@pytest.mark.voice
def test_transcribe_any_format_without_transcribe_event(asr, espeak):
    """22.05 kHz 24-bit mono sent all at once, no ``transcribe`` first (it is optional)."""
    text = "What is the weather like in London today?"
    x = resample(espeak(text), SAMPLE_RATE, 22050)
    ints = np.round(np.clip(x, -1, 1) * (2**23 - 1)).astype("<i4")
    pcm = ints.view(np.uint8).reshape(-1, 4)[:, :3].tobytes()  # little-endian 24-bit

    async def scenario(port):
        async with client(port) as c:
            await c.write_event(AudioStart(rate=22050, width=3, channels=1).event())
            for i in range(0, len(pcm), 3 * 2205):
                await c.write_event(AudioChunk(rate=22050, width=3, channels=1, audio=pcm[i:i + 3 * 2205]).event())
            await c.write_event(AudioStop().event())
            return await read_until(c, "transcript-stop")

    events = serve(scenario, asr=asr)
    assert TRANSCRIPT_ORDER.fullmatch(types(events)), types(events)
    final = Transcript.from_event(next(e for e in events if e.type == "transcript")).text
    assert wer(text, final) <= 0.35 and "london" in final.lower(), final


class StatefulASR(FakeASR):
    """Reuses its last pass until reset(), as the ASR interface allows within one utterance."""

    def __init__(self):
        self.memory = ""

    def transcribe(self, audio):
        self.memory = (self.memory + " " if self.memory else "") + f"{len(audio)}"
        return AsrTranscript(text=self.memory)

    def reset(self):
        self.memory = ""


def test_no_words_leak_from_one_utterance_into_the_next():
    """The bug: the ASR engine was never reset between requests, so an engine that reuses its passes' words
    (the interface allows it within one utterance) put the previous request's words into the next one."""
    async def utterance(c, seconds):
        await c.write_event(AudioStart(rate=16000, width=2, channels=1).event())
        await c.write_event(AudioChunk(rate=16000, width=2, channels=1, audio=bytes(32000 * seconds)).event())
        await c.write_event(AudioStop().event())
        return next(e for e in await read_until(c, "transcript-stop") if e.type == "transcript").data["text"]

    async def scenario(port):
        async with client(port) as c:
            first = await utterance(c, 1)
        async with client(port) as c:
            return first, await utterance(c, 2), await utterance(c, 3)

    first, second, third = serve(scenario, asr=StatefulASR())
    assert first.split()[-1] == "16000" and second.split()[-1] == "32000" and third.split()[-1] == "48000"
    assert "16000" not in second and "32000" not in third, (second, third)


def test_audio_stop_without_audio_gives_an_empty_transcript():
    async def scenario(port):
        async with client(port) as c:
            await c.write_event(Transcribe().event())
            await c.write_event(AudioStart(rate=16000, width=2, channels=1).event())
            await c.write_event(AudioStop().event())
            return await read_until(c, "transcript-stop")

    events = serve(scenario)
    assert types(events) == "transcript-start transcript transcript-stop"
    assert events[1].data["text"] == ""


# -- synthesize ---------------------------------------------------------------------------------------------
@pytest.mark.voice
def test_synthesize_returns_speech_that_the_asr_understands(asr, tts):
    text = "Please turn on the kitchen lights. Then open the garage door."

    async def scenario(port):
        async with client(port) as c:
            await c.write_event(Synthesize(text=text).event())
            return await read_until(c, "audio-stop")

    events = serve(scenario, asr=asr, tts=tts)
    assert re.fullmatch(r"audio-start( audio-chunk)+ audio-stop", types(events)), types(events)
    assert AudioStart.from_event(events[0]).rate == tts.sample_rate
    audio, rate = audio_of(events)
    heard = hear(asr, audio, rate)
    assert wer(text, heard) <= 0.35, heard


@pytest.mark.voice
def test_synthesize_streaming_speaks_the_first_clause_before_the_text_ends(asr, tts):
    """synthesize-start, chunks, [synthesize], synthesize-stop -> audio for a clause as soon as it is whole;
    the compatibility ``synthesize`` inside the stream is not spoken twice; synthesize-stopped comes last."""
    parts = ["Well, the sky ", "is blue, because air ", "scatters blue light more than red light. ", "It is ", "simple."]
    text = "".join(parts)

    async def scenario(port):
        async with client(port) as c:
            await c.write_event(SynthesizeStart().event())
            for p in parts[:3]:
                await c.write_event(SynthesizeChunk(text=p).event())
            first = await read_until(c, "audio-stop")  # before the text is complete
            for p in parts[3:]:
                await c.write_event(SynthesizeChunk(text=p).event())
            await c.write_event(Synthesize(text=text).event())
            await c.write_event(SynthesizeStop().event())
            return first, first + await read_until(c, "synthesize-stopped")

    first, events = serve(scenario, asr=asr, tts=tts)
    assert re.fullmatch(r"(audio-start( audio-chunk)+ audio-stop ?)+ synthesize-stopped", types(events)), types(events)
    assert types(events).count("audio-start") >= 2
    audio, rate = audio_of(events)
    heard = hear(asr, audio, rate)
    print(f"streamed TTS heard as {heard!r}")
    assert wer(text, heard) <= 0.35, heard  # the compatibility copy would have doubled the words


def test_synthesize_chunks_outside_a_stream_are_refused_and_the_connection_goes_on():
    async def scenario(port):
        async with client(port) as c:
            await c.write_event(SynthesizeChunk(text="hello").event())
            err = await c.read_event()
            await c.write_event(Synthesize(text="Short.").event())
            return err, await read_until(c, "audio-stop")

    err, events = serve(scenario)
    assert err.type == "error" and "synthesize-start" in err.data["text"]
    assert types(events).startswith("audio-start audio-chunk")


# -- handle -------------------------------------------------------------------------------------------------
HANDLED_ORDER = re.compile(r"handled-start( handled-chunk)+ handled handled-stop")


def model_llm(model, max_new_tokens=24):
    """The real model as the async text-delta stream serve_wyoming takes; closing it cancels the generation."""
    import runtime

    async def llm(text):
        loop, q, cancel = asyncio.get_running_loop(), asyncio.Queue(), runtime.CancelToken()

        def work():
            try:
                for d in model.chat([{"role": "user", "content": text}],
                                    runtime.GenerationConfig(max_new_tokens=max_new_tokens), cancel=cancel):
                    loop.call_soon_threadsafe(q.put_nowait, ("delta", d))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                loop.call_soon_threadsafe(q.put_nowait, ("error", e))
            loop.call_soon_threadsafe(q.put_nowait, ("end", None))

        worker = loop.run_in_executor(None, work)
        try:
            while True:
                kind, v = await q.get()
                if kind == "delta":
                    yield v
                elif kind == "error":
                    raise v
                else:
                    return
        finally:
            cancel.cancel()
            await worker

    return llm


@pytest.mark.slow
def test_handle_streams_the_real_models_reply(real_artifacts):
    import runtime

    model = runtime.load(real_artifacts["native"])

    async def scenario(port):
        async with client(port) as c:  # as Home Assistant's conversation agent sends it
            await c.write_event(Transcript(text="What is the capital of Germany?", language="en",
                                           context={"conversation_id": "01HX"}).event())
            return await read_until(c, "handled-stop")

    events = serve(scenario, llm=model_llm(model))
    assert HANDLED_ORDER.fullmatch(types(events)), types(events)
    chunks = "".join(e.data["text"] for e in events if e.type == "handled-chunk")
    handled = next(e for e in events if e.type == "handled")
    assert handled.data["text"] == chunks.strip() and "Berlin" in chunks, chunks
    assert events[0].data["context"] == handled.data["context"] == {"conversation_id": "01HX"}


def test_a_client_that_disconnects_mid_reply_closes_the_llm_stream():
    """The bug this guards against: a generation that runs on for a client that has gone (the board's one
    compute slot held by nobody)."""
    state = {"yielded": 0, "closed": threading.Event()}

    async def endless(text):
        try:
            for i in range(1000):
                await asyncio.sleep(0.02)
                state["yielded"] += 1
                yield f"w{i} "
        finally:
            state["closed"].set()

    async def scenario(port):
        async with client(port) as c:
            await c.write_event(Transcript(text="talk forever").event())
            got = [(await c.read_event()).type for _ in range(4)]  # handled-start + 3 chunks, then hang up
        for _ in range(250):
            if state["closed"].is_set():
                break
            await asyncio.sleep(0.02)
        async with client(port) as c:  # still serving
            await c.write_event(Describe().event())
            return got, (await c.read_event()).type

    got, after = serve(scenario, llm=endless)
    assert got == ["handled-start", "handled-chunk", "handled-chunk", "handled-chunk"]
    assert state["closed"].is_set() and state["yielded"] < 100, state
    assert after == "info"


def test_stop_cancels_a_running_reply():
    closed = threading.Event()

    async def endless(text):
        try:
            while True:
                await asyncio.sleep(0.02)
                yield "more "
        finally:
            closed.set()

    async def scenario(port):
        c = client(port)
        await c.connect()
        await c.write_event(Transcript(text="go on").event())
        assert (await c.read_event()).type == "handled-start"
        return c  # left open: stopping the server must end the reply

    serve(scenario, llm=endless)
    assert closed.is_set()


def test_an_empty_request_is_not_handled():
    async def scenario(port):
        async with client(port) as c:
            await c.write_event(Transcript(text="  ", context={"conversation_id": "x"}).event())
            return await c.read_event()

    e = serve(scenario)
    assert e.type == "not-handled" and e.data["context"] == {"conversation_id": "x"}


# -- malformed input ----------------------------------------------------------------------------------------
def _raw(header: dict, payload: bytes = b"") -> bytes:
    return json.dumps(header).encode() + b"\n" + payload


@pytest.mark.parametrize("frame,why", [
    (b"this is not json\n", "not JSON"),
    (b"[1, 2]\n", "string 'type'"),
    (_raw({"type": "audio-chunk", "payload_length": 1 << 40}), "out of range"),
    (_raw({"type": "describe", "data_length": 5}) + b"{oops", "not JSON"),
    (b"x" * (70 << 10) + b"\n", "longer than"),
    # bug: nesting past the recursion limit raised RecursionError (not ValueError), which killed the reader
    # task silently: no error, no close, the connection held one of the 16 slots forever
    (b'{"type": "ping", "data": {"x": ' + b"[" * 5000 + b"]" * 5000 + b"}}\n", "nested too deeply"),
    (_raw({"type": "describe", "data_length": 10004}) + b'{"x":' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deeply"),
])
def test_a_bad_frame_gets_an_error_and_the_server_goes_on(frame, why):
    async def scenario(port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(frame)
        await writer.drain()
        from wyoming.event import async_read_event

        err = await asyncio.wait_for(async_read_event(reader), TIMEOUT)
        end = await asyncio.wait_for(reader.read(), TIMEOUT)  # closed by the server
        writer.close()
        async with client(port) as c:
            await c.write_event(Describe().event())
            return err, end, (await c.read_event()).type

    err, end, after = serve(scenario)
    assert err.type == "error" and err.data["code"] == "bad-frame" and why in err.data["text"], err
    assert end == b"" and after == "info"


@pytest.mark.parametrize("event,why", [
    (Event("audio-chunk", {"width": 2, "channels": 1}, b"\0\0"), "'rate' is missing"),
    (Event("audio-chunk", {"rate": 16000, "width": 2, "channels": 1}, b"\0\0\0"), "whole number"),
    (Event("audio-start", {"rate": 16000, "width": 7, "channels": 1}), "unsupported audio format"),
    (Event("audio-start", {"rate": "fast", "width": 2, "channels": 1}), "'rate' must be a int"),
    (Event("synthesize", {"text": 42}), "'text' must be a str"),
    (Event("synthesize", {"text": "a" * 5000}), "at most"),
    (Event("synthesize-stop", {}), "without synthesize-start"),
    (Event("transcript", {}), "'text' is missing"),
])
def test_a_bad_event_gets_an_error_and_the_connection_goes_on(event, why):
    async def scenario(port):
        async with client(port) as c:
            await c.write_event(Event("no-such-event", {"x": 1}))  # unknown events are ignored
            await c.write_event(event)
            err = await c.read_event()
            await c.write_event(Describe().event())
            return err, (await c.read_event()).type

    err, after = serve(scenario)
    assert err.type == "error" and err.data["code"] == "bad-event" and why in err.data["text"], err
    assert after == "info"


# -- through boardtalk serve ----------------------------------------------------------------------------------
@pytest.mark.voice
def test_boardtalk_serve_answers_wyoming(tmp_path, tiny_artifact):
    """The service wires serve_wyoming to its scheduler: describe and a streamed handle over the real process."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:  # a free port (the service logs the one it got, but port 0 is not parsed here)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "config.yaml"
    config.write_text("audio:\n  enabled: false\n")
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--config", str(config), "--no-api",
                             "--wyoming", f"127.0.0.1:{port}", "--artifact", str(tiny_artifact)],
                            cwd=Path(__file__).resolve().parents[1], stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"})

    async def scenario():
        for _ in range(600):  # the engines load and warm up first
            if proc.poll() is not None:
                return None, None
            try:
                async with client(port) as c:
                    await c.write_event(Describe().event())
                    info = Info.from_event(await c.read_event())
                    break
            except OSError:
                await asyncio.sleep(0.2)
        async with client(port) as c:
            await c.write_event(Transcript(text="Hello there", context={"conversation_id": "7"}).event())
            return info, await read_until(c, "handled-stop")

    try:
        info, events = asyncio.run(scenario())
        assert info is not None, proc.stderr.read()[-2000:]
        assert info.asr[0].models[0].name == "whisper-tiny-en" and info.handle[0].supports_handled_streaming
        assert HANDLED_ORDER.fullmatch(types(events)), types(events)
    finally:
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 0, err[-2000:]


def test_idle_and_surplus_connections_are_closed(monkeypatch):
    """A client that connects and sends nothing must not hold one of the connection slots forever."""
    import runtime.serve.wyoming as wy

    monkeypatch.setattr(wy, "IDLE_S", 0.5)
    monkeypatch.setattr(wy, "MAX_CONNECTIONS", 2)

    async def scenario(port):
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        third = await asyncio.wait_for(idle[2][0].read(), TIMEOUT)  # over the limit: closed at once
        first = await asyncio.wait_for(idle[0][0].read(), TIMEOUT)  # idle: closed after IDLE_S
        for _, w in idle:
            w.close()
        async with client(port) as c:
            await c.write_event(Describe().event())
            return third, first, (await c.read_event()).type

    assert serve(scenario) == (b"", b"", "info")


def test_audio_past_30_s_is_dropped_with_an_error_and_the_rest_transcribed():
    async def scenario(port):
        async with client(port) as c:
            await c.write_event(AudioStart(rate=16000, width=2, channels=1).event())
            for _ in range(40):  # 40 s
                await c.write_event(AudioChunk(rate=16000, width=2, channels=1, audio=bytes(32000)).event())
            await c.write_event(AudioStop().event())
            return await read_until(c, "transcript-stop")

    events = serve(scenario)
    errors = [e for e in events if e.type == "error"]
    assert len(errors) == 1 and errors[0].data["code"] == "audio-too-long"
    assert next(e for e in events if e.type == "transcript").data["text"] == f"{30 * SAMPLE_RATE} samples"


def test_a_busy_model_is_an_error_event_without_a_traceback(caplog):
    """Bug: a handle request refused by the scheduler (queue full: routine under load) was logged with a full
    traceback, one per request, as if the server had failed."""
    from runtime.serve.scheduler import QueueFull

    async def busy(text):
        raise QueueFull(8, 3)
        yield  # an async generator, as the service's llm_stream

    async def scenario(port):
        async with client(port) as c:
            await c.write_event(Transcript(text="hello").event())
            return await read_until(c, "error")

    with caplog.at_level("INFO", logger="runtime.serve.wyoming"):
        events = serve(scenario, llm=busy)
    err = events[-1]
    assert err.data["code"] == "QueueFull" and "busy" in err.data["text"]
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
