"""The Wyoming server of ``boardtalk serve``: the board as Home Assistant's speech-to-text, text-to-speech and
conversation agent (issue #9 §3; docs/home-assistant.md lists every flow and its event order).

    await serve_wyoming("0.0.0.0", 10700, asr=asr, tts=tts, llm=llm, stop=stop_event, ready=ready_event)

One TCP connection carries any number of requests, answered in the order wyoming 1.10's README ("Event Flow")
gives: describe -> info; transcribe/audio-* -> transcript-start, transcript-chunk*, transcript,
transcript-stop; synthesize (plain or streamed) -> audio-start/chunk*/stop per piece [, synthesize-stopped];
a client's transcript -> handled-start, handled-chunk*, handled, handled-stop; ping -> pong.
Transcript chunks are the words two successive partial ASR passes agree on ("local agreement"), sent while
audio still arrives; the final ``transcript`` is the authority. Unknown events are ignored; a known event with
bad fields gets an ``error`` and the connection goes on; a frame that cannot be parsed gets an ``error`` and
the connection is closed (the stream cannot be resynced).

ASR and TTS are CPU-bound: they run in threads (one call per engine at a time, engine_lock), never on the event
loop. When a client disconnects, its running request is cancelled: the LLM iterator is closed (which cancels
the generation) and no further ASR/TTS call is started for it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from typing import AsyncIterator, Callable

import numpy as np

log = logging.getLogger(__name__)

INSTALL_HINT = "the Wyoming server needs wyoming >= 1.7 (streaming events): pip install 'boardtalk[serve]'"
SAMPLE_RATE = 16000  # Hz: what the ASR engines take
MAX_LINE = 64 << 10  # bytes of one event's JSON header line
MAX_DATA = 64 << 10  # bytes of an event's additional JSON data
MAX_PAYLOAD = 4 << 20  # bytes of one event's payload (an audio chunk is usually 2-8 KiB)
MAX_UTTERANCE_S = 30.0  # seconds of audio kept per transcribe request (Whisper's window); the rest is dropped
MAX_TEXT = 4000  # characters of one synthesize / handle request (a synthesize stream may send more in chunks)
PARTIAL_EVERY_S = 0.5  # seconds of new audio between partial ASR passes (one at a time; docs/home-assistant.md)
OUT_CHUNK = 1024  # samples per audio-chunk sent
MAX_CONNECTIONS = 16
IDLE_S = 300.0  # a connection that sends nothing this long is closed (it would hold one of the slots)
LANGUAGES = ["en"]  # Whisper tiny.en and the English voices

_locks: dict[int, tuple[object, threading.Lock]] = {}
_locks_guard = threading.Lock()


def engine_lock(engine) -> threading.Lock:
    """The lock that serializes calls into one engine (shared with anyone else calling it from a thread)."""
    with _locks_guard:
        held = _locks.get(id(engine))
        if held is None or held[0] is not engine:
            held = _locks[id(engine)] = (engine, threading.Lock())
        return held[1]


async def _in_thread(engine, fn, *args):
    lock = engine_lock(engine)

    def run():
        with lock:
            return fn(*args)

    return await asyncio.to_thread(run)


_asr_owner: dict[int, object] = {}  # id(asr engine) -> the utterance its reusable state belongs to


async def _transcribe(asr, utterance: object, audio: Callable[[], np.ndarray]):
    """asr.transcribe(audio()) in a thread for one utterance. The ASR interface lets an engine reuse work
    between passes of one utterance until reset(): when the engine's last pass was another utterance's
    (another connection, or the previous request), it is reset first, so no words leak across."""
    lock = engine_lock(asr)

    def run():
        with lock:
            if _asr_owner.get(id(asr)) is not utterance:
                if hasattr(asr, "reset"):
                    asr.reset()
                _asr_owner[id(asr)] = utterance
            return asr.transcribe(audio())

    return await asyncio.to_thread(run)


# -- audio in and out ------------------------------------------------------------------------------------------
def pcm_to_float(data: bytes, width: int, channels: int) -> np.ndarray:
    """Mono float32 in [-1, 1] of interleaved little-endian signed PCM (width 1-4 bytes; 1 is signed 8-bit,
    as audioop and Wyoming's converter take it). A partial last frame is an error."""
    frame = width * channels
    if len(data) % frame:
        raise ValueError(f"{len(data)} bytes is not a whole number of {width}-byte x {channels}-channel frames")
    if width == 3:
        b = np.frombuffer(data, np.uint8).reshape(-1, 3).astype(np.int32)
        x = ((b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8).astype(np.float32) / 2**23
    else:
        x = np.frombuffer(data, f"<i{width}").astype(np.float32) / float(2 ** (8 * width - 1))
    return x.reshape(-1, channels).mean(axis=1) if channels > 1 else x


def float_to_pcm16(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1.0, 1.0) * 32767).astype("<i2").tobytes()


class AudioBuffer:
    """One utterance's audio as it arrives, returned as 16 kHz mono float32. Each run of chunks at one rate is
    resampled whole (no seams inside it); at most max_s seconds are kept."""

    def __init__(self, max_s: float = MAX_UTTERANCE_S):
        self.max_s = max_s
        self._done: list[np.ndarray] = []  # 16 kHz pieces of earlier rate runs
        self._run: list[np.ndarray] = []  # the current run, at self._rate
        self._rate: int | None = None
        self.seconds = 0.0  # of audio kept
        self.dropped_s = 0.0  # of audio past max_s
        self.token = object()  # this utterance, for the ASR engine's reuse between passes (_transcribe)

    def add(self, x: np.ndarray, rate: int) -> None:
        room = self.max_s - self.seconds
        if len(x) / rate > room:
            keep = max(0, int(room * rate))
            self.dropped_s += (len(x) - keep) / rate
            x = x[:keep]
        if not len(x):
            return
        if rate != self._rate and self._run:
            self._done.append(self._resampled())
            self._run = []
        self._rate = rate
        self._run.append(x)
        self.seconds += len(x) / rate

    def _resampled(self) -> np.ndarray:
        return _to_16k(self._run, self._rate)

    def snapshot(self) -> Callable[[], np.ndarray]:
        """A function giving (samples,) float32 at 16 kHz of everything kept so far: take it on the event loop,
        call it in a thread (it resamples); chunks added meanwhile are not in it."""
        done, run, rate = list(self._done), list(self._run), self._rate

        def audio() -> np.ndarray:
            parts = done + ([_to_16k(run, rate)] if run else [])
            return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)

        return audio


