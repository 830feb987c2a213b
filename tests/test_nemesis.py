"""The nemesis (tests/nemesis): its checker on hand-made histories, each rule failing on
a history that breaks it and passing one that keeps it; and short seeded runs on each
topology (slow) that must find no violation."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.nemesis.checker import Expected, FinalRead, check, rewinds, stretch
from tests.nemesis.history import History, Op, TokenSighting

T0 = 1_000_000.0


def op(
    h: History, kind: str, invoke: float, complete: float | None, worker: str = "w0",
    step: int = 1, session: str = "s", ok: bool | None = True, **args: object,
) -> Op:  # fmt: skip
    o = h.invoke("c0", session, kind, **args)
    o.invoke, o.complete, o.ok, o.worker, o.step = T0 + invoke, None, ok, worker, step
    if complete is not None:
        o.complete = T0 + complete
    if ok is False:
        o.error = "Unavailable: gone"
    return o


def acquired(h: History, worker: str, at: float, token: str, proc: str = "") -> None:
    h.token(TokenSighting("s", token, worker, T0 + at, f"log:{proc or worker}:restored"))


def expected(steps: int, durability: str = "log", floor: int = 0) -> dict[str, Expected]:
    return {
        "s": Expected(
            "s", durability, steps, floor, {i: (f"i{i}", f"o{i}") for i in range(1, steps + 1)}
        )
    }


def final(steps: int, change: int = 0) -> dict[str, FinalRead]:
    outs = [f"o{i}" if i != change else "other" for i in range(1, steps + 1)]
    return {"s": FinalRead("s", steps, 1, [f"i{i}" for i in range(1, steps + 1)], outs)}


def rules(h: History, e: dict[str, Expected], f: dict[str, FinalRead]) -> list[str]:
    found = check(h, e, f)
    for v in found:
        assert stretch(h, v)  # every violation prints a stretch of history
    return [v.rule for v in found]


def test_a_good_history_passes():
    h = History()
    acquired(h, "w0", 0.0, "t1")
    op(h, "step", 1.0, 1.1, "w0", 1)
    acquired(h, "w1", 2.0, "t2")  # w1 took over, then answered
    op(h, "step", 2.5, 2.6, "w1", 2)
    acquired(h, "w0", 3.0, "t3")  # w0 acquired again before answering again
    op(h, "step", 3.5, 3.6, "w0", 3)
    op(h, "final", 4.0, 4.1, "w0", 3)
    assert rules(h, expected(3), final(3)) == []


def test_a_missing_acknowledged_step_fails_a_log_session_only():
    h = History()
    op(h, "step", 1.0, 1.1, "w0", 1)
    assert rules(h, expected(3), final(2)) == ["a"]
    # snapshot durability may lose what follows its last snapshot, never before it
    assert rules(h, expected(3, "snapshot", floor=2), final(2)) == []
    assert rules(h, expected(3, "snapshot", floor=3), final(2)) == ["a"]


def test_a_step_that_differs_from_its_answer_fails():
    h = History()
    assert rules(h, expected(3), final(3, change=2)) == ["a"]


def test_a_read_behind_an_acknowledged_step_fails():
    h = History()
    op(h, "get", 1.0, 1.1, "w0", 1, expect=3, floor=0, durability="log")
    assert rules(h, {}, {}) == ["a"]
    h = History()
    op(h, "get", 1.0, 1.1, "w0", 1, expect=3, floor=0, durability="none")
    assert rules(h, {}, {}) == []


def test_a_loss_after_the_store_lost_writes_is_noted_not_failed():
    """Redis showed the session's token go back (the store itself lost acknowledged
    writes: a promoted replica without them) before the read behind them: noted. The same
    read with no such sign, or a rewind seen only after the read, fails."""

    def history(rewind_at: float | None) -> History:
        h = History()
        h.token(TokenSighting("s", "t1", "a", T0 + 0.5, "redis"))
        h.token(TokenSighting("s", "t2", "a", T0 + 0.7, "redis"))
        if rewind_at is not None:
            h.token(TokenSighting("s", "t1", "a", T0 + rewind_at, "redis"))
        op(h, "get", 1.0, 1.1, "w0", 1, expect=3, floor=0, durability="log")
        return h

    h = history(0.9)
    assert rules(h, {}, {}) == []
    assert any("the store lost acknowledged writes of s" in n for n in h.notes)
    assert rules(history(None), {}, {}) == ["a"]
    assert rules(history(5.0), {}, {}) == ["a"]


def test_a_resent_step_answered_differently_fails():
    h = History()
    o = op(h, "step", 1.0, 1.1, "w0", 1, expected="aaaa")
    o.digest = "bbbb"
    assert rules(h, {}, {}) == ["a"]
    o.digest = "aaaa"
    assert rules(h, {}, {}) == []


def test_a_lost_session_fails_unless_the_store_was_wiped():
    h = History()
    e = {"s": Expected("s", "log", 0, 0, {}, lost="NotFound: session 's' does not exist")}
    assert rules(h, e, {}) == ["a"]
    h.fault("redis-restart-wiped", "redis")
    assert rules(h, e, {}) == []


def test_an_answer_after_another_worker_answered_fails_without_a_new_acquisition():
    h = History()
    acquired(h, "w0", 0.0, "t1")
    op(h, "step", 1.0, 1.1, "w0", 1)
    acquired(h, "w1", 2.0, "t2")
    op(h, "forecast", 2.5, 2.6, "w1", 1)  # w1 took over and answered
    op(h, "step", 3.0, 3.1, "w0", 2)  # w0 answers on its old lease
    assert rules(h, {}, {}) == ["b"]


def test_an_answer_in_flight_while_the_session_moved_passes():
    """w1's answer was asked for before w0 acquired again: no overlap of tenures."""
    h = History()
    acquired(h, "w1", 0.0, "t1")
    op(h, "step", 1.0, 3.0, "w1", 1)  # delivered late (a slow link)
    acquired(h, "w0", 2.0, "t2")  # a hand-off: w0 acquired after w1's answer was asked for
    op(h, "step", 3.5, 3.6, "w0", 2)
    assert rules(h, {}, {}) == []


