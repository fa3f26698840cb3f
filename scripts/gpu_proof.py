#!/usr/bin/env python3
"""Prove a tvm (CUDA) artifact on whatever NVIDIA GPU this machine has, against the native CPU backend.

    # on any machine with the native backend (writes the CPU side's greedy ids and perplexity):
    python scripts/gpu_proof.py reference --out docs/gpu_reference.json
    # on the GPU machine (only the runtime and the TVM runtime needed; no GGUF, no compiler):
    BOARDTALK_BOARD=jetson-orin-nano python scripts/gpu_proof.py run --artifact ART --reference docs/gpu_reference.json \
        --out-dir OUT
    # where ids parted, check the GPU's logits against the float64 reference (needs the GGUF; any machine):
    python scripts/gpu_proof.py bounds --logits OUT/gpu_logits.npz

``run`` loads the artifact twice (the first load JIT-compiles the PTX when the GPU is not the artifact's
sm_87; the second shows the cached load time), generates greedy ids for every prompt and compares them with
the native backend's, computes the perplexity of the first 512 tokens of tests/fixtures/apache-2.0.txt,
saves the GPU's logits at every step where the ids part (and over one whole chat prompt) for ``bounds``,
and measures TTFT (64/256 tokens), decode tokens/s (context 64 -> 192), load time and GPU memory.
Bounds are the ones the CPU backends meet against the float64 reference (tests/test_parity.py):
max |logit error| < 4.0 and mean < 0.5. Perplexity must be within +1 % of the native backend's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

# tvm_ffi imports torch when it can (~4-6 s): a board has no torch, and neither needs it; keep load times honest
sys.modules.setdefault("torch", None)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
TEXT = ROOT / "tests" / "fixtures" / "apache-2.0.txt"
MAX_NEW = 32
PPL_TOKENS = 512
MAX_ABS, MEAN_ABS = 4.0, 0.5  # tests/test_parity.py: what native and onnxruntime meet on SmolLM2
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence, please."}]
EXTRA_PROMPTS = [
    [{"role": "user", "content": "Name a planet in our solar system."}],
    [{"role": "user", "content": "How do I boil an egg?"}],
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Count from one to ten."}],
    [{"role": "user", "content": "What does a bee make?"}],
]


def prompts() -> list:
    from fixtures.make_golden_ids import PROMPTS

    return PROMPTS + EXTRA_PROMPTS


def _greedy(model) -> list[list[int]]:
    import runtime

    cfg = runtime.GenerationConfig(max_new_tokens=MAX_NEW)
    return [list(model.generate(model.chat_ids(p), cfg)) for p in prompts()]


def _text_ids(model) -> list[int]:
    return model.tokenizer.encode(TEXT.read_text(encoding="utf-8"))[:PPL_TOKENS]


def cmd_reference(args) -> int:
    import runtime
    from models.build import build_artifact

    art = Path(args.native) if args.native else Path(args.tmp) / "native-ref"
    if not args.native:
        build_artifact("smollm2-135m-instruct", art, board="host", backend="native", max_context=1024)
    m = runtime.load(art, max_context=1024)
    ids = _greedy(m)
    ppl, n = m.session.perplexity(_text_ids(m))
    out = {"backend": "native", "kernels": f"{m.manifest.kernels.simd} {' '.join(m.manifest.kernels.cflags)}",
           "prompts": prompts(), "max_new_tokens": MAX_NEW, "ids": ids, "ppl": ppl, "ppl_tokens": n}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"native: {len(ids)} prompts, perplexity {ppl:.4f} over {n} tokens -> {args.out}")
    return 0


def _stat(xs) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def _gpu_mem(backend) -> tuple[float, float]:
    """(free, total) GiB of the GPU, from the TVM runtime."""
    attr = backend.ffi.get_global_func("runtime.GetDeviceAttr")
    return attr(2, 0, 15) / 2**30, attr(2, 0, 14) / 2**30


def cmd_run(args) -> int:
    import runtime

    ref = json.loads(Path(args.reference).read_text())
    lines, res = [], {}

    def say(s=""):
        print(s, flush=True)
        lines.append(s)

    from runtime.backends.tvm import _load_runtime

    ffi = _load_runtime(cuda=True)
    attr = ffi.get_global_func("runtime.GetDeviceAttr")
    free_start = attr(2, 0, 15) / 2**30  # before anything of ours is on the GPU
    t0 = time.perf_counter()
    m = runtime.load(args.artifact, max_context=1024)
    first = time.perf_counter() - t0
    be = m.backend
    s = m.session
    s.prefill([1, 2, 3])
    s.decode_step(4)
    free_one = attr(2, 0, 15) / 2**30
    gpu = f"{attr(2, 0, 5)} (compute capability {attr(2, 0, 4)})"
    man = m.manifest
    say(f"# tvm artifact on {gpu}")
    say(f"artifact: board {man.target.board}, {man.tvm.get('cuda_arch')} SASS + {man.tvm.get('ptx_arch')} PTX "
        f"(ISA {man.tvm.get('ptx_isa')}), CUDA runtime {man.tvm.get('cuda_runtime_major')}, TVM {man.tvm.get('tvm_version')}")
    say(f"first load (includes the PTX JIT where the GPU is not {man.tvm.get('cuda_arch')}): {first:.2f} s")
    _, total = _gpu_mem(be)
    m.close()
    loads = []
    for i in range(3):
        t0 = time.perf_counter()
        m = runtime.load(args.artifact, max_context=1024)
        loads.append(time.perf_counter() - t0)
        if i < 2:
            m.close()
    res["load_s"] = loads
    res["gpu_mem_mib"] = (free_start - free_one) * 1024
    say(f"load (JIT cache warm): {_stat(loads)} s")
    say(f"GPU memory, first model + one session (cache {m.backend.cache_rows} rows) after a prefill and a decode "
        f"step: {(free_start - free_one) * 1024:.0f} MiB (device free memory before/after; of {total:.0f} GiB)")

    # ---- greedy ids against the native backend's
    say("\n## greedy ids, 8 prompts x 32 new tokens, against the native backend "
        f"({ref['kernels']})")
    ids = _greedy(m)
    parted, saved = [], {}
    for i, (got, want) in enumerate(zip(ids, ref["ids"])):
        same = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if same is None and len(got) != len(want):
            same = min(len(got), len(want))
        prompt = m.chat_ids(prompts()[i])
        if same is None:
            say(f"prompt {i}: identical ({len(got)} ids)")
            continue
        parted.append(i)
        prefix = prompt + want[:same]
        m.session.reset()  # logits() feeds ids after what is cached
        lg = m.session.logits(prefix)[-1]
        saved[f"p{i}_ids"] = np.array(prefix, np.int64)
        saved[f"p{i}_logits"] = lg.astype(np.float32)
        top2 = np.sort(lg)[-2:]
        say(f"prompt {i}: ids part at new token {same} (gpu {got[same] if same < len(got) else 'end'}, native "
            f"{want[same] if same < len(want) else 'end'}); gpu top-2 logit gap there {top2[1] - top2[0]:.3f}")
    res["identical_prompts"] = len(ids) - len(parted)
    chat = m.chat_ids(CHAT)
    saved["chat_ids"] = np.array(chat, np.int64)
    m.session.reset()
    saved["chat_logits"] = m.session.logits(chat).astype(np.float32)  # one prefill call
    m.session.reset()
    m.session.prefill(chat[:1])
    dec = [m.session.decode_step(t) for t in chat[1:]]  # the decode path (one CUDA graph per token)
    saved["chatdec_ids"] = np.array(chat, np.int64)
    saved["chatdec_logits"] = np.stack(dec).astype(np.float32)
    np.savez_compressed(Path(args.out_dir) / "gpu_logits.npz", **saved)
    say(f"{len(ids) - len(parted)} of {len(ids)} prompts identical; logits saved for the bounds check "
        f"(gpu_logits.npz: every parting step + all {len(chat)} positions of one chat prompt)")

    # ---- perplexity
    text = _text_ids(m)
    ppl, n = m.session.perplexity(text)
    rel = ppl / ref["ppl"] - 1
    res.update(ppl=ppl, ppl_native=ref["ppl"])
    say(f"\n## perplexity, first {n + 1} tokens of apache-2.0.txt\ngpu {ppl:.4f}, native {ref['ppl']:.4f}: "
        f"{rel * 100:+.2f} % ({'within' if rel <= 0.01 else 'NOT within'} +1 %)")

    # ---- figures
    s = m.session
    p64, p256 = text[:64], text[:256]
    for _ in range(3):  # warm-up: graph capture, allocator pools
        s.reset()
        s.prefill(p256)
        s.reset()
        s.prefill(p64)
        s.decode_step(1)
    tt = {"ttft64_ms": [], "ttft256_ms": [], "decode_tps": []}
    for _ in range(args.reps):
        for key, p in (("ttft64_ms", p64), ("ttft256_ms", p256)):
            s.reset()
            t0 = time.perf_counter()
            int(np.argmax(s.prefill(p)))
            tt[key].append((time.perf_counter() - t0) * 1e3)
        s.reset()
        tok = int(np.argmax(s.prefill(p64)))
        t0 = time.perf_counter()
        for _ in range(128):
            tok = int(np.argmax(s.decode_step(tok)))
        tt["decode_tps"].append(128 / (time.perf_counter() - t0))
    res.update(tt)
    say(f"\n## figures ({args.reps} repetitions; median [min-max])")
    say(f"TTFT 64-token prompt:  {_stat(tt['ttft64_ms'])} ms")
    say(f"TTFT 256-token prompt: {_stat(tt['ttft256_ms'])} ms")
    say(f"decode, context 64->192: {_stat(tt['decode_tps'])} tok/s")
    (Path(args.out_dir) / "gpu_proof.json").write_text(json.dumps(res, indent=1))
    (Path(args.out_dir) / "gpu_proof.txt").write_text("\n".join(lines) + "\n")
    return 0


def cmd_bounds(args) -> int:
    """GPU logits (from ``run``) against the float64 reference on the same ids."""
    from models.arch import read_gguf
    from models.reference import Reference
    from models.sources import resolve_gguf

    d = np.load(args.logits)
    ref = Reference(read_gguf(resolve_gguf("smollm2-135m-instruct")))
    ok = True
    for key in sorted(k for k in d.files if k.endswith("_ids")):
        name = key[:-4]
        ids, got = d[key], d[f"{name}_logits"].astype(np.float64)
        want = ref.forward(ids)
        want = want[-1] if got.ndim == 1 else want[len(want) - len(got):]
        err = np.abs(got - want)
        agree = float((got.argmax(-1) == want.argmax(-1)).mean())
        good = err.max() < MAX_ABS and err.mean() < MEAN_ABS
        ok &= bool(good)
        print(f"{name}: {len(ids)} ids, logit error vs float64 max {err.max():.4f} mean {err.mean():.5f}, top-1 "
              f"agreement {agree:.3f} ({'within' if good else 'NOT within'} the CPU backends' bounds "
              f"max < {MAX_ABS}, mean < {MEAN_ABS})")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reference", help="the native backend's greedy ids and perplexity, as JSON")
    r.add_argument("--native", help="a native artifact (default: build one for this host in --tmp)")
    r.add_argument("--tmp", default="/tmp", help="where to build the native artifact (default /tmp)")
    r.add_argument("--out", default=str(ROOT / "docs" / "gpu_reference.json"), help="(default docs/gpu_reference.json)")
    g = sub.add_parser("run", help="run the tvm artifact on this GPU: ids, perplexity, logits, figures")
    g.add_argument("--artifact", required=True, help="the tvm artifact directory")
    g.add_argument("--reference", default=str(ROOT / "docs" / "gpu_reference.json"),
                   help="output of `reference` (default docs/gpu_reference.json)")
    g.add_argument("--out-dir", default=".", help="where gpu_proof.txt/.json and gpu_logits.npz go (default .)")
    g.add_argument("--reps", type=int, default=10, help="repetitions of each timed figure (default 10)")
    b = sub.add_parser("bounds", help="check saved GPU logits against the float64 reference (needs the GGUF)")
    b.add_argument("--logits", required=True, help="gpu_logits.npz from `run`")
    args = ap.parse_args()
    return {"reference": cmd_reference, "run": cmd_run, "bounds": cmd_bounds}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