def _to_16k(run: list[np.ndarray], rate: int) -> np.ndarray:
    from runtime.voice.filemode import resample  # soxr (the voice extra), else scipy, else numpy

    return resample(np.concatenate(run), rate, SAMPLE_RATE)


def _norm(word: str) -> str:
    return re.sub(r"[^\w']+", "", word.lower())


def agreed_prefix(a: list[str], b: list[str]) -> int:
    """How many leading words two passes share (case and punctuation aside)."""
    n = 0
    while n < min(len(a), len(b)) and _norm(a[n]) == _norm(b[n]):
        n += 1
    return n


# -- the protocol -----------------------------------------------------------------------------------------------
def describe(asr, tts, llm_name: str):
    """The ``info`` event: what Home Assistant reads to offer the board as STT, TTS and conversation agent."""
    import runtime
    from runtime.voice.engines import ENGINES
    from wyoming.info import (AsrModel, AsrProgram, Attribution, HandleModel, HandleProgram, Info, TtsProgram,
                              TtsVoice)

    def about(kind: str, name: str) -> str:
        e = ENGINES.get((kind, name))
        return f"{e.description} ({e.license})" if e else name

    boardtalk = Attribution(name="boardtalk", url="https://pypi.org/project/boardtalk/")
    version = runtime.__version__
    return Info(
        asr=[AsrProgram(name="boardtalk-asr", attribution=boardtalk, installed=True, version=version,
                        description="boardtalk speech-to-text", supports_transcript_streaming=True,
                        requires_external_vad=True,
                        models=[AsrModel(name=asr.name, attribution=boardtalk, installed=True, version=version,
                                         description=about("asr", asr.name), languages=LANGUAGES)])],
        tts=[TtsProgram(name="boardtalk-tts", attribution=boardtalk, installed=True, version=version,
                        description="boardtalk text-to-speech", supports_synthesize_streaming=True,
                        voices=[TtsVoice(name=tts.name, attribution=boardtalk, installed=True, version=version,
                                         description=about("tts", tts.name), languages=LANGUAGES)])],
        handle=[HandleProgram(name="boardtalk", attribution=boardtalk, installed=True, version=version,
                              description=f"boardtalk LLM ({llm_name}) on this board", supports_handled_streaming=True,
                              supports_home_control=False,
                              models=[HandleModel(name=llm_name, attribution=boardtalk, installed=True, version=version,
                                                  description=f"{llm_name}, local", languages=LANGUAGES)])],
    ).event()


