"""``boardtalk``: build artifacts, generate, chat, measure perplexity.

Without --artifact, generate/chat/perplexity use (and on first use build) the default
model's artifact for this board under the cache dir ($BOARDTALK_CACHE or ~/.cache/boardtalk).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path


def _progress(i: int, n: int, what: str) -> None:
    width = 30
    done = int(width * i / max(n, 1))
    print(f"\r  [{'#' * done}{'.' * (width - done)}] {i}/{n} {what:<14}", end="" if i < n else "\n", file=sys.stderr,
          flush=True)


def _artifact(args) -> Path:
    import runtime

    if args.artifact:
        return Path(args.artifact)
    import boards

    board = args.board or boards.detect().name
    backend = runtime.default_backend()
    path = runtime.default_artifact(board=board, backend=backend)
    stale = _stale(path)
    if stale or not (path / "manifest.yaml").exists():
        from models.build import build_artifact
        from models.sources import DEFAULT_MODEL

        why = f"{stale}; rebuilding" if stale else "no artifact yet; building"
        print(f"boardtalk: {why} the default one ({backend}) at {path} (once)", file=sys.stderr)
        build_artifact(DEFAULT_MODEL, path, board=board, backend=backend, progress=_progress)
    return path


def _stale(path: Path) -> str | None:
    """Why the cached default artifact cannot be read by this boardtalk (an older format), or None."""
    from runtime.artifact import FORMAT_VERSION

    try:
        import yaml

        version = yaml.safe_load((path / "manifest.yaml").read_text(encoding="utf-8")).get("format_version")
    except (OSError, AttributeError, ValueError, ImportError):
        return None  # missing (built below) or damaged (loading reports it)
    if version != FORMAT_VERSION:
        return f"the default artifact has format {version}, this boardtalk reads {FORMAT_VERSION}"
    return None


def _load(args):
    import runtime

    return runtime.load(_artifact(args), threads=args.threads, board=args.board, max_context=args.max_context)


def _config(args):
    import runtime

    return runtime.GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                    top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                                    stop_strings=tuple(args.stop or ()))


def cmd_build(args) -> int:
    from models.build import build_artifact
    from models.sources import MODELS

    import boards

    args.board = args.board or boards.detect().name
    out = Path(args.out) if args.out else None
    if out is None:
        import runtime

        out = runtime.default_artifact(args.model if args.model in MODELS else Path(args.model).stem, args.board,
                                       args.backend)
    print(f"building {args.model} for {args.board} ({args.backend}, {args.scheme}) -> {out}", file=sys.stderr)
    t0 = time.monotonic()
    manifest, report = build_artifact(args.model, out, board=args.board, backend=args.backend, scheme=args.scheme,
                                      embedding=args.embedding, accuracy_level=args.accuracy_level,
                                      max_context=args.max_context, progress=_progress)
    size = sum(f["size"] for f in manifest.files.values())
    print(f"done in {time.monotonic() - t0:.1f} s: {size / 2**20:.1f} MiB, {report.n_nodes} graph nodes; "
          f"worst weight error {report.worst_max_abs:.3g} ({report.worst_tensor or '-'}), "
          f"lm_head error {report.errors['lm_head'].max_abs:.3g}")
    print(out)
    return 0


def cmd_generate(args) -> int:
    model = _load(args)
    if args.prompt_file:
        text = Path(args.prompt_file).read_text(encoding="utf-8")
    else:
        text = args.prompt
    if args.chat:
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": text}]
        ids = model.chat_ids(msgs)
    else:
        ids = model.tokenizer.encode(text)
    cfg = _config(args)
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
                          "finish_reason": st.finish_reason}, ensure_ascii=False))
    else:
        print()
        print(f"[{st.prompt_tokens} prompt tokens, {st.new_tokens} new; first token {st.ttft_s * 1e3:.0f} ms, "
              f"{st.decode_tokens_per_s:.1f} tok/s; {st.finish_reason}]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    import runtime

    model = _load(args)
    cfg = _config(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    if history:
        model.warm_prefix(history)
    print("boardtalk chat: type a message, empty line or Ctrl-D to quit, /reset to start over.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        cancel = runtime.CancelToken()
        reply = []
        try:
            for delta in model.chat(history, cfg, cancel):
                reply.append(delta)
                print(delta, end="", flush=True)
        except KeyboardInterrupt:
            cancel.cancel()
        st = model.last_stats
        print(f"\n[{st.ttft_s * 1e3:.0f} ms to first token, {st.decode_tokens_per_s:.1f} tok/s, "
              f"{st.reused_tokens} cached]", file=sys.stderr)
        history.append({"role": "assistant", "content": "".join(reply)})


def cmd_perplexity(args) -> int:
    model = _load(args)
    text = Path(args.text_file).read_text(encoding="utf-8")
    ids = model.tokenizer.encode(text)[: args.max_tokens]
    t0 = time.monotonic()
    ppl, n = model.perplexity(ids)
    dt = time.monotonic() - t0
    if args.json:
        print(json.dumps({"ppl": ppl, "n_tokens": n, "seconds": round(dt, 3)}))
    else:
        print(f"ppl {ppl:.4f} over {n} predicted tokens ({dt:.1f} s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from models.quant import EMBEDDING_SCHEMES, SCHEMES
    from models.sources import DEFAULT_MODEL, MODELS

    import boards

    p = argparse.ArgumentParser(prog="boardtalk", description="On-device streaming LLM runtime for edge boards.",
                                epilog="Run 'boardtalk COMMAND --help' for each command's options.")
    p.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="turn a model into an artifact for a board",
                       description="Convert a registered model (or a local .gguf) into a verified INT4 artifact.")
    b.add_argument("--model", default=DEFAULT_MODEL, help=f"registry name ({', '.join(MODELS)}) or path to a .gguf")
    b.add_argument("--backend", default="native", choices=["native", "onnxruntime"],
                   help="native: C kernels over the GGUF's own blocks, regrouped 8 rows at a time (fastest, "
                        "least memory); onnxruntime: portable INT4 ONNX graph")
    b.add_argument("--board", choices=list(boards.PROFILES), help="target board profile (default: this machine's)")
    b.add_argument("--out", help="artifact directory (default: the cache's default artifact path)")
    b.add_argument("--scheme", default="q4_1-exact", choices=list(SCHEMES), help="linear-layer quantization")
    b.add_argument("--embedding", default="q8_0", choices=list(EMBEDDING_SCHEMES), help="tied lm_head quantization")
    b.add_argument("--accuracy-level", type=int, default=4, choices=[0, 1, 2, 3, 4],
                   help="MatMulNBits accuracy level: 4 = int8 activations (fast), 0 = fp32")
    b.add_argument("--max-context", type=int, help="positions the artifact supports (default: the board's)")
    b.set_defaults(func=cmd_build)

    def common(sp, gen=True):
        sp.add_argument("--artifact", help="artifact directory or tarball (default: build/use the default one)")
        sp.add_argument("--board", help="run as this board profile (default: detect)")
        sp.add_argument("--threads", type=int, help="compute threads (default: the board's)")
        sp.add_argument("--max-context", type=int, help="KV cache positions (default: the board's)")
        if gen:
            sp.add_argument("--max-new-tokens", type=int, default=256)
            sp.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
            sp.add_argument("--top-k", type=int, default=0)
            sp.add_argument("--top-p", type=float, default=1.0)
            sp.add_argument("--repetition-penalty", type=float, default=1.0)
            sp.add_argument("--seed", type=int)
            sp.add_argument("--stop", action="append", help="stop string (repeatable)")

    g = sub.add_parser("generate", help="stream a completion of one prompt")
    common(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file with the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as one user message in the chat template")
    g.add_argument("--system", help="system message (with --chat)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive streaming chat")
    common(c)
    c.add_argument("--system", help="system message (prefilled once, reused every turn)")
    c.set_defaults(func=cmd_chat)

    pp = sub.add_parser("perplexity", help="perplexity of a text file (one window from its start)")
    common(pp, gen=False)
    pp.add_argument("--text-file", required=True)
    pp.add_argument("--max-tokens", type=int, default=512)
    pp.add_argument("--json", action="store_true")
    pp.set_defaults(func=cmd_perplexity)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                        format="%(levelname)s %(name)s: %(message)s")
    from runtime import ArtifactError, ContextOverflow
    from models.sources import SourceError

    try:
        return args.func(args)
    except (ArtifactError, ContextOverflow, SourceError, ValueError, FileNotFoundError) as e:
        print(f"boardtalk: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
