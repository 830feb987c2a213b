"""The in-memory step rings of a session (``RecentSteps``): by step, bounded, contiguous."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from ssmserve.server.engine.config import Architecture, MambaConfig
from ssmserve.server.state.input_log import (
    ROW_ARRAY_MIN_BYTES,
    InputBlock,
    InputCodec,
    RecentSteps,
    StepRing,
    UnflushedInputs,
)

#: Row widths (float32) held in one shared array, and in an array each.
SMALL, LARGE = 3, ROW_ARRAY_MIN_BYTES // 4


def _row_of(step: int, width: int = SMALL) -> np.ndarray:
    return np.arange(width, dtype=np.float32) + np.float32(step)


_row = _row_of


@pytest.mark.parametrize("width", [SMALL, LARGE])
@pytest.mark.parametrize("window", [1, 5, 8, 13, 64])
def test_a_ring_holds_the_newest_window_rows_as_it_grows_and_wraps(window: int, width: int) -> None:
    ring = StepRing(window, np.float32)
    _row = functools.partial(_row_of, width=width)
    for step in range(1, 200):
        ring.append(step, _row(step))
        held = range(max(1, step - window + 1), step + 1)
        assert (ring.first, ring.last, len(ring)) == (held[0], step, len(held))
        for t in (held[0] - 1, step + 1):
            assert ring.row(t) is None
        for t in held:
            row = ring.row(t)
            assert row is not None and row.tobytes() == _row(t).tobytes()
        # Any held range as one copy, in order, across the wrap too.
        for first in (held[0], held[len(held) // 2], step):
            rows = ring.rows(first, step)
            assert rows.tobytes() == np.stack([_row(t) for t in range(first, step + 1)]).tobytes()
            rows[:] = -1  # a copy
            assert ring.row(step).tobytes() == _row(step).tobytes()  # type: ignore[union-attr]
        with pytest.raises(IndexError):
            ring.rows(held[0] - 1, step)
        with pytest.raises(IndexError):
            ring.rows(held[0], step + 1)
    assert ring.nbytes == window * width * 4  # grew to the window, never past it


def test_a_ring_grows_by_half_only_as_far_as_it_is_filled() -> None:
    """8 -> 16 -> 24 -> 40 -> 64 -> 96 rows, appended one by one or extended many at a time."""
    for count, capacity in ((1, 8), (8, 8), (9, 16), (24, 24), (40, 40), (41, 64), (65, 96)):
        ring = StepRing(256, np.float32)
        for step in range(1, count + 1):
            ring.append(step, _row(step))
        assert ring.nbytes == capacity * 3 * 4, count
        extended = StepRing(256, np.float32)
        extended.extend(1, np.stack([_row(step) for step in range(1, count + 1)]))
        assert extended.nbytes == capacity * 3 * 4, count


@pytest.mark.parametrize("width", [SMALL, LARGE])
def test_cut_then_append_continues_and_a_gap_starts_over(width: int) -> None:
    ring = StepRing(6, np.float32)
    _row = functools.partial(_row_of, width=width)
    for step in range(10, 20):  # wrapped: holds 14..19
        ring.append(step, _row(step))
    ring.cut_after(16)
    assert (ring.first, ring.last) == (14, 16) and ring.row(17) is None
    ring.append(17, _row(117))  # the step after the cut, with another value
    assert ring.row(17).tobytes() == _row(117).tobytes()
    assert ring.row(14).tobytes() == _row(14).tobytes()
    ring.append(30, _row(30))  # not the next step: older rows cannot stay contiguous
    assert (ring.first, ring.last) == (30, 30) and ring.row(17) is None
    ring.cut_after(5)
    assert len(ring) == 0 and ring.row(30) is None
    ring.append(6, _row(6))
    assert (ring.first, ring.last) == (6, 6)


def test_a_ring_of_window_zero_holds_nothing() -> None:
    ring = StepRing(0, np.float32)
    ring.append(1, _row(1))
    assert len(ring) == 0 and ring.row(1) is None and ring.nbytes == 0


def test_recent_steps_answers_copies_and_history_by_step() -> None:
    recent = RecentSteps(input_window=4, output_window=3)
    for step in range(1, 8):
        recent.record(step, np.float32([step, -step]).tobytes(), _row(step))
    block = recent.unflushed.take()
    assert block is not None and (block.first, block.count) == (1, 7)
    assert block.inputs() == [np.float32([s, -s]).tobytes() for s in range(1, 8)]
    assert not recent.unflushed and recent.unflushed.take() is None
    out = recent.output_at(7)
    assert out is not None and out.tobytes() == _row(7).tobytes()
    out[:] = 0  # a copy: the ring keeps the answer
    assert recent.output_at(7).tobytes() == _row(7).tobytes()  # type: ignore[union-attr]
    assert recent.output_at(4) is None  # outputs hold 5..7
    assert recent.input_at(4) == np.float32([4, -4]).tobytes()  # inputs hold 4..7
    first, rows = recent.history(6, 10)
    assert first == 4 and rows is not None and rows.dtype == np.uint8
    assert rows.tobytes() == np.float32([[t, -t] for t in (4, 5, 6)]).tobytes()
    first, rows = recent.history(6, 2)
    assert first == 5 and rows.tobytes() == np.float32([[5, -5], [6, -6]]).tobytes()
    assert recent.history(9, 10) == (10, None)
    assert recent.history(6, 0) == (7, None)
    recent.cut_after(5)
    assert recent.input_at(6) is None and recent.output_at(5) is not None
    recent.remember(6, [np.float32([60, -60]).tobytes()], [_row(60)])
    assert recent.input_at(6) == np.float32([60, -60]).tobytes()
    assert recent.output_at(6).tobytes() == _row(60).tobytes()  # type: ignore[union-attr]


@pytest.mark.parametrize("architecture", [Architecture.SIGNAL, Architecture.LM])
def test_held_rows_decode_as_the_log_bytes_do(architecture: Architecture) -> None:
    """``decode_rows`` of the ring's raw rows equals ``decode_many`` of the same inputs'
    log bytes, for token ids and for vectors; a row of the wrong width is refused."""
    config = MambaConfig(
        architecture=architecture, hidden_size=8, state_size=2, num_hidden_layers=1,
        intermediate_size=16, conv_kernel=2, time_step_rank=1, use_bias=False,
        use_conv_bias=True, layer_norm_epsilon=1e-5, input_dim=3, signal_output_dim=2,
        vocab_size=50,
    )  # fmt: skip
    codec = InputCodec(config)
    rng = np.random.default_rng(0)
    values = rng.integers(0, 50, 5) if config.is_token_model else rng.random((5, 3))
    raw = [codec.encode(v) for v in values]
    recent = RecentSteps(input_window=8, output_window=1)
    for step, r in enumerate(raw, start=1):
        recent.record(step, r, np.zeros(2, np.float32))
    first, rows = recent.history(5, 4)
    assert first == 2 and rows is not None
    decoded = codec.decode_rows(rows)
    expected = codec.decode_many(raw[1:])
    assert decoded.dtype == expected.dtype and decoded.shape == expected.shape
    assert decoded.tobytes() == expected.tobytes()
    with pytest.raises(ValueError, match="wrong size"):
        codec.decode_rows(rows[:, :-1])


def test_large_rows_are_held_without_spare_room() -> None:
    """An array per row: the ring holds exactly the rows it was given (a language model's
    logits rows would leave megabytes spare in a ring grown by half), and once full it
    reuses the oldest row's array instead of allocating."""
    row_bytes = LARGE * 4
    for count in (1, 9, 41, 65):
        ring = StepRing(64, np.float32)
        for step in range(1, count + 1):
            ring.append(step, _row_of(step, LARGE))
        assert ring.nbytes == min(count, 64) * row_bytes, count
        extended = StepRing(64, np.float32)
        extended.extend(1, np.stack([_row_of(step, LARGE) for step in range(1, count + 1)]))
        assert extended.nbytes == min(count, 64) * row_bytes, count
    arrays = {id(ring.row(step)) for step in range(ring.first, ring.last + 1)}
    ring.append(66, _row_of(66, LARGE))
    assert id(ring.row(66)) in arrays and ring.row(2) is None  # the oldest's array, reused
    assert ring.row(66).tobytes() == _row_of(66, LARGE).tobytes()  # type: ignore[union-attr]