class BadFrame(Exception):
    """The byte stream is not Wyoming framing: the connection cannot go on."""


async def read_event(reader: asyncio.StreamReader):
    """The next event, None at a clean end of stream, BadFrame on anything malformed or over the limits."""
    from wyoming.event import Event

    try:
        line = await reader.readline()
    except ValueError:  # asyncio's LimitOverrunError: a line longer than MAX_LINE
        raise BadFrame(f"event header longer than {MAX_LINE} bytes") from None
    if not line:
        return None
    if not line.endswith(b"\n"):
        raise BadFrame("connection closed inside an event header")
    try:
        head = json.loads(line)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadFrame(f"event header is not JSON: {e}") from None
    except RecursionError:  # not a ValueError: it would end the reader without an error or a close
        raise BadFrame("event header is not JSON: nested too deeply") from None
    if not isinstance(head, dict) or not isinstance(head.get("type"), str):
        raise BadFrame("event header is not an object with a string 'type'")
    data = head.get("data") or {}
    dlen, plen = head.get("data_length") or 0, head.get("payload_length") or 0
    if not isinstance(data, dict) or not all(isinstance(n, int) and not isinstance(n, bool) for n in (dlen, plen)):
        raise BadFrame("'data' must be an object and the lengths integers")
    if not 0 <= dlen <= MAX_DATA or not 0 <= plen <= MAX_PAYLOAD:
        raise BadFrame(f"data_length {dlen} / payload_length {plen} out of range (at most {MAX_DATA} / {MAX_PAYLOAD})")
    try:
        if dlen:
            extra = json.loads(await reader.readexactly(dlen))
            if not isinstance(extra, dict):
                raise BadFrame("additional data is not a JSON object")
            data.update(extra)
        payload = await reader.readexactly(plen) if plen else None
    except asyncio.IncompleteReadError:
        raise BadFrame("connection closed inside an event") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadFrame(f"additional data is not JSON: {e}") from None
    except RecursionError:
        raise BadFrame("additional data is not JSON: nested too deeply") from None
    return Event(type=head["type"], data=data, payload=payload)


