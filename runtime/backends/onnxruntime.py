"""ONNX Runtime backend: one session over the exported graph (see models/export_onnx.py for its I/O).

The graph carries the architecture it was built for (metadata ``boardtalk.architecture``); the
loader refuses a manifest that describes anything else, and checks the graph's cache inputs
against the config before any cache is allocated.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from ..artifact import ArtifactError
from ..kv_cache import KVCache

log = logging.getLogger(__name__)
ARCH_METADATA = "boardtalk.architecture"  # graph metadata key, written by models/export_onnx.py


def _ort():
    try:
        import onnxruntime
    except ImportError as e:  # pragma: no cover
        raise ImportError("the onnxruntime backend needs onnxruntime: pip install onnxruntime") from e
    return onnxruntime


class OrtBackend:
    name = "onnxruntime"
    kv_layout = "token-major"  # the live prefix cache.kv[:n] is one contiguous input, passed without a copy

    def __init__(self, manifest, art_dir: Path, threads: int, provider: str = "CPUExecutionProvider"):
        ort = _ort()
        self.cfg = cfg = manifest.architecture
        self.threads = threads
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # A graph this ORT version already optimized at build time needs no second pass (faster load).
        done = manifest.graph_optimized_by == f"onnxruntime {ort.__version__}" and provider == "CPUExecutionProvider"
        so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_DISABLE_ALL if done
                                       else ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
        so.log_severity_level = 3
        available = ort.get_available_providers()
        if provider not in available:
            log.warning("execution provider %s not available (have %s); using CPU", provider, available)
            provider = "CPUExecutionProvider"
        graph = art_dir / manifest.graph_file
        try:
            self.session = ort.InferenceSession(str(graph), so, providers=[provider])
        except Exception as e:  # ORT raises its own exception types for a graph it cannot read
            raise ArtifactError(f"{graph.name}: onnxruntime cannot load it ({str(e).splitlines()[0][:200]})") from None
        built_for = self.session.get_modelmeta().custom_metadata_map.get(ARCH_METADATA)
        if built_for is None or json.loads(built_for) != json.loads(json.dumps(cfg.to_dict(), sort_keys=True)):
            raise ArtifactError(f"manifest architecture does not match the graph's ({_diff(built_for, cfg.to_dict())}); "
                                "the manifest was edited or belongs to another artifact")
        want = {"past_kv": [cfg.n_layers, 2 * cfg.n_kv_heads, cfg.head_dim], "logits": [cfg.vocab]}
        shapes = {i.name: i.shape for i in self.session.get_inputs() + self.session.get_outputs()}
        for name, dims in want.items():
            if shapes.get(name, [None])[-len(dims):] != dims:
                raise ArtifactError(f"{graph.name}: {name} has shape {shapes.get(name)}, the manifest implies [..., "
                                    f"{', '.join(map(str, dims))}]")
        # ORT retries on the CPU when an available provider fails to start (e.g. onnxruntime-gpu without the CUDA
        # libraries it links): report the provider the session really has, not the one asked for.
        got = self.session.get_providers()
        if provider not in got:
            log.warning("execution provider %s failed to start (session has %s); running on the CPU", provider, got)
            provider = got[0]
        self.provider = provider
        self._outputs = ["logits", "present_kv", "present_scale"]
        log.info("onnxruntime %s session: %s, %d threads", ort.__version__, provider, threads)

    def new_cache(self, max_seq: int) -> KVCache:
        c = self.cfg
        return KVCache(max_seq, c.n_layers, c.n_kv_heads, c.head_dim, layer_major=False)

    def forward(self, cache: KVCache, ids: np.ndarray, logits_from: int) -> np.ndarray:
        start = len(cache)
        feeds = {
            "input_ids": ids,
            "position_ids": np.arange(start, start + ids.shape[0], dtype=np.int64)[None],
            "past_kv": cache.kv[:start],  # contiguous views of the live prefix: no copy
            "past_scale": cache.scale[:start],
            "logits_from": np.array([logits_from], np.int64),
        }
        logits, kv, scale = self.session.run(self._outputs, feeds)
        cache.append(ids, kv, scale)
        return logits

    def rewind(self, cache: KVCache, n: int) -> None:
        cache.rewind_to(n)

    def close(self) -> None:
        self.session = None


def _diff(built_for: str | None, manifest: dict) -> str:
    if built_for is None:
        return "the graph records none: rebuild the artifact with this boardtalk"
    g = json.loads(built_for)
    keys = sorted(k for k in set(g) | set(manifest) if g.get(k) != manifest.get(k))
    return ", ".join(f"{k}: manifest {manifest.get(k)!r}, graph {g.get(k)!r}" for k in keys[:4])
