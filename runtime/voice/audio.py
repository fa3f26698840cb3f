"""Sound devices at the pipeline's edges: a microphone that yields 16 kHz windows and a speaker that plays
queued audio and stops at once (barge-in).

The PortAudio callbacks only hand buffers over (STYLE.md practice 8): the input callback copies frames into
a preallocated ring; the output callback copies frames out of one. Resampling (soxr), downmixing and
windowing run in the caller's thread. A stream that fails to open or dies while running (PortAudio error,
finished callback, callbacks that stop coming) is reopened by a supervisor thread with exponential backoff
(0.1 s doubling to 2 s), logged and counted in ``stats``; nothing here raises from a device error, and
``close()`` always works.

    with Microphone("virtual_mic") as mic:
        for window, t in mic:            # (512,) float32 at 16 kHz, monotonic seconds of its last sample
            ...
    spk = Speaker("speaker"); spk.play(audio, 22050); spk.stop()

PortAudio lists devices once, at ``import sounddevice``: a device that appears later is not found by name
until the process restarts (use ALSA names that always exist, e.g. the PulseAudio ``pulse`` plug or a
``type pulse`` pcm per PulseAudio device — tests/pulse.py writes such a config).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from .engines import SAMPLE_RATE, VAD_WINDOW

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'boardtalk[voice]'"
BACKOFF_START = 0.1  # seconds before the first retry; doubles per failure
BACKOFF_MAX = 2.0  # seconds
STALL_S = 0.5  # a running stream whose callbacks stop for this long is treated as dead
FIRST_CALLBACK_S = 3.0  # a new stream gets this long for its first callback (a PulseAudio source's first
#                         reader waits ~1.9 s for data)


def _sounddevice():
    try:
        import sounddevice
    except (ImportError, OSError) as e:  # OSError: the wheel is there but libportaudio2 is not
        raise ImportError(f"audio devices need sounddevice and PortAudio: {INSTALL_HINT} ({e})") from e
    return sounddevice


def _soxr():
    try:
        import soxr
    except ImportError as e:
        raise ImportError(f"resampling needs soxr: {INSTALL_HINT}") from e
    return soxr


class RingBuffer:
    """Preallocated float32 single-producer/single-consumer ring.

    The producer only moves the write counter, the consumer only the read counter (both count frames since
    creation and never wrap), so one thread may write while another reads without a lock. When full,
    ``write`` drops the NEWEST frames (the ones that do not fit) and counts them in ``overflows``: dropping
    the oldest would mean the producer moving the consumer's counter. ``clear()`` may be called from any
    thread: it marks everything written so far as consumed; the consumer applies it at its next read.
    Neither ``write`` nor ``read`` allocates: ``read`` copies into ``out`` or into the ring's own scratch
    array and returns a view of it that is valid until the next read.
    """

    def __init__(self, capacity: int, channels: int = 1):
        if capacity <= 0 or channels <= 0:
            raise ValueError(f"capacity and channels must be positive, got {capacity}, {channels}")
        shape = (capacity,) if channels == 1 else (capacity, channels)
        self._buf = np.zeros(shape, np.float32)  # (capacity[, channels]) float32
        self._scratch = np.zeros(shape, np.float32)  # what read() returns views of
        self.capacity = capacity
        self.channels = channels
        self._w = 0  # frames ever written (producer)
        self._r = 0  # frames ever consumed (consumer)
        self._clear_to = 0  # frames before this index count as consumed (any thread)
        self.overflows = 0  # frames dropped because the ring was full

    @property
    def written(self) -> int:
        return self._w

    @property
    def consumed(self) -> int:
        return max(self._r, self._clear_to)

    @property
    def available(self) -> int:
        return self._w - max(self._r, self._clear_to)

    @property
    def free(self) -> int:
        return self.capacity - (self._w - self._r)

    def write(self, frames: np.ndarray) -> int:
        """Copy frames ((n,) or (n, channels)) in; returns how many fit. The rest are dropped and counted."""
        n = len(frames)
        k = min(n, self.capacity - (self._w - self._r))
        if k < n:
            self.overflows += n - k
        if k <= 0:
            return 0
        i = self._w % self.capacity
        first = min(k, self.capacity - i)
        self._buf[i:i + first] = frames[:first]
        if k > first:
            self._buf[:k - first] = frames[first:k]
        self._w += k  # publish after the copy
        return k

    def _take(self, out: np.ndarray, k: int) -> None:
        i = self._r % self.capacity
        first = min(k, self.capacity - i)
        out[:first] = self._buf[i:i + first]
        if k > first:
            out[first:k] = self._buf[:k - first]
        self._r += k

    def _apply_clear(self) -> None:
        c = self._clear_to
        if c > self._r:
            self._r = c

    def read(self, n: int, out: np.ndarray | None = None) -> np.ndarray | None:
        """Exactly n frames, or None (nothing consumed) when fewer are available. Without ``out`` the result
        is a view of the ring's scratch array, overwritten by the next read."""
        if n > self.capacity:
            raise ValueError(f"read of {n} frames from a ring of {self.capacity}")
        self._apply_clear()
        if self._w - self._r < n:
            return None
        dst = self._scratch[:n] if out is None else out[:n]
        self._take(dst, n)
        return dst

    def read_into(self, out: np.ndarray) -> int:
        """Up to len(out) frames into out; returns how many (the rest of out is left as it was)."""
        self._apply_clear()
        k = min(len(out), self._w - self._r)
        if k > 0:
            self._take(out, k)
        return k

    def clear(self) -> None:
        self._clear_to = self._w


