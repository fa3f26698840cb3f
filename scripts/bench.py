#!/usr/bin/env python3
"""Benchmark boardtalk against llama.cpp on the same model, token ids and threads, side by side.

    python scripts/bench.py                      # default artifact, 2 threads, 5 rounds
    python scripts/bench.py --artifact DIR --threads 4 --rounds 7 --json out.json

Each round runs each runtime in a fresh subprocess (so peak RSS and load time are its own),
alternating ours / llama.cpp to spread machine noise over both. Reported: median and
min-max over all measurements. llama.cpp (llama-cpp-python, the 'bench' extra) is skipped
with a note when it is not installed.

Figures: load time (warm page cache), TTFT of 64- and 256-token cold prompts, TTFT of a
voice-style turn (system prompt already cached, ~16 new tokens), decode tokens/s over 128
tokens (context 64 -> 192), peak RSS, KV bytes per position, perplexity of the first 512
tokens of the Apache-2.0 license text. Then each figure against its target (issue #3), and a
roofline: this machine's streaming read bandwidth (measured in the same run), the decode
floor it sets, prefill GMAC/s, and the per-phase profile of the native backend.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TEXT = ROOT / "tests" / "fixtures" / "apache-2.0.txt"
SYSTEM = "You are Pip, a friendly robot toy. Answer in one or two short sentences a child can understand."
USER = "Why is the sky blue during the day?"


def _prompts(tok_encode, chat_ids) -> dict:
    ids = tok_encode(TEXT.read_text(encoding="utf-8"))
    sys_ids = chat_ids([{"role": "system", "content": SYSTEM}], False)
    turn_ids = chat_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}], True)
    return {"p64": ids[:64], "p256": ids[:256], "p512": ids[:512], "sys": sys_ids, "turn": turn_ids}


def _read_prompts(args):
    """The token ids both workers use, made once by the driver (no worker loads the other's tokenizer)."""
    d = json.loads(Path(args.ids).read_text())
    return d["p64"], d["p256"], d["p512"], d["sys"], d["turn"]


def _peak_rss_mib() -> float:
    """This process's peak RSS. VmHWM belongs to the address space exec made, unlike ru_maxrss, which
    a child inherits from the parent's peak at fork (the driver's bandwidth buffer would count)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _argmax(x):
    import numpy as np

    return int(np.argmax(x))


# ---------------------------------------------------------------------------------------- workers
def worker_ours(args) -> dict:
    import numpy as np

    import regex  # noqa: F401  imports are not part of load time (for either runtime)
    import yaml

    import runtime

    backend = yaml.safe_load((Path(args.artifact) / "manifest.yaml").read_text())["backend"]
    if backend == "onnxruntime":  # only what this backend loads, so peak RSS is what a user would see
        import onnxruntime  # noqa: F401

    t0 = time.perf_counter()
    m = runtime.load(args.artifact, threads=args.threads, max_context=1024)
    load_s = time.perf_counter() - t0
    s = m.session  # the benchmark drives one session through its named steps
    p64, p256, p512, sys_ids, turn_ids = _read_prompts(args)
    out = {"load_s": [load_s], "ttft64_ms": [], "ttft256_ms": [], "voice_ms": [], "decode_tps": []}
    for _ in range(args.reps):
        for key, p in (("ttft64_ms", p64), ("ttft256_ms", p256)):
            s.reset()
            t = time.perf_counter()
            _argmax(s.prefill(p))
            out[key].append((time.perf_counter() - t) * 1e3)
        s.reset()
        s.prefill(sys_ids)
        t = time.perf_counter()
        n = s.cache.common_prefix(turn_ids)
        s.rewind_to(n)
        _argmax(s.prefill(turn_ids[n:]))
        out["voice_ms"].append((time.perf_counter() - t) * 1e3)
        out["voice_new_tokens"] = len(turn_ids) - n
        s.reset()
        tok = _argmax(s.prefill(p64))
        t = time.perf_counter()
        for _ in range(128):
            tok = _argmax(s.decode_step(tok))
        out["decode_tps"].append(128 / (time.perf_counter() - t))
    out["rss_mib"] = _peak_rss_mib()  # before perplexity, as for llama.cpp
    if hasattr(s.cache, "profile"):  # where the time goes: one more pass of each, with the session's timers on
        s.reset()
        s.cache.profile(True)
        tok = _argmax(s.prefill(p64))
        out["profile_prefill64_ms"] = {k: v * 1e3 for k, v in s.cache.profile(True).items()}
        for _ in range(128):
            tok = _argmax(s.decode_step(tok))
        out["profile_decode_ms"] = {k: v * 1e3 / 128 for k, v in s.cache.profile(False).items()}
    ppl, n = s.perplexity(p512)
    out["ppl"] = ppl
    out["ppl_tokens"] = n
    out["kv_bytes_per_pos"] = s.cache.bytes_per_position
    return out


def worker_llama(args) -> dict:
    import numpy as np
    from llama_cpp import Llama

    gguf = args.gguf
    p64, p256, p512, sys_ids, turn_ids = _read_prompts(args)  # our tokenizer's ids; tests prove llama.cpp's match
    t0 = time.perf_counter()
    llm = Llama(model_path=gguf, n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads, n_batch=512,
                logits_all=False, verbose=False)
    load_s = time.perf_counter() - t0
    out = {"load_s": [load_s], "ttft64_ms": [], "ttft256_ms": [], "voice_ms": [], "decode_tps": []}

    def rewind(n):
        llm._ctx.kv_cache_seq_rm(-1, n, -1)
        llm.n_tokens = n

    def last_logits():
        return llm.scores[llm.n_tokens - 1]

    for _ in range(args.reps):
        for key, p in (("ttft64_ms", p64), ("ttft256_ms", p256)):
            rewind(0)
            t = time.perf_counter()
            llm.eval(p)
            _argmax(last_logits())
            out[key].append((time.perf_counter() - t) * 1e3)
        rewind(0)
        llm.eval(sys_ids)
        t = time.perf_counter()
        rewind(len(sys_ids))
        llm.eval(turn_ids[len(sys_ids):])
        _argmax(last_logits())
        out["voice_ms"].append((time.perf_counter() - t) * 1e3)
        rewind(0)
        llm.eval(p64)
        tk = _argmax(last_logits())
        t = time.perf_counter()
        for _ in range(128):
            llm.eval([tk])
            tk = _argmax(last_logits())
        out["decode_tps"].append(128 / (time.perf_counter() - t))
    out["rss_mib"] = _peak_rss_mib()
    llm.close()
    # perplexity with every position's logits (f16 KV, llama.cpp's default)
    llm = Llama(model_path=gguf, n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads, n_batch=512,
                logits_all=True, verbose=False)
    llm.eval(p512)
    lg = np.asarray(llm.scores[: len(p512) - 1], np.float64)
    m = lg.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(lg - m).sum(-1, keepdims=True)))[:, 0]
    nll = (lse - lg[np.arange(len(p512) - 1), p512[1:]]).mean()
    out["ppl"] = float(np.exp(nll))
    out["ppl_tokens"] = len(p512) - 1
    out["kv_bytes_per_pos"] = 2 * 2 * 30 * 3 * 64  # f16 K and V, 30 layers x 3 kv heads x 64
    return out


# ---------------------------------------------------------------------------------------- driver
def _run_worker(which: str, args) -> dict | None:
    cmd = [sys.executable, __file__, "--worker", which, "--artifact", str(args.artifact), "--threads", str(args.threads),
           "--reps", str(args.reps), "--gguf", args.gguf, "--ids", args.ids]
    # one BLAS thread in both workers: neither runtime calls BLAS, and an idle OpenBLAS pool spinning
    # after import would take a core from whichever runtime is loading (runtime sets the same itself)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        print(f"  {which} worker failed:\n{res.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])


def _bandwidth(artifact: str, threads: int) -> float:
    """Streaming read GB/s of this machine with these threads, measured by the artifact's own kernel
    library (0 for an artifact without one)."""
    from runtime.artifact import load_manifest, open_artifact
    from runtime.native import read_bandwidth

    art = open_artifact(artifact)
    m = load_manifest(art)
    return read_bandwidth(art / m.kernels.file, threads) if m.kernels else 0.0


def _stat(xs):
    return statistics.median(xs), min(xs), max(xs)


ROWS = [  # key, label, unit, higher is better
    ("ttft64_ms", "TTFT 64-token prompt (cold)", "ms", False),
    ("ttft256_ms", "TTFT 256-token prompt (cold)", "ms", False),
    ("voice_ms", "TTFT voice turn (system cached)", "ms", False),
    ("decode_tps", "decode, context 64->192", "tok/s", True),
    ("load_s", "load (warm page cache)", "s", False),
    ("rss_mib", "peak RSS", "MiB", False),
    ("kv_bytes_per_pos", "KV cache per position", "B", False),
    ("ppl", "perplexity, 512 tokens", "", False),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", help="our artifact (default: the default host artifact, built if missing)")
    ap.add_argument("--gguf", help="GGUF for llama.cpp (default: the artifact's source model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="fresh-process rounds per runtime")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each figure inside a round")
    ap.add_argument("--no-llama", action="store_true", help="measure boardtalk only")
    ap.add_argument("--json", help="also write all raw figures here")
    ap.add_argument("--worker", choices=["ours", "llama"], help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        res = (worker_ours if args.worker == "ours" else worker_llama)(args)
        print(json.dumps(res))
        return 0
    import tempfile

    import runtime
    from models.sources import resolve_gguf

    if not args.artifact:
        args.artifact = runtime.default_artifact()
        try:
            runtime.load(args.artifact).close()
        except runtime.ArtifactError as e:  # missing, damaged or of an older format: (re)build it
            import boards
            from models.build import build_artifact

            print(f"building the default artifact ({e})", file=sys.stderr)
            build_artifact(runtime.DEFAULT_MODEL, args.artifact, board=boards.detect().name,
                           backend=runtime.default_backend())
    m = runtime.load(args.artifact)
    args.gguf = args.gguf or str(resolve_gguf(m.manifest.source["registry_name"]))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(_prompts(m.tokenizer.encode, m.chat_ids), f)
        args.ids = f.name
    del m
    have_llama = not args.no_llama
    if have_llama:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama-cpp-python not installed (pip install -e .[bench]); measuring boardtalk only", file=sys.stderr)
            have_llama = False
    bandwidth = _bandwidth(args.artifact, args.threads)
    runs: dict[str, list[dict]] = {"ours": [], "llama": []}
    for r in range(args.rounds):
        for which in ("ours", "llama") if have_llama else ("ours",):
            print(f"round {r + 1}/{args.rounds}: {which}", file=sys.stderr, flush=True)
            res = _run_worker(which, args)
            if res:
                runs[which].append(res)
    os.unlink(args.ids)
    # best of before and after: the machine is shared
    bandwidth = max(bandwidth, _bandwidth(args.artifact, args.threads))
    if not runs["ours"]:
        return 1

    def collect(which, key):
        xs = []
        for res in runs[which]:
            v = res.get(key)
            xs += v if isinstance(v, list) else [v]
        return xs

    print(f"\nSmolLM2-135M-Instruct, {args.threads} threads, {args.rounds} rounds x {args.reps} reps; "
          f"median [min-max]; voice turn = {runs['ours'][0].get('voice_new_tokens')} new tokens")
    hdr = f"{'figure':34} {'boardtalk':>26} {'llama.cpp':>26} {'ratio':>7}"
    print(hdr + "\n" + "-" * len(hdr))
    table = {}
    for key, label, unit, higher in ROWS:
        o = _stat(collect("ours", key))
        cell_o = f"{o[0]:.4g} [{o[1]:.4g}-{o[2]:.4g}] {unit}"
        cell_l, ratio = "-", ""
        if runs["llama"]:
            lv = _stat(collect("llama", key))
            cell_l = f"{lv[0]:.4g} [{lv[1]:.4g}-{lv[2]:.4g}] {unit}"
            ratio = f"{o[0] / lv[0]:.2f}x"
            table[key] = {"ours": o, "llama": lv}
        else:
            table[key] = {"ours": o}
        print(f"{label:34} {cell_o:>26} {cell_l:>26} {ratio:>7}")
    print("ratio = boardtalk / llama.cpp (lower is better except decode tok/s)")
    if runs["llama"]:
        _targets(table)
    roof = _roofline(args, runs, bandwidth)
    if args.json:
        Path(args.json).write_text(json.dumps({"table": table, "roofline": roof, "raw": runs}, indent=1))
    return 0


TARGETS = [  # issue #3: key, target ratio boardtalk / llama.cpp, higher is better
    ("ttft64_ms", 0.15, False), ("ttft256_ms", 0.2, False), ("voice_ms", 0.3, False), ("decode_tps", 3.0, True),
    ("rss_mib", 0.7, False), ("load_s", 1.0, False), ("ppl", 1.01, False)]


def _targets(table) -> None:
    print("\ntargets (ratio to llama.cpp in this run):")
    for key, target, higher in TARGETS:
        label = next(lbl for k, lbl, _, _ in ROWS if k == key)
        r = table[key]["ours"][0] / table[key]["llama"][0]
        met = r >= target if higher else r <= target
        print(f"  {label:34} {r:6.2f}x  target {'>=' if higher else '<='} {target}x  {'met' if met else 'NOT met'}")


def _model_bytes(arch: dict) -> tuple[float, float]:
    """(bytes of weights a decode step reads, MACs per token in the linear layers), from the tensor list
    the native backend reads (runtime/backends/native.py)."""
    from runtime.backends.native import tensor_bytes, tensor_spec

    spec = tensor_spec(arch).values()
    return (float(sum(tensor_bytes(*t) for t in spec)),
            float(sum(rows * cols for typ, rows, cols in spec if typ == "Q4_1x8")))


def _roofline(args, runs, bandwidth) -> dict:
    """Measured figures against what this machine could do at best: the decode floor is bytes read per
    token over the streaming read bandwidth; prefill is reported as achieved int8 GMAC/s."""
    from runtime.artifact import load_manifest, open_artifact

    arch = load_manifest(open_artifact(args.artifact), verify_files=False).architecture
    wbytes, macs = _model_bytes(arch)
    kv_pos = runs["ours"][0]["kv_bytes_per_pos"]
    out = {"bandwidth_gbs": bandwidth, "weight_bytes": wbytes, "linear_macs_per_token": macs}
    med = {k: statistics.median(sum(([r[k]] if not isinstance(r[k], list) else r[k] for r in runs["ours"]), []))
           for k in ("decode_tps", "ttft64_ms", "ttft256_ms")}
    print(f"\nroofline (boardtalk, {args.threads} threads):")
    step_bytes = wbytes + 128 * kv_pos  # weights + the KV cache at the mean decode context
    print(f"  decode reads {step_bytes / 1e6:.1f} MB per token ({wbytes / 1e6:.1f} MB weights, "
          f"{128 * kv_pos / 1e6:.2f} MB KV at context 128)")
    if bandwidth:
        floor_ms = step_bytes / (bandwidth * 1e9) * 1e3
        got_ms = 1e3 / med["decode_tps"]
        out.update(decode_floor_ms=floor_ms, decode_ms=got_ms)
        print(f"  streaming read bandwidth {bandwidth:.1f} GB/s -> decode floor {floor_ms:.2f} ms/token "
              f"({1e3 / floor_ms:.0f} tok/s); measured {got_ms:.2f} ms ({100 * floor_ms / got_ms:.0f} % of the floor)")
    for key, n in (("ttft64_ms", 64), ("ttft256_ms", 256)):
        gmacs = n * macs / (med[key] / 1e3) / 1e9
        out[f"prefill{n}_gmacs"] = gmacs
        print(f"  prefill {n}: {n * macs / 1e9:.2f} GMAC in the linear layers -> {gmacs:.0f} GMAC/s achieved")
    for which, key in (("decode, ms per token at context 64->192", "profile_decode_ms"),
                       ("prefill of 64 tokens, ms", "profile_prefill64_ms")):
        profs = [r[key] for r in runs["ours"] if key in r]
        if profs:
            phases = {k: statistics.median(p[k] for p in profs) for k in profs[0]}
            out[key] = phases
            print(f"  where the time goes, {which}: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
                  + f" (sum {sum(phases.values()):.2f})")
    return out


if __name__ == "__main__":
    sys.exit(main())
