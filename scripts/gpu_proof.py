#!/usr/bin/env python3
"""Prove a tvm (CUDA) or onnxruntime (CUDA EP) artifact on this machine's NVIDIA GPU, against the native backend.

    # on any machine with the native backend (writes the CPU side's greedy ids and perplexity):
    python scripts/gpu_proof.py reference --out docs/gpu_reference.json
    # on the GPU machine (only the runtime and the TVM runtime needed; no GGUF, no compiler):
    BOARDTALK_BOARD=jetson-orin-nano python scripts/gpu_proof.py run --artifact ART --reference docs/gpu_reference.json \
        --out-dir OUT
    # where ids parted, check the GPU's logits against the float64 reference (needs the GGUF; any machine):
    python scripts/gpu_proof.py bounds --logits OUT/gpu_logits.npz
    # the onnxruntime artifact on the CUDA EP (docs/gpu.md): build for a CUDA board, patch its KV quantizer, run
    boardtalk build --backend onnxruntime --board jetson-orin-nano --out ART
    python scripts/gpu_proof.py cuda-patch ART
    BOARDTALK_BOARD=jetson-orin-nano python scripts/gpu_proof.py run --backend onnxruntime --artifact ART --out-dir OUT

``--backend onnxruntime`` proves an onnxruntime artifact built for a CUDA board (``--board jetson-orin-nano``) on
``onnxruntime-gpu``'s CUDA execution provider instead: the same checks and figures, plus where each node runs
(ort_placement.txt: ORT's verbose node placement and a profile of a 64-token prefill and 8 decode steps).

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


def _nvsmi_used_mib() -> float:
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout
        return float(out.split()[0])
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):  # no NVIDIA GPU here
        return float("nan")


def _ort_placement(m, graph: Path, out_dir: Path, text: list[int]) -> list[str]:
    """Where ORT puts each node: its verbose placement log, and a profile of a prefill and decode steps.

    Replaces the model's session with a verbose, profiling one over the same graph and options (returns lines)."""
    import collections
    import gzip
    import os

    import onnxruntime as ort

    be = m.backend
    so = ort.SessionOptions()
    so.intra_op_num_threads = be.threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 0
    so.log_verbosity_level = 1
    so.enable_profiling = True
    so.profile_file_prefix = str(out_dir / "ort_profile")
    ort.set_default_logger_severity(0)
    log_path = out_dir / "ort_verbose.log"
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)  # ORT's C++ logger writes to fd 2
    old = be.session
    try:  # the session logs verbosely on every run too: keep fd 2 in the file until it is gone
        sess = ort.InferenceSession(str(graph), so, providers=[be.provider])
        be.session = sess
        s = m.session
        s.reset()
        s.prefill(text[:64])
        tok = 1
        for _ in range(8):
            tok = int(np.argmax(s.decode_step(tok)))
        prof = Path(sess.end_profiling())
    finally:
        be.session = old
        m.session.reset()
        sess = None
        os.dup2(saved, 2)
        os.close(fd)
        os.close(saved)
        ort.set_default_logger_severity(3)
    keep = ("providers", "placed on", "Node placements", "kernel not found", "Falling back", "fallback", "Memcpy",
            "Error", "error")
    raw = log_path.read_text(errors="replace").splitlines()
    lines = ["## ORT verbose log, placement lines"]
    lines += [ln[-300:] for ln in raw if any(k in ln for k in keep)][:400]
    placed = [i for i, ln in enumerate(raw) if "placed on" in ln]
    for i in placed:  # the node list that follows each 'placed on' line (same log site)
        for ln in raw[i + 1:i + 200]:
            if "VerifyEachNodeIsAssignedToAnEp" not in ln or "placed on" in ln:
                break
            lines.append(ln[-200:])
    if len(raw) > 20000:  # keep what comes back small
        log_path.write_text("\n".join(raw[:20000]) + "\n")
    ev = json.loads(prof.read_text())
    per = collections.defaultdict(lambda: [set(), 0.0])  # (op, provider) -> (node names, total us)
    for e in ev:
        a = e.get("args", {})
        if e.get("cat") == "Node" and "provider" in a and e["name"].endswith("_kernel_time"):
            k = (a.get("op_name"), a["provider"])
            per[k][0].add(e["name"])
            per[k][1] += e.get("dur", 0)
    tot = collections.Counter()
    for (op, pv), (names, us) in per.items():
        tot[pv] += us
    lines.append("\n## profile: one 64-token prefill + 8 decode steps (kernel time, all runs)")
    lines.append("kernel time per provider: " + ", ".join(f"{pv} {us / 1e3:.2f} ms" for pv, us in tot.items()))
    for (op, pv), (names, us) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"{op:36s} {pv:26s} {len(names):4d} nodes  {us / 1e3:8.2f} ms")
    (out_dir / "ort_profile.json.gz").write_bytes(gzip.compress(prof.read_bytes()))
    prof.unlink()
    return lines


