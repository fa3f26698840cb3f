"""``boardtalk``: build and sign artifacts, generate, chat, measure perplexity.

This file only parses options, calls the runtime (and, for ``build``, models/) and prints:
generated text on stdout, progress, notes and stats on stderr.

Without --artifact, generate/chat/perplexity use the default model's artifact for this board under
the cache dir ($BOARDTALK_CACHE or ~/.cache/boardtalk). It is built on first use under the
artifact's build lock (two first runs at once build it once: the second waits and reuses it), and
rebuilt once when it no longer loads (damaged, tampered with, an older format). An artifact given
with --artifact is never rebuilt; the error says how to rebuild it.

models/ (the build side) may be absent on a board: it is imported only by ``build`` and by the
first-use build of the default artifact; everything else runs without it.

Exit status: 0 done; 2 a user error: one line ``boardtalk: error: ...`` on stderr, never a
traceback (-vv logs it at DEBUG); 130 Ctrl-C (``boardtalk: interrupted``); 141 stdout was closed
early (``| head``): silent, the status of a program killed by SIGPIPE as cat or grep are, so a
pipeline with ``set -o pipefail`` can still tell that the output was cut short.
"""
from __future__ import annotations

import argparse
import importlib
import contextlib
import json
import logging
import math
import os
import shlex
import signal
import stat
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE
BUILD_EXTRA = "boardtalk build needs the build extra: pip install 'boardtalk[build]'"
MANIFEST = "manifest.yaml"
# Modules with add_commands(subparsers): each registers its own commands, options and handlers; they
# import from here only the option types, run_options, _load and CliError.
COMMAND_MODULES: tuple[str, ...] = (
    "runtime.voice.cli",
    "runtime.verify",
    "runtime.serve.systemd",
    "runtime.serve.cli",
)


class CliError(Exception):
    """A user error; its message is one line."""


# ---------------------------------------------------------------------------------------------
# Option types: bad values are refused at parse time with one line naming the option

def _int_in(lo: int, hi: int | None = None):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo or (hi is not None and v > hi):
            want = f"from {lo} to {hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be an integer {want}, got {v}")
        return v

    return parse


def _path(s: str) -> str:
    """A path option: an empty one is an error, not "the default" (--out "" once built into the cache)."""
    if not s.strip():
        raise argparse.ArgumentTypeError("an empty path; give a file or directory")
    return s


def _float_in(lo: float, hi: float, lo_open: bool = False):
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
        if not math.isfinite(v) or v < lo or (lo_open and v == lo) or v > hi:
            want = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise argparse.ArgumentTypeError(f"must be a finite number in {want}, got {s}")
        return v

    return parse


def _nonempty(s: str) -> str:
    if not s:
        raise argparse.ArgumentTypeError("must not be empty")
    return s


class _Parser(argparse.ArgumentParser):
    """Errors in one line (argparse would print the whole multi-line usage first)."""

    def error(self, message: str):
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


# ---------------------------------------------------------------------------------------------
# Output helpers

def _progress(i: int, n: int, what: str) -> None:
    width = 30
    done = int(width * i / max(n, 1))
    print(f"\r  [{'#' * done}{'.' * (width - done)}] {i}/{n} {what:<14}", end="" if i < n else "\n", file=sys.stderr,
          flush=True)


def _stats_line(st) -> str:
    finish = {"context": "context full", "stop_string": "stop string"}.get(st.finish_reason, st.finish_reason)
    return (f"[{st.prompt_tokens} prompt tokens ({st.reused_tokens} cached), {st.new_tokens} new; "
            f"first token {st.ttft_s * 1e3:.0f} ms, {st.decode_tokens_per_s:.1f} tok/s; {finish}]")


MAX_TEXT_BYTES = 64 << 20  # a prompt or text file larger than this is refused before it is read


