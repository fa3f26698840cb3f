"""The board-side install: runtime/ imports and runs with nothing from models/ and none of the build
dependencies (issue #7, "Nothing from models/ on the board").

The fast test blocks every build-side module in a subprocess of this venv; the `install` test makes a
fresh venv with `pip install .` (the runtime dependencies only, from PyPI or pip's cache), loads a native
artifact there, generates, and reports the install's size.
"""
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD_SIDE = ("models", "gguf", "onnx", "onnxruntime", "tokenizers", "cryptography")
PROBE = r"""
import json, sys
BLOCK = %r
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCK:
            raise ImportError(f"build-side module {name} imported on the board side")
if %r:
    sys.meta_path.insert(0, Block())
import runtime
m = runtime.load(sys.argv[1])
ids = list(m.generate([5, 6, 7, 8], runtime.GenerationConfig(max_new_tokens=8, stop_ids=())))
text = "".join(m.chat([{"role": "user", "content": "hi"}], runtime.GenerationConfig(max_new_tokens=4)))
from runtime.cli import main
rc = main(["generate", "--artifact", sys.argv[1], "--prompt", "hello", "--max-new-tokens", "3"])
print(json.dumps({"ids": ids, "rc": rc, "loaded": sorted(k for k in sys.modules if k.split(".")[0] in BLOCK)}))
"""


def _probe(python, art, block=True, cwd=None):
    env = dict(os.environ, PYTHONPATH="")
    res = subprocess.run([python, "-c", PROBE % (BUILD_SIDE, block), str(art)], capture_output=True, text=True,
                         env=env, cwd=cwd or ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_runtime_runs_with_build_side_modules_blocked(tiny_artifacts):
    """A native artifact loads, generates, chats and runs the CLI's generate with models/, gguf, onnx,
    onnxruntime and tokenizers unimportable."""
    got = _probe(sys.executable, tiny_artifacts["native"])
    want = _probe(sys.executable, tiny_artifacts["native"], block=False)
    assert got["ids"] == want["ids"] and got["rc"] == 0 and got["loaded"] == []


@pytest.mark.install
def test_fresh_runtime_only_venv(tiny_artifacts, tmp_path):
    """pip install of the package alone (no extras) gives a working board runtime."""
    env_dir = tmp_path / "board-venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    res = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(ROOT)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    listed = subprocess.run([str(py), "-m", "pip", "list", "--format=json"], capture_output=True, text=True)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert not names & {"onnx", "gguf", "onnxruntime", "tokenizers", "cryptography"}, names
    got = _probe(str(py), tiny_artifacts["native"], block=False, cwd=tmp_path)  # the installed copy, not ROOT
    assert got["loaded"] == [] and got["rc"] == 0 and len(got["ids"]) == 8
    site = next((env_dir / "lib").glob("python3*/site-packages"))
    size = {p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for p in site.iterdir() if p.is_dir()}
    total = sum(size.values()) / 2**20
    numpy = sum(v for k, v in size.items() if k.startswith("numpy")) / 2**20
    pip_setuptools = sum(v for k, v in size.items() if k.startswith(("pip", "setuptools", "_distutils"))) / 2**20
    print(f"\nruntime-only install: {total:.1f} MiB in site-packages; numpy {numpy:.1f} MiB, pip/setuptools "
          f"{pip_setuptools:.1f} MiB, the rest {total - numpy - pip_setuptools:.1f} MiB")
