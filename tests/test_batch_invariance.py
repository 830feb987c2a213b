"""A session's outputs and state are bit-identical alone or inside any batch."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from ssmserve.server.engine import products
from ssmserve.server.engine import threads as helper_threads
from ssmserve.server.engine.demo import DemoSpec, demo_config
from ssmserve.server.engine.loader import load_model
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.numerics import RowStableLinear
from ssmserve.server.engine.recurrent_state import BatchState, SessionState
from ssmserve.server.engine.threads import MIN_ROWS_PER_THREAD, row_ranges
from tests.conftest import MAMBA2_SPEC, random_inputs, token_config, write_model


def _warm_states(model: MambaModel, count: int, seed: int) -> list[SessionState]:
    """Distinct non-trivial states: each session has seen its own random history."""
    rng = np.random.default_rng(seed)
    states = []
    for i in range(count):
        _, state = model.run(random_inputs(model, int(rng.integers(1, 9)), seed * 1000 + i))
        states.append(state)
    return states


def _step_one(
    model: MambaModel, state: SessionState, x: np.ndarray
) -> tuple[SessionState, np.ndarray]:
    new, out = model.step(BatchState.stack([state]), x[None] if x.ndim else x.reshape(1))
    return new.session(0), out[0]


@pytest.mark.parametrize(
    "model_name",
    ["signal_model", "token_model", "demo_model", "mamba2_model", "mamba2_token_model"],
)
def test_random_batch_compositions(model_name: str, request: pytest.FixtureRequest) -> None:
    model: MambaModel = request.getfixturevalue(model_name)
    rng = np.random.default_rng(7)
    pool = _warm_states(model, 40, seed=1)
    inputs = random_inputs(model, 40, seed=2)
    solo = [_step_one(model, pool[i], inputs[i]) for i in range(40)]
    sizes = [1, 2, 3, 15, 16, 17, 31, 33, 40, *rng.integers(1, 41, 6).tolist()]
    for size in sizes:
        members = rng.choice(40, size=size, replace=rng.random() < 0.3)  # duplicates too
        batch = BatchState.stack([pool[i] for i in members])
        new, out = model.step(batch, inputs[members])
        for row, i in enumerate(members):
            state_solo, out_solo = solo[i]
            assert np.array_equal(out[row], out_solo), f"output differs: batch {size}, row {row}"
            assert new.session(row).bit_equal(state_solo), f"state differs: batch {size}, row {row}"


@pytest.mark.parametrize("model_name", ["demo_model", "mamba2_model"])
def test_large_batches(model_name: str, request: pytest.FixtureRequest) -> None:
    model: MambaModel = request.getfixturevalue(model_name)
    pool = _warm_states(model, 8, seed=3)
    inputs = random_inputs(model, 8, seed=4)
    solo = [_step_one(model, pool[i], inputs[i])[1] for i in range(8)]
    for size in (100, 257):
        members = np.arange(size) % 8
        _, out = model.step(BatchState.stack([pool[i] for i in members]), inputs[members])
        for row, i in enumerate(members):
            assert np.array_equal(out[row], solo[i]), f"batch {size} row {row}"


def test_multi_step_sequences_batched_equal_solo(token_model: MambaModel) -> None:
    model = token_model
    seqs = [random_inputs(model, 12, seed=s) for s in range(5)]
    solo = [model.run(seq)[0] for seq in seqs]
    batch = BatchState.stack([model.new_state() for _ in seqs])
    for t in range(12):
        batch, out = model.step(batch, np.array([seq[t] for seq in seqs]))
        for i in range(5):
            assert np.array_equal(out[i], solo[i][t])


@pytest.mark.parametrize(
    "shape", [(64, 4), (256, 64), (36, 128), (4, 64), (1024, 256), (48, 512), (512, 16), (8, 256)]
)
def test_row_stable_linear_is_row_independent(shape: tuple[int, int]) -> None:
    out_f, in_f = shape
    rng = np.random.default_rng(out_f * in_f)
    lin = RowStableLinear(rng.standard_normal(shape).astype(np.float32), rng.standard_normal(out_f))
    x = rng.standard_normal((53, in_f)).astype(np.float32)
    solo = np.concatenate([lin(x[i : i + 1]) for i in range(len(x))])
    for size in (*range(1, 10), 23, 24, 25, 48, len(x)):
        assert np.array_equal(lin(x[:size]), solo[:size]), f"batch {size}"
        # and the rows past ``rows`` are left alone
        out = np.full((size + 3, out_f), 7.0, np.float32)
        lin.into(x[:size], out, size)
        assert np.array_equal(out[:size], solo[:size]) and (out[size:] == 7.0).all()
    perm = rng.permutation(len(x))
    assert np.array_equal(lin(x[perm]), solo[perm])
    # non-contiguous input rows (a column slice) give the same bits
    wide = np.concatenate([x, x], axis=1)
    assert np.array_equal(lin(wide[:, :in_f]), solo)
    # and it is the linear map it claims to be
    exact = x.astype(np.float64) @ lin.weight.T.astype(np.float64) + lin.bias
    np.testing.assert_allclose(solo, exact, rtol=1e-5, atol=1e-4 * np.sqrt(in_f))


@pytest.mark.parametrize("shape", [(50, 7), (24, 64), (30, 65), (30, 256), (9, 300)])
def test_row_stable_linear_is_the_fixed_order_fma_chain(shape: tuple[int, int]) -> None:
    """Each element sums k in blocks of ``K_BLOCK``: per block ``acc = fma(x[k], w[k], acc)``
    for k in order from 0.0, the block sums added in order, then ``+ bias``: the arithmetic
    ``products.py`` defines (no CPU- or batch-dependent order). The reference emulates fma
    in float64, where a float32 product is exact."""
    out_f, in_f = shape
    rng = np.random.default_rng(in_f)
    w = rng.standard_normal(shape).astype(np.float32)
    bias = rng.standard_normal(out_f).astype(np.float32)
    x = rng.standard_normal((11, in_f)).astype(np.float32)
    total = np.zeros((11, out_f), np.float32)
    for k0 in range(0, in_f, products.K_BLOCK):
        acc = np.zeros((11, out_f), np.float32)
        for k in range(k0, min(k0 + products.K_BLOCK, in_f)):
            exact = x[:, k, None].astype(np.float64) * w[None, :, k] + acc  # (b, o)
            acc = exact.astype(np.float32)  # one rounding
        total = acc if k0 == 0 else total + acc
    want = total + bias
    got = RowStableLinear(w, bias)(x)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(RowStableLinear(w).weight, w)
    ids = np.array([0, out_f - 1, 3, 3])
    assert np.array_equal(RowStableLinear(w).weight_rows(ids), w[ids])


def test_step_does_not_modify_its_input_state(signal_model: MambaModel) -> None:
    model = signal_model
    states = _warm_states(model, 3, seed=5)
    batch = BatchState.stack(states)
    before = [s.layers[0].ssm.copy() for s in batch.sessions()]
    model.step(batch, random_inputs(model, 3, seed=6))
    assert all(
        np.array_equal(b, s.layers[0].ssm) for b, s in zip(before, batch.sessions(), strict=True)
    )


@pytest.mark.parametrize("model_name", ["signal_model", "mamba2_token_model"])
def test_a_step_cut_over_threads_gives_the_same_bits(
    model_name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row ranges on several engine threads (``row_ranges``) change nothing: each thread
    writes only its rows of the new state and outputs."""
    model: MambaModel = request.getfixturevalue(model_name)
    # The test models are small: let any work be cut, so the ranges really run apart.
    monkeypatch.setattr(helper_threads, "MIN_FLOP_PER_THREAD", 0.0)
    assert len(row_ranges(9, 3, model.flops_per_step)) == 2
    pool = _warm_states(model, 12, seed=8)
    inputs = random_inputs(model, 12, seed=9)
    saved = model.threads
    try:
        for size in (7, 8, 9, 33, 100):
            members = np.arange(size) % 12
            batch = BatchState.stack([pool[i] for i in members])
            results = []
            for threads in (1, 2, 3):
                model.threads = threads
                results.append(model.step(batch, inputs[members]))
            (state_1, out_1), *others = results
            for state_n, out_n in others:
                assert np.array_equal(out_n.view(np.uint32), out_1.view(np.uint32)), size
                for a, b in zip(
                    state_n.conv + state_n.ssm, state_1.conv + state_1.ssm, strict=True
                ):
                    assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), size
    finally:
        model.threads = saved


