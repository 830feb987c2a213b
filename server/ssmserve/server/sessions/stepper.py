"""The stepper: queued steps of all sessions of one model run as batched engine calls.

One :class:`Stepper` per model per worker. A batch takes every session whose queue starts
with a step (up to ``max_batch`` sessions) and goes through four phases, in this order,
each one method of :meth:`Stepper._batch`:

1. **Plan** (``batch_plan.plan``, a pure function): which queued steps each session takes
   (at most ``max_ticks``), which are resends answered from memory, which are gaps, how
   many steps it advances and in which engine calls (cut where a snapshot falls due; one
   step per call for a session with guards), and whose advance goes to the log ahead.
   The planned steps are then taken off the queues (``SessionWork.take``).
2. **Log ahead**: one append of every advance the plan sends ahead, before the first
   engine call: a ``log``-durability step is answered only once its input is in Redis
   (durable before acknowledged), and the append needs the input, not the output, so the
   round trip and the computation overlap (``log_ahead``).
3. **Execute**: engine rounds; in each, every session runs its next engine call, those of
   one length together (``EngineLane.step`` for one step, ``step_many`` for several:
   the same bits), or, for a segment the plan prefills, that session alone
   (``EngineLane.prefill``: the same bits again, only the outputs it needs). A guard's
   verdict on a step decides whether the session goes on (input rules judge its input
   before the call, which runs it with the input they made: ``stateful_guards``; output
   rules judge its output after); a step it keeps from running, and what is queued
   behind it, go back to the queue.
4. **Settle**: the appends' replies and a group commit of the inputs still unlogged; if a
   session's log write fails, it is put back exactly where the batch found it (states
   are values) and its steps are answered with the error. Then each session is checked
   to be still this worker's (self-fencing: ``ResidentSessions.revalidate``); due
   periodic snapshots go to the session's background writer (a copied state), guard
   rollbacks run, resends whose outputs left memory are replayed, guard events are
   recorded.

Only then is every step answered (``SessionWork.answer``), so an answer always reports
what happened to its step. A batch runs these phases twice when it prefills
(``BatchPlan.phases``): first for the sessions that only step, answered before the prefills
compute, then for the sessions that prefill; the plan holds the steps of both within one
token budget, decode steps first (``max_batch_tokens``, ``prefill_chunk``), so a prompt
holds the answers of the sessions decoding beside it for one chunk at most.

A session that must first be proven this worker's (its lease lapsed by this worker's
clock, or a write's outcome is unknown: ``ResidentSessions.revalidate``) is kept out of
the batches until it is, and proven in a task of its own (:class:`ApartProofs`):
its store may take a whole write deadline to answer (a Cluster master whose replica
cannot confirm), which every other session of a batch would otherwise wait out, batch
after batch. If it cannot be proven, its queued steps are answered with why (none
applied; clients send them again). Engine calls go through the model's
:class:`~ssmserve.server.engine.lane.EngineLane` (shared with forecasts): large ones on
its engine thread, so the event loop keeps serving streams while a batch computes, small
ones inline (``offload_min_flop``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ssmserve.server.engine.interface import Engine
from ssmserve.server.engine.lane import EngineLane
from ssmserve.server.engine.recurrent_state import SessionState
from ssmserve.server.errors import SsmserveError, being_cancelled
from ssmserve.server.sessions.batch_plan import BatchPlan, PrefillLimits, plan, prefill_candidate
from ssmserve.server.sessions.batch_work import GuardedStep, SessionWork
from ssmserve.server.sessions.checkpoints import Checkpoints
from ssmserve.server.sessions.config import Durability
from ssmserve.server.sessions.errors import input_mismatch
from ssmserve.server.sessions.events import SessionEvent
from ssmserve.server.sessions.events import record as record_events
from ssmserve.server.sessions.guards import GuardAction, GuardEvent, GuardVerdict, check_output
from ssmserve.server.sessions.log_ahead import LogAhead
from ssmserve.server.sessions.replay import Replay
from ssmserve.server.sessions.residency import ResidentSessions
from ssmserve.server.sessions.session import (
    GuardRejectedError,
    GuardRolledBackError,
    Session,
    SessionGoneError,
    StepRun,
)
from ssmserve.server.sessions.stateful_guards import judge_input, judge_step
from ssmserve.server.state.input_log import InputBlock
from ssmserve.server.state.lease import lease_clock
from ssmserve.server.state.store import Store

log = logging.getLogger(__name__)


#: The largest token budget or prefill chunk a worker takes (a prefill's memory is bounded
#: by its 512-row chunks, not by this; it keeps a typo from holding every answer for
#: minutes).
MAX_BATCH_TOKENS = 65_536


@dataclass(frozen=True)
class StepperSettings:
    max_batch: int = 256  # sessions per engine call
    max_ticks: int = 16  # engine calls per group commit (several steps per session)
    max_unflushed: int = 1 << 16  # non-log sessions: inputs held in memory before a flush
    # Engine calls of at least this many FLOPs (batch x model FLOPs per step) run on the
    # model's engine thread (steps and forecasts); smaller ones run on the loop, where
    # they cost less than the hop. 5 MFLOP is roughly half a millisecond of step here
    # (signal 256x4 at batch 2, the demo model at batch ~40; bench/bench_engine.py).
    offload_min_flop: float = 5e6
    # A segment of at least this many steps of a session without guards runs as one
    # prefill (``batch_plan``; 0: never). Measured alone on the engine (mamba-130m shapes,
    # 2 threads): prefill beats stepping the session at batch 1 from 2 steps and stepping
    # it inside a batch of 8 such runs from ~8; the demo model's prefill overtakes batch-1
    # stepping at 6-8 steps (a prefill's fixed cost is ~0.25 ms).
    prefill_min_steps: int = 8
    # The token budget (``batch_plan``, vLLM's chunked prefill): steps computed per batch,
    # decode steps first, then prompt chunks of at most ``prefill_chunk`` steps a session
    # fill what is left. A chunk of 64 of mamba-130m takes ~130-200 ms on 2 threads: the
    # longest a token beside a prompt waits, while a prompt alone prefills as fast as in
    # chunks of 64 before (bench/bench_fair_prefill.py; docs/serving.md).
    max_batch_tokens: int = 64
    prefill_chunk: int = 64
    # The share of the stepper's time prefill takes while other sessions decode: a prefill
    # call reads every weight once, as a decode step does, so a chunk in every batch would
    # at least double their time between tokens. After a prefill phase of t seconds while
    # sessions decode, prefill pauses for t * (1 - share) / share (1: never pauses).
    prefill_share: float = 0.25


#: Every durability, once: iterating the enum class each batch cost more than its dict.
_DURABILITIES = tuple(Durability)


class ApartProofs:
    """Sessions being proven this worker's (``ResidentSessions.revalidate``) each in a task
    of its own, apart from the batches (the module's docstring tells why)."""

    def __init__(self, residents: ResidentSessions, notify: Callable[[Session], None]) -> None:
        self.residents = residents
        self.notify = notify  # the stepper's: the session may step again
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, s: Session) -> None:
        """Prove ``s``, held (busy) meanwhile; then it steps again, or, if it could not be
        proven (the store unreachable, the session not ours), its queued steps are
        answered with the error, none applied."""
        s.busy = True

        async def prove() -> None:
            try:
                error = (await self.residents.revalidate([s])).get(s.id)
                if error is not None and s.gone is None:
                    s.answer_queued(error)
            except Exception:  # a bug must not leave the session held forever
                log.exception("session %s: revalidation failed", s.id)
                if s.gone is None:
                    s.answer_queued(SessionGoneError(f"session {s.id!r}: revalidation failed"))
            finally:
                s.busy = False
                s.open_gate()
                self.notify(s)

        task = asyncio.create_task(prove(), name=f"prove[{s.id}]")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class PrefillPause:
    """Prefill's share of the stepper's time while other sessions decode
    (``StepperSettings.prefill_share``; ``batch_plan``'s docstring tells why).

    Sessions decode while a phase of steps ended within :attr:`ACTIVE_S`; a prefill that
    runs then (beside them or alone, between two of their steps) pauses prefill for the
    decode time that keeps its share. While only prompts are ready, they wait for a
    decode step until the pause ends, and just after a phase of steps for a grace of
    that phase's time (at most :attr:`GRACE_S`): its sessions' next steps are on their
    way (a generation hands its token to gRPC first, a stream's client answers), and a
    chunk started alone would hold them."""

    ACTIVE_S = 0.5
    GRACE_S = 0.1
    # A pause is at most this long: a chunk's phase that a slow store held for seconds
    # (its time counts the log and commit round trips) or a tiny share must not stop a
    # prompt for longer than a decoder's client would notice.
    MAX_PAUSE_S = 2.0

    def __init__(
        self, share: float, min_steps: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.share = share
        self.min_steps = min_steps  # a prefill candidate's shortest run
        self.clock = clock
        self.resumes_at = 0.0  # clock() at which a paused prefill goes on
        self.decoded_at = -float("inf")  # clock() at the end of the last phase of steps
        self.decode_s = 0.0  # how long that phase took

    def paused(self) -> bool:
        return self.clock() < self.resumes_at

    def decoded(self, seconds: float) -> None:
        """A phase of steps ended, after ``seconds``."""
        self.decoded_at, self.decode_s = self.clock(), seconds

    def prefilled(self, seconds: float) -> None:
        """A prefill phase ended, after ``seconds``: if sessions decode, pause prefill."""
        now = self.clock()
        if now - self.decoded_at <= self.ACTIVE_S + seconds:
            pause = seconds * (1 - self.share) / self.share
            self.resumes_at = now + min(pause, self.MAX_PAUSE_S)

    def holds_until(self) -> float:
        """Until when prompts alone wait for a decode step (see the class docstring): the
        pause only while sessions decode (a phase of steps ended within ACTIVE_S)."""
        grace = self.decoded_at + min(self.decode_s, self.GRACE_S)
        decoding = self.clock() - self.decoded_at <= self.ACTIVE_S
        return max(self.resumes_at if decoding else 0.0, grace)

    async def wait_for_decode(self, ready: Iterable[Session], wake: asyncio.Event) -> bool:
        """While only prompts (prefill candidates) are ready and :meth:`holds_until` has
        not passed: wait for a step to be queued (``wake``), or that time (the bound).
        True if it waited (the caller looks at what is ready again)."""
        if self.min_steps <= 0:  # nothing prefills: there is no prompt to hold
            return False
        left = self.holds_until() - self.clock()
        if left <= 0 or not all(prefill_candidate(s, self.min_steps) for s in ready):
            return False
        wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), left)
        return True