@pytest.mark.parametrize("width", [SMALL, LARGE])
@pytest.mark.parametrize("window", [0, 1, 5, 8, 13])
def test_extending_a_ring_by_many_rows_equals_appending_them_one_by_one(
    window: int, width: int
) -> None:
    """``extend`` (a run's rows at once) against ``append`` (the reference), over random
    sequences of extends, gaps and cuts: the same rows by step, the same memory."""
    rng = np.random.default_rng(window)
    for _ in range(50):
        many, single = StepRing(window, np.float32), StepRing(window, np.float32)
        step = int(rng.integers(1, 5))
        for _ in range(int(rng.integers(1, 12))):
            action = rng.random()
            if action < 0.1 and single.count:  # a cut (rollback)
                at = int(rng.integers(single.first - 1, single.last + 1))
                many.cut_after(at)
                single.cut_after(at)
                step = max(at + 1, single.first) if single.count else at + 1
                continue
            if action < 0.2:  # a gap: the ring starts over
                step += int(rng.integers(1, 4))
            n = int(rng.integers(0, 2 * window + 3))
            rows = rng.standard_normal((n, width)).astype(np.float32)
            many.extend(step, rows)
            for k in range(n):
                single.append(step + k, rows[k])
            step += n
            assert (many.first, many.count, many.nbytes) == (
                single.first,
                single.count,
                single.nbytes,
            )
            for s in range(single.first - 1, single.last + 2):
                a, b = many.row(s), single.row(s)
                assert (a is None) == (b is None)
                if a is not None:
                    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("window", [1, 4, 9])
