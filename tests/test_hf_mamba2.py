"""Mamba-2: per-step logits equal transformers' Mamba2ForCausalLM within 1e-5, from the
weight formats real checkpoints use (F32, F16, BF16, sharded), and config.json as
transformers and other writers spell it.

The fixtures were made by tests/fixtures/make_hf_mamba2_fixtures.py with transformers
5.24 and torch 2.13 (CPU, float32), every parameter perturbed away from HF's init.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from ssmserve.server.engine.config import Architecture
from ssmserve.server.engine.loader import load_model
from ssmserve.server.engine.recurrent_state import BatchState
from ssmserve.server.errors import ModelFormatError

TOLERANCE = 1e-5
FIXTURES = Path(__file__).parent / "fixtures" / "hf2"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").exists())


def configs() -> list[dict]:
    return [json.loads((FIXTURES / c / "config.json").read_text()) for c in CASES]


def test_fixture_cases_cover_the_config_space() -> None:
    cs = configs()
    assert {c["n_groups"] for c in cs} == {1, 2, 4}
    assert {c["conv_kernel"] for c in cs} == {3, 4}
    assert {c["use_bias"] for c in cs} == {True, False}
    assert {c["use_conv_bias"] for c in cs} == {True, False}
    assert {c["tie_word_embeddings"] for c in cs} == {True, False}
    assert {c.get("dtype") for c in cs} >= {"float32", "float16", "bfloat16"}
    assert any(c["time_step_limit"][1] != math.inf for c in cs)  # a clamp that bites
    assert any((FIXTURES / c / "model.safetensors.index.json").exists() for c in CASES)


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers_at_every_step(case: str) -> None:
    model = load_model(FIXTURES / case)
    assert model.config.architecture is Architecture.MAMBA2_LM
    ids = np.load(FIXTURES / case / "ids.npy")
    expected = np.load(FIXTURES / case / "logits.npy")
    logits, _ = model.run(ids)
    assert logits.shape == expected.shape and logits.dtype == np.float32
    per_step = np.abs(logits - expected).max(axis=1)
    assert per_step.max() <= TOLERANCE, f"worst step {per_step.argmax()}: {per_step.max():.3g}"
    assert np.abs(np.diff(expected, axis=0)).max() > 0.1  # and the logits do move


@pytest.mark.parametrize("case", CASES)
def test_a_row_gives_the_same_bits_in_any_batch(case: str) -> None:
    """Batch invariance on the HF shapes: each session's logits and state are the same
    bits alone and at any position of a batch of sessions at different steps."""
    model = load_model(FIXTURES / case)
    ids = np.load(FIXTURES / case / "ids.npy")
    states = [model.run(ids[:t])[1] if t else model.new_state() for t in range(5)]
    batch, out = model.step(BatchState.stack(states), ids[5:10])
    for i, state in enumerate(states):
        alone, solo = model.step(BatchState.stack([state]), ids[5 + i : 6 + i])
        assert solo[0].tobytes() == out[i].tobytes()
        assert alone.session(0).bit_equal(batch.session(i))


def test_the_state_has_the_mamba2_shapes() -> None:
    model = load_model(FIXTURES / "g4_k4_untied_bf16")
    c = model.config
    layer = model.new_state().layers[0]
    assert layer.conv.shape == (c.intermediate_size + 2 * c.n_groups * c.state_size, 4)
    assert layer.ssm.shape == (c.num_heads, c.head_dim, c.state_size) == (8, 8, 16)
    assert c.state_bytes == c.num_hidden_layers * (192 * 4 + 8 * 8 * 16) * 4  # c = 64 + 2*4*16


def copy_case(tmp_path: Path, case: str) -> Path:
    target = tmp_path / case
    shutil.copytree(FIXTURES / case, target)
    return target


def rewrite(directory: Path, change) -> None:
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def test_infinity_may_be_spelt_either_way_and_architectures_may_be_missing(tmp_path) -> None:
    case = "g1_k4_tied"
    reference = load_model(FIXTURES / case)
    spelt = copy_case(tmp_path, case)

    def change(raw: dict) -> None:
        raw["time_step_limit"] = [0.0, {"__float__": "Infinity"}]
        del raw["architectures"]  # recognised by model_type "mamba2"

    rewrite(spelt, change)
    model = load_model(spelt)
    assert model.config.time_step_limit == (0.0, math.inf)
    assert model.fingerprint == reference.fingerprint


def test_a_sharded_checkpoint_with_a_missing_or_foreign_shard_is_refused(tmp_path) -> None:
    sharded = copy_case(tmp_path, "g2_k3_bias_untied_sharded")
    index = sharded / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    first = sorted(set(raw["weight_map"].values()))[0]
    (sharded / first).rename(sharded / "elsewhere.bin")
    with pytest.raises(ModelFormatError, match=f"shard '{first}' is missing"):
        load_model(sharded)
    (sharded / "elsewhere.bin").rename(sharded / first)
    name = next(iter(raw["weight_map"]))
    raw["weight_map"][name] = "../outside.safetensors"
    index.write_text(json.dumps(raw))
    with pytest.raises(ModelFormatError, match="file name in the model directory"):
        load_model(sharded)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda c: c.update(num_heads=5), "num_heads \\* head_dim"),
        (lambda c: c.update(n_groups=3), "multiple of n_groups"),
        (lambda c: c.update(time_step_limit=[0.5, 0.1]), "0 <= low < high"),
        (lambda c: c.update(time_step_limit=[0.0, "big"]), "bounds must be numbers"),
        (lambda c: c.update(time_step_limit=3), "must be \\[low, high\\]"),
        (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
        (lambda c: c.update(state_size=4), "has shape"),
    ],
)
def test_bad_mamba2_configs_are_refused_clearly(tmp_path, change, says) -> None:
    directory = copy_case(tmp_path, "g1_k4_tied")
    rewrite(directory, change)
    with pytest.raises(ModelFormatError, match=says):
        load_model(directory)