class _Connection:
    def __init__(self, reader, writer, *, asr, tts, llm, info):
        self.reader, self.writer = reader, writer
        self.asr, self.tts, self.llm, self.info = asr, tts, llm, info
        self.closed = False
        self.job: asyncio.Task | None = None
        self.audio: AudioBuffer | None = None  # a transcribe request's audio while it arrives
        self.audio_fmt: tuple[int, int, int] | None = None  # (rate Hz, width bytes, channels) of audio-start
        self.partial: asyncio.Task | None = None
        self.partial_at = 0.0  # seconds of audio the last partial pass started with
        self.prev_words: list[str] | None = None  # the last partial pass's words
        self.committed: list[str] = []  # words sent as transcript-chunks
        self.started = False  # transcript-start sent
        self.chunker = None  # runtime.voice.chunker.Chunker while a synthesize stream is open

    # ---- the connection's life: a reader that notices a disconnect at once, events handled in order -------
    async def run(self) -> None:
        queue: asyncio.Queue = asyncio.Queue(maxsize=64)  # full: the reader waits, TCP pushes back on the client
        reader = asyncio.create_task(self._read(queue))
        try:
            while not self.closed:
                event = await queue.get()
                if event is None or self.closed:
                    break
                self.job = asyncio.create_task(self._handle(event))
                await asyncio.wait({self.job})
                if self.job.cancelled():
                    break
                if (e := self.job.exception()) is not None:
                    if isinstance(e, (ConnectionError, OSError)):
                        break
                    if _expected(e):  # the model is busy or stopping: the client's to retry, not a bug
                        log.info("wyoming: %s refused: %s", event.type, e)
                    else:
                        log.exception("wyoming: %s failed", event.type, exc_info=e)
                    await self._error(f"{event.type} failed: {e}", type(e).__name__)
        finally:
            self.closed = True
            for t in (reader, self.job, self.partial):
                if t is not None and not t.done():
                    t.cancel()
            await asyncio.gather(*(t for t in (reader, self.job, self.partial) if t is not None),
                                 return_exceptions=True)
            self.writer.close()

    async def _read(self, queue: asyncio.Queue) -> None:
        try:
            while True:
                try:
                    event = await asyncio.wait_for(read_event(self.reader), IDLE_S)
                except asyncio.TimeoutError:
                    log.info("wyoming: closing a connection idle for %.0f s", IDLE_S)
                    break
                if event is None:
                    break
                await queue.put(event)
        except BadFrame as e:
            log.info("wyoming: closing a connection: %s", e)
            await self._error(str(e), "bad-frame")
        except (ConnectionError, OSError):
            pass
        except Exception as e:  # noqa: BLE001 - a bug here must still close the connection (it holds a slot)
            log.exception("wyoming: reading an event failed")
            await self._error(f"cannot read the event: {e}", "bad-frame")
        self.closed = True  # the client is gone (or unreadable): cancel what runs for it
        if self.job is not None and not self.job.done():
            self.job.cancel()
        if queue.full():
            queue.get_nowait()
        queue.put_nowait(None)

    async def _send(self, event) -> None:
        from wyoming.event import async_write_event

        if self.closed and self.writer.is_closing():
            raise ConnectionResetError("client gone")
        await async_write_event(event, self.writer)

    async def _error(self, text: str, code: str) -> None:
        from wyoming.error import Error

        try:
            await self._send(Error(text=text, code=code).event())
        except (ConnectionError, OSError):
            pass

    # ---- dispatch -------------------------------------------------------------------------------------------
    async def _handle(self, event) -> None:
        t = event.type
        handler = {"describe": self._describe, "ping": self._ping, "transcribe": self._transcribe,
                   "audio-start": self._audio_start, "audio-chunk": self._audio_chunk, "audio-stop": self._audio_stop,
                   "synthesize": self._synthesize, "synthesize-start": self._synth_start,
                   "synthesize-chunk": self._synth_chunk, "synthesize-stop": self._synth_stop,
                   "transcript": self._handle_text}.get(t)
        if handler is None:
            log.debug("wyoming: ignoring a %r event", t)
            return
        try:
            await handler(event)
        except _Bad as e:
            await self._error(f"{t}: {e}", "bad-event")

    async def _describe(self, event) -> None:
        await self._send(self.info)

    async def _ping(self, event) -> None:
        from wyoming.ping import Pong

        await self._send(Pong(text=_field(event, "text", str, None)).event())

    # ---- speech to text -------------------------------------------------------------------------------------
    async def _transcribe(self, event) -> None:
        lang = _field(event, "language", str, None)
        if lang and not lang.lower().startswith("en"):
            log.info("wyoming: transcribe asked for %r; %s is English-only", lang, self.asr.name)

    async def _audio_start(self, event) -> None:
        await self._reset_audio()
        self.audio_fmt = _audio_format(event)
        self.audio = AudioBuffer()

    async def _audio_chunk(self, event) -> None:
        rate, width, channels = _audio_format(event)
        if self.audio is None:  # no audio-start: be lenient, start here
            await self._reset_audio()
            self.audio, self.audio_fmt = AudioBuffer(), (rate, width, channels)
        try:
            x = pcm_to_float(event.payload or b"", width, channels)
        except ValueError as e:
            raise _Bad(str(e)) from None
        had_room = not self.audio.dropped_s
        self.audio.add(x, rate)
        if had_room and self.audio.dropped_s:
            await self._error(f"audio past {MAX_UTTERANCE_S:.0f} s is dropped (the ASR's window)", "audio-too-long")
        if self.partial is None and self.audio.seconds - self.partial_at >= PARTIAL_EVERY_S and not self.audio.dropped_s:
            self.partial_at = self.audio.seconds
            self.partial = asyncio.create_task(self._partial_pass(self.audio))
            self.partial.add_done_callback(_log_failure)

    async def _partial_pass(self, buf: AudioBuffer) -> None:
        """A pass on the audio so far; the words it agrees on with the previous pass go out as chunks."""
        try:
            audio = buf.snapshot()
            text = (await _transcribe(self.asr, buf.token, audio)).text
            if buf is not self.audio:
                return  # that utterance ended meanwhile
            words = text.split()
            if self.prev_words is not None:
                n = agreed_prefix(self.prev_words, words)
                k = len(self.committed)
                if n > k and agreed_prefix(self.committed, words) == k:
                    await self._transcript_chunk(words[k:n])
            self.prev_words = words
        finally:
            self.partial = None

    async def _transcript_chunk(self, words: list[str]) -> None:
        from wyoming.asr import TranscriptChunk, TranscriptStart

        if not self.started:
            self.started = True
            await self._send(TranscriptStart(language=LANGUAGES[0]).event())
        if words:
            text = (" " if self.committed else "") + " ".join(words)
            self.committed += words
            await self._send(TranscriptChunk(text=text).event())

    async def _audio_stop(self, event) -> None:
        from wyoming.asr import Transcript, TranscriptStop

        buf = self.audio or AudioBuffer()
        if self.partial is not None:  # a thread cannot be interrupted: let it finish (its chunks may go out)
            await asyncio.shield(self.partial)
        audio = buf.snapshot()
        text = ""
        if buf.seconds:
            text = (await _transcribe(self.asr, buf.token, audio)).text.strip()
        words = text.split()
        if len(words) < len(self.committed) or agreed_prefix(self.committed, words) < len(self.committed):
            log.info("wyoming: the final pass changed streamed words: %r -> %r", " ".join(self.committed), text)
        await self._transcript_chunk(words[len(self.committed):])
        await self._send(Transcript(text=text, language=LANGUAGES[0]).event())
        await self._send(TranscriptStop().event())
        await self._reset_audio()

    async def _reset_audio(self) -> None:
        if self.partial is not None:
            self.partial.cancel()
        self.audio = self.audio_fmt = self.partial = self.prev_words = None
        self.partial_at, self.committed, self.started = 0.0, [], False

    # ---- text to speech -------------------------------------------------------------------------------------
    async def _speak(self, text: str, start: bool = True, stop: bool = True) -> None:
        """Synthesize one piece of text and send it (audio-start / audio-chunk* / audio-stop)."""
        from wyoming.audio import AudioChunk, AudioStart, AudioStop

        rate = int(self.tts.sample_rate)
        audio = await _in_thread(self.tts, self.tts.synthesize, text) if text.strip() else np.zeros(0, np.float32)
        if start:
            await self._send(AudioStart(rate=rate, width=2, channels=1).event())
        pcm = float_to_pcm16(audio)
        for i in range(0, len(pcm), OUT_CHUNK * 2):
            await self._send(AudioChunk(rate=rate, width=2, channels=1, audio=pcm[i:i + OUT_CHUNK * 2]).event())
        if stop:
            await self._send(AudioStop().event())

    async def _synthesize(self, event) -> None:
        if self.chunker is not None:
            return  # the copy of a stream's text for servers without streaming: already being spoken
        from runtime.voice.chunker import Chunker

        text = _text(event)
        c = Chunker()
        pieces = c.push(text) + c.flush()
        if not pieces:
            pieces = [""]
        for i, piece in enumerate(pieces):  # one audio stream, synthesized piece by piece
            await self._speak(piece, start=i == 0, stop=i == len(pieces) - 1)

    async def _synth_start(self, event) -> None:
        from runtime.voice.chunker import Chunker

        self.chunker = Chunker()

    async def _synth_chunk(self, event) -> None:
        if self.chunker is None:
            raise _Bad("synthesize-chunk outside a synthesize-start ... synthesize-stop stream")
        pieces = self.chunker.push(_text(event, allow_empty=True))
        if len(self.chunker.buf) > MAX_TEXT:  # text that never reaches a clause end: speak it as it is
            pieces += self.chunker.flush()
        for piece in pieces:
            await self._speak(piece)

    async def _synth_stop(self, event) -> None:
        from wyoming.tts import SynthesizeStopped

        if self.chunker is None:
            raise _Bad("synthesize-stop without synthesize-start")
        pieces, self.chunker = self.chunker.flush(), None
        for piece in pieces:
            await self._speak(piece)
        await self._send(SynthesizeStopped().event())

    # ---- the LLM as a handler -------------------------------------------------------------------------------
    async def _handle_text(self, event) -> None:
        from wyoming.handle import Handled, HandledChunk, HandledStart, HandledStop, NotHandled

        text = _text(event, allow_empty=True).strip()
        context = event.data.get("context")
        context = context if isinstance(context, dict) else None
        if not text:
            await self._send(NotHandled(text="nothing was said", context=context).event())
            return
        await self._send(HandledStart(context=context).event())
        reply = []
        stream = self.llm(text)
        try:
            async for delta in stream:
                if delta:
                    reply.append(delta)
                    await self._send(HandledChunk(text=delta).event())
        finally:
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()  # a disconnect or a cancel lands here: closing it cancels the generation
        await self._send(Handled(text="".join(reply).strip(), context=context).event())
        await self._send(HandledStop().event())


