#!/usr/bin/env python3
"""The voice loop's latency, per stage, against the targets and a naive stack, on one set of utterances.

    python scripts/voice_bench.py                          # espeak-ng voices + human clips, if installed
    python scripts/voice_bench.py --wav a.wav --ref "What is it?"   # your own recordings (one utterance each)
    python scripts/voice_bench.py --svg docs/voice-timeline.svg --json out.json --md table.md

Utterances: the questions spoken by espeak-ng in several voices and speeds, questions with a pause in the
middle (to count premature cuts: an utterance answered as two turns), and real human speech from Debian's
``pocketsphinx-testdata`` (BSD-2: five LibriVox sentences, five card names, "go forward ten meters";
``apt install pocketsphinx-testdata``; skipped when absent). Each is played with 0.5 s of silence before
and 0.8 s after, at real-time pace, through file mode (the full loop: Silero VAD, Whisper tiny.en trimmed,
the LLM, hibari TTS), once per loop variant, the variants interleaved clip by clip so that they share the
machine's load:

- ``boardtalk``: the defaults (250 ms hangover; final pass started early on a quiet window tail);
- ``adaptive-hangover``: the same with hangover_complete_s=0.15 (150 ms after a complete sentence): its A/B;
- ``no-early-final``: the defaults with early_final=False (the final pass waits for a silent VAD window);
- ``naive``: what a straightforward stack does, measured in the same run on the same clip: wait for the
  end of turn (the same VAD and 250 ms hangover), then Whisper on a mel padded to 30 s (faster-whisper's
  way), then the LLM on a fresh session (no partial prefill, no cached system prompt), then TTS of the
  whole first sentence once the LLM has written it. Its stages run one after another, each timed.

Prints per stage (ms after the end of speech = the last voiced sample) the median [min-max] per variant
against the issue's targets (first token <= 100 ms goal / 250 ms must; first audio <= 300 / 350 ms),
word error rates of the transcripts per kind of speech, premature cuts, speculative restarts.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "How many legs does a spider have?",
             "Tell me a fun fact about octopuses.", "What do bees make?", "Can you sing me a song?"]
VOICES = [("en-us", 160), ("en-gb", 140), ("en-us+f3", 180), ("en-gb+f3", 160)]  # espeak-ng voice, words/min
PAUSED = [("What is the capital of", "Italy?"), ("Remind me to call my sister", "tomorrow morning."),
          ("Can you tell me", "a joke about cats?"), ("Turn on the lights", "in the kitchen.")]
PAUSES_S = (0.2, 0.3)  # silence inside the paused questions (a user thinking mid-sentence)
HUMAN_DIR = Path("/usr/share/pocketsphinx/test/data")  # Debian package pocketsphinx-testdata (BSD-2)
TARGETS = {"first_token": (100, 250), "first_audio": (300, 350)}  # ms after speech end: goal, must
STAGES = ("final_start", "transcript", "first_token", "end_of_turn", "first_audio")
VARIANTS = ("boardtalk", "adaptive-hangover", "no-early-final", "naive")


@dataclass
class Clip:
    name: str
    kind: str  # "espeak", "espeak-pause", "human", "wav"
    ref: str  # what was said ("" = unknown: no WER)
    path: Path
    speech_end_s: float = 0.0  # where the speech really ends on the played clip's timeline (0.5 s lead)


# -- utterances ---------------------------------------------------------------------------------------------
def espeak(text: str, path: Path, voice: str = "en-us", speed: int = 160) -> Path:
    if not shutil.which("espeak-ng"):
        sys.exit("espeak-ng is needed to speak the questions (apt install espeak-ng), or pass --wav files")
    subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(path), text], check=True)
    return path


def _trimmed(path: Path) -> tuple[np.ndarray, int]:
    """The clip without its leading and trailing silence (espeak-ng adds some)."""
    from runtime.voice.filemode import read_wav

    x, rate = read_wav(path)
    loud = np.nonzero(np.abs(x) > 0.003)[0]  # -50 dBFS: keeps faint fricatives ("octopuses")
    return (x[loud[0] : loud[-1] + 1] if len(loud) else x), rate


LEAD_S = 0.5  # silence before each utterance, seconds


def padded(x: np.ndarray, rate: int, dst: Path, lead_s: float = LEAD_S, tail_s: float = 0.8) -> Path:
    from runtime.voice.filemode import write_wav

    z = lambda s: np.zeros(int(s * rate), np.float32)  # noqa: E731
    write_wav(dst, np.concatenate([z(lead_s), x, z(tail_s)]), rate)
    return dst


def _clip(name: str, kind: str, ref: str, x: np.ndarray, rate: int, dst: Path) -> Clip:
    """The clip, padded, and where its speech ends: the last 10 ms frame within 40 dB of the loudest one
    (a recording's noise floor is below that)."""
    n = rate // 100
    rms = np.sqrt((x[: len(x) // n * n].reshape(-1, n).astype(np.float64) ** 2).mean(1))
    loud = np.nonzero(rms > 0.01 * rms.max())[0]
    end = LEAD_S + ((loud[-1] + 1) * n if len(loud) else len(x)) / rate
    return Clip(name, kind, ref, padded(x, rate, dst), end)


def corpus(tmp: Path, human_dir: Path | None) -> list[Clip]:
    clips = []
    for voice, speed in VOICES:
        for i, q in enumerate(QUESTIONS):
            src = espeak(q, tmp / f"{voice}-{speed}-{i}.src.wav", voice, speed)
            clips.append(_clip(f"{voice}/{speed}/q{i}", "espeak", q, *_trimmed(src), tmp / f"{voice}-{speed}-{i}.wav"))
    for pause in PAUSES_S:
        for i, (a, b) in enumerate(PAUSED):
            xa, rate = _trimmed(espeak(a, tmp / f"p{i}a.wav"))
            xb, _ = _trimmed(espeak(b, tmp / f"p{i}b.wav"))
            x = np.concatenate([xa, np.zeros(int(pause * rate), np.float32), xb])
            clips.append(_clip(f"pause{pause:.1f}/p{i}", "espeak-pause", f"{a} {b}", x, rate, tmp / f"p{i}-{pause}.wav"))
    if human_dir is not None and (human_dir / "librivox" / "transcription").exists():
        from runtime.voice.filemode import read_wav

        for sub in ("librivox", "cards"):
            lines = (human_dir / sub / ("transcription" if sub == "librivox" else "cards.transcription")).read_text()
            for m in re.finditer(r"<s> (.*?)\s*</s> \((.*?)\)", lines):
                x, rate = read_wav(human_dir / sub / f"{m[2]}.wav")
                clips.append(_clip(f"{sub}/{m[2][-4:]}", "human", m[1], x, rate, tmp / f"h-{sub}-{m[2]}.wav"))
        raw = np.fromfile(human_dir / "goforward.raw", "<i2").astype(np.float32) / 32768  # 16 kHz mono PCM
        clips.append(_clip("goforward", "human", "go forward ten meters", raw, 16000, tmp / "goforward.wav"))
    return clips


# -- word error rate ----------------------------------------------------------------------------------------
_NUMBERS = dict(zip("0 1 2 3 4 5 6 7 8 9 10".split(), "zero one two three four five six seven eight nine ten".split()))


def words(text: str) -> list[str]:
    text = text.lower().replace("mr.", "mister").replace("-", " ")
    return [_NUMBERS.get(w, w) for w in re.sub(r"[^a-z0-9' ]+", " ", text).split()]


def word_errors(ref: str, hyp: str) -> tuple[int, int]:
    """(word-level Levenshtein distance, reference words) after lowercasing, dropping punctuation and
    spelling digits out."""
    r, h = words(ref), words(hyp)
    d = np.arange(len(h) + 1)
    for i, rw in enumerate(r, 1):
        prev, d[0] = d.copy(), i
        for j, hw in enumerate(h, 1):
            d[j] = min(prev[j] + 1, d[j - 1] + 1, prev[j - 1] + (rw != hw))
    return int(d[len(h)]), len(r)


# -- the naive stack ----------------------------------------------------------------------------------------
def naive_turn(path: Path, model, vad, asr_padded, tts, cfg) -> dict | None:
    """End of turn by the same VAD state machine (hangover_s, no speculation), then padded Whisper, a fresh
    LLM session, and TTS of the whole first sentence, one after the other. Times in s on the clip's
    timeline, the stages' wall times measured here."""
    from runtime.voice.engines import SAMPLE_RATE, VAD_WINDOW
    from runtime.voice.filemode import read_wav, resample
    from runtime.voice.pipeline import WINDOW_S, _last_loud

    x, rate = read_wav(path)
    x = resample(x, rate, SAMPLE_RATE)
    vad.reset()
    start = last_voiced = eot = None
    silence = 0.0
    for i in range(len(x) // VAD_WINDOW):
        w = x[i * VAD_WINDOW : (i + 1) * VAD_WINDOW]
        t, p = (i + 1) * WINDOW_S, vad(w)
        if start is None:
            if p >= cfg.vad_on:
                start, last_voiced, silence = t - WINDOW_S, t, 0.0
        elif p >= cfg.vad_off:
            last_voiced, silence = t - WINDOW_S + _last_loud(w) / SAMPLE_RATE, 0.0
        else:
            silence += WINDOW_S
            if silence >= cfg.hangover_s:
                eot = t
                break
    if start is None:
        return None
    eot = eot if eot is not None else len(x) / SAMPLE_RATE
    audio = x[max(0, int((start - cfg.preroll_s) * SAMPLE_RATE)) : int(eot * SAMPLE_RATE)]
    t0 = time.perf_counter()
    text = asr_padded.transcribe(audio).text.strip()
    transcript = eot + time.perf_counter() - t0
    session = model.new_session()
    import runtime

    msgs = [{"role": "system", "content": cfg.system}, {"role": "user", "content": text}]
    first_token = sentence = None
    reply = ""
    t0 = time.perf_counter()
    for delta in session.chat(msgs, runtime.GenerationConfig(max_new_tokens=cfg.max_new_tokens)):
        first_token = first_token or time.perf_counter() - t0
        reply += delta
        m = re.search(r"[.!?](\s|$)", reply)
        if m and len(reply.split()) >= 2:
            sentence = reply[: m.end()].strip()
            break
    written = time.perf_counter() - t0
    session.close()
    sentence = sentence or reply.strip()
    t1 = time.perf_counter()
    tts.synthesize(sentence or "Sorry.")
    tts_s = time.perf_counter() - t1
    return {"transcript": text, "reply_text": sentence, "speech_start_s": start, "speech_end_s": last_voiced,
            "final_start_s": eot, "transcript_final_s": transcript, "first_token_s": transcript + (first_token or 0),
            "end_of_turn_s": eot, "first_audio_s": transcript + written + tts_s, "speculative_restarts": 0,
            "partials": []}


def latencies(tr: dict) -> dict:
    e = tr["speech_end_s"]
    key = {"final_start": "final_start_s", "transcript": "transcript_final_s", "first_token": "first_token_s",
           "end_of_turn": "end_of_turn_s", "first_audio": "first_audio_s"}
    return {k: None if tr.get(v) is None else (tr[v] - e) * 1e3 for k, v in key.items()}


# -- report -------------------------------------------------------------------------------------------------
def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.0f} [{min(xs):.0f}-{max(xs):.0f}]" if xs else "-"


def summary(results: list[dict], variants: list[str]) -> str:
    """Markdown: per stage median [min-max] per variant against the targets; WER; cuts; restarts."""
    lines = ["| stage (ms after the end of speech) | " + " | ".join(variants) + " | target |",
             "|---|" + "---|" * (len(variants) + 1)]
    names = {"final_start": "final ASR pass starts", "transcript": "final transcript", "first_token": "first token",
             "end_of_turn": "end of turn confirmed", "first_audio": "first audio handed to the speaker"}
    for st in STAGES:
        cells = [_spread([lat[st] for r in results if r["variant"] == v for lat in [latencies(r["turns"][0])]
                          if r["turns"] and lat[st] is not None]) for v in variants]
        goal = TARGETS.get(st)
        lines.append(f"| {names[st]} | " + " | ".join(cells) + f" | {f'goal {goal[0]}, must {goal[1]}' if goal else ''} |")
    lines += ["", "| | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
    kinds = sorted({r["kind"] for r in results if r["ref"]})
    for kind in kinds:
        cells = []
        for v in variants:
            e = n = 0
            for r in results:
                if r["variant"] == v and r["kind"] == kind and r["ref"]:
                    de, dn = word_errors(r["ref"], " ".join(t["transcript"] for t in r["turns"]))
                    e, n = e + de, n + dn
            cells.append(f"{100 * e / max(n, 1):.1f} % ({e}/{n})")
        lines.append(f"| WER, {kind} | " + " | ".join(cells) + " |")
    for label, fn in (("premature cuts (a turn ended > 50 ms before the speaker finished)",
                       lambda r: any(t["end_of_turn_s"] < r["speech_end_s"] - 0.05 for t in r["turns"])),
                      ("premature cuts, of them on the short hangover",
                       lambda r: any(t["end_of_turn_s"] < r["speech_end_s"] - 0.05 and t.get("end_of_turn_rule") == "complete"
                                     for t in r["turns"])),
                      ("utterances with no turn", lambda r: not r["turns"]),
                      ("ended by the short (complete-sentence) hangover",
                       lambda r: any(t.get("end_of_turn_rule") == "complete" for t in r["turns"])),
                      ("speculative restarts (sum)", lambda r: sum(t["speculative_restarts"] for t in r["turns"])),
                      ("early final passes started (sum)", lambda r: sum(t.get("early_finals", 0) for t in r["turns"]))):
        cells = [str(sum(int(fn(r)) for r in results if r["variant"] == v)) for v in variants]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def svg_timeline(rows: list[tuple[str, dict]], path: Path) -> None:
    """One row per turn, time 0 = end of speech: speech, hangover, partial passes, final ASR pass (bar from
    its start to the transcript), first token, first audio, playback."""
    row = 26
    W, H, left = 1000, 70 + row * len(rows), 250
    t_min, t_max = -1.5, 1.0
    x = lambda t: left + (t - t_min) / (t_max - t_min) * (W - left - 20)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="10">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="10" y="16" font-size="13">voice turns (boardtalk defaults): time after the end of speech (s); '
           f'targets: first token {TARGETS["first_token"][0]} ms, first audio {TARGETS["first_audio"][0]} ms</text>']
    for k in range(int(t_min * 10), int(t_max * 10) + 1):
        t = k / 10
        out.append(f'<line x1="{x(t):.1f}" y1="40" x2="{x(t):.1f}" y2="{H - 14}" stroke="{"#888" if k == 0 else "#eee"}"/>')
        if k % 5 == 0:
            out.append(f'<text x="{x(t) - 10:.1f}" y="{H - 3}" fill="#666">{t:+.1f}</text>')
    for goal, color in ((TARGETS["first_token"][0], "#e6550d"), (TARGETS["first_audio"][0], "#31a354")):
        out.append(f'<line x1="{x(goal / 1e3):.1f}" y1="40" x2="{x(goal / 1e3):.1f}" y2="{H - 14}" stroke="{color}" '
                   'stroke-dasharray="4,3"/>')
    for i, (label, tr) in enumerate(rows):
        y = 44 + i * row
        e = tr["speech_end_s"]
        rel = lambda v: None if v is None else v - e  # noqa: E731
        clip = lambda t: min(t_max, max(t_min, t))  # noqa: E731
        out.append(f'<text x="6" y="{y + 13}">{_esc(label[:44])}</text>')
        s0 = clip(rel(tr["speech_start_s"]))
        out.append(f'<rect x="{x(s0):.1f}" y="{y + 3}" width="{x(0) - x(s0):.1f}" height="14" fill="#9ecae1"/>')
        eot, fa, done = rel(tr["end_of_turn_s"]), rel(tr["first_audio_s"]), rel(tr.get("reply_done_s"))
        if eot is not None:
            out.append(f'<rect x="{x(0):.1f}" y="{y + 7}" width="{x(clip(eot)) - x(0):.1f}" height="6" fill="#fdd0a2"/>')
        if fa is not None and fa < t_max:
            end = clip(done if done is not None else t_max)
            out.append(f'<rect x="{x(fa):.1f}" y="{y + 3}" width="{max(1.0, x(end) - x(fa)):.1f}" height="14" fill="#a1d99b"/>')
        fs, tf = rel(tr.get("final_start_s")), rel(tr["transcript_final_s"])
        if fs is not None and tf is not None:
            out.append(f'<rect x="{x(clip(fs)):.1f}" y="{y + 15}" width="{max(1.0, x(clip(tf)) - x(clip(fs))):.1f}" '
                       'height="4" fill="#756bb1"/>')
        for t, _ in tr.get("partials", []):
            if t_min <= t - e <= t_max:
                out.append(f'<line x1="{x(t - e):.1f}" y1="{y + 1}" x2="{x(t - e):.1f}" y2="{y + 19}" stroke="#3182bd" '
                           'stroke-dasharray="2,2"/>')
        t = rel(tr["first_token_s"])
        if t is not None and t_min <= t <= t_max:
            out.append(f'<circle cx="{x(t):.1f}" cy="{y + 10}" r="3.5" fill="#e6550d"/>')
    legend = [("speech", "#9ecae1"), ("silence to end of turn", "#fdd0a2"), ("final ASR pass", "#756bb1"),
              ("first token", "#e6550d"), ("partial pass done", "#3182bd"), ("reply playing", "#a1d99b")]
    for j, (name, color) in enumerate(legend):
        out.append(f'<rect x="{10 + j * 160}" y="24" width="10" height="10" fill="{color}"/>'
                   f'<text x="{24 + j * 160}" y="33">{name}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n", encoding="utf-8")


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def main() -> int:
    import runtime
    from runtime.voice.engines import open_engine
    from runtime.voice.filemode import run_file
    from runtime.voice.pipeline import VoiceConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", help="LLM artifact (default: the default artifact, which must exist)")
    ap.add_argument("--wav", action="append", help="a recording of one utterance (repeatable; replaces the built-in set)")
    ap.add_argument("--ref", action="append", help="what the --wav at the same position says, for WER (default: none)")
    ap.add_argument("--human-dir", default=str(HUMAN_DIR),
                    help="pocketsphinx-testdata's data directory ('' to skip; default: %(default)s)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, run interleaved per clip (default: %(default)s)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N clips (default: all)")
    ap.add_argument("--threads", type=int, default=1, help="LLM threads (default: %(default)s; ASR and TTS use one each)")
    ap.add_argument("--svg", help="write the timeline picture (boardtalk variant) here")
    ap.add_argument("--json", help="write every clip's turns here")
    ap.add_argument("--md", help="write the summary tables (markdown) here")
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or any(v not in VARIANTS for v in variants):
        sys.exit(f"--variants: choose from {', '.join(VARIANTS)}")
    model = runtime.load(args.artifact or runtime.default_artifact(), threads=args.threads)
    vad, asr, tts = open_engine("vad"), open_engine("asr"), open_engine("tts")
    padded_asr = open_engine("asr", "whisper-tiny-en-padded") if "naive" in variants else None
    for e in (asr, tts, padded_asr):
        if e is not None:
            e.warmup()
    base = dict(system="You are a friendly voice assistant. Answer in one short sentence.", max_new_tokens=48)
    configs = {"boardtalk": VoiceConfig(**base), "adaptive-hangover": VoiceConfig(**base, hangover_complete_s=0.15),
               "no-early-final": VoiceConfig(**base, early_final=False), "naive": VoiceConfig(**base)}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.wav:
            refs = (args.ref or []) + [""] * len(args.wav)
            clips = [_clip(Path(w).name, "wav", refs[i], *_trimmed(Path(w)), tmp / f"w{i}.wav")
                     for i, w in enumerate(args.wav)]
        else:
            clips = corpus(tmp, Path(args.human_dir) if args.human_dir else None)
        clips = clips[: args.limit] if args.limit else clips
        print(f"{len(clips)} clips x {len(variants)} variants")
        for clip in clips:
            for v in variants:
                if v == "naive":
                    tr = naive_turn(clip.path, model, vad, padded_asr, tts, configs[v])
                    turns = [tr] if tr else []
                else:
                    turns = run_file(model, vad, asr, tts, clip.path, None, configs[v], tail_s=3.0)["turns"]
                results.append({"clip": clip.name, "kind": clip.kind, "ref": clip.ref, "variant": v, "turns": turns,
                                "speech_end_s": clip.speech_end_s})
                lat = latencies(turns[0]) if turns else {}
                heard = " | ".join(t["transcript"] for t in turns)
                print(f"{clip.name:>22} {v:>14}: {heard[:44]!r:46} " + ", ".join(
                    f"{k} {val:.0f}" for k, val in lat.items() if val is not None) + f" ({len(turns)} turns)", flush=True)
    table = summary(results, variants)
    print("\n" + table)
    if args.md:
        Path(args.md).write_text(table + "\n", encoding="utf-8")
    if args.svg:
        rows = [(f"{r['clip']}: {t['transcript']}", t) for r in results if r["variant"] == variants[0] for t in r["turns"]]
        svg_timeline(rows, Path(args.svg))
        print(f"timeline: {args.svg}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