async def run_phases(
    batch: BatchPlan,
    run: Callable[[list[SessionWork]], Awaitable[None]],
    pause: PrefillPause,
) -> None:
    """``batch``'s steps taken off the queues, then its phases ``run`` in turn, each
    answered before the next computes; each phase's time goes to ``pause``."""
    # A phase of steps counts as decoding only when it steps a session that is no prompt
    # (prompts stepped for a short budget share or a snapshot cut are not decoders whose
    # next step a prompt should wait for).
    decodes = [
        any(not prefill_candidate(p.session, pause.min_steps) for p in phase)
        for phase in batch.phases
    ]
    phases = [
        [SessionWork(p, p.session.state, p.session.guard_state) for p in phase]
        for phase in batch.phases
    ]
    _take_all(phases)
    for i, phase in enumerate(phases):
        if i:  # a session that left memory while an earlier phase ran: its error
            phase = _still_resident(phase)
            if not phase:
                continue
        try:
            started = time.monotonic()
            await run(phase)
            took = time.monotonic() - started
            if phase[0].plan.rows:
                pause.prefilled(took)
            elif decodes[i]:
                pause.decoded(took)
        except BaseException:  # the later phases applied nothing: answered with why
            for later in phases[i + 1 :]:
                for w in later:
                    w.take_back(SessionGoneError("step failed: its batch failed first"))
                    w.answer()
            raise


