"""The batch plan on its own (``sessions/batch_plan.py``), as vLLM tests its scheduler:
sessions in given states with given queues, and what the plan says a batch does."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.sessions.batch_plan import (
    APPLY,
    GAP,
    RESEND,
    PrefillLimits,
    plan,
    plan_session,
)
from ssmserve.server.sessions.config import Durability, SessionConfig, SessionDefaults
from ssmserve.server.sessions.guards import GuardAction, GuardCheck, GuardRule
from ssmserve.server.sessions.session import Session, StepRun, _Gate
from ssmserve.server.state.input_log import RecentSteps
from ssmserve.server.state.lease import SessionLease

MAX_TICKS = 16


def session(model: MambaModel, step: int, **config: object) -> Session:
    c = replace(SessionConfig(snapshot_every=8, snapshot_phase=0), **config)  # type: ignore[arg-type]
    resolved = c.resolve(SessionDefaults(), model.config.output_dim)
    return Session(
        "s", model, "demo", resolved, model.new_state(), step, 0.0, RecentSteps(4, 4),
        SessionLease("s", "t.1", "w"), lambda s: None,
    )  # fmt: skip


def job(model: MambaModel, step: int) -> StepRun:
    """A step sent alone: a run of one (the plan answers nothing, so no future)."""
    value = np.zeros(model.config.input_dim, np.float32)
    return StepRun.one("s", step, value, value.tobytes(), None)  # type: ignore[arg-type]


def run(model: MambaModel, first: int, count: int) -> StepRun:
    values = np.zeros((count, model.config.input_dim), np.float32)
    return StepRun("s", first, values, values.tobytes(), model.config.output_dim, None)  # type: ignore[arg-type]


def kinds(p) -> list[tuple[str, int, int]]:
    return [(piece.kind, piece.first, piece.count) for piece in p.pieces]


def test_a_lone_next_step_is_applied_in_one_engine_call_and_logged_ahead(demo_model):
    s = session(demo_model, 3)
    s.queue.append(job(demo_model, 4))
    p = plan_session(s, MAX_TICKS)
    assert kinds(p) == [(APPLY, 4, 1)]
    assert (p.advance, p.segments, p.log_ahead, p.guarded) == (1, [1], True, False)


def test_resends_gaps_and_applies_in_queue_order(demo_model):
    """At step 5: a resend of 5, step 6, a gap (8: the session will be at 6), then 7,
    and 8 again, now the next step. Each is classified at its place in the queue."""
    s = session(demo_model, 5)
    for step in (5, 6, 8, 7, 8):
        s.queue.append(job(demo_model, step))
    p = plan_session(s, MAX_TICKS)
    assert kinds(p) == [(RESEND, 5, 1), (APPLY, 6, 1), (GAP, 8, 1), (APPLY, 7, 1), (APPLY, 8, 1)]
    assert [piece.at for piece in p.pieces] == [5, 5, 6, 6, 7]
    assert p.advance == 3 and p.segments == [3]


def test_a_run_is_cut_where_snapshots_fall_due_and_capped_at_max_ticks(demo_model):
    """Snapshots every 8 steps (phase 0): a run of 40 from step 11 takes 16 steps
    (11..26), in engine calls ending at 16 and 24, and leaves the rest queued."""
    s = session(demo_model, 10)
    r = run(demo_model, 11, 40)
    s.queue.append(r)
    p = plan_session(s, MAX_TICKS)
    assert kinds(p) == [(APPLY, 11, 16)]
    assert p.segments == [6, 8, 2] and p.due == [16, 24]
    assert r.taken == 0 and len(s.queue) == 1  # the plan takes nothing itself


def test_a_run_partly_resent_then_applied(demo_model):
    """A run from step 3 when the session is at 6: 3..6 are resends, 7.. applied."""
    s = session(demo_model, 6)
    s.queue.append(run(demo_model, 3, 8))
    p = plan_session(s, MAX_TICKS)
    assert kinds(p) == [(RESEND, 3, 4), (APPLY, 7, 4)]
    assert p.pieces[1].lo == 4 and p.advance == 4


def test_a_guarded_session_advances_one_step_per_engine_call_and_logs_after(demo_model):
    rule = GuardRule(name="g", check=GuardCheck.FINITE, action=GuardAction.REJECT)
    s = session(demo_model, 0, guards=(rule,))
    for step in (1, 2, 3):
        s.queue.append(job(demo_model, step))
    p = plan_session(s, MAX_TICKS)
    assert p.guarded and p.segments == [1, 1, 1] and not p.log_ahead


def test_a_control_operation_ends_what_the_batch_takes(demo_model):
    s = session(demo_model, 0)
    s.queue.append(job(demo_model, 1))
    s.queue.append(_Gate(None))  # type: ignore[arg-type]
    s.queue.append(job(demo_model, 2))
    assert kinds(plan_session(s, MAX_TICKS)) == [(APPLY, 1, 1)]


@pytest.mark.parametrize(
    ("durability", "segments", "ahead"),
    [
        (Durability.LOG, [8, 4], True),
        (Durability.SNAPSHOT, [8, 4], False),  # snapshots still cut the engine calls
        (Durability.NONE, [12], False),  # no periodic snapshots at all
    ],
)
def test_durability_decides_the_log_ahead_and_the_snapshot_cuts(
    demo_model, durability, segments, ahead
):
    s = session(demo_model, 0, durability=durability)
    s.queue.append(run(demo_model, 1, 12))
    p = plan_session(s, MAX_TICKS)
    assert (p.segments, p.log_ahead) == (segments, ahead)


def test_nothing_goes_ahead_while_older_inputs_wait_to_be_logged(demo_model):
    s = session(demo_model, 2)
    s.recent.record(2, b"\0" * 16, np.zeros(demo_model.config.output_dim, np.float32))
    s.queue.append(job(demo_model, 3))
    assert not plan_session(s, MAX_TICKS).log_ahead


def test_a_batch_plan_has_as_many_rounds_as_its_longest_session(demo_model):
    a, b = session(demo_model, 0), session(demo_model, 0)
    a.queue.append(job(demo_model, 1))
    b.queue.append(run(demo_model, 1, 12))
    p = plan([a, b], MAX_TICKS)
    assert [sp.segments for sp in p.sessions] == [[1], [8, 4]] and p.rounds == 2


# ---------------------------------------------------------------------------- prefill

PREFILL = PrefillLimits(min_steps=8, batch_tokens=64, chunk=64)


def long_run(model: MambaModel, first: int, count: int, last_only: bool = False) -> StepRun:
    values = np.zeros((count, model.config.input_dim), np.float32)
    return StepRun(
        "s",
        first,
        values,
        values.tobytes(),
        model.config.output_dim,
        None,
        last_only,  # type: ignore[arg-type]
    )


def test_a_long_run_alone_is_prefilled_in_chunks_of_the_batch_budget(demo_model):
    """A run of 200 from step 1, snapshots every 32: the batch takes 64 steps (the whole
    budget, not max_ticks), as two prefills ending where snapshots fall due, every output
    computed; the rest stays queued."""
    s = session(demo_model, 0, snapshot_every=32)
    s.queue.append(long_run(demo_model, 1, 200))
    (p,) = plan([s], MAX_TICKS, PREFILL).sessions
    assert kinds(p) == [(APPLY, 1, 64)] and p.segments == [32, 32] and p.due == [32, 64]
    assert p.prefilled(0) and p.prefilled(1)
    assert [r.tolist() for r in p.rows] == [list(range(32))] * 2
    assert p.computed is not None and p.computed.all()


def test_a_last_only_run_computes_only_its_last_output_and_each_segment_end(demo_model):
    """A last_only run of 40 at step 5, snapshots every 32: segments 6..32 (27 steps)
    and 33..44; the first computes only its end (the snapshot's step), the second its
    end, the run's last step."""
    s = session(demo_model, 5, snapshot_every=32)
    s.queue.append(long_run(demo_model, 6, 40, last_only=True))
    (p,) = plan([s], MAX_TICKS, PREFILL).sessions
    assert p.segments == [27, 13] and [r.tolist() for r in p.rows] == [[26], [12]]
    computed = p.computed
    assert computed is not None and np.flatnonzero(computed).tolist() == [26, 39]


def test_a_resend_queued_behind_a_last_only_run_asks_for_its_output(demo_model):
    """A step of the advance resent by a later entry (another stream asking for outputs)
    is answered with its output, so the prefill computes it."""
    s = session(demo_model, 0, snapshot_every=64)
    s.queue.append(long_run(demo_model, 1, 20, last_only=True))
    s.queue.append(job(demo_model, 7))
    (p,) = plan([s], MAX_TICKS, PREFILL).sessions
    assert kinds(p) == [(APPLY, 1, 20), (RESEND, 7, 1)]
    assert [r.tolist() for r in p.rows] == [[6, 19]]


@pytest.mark.parametrize(
    ("count", "config", "why"),
    [
        (7, {}, "shorter than min_steps"),
        (40, {"snapshot_every": 4}, "snapshots more often than every min_steps steps"),
        (
            40,
            {"guards": (GuardRule(name="g", check=GuardCheck.FINITE, action=GuardAction.REPORT),)},
            "guards read every output before the next step",
        ),
    ],
)
def test_runs_that_are_not_prefilled(demo_model, count, config, why):
    s = session(demo_model, 0, **{"snapshot_every": 64, **config})
    s.queue.append(long_run(demo_model, 1, count))
    (p,) = plan([s], MAX_TICKS, PREFILL).sessions
    assert not p.rows and p.computed is None, why
    assert p.advance == min(count, MAX_TICKS)


def test_a_prompt_among_decoding_sessions_is_prefilled_and_they_step(demo_model):
    """Three decoding sessions' steps count first against the budget of 64; the prompt
    prefills the 61 left, computing only its chunk's last output."""
    decoding = [session(demo_model, 10, snapshot_every=64) for _ in range(3)]
    for d in decoding:
        d.queue.append(job(demo_model, 11))
    prompt = session(demo_model, 0, snapshot_every=64)
    prompt.queue.append(long_run(demo_model, 1, 512, last_only=True))
    p = plan([*decoding, prompt], MAX_TICKS, PREFILL)
    assert [sp.segments for sp in p.sessions] == [[1], [1], [1], [61]]
    assert [sp.prefilled(0) for sp in p.sessions] == [False, False, False, True]
    assert p.sessions[3].rows[0].tolist() == [60] and p.rounds == 1 and p.steps == 64


def test_the_budget_is_shared_and_many_runs_step_batched_instead(demo_model):
    """Four sessions with long runs share the 64 prefilled steps (16 each, prefilled);
    nine would get 7 each, under min_steps: their runs step together, max_ticks each,
    the weights read once per step for all of them."""

    def sessions(n: int) -> list[Session]:
        out = [session(demo_model, 0, snapshot_every=64) for _ in range(n)]
        for s in out:
            s.queue.append(long_run(demo_model, 1, 100))
        return out

    four = plan(sessions(4), MAX_TICKS, PrefillLimits(8, 64, 64))
    assert [sp.segments for sp in four.sessions] == [[16]] * 4
    assert all(sp.prefilled(0) for sp in four.sessions)
    wider = plan(sessions(4), MAX_TICKS, PrefillLimits(8, 128, 128))
    assert [sp.segments for sp in wider.sessions] == [[32]] * 4  # a share above max_ticks
    nine = plan(sessions(9), MAX_TICKS, PrefillLimits(8, 64, 64))
    assert [sp.segments for sp in nine.sessions] == [[MAX_TICKS]] * 9
    assert not any(sp.rows for sp in nine.sessions)
    assert plan(sessions(1), MAX_TICKS).sessions[0].rows == []  # NO_PREFILL: never


# ---------------------------------------------------------------------------- token budget


def decoders(model: MambaModel, n: int) -> list[Session]:
    """``n`` sessions at step 10, each with its next step queued (a generated token)."""
    out = [session(model, 10, snapshot_every=64) for _ in range(n)]
    for d in out:
        d.queue.append(job(model, 11))
    return out


def prompts(model: MambaModel, n: int, count: int = 1024) -> list[Session]:
    out = [session(model, 0, snapshot_every=1024) for _ in range(n)]
    for s in out:
        s.queue.append(long_run(model, 1, count, last_only=True))
    return out


@pytest.mark.parametrize(
    ("decoding", "chunk"),
    [
        (0, 16),  # alone: the chunk, not the budget (32) nor max_ticks
        (3, 16),  # 29 left: still the chunk
        (20, 12),  # 12 left after the decode steps
        (40, 8),  # the decode steps take the whole budget: min_steps, so the prompt goes on
    ],
)
def test_decode_steps_count_first_and_a_prompt_chunk_fills_what_is_left(
    demo_model, decoding, chunk
):
    limits = PrefillLimits(min_steps=8, batch_tokens=32, chunk=16)
    (prompt,) = prompts(demo_model, 1)
    p = plan([*decoders(demo_model, decoding), prompt], MAX_TICKS, limits)
    *stepping, prefilling = p.sessions
    assert all(sp.segments == [1] and not sp.rows for sp in stepping)
    assert prefilling.segments == [chunk] and prefilling.prefilled(0)
    assert kinds(prefilling) == [(APPLY, 1, chunk)]


def test_a_chunk_above_max_ticks_is_taken_whole(demo_model):
    """The chunk bounds a prompt's steps per batch, not max_ticks (a stream's steps)."""
    (prompt,) = prompts(demo_model, 1)
    (p,) = plan([prompt], MAX_TICKS, PrefillLimits(8, 256, 96)).sessions
    assert p.segments == [96] and p.prefilled(0)


def test_prompts_share_what_the_decode_steps_leave(demo_model):
    """Two decoding sessions and a stream's short run (under min_steps: it steps) take 6
    of the budget of 40: two prompts get 17 each, under their chunk of 32."""
    short = session(demo_model, 4, snapshot_every=64)
    short.queue.append(long_run(demo_model, 5, 4))
    p = plan(
        [*decoders(demo_model, 2), short, *prompts(demo_model, 2)],
        MAX_TICKS,
        PrefillLimits(8, 40, 32),
    )
    assert [sp.segments for sp in p.sessions] == [[1], [1], [4], [17], [17]]


def test_the_phases_run_the_sessions_that_step_before_those_that_prefill(demo_model):
    """Given a prompt first, then two decoding sessions: the batch runs the two (in
    their order), answered before the prompt's chunk computes; without a prompt, one
    phase."""
    (prompt,) = prompts(demo_model, 1)
    a, b = decoders(demo_model, 2)
    p = plan([prompt, a, b], MAX_TICKS, PrefillLimits(8, 32, 16))
    assert [[sp.session for sp in phase] for phase in p.phases] == [[a, b], [prompt]]
    assert p.steps == 18
    only = plan(decoders(demo_model, 3), MAX_TICKS, PrefillLimits(8, 32, 16))
    assert len(only.phases) == 1 and len(only.phases[0]) == 3
    assert plan([], MAX_TICKS, PrefillLimits(8, 32, 16)).phases == []


def test_a_paused_prefill_takes_nothing_of_the_prompts_while_others_step(demo_model):
    """Paused (the stepper's share of time for prefill is spent): the decoding sessions
    step and the prompt is left queued, in no phase; a batch of prompts alone prefills
    even so (nothing else would run)."""
    limits = PrefillLimits(8, 32, 16)
    (prompt,) = prompts(demo_model, 1)
    a, b = decoders(demo_model, 2)
    p = plan([prompt, a, b], MAX_TICKS, limits, paused=True)
    assert p.sessions[0].pieces == [] and p.sessions[0].advance == 0
    assert [[sp.session for sp in phase] for phase in p.phases] == [[a, b]]
    assert p.steps == 2
    (alone,) = plan([prompt], MAX_TICKS, limits, paused=True).sessions
    assert alone.segments == [16] and alone.prefilled(0)
