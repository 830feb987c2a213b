"""8-bit weights: ``quantize="q8_0"`` (issue 48 part 3).

Q8_0 is llama.cpp's: blocks of 32 int8 with one float16 scale. ``scale * q`` is exact in
float32, so a Q8_0 model's every output and state has the bits of the float32 model that
holds the dequantized weights: at batch 1, 8 and 64, stepping and prefill, Mamba and
Mamba-2, signal and token models. The quantised bytes are those llama.cpp's own quantiser
(``gguf.quants``, which ``convert_hf_to_gguf.py`` uses) writes."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from ssmserve.server.engine.demo import DemoSpec, demo_config, random_tensors
from ssmserve.server.engine.loader import load_model, save_model
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.model_tensors import kept_16bit, load_bytes
from ssmserve.server.engine.quantize import (
    Q8Weight,
    from_blocks,
    quantizable,
    quantize_q8_0,
    to_blocks,
)
from ssmserve.server.engine.recurrent_state import BatchState
from ssmserve.server.errors import ModelFormatError
from tests.conftest import token_config

CONFIGS = {
    "signal": demo_config(DemoSpec(input_dim=5, output_dim=7, hidden=64, layers=2, state=8)),
    "signal-mamba2": demo_config(
        DemoSpec(
            input_dim=5,
            output_dim=7,
            hidden=64,
            layers=2,
            state=8,
            arch="mamba2",
            head_dim=16,
            groups=2,
        )
    ),
    "lm-untied": token_config(
        hidden_size=64, intermediate_size=128, vocab_size=96, time_step_rank=4
    ),
    "lm-tied": token_config(
        hidden_size=64,
        intermediate_size=128,
        vocab_size=100,
        time_step_rank=4,
        tie_word_embeddings=True,
        use_bias=False,
    ),
}


def _dequantized(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tensors a Q8_0 load holds, as float32: each weight it quantises, dequantized."""
    return {
        name: quantize_q8_0(v).dequantized() if kept_16bit(name) and quantizable(v.shape) else v
        for name, v in tensors.items()
    }


@pytest.fixture(scope="module")
def pairs(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[MambaModel, MambaModel]]:
    """name -> (the model loaded with quantize="q8_0", its dequantized values as float32)."""
    root = tmp_path_factory.mktemp("q8")
    out = {}
    for i, (name, config) in enumerate(CONFIGS.items()):
        tensors = random_tensors(config, seed=i)
        save_model(root / name, config, tensors)
        save_model(root / f"{name}-deq", config, _dequantized(tensors))
        out[name] = (load_model(root / name, quantize="q8_0"), load_model(root / f"{name}-deq"))
    return out