def test_row_ranges_cover_the_batch_once() -> None:
    for batch in range(1, 70):
        for threads in (1, 2, 3, 8):
            parts = row_ranges(batch, threads)
            assert parts[0][0] == 0 and parts[-1][1] == batch
            assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
            assert len(parts) <= threads
            assert len(parts) == 1 or min(hi - lo for lo, hi in parts) >= MIN_ROWS_PER_THREAD
    # and work: no range below MIN_FLOP_PER_THREAD
    assert row_ranges(64, 2, helper_threads.MIN_FLOP_PER_THREAD / 40) == [(0, 64)]
    assert row_ranges(80, 2, helper_threads.MIN_FLOP_PER_THREAD / 40) == [(0, 40), (40, 80)]


@pytest.mark.parametrize("outputs", [24, 50, 97])
@pytest.mark.parametrize("with_bias", [False, True])
def test_products_by_column_ranges_give_the_same_bits(outputs: int, with_bias: bool) -> None:
    """Panels computed by several calls (``product_panels``, as the engine's threads do)
    fill ``out`` with the bits of one whole product, partial last panel and bias included,
    and leave the other columns alone."""
    rng = np.random.default_rng(outputs)
    weight = rng.standard_normal((outputs, 37)).astype(np.float32)
    bias = rng.standard_normal(outputs).astype(np.float32) if with_bias else None
    lin = RowStableLinear(weight, bias)
    x = rng.standard_normal((6, 37)).astype(np.float32)
    whole = lin(x)
    panels = lin.panels.shape[0]
    b = lin.bias if lin.bias is not None else np.zeros(1, np.float32)
    for cut in range(panels + 1):
        out = np.full((6, outputs), np.nan, np.float32)
        products.product_panels(x, lin.panels, lin.scales, b, with_bias, 0, 6, 0, cut, out)
        done = min(cut * products.COLUMNS, outputs)
        assert np.isnan(out[:, done:]).all()  # columns of the other range not touched
        products.product_panels(x, lin.panels, lin.scales, b, with_bias, 0, 6, cut, panels, out)
        assert np.array_equal(out.view(np.uint32), whole.view(np.uint32)), cut