def _expected(e: BaseException) -> bool:
    """The scheduler's refusals (queue full, shutting down, prompt too long): answered, not logged as bugs."""
    from .scheduler import PromptTooLong, QueueFull, ShuttingDown

    return isinstance(e, (QueueFull, ShuttingDown, PromptTooLong))


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None and not isinstance(task.exception(), ConnectionError):
        log.warning("wyoming: a partial ASR pass failed: %r", task.exception())


class _Bad(Exception):
    """A known event with a missing or wrong field: answered with an error event; the connection goes on."""


def _field(event, key: str, kind, default=...):
    v = event.data.get(key, default)
    if v is ... or (v is not None and not isinstance(v, kind)) or isinstance(v, bool) and kind is not bool:
        raise _Bad(f"'{key}' must be a {kind.__name__}, got {v!r}" if v is not ... else f"'{key}' is missing")
    return v


def _text(event, allow_empty: bool = False) -> str:
    text = _field(event, "text", str)
    if len(text) > MAX_TEXT:
        raise _Bad(f"text of {len(text)} characters; at most {MAX_TEXT} per event")
    if not allow_empty and not text.strip():
        raise _Bad("text is empty")
    return text


def _audio_format(event) -> tuple[int, int, int]:
    rate, width, channels = (_field(event, k, int) for k in ("rate", "width", "channels"))
    if not 1000 <= rate <= 384000 or width not in (1, 2, 3, 4) or not 1 <= channels <= 16:
        raise _Bad(f"unsupported audio format: rate {rate} Hz, width {width} bytes, {channels} channels "
                   "(rate 1000-384000, width 1-4, 1-16 channels)")
    return rate, width, channels