def _find_device(sd, device, kind: str) -> int:
    """PortAudio index of a device: None = the default for kind ("input"/"output"), an int, or a name
    (exact match first, then case-insensitive substring) among devices with channels of that kind."""
    if device is None:
        return sd.query_devices(kind=kind)["index"]  # raises PortAudioError when there is none
    key = "max_input_channels" if kind == "input" else "max_output_channels"
    devices = [d for d in sd.query_devices() if d[key] > 0]
    if isinstance(device, int):
        if any(d["index"] == device for d in devices):
            return device
        raise LookupError(f"no {kind} device with index {device}")
    for match in (lambda name: name == device, lambda name: device.lower() in name.lower()):
        for d in devices:
            if match(d["name"]):
                return d["index"]
    names = ", ".join(d["name"] for d in devices) or "none"
    raise LookupError(f"no {kind} device named like {device!r}; {kind} devices: {names}")


class _Device:
    """A stream kept open by a supervisor thread: opened with backoff, reopened when it dies."""

    kind = "input"

    def __init__(self, device, rate, block_ms: float):
        if block_ms <= 0:
            raise ValueError(f"block_ms must be positive, got {block_ms}")
        self._sd = _sounddevice()  # eager: a missing package raises here, with the install hint
        self._soxr = _soxr()
        self.device = device
        self.requested_rate = rate
        self.block_ms = block_ms
        self.rate: int | None = None  # Hz of the open stream (the device's native rate unless given)
        self.stats = {"xruns": 0, "underruns": 0, "overflows": 0, "reconnects": 0, "open_failures": 0}
        self.connected = threading.Event()
        self._stream = None
        self._dead = False  # set by the finished callback
        self._flushing = False  # a deliberate abort + start is under way (Speaker.stop)
        self._last_cb = 0.0  # monotonic time of the latest callback
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name=f"boardtalk-{self.kind}", daemon=True)
        self._started = False

    # subclasses: _open(index, rate) -> stream (not started); _on_reconnect()
    def start(self):
        if not self._started:
            self._started = True
            self._thread.start()
        return self

    def wait_connected(self, timeout: float | None = None) -> bool:
        return self.connected.wait(timeout)

    def _finished(self):  # PortAudio's finished callback: the stream stopped (error, abort or close)
        self._dead = True

    def _try_open(self):
        idx = _find_device(self._sd, self.device, self.kind)
        rate = int(self.requested_rate or self._sd.query_devices(idx)["default_samplerate"])
        self._dead = False
        stream = self._open(idx, rate)
        try:
            self._last_cb = time.monotonic()
            stream.start()
        except Exception:
            stream.close()
            raise
        return stream, idx, rate

    def _supervise(self):
        delay = BACKOFF_START
        failed = False  # a failure since the last good stream: the next good one is a reconnect
        while not self._closing.is_set():
            try:
                stream, idx, rate = self._try_open()
            except Exception as e:  # PortAudioError, LookupError: never a crash, retried
                self.stats["open_failures"] += 1
                log.warning("%s device %r not available (%s); retry in %.1f s", self.kind, self.device, e, delay)
                failed = True
                if self._closing.wait(delay):
                    break
                delay = min(delay * 2, BACKOFF_MAX)
                continue
            self.rate = rate
            self._stream = stream
            if failed:
                self.stats["reconnects"] += 1
                log.warning("%s device %r reconnected (index %d, %d Hz)", self.kind, self.device, idx, rate)
            else:
                log.info("%s device %r open (index %d, %d Hz)", self.kind, self.device, idx, rate)
            self.connected.set()
            delay = BACKOFF_START
            why = None
            t_open = self._last_cb  # set just before start(); a callback moves it past this
            while not self._closing.wait(0.02):  # watch it
                if self._flushing:  # Speaker.stop() restarts the stream on purpose
                    continue
                if self._dead or not stream.active:
                    why = "stream finished"
                elif time.monotonic() - self._last_cb > (STALL_S if self._last_cb > t_open else FIRST_CALLBACK_S):
                    why = f"no callback for {time.monotonic() - self._last_cb:.2f} s"
                if why:
                    break
            self.connected.clear()
            self._stream = None
            try:
                stream.abort()
            except Exception:
                pass
            try:
                stream.close()
            except Exception:
                pass
            if self._closing.is_set():
                break
            log.warning("%s device %r stopped (%s); reconnecting", self.kind, self.device, why)
            failed = True
            self._on_reconnect()

    def _on_reconnect(self):
        pass

    def close(self) -> None:
        """Stop and release the device; safe to call twice, before start, or while it is reconnecting."""
        self._closing.set()
        if self._started and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        s, self._stream = self._stream, None
        if s is not None:
            try:
                s.close()
            except Exception:
                pass
        self.connected.clear()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()


