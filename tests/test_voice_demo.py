"""The voice toy (voice_demo/): persona validation, the wake phrase matcher, earcons, the content guard, the
face, and the toy on the voice loop in file mode: with scripted engines around the tiny LLM (push-to-talk
gating, forgetting after the idle timeout), and end to end through ``python -m voice_demo`` with the real
engines and SmolLM2 on espeak-ng speech (wake phrase gating, the earcon in the output, no stray files)."""
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import runtime
from runtime.voice.engines import SAMPLE_RATE, Transcript
from runtime.voice.filemode import read_wav, resample, write_wav
from voice_demo import persona as P
from voice_demo.earcons import TONES, earcon
from voice_demo.face import STATES, Face, render
from voice_demo.guard import ContentGuard, GuardedTTS
from voice_demo.wake import WakeGate, match_wake

from pulse import pulse  # noqa: F401,E402  (the private PulseAudio session fixture, for the live test)

ROOT = Path(__file__).resolve().parents[1]
SR = SAMPLE_RATE


# ---- personas ---------------------------------------------------------------------------------------
def test_shipped_personas_load():
    names = P.shipped()
    assert {"coco", "robo"} <= set(names)
    coco, robo = P.load_persona("coco"), P.load_persona("robo")
    assert coco.activation.mode == "wake" and coco.wake_phrase == "hey coco" and coco.voice.engine == "hibari"
    assert robo.activation.mode == "push_to_talk" and robo.activation.key == "space"
    assert coco.max_reply_tokens <= 64 and robo.max_reply_tokens <= 64  # short replies by default
    minimal = P.from_dict({"name": "Bo", "system_prompt": "Be kind."})
    assert minimal.wake_phrase == "hey Bo" and minimal.privacy.forget_after_s == 30 and minimal.earcons.enabled


BAD = [  # (YAML text, words the one-line error must contain)
    ("name: Bo\nsystem_prompt: hi\nvoise: {engine: hibari}\n", ["unknown key 'voise'", "voice"]),
    ("name: Bo\nsystem_prompt: hi\nactivation: {mode: wake, wakephrase: hey bo}\n",
     ["unknown key 'activation.wakephrase'", "wake_phrase"]),
    ("name: Bo\nsystem_prompt: hi\nmax_reply_tokens: '40'\n", ["max_reply_tokens", "an integer from 1 to 256", "str"]),
    ("name: Bo\nsystem_prompt: hi\nmax_reply_tokens: 5000\n", ["max_reply_tokens", "from 1 to 256", "5000"]),
    ("name: Bo\nsystem_prompt: hi\nearcons: {enabled: 'yes'}\n", ["earcons.enabled", "true or false"]),
    ("name: Bo\nsystem_prompt: hi\nearcons: on\n", ["earcons: expected a mapping"]),
    ("system_prompt: hi\n", ["missing key 'name'"]),
    ("name: Bo\nsystem_prompt: hi\nactivation: {mode: wake, key: space}\n", ["activation.key is for mode push_to_talk"]),
    ("name: Bo\nsystem_prompt: hi\nactivation: {mode: talk}\n", ["activation.mode", "wake or push_to_talk"]),
    ("name: Bo\nsystem_prompt: hi\nactivation: {mode: push_to_talk, key: ctrl}\n", ["activation.key", "printable"]),
    ("name: Bo\nsystem_prompt: hi\nvoice: {engine: nosuch}\n", ["voice.engine", "hibari"]),
    ("name: Bo\nsystem_prompt: hi\nvoice: {engine: piper, speed: 1.2}\n", ["voice.speed", "piper", "no speed"]),
    ("name: Bo\nsystem_prompt: hi\nvoice: {speed: .nan}\n", ["voice.speed", "from 0.5 to 2"]),
    ("name: Bo\nsystem_prompt: hi\nguard: {extra_words: gun}\n", ["guard.extra_words", "a list"]),
    ("name: Bo\nname: Al\nsystem_prompt: hi\n", ["duplicate key 'name'", "line 2"]),
    ("name: [Bo\nsystem_prompt: hi\n", ["not valid YAML", "line"]),
    ("- name: Bo\n", ["expected a mapping"]),
]


@pytest.mark.parametrize("text,words", BAD, ids=[w[0] for _, w in BAD])
def test_persona_errors_are_one_line_naming_the_key(tmp_path, text, words):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(P.PersonaError) as e:
        P.load_persona(str(f))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(f)), msg
    for w in words:
        assert w in msg, msg