def cmd_run(args) -> int:
    import runtime

    ref = json.loads(Path(args.reference).read_text())
    lines, res = [], {}

    def say(s=""):
        print(s, flush=True)
        lines.append(s)

    if args.backend == "onnxruntime":
        return _run_ort(args, ref, lines, res, say)
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
    loads, m = _warm_loads(args.artifact)
    res["load_s"] = loads
    res["gpu_mem_mib"] = (free_start - free_one) * 1024
    say(f"load (JIT cache warm): {_stat(loads)} s")
    say(f"GPU memory, first model + one session (cache {m.backend.cache_rows} rows) after a prefill and a decode "
        f"step: {(free_start - free_one) * 1024:.0f} MiB (device free memory before/after; of {total:.0f} GiB)")

    _checks(args, ref, m, lines, res, say)
    return 0


def _warm_loads(artifact, n: int = 3):
    """(seconds of n loads after the first, the last model, left open)."""
    import runtime

    loads = []
    for i in range(n):
        t0 = time.perf_counter()
        m = runtime.load(artifact, max_context=1024)
        loads.append(time.perf_counter() - t0)
        if i < n - 1:
            m.close()
    return loads, m


def _run_ort(args, ref, lines, res, say) -> int:
    import onnxruntime as ort

    import runtime

    used0 = _nvsmi_used_mib()
    t0 = time.perf_counter()
    m = runtime.load(args.artifact, max_context=1024)
    first = time.perf_counter() - t0
    m.session.prefill([1, 2, 3])
    m.session.decode_step(4)
    used1 = _nvsmi_used_mib()
    say(f"# onnxruntime artifact on onnxruntime {ort.__version__} ({ort.get_device()}), providers "
        f"{m.backend.session.get_providers()}")
    say(f"artifact: board {m.manifest.target.board}; available providers {ort.get_available_providers()}")
    say(f"first load: {first:.2f} s")
    m.close()
    loads, m = _warm_loads(args.artifact)
    if args.ort_options:  # e.g. use_tf32=0: the same graph on a session with these CUDA EP options
        opts = dict(kv.split("=", 1) for kv in args.ort_options.split(","))
        be = m.backend
        so = ort.SessionOptions()
        so.intra_op_num_threads = be.threads
        so.inter_op_num_threads = 1
        be.session = ort.InferenceSession(str(Path(args.artifact) / m.manifest.graph_file), so,
                                          providers=[(be.provider, opts)])
        say(f"session replaced: {be.provider} options {be.session.get_provider_options().get(be.provider)}")
    res["load_s"] = loads
    res["gpu_mem_mib"] = used1 - used0
    say(f"load: {_stat(loads)} s")
    say(f"GPU memory (nvidia-smi used, before load / after a prefill and a decode step): {used1 - used0:.0f} MiB")
    try:
        place = _ort_placement(m, Path(args.artifact) / m.manifest.graph_file, Path(args.out_dir), _text_ids(m))
    except Exception as e:  # the checks below still run
        place = [f"placement step failed: {type(e).__name__}: {e}"]
    (Path(args.out_dir) / "ort_placement.txt").write_text("\n".join(place) + "\n")
    say("\n".join(ln for ln in place if "placed on" in ln or "kernel time per provider" in ln))
    _checks(args, ref, m, lines, res, say)
    return 0


def _checks(args, ref, m, lines, res, say) -> None:
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
    dec = [m.session.decode_step(t) for t in chat[1:]]  # the decode path
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


