"""ONNX Runtime backend: one session over the exported graph (see models/export_onnx.py for its I/O)."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


def _ort():
    try:
        import onnxruntime
    except ImportError as e:  # pragma: no cover
        raise ImportError("the onnxruntime backend needs onnxruntime: pip install onnxruntime") from e
    return onnxruntime


class OrtBackend:
    def __init__(self, graph: Path, threads: int, provider: str = "CPUExecutionProvider", optimized_by: str | None = None):
        ort = _ort()
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # A graph this ORT version already optimized at build time needs no second pass (faster load).
        done = optimized_by == f"onnxruntime {ort.__version__}" and provider == "CPUExecutionProvider"
        so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_DISABLE_ALL if done
                                       else ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
        so.log_severity_level = 3
        available = ort.get_available_providers()
        if provider not in available:
            log.warning("execution provider %s not available (have %s); using CPU", provider, available)
            provider = "CPUExecutionProvider"
        self.session = ort.InferenceSession(str(graph), so, providers=[provider])
        self.provider = provider
        self._outputs = ["logits", "present_kv", "present_scale"]
        log.info("onnxruntime %s session: %s, %d threads", ort.__version__, provider, threads)

    def forward(self, ids: np.ndarray, start: int, kv: np.ndarray, scale: np.ndarray, logits_from: int):
        feeds = {
            "input_ids": ids,
            "position_ids": np.arange(start, start + ids.shape[0], dtype=np.int64)[None],
            "past_kv": kv[:start],  # contiguous views of the live prefix: no copy
            "past_scale": scale[:start],
            "logits_from": np.array([logits_from], np.int64),
        }
        return self.session.run(self._outputs, feeds)
