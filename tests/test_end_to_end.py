"""The real SmolLM2-135M through each backend and through the CLI, as a user runs it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import runtime
from runtime import GenerationConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnxruntime", "native"])
def test_real_model_answers(real_artifacts, backend):
    m = runtime.load(real_artifacts[backend])
    text = "".join(m.stream(m.tokenizer.encode("The capital of France is"), GenerationConfig(max_new_tokens=6)))
    assert "Paris" in text
    reply = "".join(m.chat([{"role": "user", "content": "What is the capital of Germany?"}],
                           GenerationConfig(max_new_tokens=16)))
    assert "Berlin" in reply and m.last_stats.finish_reason == "stop"
    assert "<|im_end|>" not in reply


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnxruntime", "native"])
def test_real_model_voice_turn_reuses_the_system_prompt(real_artifacts, backend):
    m = runtime.load(real_artifacts[backend])
    system = [{"role": "system", "content": "You are Pip, a friendly robot toy."}]
    n = m.warm_prefix(system)
    turn = system + [{"role": "user", "content": "Hi Pip!"}]
    warm = list(m.generate(m.chat_ids(turn), GenerationConfig(max_new_tokens=12)))
    assert m.last_stats.reused_tokens >= n
    m.reset()
    assert list(m.generate(m.chat_ids(turn), GenerationConfig(max_new_tokens=12))) == warm


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})), timeout=600)


@pytest.mark.parametrize("backend,progress", [("native", "regroup weights"), ("onnxruntime", "layer 1")])
def test_cli_build_generate_perplexity(tiny_gguf, tmp_path, backend, progress):
    out = tmp_path / "art"
    r = _cli("build", "--model", str(tiny_gguf), "--board", "host", "--backend", backend, "--out", str(out),
             "--max-context", "128")
    assert r.returncode == 0, r.stderr
    assert progress in r.stderr and str(out) in r.stdout  # progress went to stderr, the path to stdout
    r = _cli("generate", "--artifact", str(out), "--prompt", "the cat", "--max-new-tokens", "5", "--json",
             env={"BOARDTALK_BOARD": "host"})
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert len(res["token_ids"]) == 5 and res["prompt_ids"] and isinstance(res["text"], str)
    assert res["ttft_ms"] > 0 and res["decode_tokens_per_s"] > 0
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat " * 10)
    r = _cli("perplexity", "--artifact", str(out), "--text-file", str(text), "--max-tokens", "64", "--json",
             env={"BOARDTALK_BOARD": "host"})
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["n_tokens"] == 63 and res["ppl"] > 1


def test_cli_errors_are_clear(tmp_path):
    r = _cli("generate", "--artifact", str(tmp_path / "missing"), "--prompt", "x")
    assert r.returncode == 2 and "artifact not found" in r.stderr and "Traceback" not in r.stderr
    r = _cli("build", "--model", "no-such-model", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "unknown model 'no-such-model'" in r.stderr
    r = _cli("--help")
    assert r.returncode == 0 and "build" in r.stdout and "perplexity" in r.stdout