def test_a_token_acquired_twice_fails():
    h = History()
    acquired(h, "w0", 0.0, "t1", proc="p1")
    acquired(h, "w1", 1.0, "t1", proc="p2")
    assert rules(h, {}, {}) == ["c"]


def test_a_token_with_two_owners_in_redis_fails():
    h = History()
    for at, token, owner in [(0.0, "t1", "a"), (1.0, "t2", "b"), (2.0, "t1", "b")]:
        h.token(TokenSighting("s", token, owner, T0 + at, "redis"))
    assert rules(h, {}, {}) == ["c"]
    h = History()  # the store went back to t1 (lost writes): reported, not a violation
    for at, token, owner in [(0.0, "t1", "a"), (1.0, "t2", "b"), (2.0, "t1", "a")]:
        h.token(TokenSighting("s", token, owner, T0 + at, "redis"))
    assert rules(h, {}, {}) == []
    assert len(rewinds(h.tokens)) == 1
    h = History()  # back to t1 while a hand-off reserved it for b: the store's loss only
    for at, token, owner in [(0.0, "t1", "a"), (1.0, "t2", "b"), (2.0, "t1", "handoff:b")]:
        h.token(TokenSighting("s", token, owner, T0 + at, "redis"))
    assert rules(h, {}, {}) == []
    # ... or after that reservation ran out: no lease key, nobody holds it (the sampler
    # records no owner; seed 5202 on Sentinel, 10 min, saw it).
    h = History()
    for at, token, owner in [(0.0, "t1", "a"), (1.0, "t2", "b"), (2.0, "t1", "")]:
        h.token(TokenSighting("s", token, owner, T0 + at, "redis"))
    assert rules(h, {}, {}) == []


def test_a_request_without_an_outcome_fails():
    h = History()
    op(h, "stream", 1.0, None, ok=None)
    assert rules(h, {}, {}) == ["d"]
    h = History()
    o = op(h, "stream", 1.0, 61.0, ok=False)
    o.error = "Hung: HUNG: no answer and no error within 60 s"
    assert rules(h, {}, {}) == ["d"]
    o.error = "Unavailable: gone"  # an error reported in time is an outcome
    assert rules(h, {}, {}) == []


def test_a_session_that_does_not_recover_fails():
    h = History()
    op(h, "final", 1.0, 31.0, ok=False)
    assert rules(h, {}, {}) == ["e"]


def test_a_history_survives_its_dump(tmp_path: Path):
    h = History()
    op(h, "step", 1.0, 1.1, "w0", 1)
    h.fault("worker-kill-9", "w0")
    h.token(TokenSighting("s", "t1", "w0", T0, "redis"))
    h.dump(tmp_path / "h.json")
    again = History.load(tmp_path / "h.json")
    assert [o.line() for o in again.ops] == [o.line() for o in h.ops]
    assert len(again.faults) == 1 and len(again.tokens) == 1


def _run(topology: str, seed: int, tmp_path: Path) -> None:
    from tests.nemesis.run import run

    outcome = run(seed, 2.0, topology, keep=tmp_path)
    text = "\n".join(outcome.report)
    assert sum(outcome.faults.values()) > 0, text
    assert outcome.ok, text


@pytest.mark.slow
def test_nemesis_single(tmp_path: Path):
    _run("single", 4049, tmp_path)


@pytest.mark.slow
@pytest.mark.topology
def test_nemesis_sentinel(tmp_path: Path):
    _run("sentinel", 4049, tmp_path)


@pytest.mark.slow
@pytest.mark.topology
def test_nemesis_cluster(tmp_path: Path):
    _run("cluster", 4049, tmp_path)
