"""``python -m voice_demo``: the voice toy on the sound card, or on a WAV (file mode).

This file parses options, loads the model and the engines, and calls voice_demo/run.py. Exit status as
``boardtalk``'s: 0 done; 2 a user error in one line (``voice_demo: error: ...``); 130 Ctrl-C.
"""
from __future__ import annotations

import argparse
import logging
import sys

from runtime.cli import CliError, _float_in, _load, _path, run_options

from . import persona as personas

PROG = "python -m voice_demo"
EXIT_ERROR, EXIT_INTERRUPTED = 2, 130


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(EXIT_ERROR, f"voice_demo: error: {message} (see '{PROG} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
                description="A talking toy: a persona (voice_demo/personas/*.yaml or your own YAML) on the\n"
                            "boardtalk voice loop (microphone -> VAD -> speech recognition -> LLM -> speech).\n"
                            "It wakes on its wake phrase (\"hey coco, what color is the sky?\") or a push-to-talk\n"
                            "key, beeps when it starts listening, shows a face for its state, keeps replies\n"
                            "short, writes nothing to disk unless asked, and forgets the conversation when\n"
                            "left alone.",
                epilog="Examples:\n"
                       f"  {PROG}                               # Coco on the default sound card; Ctrl-C quits\n"
                       f"  {PROG} --persona robo                # push-to-talk: press space, then speak\n"
                       f"  {PROG} --input-wav q.wav --output-wav a.wav --report-json r.json   # file mode\n"
                       "Persona keys, defaults and the content guard: docs/voice_demo.md. Needs the voice extra: "
                       "pip install 'boardtalk[voice]'.")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="log more: -v info, -vv debug with tracebacks of errors (default: warnings only)")
    p.add_argument("--persona", default="coco", metavar="NAME|FILE", type=_path,
                   help="a shipped persona's name (see --list-personas) or the path of a persona YAML file "
                        "(default: %(default)s)")
    p.add_argument("--list-personas", action="store_true",
                   help="print the shipped personas and exit (default: off)")
    run_options(p, gen=False)  # --artifact, --board, --threads, --max-context, --trusted-keys
    p.add_argument("--input", metavar="DEV",
                   help="microphone: sounddevice name (substring) or index (default: the board profile's, else the "
                        "system default); a missing device is retried, not fatal")
    p.add_argument("--output", metavar="DEV",
                   help="speaker: sounddevice name (substring) or index (default: the board profile's, else the "
                        "system default)")
    p.add_argument("--input-wav", metavar="IN.wav", type=_path,
                   help="file mode: play this WAV (any rate, mono or stereo) into the toy at real-time pace instead "
                        "of the microphone (default: live, from the microphone)")
    p.add_argument("--output-wav", metavar="OUT.wav", type=_path,
                   help="file mode: write what the toy says, earcons included, here (default: not written)")
    p.add_argument("--report-json", metavar="R.json", type=_path,
                   help="file mode: write each turn (what was heard, the reply, latencies) and the toy's events "
                        "here; it holds the transcripts (default: not written)")
    p.add_argument("--press-at", metavar="SECONDS", type=_float_in(0, 3600), action="append", default=[],
                   help="file mode, push_to_talk persona: press the key at this time of IN.wav; repeatable "
                        "(default: none)")
    return p


def _board_audio(args) -> tuple[str | None, str | None]:
    import boards

    prof = boards.PROFILES[args.board] if args.board else boards.detect()
    return args.input or prof.audio_input, args.output or prof.audio_output


