"""``boardtalk voice``: the voice loop live on audio devices, or in file mode from a WAV.

Only parses options, loads the model and the engines, and prints: states and one line per turn with
its latencies on stderr, the replies' text on stdout.
"""
from __future__ import annotations

import sys

from runtime.cli import CliError, _int_in, _load, _path, run_options

VOICE_SYSTEM = "You are a friendly voice assistant. Answer in one or two short sentences."


def cmd_voice(args) -> int:
    from runtime.voice.engines import open_engine
    from runtime.voice.pipeline import VoiceConfig

    if args.input_wav is None and (args.output_wav or args.report_json):
        raise CliError("--output-wav and --report-json are for file mode: give --input-wav too")
    if args.input_wav is not None:  # before minutes of loading: a typo is one line at once
        from runtime.voice.filemode import read_wav

        read_wav(args.input_wav)
    if args.threads is None:
        args.threads = 1  # ASR and TTS run beside the LLM: 2 OpenMP threads on 2 busy cores stall (measured)
    cfg = VoiceConfig(system=args.system, max_new_tokens=args.max_new_tokens, hangover_s=args.hangover_ms / 1e3,
                      barge_in=args.barge_in, barge_in_s=args.barge_in_ms / 1e3, early_final=not args.no_early_final,
                      hangover_complete_s=None if args.hangover_complete_ms is None else args.hangover_complete_ms / 1e3)
    model = _load(args)
    print("loading the voice engines ...", file=sys.stderr)
    vad, asr, tts = (open_engine(k, getattr(args, k)) for k in ("vad", "asr", "tts"))
    for e in (asr, tts):
        e.warmup()
    if args.input_wav is not None:
        from runtime.voice.filemode import run_file

        rep = run_file(model, vad, asr, tts, args.input_wav, args.output_wav, cfg, args.report_json,
                       on_state=lambda st: print(f"[{st}]", file=sys.stderr))
        for tr in rep["turns"]:
            print(_turn_line(tr), file=sys.stderr)
            print(tr["reply_text"])
        return 0
    from runtime.voice.live import run_live

    def print_turn(tr) -> None:  # as file mode: the turn's latencies on stderr, what was said on stdout
        d = tr.to_dict()
        print(_turn_line(d), file=sys.stderr)
        print(d["reply_text"], flush=True)

    return run_live(model, vad, asr, tts, cfg, args.input, args.output, print_turn=print_turn)


def _turn_line(tr: dict) -> str:
    lat = tr["latency_ms"]
    ms = ", ".join(f"{k.replace('_', ' ')} {v:.0f} ms" for k, v in lat.items() if v is not None)
    return f"[you: {tr['transcript']!r} | after speech end: {ms} | restarts {tr['speculative_restarts']}]"


def add_commands(sub) -> None:
    v = sub.add_parser("voice", help="talk to the model: microphone -> speech recognition -> LLM -> speech",
                       description="Live conversation on the default or named audio devices, or file mode "
                                   "(--input-wav): a WAV played in at real-time pace, the replies written to a "
                                   "WAV and every turn's latencies to a JSON report. Needs the voice extra: "
                                   "pip install 'boardtalk[voice]'.")
    run_options(v, gen=False)
    v.add_argument("--input", metavar="DEV", help="microphone: sounddevice name (substring) or index "
                                                  "(default: the board profile's, else the system default)")
    v.add_argument("--output", metavar="DEV", help="speaker: sounddevice name (substring) or index (default: as --input)")
    v.add_argument("--input-wav", metavar="IN.wav", type=_path,
                   help="file mode: play this WAV (any rate, mono or stereo) into the loop instead of a microphone "
                        "(default: live, from the microphone)")
    v.add_argument("--output-wav", metavar="OUT.wav", type=_path, help="file mode: write the spoken replies here (default: not written)")
    v.add_argument("--report-json", metavar="REPORT.json", type=_path,
                   help="file mode: write each turn's transcript, reply and latencies here (default: not written)")
    v.add_argument("--system", metavar="TEXT", default=VOICE_SYSTEM,
                   help="system prompt, prefilled once (default: a short-answer voice assistant)")
    v.add_argument("--max-new-tokens", type=_int_in(1, 4096), default=64, metavar="N",
                   help="reply length cap in tokens (default: %(default)s)")
    v.add_argument("--hangover-ms", type=_int_in(0, 5000), default=250, metavar="MS",
                   help="silence that ends a turn; shorter answers sooner but may cut a pause (default: %(default)s)")
    v.add_argument("--hangover-complete-ms", type=_int_in(0, 5000), metavar="MS",
                   help="end the turn after this shorter silence once the transcript reads as a finished sentence "
                        "(<= --hangover-ms): ~96 ms sooner first audio on the bench, but it cut 2 of 8 users who "
                        "paused after a complete clause (default: off)")
    v.add_argument("--no-early-final", action="store_true",
                   help="start the final speech-recognition pass only when the VAD reports silence, not one window "
                        "earlier when the last voiced window's tail is already quiet (default: early, ~19 ms sooner)")
    v.add_argument("--barge-in", action="store_true",
                   help="speech while the bot talks stops it (needs echo cancellation on a live device; file mode "
                        "has no echo) (default: off, half-duplex)")
    v.add_argument("--barge-in-ms", type=_int_in(32, 2000), default=150, metavar="MS",
                   help="voiced time during a reply that counts as the user interrupting, with --barge-in; longer "
                        "ignores coughs and echo residue but reacts later (default: %(default)s)")
    for kind in ("vad", "asr", "tts"):
        v.add_argument(f"--{kind}", metavar="ENGINE",
                       help=f"{kind.upper()} engine (default: the registry's default; see runtime/voice/engines.py)")
    v.set_defaults(func=cmd_voice)
