"""The stepper: queued steps of all sessions of one model run as batched engine steps.

One :class:`Stepper` per model per worker. A batch takes every session whose queue starts
with a step (up to ``max_batch`` sessions) and runs ticks: each tick is one engine call
that advances each of those sessions by one input. A session with several queued steps
(several steps in one message) advances once per tick, up to ``max_ticks`` ticks. A
session whose queue starts with a :class:`~ssmserve.server.sessions.session.StepRun` (a
message's consecutive steps of it) that can go straight through advances by a chunk of
it instead: one engine call steps every such session's chunk (``_run_chunks``), with
per-chunk rather than per-step bookkeeping; the answers are the same. Then
the batch ends with one group commit: the inputs of every ``log``-durability session go to
Redis in one pipeline, and only then are the steps answered (durable before acknowledged).
Most of them went earlier: a session's first steps of the batch are sent to the log just
before the engine call that computes them, and their replies read in the group commit
(``log_ahead.py``), so the round trip overlaps the computation.

If a session's log write fails, that session is put back exactly where the batch found it
(states are values, so this is keeping a reference) and its applied steps are answered
with the error: a step is either durable and answered, or not applied at all.

Then the batch makes sure each session is still this worker's (self-fencing: a lease that
may have run out by this worker's clock is revalidated, see ``_check_leases``), and, in
order, still holding the sessions: due periodic snapshots are handed to each
session's background writer (copied state; encoded and written after the answers, see
``snapshot_writer.py``), guard rollbacks run, outputs of resent steps that fell out of
memory are recomputed by replay. Only then are the futures resolved, so an answer always
reports what happened to its step; a snapshot is reported in the session's first answer
after it is committed.

Engine calls go through the model's :class:`~ssmserve.server.engine.lane.EngineLane` (shared with
forecasts): large ones on its engine thread, so the event loop keeps serving streams
while a batch computes, small ones inline (``offload_min_flop``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ssmserve.server.engine.lane import EngineLane
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.recurrent_state import SessionState
from ssmserve.server.errors import SsmserveError, being_cancelled
from ssmserve.server.sessions.config import Durability
from ssmserve.server.sessions.errors import ReloadingError
from ssmserve.server.sessions.events import SessionEvent
from ssmserve.server.sessions.guards import GuardAction, GuardEvent, check_output
from ssmserve.server.sessions.log_ahead import LogAhead, steps_block
from ssmserve.server.sessions.session import (
    GuardRejectedError,
    GuardRolledBackError,
    Session,
    SessionGoneError,
    SessionRewoundError,
    StepGapError,
    StepJob,
    StepOutcome,
    StepRun,
)
from ssmserve.server.state.input_log import InputBlock
from ssmserve.server.state.lease import SessionLease
from ssmserve.server.state.store import SnapshotRecord, Store

log = logging.getLogger(__name__)


class BatchHooks(Protocol):
    """What the stepper asks of the session components while it holds a batch
    (``manager.StepperHooks`` serves it from residency, checkpoints and replay)."""

    def schedule_snapshot(self, session: Session, step: int, state: SessionState) -> None: ...

    async def restore_to(
        self, session: Session, target: int, record: SnapshotRecord | None = None
    ) -> tuple[int, str, int]: ...

    async def newest_snapshot(self, session: Session, at_most: int) -> SnapshotRecord | None: ...

    async def output_at(self, session: Session, step: int) -> np.ndarray: ...

    async def flush_unflushed(self, session: Session, upto: int) -> None: ...

    def lost(
        self, session: Session, lease: SessionLease, error: SsmserveError, settle: bool = False
    ) -> None: ...

    async def revalidate(self, sessions: list[Session]) -> dict[str, SsmserveError]: ...

    def drop(self, session: Session, error: SsmserveError) -> None: ...

    async def record_events(self, session: Session, events: list[SessionEvent]) -> None: ...


#: Every durability, once: iterating the enum class each batch cost more than its dict.
_DURABILITIES = tuple(Durability)


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
    # Send a batch's log appends before its engine call and read the replies after, so
    # the round trip to Redis and the computation overlap (``log_ahead``). Off: the
    # inputs go in one group commit after all of the batch's engine calls.
    log_ahead: bool = True


@dataclass
class _SessionBatch:
    """What one batch did to one session, to answer it or take it back."""

    session: Session
    start_state: SessionState
    start_step: int
    done: list[tuple[StepJob, StepOutcome]]
    snapshots_due: list[tuple[int, SessionState]]
    guard_rollback: tuple[StepJob, StepOutcome] | None = None
    # No further steps in this batch: a REJECT or ROLLBACK, its share of the batch used
    # by runs, or a run at its head left for the next batch to step whole.
    stopped: bool = False
    appended: bool = False  # steps of this batch of the session are (or may be) logged
    fenced: bool = False  # not surely ours any more: nothing of this batch is answered
    rollbacks: list[SessionEvent] = field(default_factory=list)  # by guards, this batch
    # Chunks of runs stepped whole (run, first index, end index), answered at the end.
    chunks: list[tuple[StepRun, int, int]] = field(default_factory=list)
    ran: int = 0  # steps of runs this batch stepped for the session

    @property
    def stepped(self) -> bool:
        """Whether this batch took any step of the session."""
        return bool(self.done or self.chunks)

    def take_chunk(self, max_ticks: int) -> tuple[StepRun, int, int] | None:
        """The next chunk of the run at the head of the session's queue, taken (the queue,
        the counts, ``chunks``), if the run can go straight through: the session is at its
        next step and has no guards. At most the steps the batch has left for the session
        (``max_ticks``), ending at the session's next periodic snapshot (whose state the
        chunk then has). Taken before the engine call, as ticks pop their jobs: a session
        that leaves memory meanwhile answers only what is still queued."""
        s = self.session
        if self.stopped or not s.queue:
            return None
        run = s.queue[0]
        if not isinstance(run, StepRun) or s.config.guards or run.next_step != s.step + 1:
            return None  # not a run, or not one to step straight through: per step
        lo = run.taken
        n = min(run.count - lo, max_ticks - self.ran)
        every, phase = s.config.snapshot_every, s.config.snapshot_phase
        if s.config.durability != Durability.NONE and phase is not None:  # None: never due
            due = s.step + 1 + (phase - s.step - 1) % every  # the next snapshot's step
            n = min(n, due - s.step)
        run.taken = lo + n
        if run.taken == run.count:
            s.queue.popleft()
        s.queued_steps -= n
        self.ran += n
        self.stopped = self.ran >= max_ticks  # its share of this batch: no ticks after
        self.chunks.append((run, lo, lo + n))  # answered at the end of the batch, whatever
        return run, lo, lo + n

    def take_back(self, error: SsmserveError) -> None:
        """Undo every step this batch applied to the session; answer them with ``error``."""
        s = self.session
        if s.step != self.start_step:
            s.state, s.step = self.start_state, self.start_step
            s.recent.cut_after(self.start_step)
        self.snapshots_due.clear()
        self.guard_rollback = None
        for job, outcome in self.done:
            if not outcome.replayed or job.step > self.start_step:
                outcome.output, outcome.replayed, outcome.error = None, False, error
                outcome.guard_events = ()
        self.fail_chunks(error)

    def fail_chunks(self, error: SsmserveError) -> None:
        """The steps of this batch's run chunks are answered with ``error``."""
        for run, lo, hi in self.chunks:
            for t in range(lo, hi):
                run.outcomes[t] = StepOutcome(run.session_id, run.first + t, error=error)

    def report_snapshots(self) -> None:
        """The session's newly committed snapshots go into its last answer of this batch."""
        events, self.session.snapshot_events = self.session.snapshot_events, ()
        if self.done:
            self.done[-1][1].snapshot_events += events
            return
        run, _lo, hi = self.chunks[-1]
        last = run.outcomes[hi - 1]
        if last is None:  # answered by its output so far: give it an outcome of its own
            last = run.outcomes[hi - 1] = StepOutcome(
                run.session_id, run.first + hi - 1, output=run.outputs[hi - 1]
            )
        last.snapshot_events += events


