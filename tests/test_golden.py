"""Exact greedy ids of SmolLM2-135M per backend (tests/fixtures/golden_smollm2.json, written by
tests/fixtures/make_golden_ids.py): a change that moves any id of the real model fails here."""
import json
from pathlib import Path

import pytest

from fixtures.make_golden_ids import MAX_NEW, PROMPTS, generate_all, key

GOLDEN = json.loads((Path(__file__).parent / "fixtures" / "golden_smollm2.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native", "onnxruntime"])
def test_greedy_ids_are_the_recorded_ones(real_artifacts, backend):
    import runtime

    assert GOLDEN["prompts"] == PROMPTS and GOLDEN["max_new_tokens"] == MAX_NEW
    m = runtime.load(real_artifacts[backend])
    k = key(m)
    if k not in GOLDEN["ids"]:
        pytest.skip(f"no golden ids recorded for {k} (recorded: {', '.join(GOLDEN['ids'])}); "
                    "run tests/fixtures/make_golden_ids.py on such a machine")
    got = generate_all(m)
    assert got == GOLDEN["ids"][k]
    assert all(len(ids) > 3 for ids in got)