def test_a_ring_matches_a_dict_of_its_newest_contiguous_rows(window: int) -> None:
    """Both kinds of row, and a ring whose row width changes (small <-> large) between
    runs, against a plain dict of step -> row holding what a ring must: the newest
    ``window`` contiguous steps since the last gap, cut or width change."""
    rng = np.random.default_rng(window)
    for _ in range(40):
        ring, want = StepRing(window, np.float32), {}
        step, width = 1, int(rng.choice([SMALL, LARGE]))
        for _ in range(int(rng.integers(1, 14))):
            action = rng.random()
            if action < 0.1 and want:  # a cut (rollback)
                at = int(rng.integers(min(want) - 1, max(want) + 1))
                ring.cut_after(at)
                want = {t: r for t, r in want.items() if t <= at}
                step = at + 1
                continue
            if action < 0.2:  # a gap
                step += int(rng.integers(1, 4))
            if action > 0.9:  # another width
                width = LARGE if width == SMALL else SMALL
            n = int(rng.integers(0, 2 * window + 3))
            rows = rng.standard_normal((n, width)).astype(np.float32)
            held_width = len(next(iter(want.values()))) if want else width
            if n and want and (step != max(want) + 1 or held_width != width):
                want = {}  # not the next step, or rows of another width: the ring starts over
            if rng.random() < 0.5:
                ring.extend(step, rows)
            else:
                for k in range(n):
                    ring.append(step + k, rows[k])
            want.update({step + k: rows[k] for k in range(n)})
            want = {t: want[t] for t in sorted(want)[-window:]}
            step += n
            assert len(ring) == len(want)
            if want:
                assert (ring.first, ring.last) == (min(want), max(want))
                got = ring.rows(ring.first, ring.last)
                assert got.tobytes() == np.stack([want[t] for t in sorted(want)]).tobytes()
            for t in range(step - 2 * window - 3, step + 2):
                row = ring.row(t)
                assert (row is None) == (t not in want)
                if row is not None:
                    assert row.tobytes() == want[t].tobytes()