def _inputs(model: MambaModel, batch: int, steps: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    c = model.config
    if c.is_token_model:
        return rng.integers(0, c.vocab_size, (batch, steps))
    return rng.standard_normal((batch, steps, c.input_dim)).astype(np.float32)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_q8_weights_give_the_bits_of_their_dequantized_float32_model(pairs, name):
    q8, f32 = pairs[name]
    formats = {lin.format for lin in q8.linears}
    assert "q8_0" in formats  # the products whose rows are whole 32-blocks
    assert all(lin.format == "f32" for lin in f32.linears)
    for lin in q8.linears:  # dt_proj (rank 4) and a 5-wide input projection stay float32
        assert lin.format == ("q8_0" if lin.in_features % 32 == 0 else "f32")
    if q8.embeddings is not None:
        assert isinstance(q8.embeddings, Q8Weight)
    assert q8.fingerprint != f32.fingerprint  # the format is named: no replay across
    for batch in (1, 8, 64):
        x = _inputs(q8, batch, 3, seed=batch)
        states = [BatchState.stack([m.new_state() for _ in range(batch)]) for m in (q8, f32)]
        for t in range(3):
            (states[0], a), (states[1], b) = (
                q8.step(states[0], x[:, t]),
                f32.step(states[1], x[:, t]),
            )
            assert a.tobytes() == b.tobytes(), (batch, t)
        for layer_a, layer_b in zip(states[0].ssm, states[1].ssm, strict=True):
            assert layer_a.tobytes() == layer_b.tobytes()
    x = _inputs(q8, 1, 40, seed=7)[0]
    (pa, sa), (pb, sb) = q8.prefill(x), f32.prefill(x)
    assert pa.tobytes() == pb.tobytes()
    for layer_a, layer_b in zip(sa.layers, sb.layers, strict=True):
        assert layer_a.ssm.tobytes() == layer_b.ssm.tobytes()
        assert layer_a.conv.tobytes() == layer_b.conv.tobytes()
    stepped, _ = q8.run(x)
    assert stepped.tobytes() == pa.tobytes()


def test_the_q8_fingerprint_is_stable_and_differs_from_the_float32_one(tmp_path):
    config = CONFIGS["lm-tied"]
    save_model(tmp_path / "m", config, random_tensors(config, seed=3))
    first = load_model(tmp_path / "m", quantize="q8_0").fingerprint
    assert load_model(tmp_path / "m", quantize="q8_0").fingerprint == first
    assert load_model(tmp_path / "m").fingerprint != first


def test_quantising_writes_llama_cpps_bytes():
    """The reference quantiser in ``gguf`` (what ``convert_hf_to_gguf.py --outtype q8_0``
    runs): the same scale and int8 bytes for every block, rounding ties included."""
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    rng = np.random.default_rng(0)
    for scale in (1e-4, 0.02, 3.0):
        w = (rng.standard_normal((70, 256)) * scale).astype(np.float32)
        w[3, :32] = 0.0  # an all-zero block: scale 0
        w[5, :32] = np.linspace(-1, 1, 32) * 127 * scale  # exact halves after scaling
        ref = gguf_quants.quantize(w, GGMLQuantizationType.Q8_0)
        mine = quantize_q8_0(w)
        assert np.array_equal(to_blocks(mine), ref)
        back = from_blocks(ref, w.shape)
        assert np.array_equal(back.quants, mine.quants)
        assert np.array_equal(back.scales.view(np.uint16), mine.scales.view(np.uint16))
        deq = gguf_quants.dequantize(ref, GGMLQuantizationType.Q8_0)
        assert np.array_equal(mine.dequantized(), deq)


def test_quantising_bf16_bits_equals_quantising_their_values():
    from ssmserve.server.engine.loader import bf16_bits
    from ssmserve.server.engine.numerics import widened

    w = np.random.default_rng(1).standard_normal((40, 64)).astype(np.float32)
    bits = bf16_bits(w)
    a, b = quantize_q8_0(bits), quantize_q8_0(widened(bits))
    assert np.array_equal(a.quants, b.quants) and np.array_equal(a.scales, b.scales)


def test_a_weight_too_big_for_q8_is_refused_by_name(tmp_path):
    config = CONFIGS["lm-tied"]
    tensors = random_tensors(config, seed=4)
    tensors["backbone.layers.1.mixer.out_proj.weight"][0, 0] = 1e7
    save_model(tmp_path / "m", config, tensors)
    with pytest.raises(ModelFormatError, match=r"out_proj.weight.*float16"):
        load_model(tmp_path / "m", quantize="q8_0")
    with pytest.raises(ValueError, match="q8_0"):
        load_model(tmp_path / "m", quantize="q4_0")


@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_a_q8_load_stays_within_the_memory_it_was_checked_for(tmp_path: Path, dtype: str):
    """The peak beyond the model itself is bounded by a fixed few MiB (quantising a chunk
    at a time), so a model ten times that size shows the bound holds."""
    config = token_config(hidden_size=256, intermediate_size=512, vocab_size=32768,
                          time_step_rank=16, num_hidden_layers=6)  # fmt: skip
    save_model(tmp_path / "m", config, random_tensors(config, seed=1), dtype=dtype)
    stored = dict.fromkeys(random_tensors(config, seed=1), dtype)
    tracemalloc.start()
    try:
        model = load_model(tmp_path / "m", quantize="q8_0")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= load_bytes(config, stored, keep_bf16=True, quantize="q8_0")
    f32_bytes = load_model(tmp_path / "m").weight_bytes
    assert model.weight_bytes < 0.4 * f32_bytes * (2 if dtype == "BF16" else 1)