def _read_text(path: str, option: str, tail: int | None = None) -> str:
    """A regular UTF-8 file of at most MAX_TEXT_BYTES (/dev/zero, a FIFO or a huge file is refused without
    reading it); tail: only its last ``tail`` bytes are read (from the first whole character on)."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise CliError(f"{option} {path} is not a regular file")
            if st.st_size > MAX_TEXT_BYTES and tail is None:
                raise CliError(f"{option} {path} is {st.st_size / 2**20:.0f} MiB; at most {MAX_TEXT_BYTES >> 20} MiB "
                               "(with --truncate-prompt only its end is read)")
            if tail is not None and st.st_size > tail:
                f.seek(st.st_size - tail)
                data = f.read(tail)
                data = data[next((i for i, b in enumerate(data[:4]) if b & 0xC0 != 0x80), 0):]  # whole chars only
            else:
                data = f.read(MAX_TEXT_BYTES + 1)
        return data.decode("utf-8")
    except OSError as e:
        raise CliError(f"cannot read {option} {path}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise CliError(f"{option} {path} is not UTF-8 text (byte {e.start})") from None


# ---------------------------------------------------------------------------------------------
# Loading: trusted keys, the user's artifact, the default artifact

def _trusted_keys(args):
    """Keys from --trusted-keys, or None: runtime.load then uses $BOARDTALK_TRUSTED_KEYS or /etc/boardtalk."""
    if not args.trusted_keys:
        return None
    from runtime.signing import KEY_TAG, load_public_keys

    keys = load_public_keys(args.trusted_keys)
    if not keys:
        raise CliError(f"--trusted-keys {args.trusted_keys} holds no '{KEY_TAG}' key")
    return keys


def _load(args):
    import runtime

    kw = dict(threads=args.threads, board=args.board, max_context=args.max_context, trusted_keys=_trusted_keys(args))
    if not args.artifact:
        return _load_default(args, kw)
    try:
        return runtime.load(args.artifact, **kw)
    except runtime.UntrustedArtifact as e:  # a rebuild would not be signed by a trusted key either
        raise CliError(str(e)) from e
    except runtime.ArtifactError as e:  # never rebuilt: it is the user's; say how
        raise CliError(f"{e}{_rebuild_hint(Path(args.artifact), args.board)}") from e


def _rebuild_hint(path: Path, board: str | None) -> str:
    """'; to rebuild it: boardtalk build ...' with what the manifest still says (model, backend)."""
    import boards
    import runtime

    if (path.exists() and not path.is_dir()) or path.name.endswith((".tar", ".tar.gz", ".tgz")):
        return ""  # a tarball: it is rebuilt and packed where it was made
    # a damaged manifest no longer says which model it was: the user fills it in
    model, backend = runtime.DEFAULT_MODEL if not path.exists() else "MODEL_OR_GGUF", runtime.default_backend()
    try:
        import yaml

        d = yaml.safe_load((path / MANIFEST).read_text(encoding="utf-8"))
        model = str(d["model"]["source"].get("registry_name") or model)
        backend = d["backend"] if d["backend"] in runtime.BACKENDS else backend
    except Exception:  # noqa: BLE001 - a damaged manifest: it no longer says which model it was
        pass
    try:
        board = board or boards.detect().name
    except ValueError:
        board = "host"
    cmd = (f"boardtalk build --model {shlex.quote(model)} --backend {backend} --board {board} "
           f"--out {shlex.quote(str(path))}")
    return f"; to {'rebuild it' if path.exists() else 'build one'}: {cmd}"


def _stamp(path: Path):
    """Identity of the artifact's manifest file (a build installs a new one), or None."""
    try:
        s = (path / MANIFEST).stat()
    except OSError:
        return None
    return s.st_ino, s.st_mtime_ns, s.st_size


def _stale(path: Path) -> str | None:
    """Why the cached default artifact cannot be read by this boardtalk (an older format), or None."""
    import yaml

    from runtime.artifact import FORMAT_VERSION

    try:
        version = yaml.safe_load((path / MANIFEST).read_text(encoding="utf-8")).get("format_version")
    except (OSError, AttributeError, ValueError, yaml.YAMLError):
        return None  # missing (built below) or damaged (loading reports it, then it is rebuilt)
    if version != FORMAT_VERSION:
        return f"the default artifact has format {version}, this boardtalk reads {FORMAT_VERSION}"
    return None