def test_recording_a_run_equals_recording_its_steps() -> None:
    rng = np.random.default_rng(1)
    raw = rng.standard_normal((6, 4)).astype("<f4")
    out = rng.standard_normal((6, 2)).astype(np.float32)
    run, steps = RecentSteps(4, 5), RecentSteps(4, 5)
    run.record_run(3, raw.tobytes(), out)
    for k in range(6):
        steps.record(3 + k, raw[k].tobytes(), out[k])
    assert run.unflushed.block() == steps.unflushed.block()
    for s in range(2, 10):
        assert run.input_at(s) == steps.input_at(s)
        a, b = run.output_at(s), steps.output_at(s)
        assert (a is None) == (b is None) and (a is None or np.array_equal(a, b))


def test_unflushed_inputs_keep_the_steps_a_list_of_pairs_would() -> None:
    """``UnflushedInputs`` (one block) against a list of (step, bytes) pairs over random
    single steps, runs, rollbacks, partial flushes and takes."""
    rng = np.random.default_rng(7)
    width = 8
    for _round in range(30):
        held, pairs = UnflushedInputs(), list[tuple[int, bytes]]()
        step = int(rng.integers(1, 50))  # the session's step: the next input is step + 1
        for _op in range(60):
            op = rng.integers(5)
            if op <= 1:  # one step, or a run of them
                n = 1 if op == 0 else int(rng.integers(1, 6))
                raws = [rng.bytes(width) for _ in range(n)]
                held.add(step + 1, n, b"".join(raws))
                pairs += [(step + 1 + i, raw) for i, raw in enumerate(raws)]
                step += n
            elif op == 2:  # rollback
                step = max(0, step - int(rng.integers(0, 6)))
                held.cut_after(step)
                pairs = [(s, raw) for s, raw in pairs if s <= step]
            elif op == 3 and pairs:  # a flush up to some step, then what it wrote dropped
                upto = pairs[0][0] + int(rng.integers(-1, len(pairs) + 1))
                block = held.block(upto)
                written = [raw for s, raw in pairs if s <= upto]
                if not written:
                    assert block is None
                    continue
                assert block is not None and block.first == pairs[0][0]
                assert block.inputs() == written and block.last == pairs[len(written) - 1][0]
                held.drop(block.count)
                pairs = pairs[len(written) :]
            elif op == 4 and rng.random() < 0.3:
                block = held.take()
                assert (block is None) == (not pairs)
                if block is not None:
                    assert block == InputBlock.of(pairs[0][0], [raw for _, raw in pairs])
                pairs = []
            assert len(held) == len(pairs) and bool(held) == bool(pairs)
            if pairs:
                assert (held.first, held.last) == (pairs[0][0], pairs[-1][0])
                lo, hi = sorted(int(x) for x in rng.integers(step - 8, step + 3, 2))
                assert held.inputs(lo, hi) == [raw for s, raw in pairs if lo <= s <= hi]


def test_unflushed_inputs_refuse_a_gap_and_blocks_refuse_ragged_inputs() -> None:
    held = UnflushedInputs()
    held.add(5, 2, b"aabb")
    with pytest.raises(ValueError, match="step 8 does not follow"):
        held.add(8, 1, b"cc")
    assert held.block() == InputBlock(5, 2, b"aabb")  # unchanged
    with pytest.raises(ValueError, match="one length"):
        InputBlock.of(1, [b"a", b"bb"])
    with pytest.raises(ValueError, match="not 2 inputs"):
        InputBlock(1, 2, b"abc")
