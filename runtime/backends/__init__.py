"""Backends run one forward pass of the model over the int8 KV cache's live prefix.

A backend is any object with
    forward(ids (T,) int64, start: int, kv, scale, logits_from: int)
        -> (logits (T - logits_from, vocab) float32, present_kv (T, L, 2*KVH, D) int8, present_scale (T, L, 2*KVH, 1) float32)
where kv int8 and scale float32 are the whole cache (positions [0, start) live), token-major
(max_seq, L, 2*KVH, ...) unless the backend sets ``kv_layer_major = True`` ((L, max_seq, 2*KVH, ...)).
A backend may write the new positions in place and return views of them (a layer-major one must).
A new backend (TVM, an NPU) is a new module here plus an entry in ``open_backend``.
"""
from __future__ import annotations


def open_backend(manifest, art_dir, threads: int, provider: str, max_seq: int):
    if manifest.backend == "onnxruntime":
        from .onnxruntime import OrtBackend

        return OrtBackend(art_dir / manifest.graph_file, threads=threads, provider=provider,
                          optimized_by=manifest.graph_optimized_by)
    if manifest.backend == "native":
        from .native import NativeBackend

        return NativeBackend(art_dir / manifest.graph_file, art_dir / "native.json", manifest.architecture, max_seq, threads)
    raise NotImplementedError(f"backend {manifest.backend!r} is not available in this runtime build")
