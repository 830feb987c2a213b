"""Per-step logits equal transformers' MambaForCausalLM (cache path) within 1e-5.

The fixtures were made by tests/fixtures/make_hf_fixtures.py with transformers 5.23 and
torch 2.13 (CPU, float32), with every parameter perturbed away from HF's init.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from ssmserve.server.engine.loader import load_model
from tests.conftest import HF_CASES, HF_FIXTURES

TOLERANCE = 1e-5


def test_fixture_cases_cover_the_config_space() -> None:
    configs = [json.loads((HF_FIXTURES / c / "config.json").read_text()) for c in HF_CASES]
    assert len(configs) >= 4
    assert {c["conv_kernel"] for c in configs} >= {2, 3, 4, 5}
    assert {c["use_bias"] for c in configs} == {True, False}
    assert {c["use_conv_bias"] for c in configs} == {True, False}
    assert {c["tie_word_embeddings"] for c in configs} == {True, False}
    assert max(c["num_hidden_layers"] for c in configs) >= 3
    # intermediate_size that is not expand * hidden must be honoured
    assert any(c["intermediate_size"] != c["expand"] * c["hidden_size"] for c in configs)


@pytest.mark.parametrize("case", HF_CASES)
def test_logits_match_transformers_at_every_step(case: str) -> None:
    model = load_model(HF_FIXTURES / case)
    ids = np.load(HF_FIXTURES / case / "ids.npy")
    expected = np.load(HF_FIXTURES / case / "logits.npy")
    logits, _ = model.run(ids)
    assert logits.shape == expected.shape
    assert logits.dtype == np.float32
    per_step = np.abs(logits - expected).max(axis=1)
    assert per_step.max() <= TOLERANCE, f"worst step {per_step.argmax()}: {per_step.max():.3g}"
    # and the engine is not trivially close: logits vary across steps
    assert np.abs(np.diff(expected, axis=0)).max() > 0.1


def test_intermediate_size_overrides_expand() -> None:
    model = load_model(HF_FIXTURES / "conv2_intermediate_eps")
    assert model.config.intermediate_size == 40
    assert model.config.hidden_size * 2 == 32