def cmd_cuda_patch(args) -> int:
    """Rewrite an onnxruntime artifact's blocked int8 QuantizeLinear nodes (the KV cache's quantizer) as
    Div -> Round -> Clip -> Cast(int8): the same arithmetic (round half to even, saturate to int8), bit-identical on
    the CPU EP, but in ops the CUDA EP runs (its QuantizeLinear has blocked kernels for int4 only: 'Unsupported
    quantization type'). Updates the manifest's size and sha256 of the graph file. A diagnosis tool: the export
    (models/export_onnx.py) is where this belongs."""
    import hashlib

    import onnx
    import yaml
    from onnx import TensorProto, helper, numpy_helper

    art = Path(args.artifact)
    man_path = art / "manifest.yaml"
    graph = art / yaml.safe_load(man_path.read_text())["graph"]["file"]
    m = onnx.load(graph, load_external_data=False)
    m.graph.initializer.extend([numpy_helper.from_array(np.array(-128.0, np.float32), "cuda_patch_lo"),
                                numpy_helper.from_array(np.array(127.0, np.float32), "cuda_patch_hi")])
    nodes, done = [], 0
    for n in m.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type != "QuantizeLinear" or attrs.get("output_dtype") != TensorProto.INT8 or len(n.input) != 2:
            nodes.append(n)
            continue
        x, scale = n.input
        p = n.name
        nodes += [helper.make_node("Div", [x, scale], [p + "_div"], name=p + "_div"),
                  helper.make_node("Round", [p + "_div"], [p + "_round"], name=p + "_round"),
                  helper.make_node("Clip", [p + "_round", "cuda_patch_lo", "cuda_patch_hi"], [p + "_clip"],
                                   name=p + "_clip"),
                  helper.make_node("Cast", [p + "_clip"], [n.output[0]], name=p + "_cast", to=TensorProto.INT8)]
        done += 1
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    onnx.save(m, graph)
    data = graph.read_bytes()
    text = man_path.read_text()
    old = yaml.safe_load(text)["files"][graph.name]
    text = text.replace(old["sha256"], hashlib.sha256(data).hexdigest())
    man_path.write_text(text.replace(f"size: {old['size']}", f"size: {len(data)}"))
    print(f"{graph}: {done} int8 QuantizeLinear nodes rewritten; manifest updated")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reference", help="the native backend's greedy ids and perplexity, as JSON")
    r.add_argument("--native", help="a native artifact (default: build one for this host in --tmp)")
    r.add_argument("--tmp", default="/tmp", help="where to build the native artifact (default /tmp)")
    r.add_argument("--out", default=str(ROOT / "docs" / "gpu_reference.json"), help="(default docs/gpu_reference.json)")
    g = sub.add_parser("run", help="run the artifact on this GPU: ids, perplexity, logits, figures")
    g.add_argument("--artifact", required=True, help="the tvm (or, with --backend onnxruntime, onnxruntime) artifact")
    g.add_argument("--backend", choices=("tvm", "onnxruntime"), default="tvm",
                   help="the artifact's backend; onnxruntime runs on the board profile's provider, e.g. "
                        "BOARDTALK_BOARD=jetson-orin-nano for CUDAExecutionProvider (default tvm)")
    g.add_argument("--reference", default=str(ROOT / "docs" / "gpu_reference.json"),
                   help="output of `reference` (default docs/gpu_reference.json)")
    g.add_argument("--ort-options", default="",
                   help="onnxruntime only: execution provider options k=v,k=v for the measured session, e.g. "
                        "use_tf32=0 (default: none, ORT's defaults)")
    g.add_argument("--out-dir", default=".", help="where gpu_proof.txt/.json and gpu_logits.npz go (default .)")
    g.add_argument("--reps", type=int, default=10, help="repetitions of each timed figure (default 10)")
    b = sub.add_parser("bounds", help="check saved GPU logits against the float64 reference (needs the GGUF)")
    b.add_argument("--logits", required=True, help="gpu_logits.npz from `run`")
    c = sub.add_parser("cuda-patch", help="onnxruntime artifact: int8 QuantizeLinear -> ops the CUDA EP runs "
                                          "(in place; a diagnosis tool)")
    c.add_argument("artifact", help="an onnxruntime artifact directory (a copy: it is rewritten)")
    args = ap.parse_args()
    cmds = {"reference": cmd_reference, "run": cmd_run, "bounds": cmd_bounds, "cuda-patch": cmd_cuda_patch}
    try:
        return cmds[args.cmd](args)
    except (OSError, ValueError) as e:  # a wrong path or a file that is not what it should be: one line
        print(f"gpu_proof: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
