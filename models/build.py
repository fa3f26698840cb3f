"""Turn a model source into an artifact for one board: the interface the CLIs call.

    build_artifact("smollm2-135m-instruct", out_dir, board="host")
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

from runtime import store

from . import quant
from .arch import read_gguf
from .native_build import build_library
from .sources import resolve_gguf, sha256_file

log = logging.getLogger(__name__)

TOOL_VERSION = "boardtalk 0.1.0"
BACKENDS = ("onnxruntime", "native", "tvm")
KV_LAYOUT_SHAPES = {"token-major": "(position, layer, 2*kv_heads, head_dim)",
                    "layer-major": "(layer, position, 2*kv_heads, head_dim)"}


def kv_cache_fields(backend: str) -> dict:
    """What the manifest says of the KV cache: the scheme, and the layout the backend really uses."""
    from runtime.artifact import KV_SCHEME
    from runtime.backends import BACKENDS

    layout = BACKENDS[backend].kv_layout
    return {"scheme": KV_SCHEME, "dtype": "int8", "scale_dtype": "float32", "layout": layout,
            "shape": KV_LAYOUT_SHAPES[layout] + "; K heads then V heads; one scale per (position, layer, head)"}


def build_artifact(model: str, out_dir: str | Path, board: str = "host", backend: str = "onnxruntime",
                   scheme: str = "q4_1-exact", embedding: str = "q8_0", accuracy_level: int = 4,
                   max_context: int | None = None, optimize: bool | None = None,
                   progress: Callable[[int, int, str], None] | None = None, sign_key: str | Path | None = None):
    """Build into out_dir (replaced atomically); returns (Manifest, models.export_onnx.ExportReport).

    optimize: also run ONNX Runtime's graph optimizer now and ship its result, so the board loads
    faster (about 0.3 s less for SmolLM2); None = only when building for the board this runs on.
    sign_key: an Ed25519 private key (runtime.signing) to sign the manifest with.
    out_dir must be new, empty or an artifact (runtime.store.prepare_output); builds of one out_dir
    serialize, and the finished artifact is switched in atomically (docs/artifact-store.md).
    """
    import boards
    from runtime.artifact import write_manifest

    from .export_onnx import ExportOptions, build_graph, save
    from .tokenizer import bpe_file_text, stop_ids

    profile = boards.get(board)
    if backend not in BACKENDS:
        raise NotImplementedError(f"backend {backend!r}: known backends are {', '.join(BACKENDS)} (TVM is its own issue)")
    if scheme not in quant.SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; known: {', '.join(quant.SCHEMES)}")
    if backend in ("native", "tvm") and (scheme != "q4_1-exact" or embedding != "q8_0"):
        raise ValueError(f"the {backend} backend runs GGUF Q4_1 weights as stored (--scheme q4_1-exact --embedding q8_0)")
    out_dir = store.prepare_output(out_dir)  # refuse a bad out_dir before any download
    if sign_key is not None:  # and a key that cannot sign, before the long part
        from runtime.signing import check_private_key

        check_private_key(sign_key)
    t0 = time.monotonic()
    gguf_path = resolve_gguf(model)
    src = read_gguf(gguf_path)
    cfg = src.config
    bpe_text = bpe_file_text(src.tokenizer)  # an unsupported tokenizer fails here, before the long part
    ctx = min(max_context or profile.max_context, cfg.context_length)
    log.info("building %s for %s: %d layers, hidden %d, scheme %s, context %d", src.name, board, cfg.n_layers,
             cfg.hidden, scheme, ctx)
    with store.build_lock(out_dir), store.staging_dir(out_dir) as tmp:
        kernels = tvm_fields = None
        if backend == "tvm":  # models/tvm_build.py: Relax model compiled for the board's GPU
            from .tvm_build import build_tvm_files

            files, graph_info, tvm_fields, report = build_tvm_files(src, tmp, profile, ctx, progress)
        elif backend == "native":
            files, report = _native_files(src, tmp, progress)
            graph_info = {"file": files[0], "index": files[1]}
            kernels = build_library(board, tmp)
            files.append(kernels["file"])
        else:
            kv_quantizer = "round" if profile.provider == "CUDAExecutionProvider" else "quantizelinear"
            proto, report = build_graph(src, ExportOptions(scheme=scheme, embedding=embedding, accuracy_level=accuracy_level,
                                                           max_context=ctx, kv_quantizer=kv_quantizer), progress=progress)
            files = save(proto, tmp)
            del proto
            graph_info = {"file": files[0]}
            if optimize is None:
                optimize = board == boards.detect().name  # ORT's optimized graph may be specific to this CPU
            if optimize:
                files, graph_info = _optimize_graph(tmp, files)
        (tmp / "tokenizer.bpe").write_text(bpe_text, encoding="utf-8")
        files.append("tokenizer.bpe")
        s = quant.SCHEMES[scheme]
        fields = {
            "tool_version": TOOL_VERSION,
            "model": {"name": src.name, "architecture": cfg.to_dict(),
                      "source": {"file": gguf_path.name, "sha256": sha256_file(gguf_path), "registry_name": model}},
            "tokenizer": {"file": "tokenizer.bpe", "bos_id": src.tokenizer.bos_id, "eos_id": src.tokenizer.eos_id,
                          "stop_ids": stop_ids(src.tokenizer)},
            "chat_template": src.tokenizer.chat_template,
            "quantization": {"scheme": scheme, "bits": s.bits, "group_size": s.block_size, "symmetric": s.symmetric,
                             "embedding": embedding,
                             **({"accuracy_level": accuracy_level} if backend == "onnxruntime" else {})},
            "kv_cache": kv_cache_fields(backend),
            "backend": backend,
            "graph": graph_info,
            **({"kernels": {k: kernels[k] for k in ("file", "cpu_features", "cflags", "simd")}} if kernels else {}),
            **({"tvm": tvm_fields} if tvm_fields else {}),
            "target": {"board": profile.name, "triple": profile.triple, "cuda_arch": profile.cuda_arch},
            "max_context": ctx,
        }
        manifest = write_manifest(tmp, fields, files)
        if sign_key is not None:
            from runtime.signing import sign_manifest

            sign_manifest(tmp, sign_key)
        store.install(tmp, out_dir)
    log.info("artifact %s ready in %.1f s (%.1f MiB)", out_dir, time.monotonic() - t0,
             sum(f["size"] for f in manifest.files.values()) / 2**20)
    return manifest, report


def _optimize_graph(art_dir: Path, files: list[str]) -> tuple[list[str], dict]:
    """Replace the portable graph with ONNX Runtime's optimized one (fused ops, folded constants)."""
    import onnxruntime as ort

    graph, data = "model.opt.onnx", "model.opt.onnx.data"
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(art_dir / graph)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", data)
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    so.log_severity_level = 3
    ort.InferenceSession(str(art_dir / files[0]), so, providers=["CPUExecutionProvider"])
    for f in files:
        (art_dir / f).unlink()
    log.info("saved ONNX Runtime %s's optimized graph", ort.__version__)
    return [graph, data], {"file": graph, "optimized_by": f"onnxruntime {ort.__version__}"}