def test_persona_lookup_errors(tmp_path):
    with pytest.raises(P.PersonaError, match="no persona 'nosuch': the shipped ones are .*coco"):
        P.load_persona("nosuch")
    with pytest.raises(P.PersonaError, match="cannot read persona"):
        P.load_persona(str(tmp_path / "missing.yaml"))
    with pytest.raises(P.PersonaError, match="not a regular file"):
        P.load_persona(str(tmp_path) + "/")
    os.mkfifo(tmp_path / "fifo.yaml")
    with pytest.raises(P.PersonaError, match="not a regular file"):  # refused, not waited on
        P.load_persona(str(tmp_path / "fifo.yaml"))
    (tmp_path / "big.yaml").write_text("#" * (P.MAX_PERSONA_BYTES + 10))
    with pytest.raises(P.PersonaError, match="larger than"):
        P.load_persona(str(tmp_path / "big.yaml"))


def test_cli_refuses_a_bad_persona_in_one_line_before_loading_anything(tmp_path):
    (tmp_path / "bad.yaml").write_text("name: Bo\nsystem_prompt: hi\nmax_reply_tokens: lots\n")
    (tmp_path / "in.wav").write_bytes(b"")
    for argv, want in ((["--persona", "bad.yaml", "--input-wav", "in.wav"], "max_reply_tokens: expected an integer"),
                       (["--output-wav", "o.wav"], "for file mode"),
                       (["--persona", "robo", "--input-wav", "in.wav"], "give --press-at"),
                       (["--press-at", "1", "--input-wav", "in.wav"], "for push_to_talk personas"),
                       (["--persona", "robo"], "standard input is not one")):  # live push-to-talk, no terminal
        r = subprocess.run([sys.executable, "-m", "voice_demo", *argv], cwd=tmp_path, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60, stdin=subprocess.DEVNULL)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("voice_demo: error: "), r.stderr
        assert want in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml", "in.wav"]


# ---- wake phrase, earcons, guard, face -----------------------------------------------------------------
@pytest.mark.parametrize("heard,question", [
    ("Hey, Coco! What color is the sky?", "What color is the sky?"),
    ("hey coco what color is the sky", "what color is the sky"),
    ("Hey Koko, why is grass green?", "why is grass green?"),  # an ASR slip in the name
    ("Um, hey Coco, tell me a story.", "tell me a story."),  # a word before it
    ("Heycoco, sing", "sing"),  # merged by the ASR
    ("Hey Coco.", ""),  # the phrase alone
    ("What color is the sky?", None),
    ("Hey you, what color is the sky?", None),
    ("I told my sister that Coco said hey", None),  # the name, but not at the start
    ("", None),
    ("Hey, co-co, hi", "hi"),  # split by the ASR
    # near misses (Whisper's transcripts of espeak-ng saying them): they look like it but do not sound like it,
    # or sound like it but do not look like it
    ("Hey, look, a dog!", None),
    ("Hey Coach, can we play?", None),
    ("Hey, momo. What color is the sky?", None),
    ("Hey, go get the ball.", None),
    ("Hey Google, what time is it?", None),
])
def test_match_wake(heard, question):
    """Regression: matching on spelling alone (difflib ratio >= 0.75) woke the toy for "Hey, look, a dog!",
    "Hey Coach" and "Hey, momo" (7 of 14 near misses); the phrase must now sound like it too."""
    assert match_wake(heard, "hey coco") == question


def test_match_wake_exact_threshold():
    assert match_wake("Hey Koko, hi", "hey coco", threshold=1.0) is None
    assert match_wake("Hey, Coco, hi", "hey coco", threshold=1.0) == "hi"


def _freq(x, rate):
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return np.argmax(spec) * rate / len(x)


def test_earcons_are_two_tones_that_rise_or_fall():
    for kind, (a, b) in TONES.items():
        x = earcon(kind, 24000, volume=0.3)
        assert x.dtype == np.float32 and 0.15 < len(x) / 24000 < 0.3 and abs(np.abs(x).max() - 0.3) < 0.01
        assert abs(x[0]) < 1e-3 and abs(x[-1]) < 1e-3  # faded: no click
        assert abs(_freq(x[240:1920], 24000) - a) < 15 and abs(_freq(x[-1920:-240], 24000) - b) < 15
    assert TONES["listen"][0] < TONES["listen"][1] and TONES["sleep"][0] > TONES["sleep"][1]
    with pytest.raises(ValueError, match="unknown earcon"):
        earcon("boop", 16000)


