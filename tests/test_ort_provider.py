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
