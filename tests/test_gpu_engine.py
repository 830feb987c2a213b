"""The GPU engine's exactness, on the CPU: its Triton kernels under Triton's interpreter.

What is checked, for a tiny Mamba-1 language model and a tiny Mamba-2 signal model with
odd dims: a row's outputs and next state have the same bits at every batch size 1..9 and
in a permuted batch; a prefill over T positions gives the bits of T steps (every output,
the state); a state exported through a checkpoint continues with the same bits; outputs
agree with the CPU engine within 1e-4; a product is the CPU engine's micro-kernel's bits
by either launch. The interpreter runs the kernels' per-element operations (its fma
rounds once), not the device's exp/log: the bits on a GPU are checked by
``bench/tools/gpu_check.py`` on the device.

Skipped only when torch or triton is not installed (``pip install 'ssmserve[cuda]'``;
``./dev test`` installs CPU builds of both).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported: kernels on the CPU

from pathlib import Path

import numpy as np
import pytest

from ssmserve.server.engine.gpu.runtime import missing_packages

if missing_packages():
    pytest.skip(
        f"the GPU engine needs {' and '.join(missing_packages())} (pip install 'ssmserve[cuda]')",
        allow_module_level=True,
    )

import torch

from ssmserve.server.engine.demo import demo_config
from ssmserve.server.engine.gpu import launch
from ssmserve.server.engine.gpu.model import GpuMambaModel
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.numerics import RowStableLinear, numerics_signature
from ssmserve.server.engine.recurrent_state import BatchState, SessionState
from ssmserve.server.state.checkpoint import Checkpoint, InputHistory
from tests.conftest import MAMBA2_SPEC, random_inputs, token_config, write_model

CPU = torch.device("cpu")
STEPS = 17  # the longest prefill checked: T in PREFILLS


def random_state(model: GpuMambaModel, seed: int) -> SessionState:
    """A state of the model's shapes with random values: a prefill shorter than the conv
    window reads the carried window, so a zero start state would hide a wrong read."""
    zeros = model.new_state()
    rng = np.random.default_rng(seed)
    buffer = (rng.standard_normal(zeros.layout.size) * 0.5).astype(np.float32)
    return SessionState.of_buffer(buffer, zeros.layout)


class Case:
    """One model on both engines, and its run of STEPS single steps from a random state
    (computed once, shared by the tests that compare against it)."""

    def __init__(self, directory: Path, config: object, seed: int) -> None:
        self.cpu: MambaModel = write_model(directory, config, seed=seed)  # type: ignore[arg-type]
        self.gpu = GpuMambaModel.load(directory, device=CPU)
        self.start = random_state(self.gpu, seed)
        self.inputs = random_inputs(self.gpu, STEPS, seed)
        self.outputs = np.empty((STEPS, self.gpu.config.output_dim), np.float32)
        self.states: list[SessionState] = []  # after step 1, 2, ..., STEPS
        batch = BatchState.stack([self.start])
        for t in range(STEPS):
            batch, out = self.gpu.step(batch, self.inputs[t : t + 1])
            self.outputs[t] = out[0]
            self.states.append(batch.session(0).copy())


@pytest.fixture(scope="module", params=["mamba1-lm", "mamba2-signal"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    if request.param == "mamba1-lm":
        # Tied, as the presets and released checkpoints are: embeddings read from the head.
        config = token_config(tie_word_embeddings=True)
        return Case(tmp_path_factory.mktemp("gpu-m1"), config, seed=3)
    return Case(tmp_path_factory.mktemp("gpu-m2"), demo_config(MAMBA2_SPEC), seed=12)


def _same(a: SessionState, b: SessionState) -> bool:
    return a.bit_equal(b)


def test_a_product_has_the_cpu_engines_bits_by_either_launch() -> None:
    """k = 150 (blocks of 64, 64, 22), rows and columns past a tile: the one-pass and the
    k-parallel launches, and the CPU engine's micro-kernel, give the same bits, and a
    row alone the bits it has among others."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((19, 150)).astype(np.float32)
    w = rng.standard_normal((70, 150)).astype(np.float32)
    bias = rng.standard_normal(70).astype(np.float32)
    lin = launch.DeviceLinear.of(w, bias, CPU)
    one_pass = launch.product(torch.from_numpy(x), lin, split=False).numpy()
    k_parallel = launch.product(torch.from_numpy(x), lin, split=True).numpy()
    cpu = RowStableLinear(w, bias)(x)
    assert one_pass.tobytes() == k_parallel.tobytes()
    assert one_pass.tobytes() == cpu.tobytes()
    alone = launch.product(torch.from_numpy(x[17:18]), lin).numpy()
    assert alone.tobytes() == one_pass[17:18].tobytes()