class Microphone(_Device):
    """Capture from ``device`` (None: the default input; an index; or a name substring) at its native rate
    (or ``rate``), ``block_ms`` per callback. ``read()`` / iteration give VAD_WINDOW-sample windows of mono
    float32 at SAMPLE_RATE with the monotonic time of each window's last sample.

    Capture time: the callback's ``time.inputBufferAdcTime`` (PortAudio's stream clock) plus the block's
    duration, mapped to ``time.monotonic()`` by the offset between ``time.currentTime`` and
    ``time.monotonic()`` taken in the same callback; when the host API gives no ADC time (0), the callback's
    arrival time. Samples the resampler still holds are accounted for.
    """

    kind = "input"

    def __init__(self, device=None, rate: int | None = None, block_ms: float = 10, buffer_s: float = 2.0,
                 channels: int = 1, latency: float | str = "high"):
        super().__init__(device, rate, block_ms)
        self.channels = channels
        self.latency = latency  # PortAudio's suggested input latency: "high" survives bursty servers
        self._ring = RingBuffer(int(buffer_s * 96000), channels)  # sized for rates up to 96 kHz
        self._anchor = (0, 0.0)  # (ring frames written at the end of a block, monotonic time of its last frame)
        self._epoch = 0  # bumped for every new stream; the reader resets its resampler
        self._reader_epoch = -1
        self._resampler = None
        self._in_rate = 0
        self._in_count = 0  # frames fed to the resampler since the last reset
        self._out_count = 0  # samples it gave back
        self._acc = np.zeros(4 * VAD_WINDOW + SAMPLE_RATE, np.float32)  # 16 kHz samples not yet windowed
        self._acc_n = 0
        self._acc_drops = 0  # 16 kHz samples dropped because the caller did not read
        chunk = int(0.1 * 96000)  # frames moved per pump
        self._chunk = np.zeros(chunk if channels == 1 else (chunk, channels), np.float32)

    def _callback(self, indata, frames, t, status):  # audio thread: hand the frames over, count, nothing else
        now = time.monotonic()
        self._last_cb = now
        if status.input_overflow or status.input_underflow:
            self.stats["xruns"] += 1
        self._ring.write(indata if self.channels > 1 else indata[:, 0])
        adc = t.inputBufferAdcTime
        last = now + (adc - t.currentTime) + (frames - 1) / self.rate if adc > 0 else now
        self._anchor = (self._ring.written, last)

    def _open(self, idx, rate):
        self.rate = rate
        self._ring.clear()
        self._epoch += 1
        return self._sd.InputStream(device=idx, samplerate=rate, channels=self.channels, dtype="float32",
                                    blocksize=max(1, int(rate * self.block_ms / 1000)), latency=self.latency,
                                    callback=self._callback, finished_callback=self._finished)

    def _pump(self) -> bool:
        """Move what the ring holds through the resampler into the 16 kHz accumulator; True if anything."""
        if self._epoch == 0:  # no stream opened yet
            return False
        if self._reader_epoch != self._epoch:
            self._reader_epoch = self._epoch
            self._in_rate = self.rate
            self._resampler = self._soxr.ResampleStream(self._in_rate, SAMPLE_RATE, 1, dtype="float32")
            self._in_count = self._out_count = 0
            self._acc_n = 0
        n = self._ring.read_into(self._chunk)
        self.stats["overflows"] = self._ring.overflows + self._acc_drops
        if n == 0:
            return False
        x = self._chunk[:n] if self.channels == 1 else self._chunk[:n].mean(axis=1)
        y = self._resampler.resample_chunk(x)
        self._in_count += n
        self._out_count += len(y)
        room = len(self._acc) - self._acc_n
        if len(y) > room:  # the caller is not reading: keep the newest
            self._acc[:self._acc_n - (len(y) - room)] = self._acc[len(y) - room:self._acc_n]
            self._acc_drops += len(y) - room
            self._acc_n -= len(y) - room
        self._acc[self._acc_n:self._acc_n + len(y)] = y
        self._acc_n += len(y)
        return True

    def read(self, timeout: float | None = None) -> tuple[np.ndarray, float] | None:
        """The next window: ((VAD_WINDOW,) float32 at 16 kHz, monotonic seconds of its last sample), or None
        after ``timeout`` seconds or once closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            while self._pump():
                pass
            if self._acc_n >= VAD_WINDOW:
                win = self._acc[:VAD_WINDOW].copy()
                rest = self._acc_n - VAD_WINDOW
                self._acc[:rest] = self._acc[VAD_WINDOW:self._acc_n]
                self._acc_n = rest
                idx, t_last = self._anchor  # last frame of the latest block
                consumed = self._ring.consumed
                t_in = t_last - (idx - consumed) / self._in_rate  # time of the last frame consumed
                held = self._in_count * SAMPLE_RATE / self._in_rate - self._out_count  # inside soxr
                return win, t_in - (held + rest) / SAMPLE_RATE
            if self._closing.is_set() or (deadline is not None and time.monotonic() >= deadline):
                return None
            time.sleep(self.block_ms / 2000)

    def __iter__(self):
        while not self._closing.is_set():
            got = self.read(timeout=0.5)
            if got is not None:
                yield got


@dataclass
class Chunk:
    """One queued piece of audio and when it met the device."""

    queued_at: float  # monotonic seconds, play() call
    start: int  # ring frame index of its first sample
    frames: int  # at the device rate
    handed_at: float | None = None  # monotonic seconds its first sample went to PortAudio (None: not yet/cut)
    heard_at: float | None = None  # estimated monotonic seconds its first sample reaches the DAC


class Speaker(_Device):
    """Play queued audio on ``device`` (None: the default output; an index; or a name substring) at its native
    rate (or ``rate``). ``play()`` resamples and queues; ``stop()`` drops everything not yet handed to the
    device and flushes the device's own buffer (barge-in)."""

    kind = "output"

    def __init__(self, device=None, rate: int | None = None, block_ms: float = 10, buffer_s: float = 60.0,
                 latency: float | str = "low"):
        super().__init__(device, rate, block_ms)
        self.latency = latency  # PortAudio's suggested output latency (seconds, "low" or "high")
        self._ring = RingBuffer(int(buffer_s * 48000))
        self.stats["underrun_ms"] = 0.0  # silence inside streams (play(last=False) ... next play), ms
        self._more = False  # the caller said more audio follows (play(last=False)), until finish()/stop()
        self._dry = True  # the callback found the ring empty (set on the audio thread)
        self._dry_at = 0.0  # monotonic seconds the ring last ran dry
        self._out_latency = 0.0  # seconds from handing a frame over to hearing it (from the callback)
        n = 4096  # callback history: (first ring index, end ring index, monotonic, dac - current)
        self._hist = np.zeros((n, 4), np.float64)
        self._hist_n = 0
        self.chunks: list[Chunk] = []
        self._wait_rate = threading.Event()

    def _callback(self, outdata, frames, t, status):  # audio thread: copy out of the ring, nothing else
        now = time.monotonic()
        self._last_cb = now
        if status.output_underflow:
            self.stats["xruns"] += 1
        start = self._ring.consumed
        got = self._ring.read_into(outdata[:, 0])
        if got < frames:
            outdata[got:, 0] = 0
            if not self._dry:
                self._dry_at = now + got / self.rate  # play() decides whether this was a gap
            self._dry = True
        else:
            self._dry = False
        if got:
            lat = t.outputBufferDacTime - t.currentTime if t.outputBufferDacTime > 0 else 0.0
            h = self._hist[self._hist_n % len(self._hist)]
            h[0], h[1], h[2], h[3] = start, start + got, now, lat
            self._hist_n += 1
            self._out_latency = lat

    def _open(self, idx, rate):
        self._ring.clear()
        self.rate = rate
        self._wait_rate.set()
        return self._sd.OutputStream(device=idx, samplerate=rate, channels=1, dtype="float32",
                                     blocksize=max(1, int(rate * self.block_ms / 1000)), latency=self.latency,
                                     callback=self._callback, finished_callback=self._finished)

    def play(self, audio: np.ndarray, rate: int = SAMPLE_RATE, last: bool = True) -> Chunk | None:
        """Queue mono float32 audio at ``rate`` Hz. ``last=False`` says more follows (a streamed reply): if
        the queue runs dry before the next play() of the stream, that play() counts an underrun and its gap
        (``stats["underrun_ms"]``). The end of a stream is ``last=True``, ``finish()`` or ``stop()``: running
        dry then is no underrun. Returns the chunk's record, or None when no device is open yet (the audio is
        dropped and counted as an underrun)."""
        audio = np.asarray(audio, np.float32).reshape(-1)
        if self.rate is None and not self._wait_rate.wait(1.0):
            self.stats["underruns"] += 1
            return None
        if rate != self.rate:
            audio = self._soxr.resample(audio, rate, self.rate).astype(np.float32, copy=False)
        if self._more and self._dry and self._ring.available == 0:  # the stream went silent in the middle
            self.stats["underruns"] += 1
            self.stats["underrun_ms"] += max(0.0, time.monotonic() - self._dry_at) * 1e3
        start = self._ring.written
        k = self._ring.write(audio)
        self.stats["overflows"] = self._ring.overflows
        chunk = Chunk(time.monotonic(), start, k)
        self.chunks.append(chunk)
        self._more = not last
        return chunk

    def stop(self) -> float:
        """Drop all queued audio now; the callback plays zeros from its next block. Also drops what the device
        already buffered (abort + restart of the stream) when that is more than one block. Returns the
        monotonic time of the call."""
        t = time.monotonic()
        self._more = False
        self._ring.clear()
        s = self._stream
        if s is not None and self._out_latency > self.block_ms / 1000:
            self._flushing = True
            try:
                s.abort()  # PortAudio drops what the device holds (snd_pcm_drop)
                self._dead = False  # the finished callback of this abort is not a failure
                self._last_cb = time.monotonic()
                s.start()
            except Exception as e:  # the supervisor notices a dead stream and reopens it
                log.warning("flushing the output device failed: %s", e)
            finally:
                self._flushing = False
        return t

    def finish(self) -> None:
        """The stream of ``play(last=False)`` chunks is complete: its queue running dry is its end, no underrun."""
        self._more = False

    @property
    def playing(self) -> bool:
        return self._ring.available > 0 or time.monotonic() < self.played_until

    @property
    def played_until(self) -> float:
        """Monotonic seconds at which the last queued sample will be heard (now or earlier when idle)."""
        rate = self.rate or SAMPLE_RATE
        n = self._hist_n
        if n == 0:
            return time.monotonic() + self._ring.available / rate
        h = self._hist[(n - 1) % len(self._hist)]
        if self._ring.available == 0:  # everything handed over: the last block ends at its DAC time
            return h[2] + h[3] + (h[1] - h[0]) / rate
        return time.monotonic() + self._out_latency + self._ring.available / rate

    def handed_times(self) -> list[Chunk]:
        """Fill in ``handed_at``/``heard_at`` of the chunks from the callback history, and return them."""
        rate = self.rate or SAMPLE_RATE
        n = self._hist_n
        hist = self._hist[:n] if n <= len(self._hist) else np.roll(self._hist, -(n % len(self._hist)), axis=0)
        for c in self.chunks:
            if c.handed_at is not None or c.frames == 0:
                continue
            hit = np.nonzero((hist[:, 0] <= c.start) & (c.start < hist[:, 1]))[0]
            if len(hit):
                h = hist[hit[0]]
                c.handed_at = float(h[2])
                c.heard_at = float(h[2] + h[3] + (c.start - h[0]) / rate)
        return self.chunks
