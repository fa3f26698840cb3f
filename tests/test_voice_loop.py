"""The voice loop's turn logic in file mode, with scripted engines around the real (tiny) LLM: the order and
size of every latency, speculation and its restart, the hangover, barge-in, and the file mode's WAV I/O.
The real engines are tested in tests/test_voice_engines.py and end to end in tests/test_voice_e2e.py."""
import json
import time

import numpy as np
import pytest

import runtime
from runtime.voice.engines import SAMPLE_RATE, Transcript
from runtime.voice.filemode import read_wav, resample, run_file, write_wav
from runtime.voice.pipeline import VoiceConfig

SR = SAMPLE_RATE


class EnergyVAD:
    name = "energy"

    def reset(self):
        pass

    def __call__(self, window):
        return 1.0 if np.sqrt((window.astype(np.float64) ** 2).mean()) > 0.01 else 0.0


class LaggyVAD(EnergyVAD):
    """Like Silero: 0.8 while a window or the one before it has sound (it reports the end one window late)."""

    def reset(self):
        self.prev = 0.0

    def __call__(self, window):
        now = super().__call__(window)
        p, self.prev = max(now, self.prev) * 0.8, now
        return p


class ScriptedASR:
    """Says how many seconds of tone it heard, after a fixed compute time."""
    name = "scripted"

    def __init__(self, delay=0.06):
        self.delay, self.calls = delay, 0

    def reset(self):
        pass

    def warmup(self):
        pass

    def transcribe(self, audio):
        self.calls += 1
        time.sleep(self.delay)
        voiced = np.sum(np.abs(audio) > 0.05) / SR
        return Transcript(text=f"a question of {voiced:.1f} seconds", audio_s=len(audio) / SR)


class FixedASR(ScriptedASR):
    """Says the same words whatever it hears (a complete question, or a sentence cut at a pause)."""

    def __init__(self, text, delay=0.03):
        super().__init__(delay)
        self.text = text

    def transcribe(self, audio):
        super().transcribe(audio)
        return Transcript(text=self.text, audio_s=len(audio) / SR)


class ToneTTS:
    name, sample_rate = "tone", 24000

    def __init__(self, per_word=0.05):
        self.per_word = per_word

    def warmup(self):
        pass

    def synthesize(self, text):
        time.sleep(0.01)
        n = int(self.per_word * len(text.split()) * self.sample_rate) + 1
        return (0.3 * np.sin(np.arange(n) * 2 * np.pi * 440 / self.sample_rate)).astype(np.float32)