def _still_resident(phase: list[SessionWork]) -> list[SessionWork]:
    """The work of ``phase`` whose sessions are still in memory; the others' steps are
    taken back, nothing applied, and answered with what dropped them."""
    kept: list[SessionWork] = []
    for w in phase:
        if w.session.gone is None:
            kept.append(w)
        else:
            w.take_back(w.session.gone)
            w.answer()
    return kept


def _take_all(phases: list[list[SessionWork]]) -> None:
    """Every phase's steps off the queues, before anything runs; a failure (a bug) answers
    every step with it, none applied."""
    try:
        for phase in phases:
            for w in phase:
                w.take()
    except BaseException as exc:
        error = SessionGoneError(f"step failed: {exc!r}")
        for w in (w for phase in phases for w in phase):
            w.take_back(error)
            w.answer()
        raise


class Stepper:
    """Runs the batches of one model's sessions (the module's docstring tells how).

    While it holds a batch it asks ``residents`` whether each session is still ours
    (and drops those that are not), ``checkpoints`` for due and newest snapshots, and
    ``replay`` for guard rollbacks and the outputs of resent steps memory let go of."""

    def __init__(
        self,
        model: Engine,
        store: Store,
        residents: ResidentSessions,
        checkpoints: Checkpoints,
        replay: Replay,
        settings: StepperSettings,
        engine: EngineLane,
    ) -> None:
        self.model = model
        self.store = store
        self.residents = residents
        self.checkpoints = checkpoints
        self.replay = replay
        self.settings = settings
        self._ready: dict[str, Session] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._proofs = ApartProofs(residents, self.notify)
        self.engine = engine  # the model's lane, shared with forecasts and replays
        self._prefill_limits = PrefillLimits(
            settings.prefill_min_steps, settings.max_batch_tokens, settings.prefill_chunk
        )
        self._pause = PrefillPause(settings.prefill_share, self._prefill_limits.min_steps)
        self.steps = 0
        # Metric children resolved once: a labelled lookup per step would cost more.
        m = store.metrics
        self._steps_by = {d: m.steps.labels(model.name, d.name.lower()) for d in Durability}
        self._batch_size = m.engine_batch_size.labels(model.name)
        self._batch_seconds = m.engine_batch_seconds.labels(model.name)
        self._guard_events = m.guard_events
        self._rolled_back_by_guards = m.rollbacks.labels("guard")

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"stepper[{self.model.name}]")

    async def stop(self) -> None:
        await self._proofs.stop()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.engine.shutdown()

    def submit(self, session: Session, run: StepRun) -> None:
        if session.gone is not None:  # it left memory: nobody would run these steps
            run.taken = run.count
            run.answer(0, run.count, session.gone)
            return
        session.queue.append(run)
        session.queued_steps += run.count
        self.notify(session)

    def notify(self, session: Session) -> None:
        """Called whenever a session's queue head may have become a runnable step."""
        if session.head_is_step and not session.busy and session.gone is None:
            self._ready[session.id] = session
            self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._ready:
                if await self._pause.wait_for_decode(self._ready.values(), self._wake):
                    continue
                take = list(self._ready.values())[: self.settings.max_batch]
                for s in take:
                    del self._ready[s.id]
                sessions = [s for s in take if s.head_is_step and not s.busy and s.gone is None]
                now = lease_clock()  # read once per batch, not once per session
                unproven = [s for s in sessions if not s.answerable(now)]
                if unproven:
                    for s in unproven:
                        self._proofs.start(s)
                    sessions = [s for s in sessions if not s.busy]
                if not sessions:
                    continue
                for s in sessions:
                    s.busy = True
                try:
                    await self._batch(sessions)
                except asyncio.CancelledError:
                    # stop() cancelled the stepper: end. Otherwise a task the batch awaited
                    # was cancelled by someone else (an offloaded engine call, a write):
                    # that batch failed (its steps answered with the error), and the
                    # stepper goes on, or every session of the model would wait forever.
                    if being_cancelled():
                        raise
                    log.exception("stepper batch failed: a task it awaited was cancelled")
                except Exception:  # a bug must not kill the stepper: fail this batch's steps
                    log.exception("stepper batch failed")
                finally:
                    now = (time.monotonic(), time.time())
                    for s in sessions:
                        s.busy = False
                        s.touch(now)
                        s.open_gate()
                        self.notify(s)
                # Callers its answers woke that step again at once queue their next steps
                # before the next batch is planned, so they are in it.
                await asyncio.sleep(0)

    async def _batch(self, sessions: list[Session]) -> None:
        """Plan the batch, take what it says off the queues, then run its phases in turn,
        each answered before the next computes (``BatchPlan.phases``); each phase's time
        goes to the prefill pause (:class:`PrefillPause`)."""
        batch = plan(sessions, self.settings.max_ticks, self._prefill_limits, self._pause.paused())
        await run_phases(batch, self._phase, self._pause)

    async def _phase(self, work: list[SessionWork]) -> None:
        """One phase of a batch, its steps already taken: log ahead, execute, settle, then
        every step answered."""
        ahead = LogAhead(self.store)
        try:
            await ahead.send(
                [
                    (w.session, InputBlock(w.start + 1, w.plan.advance, w.raw))
                    for w in work
                    if w.plan.log_ahead
                ]
            )
            await self._execute(work)
            await self._settle(work, ahead)
        except BaseException as exc:
            await _failed(work, ahead, exc, self.residents)
            raise
        finally:
            for w in work:
                w.answer()

    # ------------------------------------------------------------------ execute

    async def _execute(self, work: list[SessionWork]) -> None:
        """The engine rounds: in each, every session's next engine call, those of one
        length in one call."""
        for r in range(max((len(w.plan.segments) for w in work), default=0)):
            by_length: dict[int, list[SessionWork]] = {}
            for w in work:
                if n := w.segment(r):
                    if w.plan.prefilled(r):
                        await self._prefill(w, r, n)
                    elif w.session.guard_state is None or self._judge_input(w):
                        by_length.setdefault(n, []).append(w)
            for n, group in by_length.items():
                await self._engine_call(group, n)

    async def _prefill(self, w: SessionWork, r: int, n: int) -> None:
        """The session's ``r``-th engine call, ``n`` steps, as one prefill computing the
        outputs the plan names (``SessionPlan.rows``), then applied."""
        rows = w.plan.rows[r]
        assert rows is not None
        started = time.perf_counter()
        attributes = {"ssmserve.model": self.model.name, "ssmserve.prefill_steps": n}
        inputs = w.values[w.applied : w.applied + n]  # type: ignore[index]
        every = len(rows) == n
        with self.store.metrics.tracing.span("engine.prefill", attributes):
            outputs, state = await self.engine.prefill(
                inputs, w.session.state, "all" if every else rows
            )  # (m, o)
        self._batch_seconds.observe(time.perf_counter() - started)
        self.steps += n
        self._apply(w, state, outputs, None if every else rows, n)
        self._steps_by[w.session.config.durability].inc(n)

    async def _engine_call(self, group: list[SessionWork], n: int) -> None:
        """``n`` steps of each session of ``group`` in one engine call, then applied."""
        started = time.perf_counter()
        attributes = {"ssmserve.model": self.model.name, "ssmserve.batch_size": len(group)}
        states = [w.session.state for w in group]
        with self.store.metrics.tracing.span("engine.batch", attributes):
            if n == 1:
                batch, outputs = await self.engine.step(
                    states, [w.next_input() for w in group]
                )  # outputs (b, o)
            else:
                inputs = np.array([w.values[w.applied : w.applied + n] for w in group])
                batch, outputs = await self.engine.step_many(states, inputs)  # (b, n, o)
        self._batch_seconds.observe(time.perf_counter() - started)
        for _ in range(n):  # sessions per engine step
            self._batch_size.observe(len(group))
        self.steps += len(group) * n
        applied = dict.fromkeys(_DURABILITIES, 0)
        for row, w in enumerate(group):
            rows = outputs[row] if n > 1 else outputs[row : row + 1]  # (n, o)
            if w.plan.guarded:
                applied_here = self._guarded(w, batch.session(row), rows[0])
            else:
                self._apply(w, batch.session(row), rows)
                applied_here = n
            applied[w.session.config.durability] += applied_here
        for durability, count in applied.items():
            if count:
                self._steps_by[durability].inc(count)

    def _apply(
        self,
        w: SessionWork,
        state: SessionState,
        rows: np.ndarray,
        picked: np.ndarray | None = None,
        steps: int = 0,
    ) -> None:
        """The session's next steps applied: ``rows`` ``(n, o)`` their outputs, or with
        ``picked`` (a prefill's indices into its ``steps`` steps) the outputs of those only;
        the others have none (``SessionPlan.computed``)."""
        s, n = w.session, rows.shape[0] if picked is None else steps
        if w.outputs is None:
            w.outputs = (
                rows
                if n == w.plan.advance and picked is None
                else np.empty((w.plan.advance, rows.shape[1]), rows.dtype)
            )
        if picked is not None:
            w.outputs[w.applied + picked] = rows  # the other rows stay unwritten
        elif w.outputs is not rows:
            w.outputs[w.applied : w.applied + n] = rows
        first = w.start + w.applied + 1
        logged = w.plan.log_ahead
        if picked is not None:
            s.recent.record_picked(first, w.raw_at(w.applied, n), n, picked, rows, logged)
        elif n == 1:
            s.recent.record(first, w.raw_at(w.applied), rows[0], logged)
        else:
            s.recent.record_run(first, w.raw_at(w.applied, n), rows, logged)
        w.applied += n
        s.state, s.step = state, first + n - 1
        if s.config.durability != Durability.NONE and s.config.snapshot_due(s.step):
            w.snapshots_due.append((s.step, state, s.guard_state))

    def _judge_input(self, w: SessionWork) -> bool:
        """The input rules on a guarded session's next step (its guards carry state),
        before the engine call: whether it runs (with ``w.before.applied``); if not, the
        session stops there, as for a refused output."""
        s, step = w.session, w.start + w.applied + 1
        assert s.guard_state is not None
        w.before = judge_input(s.config.guards, s.guard_state, step, w.values[w.applied])  # type: ignore[index]
        if w.before.applies_step:
            return True
        self._refused(w, step, None, w.before.events, w.before.action, "input")
        return False

    def _guarded(self, w: SessionWork, state: SessionState, output: np.ndarray) -> int:
        """A guarded session's next step: its output checked, then applied (1) or not (0:
        the session stops, and what it took after the step goes back to its queue)."""
        s = w.session
        step = w.start + w.applied + 1
        if s.guard_state is not None and w.before is not None:
            judged = judge_step(s.config.guards, s.guard_state, step, w.before, output)
            w.before = None
            verdict = GuardVerdict(judged.output, judged.events, judged.action)
            if judged.applies_step:
                s.guard_state = judged.state  # before _apply: a snapshot due there takes it
        else:
            verdict = check_output(s.config.guards, step, output)
        if verdict.applies_step:
            self._count(verdict.events)
            w.guarded[step] = GuardedStep(verdict.output, verdict.events)
            self._apply(w, state, verdict.output[None])
            return 1
        assert verdict.action is not None
        self._refused(w, step, verdict.output, verdict.events, verdict.action, "output")
        return 0

    def _refused(
        self,
        w: SessionWork,
        step: int,
        output: np.ndarray | None,
        events: tuple[GuardEvent, ...],
        action: GuardAction,
        what: str,
    ) -> None:
        """A guard refused step ``step`` (its ``what``, the input or the output): the
        session stops, and what it took after the step goes back to its queue."""
        self._count(events)
        w.guarded[step] = GuardedStep(output, events)
        w.stopped = True
        w.give_back(step)
        if action == GuardAction.REJECT:
            broken = next(e for e in events if e.action == action)
            w.guarded[step].error = GuardRejectedError(
                f"step {step} was not applied: guard {broken.guard!r} rejected its {what} "
                f"({broken.detail}); the session stays at step {w.session.step}"
            )
        else:
            w.guard_rollback = step

    def _count(self, events: tuple[GuardEvent, ...]) -> None:
        for event in events:
            self._guard_events.labels(event.action.name.lower()).inc()

    # ------------------------------------------------------------------ settle

    async def _settle(self, work: list[SessionWork], ahead: LogAhead) -> None:
        await self._commit_logs(work, ahead)
        # Before anything else is written or answered for a session: is it still ours?
        await self._check_leases(work)
        for w in work:  # due periodic snapshots, to the sessions' background writers
            if w.fenced is None:
                for step, state, guards in w.snapshots_due:
                    self.checkpoints.schedule(w.session, step, state, guards)
        await _guard_rollbacks(work, self.checkpoints, self.replay, self._rolled_back_by_guards)
        await _recompute(work, self.replay)
        await _record_events(work, self.store)

    async def _commit_logs(self, work: list[SessionWork], ahead: LogAhead) -> None:
        """The replies of the appends sent ahead, then a group commit (one pipeline) of
        the inputs of every log-durability session still unlogged."""
        of = {w.session.id: w for w in work}
        for s, lease, error in await ahead.settle():
            w = of[s.id]
            w.appended = error is None
            if error is not None:
                w.take_back(error)
                self.residents.lost(s, lease, error, settle=True)
        pending = [
            (w, w.session.lease, block)
            for w in work
            if w.failed is None
            and w.session.config.durability == Durability.LOG
            and (block := w.session.recent.unflushed.take()) is not None
        ]
        appends = [(lease, block) for _w, lease, block in pending]
        try:
            errors: list[SsmserveError | None] = await self.store.append_logs(appends, time.time())
        except SsmserveError as exc:
            errors = [exc] * len(appends)
        except BaseException:  # cancelled, or a bug: each may be in the log now
            for w, _lease, _block in pending:
                w.appended = True  # so the batch's failure path drops it
            raise
        for (w, lease, _block), error in zip(pending, errors, strict=True):
            if error is None:
                w.appended = True
                continue
            w.take_back(error)
            if w.appended:  # its steps logged ahead are in Redis, memory gave them back
                self.residents.drop(w.session, error)
            else:
                # Dropped if another worker owns it now; an unknown outcome waits for
                # the store to say whether it holds more than memory (then it reloads).
                self.residents.lost(w.session, lease, error, settle=True)
        for w in work:
            s = w.session
            if (
                s.config.durability != Durability.LOG
                and len(s.recent.unflushed) > self.settings.max_unflushed
            ):
                try:  # bound memory: a session that is never snapshotted still gets logged
                    await self.residents.flush_unflushed(s, s.step)
                except SsmserveError as exc:
                    log.warning("session %s: log flush failed: %s", s.id, exc)

    async def _check_leases(self, work: list[SessionWork]) -> None:
        """Answer only for sessions this worker surely still owns (self-fencing).

        A session whose lease may have run out by this worker's clock (a freeze, a long
        stall, Redis unreachable), or whose memory is unsettled, is revalidated first; if
        that fails, nothing of this batch is answered for it (not even what its log
        already holds: the next owner answers a resend of those steps from the log). If
        this batch logged steps of it, it also leaves memory (memory gives them back,
        Redis keeps them), so the next request reloads it or finds its new owner.
        """
        errors = await self.residents.revalidate([w.session for w in work if w.took])
        for w in work:
            error = errors.get(w.session.id)
            if error is None:
                continue
            w.take_back(error)
            w.fenced = error
            if w.appended:  # Redis holds steps that memory just gave back: reload
                self.residents.drop(w.session, error)