def _check_paths(args) -> None:
    """Before anything is loaded: IN.wav readable, and the output files writable where they are to go (a run
    is not lost at its end for a typo in a directory name)."""
    from pathlib import Path

    try:
        with open(args.input_wav, "rb") as f:
            head = f.read(12)
    except OSError as e:
        raise CliError(f"cannot read --input-wav {args.input_wav}: {e.strerror or e}") from None
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        raise CliError(f"--input-wav {args.input_wav} is not a WAV file")
    for opt, path in (("--output-wav", args.output_wav), ("--report-json", args.report_json)):
        if path is None:
            continue
        p = Path(path)
        if p.is_dir():
            raise CliError(f"{opt} {path} is a directory; give a file name")
        if not p.parent.is_dir():
            raise CliError(f"{opt} {path}: directory {p.parent} does not exist")
        if p.resolve() == Path(args.input_wav).resolve():
            raise CliError(f"{opt} {path} is the input file; it would be overwritten")
    if args.output_wav and args.report_json and Path(args.output_wav).resolve() == Path(args.report_json).resolve():
        raise CliError("--output-wav and --report-json are the same file")


def run(args) -> int:
    if args.list_personas:
        for name, path in personas.shipped().items():
            p = personas.load_persona(str(path))
            how = f"says \"{p.wake_phrase}\"" if p.activation.mode == "wake" else f"key {p.activation.key!r}"
            print(f"{name:<10} {p.activation.mode:<13} {how:<22} {p.description}")
        return 0
    file_mode = args.input_wav is not None
    if not file_mode and (args.output_wav or args.report_json or args.press_at):
        raise CliError("--output-wav, --report-json and --press-at are for file mode: give --input-wav too")
    persona = personas.load_persona(args.persona)
    ptt = persona.activation.mode == "push_to_talk"
    if file_mode and ptt and not args.press_at:
        raise CliError(f"persona {persona.name} is push_to_talk: in file mode give --press-at SECONDS for each "
                       "key press (nothing is heard otherwise)")
    if not file_mode and ptt and not sys.stdin.isatty():
        raise CliError(f"persona {persona.name} is push_to_talk: its key is read from a terminal, and standard input "
                       "is not one; run it in a terminal, or use a wake persona")
    if args.press_at and not ptt:
        raise CliError(f"--press-at is for push_to_talk personas; {persona.name} wakes on \"{persona.wake_phrase}\"")
    if file_mode:
        _check_paths(args)
    if args.threads is None:
        args.threads = 1  # ASR and TTS run beside the LLM: 2 threads on 2 busy cores stall (as boardtalk voice)
    from runtime.voice.engines import open_engine

    from .face import Face

    model = _load(args)
    print(f"loading the voice engines for {persona.name} ...", file=sys.stderr)
    vad, asr = open_engine("vad"), open_engine("asr")
    voice = {} if persona.voice.speed is None else {"speed": persona.voice.speed}
    tts = open_engine("tts", persona.voice.engine, **voice)
    for e in (asr, tts):
        e.warmup()
    hint = f"say \"{persona.wake_phrase}\"" if not ptt else f"press {persona.activation.key} to talk"
    face = Face(persona.name, sys.stderr, hint=hint)
    from .run import run_file, run_live

    if file_mode:
        rep = run_file(model, vad, asr, tts, persona, args.input_wav, args.output_wav, args.report_json,
                       presses=args.press_at, face=face)
        for tr in rep["turns"]:
            if tr["reply_text"]:
                print(tr["reply_text"])
        return 0
    face.say(f"{persona.name} is ready: {hint}; Ctrl-C quits")
    inp, out = _board_audio(args)
    return run_live(model, vad, asr, tts, persona, inp, out, face=face)


def main(argv=None) -> int:
    from runtime.cli import _one_line, _user_errors

    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                            format="%(levelname)s %(name)s: %(message)s")
        return run(args)
    except KeyboardInterrupt:
        print(("\n" if sys.stderr.isatty() else "") + "voice_demo: interrupted", file=sys.stderr)  # after ^C
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - only user errors are caught, the rest re-raised
        if not isinstance(e, _user_errors()):
            raise
        logging.getLogger(__name__).debug("error", exc_info=True)
        print(f"voice_demo: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_ERROR
