"""The real SmolLM2-135M through each backend, as a user runs it (the CLI: tests/test_cli.py)."""
import pytest

import runtime
from runtime import GenerationConfig


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