async def _failed(
    work: list[SessionWork], ahead: LogAhead, exc: BaseException, residents: ResidentSessions
) -> None:
    """A batch's phase failed (a bug, a cancelled engine call or write): every session is
    put back where the batch found it and its steps are answered with the error. Sessions
    whose steps Redis holds, or may hold, and memory just gave back leave memory; the next
    request reloads them from Redis."""
    error = exc if isinstance(exc, SsmserveError) else SessionGoneError(f"step failed: {exc!r}")
    for w in work:
        w.take_back(error)
    dropped = set()
    for w in work:
        if w.appended:
            residents.drop(w.session, error)
            dropped.add(w.session.id)
    for s, lease, refused in await ahead.abandon():
        if refused is not None:  # not written; lost() drops it if not ours now
            residents.lost(s, lease, refused)
        elif s.id not in dropped:
            residents.drop(s, error)


async def _guard_rollbacks(
    work: list[SessionWork], checkpoints: Checkpoints, replay: Replay, counted: Any
) -> None:
    """The rollbacks ROLLBACK rules asked for in this batch: each session back to its
    newest snapshot before the step refused (``Replay.restore_to``)."""
    for w in work:
        if not w.guard_rollback or w.fenced is not None or w.failed is not None:
            continue
        step_refused, s = w.guard_rollback, w.session
        outcome = w.guarded[step_refused]
        events = [e for e in outcome.events if e.action == GuardAction.ROLLBACK]
        try:
            record = await checkpoints.newest(s, step_refused - 1)
            if record is None:
                raise GuardRolledBackError("no snapshot before the violation to return to")
            step, _snapshot_id, replayed = await replay.restore_to(s, record.step, record)
            counted.inc()
            w.rollbacks.append(
                SessionEvent.rollback(step_refused, step, "guard", f"guard {events[0].guard}")
            )
            log.info(
                "session %s rolled back to step %d by guard %r (%d replayed)",
                s.id, step, events[0].guard, replayed,
                extra={"session_id": s.id, "step": step, "token": s.lease.token,
                       "event": "rolled_back", "cause": "guard"},
            )  # fmt: skip
        except SsmserveError as exc:
            outcome.error = GuardRolledBackError(
                f"step {step_refused} was not applied: guard {events[0].guard!r} asked for a "
                f"rollback that failed ({exc}); the session stays at step {s.step}"
            )
            continue
        outcome.events = tuple(
            GuardEvent(e.guard, e.action, e.step, e.dims, e.detail, step)
            if e.action == GuardAction.ROLLBACK
            else e
            for e in outcome.events
        )
        outcome.error = GuardRolledBackError(
            f"step {step_refused} was not applied: guard {events[0].guard!r} was broken "
            f"({events[0].detail}); the session returned to step {step}, so the next "
            f"input is step {step + 1}"
        )