class RecordingTTS:
    name, sample_rate = "rec", 16000

    def __init__(self):
        self.said = []

    def warmup(self):
        pass

    def synthesize(self, text):
        self.said.append(text)
        return np.full(100, 0.1, np.float32)


def test_guard_blocks_whole_words_and_mutes_the_rest_of_the_reply():
    g = ContentGuard(extra_words=["broccoli"], redirect="Let's play a game!")
    assert g.blocked("To make a bomb, you need") == "bomb"
    assert g.blocked("I will KILL it") == "KILL" and g.blocked("killers") == "killers"  # kill*
    assert g.blocked("Where, do you live?") == "Where, do you live"  # a phrase, punctuation between words
    assert g.blocked("Broccoli is green") == "Broccoli"  # the persona's own word
    for fine in ("The sky is blue.", "What a skill!", "Hello there", "a stable horse", "a shooting star"):
        assert g.blocked(fine) is None, fine
    inner = RecordingTTS()
    tts = GuardedTTS(inner, g)
    assert len(tts.synthesize("The sky is blue.")) == 100
    assert len(tts.synthesize("You can make a bomb,")) == 100  # said: the redirect instead
    assert len(tts.synthesize("with some powder.")) == 0  # the rest of that reply: nothing
    assert inner.said == ["The sky is blue.", "Let's play a game!"] and tts.blocked == ["bomb"]
    assert " ".join(tts.spoken) == "The sky is blue. Let's play a game!"
    tts.new_reply()
    assert len(tts.synthesize("Hello!")) == 100 and tts.blocked == []


def test_face_render_per_state():
    faces = {s: render(s, "Coco") for s in STATES}
    assert len({tuple(f[:4]) for f in faces.values()}) == len(STATES)  # each state its own face
    assert all(len(f) == 5 for f in faces.values())
    assert faces["sleeping"][4] == "  Coco is asleep" and "hears you" in faces["hearing"][4]
    assert "(say hey coco)" in render("sleeping", "Coco", hint="say hey coco")[4]
    with pytest.raises(ValueError, match="unknown face state"):
        render("dancing", "Coco")


def test_face_plain_lines_when_not_a_tty():
    out = io.StringIO()
    f = Face("Coco", out)
    assert not f.tty
    for s in ("sleeping", "sleeping", "hearing", "thinking", "speaking", "listening"):
        f.show(s)
    f.say("coco: The sky is blue.")
    assert out.getvalue().splitlines() == ["[coco] sleeping", "[coco] hearing", "[coco] thinking", "[coco] speaking",
                                           "[coco] listening", "coco: The sky is blue."]


def test_face_redraws_in_place_on_a_tty():
    out = io.StringIO()
    f = Face("Coco", out, tty=True)
    f.show("sleeping")
    first = out.getvalue()
    assert first.startswith("\x1b[J") and first.count("\n") == 5  # nothing to move up over yet
    f.show("speaking")
    second = out.getvalue()[len(first):]
    assert second.startswith("\x1b[5F\x1b[J")  # back up over the 5 lines drawn, clear, draw
    assert "\n".join(render("speaking", "Coco")) in second
    f.say("you: hi")
    assert out.getvalue()[len(first) + len(second):].startswith("\x1b[5F\x1b[J")
    assert out.getvalue().endswith("you: hi\n")
    f.say("coco: " + "la " * 200)  # longer than the terminal: cut to one row, so the redraw stays in place
    last = out.getvalue().splitlines()[-1]
    assert last.endswith("...") and len(last) < 400


# ---- the toy in file mode with scripted engines around the tiny LLM ------------------------------------
class EnergyVAD:
    name = "energy"

    def reset(self):
        pass

    def __call__(self, window):
        return 1.0 if np.sqrt((window.astype(np.float64) ** 2).mean()) > 0.01 else 0.0


class ScriptedASR:
    """Hears each tone burst as the next line of ``lines``."""
    name = "scripted"

    def __init__(self, lines):
        self.lines, self.n = list(lines), 0

    def reset(self):
        self.n += 1

    def warmup(self):
        pass

    def transcribe(self, audio):
        time.sleep(0.03)
        return Transcript(text=self.lines[min(self.n, len(self.lines)) - 1])