def _native_files(src, out: Path, progress):
    """The native backend's weights file: every tensor the C code reads, the linear layers and the
    embedding regrouped 8 rows at a time (bytes moved, never re-rounded), 64-byte aligned, plus its index."""
    import json

    import numpy as np

    from runtime.backends.native import ALIGN, INDEX_FILE, INDEX_FORMAT, SOURCE_TYPE, WEIGHTS_FILE, tensor_spec

    from .export_onnx import ExportReport

    if not src.config.tie_embeddings:
        raise NotImplementedError("untied output layers are not supported by the native backend yet")
    spec = tensor_spec(src.config)
    for name, (typ, _, _) in spec.items():
        t = src.tensors.get(name)
        if t is None or t.tensor_type.name != SOURCE_TYPE[typ]:
            found = "missing" if t is None else t.tensor_type.name
            raise ValueError(f"native backend needs {name} as {SOURCE_TYPE[typ]}, the GGUF has {found}; "
                             "use --backend onnxruntime")
    index, off = {}, 0
    with open(out / WEIGHTS_FILE, "wb") as f:
        for i, (name, (typ, rows, cols)) in enumerate(spec.items()):
            raw = np.asarray(src.tensors[name].data).view(np.uint8).reshape(rows, -1)
            if typ == "Q4_1x8":
                raw = quant.interleave_q4_1(raw, cols)
            elif typ == "Q8_0x8":
                raw = quant.interleave_q8_0(raw, cols)
            pad = -off % ALIGN
            f.write(b"\0" * pad)
            off += pad
            f.write(np.ascontiguousarray(raw).tobytes())
            index[name] = [off, int(raw.nbytes), typ]
            off += int(raw.nbytes)
            if progress and (i % 16 == 0 or i == len(spec) - 1):
                progress(i + 1, len(spec), "regroup weights")
    (out / INDEX_FILE).write_text(json.dumps({"format": INDEX_FORMAT, "file": WEIGHTS_FILE,
                                              "architecture": src.config.to_dict(), "tensors": index}, indent=0),
                                  encoding="utf-8")
    return [WEIGHTS_FILE, INDEX_FILE], ExportReport(weight_bytes=off, n_nodes=0, exact=True)
