#!/usr/bin/env python3
"""The voice loop's latency, per stage, on spoken questions played through file mode at real-time pace.

    python scripts/voice_bench.py                         # default artifact, espeak-ng questions, 1 LLM thread
    python scripts/voice_bench.py --wav a.wav --wav b.wav  # your own recordings (one question each)
    python scripts/voice_bench.py --svg docs/voice-timeline.svg --json out.json

For each question: 0.5 s of silence, the question, then silence until the reply has been spoken. Prints
each turn's stage times after the end of speech (the last voiced sample) and, over all turns, the
median and min-max of: final transcript, first token, confirmed end of turn, first audio, against the
issue's targets (first token <= 100 ms / <= 250 ms at least; first audio <= 300 ms / <= 350 ms at least).
Draws one timeline row per turn as an SVG (no plotting library needed).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "How many legs does a spider have?",
             "Tell me a fun fact about octopuses.", "What do bees make?", "Can you sing me a song?"]
TARGETS = {"first_token": (100, 250), "first_audio": (300, 350)}  # ms after speech end: goal, must


def espeak_wav(text: str, path: Path, voice: str = "en-us", speed: int = 160) -> Path:
    if not shutil.which("espeak-ng"):
        sys.exit("espeak-ng is needed to speak the questions (apt install espeak-ng), or pass --wav files")
    subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(path), text], check=True)
    return path


def padded(src: Path, dst: Path, lead_s: float = 0.5, tail_s: float = 0.8) -> Path:
    import numpy as np

    from runtime.voice.filemode import read_wav, write_wav

    x, rate = read_wav(src)
    z = np.zeros(int(lead_s * rate), np.float32)
    write_wav(dst, np.concatenate([z, x, np.zeros(int(tail_s * rate), np.float32)]), rate)
    return dst


def svg_timeline(turns: list[dict], path: Path) -> None:
    """One row per turn, time 0 = end of speech: speech, hangover, partial passes, final transcript, first
    token, end of turn, first audio, playback."""
    W, H, left, row = 960, 60 + 46 * len(turns), 230, 46
    t_min, t_max = -1.5, 1.5
    x = lambda t: left + (t - t_min) / (t_max - t_min) * (W - left - 20)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="10" y="18" font-size="13">voice turns: time after the end of speech (s); '
           f'targets: first token {TARGETS["first_token"][0]} ms, first audio {TARGETS["first_audio"][0]} ms</text>']
    for k in range(int(t_min * 4), int(t_max * 4) + 1):
        t = k / 4
        out.append(f'<line x1="{x(t):.1f}" y1="30" x2="{x(t):.1f}" y2="{H - 10}" stroke="{"#888" if t == 0 else "#eee"}"/>')
        out.append(f'<text x="{x(t) - 8:.1f}" y="{H - 1}" fill="#666">{t:+.2f}</text>')
    for i, tr in enumerate(turns):
        y = 40 + i * row
        e = tr["speech_end_s"]
        rel = lambda v: None if v is None else v - e  # noqa: E731
        label = (tr["transcript"] or "(nothing heard)")[:34]
        out.append(f'<text x="10" y="{y + 16}">{_esc(label)}</text>')
        out.append(f'<rect x="{x(max(t_min, rel(tr["speech_start_s"]))):.1f}" y="{y + 4}" '
                   f'width="{x(0) - x(max(t_min, rel(tr["speech_start_s"]))):.1f}" height="16" fill="#9ecae1"/>')
        eot, fa, done = rel(tr["end_of_turn_s"]), rel(tr["first_audio_s"]), rel(tr["reply_done_s"])
        if eot is not None:
            out.append(f'<rect x="{x(0):.1f}" y="{y + 8}" width="{x(eot) - x(0):.1f}" height="8" fill="#fdd0a2"/>')
        if fa is not None:
            end = min(t_max, done if done is not None else fa + 0.5)
            out.append(f'<rect x="{x(fa):.1f}" y="{y + 4}" width="{max(1.0, x(end) - x(fa)):.1f}" height="16" '
                       'fill="#a1d99b"/>')
        for t, _ in tr.get("partials", []):
            if t_min <= t - e <= t_max:
                out.append(f'<line x1="{x(t - e):.1f}" y1="{y + 2}" x2="{x(t - e):.1f}" y2="{y + 22}" stroke="#3182bd" '
                           'stroke-dasharray="2,2"/>')
        for key, color in (("transcript_final_s", "#756bb1"), ("first_token_s", "#e6550d")):
            t = rel(tr[key])
            if t is not None and t_min <= t <= t_max:
                out.append(f'<circle cx="{x(t):.1f}" cy="{y + 12}" r="4" fill="{color}"/>')
    legend = [("speech", "#9ecae1"), ("hangover", "#fdd0a2"), ("reply playing", "#a1d99b"),
              ("final transcript", "#756bb1"), ("first token", "#e6550d"), ("partial ASR pass", "#3182bd")]
    for j, (name, color) in enumerate(legend):
        out.append(f'<rect x="{left + j * 120}" y="24" width="10" height="10" fill="{color}"/>'
                   f'<text x="{left + j * 120 + 14}" y="33">{name}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out), encoding="utf-8")


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def main() -> int:
    import runtime
    from runtime.voice.engines import open_engine
    from runtime.voice.filemode import run_file
    from runtime.voice.pipeline import VoiceConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", help="LLM artifact (default: the default artifact, which must exist)")
    ap.add_argument("--wav", action="append", help="a recording of one question (repeatable; default: espeak-ng)")
    ap.add_argument("--threads", type=int, default=1, help="LLM threads (default: %(default)s; ASR and TTS use one each)")
    ap.add_argument("--hangover-ms", type=int, default=250, help="end-of-turn silence (default: %(default)s)")
    ap.add_argument("--svg", help="write the timeline picture here")
    ap.add_argument("--json", help="write every turn's report here")
    args = ap.parse_args()
    model = runtime.load(args.artifact or runtime.default_artifact(), threads=args.threads)
    vad, asr, tts = open_engine("vad"), open_engine("asr"), open_engine("tts")
    asr.warmup()
    tts.warmup()
    cfg = VoiceConfig(system="You are a friendly voice assistant. Answer in one short sentence.", max_new_tokens=48,
                      hangover_s=args.hangover_ms / 1e3)
    turns = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sources = [Path(w) for w in args.wav] if args.wav else [espeak_wav(q, tmp / f"q{i}.wav")
                                                                 for i, q in enumerate(QUESTIONS)]
        for i, src in enumerate(sources):
            rep = run_file(model, vad, asr, tts, padded(src, tmp / f"in{i}.wav"), None, cfg, tail_s=15)
            for tr in rep["turns"]:
                turns.append(tr)
                lat = tr["latency_ms"]
                print(f"{src.name:>12}: heard {tr['transcript']!r:40.40} | " + ", ".join(
                    f"{k} {v:.0f} ms" for k, v in lat.items() if v is not None)
                    + f" | restarts {tr['speculative_restarts']}, partials {tr['partial_passes']}, "
                      f"ASR {tr['asr_final_ms'] or 0:.0f} ms, TTS first {tr['tts_first_ms'] or 0:.0f} ms")
    print(f"\n{len(turns)} turns; ms after the end of speech, median [min-max]:")
    for key in ("transcript", "first_token", "end_of_turn", "first_audio"):
        xs = [t["latency_ms"][key] for t in turns if t["latency_ms"][key] is not None]
        if not xs:
            continue
        goal = TARGETS.get(key)
        verdict = ""
        if goal:
            med = statistics.median(xs)
            verdict = (f"   goal {goal[0]}: {'met' if med <= goal[0] else 'NOT met'}; "
                       f"must {goal[1]}: {'met' if med <= goal[1] else 'NOT met'}")
        print(f"  {key:>12}: {statistics.median(xs):7.0f} [{min(xs):.0f}-{max(xs):.0f}]{verdict}")
    if args.svg:
        svg_timeline(turns, Path(args.svg))
        print(f"timeline: {args.svg}")
    if args.json:
        Path(args.json).write_text(json.dumps(turns, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