def _load_default(args, kw):
    import boards
    import runtime

    board = args.board or boards.detect().name
    backend = runtime.default_backend()
    path = runtime.default_artifact(board=board, backend=backend)
    seen = _stamp(path)
    why = "no artifact yet" if seen is None else _stale(path)
    if why:
        _build_default(path, board, backend, why, seen)
        seen = _stamp(path)
    try:
        return runtime.load(path, **kw)
    except runtime.ArtifactError as e:
        if isinstance(e, runtime.UntrustedArtifact):  # a rebuild is unsigned too: it would not help
            raise CliError(f"{e}; the default artifact is built unsigned: build and sign one with 'boardtalk build "
                           f"--sign-key KEY --out DIR' and run with --artifact DIR") from e
        if why:  # just built (here or by another run): a second build would fail the same way
            raise
        _build_default(path, board, backend, f"the default artifact does not load ({e})", seen)
    return runtime.load(path, **kw)  # once: an error now is reported as it is


def _build_default(path: Path, board: str, backend: str, why: str, seen) -> None:
    """Build the default artifact, once: under its build lock, a run that waited while another built
    it (the manifest changed since ``seen``) uses that build."""
    import runtime
    from runtime.store import build_lock

    try:
        from models.build import build_artifact
    except ImportError as e:
        log.debug("models/ is not importable", exc_info=True)
        raise CliError(f"{why}; building it needs the build extra: pip install 'boardtalk[build]' "
                       "(or pass --artifact DIR)") from e
    with build_lock(path):
        if _stamp(path) != seen and _stale(path) is None:
            log.info("the default artifact %s was built by another run meanwhile", path)
            return
        print(f"boardtalk: {why}; building the default one ({runtime.DEFAULT_MODEL}, {backend}) at {path} (once)",
              file=sys.stderr)
        build_artifact(runtime.DEFAULT_MODEL, path, board=board, backend=backend, progress=_progress)


# ---------------------------------------------------------------------------------------------
# Commands

def _config(args):
    import runtime

    return runtime.GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                    top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                                    stop_strings=tuple(args.stop or ()),
                                    truncate_prompt=getattr(args, "truncate_prompt", False))


def cmd_build(args) -> int:
    if _build_registries() is None:
        raise CliError(BUILD_EXTRA)
    try:
        from models.build import build_artifact
        from models.sources import MODELS
    except ImportError as e:
        log.debug("models/ is not importable", exc_info=True)
        raise CliError(BUILD_EXTRA) from e
    import boards
    import runtime

    board = args.board or boards.detect().name
    out = Path(args.out) if args.out else runtime.default_artifact(
        args.model if args.model in MODELS else Path(args.model).stem, board, args.backend)
    print(f"building {args.model} for {board} ({args.backend}, {args.scheme}) -> {out}", file=sys.stderr)
    t0 = time.monotonic()
    manifest, report = build_artifact(args.model, out, board=board, backend=args.backend, scheme=args.scheme,
                                      embedding=args.embedding, accuracy_level=args.accuracy_level,
                                      max_context=args.max_context, progress=_progress, sign_key=args.sign_key)
    size = sum(f["size"] for f in manifest.files.values())
    signed = f"; signed with {args.sign_key}" if args.sign_key else ""
    print(f"done in {time.monotonic() - t0:.1f} s: {size / 2**20:.1f} MiB; {report.summary()}{signed}",
          file=sys.stderr)
    print(out)
    return 0