class Stepper:
    """Runs the batches of one model's sessions (the module's docstring tells how).

    Why this class is long: a batch's phases (compute, log, fencing, snapshots, guard
    rollbacks, answers) must happen in one order for a step to be durable before it is
    answered and never answered for a session that may not be ours; they are kept in one
    class, each phase one method, so that order reads top to bottom in ``_batch``.
    """

    def __init__(
        self,
        model: MambaModel,
        store: Store,
        hooks: BatchHooks,
        settings: StepperSettings,
        engine: EngineLane,
    ) -> None:
        self.model = model
        self.store = store
        self.hooks = hooks
        self.settings = settings
        self._ready: dict[str, Session] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.engine = engine  # the model's lane, shared with forecasts and replays
        self.batches = 0
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
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.engine.shutdown()

    def submit(self, session: Session, job: StepJob | StepRun) -> None:
        if session.gone is not None:  # it left memory: nobody would run this step
            if isinstance(job, StepRun):
                job.taken = job.count
                job.answer(0, job.count, session.gone)
            else:
                job.future.set_result(StepOutcome(session.id, job.step, error=session.gone))
            return
        session.queue.append(job)
        session.queued_steps += job.count if isinstance(job, StepRun) else 1
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
                take = list(self._ready.values())[: self.settings.max_batch]
                for s in take:
                    del self._ready[s.id]
                sessions = [s for s in take if s.head_is_step and not s.busy and s.gone is None]
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

    async def _batch(self, sessions: list[Session]) -> None:
        work = [_SessionBatch(s, s.state, s.step, [], []) for s in sessions]
        recompute: list[tuple[_SessionBatch, StepJob, StepOutcome]] = []
        ahead = LogAhead(self.store, self.settings.log_ahead)
        try:
            for _ in range(self.settings.max_ticks):
                if not await self._run_chunks(work, ahead):
                    break
            for tick in range(self.settings.max_ticks):
                if not await self._tick(work, recompute, ahead, self.settings.max_ticks - tick):
                    break
            await self._commit_logs(work, ahead)
            # Before anything else is written or answered for a session: is it still ours?
            await self._check_leases(work)
            self._snapshots(work)
            await self._guard_rollbacks(work)
            for w, job, outcome in recompute:
                if not w.fenced:
                    await self._recompute(w, job, outcome)
            await self._record_events(work)
        except BaseException as exc:
            error = exc if isinstance(exc, SsmserveError) else None
            error = error or SessionGoneError(f"step failed: {exc!r}")
            for w in work:
                w.take_back(error)
            # Sessions whose steps Redis holds, or may hold, and memory just gave back:
            # they leave memory, and the next request reloads them from Redis.
            dropped = set()
            for w in work:
                if w.appended:
                    self.hooks.drop(w.session, error)
                    dropped.add(w.session.id)
            for s, lease, refused in await ahead.abandon():
                if refused is not None:  # not written; lost() drops it if not ours now
                    self.hooks.lost(s, lease, refused)
                elif s.id not in dropped:
                    self.hooks.drop(s, error)
            raise
        finally:
            for w in work:
                if w.stepped and w.session.snapshot_events:  # committed since the last answer
                    w.report_snapshots()
                for job, outcome in w.done:
                    if not job.future.done():
                        job.future.set_result(outcome)
                for run, lo, hi in w.chunks:
                    run.answer(lo, hi)

    # ------------------------------------------------------------------ compute

    async def _run_chunks(self, work: list[_SessionBatch], ahead: LogAhead) -> bool:
        """Step every session whose queue starts with a run it can step straight through
        by a chunk of that run (``_SessionBatch.take_chunk``): all of them in one engine
        call per chunk length. False if none could."""
        by_length: dict[int, list[tuple[_SessionBatch, StepRun, int]]] = {}
        for w in work:
            if (chunk := w.take_chunk(self.settings.max_ticks)) is not None:
                run, lo, hi = chunk
                by_length.setdefault(hi - lo, []).append((w, run, lo))
        if not by_length:
            return False
        for n, group in by_length.items():
            raws = [run.raw_of(lo, lo + n) for _, run, lo in group]  # logged and recorded
            await ahead.send(
                [
                    (w.session, InputBlock(run.first + lo, n, raw))
                    for (w, run, lo), raw in zip(group, raws, strict=True)
                    if ahead.takes(w.session)
                ]
            )
            started = time.perf_counter()
            inputs = np.array([run.values[lo : lo + n] for _, run, lo in group])  # (b, n, i)
            attributes = {"ssmserve.model": self.model.name, "ssmserve.batch_size": len(group)}
            with self.store.metrics.tracing.span("engine.batch", attributes):
                new_batch, outputs = await self.engine.step_many(
                    [w.session.state for w, _, _ in group], inputs
                )  # outputs (b, n, o)
            self._batch_seconds.observe(time.perf_counter() - started)
            for _ in range(n):  # sessions per engine step, as ``_tick`` counts them
                self._batch_size.observe(len(group))
            self.steps += len(group) * n
            applied = dict.fromkeys(_DURABILITIES, 0)
            for row, (w, run, lo) in enumerate(group):
                s = w.session
                hi = lo + n
                run.outputs[lo:hi] = outputs[row]
                state = new_batch.session(row)
                s.state, s.step = state, s.step + n
                s.recent.record_run(
                    run.first + lo,
                    raws[row],
                    run.outputs[lo:hi],
                    run.first + hi - 1 <= ahead.upto(s),
                )
                if s.config.snapshot_due(s.step) and s.config.durability != Durability.NONE:
                    w.snapshots_due.append((s.step, state))
                applied[s.config.durability] += n
            for durability, count in applied.items():
                if count:
                    self._steps_by[durability].inc(count)
        return True

    async def _tick(
        self,
        work: list[_SessionBatch],
        recompute: list[tuple[_SessionBatch, StepJob, StepOutcome]],
        ahead: LogAhead,
        ticks: int,
    ) -> bool:
        """One engine call for every session with a step at its head; False if none had.
        ``ticks``: this one and those the batch has left."""
        apply: list[tuple[_SessionBatch, StepJob]] = []
        for w in work:
            s = w.session
            if w.stopped or not s.head_is_step:
                continue
            if isinstance(s.queue[0], StepRun):
                run = s.queue[0]
                if w.stepped and not s.config.guards and run.next_step == s.step + 1:
                    w.stopped = True  # the next batch steps it whole
                    continue
                s.queue.popleft()  # step by step: each of its steps is a job of its own
                s.queue.push_front(run.split())
            job = s.queue.popleft()
            s.queued_steps -= 1
            assert isinstance(job, StepJob)
            outcome = StepOutcome(s.id, job.step)
            w.done.append((job, outcome))
            if job.step <= s.step:  # a resend: answer with the recorded output
                outcome.replayed = True
                outcome.output = s.recent.output_at(job.step)
                if outcome.output is None:
                    recompute.append((w, job, outcome))
            elif job.step > s.step + 1 and s.step == s.restored_step:
                outcome.error = SessionRewoundError(
                    f"session {s.id!r} came back from the store at step {s.step}, behind "
                    f"step {job.step - 1} (its durability keeps steps in memory between "
                    f"flushes, or the store lost writes): resend from step {s.step + 1}",
                    session_step=s.step,
                )
            elif job.step > s.step + 1:
                outcome.error = StepGapError(
                    f"step {job.step} of session {s.id!r} skips ahead: the session is at "
                    f"step {s.step}, so the next input is step {s.step + 1}",
                    session_step=s.step,
                )
            else:
                apply.append((w, job))
        if not apply:
            return any(not w.stopped and w.session.head_is_step for w in work)
        await ahead.send(
            [
                (w.session, steps_block(w.session, job, ticks))
                for w, job in apply
                if ahead.takes(w.session)
            ]
        )
        started = time.perf_counter()
        attributes = {"ssmserve.model": self.model.name, "ssmserve.batch_size": len(apply)}
        with self.store.metrics.tracing.span("engine.batch", attributes):
            new_batch, outputs = await self.engine.step(
                [w.session.state for w, _ in apply], [job.value for _, job in apply]
            )
        self._batch_seconds.observe(time.perf_counter() - started)
        self._batch_size.observe(len(apply))
        self.steps += len(apply)
        applied = dict.fromkeys(_DURABILITIES, 0)
        for row, (w, job) in enumerate(apply):
            s = w.session
            # A view until answered; the session's recent outputs keep a copy in their ring.
            output = outputs[row]
            if not s.config.guards:  # the common case, without a verdict per step
                w.done[-1][1].output = output
                self._apply(w, job, new_batch.session(row), output, job.step <= ahead.upto(s))
                applied[s.config.durability] += 1
            elif self._settle(w, job, new_batch.session(row), output):
                applied[s.config.durability] += 1
        for durability, count in applied.items():
            if count:
                self._steps_by[durability].inc(count)
        return True

    def _apply(
        self,
        w: _SessionBatch,
        job: StepJob,
        state: SessionState,
        output: np.ndarray,
        logged: bool = False,
    ) -> None:
        """The step applied to the session; ``logged``: its input is logged ahead."""
        s = w.session
        s.state, s.step = state, job.step
        s.recent.record(job.step, job.raw, output, logged)
        if s.config.snapshot_due(job.step) and s.config.durability != Durability.NONE:
            w.snapshots_due.append((job.step, state))

    def _settle(
        self, w: _SessionBatch, job: StepJob, state: SessionState, output: np.ndarray
    ) -> bool:
        """The output of a session with guards: checked, then applied (True) or not."""
        s = w.session
        outcome = w.done[-1][1]
        verdict = check_output(s.config.guards, job.step, output)
        outcome.guard_events += verdict.events
        for event in verdict.events:
            self._guard_events.labels(event.action.name.lower()).inc()
        outcome.output = verdict.output
        if verdict.applies_step:
            self._apply(w, job, state, verdict.output)
            return True
        w.stopped = True
        if verdict.action == GuardAction.REJECT:
            outcome.error = GuardRejectedError(
                f"step {job.step} was not applied: guard {verdict.events[0].guard!r} "
                f"rejected its output ({verdict.events[0].detail}); the session stays at "
                f"step {s.step}"
            )
        else:
            w.guard_rollback = (job, outcome)
        return False

    # ------------------------------------------------------------------ durability

    async def _commit_logs(self, work: list[_SessionBatch], ahead: LogAhead) -> None:
        """The replies of the appends sent ahead, then a group commit (one pipeline) of
        the inputs of every log-durability session still unlogged."""
        if settled := await ahead.settle():
            of = {w.session.id: w for w in work}
            for s, lease, error in settled:
                w = of[s.id]
                w.appended = error is None
                if error is not None:
                    w.take_back(error)
                    self.hooks.lost(s, lease, error, settle=True)
                elif s.step < ahead.upto(s):  # a queued step logged ahead left the queue
                    self.hooks.drop(s, ReloadingError(f"session {s.id!r} is behind its log"))
        durable = [
            w
            for w in work
            if w.session.config.durability == Durability.LOG and w.session.recent.unflushed
        ]
        pending = [
            (w, w.session.lease, block)
            for w in durable
            if (block := w.session.recent.unflushed.take()) is not None
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
                self.hooks.drop(w.session, error)
            else:
                # Dropped if another worker owns it now; an unknown outcome waits for
                # the store to say whether it holds more than memory (then it reloads).
                self.hooks.lost(w.session, lease, error, settle=True)
        for w in work:
            s = w.session
            if (
                s.config.durability != Durability.LOG
                and len(s.recent.unflushed) > self.settings.max_unflushed
            ):
                try:  # bound memory: a session that is never snapshotted still gets logged
                    await self.hooks.flush_unflushed(s, s.step)
                except SsmserveError as exc:
                    log.warning("session %s: log flush failed: %s", s.id, exc)

    async def _check_leases(self, work: list[_SessionBatch]) -> None:
        """Answer only for sessions this worker surely still owns (self-fencing).

        A session whose lease may have run out by this worker's clock (a freeze, a long
        stall, Redis unreachable) is revalidated first; if that fails, nothing of this
        batch is answered for it (not even what its log already holds: the next owner
        answers a resend of those steps from the log). If this batch logged steps of it,
        it also leaves memory (memory gives them back, Redis keeps them), so the next
        request reloads it or finds its new owner.
        """
        errors = await self.hooks.revalidate([w.session for w in work if w.stepped])
        if not errors:
            return
        for w in work:
            error = errors.get(w.session.id)
            if error is None:
                continue
            w.take_back(error)
            w.fenced = True
            for _job, outcome in w.done:  # resends too: a new owner may have rolled back
                outcome.output, outcome.replayed, outcome.error = None, False, error
                outcome.guard_events = ()
            w.fail_chunks(error)
            if w.appended:  # Redis holds steps that memory just gave back: reload
                self.hooks.drop(w.session, error)

    def _snapshots(self, work: list[_SessionBatch]) -> None:
        """Hand due snapshots to the sessions' background writers."""
        for w in work:
            for step, state in w.snapshots_due:
                self.hooks.schedule_snapshot(w.session, step, state)

    async def _guard_rollbacks(self, work: list[_SessionBatch]) -> None:
        for w in work:
            if w.guard_rollback is None:
                continue
            job, outcome = w.guard_rollback
            s = w.session
            events = [e for e in outcome.guard_events if e.action == GuardAction.ROLLBACK]
            try:
                record = await self.hooks.newest_snapshot(s, job.step - 1)
                if record is None:
                    raise GuardRolledBackError("no snapshot before the violation to return to")
                step, _snapshot_id, replayed = await self.hooks.restore_to(s, record.step, record)
                self._rolled_back_by_guards.inc()
                w.rollbacks.append(
                    SessionEvent.rollback(job.step, step, "guard", f"guard {events[0].guard}")
                )
                log.info(
                    "session %s rolled back to step %d by guard %r (%d replayed)",
                    s.id, step, events[0].guard, replayed,
                    extra={"session_id": s.id, "step": step, "token": s.lease.token,
                           "event": "rolled_back", "cause": "guard"},
                )  # fmt: skip
            except SsmserveError as exc:
                outcome.error = GuardRolledBackError(
                    f"step {job.step} was not applied: guard {events[0].guard!r} asked for a "
                    f"rollback that failed ({exc}); the session stays at step {s.step}"
                )
                continue
            outcome.guard_events = tuple(
                GuardEvent(e.guard, e.action, e.step, e.dims, e.detail, step)
                if e.action == GuardAction.ROLLBACK
                else e
                for e in outcome.guard_events
            )
            outcome.error = GuardRolledBackError(
                f"step {job.step} was not applied: guard {events[0].guard!r} found its output "
                f"{events[0].detail}; the session returned to step {step}, so the next input "
                f"is step {step + 1}"
            )

    async def _record_events(self, work: list[_SessionBatch]) -> None:
        """Guard events and guard rollbacks of this batch into each session's event list
        (``events``), before the steps are answered; one write per session that had any."""
        writes = []
        for w in work:
            if w.fenced:
                continue
            events = [SessionEvent.of_guard(e) for _, o in w.done for e in o.guard_events]
            if events or w.rollbacks:
                writes.append(self.hooks.record_events(w.session, events + w.rollbacks))
        if writes:
            await asyncio.gather(*writes)

    async def _recompute(self, w: _SessionBatch, job: StepJob, outcome: StepOutcome) -> None:
        try:
            outcome.output = await self.hooks.output_at(w.session, job.step)
        except SsmserveError as exc:
            outcome.output, outcome.replayed, outcome.error = None, False, exc
