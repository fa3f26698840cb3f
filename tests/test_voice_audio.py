"""runtime/voice/audio.py: the ring buffer, and Microphone/Speaker through a private PulseAudio server's
virtual devices (tests/pulse.py). Figures measured here are logged at INFO (pytest -o log_cli=true)."""
import logging
import time

import numpy as np
import pytest

from pulse import pulse, read_raw_f32, write_wav  # noqa: F401  (pulse: the session fixture)
from runtime.voice.audio import RingBuffer
from runtime.voice.engines import SAMPLE_RATE, VAD_WINDOW

pytestmark = pytest.mark.voice
log = logging.getLogger(__name__)


# --- RingBuffer

def test_ring_wraps_around_in_order():
    r = RingBuffer(10)
    src = np.arange(100, dtype=np.float32)
    out, pos = [], 0
    for step in (3, 7, 4, 6, 9, 1, 5, 8):  # writes and reads that straddle the end of the buffer
        pos += r.write(src[pos:pos + step])
        while (x := r.read(2)) is not None:
            out.extend(x.tolist())
    assert out == src[:len(out)].tolist() and len(out) >= pos - 1
    assert r.overflows == 0


def test_ring_overflow_drops_newest_and_counts():
    r = RingBuffer(8)
    assert r.write(np.arange(5, dtype=np.float32)) == 5
    assert r.write(np.arange(5, 10, dtype=np.float32)) == 3  # 8, 9 dropped
    assert r.overflows == 2 and r.available == 8 and r.free == 0
    assert r.read(8).tolist() == list(range(8))
    assert r.read(1) is None


def test_ring_read_is_a_view_of_preallocated_scratch_and_write_copies():
    r = RingBuffer(16)
    src = np.ones(4, np.float32)
    r.write(src)
    src[:] = 7  # the ring copied on write
    a = r.read(4)
    assert a.tolist() == [1, 1, 1, 1]
    assert np.shares_memory(a, r._scratch)  # no allocation per read: a view of the ring's own scratch
    r.write(np.full(4, 2, np.float32))
    b = r.read(4)
    assert np.shares_memory(a, b) and a.tolist() == [2, 2, 2, 2]  # valid until the next read, as documented
    out = np.zeros(4, np.float32)
    r.write(np.full(4, 3, np.float32))
    assert r.read(4, out=out) is not None and out.tolist() == [3] * 4
    assert r.read_into(out) == 0


def test_ring_clear_from_another_thread_keeps_later_writes():
    r = RingBuffer(32)
    r.write(np.ones(10, np.float32))
    r.clear()
    assert r.available == 0
    r.write(np.full(3, 5, np.float32))
    assert r.available == 3 and r.read(3).tolist() == [5, 5, 5]


def test_ring_stereo():
    r = RingBuffer(6, channels=2)
    x = np.arange(10, dtype=np.float32).reshape(5, 2)
    r.write(x)
    r.read(4)
    r.write(x[:4])  # wraps
    assert r.read(5).tolist() == [x[4].tolist(), *x[:4].tolist()]


# --- through the virtual devices