class ToneTTS:
    name, sample_rate = "tone", 24000

    def warmup(self):
        pass

    def synthesize(self, text):
        n = int(0.03 * len(text.split()) * self.sample_rate) + 1
        return (0.3 * np.sin(np.arange(n) * 2 * np.pi * 300 / self.sample_rate)).astype(np.float32)


def _tone_wav(path, parts):
    """parts: [(seconds, voiced?)]: a 220 Hz tone for speech, zeros for silence."""
    x = np.concatenate([0.4 * np.sin(np.arange(int(s * SR)) * 2 * np.pi * 220 / SR) if v else np.zeros(int(s * SR))
                        for s, v in parts]).astype(np.float32)
    write_wav(path, x, SR)
    return path


@pytest.fixture()
def tiny(tiny_artifacts):
    return runtime.load(tiny_artifacts["native"])


def _persona(**over):
    d = {"name": "Coco", "system_prompt": "Be brief.", "max_reply_tokens": 8}
    for k, v in over.items():
        d[k] = v
    return P.from_dict(d)


def _run(model, persona, wav, lines, tmp_path, presses=()):
    from voice_demo.run import run_file

    return run_file(model, EnergyVAD(), ScriptedASR(lines), ToneTTS(), persona, wav, tmp_path / "out.wav",
                    presses=presses, tail_s=5)


@pytest.mark.parametrize("forget_after_s", [1.0, 30.0])
def test_history_is_forgotten_after_the_idle_timeout(tiny, tmp_path, monkeypatch, forget_after_s):
    """Two questions 3 s apart: with forget_after_s 1 the model is asked the second with no trace of the first,
    neither in the messages nor in the KV cache (rewound to the system prompt); with 30 it sees both."""
    asked = []  # (messages' contents, tokens cached in the session) of every chat call
    chat = runtime.session.Session.chat

    def spy(self, messages, *a, **kw):
        asked.append(([m["content"] for m in messages], len(self.cache)))
        return chat(self, messages, *a, **kw)

    monkeypatch.setattr(runtime.session.Session, "chat", spy)
    wav = _tone_wav(tmp_path / "in.wav", [(0.3, False), (0.5, True), (2.7, False), (0.5, True), (0.6, False)])
    persona = _persona(activation={"follow_up_s": 0.3}, privacy={"forget_after_s": forget_after_s},
                       earcons={"enabled": False})
    rep = _run(tiny, persona, wav, ["hey coco, first question", "hey coco, second question"], tmp_path)
    assert [t["transcript"] for t in rep["turns"]] == ["first question", "second question"], rep["turns"]
    forgot = [e["t"] for e in rep["events"] if e["event"] == "forgot the conversation"]
    msgs, cached = [a for a in asked if a[0][-1] == "second question"][-1]
    system_tokens = len(tiny.new_session().chat_ids([{"role": "system", "content": "Be brief."}], False))
    if forget_after_s < 2:
        assert msgs == ["Be brief.", "second question"] and rep["remembered_messages"] == 2
        assert cached <= system_tokens + 8  # the system prompt (and at most a partial prefill of the question)
        assert len(forgot) == 1 and rep["turns"][0]["reply_done_s"] < forgot[0] < rep["turns"][1]["speech_start_s"]
        assert forgot[0] - rep["turns"][0]["reply_done_s"] >= forget_after_s - 0.1
    else:
        assert msgs[:2] == ["Be brief.", "first question"] and len(msgs) == 4 and rep["remembered_messages"] == 4
        assert cached > system_tokens + 8 and forgot == []


def test_push_to_talk_opens_the_mic_once_per_press(tiny, tmp_path):
    """Speech before any press and after the answered one is not heard; the press plays the listen earcon and
    the mic opens only once it has ended."""
    wav = _tone_wav(tmp_path / "in.wav", [(0.2, False), (0.5, True), (0.8, False), (0.6, True), (0.8, False),
                                          (0.5, True), (0.6, False)])
    persona = P.from_dict({"name": "Robo", "system_prompt": "Be brief.", "max_reply_tokens": 8,
                           "activation": {"mode": "push_to_talk", "key": "space"}})
    rep = _run(tiny, persona, wav, ["one", "two", "three"], tmp_path, presses=[1.0])
    assert len(rep["turns"]) == 1 and rep["turns"][0]["transcript"] == "one"  # the first utterance it heard
    tr = rep["turns"][0]
    assert 1.5 - 0.1 < tr["speech_start_s"] < 1.5 + 0.1 and tr["reply_text"]
    ev = [(e["t"], e["event"]) for e in rep["events"]]
    assert ev[:2] == [(pytest.approx(1.024, abs=0.04), "earcon listen"), (pytest.approx(1.024, abs=0.04), "mic open (key)")]
    out, rate = read_wav(tmp_path / "out.wav")
    t0 = ev[0][0]
    assert abs(_freq(out[int((t0 + 0.01) * rate):int((t0 + 0.08) * rate)], rate) - TONES["listen"][0]) < 20
    assert abs(_freq(out[int((t0 + 0.12) * rate):int((t0 + 0.19) * rate)], rate) - TONES["listen"][1]) < 20
    assert np.abs(out[: int(t0 * rate)]).max() == 0  # nothing before the press


