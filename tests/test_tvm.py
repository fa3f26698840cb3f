"""The tvm backend: build path and manifest, refusal on machines that cannot run it, numerics against the
float64 reference, and every behaviour test of tests/test_generate.py and tests/test_session.py run on it.

Without a GPU the backend is exercised through a CPU (LLVM) build of the same Relax model: same graph,
same TE kernels, same int8 KV scheme. With a GPU (marker ``cuda``) the same tests run on a CUDA build for
the Jetson target (sm_87 SASS + compute_87 PTX, JIT on newer GPUs): built here when TVM and nvcc are
installed, else taken from $BOARDTALK_TVM_CUDA_ARTIFACT (a tiny artifact built elsewhere with
``python tests/test_tvm.py OUT``).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import runtime

ROOT = Path(__file__).resolve().parents[1]


def _have_tvm() -> bool:
    import importlib.util

    return importlib.util.find_spec("tvm") is not None


def _have_nvcc() -> bool:
    from models.tvm_build import NVCC

    return Path(NVCC).exists() and shutil.which("aarch64-linux-gnu-gcc") is not None


needs_tvm = pytest.mark.skipif(not _have_tvm(), reason="needs TVM to build: pip install -e '.[tvm]'")


def _gpu_present() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def build_cuda_tiny(gguf, out) -> Path:
    from models.build import build_artifact

    build_artifact(str(gguf), out, board="jetson-orin-nano", backend="tvm", max_context=128)
    return Path(out)


@pytest.fixture(scope="session")
def tvm_cpu_artifact(tiny_gguf, tmp_path_factory, board_name):
    if not _have_tvm():
        pytest.skip("needs TVM to build: pip install -e '.[tvm]'")
    from conftest import _build

    return _build(tiny_gguf, tmp_path_factory, board_name, "tvm", "tiny-tvm", max_context=128)


@pytest.fixture(scope="session")
def cuda_build_here(tiny_gguf, tmp_path_factory):
    """The tiny model built here for the Jetson (CUDA) target, once per session."""
    if not (_have_tvm() and _have_nvcc()):
        pytest.skip("needs TVM, nvcc (CUDA 13, /usr/local/cuda-13.0) and aarch64-linux-gnu-gcc to build a CUDA artifact")
    return build_cuda_tiny(tiny_gguf, tmp_path_factory.mktemp("tvm-cuda-here") / "orin")


@pytest.fixture(scope="session")
def tvm_cuda_artifact(tiny_gguf, tmp_path_factory):
    if os.environ.get("BOARDTALK_TVM_CUDA_ARTIFACT"):
        return Path(os.environ["BOARDTALK_TVM_CUDA_ARTIFACT"])
    if not (_have_tvm() and _have_nvcc()):
        pytest.skip("needs TVM, nvcc (CUDA 13) and aarch64-linux-gnu-gcc to build a CUDA artifact")
    return build_cuda_tiny(tiny_gguf, tmp_path_factory.mktemp("tvm-cuda") / "a")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def tiny_model(request):
    """Overrides conftest's fixture for the behaviour tests imported below: the tiny model on the tvm backend."""
    if request.param == "cuda":
        if not _gpu_present():
            pytest.skip("needs an NVIDIA GPU (run on the GPU machine: pytest -m cuda tests/test_tvm.py)")
        art = request.getfixturevalue("tvm_cuda_artifact")
        return runtime.load(art, board="jetson-orin-nano")
    return runtime.load(request.getfixturevalue("tvm_cpu_artifact"))


# Every behaviour test that runs on `tiny_model` now also runs on the tvm backend (same names, this module).
from test_generate import *  # noqa: E402,F401,F403
from test_session import *  # noqa: E402,F401,F403
from test_generate import test_config_validation, test_greedy_ids_match_float64_reference  # noqa: E402
from test_session import test_close_while_another_thread_generates  # noqa: E402

del test_config_validation, test_greedy_ids_match_float64_reference, test_close_while_another_thread_generates


def test_tvm_logits_and_kv_codes_match_the_float64_reference(tiny_model, tiny_gguf):
    """fp32 activations: logits within float32 rounding of the float64 reference, and the int8 KV codes of
    layer 0 within one step of the reference's (a code may flip where x/scale lands on .5)."""
    from models.arch import read_gguf
    from models.reference import Reference

    ids = [5, 77, 100, 3, 9, 200, 13, 44, 1, 8, 150, 42]
    kvo = []
    ref = Reference(read_gguf(tiny_gguf)).forward(ids, kv_out=kvo)
    s = tiny_model.new_session()
    got = s.logits(ids).astype(np.float64)
    assert np.abs(got - ref).max() < 2e-4
    kv, sc = s.cache.kv[0, : len(ids)].astype(np.float64), s.cache.scale[0, : len(ids)].astype(np.float64)
    k0, v0 = kvo[0]
    want = np.concatenate([k0, v0], axis=1)  # (T, 2KVH, D)
    assert np.abs(kv * sc - want).max() <= sc.max() * 0.5 * 1.001 + 1e-6
    assert np.all(np.abs(kv).max(-1) == 127)