def _tone(freq, seconds, amp=0.5, rate=SAMPLE_RATE):
    t = np.arange(int(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _capture(mic, seconds):
    wins, times = [], []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = mic.read(timeout=0.2)
        if got is not None:
            wins.append(got[0])
            times.append(got[1])
    return np.concatenate(wins) if wins else np.zeros(0, np.float32), np.array(times)


def test_mic_tone_arrives_at_16k_with_its_frequency_and_a_bounded_delay(pulse, tmp_path):
    from runtime.voice.audio import Microphone

    # 0.5 s silence, then a 1 s 440 Hz tone: its onset gives the delay
    audio = np.concatenate([np.zeros(SAMPLE_RATE // 2, np.float32), _tone(440, 1.0)])
    wav = write_wav(tmp_path / "tone.wav", audio)
    with Microphone("virtual_mic") as mic:
        assert mic.wait_connected(5)
        assert mic.rate > 0
        _capture(mic, 0.3)  # settle
        t_play = time.monotonic()
        proc = pulse.play_into_mic(wav, wait=False)
        x, times = _capture(mic, 2.2)
        proc.wait(10)
        stats = dict(mic.stats)
    assert len(x) > SAMPLE_RATE
    # every window's time is its last sample's: consecutive windows 32 ms apart
    gaps = np.diff(times)
    assert abs(np.median(gaps) - VAD_WINDOW / SAMPLE_RATE) < 0.004
    # the tone's frequency
    loud = np.abs(x) > 0.1
    assert loud.any(), "the tone never arrived"
    i0 = int(np.argmax(loud))
    seg = x[i0 + 1600:i0 + 1600 + 8192]
    spec = np.abs(np.fft.rfft(seg * np.hanning(len(seg))))
    peak = np.argmax(spec) * SAMPLE_RATE / len(seg)
    assert abs(peak - 440) < 5, peak
    # the delay: capture time of the tone's first sample minus when it was due (play start + 0.5 s)
    t_onset = times[i0 // VAD_WINDOW] - (VAD_WINDOW - 1 - i0 % VAD_WINDOW) / SAMPLE_RATE
    delay = t_onset - (t_play + 0.5)
    log.info("mic: capture delay %.0f ms (tone onset), rate %d Hz, stats %s", delay * 1000, mic.rate, stats)
    print(f"MEASURED capture delay {delay * 1000:.0f} ms at device rate {mic.rate}")
    assert -0.05 < delay < 0.4, delay
    assert stats["reconnects"] == 0


def _recorded(pulse, path, seconds_before, action, seconds_after):
    rec = pulse.record_speaker(path)
    time.sleep(seconds_before)
    out = action()
    time.sleep(seconds_after)
    rec.terminate()
    rec.wait(5)
    return read_raw_f32(path), out


def test_speaker_play_is_captured_from_the_monitor(pulse, tmp_path):
    from runtime.voice.audio import Speaker

    rng = np.random.default_rng(0)
    noise = (0.3 * rng.standard_normal(8000)).astype(np.float32)  # 0.5 s at 16 kHz, played at 22.05 kHz
    src = noise.copy()
    with Speaker("speaker") as spk:
        assert spk.wait_connected(5)
        y, chunk = _recorded(pulse, tmp_path / "spk.raw", 0.3, lambda: spk.play(src, 16000), 1.0)
        chunks = spk.handed_times()
        stats = dict(spk.stats)
    assert chunks and chunks[0].handed_at is not None and chunks[0].handed_at >= chunks[0].queued_at
    assert len(y) > 8000
    c = np.correlate(y, noise, mode="valid")
    k = int(np.argmax(np.abs(c)))
    norm = np.linalg.norm(noise) * np.linalg.norm(y[k:k + len(noise)])
    assert c[k] / norm > 0.9, c[k] / norm  # the same signal, after two resamplings (16k -> device -> 16k)
    log.info("speaker: handed %.1f ms after play(); stats %s", (chunks[0].handed_at - chunks[0].queued_at) * 1e3,
             stats)
    assert stats["underruns"] == 0


def test_speaker_stop_silences_within_50ms(pulse, tmp_path):
    from runtime.voice.audio import Speaker

    tone = _tone(1000, 3.0)
    with Speaker("speaker") as spk:
        assert spk.wait_connected(5)
        marks = {}

        def play_then_stop():
            marks["play"] = spk.play(tone, SAMPLE_RATE)
            time.sleep(0.8)
            marks["stop"] = spk.stop()
            marks["playing_after"] = spk.playing

        y, _ = _recorded(pulse, tmp_path / "stop.raw", 0.3, play_then_stop, 0.6)
        spk.handed_times()
    loud = np.abs(y) > 0.05
    assert loud.any()
    # the recording's clock: find the tone start, then the last loud sample; stop came 0.8 s after play()
    first, last = int(np.argmax(loud)), len(loud) - 1 - int(np.argmax(loud[::-1]))
    heard_s = (last - first) / SAMPLE_RATE
    chunk = marks["play"]
    t_first = chunk.heard_at or chunk.handed_at  # estimated monotonic time of the tone's first sample
    stop_latency = (t_first + heard_s) - marks["stop"]
    log.info("speaker: stop latency %.1f ms (tone heard %.3f s, stop %.3f s after its first sample)",
             stop_latency * 1e3, heard_s, marks["stop"] - t_first)
    print(f"MEASURED stop latency {stop_latency * 1000:.1f} ms")
    assert heard_s < 2.5, "stop() did not cut the tone"
    assert stop_latency < 0.050, stop_latency
    assert not marks["playing_after"] or spk.played_until - marks["stop"] < 0.05


def test_mic_reconnects_after_the_device_is_removed_and_restored(pulse):
    from runtime.voice.audio import Microphone

    with Microphone("virtual_mic") as mic:
        assert mic.wait_connected(5)
        _capture(mic, 0.2)
        pulse.remove_mic()
        t = time.monotonic()
        while mic.connected.is_set() and time.monotonic() - t < 2:
            time.sleep(0.01)
        assert not mic.connected.is_set(), "the dead stream was not noticed"
        time.sleep(1.5)  # it keeps retrying while the device is gone
        assert mic.stats["open_failures"] >= 1
        t_back = time.monotonic()
        pulse.restore_mic()
        assert mic.wait_connected(5)
        reconnect_s = time.monotonic() - t_back
        x, _ = _capture(mic, 0.3)  # and it delivers again
        stats = dict(mic.stats)
    log.info("mic: reconnected %.0f ms after the device returned; stats %s", reconnect_s * 1e3, stats)
    print(f"MEASURED reconnect {reconnect_s * 1000:.0f} ms, stats {stats}")
    assert stats["reconnects"] == 1
    assert reconnect_s < 2.1  # the backoff is capped at 2 s; opening takes a few ms
    assert len(x) >= VAD_WINDOW


def test_missing_device_at_start_is_retried_not_a_crash(pulse):
    from runtime.voice.audio import Microphone, Speaker

    mic = Microphone("no-such-device").start()
    spk = Speaker("no-such-device").start()
    time.sleep(0.5)
    assert not mic.connected.is_set() and mic.stats["open_failures"] >= 2  # 0.1, 0.2 s backoff
    assert mic.read(timeout=0.05) is None
    assert spk.play(np.zeros(100, np.float32)) is None  # dropped, counted, no exception
    t = time.monotonic()
    mic.close()
    spk.close()
    assert time.monotonic() - t < 1.0
    mic.close()  # twice is fine
    Microphone().close()  # never started


def test_missing_mic_at_start_connects_when_it_appears(pulse):
    from runtime.voice.audio import Microphone

    pulse.remove_mic()
    try:
        with Microphone("virtual_mic") as mic:
            time.sleep(0.4)
            assert not mic.connected.is_set() and mic.stats["open_failures"] >= 1
            pulse.restore_mic()
            assert mic.wait_connected(3)
            assert mic.stats["reconnects"] == 1
    finally:
        if pulse.module_id("source_name=virtual_mic") is None:
            pulse.restore_mic()


def _drain(spk, timeout=3.0):
    deadline = time.monotonic() + timeout
    while spk.playing and time.monotonic() < deadline:
        time.sleep(0.01)


def test_speaker_underruns_are_gaps_inside_a_stream_not_its_end(pulse):
    """Regression: live mode queued every chunk with last=False and never ended the stream, so each reply's end
    counted as an underrun. A stream's end (finish(), stop(), last=True) is not one; a chunk that arrives after
    the queue ran dry is, and its gap is measured."""
    from runtime.voice.audio import Speaker

    chunk = _tone(440, 0.2)
    with Speaker("speaker") as spk:
        assert spk.wait_connected(5)
        for _ in range(3):  # back to back: no gap
            spk.play(chunk, SAMPLE_RATE, last=False)
        _drain(spk)
        time.sleep(0.1)
        spk.finish()
        assert spk.stats["underruns"] == 0, spk.stats
        spk.play(chunk, SAMPLE_RATE, last=False)  # a new stream after finish(): its start is no underrun
        _drain(spk)
        time.sleep(0.3)  # the next chunk comes 0.3 s after the queue ran dry: a real gap
        spk.play(chunk, SAMPLE_RATE, last=True)
        _drain(spk)
        time.sleep(0.1)
        stats = dict(spk.stats)
    log.info("speaker: gap measured %.0f ms", stats["underrun_ms"])
    assert stats["underruns"] == 1, stats
    assert 250 < stats["underrun_ms"] < 600, stats  # ~0.3 s plus the drain poll


def test_live_speaker_sink_counts_per_reply_and_not_the_replys_end(pulse):
    """Regression (runtime/voice/live.py SpeakerSink passed last=False for every chunk): a reply of three
    chunks then its end gives 0 underruns for the reply; a reply with a 0.3 s hole gives 1."""
    from runtime.voice.audio import Speaker
    from runtime.voice.live import SpeakerSink

    chunk = _tone(330, 0.15, rate=24000)
    firsts = []
    with Speaker("speaker") as spk:
        assert spk.wait_connected(5)
        sink = SpeakerSink(spk, on_first_audio=lambda: firsts.append(time.monotonic()))
        for _ in range(3):
            until = sink(chunk, 24000, time.monotonic())
        assert until > time.monotonic()  # when the last sample will be heard
        _drain(spk)
        time.sleep(0.1)
        first = sink.end_reply()
        sink(chunk, 24000, time.monotonic())
        _drain(spk)
        time.sleep(0.3)
        sink(chunk, 24000, time.monotonic())
        _drain(spk)
        second = sink.end_reply()
        assert sink.end_reply() is None  # nothing played since
    assert first["underruns"] == 0 and second["underruns"] == 1 and second["underrun_ms"] > 250, (first, second)
    assert len(firsts) == 2  # [speaking] once per reply


def test_echo_gate_learns_the_users_level_and_silences_quieter_windows():
    """runtime/voice/live.py EchoGate: nothing is gated until the user's level is known; then, while the bot
    speaks, a window more than margin_db below it is passed on as silence (a canceller's residual echo)."""
    from runtime.voice.live import EchoGate

    rng = np.random.default_rng(0)

    def at(db):
        x = rng.standard_normal(VAD_WINDOW)
        return (x / np.sqrt(np.mean(x ** 2)) * 10 ** (db / 20)).astype(np.float32)

    silence = np.zeros(VAD_WINDOW, np.float32)
    gate = EchoGate(margin_db=12, min_windows=16)
    quiet = at(-40)
    assert gate(quiet, silence) is quiet and gate.floor_db is None  # the user's level is not known yet
    for _ in range(8):
        gate.learn(at(-20))
        gate.learn(silence)  # digital silence teaches nothing
    assert gate.floor_db is None
    for _ in range(8):
        gate.learn(at(-20))
    assert abs(gate.floor_db - (-32)) < 0.5
    assert gate(quiet, silence) is silence and gate.gated == 1
    loud = at(-25)
    assert gate(loud, silence) is loud and gate.gated == 1