def test_wake_gate_passes_only_woken_or_follow_up_utterances():
    asr = ScriptedASR(["What color is the sky?"])
    asr.n = 1
    gate = WakeGate(asr, "hey coco")
    gate.begin(awake=False)
    assert gate.transcribe(np.zeros(SR, np.float32)).text == "" and gate.heard.raw == "What color is the sky?"
    gate.begin(awake=True)  # a follow-up: no phrase needed
    assert gate.transcribe(np.zeros(SR, np.float32)).text == "What color is the sky?"
    asr.lines = ["Hey Coco, why?"]
    gate.begin(awake=False)
    assert gate.transcribe(np.zeros(SR, np.float32)).text == "why?" and gate.heard.woke
    assert WakeGate(asr, None).transcribe(np.zeros(SR, np.float32)).text == "Hey Coco, why?"  # push-to-talk


# ---- end to end: python -m voice_demo on espeak-ng speech, the real engines and SmolLM2 ---------------
def _espeak(text, tmp_path):
    path = tmp_path / "espeak.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-w", str(path), text], check=True, capture_output=True)
    x, rate = read_wav(path)
    path.unlink()
    return resample(x, rate, SR)


def _files(root: Path) -> set:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} if root.exists() else set()


@pytest.mark.voice
@pytest.mark.slow
def test_wake_phrase_gates_replies_end_to_end(real_artifacts, tmp_path):
    """A question without the wake phrase gets no reply; "hey coco, what color is the sky?" does, at once (no
    listen earcon before an answer: it delayed every answer by 200 ms); nothing is written besides the files
    asked for."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng)")
    pytest.importorskip("hibari", reason="needs the voice extra: pip install 'boardtalk[voice]'")
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir(), tmp.mkdir()
    gap = np.zeros(int(1.5 * SR), np.float32)
    x = np.concatenate([gap[: SR // 2], _espeak("What color is the sky?", tmp_path), gap,
                        _espeak("Hey Coco, what color is the sky?", tmp_path), gap[:SR]])
    write_wav(work / "in.wav", x, SR)
    from runtime.voice.assets import asset, asset_dir, voice_cache

    asset("silero_vad.onnx"), asset_dir("whisper-tiny-en")  # the engines' models, in the shared cache first
    # a cache of its own (other processes write to the shared one); the voice models read from the shared one
    cache = tmp_path / "cache"
    cache.mkdir()
    r = subprocess.run([sys.executable, "-m", "voice_demo", "--artifact", str(real_artifacts["native"]),
                        "--input-wav", "in.wav", "--output-wav", "out.wav", "--report-json", "r.json"],
                       cwd=work, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp), "BOARDTALK_CACHE": str(cache),
                            "BOARDTALK_VOICE_ASSETS": str(voice_cache())})
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in work.iterdir()) == ["in.wav", "out.wav", "r.json"]  # nothing else
    # `import onnxruntime` itself writes $TMPDIR/.ses (its embedded telemetry SDK's session file: a launch time
    # and a random id, nothing of ours); anything else there would be the toy's
    assert _files(tmp) <= {".ses"}
    if (tmp / ".ses").exists():
        assert re.fullmatch(r"\d+\n[0-9a-f-]{36}\n", (tmp / ".ses").read_text())
    assert all(f.endswith(".lock") for f in _files(cache)), _files(cache)
    rep = json.loads((work / "r.json").read_text())
    why = json.dumps({k: rep[k] for k in ("turns", "events")}, indent=None)[:3000]
    # the first question: heard, not answered. Then the wake phrase, either with the question in one turn or
    # (when the ASR/VAD cut at the comma) alone in one turn and the question as a follow-up in the next
    first, *rest = rep["turns"]
    assert "color" in first["heard"].lower() and not first["woke"] and first["reply_text"] == "", why
    assert 1 <= len(rest) <= 2 and rest[0]["woke"] and all(not t["woke"] for t in rest[1:]), why
    answer = rest[-1]
    assert "color" in answer["transcript"].lower() and answer["reply_text"], why
    assert "coco" not in answer["transcript"].lower(), why  # the loop got the question only
    assert r.stdout.strip() == answer["reply_text"]
    earcons = [e["t"] for e in rep["events"] if e["event"] == "earcon listen"]
    out, rate = read_wav(work / "out.wav")
    if len(rest) == 1:  # wake phrase and question in one breath: answered at once, no beep first
        assert earcons == [], why
        t0 = answer["first_audio_s"]
        assert np.abs(out[: int(t0 * rate) - 1]).max() < 1e-3  # the first question got nothing at all
        assert np.abs(out[int(t0 * rate):int((t0 + 0.5) * rate)]).max() > 0.05  # the reply from first_audio_s
    else:  # the phrase alone (cut at the comma): the listen earcon, then the question as a follow-up
        assert len(earcons) == 1 and rest[0]["end_of_turn_s"] - 0.05 <= earcons[0] <= rest[0]["end_of_turn_s"] + 1.0, why
        t0 = earcons[0]
        assert np.abs(out[: int(t0 * rate) - 1]).max() < 1e-3  # the first question got nothing at all
        assert abs(_freq(out[int((t0 + 0.01) * rate):int((t0 + 0.08) * rate)], rate) - TONES["listen"][0]) < 20
        assert abs(_freq(out[int((t0 + 0.12) * rate):int((t0 + 0.19) * rate)], rate) - TONES["listen"][1]) < 20
        assert np.abs(out[int(max(t0 + 0.25, answer["first_audio_s"]) * rate):]).max() > 0.05  # then the reply
    lines = r.stderr.splitlines()
    assert "[coco] sleeping" in lines and "[coco] speaking" in lines and lines[-1] == "[coco] listening"


def test_key_reader_on_a_terminal_and_refusal_without_one():
    """Push-to-talk reads its key from a terminal in cbreak mode and restores the terminal afterwards."""
    import termios

    from voice_demo.run import KeyReader

    master, slave = os.openpty()
    with open(slave, "rb", buffering=0, closefd=False) as tty:
        before = termios.tcgetattr(slave)
        with KeyReader("space", tty) as keys:
            assert not termios.tcgetattr(slave)[3] & termios.ICANON  # cbreak: keys arrive without Enter
            os.write(master, b"x x ")
            deadline = time.monotonic() + 5
            got = []
            while len(got) < 2 and time.monotonic() < deadline:
                got += keys.drain()
                time.sleep(0.02)
        assert len(got) == 2  # the two spaces, not the x's
        assert termios.tcgetattr(slave) == before
    os.close(master), os.close(slave)
    with pytest.raises(ValueError, match="push_to_talk needs a terminal"):
        with KeyReader("space", io.StringIO()):
            pass


@pytest.mark.voice
@pytest.mark.slow
def test_live_on_virtual_devices(pulse, real_artifacts, tmp_path, caplog):
    """Live mode on the private PulseAudio's virtual microphone and speaker: "hey coco, what color is the sky?"
    played into the microphone is answered on the speaker, at once (no earcon before an answer)."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng)")
    import threading

    from pulse import read_raw_f32
    from runtime.voice.engines import open_engine
    from voice_demo.run import run_live

    model = runtime.load(real_artifacts["native"], threads=1)
    vad, asr, tts = open_engine("vad"), open_engine("asr"), open_engine("tts")
    asr.warmup(), tts.warmup()
    q = np.concatenate([_espeak("Hey Coco, what color is the sky?", tmp_path), np.zeros(SR // 2, np.float32)])
    write_wav(tmp_path / "q.wav", q, SR)
    out, stop, ready = io.StringIO(), threading.Event(), threading.Event()
    face = Face("Coco", out, tty=False)
    caplog.set_level(logging.DEBUG, logger="voice_demo")
    th = threading.Thread(target=run_live, args=(model, vad, asr, tts, P.load_persona("coco"), "virtual_mic",
                                                 "speaker", face, stop, ready))
    rec = pulse.record_speaker(tmp_path / "spk.raw")
    th.start()
    try:
        assert ready.wait(20), "no microphone window in 20 s"
        time.sleep(0.5)
        pulse.play_into_mic(tmp_path / "q.wav", wait=True)
        deadline = time.monotonic() + 40  # generous: the machine is shared; it ends as soon as the toy is done
        while "[coco] listening" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.3)
    finally:
        stop.set()
        th.join(10)
        rec.terminate(), rec.wait(5)
    lines = out.getvalue().splitlines()
    assert "[coco] speaking" in lines and lines[-1] == "[coco] listening", (lines, caplog.text)
    assert any(line.startswith("coco: ") and len(line) > 7 for line in lines), lines
    y = read_raw_f32(tmp_path / "spk.raw")
    loud = np.nonzero(np.abs(y) > 0.05)[0]
    assert len(loud), "nothing was played"
    t0 = loud[0] / SR  # the reply, said at once
    assert np.abs(y[int((t0 + 0.3) * SR):]).max() > 0.05


@pytest.mark.voice
def test_ctrl_c_exits_130_without_a_traceback(tiny_artifacts, tmp_path):
    pytest.importorskip("hibari", reason="needs the voice extra: pip install 'boardtalk[voice]'")
    write_wav(tmp_path / "in.wav", np.zeros(30 * SR, np.float32), SR)
    (tmp_path / "bo.yaml").write_text("name: Bo\nsystem_prompt: Be brief.\nmax_reply_tokens: 8\n")
    p = subprocess.Popen([sys.executable, "-m", "voice_demo", "--artifact", str(tiny_artifacts["native"]),
                          "--persona", "bo.yaml", "--input-wav", "in.wav"], cwd=tmp_path, stderr=subprocess.PIPE,
                         text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = ""
        while "[bo] sleeping" not in line:  # running: the toy is waiting for its wake phrase
            line = p.stderr.readline()
            assert line, "voice_demo ended before it was running"
        p.send_signal(2)  # SIGINT, as Ctrl-C
        err = p.stderr.read()
        assert p.wait(30) == 130
    finally:
        p.kill() if p.poll() is None else None
    assert err.strip().splitlines() == ["voice_demo: interrupted"], err
    assert sorted(x.name for x in tmp_path.iterdir()) == ["bo.yaml", "in.wav"]


@pytest.mark.voice
@pytest.mark.slow
def test_live_missing_microphone_is_retried_not_a_crash(pulse, tiny_artifacts):
    """The toy starts with no microphone: it says so, keeps running, and takes windows once it appears."""
    import threading

    from runtime.voice.engines import open_engine
    from voice_demo.run import run_live

    model = runtime.load(tiny_artifacts["native"])
    out, stop, ready = io.StringIO(), threading.Event(), threading.Event()
    pulse.remove_mic()
    th = threading.Thread(target=run_live, args=(model, open_engine("vad"), ScriptedASR(["hi"]), ToneTTS(),
                                                 _persona(), "virtual_mic", "speaker",
                                                 Face("Coco", out, tty=False), stop, ready))
    th.start()
    try:
        deadline = time.monotonic() + 10
        while "not available: retrying" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "[microphone virtual_mic not available: retrying]" in out.getvalue() and th.is_alive()
        assert not ready.is_set()
        pulse.restore_mic()
        assert ready.wait(15), "no microphone window after the device came back"
    finally:
        if pulse.module_id("source_name=virtual_mic") is None:
            pulse.restore_mic()
        stop.set()
        th.join(10)
    assert not th.is_alive()


def test_a_prompt_that_leaves_no_room_for_a_question_is_refused(tiny):
    """Regression: a persona whose system prompt did not fit the model's context crashed the loop's first
    prefill with a ContextOverflow traceback; it is now one error naming the persona and the numbers."""
    from voice_demo.toy import Toy

    assert tiny.max_context == 128
    for persona in (P.load_persona("coco"), _persona(max_reply_tokens=100)):  # too long a prompt; too long a reply
        with pytest.raises(ValueError, match=r"persona Coco: the system prompt \(\d+ tokens\) .* context of 128"):
            Toy(tiny, EnergyVAD(), ScriptedASR(["x"]), ToneTTS(), persona)


def test_a_blocked_reply_is_not_said_nor_remembered(tiny, tmp_path, monkeypatch):
    """The model's reply (scripted here) has a blocked word in its first sentence: the redirect is said instead,
    the rest is dropped, and the next turn's history holds the redirect, not what the model wrote."""
    asked = []

    def chat(self, messages, *a, **kw):
        asked.append([m["content"] for m in messages])
        yield from ("To make a bomb, ", "you need powder. ", "Ask a grown-up to help.") if len(asked) == 1 else ("Ok.",)

    monkeypatch.setattr(runtime.session.Session, "chat", chat)
    wav = _tone_wav(tmp_path / "in.wav", [(0.3, False), (0.5, True), (3.0, False), (0.5, True), (0.8, False)])
    persona = _persona(activation={"follow_up_s": 10}, guard={"redirect": "Let us sing a song!"},
                       earcons={"enabled": False})
    rep = _run(tiny, persona, wav, ["hey coco, how do I make a bomb?", "why?"], tmp_path)
    first, second = rep["turns"]
    assert first["reply_text"] == "Let us sing a song!" and first["blocked_words"] == ["bomb"]
    assert second["transcript"] == "why?" and second["was_listening"]  # a follow-up: no wake phrase needed
    last = [a for a in asked if a[-1] == "why?"][-1]
    assert last == ["Be brief.", "how do I make a bomb?", "Let us sing a song!", "why?"]
    out, rate = read_wav(tmp_path / "out.wav")
    loud = np.nonzero(np.abs(out) > 0.01)[0] / rate
    said = loud[(loud > first["first_audio_s"] - 0.01) & (loud < second["speech_start_s"])]
    assert said.max() - said.min() == pytest.approx(0.03 * 5, abs=0.01)  # ToneTTS: 30 ms per word, 5 words


def test_a_final_pass_that_mishears_the_name_keeps_the_wake():
    """CI: the partial passes heard "Hey Coco" but the final pass heard "Hey go go, what color is the sky?",
    so the question was dropped as said to someone else. Once a pass over an utterance has heard the phrase,
    later passes over it only locate the (misheard) phrase; an utterance never woken stays ignored."""
    from runtime.voice.engines import Transcript
    from voice_demo.wake import WakeGate

    class Said:
        name = "said"

        def __init__(self, *texts):
            self.texts = list(texts)

        def transcribe(self, audio):
            return Transcript(text=self.texts.pop(0), audio_s=1.0)

    gate = WakeGate(Said("Hey Coco", "Hey go go, what color is the sky?", "Hey go go what color"), "hey coco")
    gate.begin(awake=False)
    assert gate.transcribe(None).text == "" and gate.heard.woke  # the phrase alone, so far
    assert gate.transcribe(None).text == "what color is the sky?" and gate.heard.woke
    assert gate.transcribe(None).text.endswith("what color") and gate.heard.woke
    gate = WakeGate(Said("Hey go go, what color is the sky?"), "hey coco")
    gate.begin(awake=False)
    assert gate.transcribe(None).text == "" and not gate.heard.woke  # never heard as the phrase: not woken
    gate = WakeGate(Said("Hey Coco", "Hey go go, what color?"), "hey coco")
    gate.begin(awake=False)
    assert gate.transcribe(None).text == "" and gate.heard.woke
    gate.begin(awake=False)  # a new utterance does not inherit the last one's wake
    assert gate.transcribe(None).text == "" and not gate.heard.woke


def test_the_toy_tells_its_speaker_when_each_reply_ends(tiny, tmp_path, monkeypatch):
    """Review: ToySink wrapped the speaker sink without passing on the loop's end_reply(), so live the end of
    every reply still counted as one speaker underrun."""
    from runtime.voice import filemode
    from voice_demo import run

    ends = []

    class Output(filemode.FileOutput):
        def end_reply(self):
            ends.append(self.clock())

    monkeypatch.setattr(run, "FileOutput", Output)
    wav = _tone_wav(tmp_path / "in.wav", [(0.2, False), (0.5, True), (0.8, False), (0.6, True), (0.8, False),
                                          (0.5, True), (0.6, False)])
    persona = P.from_dict({"name": "Robo", "system_prompt": "Be brief.", "max_reply_tokens": 8,
                           "activation": {"mode": "push_to_talk", "key": "space"}})
    rep = _run(tiny, persona, wav, ["one", "two", "three"], tmp_path, presses=[1.0])
    assert len(rep["turns"]) == 1 and len(ends) == 1 and ends[0] > rep["turns"][0]["first_audio_s"]
