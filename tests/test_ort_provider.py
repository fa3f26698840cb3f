"""Which execution provider an onnxruntime artifact really runs on (issue #10, the CUDA EP check)."""
import logging

import numpy as np


def test_provider_that_fails_to_start_is_reported_as_cpu(tiny_artifact, monkeypatch, caplog):
    """Regression: OrtBackend.provider said CUDAExecutionProvider while the session ran on the CPU.

    onnxruntime-gpu lists CUDAExecutionProvider as available even when the CUDA libraries it links are missing;
    the session then starts on the CPU only. Here a CPU build is made to list CUDA, which gives the same session."""
    import onnxruntime

    import runtime
    from runtime.backends import open_backend

    real = onnxruntime.get_available_providers()
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", *real])
    m = runtime.load(tiny_artifact)
    with caplog.at_level(logging.WARNING, logger="runtime.backends.onnxruntime"):
        be = open_backend(m.manifest, tiny_artifact, threads=1, provider="CUDAExecutionProvider")
    assert be.session.get_providers() == ["CPUExecutionProvider"]
    assert be.provider == "CPUExecutionProvider"
    assert "failed to start" in caplog.text
    ids = np.asarray(m.chat_ids([{"role": "user", "content": "hi"}])[:4], np.int64)
    assert be.forward(be.new_cache(8), ids, 3).shape[-1] == m.manifest.architecture.vocab  # it still runs
    be.close()
    m.close()


def test_cuda_patch_keeps_the_arithmetic(tiny_artifact, tmp_path):
    """scripts/gpu_proof.py cuda-patch: the int8 KV QuantizeLinear (blocked; the CUDA EP fails on it with
    'Unsupported quantization type') becomes Div/Round/Clip/Cast with bit-identical logits and KV codes."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import onnx

    import runtime

    art = tmp_path / "patched"
    shutil.copytree(tiny_artifact, art)
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, str(root / "scripts" / "gpu_proof.py"), "cuda-patch", str(art)], check=True)
    graph = art / runtime.load(tiny_artifact).manifest.graph_file
    ops = {n.op_type for n in onnx.load(graph, load_external_data=False).graph.node}
    assert "QuantizeLinear" not in ops and {"Round", "Clip"} <= ops
    a, b = runtime.load(tiny_artifact), runtime.load(art)  # b: the manifest's sha256 was updated, it verifies
    ids = a.chat_ids([{"role": "user", "content": "hello there"}])
    np.testing.assert_array_equal(a.session.logits(ids), b.session.logits(ids))
    np.testing.assert_array_equal(a.session.decode_step(5), b.session.decode_step(5))
    n = len(a.session.cache)
    np.testing.assert_array_equal(a.session.cache.kv[:n], b.session.cache.kv[:n])
    np.testing.assert_array_equal(a.session.cache.scale[:n], b.session.cache.scale[:n])
    a.close()
    b.close()


def test_cuda_boards_get_the_kv_quantizer_the_cuda_ep_runs(tiny_gguf, tiny_artifact, tmp_path):
    """GPU check: an onnxruntime artifact for a Jetson failed its first forward on the CUDA EP ('Unsupported
    quantization type': its blocked QuantizeLinear is int4-only there) and needed scripts/gpu_proof.py
    cuda-patch. The build now emits Div/Round/Clip/Cast for boards whose provider is CUDA; the same numbers."""
    import onnx

    import runtime
    from models.build import build_artifact

    art = tmp_path / "orin"
    build_artifact(str(tiny_gguf), art, board="jetson-orin-nano", backend="onnxruntime", max_context=128)
    orin = runtime.load(art, board="jetson-orin-nano", threads=1)  # CUDA absent here: the CPU EP runs it
    ops = {n.op_type for n in onnx.load(art / orin.manifest.graph_file, load_external_data=False).graph.node}
    assert "QuantizeLinear" not in ops and {"Div", "Round", "Clip"} <= ops
    host = runtime.load(tiny_artifact, threads=1)
    ops = {n.op_type for n in onnx.load(tiny_artifact / host.manifest.graph_file, load_external_data=False).graph.node}
    assert "QuantizeLinear" in ops  # CPU boards keep the single node
    ids = host.chat_ids([{"role": "user", "content": "hello there"}])
    np.testing.assert_allclose(orin.session.logits(ids), host.session.logits(ids), atol=1e-4)
    n = len(host.session.cache)
    np.testing.assert_array_equal(orin.session.cache.kv[:n], host.session.cache.kv[:n])
    orin.close()
    host.close()