@pytest.mark.parametrize("stored", ["bf16", "f16", "f32"])
def test_weights_keep_their_stored_precision_and_give_the_float32_bits(stored: str) -> None:
    """A model stored in BF16 or F16 keeps those weights 16-bit on the device (half the
    bytes a step reads); the kernels widen them exactly, so the product has the bits of
    the same weights in float32 (the CPU engine's micro-kernel here)."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 150)).astype(np.float32)
    w = rng.standard_normal((70, 150)).astype(np.float32)
    if stored == "bf16":  # what the loader makes of a BF16 tensor: its high 16 bits
        w = (w.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    elif stored == "f16":
        w = w.astype(np.float16).astype(np.float32)
    lin = launch.DeviceLinear.of(w, None, CPU)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[stored]
    assert lin.w_t.dtype == dtype
    want = RowStableLinear(w)(x).tobytes()
    for split in (False, True):
        assert launch.product(torch.from_numpy(x), lin, split=split).numpy().tobytes() == want


def test_rows_have_the_same_bits_at_every_batch_size_and_position(case: Case) -> None:
    model = case.gpu
    states = [random_state(model, 100 + i) for i in range(9)]
    inputs = random_inputs(model, 9, 7)
    full, out = model.step(BatchState.stack(states), inputs)
    for b in range(1, 9):
        part, part_out = model.step(BatchState.stack(states[:b]), inputs[:b])
        assert part_out.tobytes() == out[:b].tobytes(), f"batch {b}"
        for i in range(b):
            assert _same(part.session(i), full.session(i)), f"batch {b} row {i}"
    perm = np.random.default_rng(1).permutation(9)
    mixed, mixed_out = model.step(BatchState.stack([states[i] for i in perm]), inputs[perm])
    assert mixed_out.tobytes() == out[perm].tobytes()
    assert all(_same(mixed.session(j), full.session(i)) for j, i in enumerate(perm))


@pytest.mark.parametrize("positions", [1, 2, 7, STEPS])
def test_a_prefill_has_the_bits_of_as_many_steps(case: Case, positions: int) -> None:
    outputs, state = case.gpu.prefill(case.inputs[:positions], case.start)
    assert outputs.tobytes() == case.outputs[:positions].tobytes()
    assert _same(state, case.states[positions - 1])


def test_a_prefill_computes_only_the_outputs_asked_for(case: Case) -> None:
    last, state = case.gpu.prefill(case.inputs[:5], case.start, outputs=[1, 4])
    assert last.tobytes() == case.outputs[[1, 4]].tobytes()
    assert _same(state, case.states[4])


def test_outputs_agree_with_the_cpu_engine(case: Case) -> None:
    cpu_out, cpu_state = case.cpu.run(case.inputs, case.start)
    scale = float(np.abs(cpu_out).max())
    assert float(np.abs(case.outputs - cpu_out).max()) <= 1e-4 * scale
    for ours, theirs in zip(case.states[-1].layers, cpu_state.layers, strict=True):
        np.testing.assert_allclose(ours.ssm, theirs.ssm, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(ours.conv, theirs.conv, rtol=1e-4, atol=1e-5)


def test_a_state_through_a_checkpoint_continues_with_the_same_bits(case: Case) -> None:
    """The state after 7 steps, encoded as a checkpoint (numpy, the CPU engine's format)
    and decoded, continues through the next 10 inputs as the uninterrupted run did."""
    model = case.gpu
    ckpt = Checkpoint(
        session_id="s", step=7, model_id=model.name, fingerprint=model.fingerprint,
        state=case.states[6], history=InputHistory(1, case.inputs[:7]),
    )  # fmt: skip
    restored = Checkpoint.decode(ckpt.encode())
    restored.check_model(model)  # type: ignore[arg-type]
    outputs, state = model.prefill(case.inputs[7:], restored.state)
    assert outputs.tobytes() == case.outputs[7:].tobytes()
    assert _same(state, case.states[-1])


def test_the_numerics_signature_names_the_engine_and_device(case: Case) -> None:
    text = case.gpu.numerics
    assert text.startswith("engine=triton device=cpu triton-interpreter | torch ")
    assert len(case.gpu.numerics_signature) == 16
    assert case.gpu.numerics_signature != numerics_signature()
    assert case.gpu.fingerprint == case.cpu.fingerprint


def test_a_step_in_its_bucket_has_the_bits_of_the_unpadded_eager_step(case: Case) -> None:
    """``graphs.py``: a batch of b runs on the buffers of its size bucket, whose rows past
    b still hold an earlier batch's states and inputs; its rows :b must be the unpadded
    eager step's bits (on a GPU the bucket is a CUDA graph replay, the same operations)."""
    from ssmserve.server.engine.gpu.graphs import bucket_for
    from ssmserve.server.engine.gpu.model import DeviceBatch

    model = case.gpu
    states = [random_state(model, 200 + i) for i in range(7)]
    inputs = random_inputs(model, 7, 8)
    model.step(BatchState.stack(states), inputs)  # bucket 8: its rows 5 and 6 keep these
    for b in (5, 3):
        picked, x = states[b - 1 :: -1], inputs[b - 1 :: -1].copy()
        assert bucket_for(b) > b
        got, out = model.step(BatchState.stack(picked), x)
        batch = DeviceBatch.from_host(BatchState.stack(picked), CPU)
        eager, eager_out = model.step_device(batch, torch.from_numpy(np.asarray(x)))
        assert out.tobytes() == eager_out.numpy().tobytes(), f"batch {b}"
        want = eager.to_host()
        assert all(_same(got.session(i), want.session(i)) for i in range(b))
