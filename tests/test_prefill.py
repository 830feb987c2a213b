"""Prefill (``MambaModel.prefill``, engine/prefill.py) has the bits of stepping.

Every requested output and the final state equal, bit for bit, what ``MambaModel.run``
(T calls of ``MambaModel.step`` on one session) gives: Mamba-1 and Mamba-2, every HF
fixture and the signal and token models of conftest, prompts of 1, 2, 7, 64 and 513
inputs (513 crosses a chunk boundary), outputs all / last / none / a mask / indices,
from a fresh state and from one a few steps in. Chunk size and thread count change no
bits either. ``ssmserve model run --prefill`` writes the same bits as without it, and
``ssmserve model bench --prefill`` reports the prefill and the decode step.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ssmserve.server.engine import prefill as prefill_module
from ssmserve.server.engine.loader import load_model
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.recurrent_state import SessionState
from ssmserve.server.errors import ModelInputError
from tests.conftest import HF2_FIXTURES, HF_CASES, HF_FIXTURES, random_inputs
from tests.test_cli import DEMO_ARGS, assert_one_line_error, ssmserve

LENGTHS = (1, 2, 7, 64, 513)
HF2_CASES = sorted(p.name for p in HF2_FIXTURES.iterdir() if (p / "config.json").exists())
#: Every model the engine tests use: the HF fixtures (token models, Mamba-1 and Mamba-2)
#: and conftest's signal and token models.
MODELS = (
    *(f"hf/{case}" for case in HF_CASES),
    *(f"hf2/{case}" for case in HF2_CASES),
    "signal_model",
    "demo_model",
    "token_model",
    "mamba2_model",
)


def named_model(name: str, request: pytest.FixtureRequest) -> MambaModel:
    """``hf/CASE``, ``hf2/CASE`` (a fixture directory) or a conftest fixture's name."""
    if name.startswith("hf/"):
        return load_model(HF_FIXTURES / name.removeprefix("hf/"))
    if name.startswith("hf2/"):
        return load_model(HF2_FIXTURES / name.removeprefix("hf2/"))
    return request.getfixturevalue(name)


@pytest.fixture(scope="module", params=MODELS)
def model(request: pytest.FixtureRequest) -> MambaModel:
    return named_model(request.param, request)


def bits(a: np.ndarray) -> np.ndarray:
    """The raw bits of a float32 array (so -0.0 != 0.0 and NaNs compare by payload)."""
    assert a.dtype == np.float32
    return a.view(np.uint32)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(bits(a), bits(b))


def same_state(a: SessionState, b: SessionState) -> bool:
    return len(a.layers) == len(b.layers) and all(
        same_bits(x.conv, y.conv) and same_bits(x.ssm, y.ssm)
        for x, y in zip(a.layers, b.layers, strict=True)
    )


def stepped(
    model: MambaModel, inputs: np.ndarray, start: SessionState
) -> tuple[np.ndarray, dict[int, SessionState]]:
    """The reference: ``run`` (one step per input) from ``start``; the outputs of every
    position and the state after each of ``LENGTHS`` inputs (the run in segments: a
    step is a function of the state and the input, so where a run stops changes nothing)."""
    outputs, states = [], {}
    state, done = start, 0
    for length in LENGTHS:
        out, state = model.run(inputs[done:length], state)
        outputs.append(out)
        states[length] = state
        done = length
    return np.concatenate(outputs), states


def starts(model: MambaModel) -> Iterator[tuple[str, SessionState]]:
    """A fresh state, and one 5 steps in (non-zero conv windows and SSM states)."""
    yield "fresh", model.new_state()
    _, warm = model.run(random_inputs(model, 5, seed=99))
    assert any(np.any(layer.ssm != 0) and np.any(layer.conv != 0) for layer in warm.layers)
    yield "warm", warm