def _wav(tmp_path, parts, rate=SR, stereo=False, name="in.wav"):
    """parts: [(seconds, voiced?)]: tones for speech, zeros for silence."""
    xs = []
    for sec, voiced in parts:
        n = int(sec * rate)
        xs.append(0.4 * np.sin(np.arange(n) * 2 * np.pi * 220 / rate) if voiced else np.zeros(n))
    x = np.concatenate(xs).astype(np.float32)
    if stereo:
        x = np.stack([x, x], 1).reshape(-1)
    path = tmp_path / name
    import wave

    with wave.open(str(path), "wb") as w:
        w.setnchannels(2 if stereo else 1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((x * 32767).astype("<i2").tobytes())
    return path


@pytest.fixture()
def model(tiny_artifacts):
    return runtime.load(tiny_artifacts["native"])


def _run(model, path, tmp_path, per_word=0.05, **cfg):
    cfg = VoiceConfig(system="be brief", max_new_tokens=24, **cfg)
    return run_file(model, EnergyVAD(), ScriptedASR(), ToneTTS(per_word), path, tmp_path / "out.wav", cfg,
                    tmp_path / "report.json", tail_s=10)


def test_two_turns_with_ordered_latencies(model, tmp_path):
    path = _wav(tmp_path, [(0.4, False), (1.0, True), (1.2, False), (0.7, True), (0.6, False)], rate=44100, stereo=True)
    rep = _run(model, path, tmp_path)
    assert json.loads((tmp_path / "report.json").read_text()) == json.loads(json.dumps(rep))
    turns = rep["turns"]
    assert len(turns) == 2, turns
    for tr, (start, end) in zip(turns, [(0.4, 1.4), (2.6, 3.3)]):
        assert abs(tr["speech_start_s"] - start) < 0.1 and abs(tr["speech_end_s"] - end) < 0.05, tr
        assert tr["speech_end_s"] < tr["transcript_final_s"] <= tr["first_token_s"] < tr["first_audio_s"]
        assert tr["end_of_turn_s"] <= tr["first_audio_s"]
        hang = tr["end_of_turn_s"] - tr["speech_end_s"]
        assert 0.25 <= hang <= 0.25 + 0.07  # the hangover, to a window
        assert tr["transcript"].startswith("a question of") and tr["reply_text"]
        # the final pass started at the first silent window, not after the hangover
        assert tr["transcript_final_s"] - tr["speech_end_s"] < 0.25
        assert tr["speculative_restarts"] == 0 and tr["partial_passes"] >= 1
    assert turns[1]["prefill_reused_tokens"] > 0  # the system prompt and turn 1 were cached
    out, rate = read_wav(tmp_path / "out.wav")
    assert rate == 24000
    first = np.nonzero(np.abs(out) > 0.01)[0][0] / rate
    assert abs(first - turns[0]["first_audio_s"]) < 0.01  # written where it was handed over


def test_a_pause_shorter_than_the_hangover_restarts_the_speculation(model, tmp_path):
    """Speech resumes 160 ms after a pause: the speculative answer is cancelled and never heard."""
    path = _wav(tmp_path, [(0.3, False), (0.8, True), (0.16, False), (0.8, True), (0.8, False)])
    rep = _run(model, path, tmp_path)
    assert len(rep["turns"]) == 1
    tr = rep["turns"][0]
    assert tr["speculative_restarts"] >= 1 and float(tr["transcript"].split()[3]) >= 1.4  # both parts heard
    assert tr["first_audio_s"] > tr["speech_end_s"] > 2.0


def test_complete_sentence():
    from runtime.voice.pipeline import complete_sentence

    for text in ("Why is the sky blue?", "Tell me a fun fact.", "Go forward 10 meters.", "Stop!",
                 "How many legs does a spider have?", "What is that?"):
        assert complete_sentence(text), text
    for text in ("What is the capital of?", "Remind me to call my.", "Can you tell me", "and so...", "", None,
                 "Turn on the lights and."):
        assert not complete_sentence(text), text


@pytest.mark.parametrize("text, rule, hang", [("Why is the sky blue?", "complete", 0.15),
                                               ("What is the capital of.", "hangover", 0.25)])
def test_hangover_adapts_to_a_complete_sentence(model, tmp_path, text, rule, hang):
    """A finished question ends the turn after hangover_complete_s of silence; words a sentence cannot end in
    (a user pausing mid-sentence) wait the whole hangover_s."""
    path = _wav(tmp_path, [(0.3, False), (1.0, True), (1.0, False)])
    cfg = VoiceConfig(system="be brief", max_new_tokens=8, hangover_s=0.25, hangover_complete_s=0.15)
    rep = run_file(model, EnergyVAD(), FixedASR(text), ToneTTS(), path, None, cfg, tail_s=5)
    (tr,) = rep["turns"]
    assert tr["end_of_turn_rule"] == rule and tr["transcript"] == text
    assert hang <= tr["end_of_turn_s"] - tr["speech_end_s"] <= hang + 0.07
    assert tr["first_audio_s"] >= tr["end_of_turn_s"]  # never spoken before the end of turn


def test_short_hangover_off_and_validated(model, tmp_path):
    assert VoiceConfig().hangover_complete_s is None  # opt-in: it cut users who paused after a clause
    path = _wav(tmp_path, [(0.3, False), (1.0, True), (1.0, False)])
    cfg = VoiceConfig(system="be brief", max_new_tokens=8, hangover_complete_s=None)
    (tr,) = run_file(model, EnergyVAD(), FixedASR("Why is the sky blue?"), ToneTTS(), path, None, cfg, tail_s=5)["turns"]
    assert tr["end_of_turn_rule"] == "hangover" and tr["end_of_turn_s"] - tr["speech_end_s"] >= 0.25
    with pytest.raises(ValueError, match="must not exceed"):
        VoiceConfig(hangover_s=0.2, hangover_complete_s=0.3)
    with pytest.raises(ValueError, match="hangover_complete_s"):
        VoiceConfig(hangover_complete_s=-1)


def test_early_final_pass_starts_a_window_before_the_vad_says_silence(model, tmp_path):
    """The final pass starts in the lagging VAD's last 'voiced' window once its tail is quiet, one window (32 ms)
    before the VAD reports silence; the turn is the same."""
    path = _wav(tmp_path, [(0.3, False), (1.0, True), (1.0, False)])
    runs = {}
    for early in (True, False):
        cfg = VoiceConfig(system="be brief", max_new_tokens=8, early_final=early)
        (runs[early],) = run_file(model, LaggyVAD(), ScriptedASR(0.03), ToneTTS(), path, None, cfg, tail_s=5)["turns"]
    assert runs[True]["early_finals"] == 1 and runs[False]["early_finals"] == 0
    assert runs[True]["speculative_restarts"] == runs[False]["speculative_restarts"] == 0
    assert runs[True]["transcript"] == runs[False]["transcript"] == "a question of 0.9 seconds"  # 0.4 sine: 92 % of samples above 0.05
    assert runs[True]["final_start_s"] < runs[False]["final_start_s"]
    assert runs[True]["end_of_turn_s"] == runs[False]["end_of_turn_s"]  # the end of turn is not moved


def test_early_final_pass_is_abandoned_when_speech_goes_on(model, tmp_path):
    """A quiet tail inside the speech (a 40 ms gap) starts an early final pass; the next voiced window cancels it
    and the answer covers both parts."""
    path = _wav(tmp_path, [(0.3, False), (0.6, True), (0.04, False), (0.6, True), (1.0, False)])
    cfg = VoiceConfig(system="be brief", max_new_tokens=8)
    (tr,) = run_file(model, LaggyVAD(), ScriptedASR(0.03), ToneTTS(), path, None, cfg, tail_s=5)["turns"]
    assert tr["early_finals"] >= 2 and tr["speculative_restarts"] >= 1
    assert tr["transcript"] == "a question of 1.1 seconds"  # both parts (0.55 each)


def test_noise_bursts_are_not_turns(model, tmp_path):
    path = _wav(tmp_path, [(0.3, False), (0.064, True), (0.8, False)])
    assert _run(model, path, tmp_path)["turns"] == []


def test_barge_in_stops_the_reply_and_keeps_only_what_was_heard(model, tmp_path):
    """Speech during playback (file mode has no echo, so barge-in is on) cuts the reply within a window
    or two; the history keeps only the words that were played."""
    path = _wav(tmp_path, [(0.3, False), (0.8, True), (0.45, False), (0.6, True), (1.5, False)])
    rep = _run(model, path, tmp_path, per_word=0.5, barge_in=True, barge_in_s=0.1)
    assert len(rep["turns"]) == 2
    first = rep["turns"][0]
    assert first["interrupted"] and first["first_audio_s"] < 1.65
    out, rate = read_wav(tmp_path / "out.wav")
    loud = np.nonzero(np.abs(out) > 0.01)[0] / rate
    cut = 1.55 + 0.1  # speech resumes at 1.55 s; barge-in needs 0.1 s of it
    assert not np.any((loud > cut + 0.05) & (loud < rep["turns"][1]["first_audio_s"] - 0.01))


def test_wav_io_and_resampling(tmp_path):
    x = (0.5 * np.sin(np.arange(44100) * 2 * np.pi * 1000 / 44100)).astype(np.float32)
    write_wav(tmp_path / "a.wav", x, 44100)
    y, rate = read_wav(tmp_path / "a.wav")
    assert rate == 44100 and np.abs(y - x).max() < 1e-4
    z = resample(y, 44100, 16000)
    assert abs(len(z) - 16000) <= 2
    spec = np.abs(np.fft.rfft(z[2000:14000]))
    assert abs(np.argmax(spec) * 16000 / 12000 - 1000) < 5
    (tmp_path / "bad.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk")
    with pytest.raises(ValueError, match="no fmt or data"):
        read_wav(tmp_path / "bad.wav")
    with pytest.raises(ValueError, match="not a WAV"):
        read_wav(tmp_path / "a.wav.txt") if (tmp_path / "a.wav.txt").write_text("x") else None


def test_the_loop_tells_its_output_when_each_reply_ends(model, tmp_path, monkeypatch):
    """Live review: the service's and the voice toy's speaker sinks were never told that a reply had ended, so
    the silence after each reply counted as one speaker underrun; the loop now calls output.end_reply()."""
    from runtime.voice import filemode

    ends = []

    class Output(filemode.FileOutput):
        def end_reply(self):
            ends.append(self.clock())

    monkeypatch.setattr(filemode, "FileOutput", Output)
    path = _wav(tmp_path, [(0.4, False), (1.0, True), (1.2, False), (0.7, True), (0.6, False)])
    turns = _run(model, path, tmp_path)["turns"]
    assert len(turns) == 2 and len(ends) == 2, (turns, ends)
    assert turns[0]["first_audio_s"] < ends[0] < turns[1]["speech_start_s"] + 0.1 < ends[1]