# -- the server -------------------------------------------------------------------------------------------------
async def serve_wyoming(host: str, port: int, *, asr, tts, llm: Callable[[str], AsyncIterator[str]],
                        stop: asyncio.Event, ready: asyncio.Event | None = None, llm_name: str = "boardtalk",
                        on_listen: Callable[[int], None] | None = None) -> None:
    """Serve Wyoming on host:port until ``stop`` is set. The engines are warmed up first (in a thread); then
    ``on_listen(port)`` (the real port when port is 0) and ``ready.set()``. Returns after every connection is
    closed and its work cancelled."""
    try:  # the streaming events came with wyoming 1.7: fail here, not in the middle of a request
        from wyoming.asr import TranscriptChunk  # noqa: F401
        from wyoming.handle import HandledChunk  # noqa: F401
        from wyoming.tts import SynthesizeStopped  # noqa: F401
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    for engine in (asr, tts):
        if hasattr(engine, "warmup"):
            await _in_thread(engine, engine.warmup)
    info = describe(asr, tts, llm_name)
    conns: set[asyncio.Task] = set()

    async def on_connect(reader, writer):
        if len(conns) >= MAX_CONNECTIONS:
            log.warning("wyoming: %d connections open; refusing another", len(conns))
            writer.close()
            return
        task = asyncio.current_task()
        conns.add(task)
        try:
            await _Connection(reader, writer, asr=asr, tts=tts, llm=llm, info=info).run()
        except asyncio.CancelledError:
            pass
        finally:
            conns.discard(task)

    server = await asyncio.start_server(on_connect, host, port, limit=MAX_LINE)
    bound = server.sockets[0].getsockname()[1]
    log.info("wyoming: serving on tcp://%s:%d (asr %s, tts %s, handle %s)", host, bound, asr.name, tts.name, llm_name)
    if on_listen is not None:
        on_listen(bound)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        server.close()
        for t in list(conns):
            t.cancel()
        await asyncio.gather(*conns, return_exceptions=True)
        await server.wait_closed()
        log.info("wyoming: stopped")
