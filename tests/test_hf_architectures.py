"""The architectures people have, against transformers' own classes (random weights saved
by ``save_pretrained``, loaded by ssmserve): FalconMamba (``FalconMambaForCausalLM``, a
Mamba-1 LM with weightless RMS norms of Δ's low rank, B and C inside the mixer) and a
Codestral-shaped Mamba-2 (8 groups). Per-step logits match transformers' forward within
1e-5; prefill, stepping and any batch agree bit for bit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ssmserve.server.engine.loader import load_model
from ssmserve.server.engine.recurrent_state import BatchState

torch = pytest.importorskip("torch", reason="the reference is transformers' FalconMamba")
transformers = pytest.importorskip("transformers", reason="the reference is transformers")

CASES = {
    "tied": {},
    "untied-biases": {"tie_word_embeddings": False, "use_bias": True, "conv_kernel": 3},
    "eps-1e-3": {"mixer_rms_eps": 1e-3, "use_conv_bias": False},
}


def _falcon(tmp_path, name, **overrides):
    torch.manual_seed(sum(map(ord, name)))
    fields = {"hidden_size": 48, "num_hidden_layers": 2, "state_size": 8, "expand": 2,
              "time_step_rank": 6, "vocab_size": 61, "pad_token_id": 0, "bos_token_id": 0,
              "eos_token_id": 0, **overrides}  # fmt: skip
    model = transformers.FalconMambaForCausalLM(transformers.FalconMambaConfig(**fields)).eval()
    directory = tmp_path / name
    model.save_pretrained(directory)
    return model, directory


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_falcon_mamba(tmp_path, case):
    reference, directory = _falcon(tmp_path, case, **CASES[case])
    ids = np.random.default_rng(3).integers(0, 61, 16)
    with torch.no_grad():
        want = reference(torch.from_numpy(ids)[None]).logits[0].numpy()  # (t, v)
    model = load_model(directory)
    assert model.config.mixer_rms_eps == reference.config.mixer_rms_eps
    stepped, _ = model.run(ids)
    assert np.abs(stepped - want).max() <= 1e-5
    prefilled, _ = model.prefill(ids)
    assert prefilled.tobytes() == stepped.tobytes()


def test_a_falcon_mamba_row_is_the_same_in_any_batch(tmp_path):
    _, directory = _falcon(tmp_path, "batch")
    model = load_model(directory)
    ids = np.random.default_rng(4).integers(0, 61, (8, 5))  # 8 sessions, 5 steps
    alone = [model.run(ids[s])[0] for s in range(8)]
    batch = BatchState.stack([model.new_state() for _ in range(8)])
    for t in range(5):
        batch, out = model.step(batch, ids[:, t])
        for s in range(8):
            assert out[s].tobytes() == alone[s][t].tobytes()


def test_falcon_mamba_is_its_own_model_not_a_mamba(tmp_path):
    _, directory = _falcon(tmp_path, "id")
    falcon = load_model(directory)
    raw = json.loads((directory / "config.json").read_text())
    raw["architectures"], raw["model_type"] = ["MambaForCausalLM"], "mamba"
    (directory / "config.json").write_text(json.dumps(raw))
    plain = load_model(directory)  # the same weights read as a Mamba: no mixer norms
    assert plain.config.mixer_rms_eps == 0.0
    assert plain.fingerprint != falcon.fingerprint
    assert falcon.config.canonical()["mixer_rms_eps"] == falcon.config.mixer_rms_eps
    assert "mixer_rms_eps" not in plain.config.canonical()
    written = falcon.config.to_json()
    assert written["architectures"] == ["FalconMambaForCausalLM"]
    assert written["model_type"] == "falcon_mamba"


def test_a_worker_serves_falcon_mamba_with_the_engine_bits(tmp_path, redis_server):
    from tests.harness import WorkerHarness

    _, directory = _falcon(tmp_path, "served")
    ids = np.random.default_rng(5).integers(0, 61, 12)
    want, _ = load_model(directory).run(ids)
    harness = WorkerHarness({"falcon": directory}, redis_server.url)
    try:
        session = harness.client.create_session("falcon")
        got = np.stack([o.output for o in harness.client.stream_steps(session, ids.tolist())])
        assert got.tobytes() == want.tobytes()
    finally:
        harness.stop()


def test_codestral_shaped_mamba2_with_8_groups_matches_transformers(tmp_path):
    """Codestral Mamba's Mamba-2 layout (n_groups 8, untied head), small: per-step logits
    within 1e-5 of transformers' own Mamba2ForCausalLM."""
    torch.manual_seed(8)
    config = transformers.Mamba2Config(
        hidden_size=64, num_hidden_layers=2, state_size=16, expand=2, num_heads=16,
        head_dim=8, n_groups=8, vocab_size=50, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    reference = transformers.Mamba2ForCausalLM(config).eval()
    reference.save_pretrained(tmp_path / "codestral")
    ids = np.random.default_rng(8).integers(0, 50, 16)
    with torch.no_grad():
        want = reference(torch.from_numpy(ids)[None]).logits[0].numpy()  # (t, v)
    model = load_model(tmp_path / "codestral")
    assert model.config.n_groups == 8
    got, _ = model.run(ids)
    assert np.abs(got - want).max() <= 1e-5
