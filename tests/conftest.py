import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: uses the real SmolLM2-135M (downloads its wheel once); CI runs these")
    config.addinivalue_line("markers", "cuda: needs an NVIDIA GPU (run on the GPU machine)")
    config.addinivalue_line("markers", "board: needs a real Pi 5 / Jetson board")
    config.addinivalue_line("markers", "kernels: compiles C (host, and aarch64 cross + qemu-user)")
    config.addinivalue_line("markers", "install: makes a fresh venv and pip-installs the package (PyPI or pip's cache)")
    config.addinivalue_line("markers", "voice: runs the real voice engines (models from PyPI wheels)")


@pytest.fixture(scope="session")
def board_name():
    import boards

    return boards.detect().name


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    from make_tiny_model import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


BACKENDS = ["onnxruntime", "native"]


def _build(src, tmp_path_factory, board, backend, name, **kw):
    from models.build import build_artifact

    out = tmp_path_factory.mktemp(name) / name
    build_artifact(str(src), out, board=board, backend=backend, **kw)
    return out


@pytest.fixture(scope="session")
def tiny_artifacts(tiny_gguf, tmp_path_factory, board_name):
    return {b: _build(tiny_gguf, tmp_path_factory, board_name, b, f"tiny-{b}", max_context=128) for b in BACKENDS}


@pytest.fixture(scope="session")
def tiny_artifact(tiny_artifacts):
    return tiny_artifacts["onnxruntime"]


@pytest.fixture(params=BACKENDS)
def tiny_model(request, tiny_artifacts):
    """The tiny model on each backend: behaviour tests run on both."""
    import runtime

    return runtime.load(tiny_artifacts[request.param])


@pytest.fixture(scope="session")
def real_gguf():
    from models.sources import resolve_gguf

    return resolve_gguf("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def real_artifacts(real_gguf, tmp_path_factory, board_name):
    return {b: _build(real_gguf, tmp_path_factory, board_name, b, f"real-{b}", max_context=512) for b in BACKENDS}
