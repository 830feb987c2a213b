"""BF16 weights stay 16-bit in memory (issue 48 part 2).

A model stored in BF16 keeps its products' weights and its embedding table as their raw
bits, and the product kernel widens each value as it loads it. Widening BF16 is exact, so
every output and state has the bits of the same weights widened to float32 up front: at
batch 1, 8 and 64, stepping and prefill, Mamba and Mamba-2, signal and token models."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from ssmserve.server.engine import products
from ssmserve.server.engine.demo import DemoSpec, demo_config, random_tensors
from ssmserve.server.engine.loader import bf16_bits, load_model, save_model
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.model_tensors import load_bytes
from ssmserve.server.engine.numerics import widened
from ssmserve.server.engine.recurrent_state import BatchState
from tests.conftest import token_config

CONFIGS = {
    "signal": demo_config(DemoSpec(input_dim=5, output_dim=7, hidden=48, layers=2, state=8)),
    "signal-mamba2": demo_config(
        DemoSpec(
            input_dim=5,
            output_dim=7,
            hidden=48,
            layers=2,
            state=8,
            arch="mamba2",
            head_dim=16,
            groups=2,
        )
    ),
    "lm-untied": token_config(
        hidden_size=48, intermediate_size=96, vocab_size=96, time_step_rank=3
    ),
    "lm-tied": token_config(
        hidden_size=48,
        intermediate_size=96,
        vocab_size=96,
        time_step_rank=3,
        tie_word_embeddings=True,
        use_bias=False,
    ),
}


@pytest.fixture(scope="module")
def pairs(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[MambaModel, MambaModel, Path]]:
    """name -> (the BF16-stored model as loaded, the same values stored as float32, its dir)."""
    root = tmp_path_factory.mktemp("bf16")
    out = {}
    for i, (name, config) in enumerate(CONFIGS.items()):
        tensors = random_tensors(config, seed=i)
        save_model(root / name, config, tensors, dtype="BF16")
        wide = {k: widened(bf16_bits(v)) for k, v in tensors.items()}
        save_model(root / f"{name}-f32", config, wide)
        out[name] = (load_model(root / name), load_model(root / f"{name}-f32"), root / name)
    return out


def _inputs(model: MambaModel, batch: int, steps: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    c = model.config
    if c.is_token_model:
        return rng.integers(0, c.vocab_size, (batch, steps))
    return rng.standard_normal((batch, steps, c.input_dim)).astype(np.float32)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bf16_weights_stay_16_bit_and_give_the_widened_bits(pairs, name):
    bf16, f32, _ = pairs[name]
    kept = [lin.panels for block in bf16.blocks for lin in block.linears] + [bf16.head.panels]
    assert all(p.dtype == np.uint16 for p in kept)
    assert all(lin.panels.dtype == np.float32 for block in f32.blocks for lin in block.linears)
    if bf16.embeddings is not None:
        assert bf16.embeddings.dtype == np.uint16
    assert bf16.fingerprint == f32.fingerprint  # the same values: one model
    for batch in (1, 8, 64):
        x = _inputs(bf16, batch, 3, seed=batch)
        states = [BatchState.stack([m.new_state() for _ in range(batch)]) for m in (bf16, f32)]
        for t in range(3):
            (states[0], a), (states[1], b) = (
                bf16.step(states[0], x[:, t]),
                f32.step(states[1], x[:, t]),
            )
            assert a.tobytes() == b.tobytes(), (batch, t)
        for layer_a, layer_b in zip(states[0].ssm, states[1].ssm, strict=True):
            assert layer_a.tobytes() == layer_b.tobytes()
    x = _inputs(bf16, 1, 40, seed=7)[0]
    (pa, sa), (pb, sb) = bf16.prefill(x), f32.prefill(x)
    assert pa.tobytes() == pb.tobytes()
    for layer_a, layer_b in zip(sa.layers, sb.layers, strict=True):
        assert layer_a.ssm.tobytes() == layer_b.ssm.tobytes()
        assert layer_a.conv.tobytes() == layer_b.conv.tobytes()
    stepped, _ = bf16.run(x)
    assert stepped.tobytes() == pa.tobytes()


def _array_bytes(obj: object, seen: set[int]) -> int:
    """Bytes of every numpy array reachable from ``obj`` (its attributes, tuples, lists)."""
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        return obj.nbytes if obj.base is None or id(obj.base) not in seen else 0
    if isinstance(obj, list | tuple):
        return sum(_array_bytes(v, seen) for v in obj)
    fields = getattr(obj, "__dict__", None)
    slots = getattr(type(obj), "__slots__", ())
    values = list(fields.values()) if fields else []
    values += [getattr(obj, s) for s in slots if hasattr(obj, s)]
    if type(obj).__module__.startswith("ssmserve"):
        return sum(_array_bytes(v, seen) for v in values)
    return 0


@pytest.mark.parametrize("name", ["lm-untied", "lm-tied"])
def test_a_bf16_model_holds_about_its_stored_bytes(pairs, name):
    """The weights in memory: within 1.15x of the stored bytes, beyond a fixed overhead
    (the float32 state of a fresh session, the norms, A and D as float32, and the panels'
    padding to whole COLUMNS-wide panels)."""
    bf16, _, directory = pairs[name]
    stored = (directory / "model.safetensors").stat().st_size
    held = _array_bytes(bf16, set())
    c = bf16.config
    fixed = c.state_bytes + 4 * c.num_hidden_layers * (
        c.intermediate_size * (c.state_size + 2) + 2 * c.hidden_size
    )
    fixed += 2 * products.COLUMNS * (c.vocab_size + 4 * c.intermediate_size + c.hidden_size)
    assert held <= 1.15 * stored + fixed, (held, stored, fixed)


def test_a_bf16_file_is_what_torch_writes(tmp_path):
    """``save_model(dtype="BF16")`` rounds to nearest even, as torch does, and the file
    reads back through safetensors' own reader (header, offsets)."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    config = CONFIGS["signal"]
    tensors = random_tensors(config, seed=9)
    save_model(tmp_path / "m", config, tensors, dtype="BF16")
    back = load_file(tmp_path / "m" / "model.safetensors")
    for name, values in tensors.items():
        want = torch.from_numpy(values).to(torch.bfloat16)
        assert back[name].dtype == torch.bfloat16
        assert torch.equal(back[name], want), name
    assert json.loads((tmp_path / "m" / "config.json").read_text())["input_dim"] == 5