def _prompt_ids(model, text: str, args) -> list[int]:
    system = [{"role": "system", "content": args.system}] if args.system else []
    msgs = system + [{"role": "user", "content": text}]
    if args.truncate_prompt:  # keep the newest part of the text; with --chat the template stays whole
        room = model.max_context - 1 - min(args.max_new_tokens, model.max_context // 2)
        overhead = len(model.chat_ids(system + [{"role": "user", "content": ""}])) if args.chat else 0
        if room - overhead < 1:
            raise CliError(f"the chat template alone takes {overhead} of the {model.max_context}-token context")
        ids = model.tokenizer.encode(text[-(room * 64):])  # no token is 64 characters: the tail is enough
        if len(ids) > room - overhead:
            print(f"[prompt truncated to its newest {room - overhead} tokens]", file=sys.stderr)
            ids = ids[-(room - overhead):]
        if not args.chat:
            return ids
        return model.chat_ids(system + [{"role": "user", "content": model.tokenizer.decode(ids)}])
    room = model.max_context - 1  # at least one position to generate into
    ids = model.tokenizer.encode(text, limit=model.max_context)  # stops early on a prompt that cannot fit
    if args.chat and len(ids) <= room:
        ids = model.chat_ids(msgs)
    if len(ids) > room:
        n = f"more than {model.max_context}" if len(ids) > model.max_context else str(len(ids))
        more = (f", raise --max-context (this artifact allows {model.manifest.max_context})"
                if model.max_context < model.manifest.max_context else "")
        raise CliError(f"the prompt is {n} tokens{' with the chat template' if args.chat else ''}; the context holds "
                       f"{model.max_context} with room for the reply; shorten it{more}, or pass --truncate-prompt "
                       "to keep only its newest tokens")
    return ids


def cmd_generate(args) -> int:
    if args.system is not None and not args.chat:
        raise CliError("--system needs --chat (a system message is part of the chat template)")
    tail = 64 * 1024 * 1024 if args.truncate_prompt else None  # only the end of a huge file can be kept
    text = _read_text(args.prompt_file, "--prompt-file", tail) if args.prompt_file is not None else args.prompt
    if not text:
        raise CliError("the prompt is empty" + (f" ({args.prompt_file} has no text)" if args.prompt_file else ""))
    cfg = _config(args)
    model = _load(args)
    ids = _prompt_ids(model, text, args)
    out = []
    for delta in model.stream(ids, cfg):
        out.append(delta)
        if not args.json:
            print(delta, end="", flush=True)
    st = model.last_stats
    if args.json:
        print(json.dumps({"prompt_ids": ids, "token_ids": st.token_ids, "text": "".join(out),
                          "ttft_ms": round(st.ttft_s * 1e3, 2), "decode_tokens_per_s": round(st.decode_tokens_per_s, 2),
                          "prompt_tokens": st.prompt_tokens, "new_tokens": st.new_tokens,
                          "finish_reason": st.finish_reason}, ensure_ascii=False), flush=True)
    else:
        print(flush=True)
        print(_stats_line(st), file=sys.stderr)
    return 0


@contextlib.contextmanager
def _ctrl_c_cancels(cancel):
    """While a reply streams, Ctrl-C only sets ``cancel``: generation ends within one step, the reply so
    far is kept and the session stays usable. The previous handler is back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    prev = signal.signal(signal.SIGINT, lambda signum, frame: cancel.cancel())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, prev if prev is not None else signal.default_int_handler)


def _chat_turn(model, history: list[dict], first: int, cfg) -> list[dict]:
    """One reply to history (which ends with the user's message); returns the history to keep.
    first: how many leading messages are the system prompt (always kept)."""
    import runtime

    cancel = runtime.CancelToken()
    reply = []
    with _ctrl_c_cancels(cancel):  # from the moment the message is taken: Ctrl-C only ever stops this reply
        try:
            deltas = model.chat(history, cfg, cancel)
        except runtime.ContextOverflow as e:
            print(f"[{e}; message not sent]", file=sys.stderr)
            return history[:-1]
        k = model.last_stats.dropped_messages
        if k:  # the model no longer sees them: neither does the next turn
            history = history[:first] + history[first + k :]
            print(f"[context full: left out the {k} oldest message{'s' if k != 1 else ''}]", file=sys.stderr)
        for delta in deltas:
            reply.append(delta)
            print(delta, end="", flush=True)
    print(flush=True)
    print(_stats_line(model.last_stats), file=sys.stderr)
    return history + [{"role": "assistant", "content": "".join(reply)}]


def cmd_chat(args) -> int:
    cfg = _config(args)
    model = _load(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    if system:
        model.warm_prefix(system)
    history = list(system)
    print("boardtalk chat: type a message; Ctrl-C stops a reply, /reset starts over, an empty line or Ctrl-D quits.",
          file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:  # Ctrl-D; Ctrl-C here is KeyboardInterrupt: "interrupted", 130
            print(file=sys.stderr)
            return 0
        if not line.strip():
            return 0
        if line.strip() == "/reset":
            history = list(system)
            print("[conversation reset]", file=sys.stderr)
            continue
        history = _chat_turn(model, history + [{"role": "user", "content": line}], len(system), cfg)


def cmd_perplexity(args) -> int:
    text = _read_text(args.text_file, "--text-file")
    if not text:
        raise CliError(f"--text-file {args.text_file} is empty")
    model = _load(args)
    if args.max_tokens is None:
        args.max_tokens = min(512, model.max_context)
    if args.max_tokens > model.max_context:
        raise CliError(f"--max-tokens {args.max_tokens} exceeds the context of {model.max_context} positions; "
                       f"use --max-tokens {model.max_context} or less")
    ids = model.tokenizer.encode(text, limit=args.max_tokens)[: args.max_tokens]
    if len(ids) < 2:
        raise CliError(f"--text-file {args.text_file} is {len(ids)} token; perplexity needs at least 2")
    t0 = time.monotonic()
    ppl, n = model.perplexity(ids)
    dt = time.monotonic() - t0
    if args.json:
        print(json.dumps({"ppl": ppl, "n_tokens": n, "seconds": round(dt, 3)}))
    else:
        print(f"ppl {ppl:.4f} over {n} predicted tokens ({dt:.1f} s)")
    return 0


def cmd_keygen(args) -> int:
    from runtime.signing import generate_key

    private, public = Path(f"{args.out}.key"), Path(f"{args.out}.pub")
    kid = generate_key(private, public)
    print(f"key {kid}: private {private} (mode 0600: keep it on the build machine), public {public} (copy it to "
          f"boards: $BOARDTALK_TRUSTED_KEYS or /etc/boardtalk/trusted_keys/)", file=sys.stderr)
    print(kid)
    return 0


def cmd_sign(args) -> int:
    from runtime import signing, store
    from runtime.artifact import load_manifest

    art = Path(args.artifact)
    if not (art / MANIFEST).is_file() or not store.is_artifact_dir(art):
        raise CliError(f"{art} is not an artifact directory (sign the directory, then pack it into a tarball)")
    with store.build_lock(art):  # not while a build replaces it
        load_manifest(art)  # every file matches the manifest: sign only what is really there
        kid = signing.sign_manifest(art, args.key)
    print(f"signed {art / MANIFEST} with key {kid}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# Parser

def run_options(sp, gen=True) -> None:
    """Options of every command that loads an artifact (gen: also the generation options)."""
    import boards

    board_names = list(boards.PROFILES)
    sp.add_argument("--artifact", metavar="PATH", type=_path,
                    help="artifact directory or tarball (default: the default model's artifact for this board, "
                         "built in the cache on first use)")
    sp.add_argument("--board", choices=board_names,
                    help="run as this board profile (default: $BOARDTALK_BOARD or detected)")
    sp.add_argument("--threads", type=_int_in(1, boards.MAX_THREADS), metavar="N",
                    help=f"compute threads, 1-{boards.MAX_THREADS} (default: the board's; host: every usable core)")
    sp.add_argument("--max-context", type=_int_in(2), metavar="N",
                    help="KV cache positions, >= 2 (default: the board's, capped by the artifact's)")
    sp.add_argument("--trusted-keys", metavar="PATH", type=_path,
                    help="a .pub file or a directory of them: load only artifacts signed by one of these keys "
                         "(default: $BOARDTALK_TRUSTED_KEYS, else /etc/boardtalk/trusted_keys/ if it exists, "
                         "else no signature check)")
    if gen:
        sp.add_argument("--max-new-tokens", type=_int_in(1), default=256, metavar="N",
                        help="most tokens to generate per reply, >= 1 (default: %(default)s)")
        sp.add_argument("--temperature", type=_float_in(0, 100), default=0.0, metavar="T",
                        help="sampling temperature in [0, 100]; 0 = greedy, deterministic (default: %(default)s)")
        sp.add_argument("--top-k", type=_int_in(0), default=0, metavar="K",
                        help="sample from the K most likely tokens only; 0 = off (default: %(default)s)")
        sp.add_argument("--top-p", type=_float_in(0, 1, lo_open=True), default=1.0, metavar="P",
                        help="nucleus sampling: the smallest set of tokens with probability P, in (0, 1]; "
                             "1 = off (default: %(default)s)")
        sp.add_argument("--repetition-penalty", type=_float_in(0, 100, lo_open=True), default=1.0, metavar="R",
                        help="> 1 discourages tokens already seen, in (0, 100]; 1 = off (default: %(default)s)")
        sp.add_argument("--seed", type=_int_in(0, 2**64 - 1), metavar="N",
                        help="sampling seed, for repeatable output with --temperature > 0 (default: random)")
        sp.add_argument("--stop", action="append", type=_nonempty, metavar="TEXT",
                        help="stop when the reply produces TEXT (not printed); repeatable (default: only the "
                             "model's end-of-turn tokens stop)")


def _build_registries():
    """(model names, schemes, embedding schemes) from models/, or None when models/ is not installed."""
    try:
        from models.quant import EMBEDDING_SCHEMES, SCHEMES
        from models.sources import MODELS
    except ImportError:
        log.debug("models/ is not importable: 'build' is unavailable", exc_info=True)
        return None
    return list(MODELS), list(SCHEMES), list(EMBEDDING_SCHEMES)


def build_parser(for_build: bool = True) -> argparse.ArgumentParser:
    """for_build: also read models/' registries for the build command's choices (a board that runs
    generate/chat never imports models/)."""
    import boards
    import runtime

    p = _Parser(prog="boardtalk", description="On-device streaming LLM runtime for edge boards.",
                epilog="Run 'boardtalk COMMAND --help' for the options of each command. Without --artifact, "
                       "generate/chat/perplexity build (once) and use the default model's artifact for this board "
                       "under $BOARDTALK_CACHE (default ~/.cache/boardtalk).")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="log more: -v info, -vv debug with tracebacks of errors (default: warnings only)")
    p.add_argument("--version", action="version", version=f"boardtalk {runtime.__version__}",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", title="commands")
    board_names = list(boards.PROFILES)
    reg = _build_registries() if for_build else None

    b = sub.add_parser("build", help="turn a model (registry name or .gguf) into a verified artifact for a board",
                       description="Convert a registered model or a local .gguf into a verified artifact. "
                                   + ("" if reg or not for_build else BUILD_EXTRA + "."))
    models_help = f"registry name ({', '.join(reg[0])})" if reg else "registry name"
    b.add_argument("--model", default=runtime.DEFAULT_MODEL,
                   help=f"{models_help} or path to a .gguf file (default: {runtime.DEFAULT_MODEL})")
    b.add_argument("--backend", default=runtime.DEFAULT_BACKEND, choices=list(runtime.BACKENDS),
                   help="native: C kernels over the GGUF's own blocks, regrouped 8 rows at a time (fastest, least "
                        "memory); onnxruntime: portable INT4 ONNX graph (default: %(default)s)")
    b.add_argument("--board", choices=board_names,
                   help="target board profile (default: this machine's: $BOARDTALK_BOARD or detected)")
    b.add_argument("--out", metavar="DIR", type=_path,
                   help="artifact directory, new, empty or an artifact (replaced atomically) (default: the cache's "
                        "artifact path for this model, backend and board)")
    b.add_argument("--scheme", default="q4_1-exact", choices=reg[1] if reg else None,
                   help="linear-layer quantization (native needs q4_1-exact) (default: %(default)s)")
    b.add_argument("--embedding", default="q8_0", choices=reg[2] if reg else None,
                   help="tied embedding / lm_head quantization (native needs q8_0) (default: %(default)s)")
    b.add_argument("--accuracy-level", type=int, default=4, choices=[0, 1, 2, 3, 4],
                   help="onnxruntime MatMulNBits accuracy level: 4 = int8 activations (fast), 0 = fp32 "
                        "(default: %(default)s)")
    b.add_argument("--max-context", type=_int_in(2), metavar="N",
                   help="positions the artifact supports, >= 2 (default: the board's, capped by the model's)")
    b.add_argument("--sign-key", metavar="KEY", type=_path,
                   help="Ed25519 private key (from 'boardtalk keygen') to sign the manifest with (default: unsigned)")
    b.set_defaults(func=cmd_build)

    g = sub.add_parser("generate", help="stream a completion of one prompt",
                       description="Stream the model's continuation of one prompt (or, with --chat, its reply).")
    run_options(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="prompt text (this or --prompt-file is required)")
    src.add_argument("--prompt-file", metavar="FILE", type=_path,
                     help="UTF-8 file with the prompt text (this or --prompt is required)")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt as one user message in the model's chat template (default: continue the "
                        "prompt as raw text)")
    g.add_argument("--system", metavar="TEXT", help="system message; needs --chat (default: none)")
    g.add_argument("--truncate-prompt", action="store_true",
                   help="keep only the newest tokens of a prompt that does not fit the context (default: refuse it)")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object (ids, text, timings) at the end instead of streaming text "
                        "(default: stream text, stats on stderr)")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive streaming chat (Ctrl-C stops a reply, Ctrl-D quits)",
                       description="Interactive chat. The system message is computed once and reused every turn; "
                                   "when the conversation outgrows the context its oldest turns are left out.")
    run_options(c)
    c.add_argument("--system", metavar="TEXT", help="system message, prefilled once and always kept (default: none)")
    c.set_defaults(func=cmd_chat)

    pp = sub.add_parser("perplexity", help="perplexity of a text file (one window from its start)",
                        description="Perplexity of the first --max-tokens tokens of a text file, as one window.")
    run_options(pp, gen=False)
    pp.add_argument("--text-file", required=True, metavar="FILE", type=_path, help="UTF-8 text to score (required)")
    pp.add_argument("--max-tokens", type=_int_in(2), metavar="N",
                    help="tokens from the start of the file to score, 2 to the context size (default: 512, or the context if smaller)")
    pp.add_argument("--json", action="store_true",
                    help="print one JSON object instead of a line of text (default: text)")
    pp.set_defaults(func=cmd_perplexity)

    k = sub.add_parser("keygen", help="make an Ed25519 key pair for signing artifacts",
                       description="Write PREFIX.key (private, mode 0600) and PREFIX.pub (public: copy it to the "
                                   "boards that should trust artifacts signed with it). Needs 'cryptography'.")
    k.add_argument("--out", required=True, metavar="PREFIX", type=_path,
                   help="path prefix of the two files; existing files are never overwritten (required)")
    k.set_defaults(func=cmd_keygen)

    s = sub.add_parser("sign", help="sign an artifact's manifest with a private key",
                       description="Check every file of an artifact directory against its manifest, then write "
                                   "manifest.sig (Ed25519 over manifest.yaml).")
    s.add_argument("--artifact", required=True, metavar="DIR", type=_path, help="artifact directory to sign (required)")
    s.add_argument("--key", required=True, metavar="KEY", type=_path, help="private key from 'boardtalk keygen' (required)")
    s.set_defaults(func=cmd_sign)
    for name in COMMAND_MODULES:  # commands that live beside what they run
        importlib.import_module(name).add_commands(sub)
    return p


# ---------------------------------------------------------------------------------------------
# Entry point

def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that are the user's to fix: reported in one line, without a traceback."""
    import runtime
    from runtime.native import NativeError
    from runtime.signing import SignatureError
    from runtime.store import StoreError

    errors = [CliError, runtime.ArtifactError, runtime.ContextOverflow, runtime.ConfigError, runtime.SessionBusy,
              StoreError, SignatureError, NativeError, ValueError, OSError, ImportError, NotImplementedError]
    sources = sys.modules.get("models.sources")  # not loaded: it raised nothing
    if sources is not None:
        errors.append(sources.SourceError)
    return tuple(errors)


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror and e.filename:
        return f"{e.filename}: {e.strerror}"
    text = " ".join(str(e).split("\n")).strip()
    return text or type(e).__name__


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so flushing it at exit does not raise BrokenPipeError again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def main(argv=None) -> int:
    if sys.stdout is None or sys.stderr is None:  # started with fd 1 or 2 closed (>&-): output would vanish
        os.write(2, b"boardtalk: error: standard output is closed\n") if sys.stderr is not None else None
        return 2
    try:
        args = build_parser(for_build="build" in (sys.argv[1:] if argv is None else argv)).parse_args(argv)
        logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                            format="%(levelname)s %(name)s: %(message)s")
        return args.func(args)
    except KeyboardInterrupt:
        log.debug("interrupted", exc_info=True)
        print("\nboardtalk: interrupted" if _mid_line() else "boardtalk: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout closed early (| head): stop quietly
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except Exception as e:  # noqa: BLE001 - only user errors are caught, the rest re-raised below
        if not isinstance(e, _user_errors()):
            raise
        log.debug("error", exc_info=True)
        print(f"boardtalk: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_ERROR


def _mid_line() -> bool:
    """Whether the terminal's cursor is after streamed text (stdout and stderr the same tty)."""
    try:
        return sys.stdout.isatty() and sys.stderr.isatty()
    except (ValueError, OSError):
        return False


if __name__ == "__main__":  # python -m runtime.cli: run the imported module, whose CliError the command modules raise
    from runtime.cli import main as _main

    sys.exit(_main())