async def _recompute(work: list[SessionWork], replay: Replay) -> None:
    """Resends whose inputs left memory: checked against the log (INPUT_MISMATCH, as
    ``SessionWork.take`` checks those in memory). Resends whose recorded outputs left
    memory: replayed from the store."""
    for w in work:
        if w.fenced is not None:
            continue
        for step, sent in w.unchecked.items():
            try:
                (taken,) = await replay.inputs(w.session, step, step)
            except SsmserveError as exc:
                w.resend_errors[step] = exc
                w.resent.pop(step, None)
                continue
            if taken != sent:
                w.resend_errors[step] = input_mismatch(w.session.id, step)
                w.resent.pop(step, None)
        for step, output in w.resent.items():
            if output is None:
                try:
                    w.resent[step] = await replay.output_at(w.session, step)
                except SsmserveError as exc:
                    w.resend_errors[step] = exc


async def _record_events(work: list[SessionWork], store: Store) -> None:
    """Guard events and guard rollbacks of this batch into each session's event list
    (``events``), before the steps are answered; one write per session that had any."""
    writes = []
    for w in work:
        if w.fenced is not None or w.failed is not None:
            continue
        events = [SessionEvent.of_guard(e) for g in w.guarded.values() for e in g.events]
        if events or w.rollbacks:
            writes.append(record_events(store, w.session.lease, events + w.rollbacks))
    if writes:
        await asyncio.gather(*writes)