@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_a_load_stays_within_the_memory_it_was_checked_for(tmp_path, dtype):
    """tracemalloc's peak over a whole load (numpy reports its arrays to it) against the
    figure the memory check compares with what is available (``load_bytes``)."""
    config = token_config(hidden_size=96, intermediate_size=192, vocab_size=4096,
                          time_step_rank=6, num_hidden_layers=3)  # fmt: skip
    save_model(tmp_path / "m", config, random_tensors(config, seed=1), dtype=dtype)
    stored = dict.fromkeys(random_tensors(config, seed=1), dtype)
    tracemalloc.start()
    try:
        load_model(tmp_path / "m")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= load_bytes(config, stored, keep_bf16=True)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_f16_weights_stay_16_bit_and_give_the_widened_bits(tmp_path, name):
    """F16 as BF16: the products' weights and the embedding table stay as their float16
    bits (int16 panels), widened inside the kernel by the CPU's half-to-float conversion
    (exact), so every output and state, stepping and prefill, has the bits of the same
    values widened up front, and the fingerprint is theirs."""
    from safetensors.numpy import save_file

    config = CONFIGS[name]
    tensors = random_tensors(config, seed=11)
    save_model(tmp_path / "f16", config, tensors)
    halves = {k: v.astype(np.float16) for k, v in tensors.items()}
    save_file(halves, str(tmp_path / "f16" / "model.safetensors"))
    save_model(tmp_path / "f32", config, {k: v.astype(np.float32) for k, v in halves.items()})
    half, wide = load_model(tmp_path / "f16"), load_model(tmp_path / "f32")
    assert {lin.format for lin in half.linears} == {"f16"}
    if half.embeddings is not None:
        assert half.embeddings.dtype == np.int16
    assert half.fingerprint == wide.fingerprint
    for batch in (1, 8, 64):
        x = _inputs(half, batch, 3, seed=batch)
        states = [BatchState.stack([m.new_state() for _ in range(batch)]) for m in (half, wide)]
        for t in range(3):
            (states[0], a), (states[1], b) = (
                half.step(states[0], x[:, t]),
                wide.step(states[1], x[:, t]),
            )
            assert a.tobytes() == b.tobytes(), (batch, t)
    x = _inputs(half, 1, 40, seed=7)[0]
    (pa, sa), (pb, sb) = half.prefill(x), wide.prefill(x)
    assert pa.tobytes() == pb.tobytes()
    for layer_a, layer_b in zip(sa.layers, sb.layers, strict=True):
        assert layer_a.ssm.tobytes() == layer_b.ssm.tobytes()
    assert half.weight_bytes < 0.55 * wide.weight_bytes