def test_a_big_product_is_cut_by_columns_over_the_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lin = RowStableLinear(np.random.default_rng(0).standard_normal((200, 64)).astype(np.float32))
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    alone = lin(x)
    panel_bytes = lin.panels[0].nbytes
    assert helper_threads.column_ranges(9, panel_bytes, 2) == [(0, 9)]  # too small to cut
    monkeypatch.setattr(helper_threads, "COLUMN_SPLIT_MIN_BYTES", 2 * panel_bytes)
    assert helper_threads.column_ranges(9, panel_bytes, 1) == [(0, 9)]
    assert helper_threads.column_ranges(9, panel_bytes, 2) == [(0, 4), (4, 9)]
    assert helper_threads.column_ranges(9, panel_bytes, 3) == [(0, 3), (3, 6), (6, 9)]
    assert helper_threads.column_ranges(2, panel_bytes, 8) == [(0, 1), (1, 2)]
    for threads in (2, 3):
        out = lin.into(x, np.empty((3, 200), np.float32), threads=threads)
        assert np.array_equal(out.view(np.uint32), alone.view(np.uint32)), threads


@pytest.mark.parametrize("kind", ["mamba1-signal", "mamba1-token", "mamba2-signal"])
def test_a_step_with_products_cut_by_columns_gives_the_same_bits(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every product big enough to cut (a threshold of 0 bytes), steps too small to
    cut by rows cut their products by columns (Mamba-1's mixer then runs product by
    product instead of fused) and give the bits of one thread, at every batch size."""
    monkeypatch.setattr(helper_threads, "COLUMN_SPLIT_MIN_BYTES", 0)
    config = {
        "mamba1-signal": lambda: demo_config(
            DemoSpec(
                input_dim=5,
                output_dim=3,
                hidden=22,
                layers=2,
                state=7,
                expand=3,
                conv_kernel=3,
                seed=4,
            )
        ),
        "mamba1-token": token_config,
        "mamba2-signal": lambda: demo_config(MAMBA2_SPEC),
    }[kind]()
    model = write_model(tmp_path, config, seed=5)  # fresh: blocks cache whether they cut
    model.threads = 2
    # The reference: the same files, another model object (its own workspaces, so a
    # column range left unwritten cannot pass by finding the reference's values there).
    reference = load_model(tmp_path)
    reference.threads = 1
    if kind.startswith("mamba1"):
        assert all(block.has_column_ranges for block in model.blocks)
    states = _warm_states(reference, 7, seed=6)
    inputs = random_inputs(model, 7, seed=7)
    for size in (1, 2, 3, 7):
        batch = BatchState.stack(states[:size])
        state_1, out_1 = reference.step(batch, inputs[:size])
        state_2, out_2 = model.step(batch, inputs[:size])
        assert np.array_equal(out_2.view(np.uint32), out_1.view(np.uint32)), size
        for a, b in zip(state_2.conv + state_2.ssm, state_1.conv + state_1.ssm, strict=True):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), size


@pytest.mark.parametrize("fixture", ["signal_model", "mamba2_model"])
def test_rows_of_several_batches_and_own_states_stack_as_their_layers(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    """A worker with many sessions forms a batch from rows of several earlier batches and
    from states of their own (just loaded), in any order: each row of the stacked batch
    holds exactly that session's arrays, whatever mix it came from."""
    model: MambaModel = request.getfixturevalue(fixture)
    states = _warm_states(model, 6, seed=21)
    a, _ = model.step(BatchState.stack(states[:4]), random_inputs(model, 4, seed=22))
    b, _ = model.step(BatchState.stack(states[4:]), random_inputs(model, 2, seed=23))
    own = states[0].copy()
    for mix in (
        [a.session(2), a.session(3), b.session(0), own, a.session(0)],  # a range, then scattered
        [b.session(1), a.session(1), b.session(0), a.session(3)],  # interleaved sources
        [own, states[5].copy()],  # no rows at all
        [a.session(1)],
    ):
        stacked = BatchState.stack(mix)
        assert stacked.batch_size == len(mix)
        for k, s in enumerate(mix):
            assert stacked.session(k).bit_equal(s)
        for arr in (*stacked.conv, *stacked.ssm):  # arrays of the stack's own
            assert not any(np.shares_memory(arr, x) for x in (*a.conv, *a.ssm, *b.conv, *b.ssm))


def test_rows_of_one_batch_step_again_without_a_copy(signal_model: MambaModel) -> None:
    """A stepper's next tick passes the rows of the last batch: all of them in order *are*
    that batch (no stacking); a subset or another order is gathered; the bits of every row
    equal the row stepped alone."""
    states = _warm_states(signal_model, 5, seed=11)
    x = random_inputs(signal_model, 5, seed=12)
    batch, _ = signal_model.step(BatchState.stack(states), x)
    rows = batch.sessions()
    assert all(r.is_view for r in rows)
    assert BatchState.stack(rows) is batch
    for picked in ([3, 1], [4, 3, 2, 1, 0], [0, 1, 2, 3]):
        gathered = BatchState.stack([rows[i] for i in picked])
        assert gathered is not batch and gathered.batch_size == len(picked)
        y = random_inputs(signal_model, len(picked), seed=13)
        stepped, out = signal_model.step(gathered, y)
        for k, i in enumerate(picked):
            alone, out_alone = _step_one(signal_model, rows[i].copy(), y[k])
            assert stepped.session(k).bit_equal(alone)
            assert out[k].tobytes() == out_alone.tobytes()
    # a row read as per-layer views (a snapshot) is still recognised as a row
    assert rows[2].layers[0].ssm.base is not None
    assert BatchState.stack(rows) is batch
    own = rows[2].copy()
    assert not own.is_view and own.bit_equal(rows[2])