def test_tvm_prefill_chunks_and_decode_give_the_same_cache(tiny_model):
    """A token's K/V and logits do not depend on how the call was split (prefill vs chunks vs decode)."""
    ids = list(range(10, 40))
    a, b = tiny_model.new_session(), tiny_model.new_session()
    la = a.logits(ids)
    b.prefill(ids[:7])
    lb = [b.decode_step(t) for t in ids[7:]]
    diff = np.abs(a.cache.kv[:, :30].astype(int) - b.cache.kv[:, :30])
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01  # float sum order differs (GEMM vs GEMV schedule)
    assert np.abs(la[7:] - np.stack(lb)).max() < 1e-2


@needs_tvm
def test_decode_windows_switch_without_changing_results(tiny_gguf, tmp_path):
    """Decode attention scans a static window (128, 256, then the whole cache here): the step that crosses a
    window boundary gives the logits one prefill of the same ids gives."""
    from models.build import build_artifact

    build_artifact(str(tiny_gguf), tmp_path / "w", board="host", backend="tvm", max_context=300)
    m = runtime.load(tmp_path / "w")
    assert m.backend.windows == [128, 256, 300]
    ids = [(7 * i) % 250 + 3 for i in range(290)]
    a, b = m.new_session(), m.new_session()
    la = a.logits(ids)
    b.prefill(ids[:120])
    lb = np.stack([b.decode_step(t) for t in ids[120:]])
    assert np.abs(la[120:] - lb).max() < 1e-2


def test_cuda_build_writes_the_manifest_a_board_needs(cuda_build_here):
    """The Jetson artifact: a Relax executable per host (aarch64 board, x86_64 dev GPU), a fatbin of sm_87
    SASS + compute_87 PTX, and a manifest naming target, arch, PTX ISA and the CUDA major it needs."""
    art = cuda_build_here
    from runtime.artifact import load_manifest

    m = load_manifest(art)
    assert m.backend == "tvm" and m.target.board == "jetson-orin-nano" and m.target.cuda_arch == "sm_87"
    t = m.tvm
    assert t["device"] == "cuda" and t["cuda_arch"] == "sm_87" and t["ptx_arch"] == "compute_87"
    assert t["cuda_runtime_major"] == 13 and float(t["ptx_isa"]) >= 8.0
    assert t["libraries"] == {"aarch64-linux-gnu": "model-aarch64.so", "x86_64-linux-gnu": "model-x86_64.so"}
    for host, lib in t["libraries"].items():
        head = (art / lib).read_bytes()[:20]
        assert head[:4] == b"\x7fELF" and head[18] == (0xB7 if host.startswith("aarch64") else 0x3E)
        assert lib in m.files
    assert set(m.files) == {"tvm_weights.bin", "tvm.json", "tokenizer.bpe", *t["libraries"].values()}


def test_loading_a_cuda_artifact_without_a_gpu_names_what_is_missing(cuda_build_here):
    """On a machine without the NVIDIA driver (this CI machine), load fails with one line saying so."""
    if _gpu_present():
        pytest.skip("this machine has a GPU")
    art = cuda_build_here
    code = ("import runtime, sys\ntry:\n    runtime.load(sys.argv[1], board='jetson-orin-nano')\n"
            "except Exception as e:\n    print(type(e).__name__, e); sys.exit(3)\n")
    r = subprocess.run([sys.executable, "-c", code, str(art)], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 3, r.stderr[-2000:]
    msg = r.stdout.strip()
    assert msg.startswith("TvmUnavailable cannot run a CUDA artifact here") and "NVIDIA" in msg, msg


@needs_tvm
def test_tvm_build_refuses_other_schemes(tiny_gguf, tmp_path):
    from models.build import build_artifact

    with pytest.raises(ValueError, match="tvm backend runs GGUF Q4_1"):
        build_artifact(str(tiny_gguf), tmp_path / "x", board="host", backend="tvm", scheme="rtn-int4")


@pytest.mark.parametrize("windows", [[64, 128], [128, 64], ["128"], []])
def test_edited_decode_windows_are_refused(tvm_cpu_artifact, tmp_path, windows):
    """A manifest naming decode functions the library lacks is one ArtifactError line, not a TVM crash."""
    import yaml

    from runtime.artifact import ArtifactError

    dst = tmp_path / "a"
    shutil.copytree(tvm_cpu_artifact, dst)
    d = yaml.safe_load((dst / "manifest.yaml").read_text())
    d["tvm"]["decode_windows"] = windows
    (dst / "manifest.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(ArtifactError, match="decode_windows|no function decode64"):
        runtime.load(dst)


def test_manifest_without_tvm_libraries_is_refused(tvm_cpu_artifact, tmp_path):
    import yaml

    from runtime.artifact import ArtifactError

    dst = tmp_path / "a"
    shutil.copytree(tvm_cpu_artifact, dst)
    d = yaml.safe_load((dst / "manifest.yaml").read_text())
    d["tvm"]["libraries"] = {"x86_64-linux-gnu": "other.so"}
    (dst / "manifest.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(ArtifactError, match="other.so is used but not listed"):
        runtime.load(dst)


if __name__ == "__main__":  # build the tiny CUDA artifact for a GPU machine without TVM's compiler
    sys.path.insert(0, str(ROOT))
    from make_tiny_model import write_tiny_gguf

    out = Path(sys.argv[1])
    g = write_tiny_gguf(out.parent / "tiny.gguf")
    print(build_cuda_tiny(g, out))