def test_prefill_has_the_bits_of_stepping(model: MambaModel) -> None:
    inputs = random_inputs(model, max(LENGTHS), seed=7)
    for where, start in starts(model):
        before = start.packed()
        expected, states = stepped(model, inputs, start)
        for length in LENGTHS:
            for outputs, rows in (("all", slice(0, length)), ("last", slice(length - 1, length))):
                out, state = model.prefill(inputs[:length], start, outputs)
                assert out.dtype == np.float32
                assert same_bits(out, expected[rows]), (where, length, outputs)
                assert same_state(state, states[length]), (where, length, outputs)
            out, state = model.prefill(inputs[:length], start, "none")
            assert out.shape == (0, model.config.output_dim)
            assert same_state(state, states[length]), (where, length, "none")
        assert np.array_equal(bits(start.packed()), bits(before))  # the start is not written


@pytest.mark.parametrize("name", ["hf/base", "hf2/g2_k3_bias_untied_sharded", "signal_model"])
def test_chunks_and_threads_change_no_bits(
    name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of 16 rows (the state carried across 9 chunk boundaries here) and one or
    two threads (products cut by rows from 32 rows up) give the bits of stepping."""
    model = named_model(name, request)
    inputs = random_inputs(model, 150, seed=3)
    _, start = model.run(random_inputs(model, 3, seed=4))
    expected, state = model.run(inputs, start)
    monkeypatch.setattr(prefill_module, "CHUNK_ROWS", 16)
    for threads in (1, 2):
        monkeypatch.setattr(model, "threads", threads)
        out, final = model.prefill(inputs, start)
        assert same_bits(out, expected) and same_state(final, state), threads


@pytest.mark.parametrize("failing_chunk", [0, 1, 4])
def test_a_failing_runner_fails_the_prefill_and_no_runner_waits(
    signal_model: MambaModel, monkeypatch: pytest.MonkeyPatch, failing_chunk: int
) -> None:
    """Chunk 0 runs on the calling thread, chunk 1 on a runner of its own, chunk 4 after
    the others waited for turns: whichever fails, its error comes back, and within a
    bound (a runner waiting for a failed one's turn would hang)."""
    monkeypatch.setattr(prefill_module, "CHUNK_ROWS", 16)
    monkeypatch.setattr(signal_model, "threads", 2)
    chunk = prefill_module._chunk

    def failing(*args: object) -> None:
        if args[5] == failing_chunk:
            raise RuntimeError(f"chunk {failing_chunk} failed")
        chunk(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(prefill_module, "_chunk", failing)
    result: list[BaseException] = []

    def call() -> None:
        try:
            signal_model.prefill(random_inputs(signal_model, 150, seed=1))
        except BaseException as exc:
            result.append(exc)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(timeout=60)
    assert not caller.is_alive(), "the prefill hangs after a runner failed"
    assert len(result) == 1 and str(result[0]) == f"chunk {failing_chunk} failed"
    assert {t.name for t in threading.enumerate()}.isdisjoint({"ssmserve-prefill-1"})


def test_outputs_by_mask_and_by_indices(token_model: MambaModel) -> None:
    inputs = random_inputs(token_model, 40, seed=5)
    expected, state = token_model.run(inputs)
    picked = np.array([0, 3, 17, 32, 39])
    mask = np.zeros(40, bool)
    mask[picked] = True
    for outputs in (mask, picked, list(picked)):
        out, final = token_model.prefill(inputs, outputs=outputs)
        assert same_bits(out, expected[picked]) and same_state(final, state)
    out, _ = token_model.prefill(inputs, outputs=np.array([], np.int64))
    assert out.shape == (0, token_model.config.output_dim)


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        ("first", "outputs must be 'all', 'last', 'none'"),
        (np.zeros(5, bool), "an outputs mask has shape (6,)"),
        (np.array([0.5]), "outputs indices must be 1-d ints"),
        (np.array([2, 1]), "must increase strictly within [0, 6)"),
        (np.array([1, 1]), "must increase strictly within [0, 6)"),
        (np.array([6]), "must increase strictly within [0, 6)"),
        (np.array([-1]), "must increase strictly within [0, 6)"),
    ],
)
def test_bad_outputs_are_refused(token_model: MambaModel, outputs: object, message: str) -> None:
    with pytest.raises(ModelInputError, match=re.escape(message)):
        token_model.prefill(random_inputs(token_model, 6, seed=1), outputs=outputs)  # type: ignore[arg-type]


def test_bad_inputs_and_states_are_refused(
    token_model: MambaModel, signal_model: MambaModel
) -> None:
    with pytest.raises(ModelInputError, match="outside"):
        token_model.prefill(np.array([1, token_model.config.vocab_size]))
    with pytest.raises(ModelInputError, match="NaN or Inf"):
        signal_model.prefill(np.full((3, signal_model.config.input_dim), np.nan, np.float32))
    with pytest.raises(ModelInputError, match="layers"):
        token_model.prefill(np.array([1, 2]), signal_model.new_state())


def test_an_empty_prompt_leaves_the_state(token_model: MambaModel) -> None:
    _, start = token_model.run(random_inputs(token_model, 4, seed=2))
    for outputs in ("all", "last", "none"):
        out, state = token_model.prefill(np.zeros(0, np.int64), start, outputs)
        assert out.shape == (0, token_model.config.output_dim)
        assert same_state(state, start)


# ---------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("kind", ["signal", "token", "mamba2-token"])
def test_model_run_with_prefill_writes_the_bits_of_stepping(tmp_path: Path, kind: str) -> None:
    if kind == "signal":
        directory = tmp_path / "demo"
        assert ssmserve("model", "init-demo", directory, *DEMO_ARGS).returncode == 0
        inputs: np.ndarray = np.random.default_rng(0).standard_normal((70, 3)).astype(np.float32)
    else:
        directory = (
            HF_FIXTURES / "conv3_bias_rank5_untied"
            if kind == "token"
            else HF2_FIXTURES / "g2_k4_bias_tied_f16_limit"
        )
        inputs = random_inputs(load_model(directory), 70, seed=8)
    np.save(tmp_path / "in.npy", inputs)
    outs = {}
    for flags in ((), ("--prefill",)):
        out = tmp_path / f"out{len(flags)}.npy"
        result = ssmserve(
            "model", "run", directory, "--input", tmp_path / "in.npy", "--output", out, *flags
        )
        assert result.returncode == 0, result.stderr
        outs[flags] = np.load(out)
    assert outs[()].shape == (70, load_model(directory).config.output_dim)
    assert same_bits(outs[("--prefill",)], outs[()])


def test_model_bench_prefill_reports_prefill_and_decode(tmp_path: Path) -> None:
    directory = tmp_path / "demo"
    assert ssmserve("model", "init-demo", directory, *DEMO_ARGS).returncode == 0
    result = ssmserve(
        "model", "bench", directory, "--prefill", "40", "--steps", "6", "--rounds", "2", "--json"
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert (report["prefill_steps"], report["rounds"], report["steps"]) == (40, 2, 6)
    assert report["prefill_ms"] > 0 and report["step_us_median"] > 0
    per_input = report["prefill_ms"] * 1e3 / 40
    assert report["prefill_per_input_over_step"] == pytest.approx(
        per_input / report["step_us_median"], rel=1e-6
    )
    text = ssmserve("model", "bench", directory, "--prefill", "8", "--steps", "2")
    assert text.returncode == 0 and "prefill" in text.stdout and "decode step" in text.stdout
    assert_one_line_error(
        ssmserve("model", "bench", directory, "--prefill", "8", "--batch", "2"),
        "--prefill times one session",
    )


def test_the_cli_shows_the_engines_prefill_limit() -> None:
    from ssmserve.server import cli
    from ssmserve.server.engine import bench

    assert cli.MAX_PREFILL == bench.MAX_PREFILL
