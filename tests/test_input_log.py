"""The in-memory step rings of a session (``RecentSteps``): by step, bounded, contiguous."""

from __future__ import annotations

import numpy as np
import pytest

from ssmserve.server.state.input_log import RecentSteps, StepRing


def _row(step: int, width: int = 3) -> np.ndarray:
    return np.arange(width, dtype=np.float32) + np.float32(step)


@pytest.mark.parametrize("window", [1, 5, 8, 13, 64])
def test_a_ring_holds_the_newest_window_rows_as_it_grows_and_wraps(window: int) -> None:
    ring = StepRing(window, np.float32)
    for step in range(1, 200):
        ring.append(step, _row(step))
        held = range(max(1, step - window + 1), step + 1)
        assert (ring.first, ring.last, len(ring)) == (held[0], step, len(held))
        for t in (held[0] - 1, step + 1):
            assert ring.row(t) is None
        for t in held:
            row = ring.row(t)
            assert row is not None and row.tobytes() == _row(t).tobytes()
    assert ring.nbytes == window * 3 * 4  # grew to the window, never past it


def test_a_ring_grows_by_doubling_only_as_far_as_it_is_filled() -> None:
    ring = StepRing(256, np.float32)
    for step in range(1, 41):
        ring.append(step, _row(step))
    assert ring.nbytes == 64 * 3 * 4


def test_cut_then_append_continues_and_a_gap_starts_over() -> None:
    ring = StepRing(6, np.float32)
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
    assert [s for s, _ in recent.take_unflushed()] == list(range(1, 8))
    out = recent.output_at(7)
    assert out is not None and out.tobytes() == _row(7).tobytes()
    out[:] = 0  # a copy: the ring keeps the answer
    assert recent.output_at(7).tobytes() == _row(7).tobytes()  # type: ignore[union-attr]
    assert recent.output_at(4) is None  # outputs hold 5..7
    assert recent.input_at(4) == np.float32([4, -4]).tobytes()  # inputs hold 4..7
    first, raw = recent.history(6, 10)
    assert first == 4 and raw == [np.float32([t, -t]).tobytes() for t in (4, 5, 6)]
    assert recent.history(9, 10) == (10, [])
    recent.cut_after(5)
    assert recent.input_at(6) is None and recent.output_at(5) is not None
    recent.remember(6, [np.float32([60, -60]).tobytes()], [_row(60)])
    assert recent.input_at(6) == np.float32([60, -60]).tobytes()
    assert recent.output_at(6).tobytes() == _row(60).tobytes()  # type: ignore[union-attr]
