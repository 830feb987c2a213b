"""What one stepper batch did to one session (:class:`SessionWork`), and its answers.

The batch's plan (``batch_plan``) says which queued steps it takes and what each is;
this record keeps what happened to them while the batch runs: the outputs of the
steps applied, the guards' verdicts, the snapshots that fell due, the state to go back
to, and whether the session is still surely this worker's. At the end of the batch
:meth:`SessionWork.answer` answers every step taken, exactly once, from it; a step a
guard kept from running, and those queued behind it, go back to the queue
(:meth:`SessionWork.give_back`) for the next batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ssmserve.server.engine.recurrent_state import SessionState
from ssmserve.server.errors import SsmserveError
from ssmserve.server.sessions.batch_plan import APPLY, GAP, RESEND, Piece, SessionPlan
from ssmserve.server.sessions.errors import input_mismatch
from ssmserve.server.sessions.events import SessionEvent
from ssmserve.server.sessions.guards import GuardEvent
from ssmserve.server.sessions.session import (
    Session,
    SessionRewoundError,
    StepGapError,
    StepOutcome,
    StepRun,
)
from ssmserve.server.sessions.stateful_guards import InputVerdict
from ssmserve.server.state.checkpoint import GuardState


@dataclass(slots=True)
class GuardedStep:
    """A guarded step's verdict: what to answer for it."""

    output: np.ndarray | None  # None: its input was refused before the model ran
    events: tuple[GuardEvent, ...]
    error: SsmserveError | None = None


@dataclass(eq=False)
class SessionWork:
    """One session in one batch (see the module's docstring)."""

    plan: SessionPlan
    start_state: SessionState
    start_guards: GuardState | None = None  # the session's guard state when it began
    # The inputs of the advance: values (advance, ...) and their log bytes, back to back.
    values: np.ndarray | None = None
    raw: bytes = b""
    outputs: np.ndarray | None = None  # (advance, o): row k is step start + 1 + k
    applied: int = 0  # steps of the advance applied so far
    stopped: bool = False  # a guard stopped the advance
    # The input rules' verdict on the session's next step (a session whose guards carry
    # state), made before the engine call that runs it with ``before.applied``.
    before: InputVerdict | None = None
    guarded: dict[int, GuardedStep] = field(default_factory=dict)  # by step
    # Resends of steps before the batch: step -> the recorded output (None: not in
    # memory, recomputed by replay after the engine calls, or its error there).
    resent: dict[int, np.ndarray | None] = field(default_factory=dict)
    resend_errors: dict[int, SsmserveError] = field(default_factory=dict)
    # Resends whose input memory no longer holds: step -> the log bytes sent, compared
    # with the log's after the engine calls (``stepper._recompute``).
    unchecked: dict[int, bytes] = field(default_factory=dict)
    # (step, state, guard state) of each periodic snapshot due in the batch
    snapshots_due: list[tuple[int, SessionState, GuardState | None]] = field(default_factory=list)
    guard_rollback: int = 0  # the step whose output a ROLLBACK guard refused (0: none)
    appended: bool = False  # steps of this batch are (or may be) in the log
    failed: SsmserveError | None = None  # the batch's steps of it were taken back
    fenced: SsmserveError | None = None  # not surely ours: nothing of it is answered
    rollbacks: list[SessionEvent] = field(default_factory=list)  # by guards, this batch
    given_back: int = 0  # pieces (from the end) a guard sent back to the queue

    @property
    def session(self) -> Session:
        return self.plan.session

    @property
    def start(self) -> int:
        return self.plan.start

    @property
    def took(self) -> bool:
        """Whether the batch took any step of the session."""
        return len(self.plan.pieces) > self.given_back

    def take(self) -> None:
        """Take every planned step off the session's queue; gather the advance's inputs
        (values and log bytes) and read the recorded outputs of resends of older steps."""
        s = self.session
        values: list[np.ndarray] = []
        raws: list[bytes] = []
        for piece in self.plan.pieces:
            run, lo, n = piece.entry, piece.lo, piece.count
            run.taken = lo + n
            if run.taken == run.count:
                s.queue.popleft()  # the plan took runs from the head, in order
            s.queued_steps -= n
            if piece.kind == APPLY:
                if n == run.count:  # the whole run (a step sent alone, most often)
                    values.append(run.values)
                    raws.append(run.raw)
                else:
                    values.append(run.values[lo : lo + n])
                    raws.append(run.raw_of(lo, lo + n))
            elif piece.kind == RESEND:
                self._check_resent(piece)
        if values:
            self.values = values[0] if len(values) == 1 else np.concatenate(values)
            self.raw = raws[0] if len(raws) == 1 else b"".join(raws)

    def _check_resent(self, piece: Piece) -> None:
        """A resend of steps the session took before this batch: each is answered with
        its recorded output only if it carries the input the step was taken with (a
        resend is the same request again; other inputs are INPUT_MISMATCH, as an
        idempotency key reused with other parameters). Inputs memory no longer holds
        are compared with the log's later (``unchecked``)."""
        s, run = self.session, piece.entry
        # A last_only run's steps but its last are answered without output.
        answered = run.first + run.count - 1 if run.last_only else 0
        for step in range(piece.first, min(piece.first + piece.count, self.start + 1)):
            sent = run.raw_of(step - run.first, step - run.first + 1)
            taken = s.recent.input_at(step)
            if taken is None:
                self.unchecked[step] = sent
            elif taken != sent:
                self.resend_errors[step] = input_mismatch(s.id, step)
                continue
            if step >= answered:
                self.resent[step] = s.recent.output_at(step)

    def raw_at(self, k: int, n: int = 1) -> bytes:
        """The log bytes of the advance's steps ``k .. k + n - 1`` (indices)."""
        width = len(self.raw) // self.plan.advance
        return self.raw[k * width : (k + n) * width]

    def next_input(self) -> np.ndarray:
        """The input the engine runs the session's next step with: as sent, or as the
        input rules made it (imputed dims)."""
        if self.before is not None:
            return self.before.applied
        return self.values[self.applied]  # type: ignore[index]

    def segment(self, r: int) -> int:
        """The length of the session's ``r``-th engine call (0: none this round)."""
        if self.stopped or r >= len(self.plan.segments):
            return 0
        return self.plan.segments[r]

    def take_back(self, error: SsmserveError) -> None:
        """Undo every step this batch applied to the session; they are answered with
        ``error`` (and so is every step it took but resends of older steps)."""
        s = self.session
        if s.step != self.start:
            s.state, s.step = self.start_state, self.start
            s.guard_state = self.start_guards
            s.recent.cut_after(self.start)
        self.snapshots_due.clear()
        self.guard_rollback = 0
        self.failed = error

    def give_back(self, after_step: int) -> None:
        """A guard stopped the session at ``after_step``: the steps taken after it go back
        to the head of its queue, in order, answered by a later batch (a guarded session's
        pieces are single steps: ``batch_plan.plan_session``)."""
        pieces = self.plan.pieces
        keep = len(pieces)
        while keep and not (
            pieces[keep - 1].kind == APPLY and pieces[keep - 1].first == after_step
        ):
            keep -= 1
        self.given_back = len(pieces) - keep
        s = self.session
        back: list[StepRun] = []  # runs the batch took off the queue whole, in order
        last: StepRun | None = None
        for piece in pieces[keep:]:
            s.queued_steps += piece.count
            run = piece.entry
            if run is last:  # a run's pieces are consecutive: its first one reset it
                continue
            last = run
            if run.taken == run.count:  # taken whole, so off the queue (``SessionWork.take``)
                back.append(run)
            run.taken = piece.lo  # its steps from this piece on are queued again
        if back:
            s.queue.push_front(back)

    # ------------------------------------------------------------------ answers

    def answer(self) -> None:
        """Answer every step taken (and not given back), once; snapshots committed since
        the session's last answer go with the last one."""
        s = self.session
        pieces = self.plan.pieces[: len(self.plan.pieces) - self.given_back]
        events: tuple = ()
        if pieces and s.snapshot_events:
            events, s.snapshot_events = s.snapshot_events, ()
        for i, piece in enumerate(pieces):
            self._answer_piece(piece, events if i == len(pieces) - 1 else ())

    def _answer_piece(self, piece: Piece, events: tuple) -> None:
        run = piece.entry
        lease = self.session.lease  # what every answer here speaks under
        if run.outputs is None:  # a step sent alone: answered with its own outcome
            outcome = self._outcome(piece, piece.first)
            outcome.snapshot_events += events
            outcome.lease = lease
            run.answer_alone(outcome)
            return
        run.lease = lease
        lo, hi = piece.lo, piece.lo + piece.count
        if (
            piece.kind == APPLY
            and not self.plan.guarded
            and self.failed is None
            and self.fenced is None
        ):
            row = piece.first - self.start - 1  # applied whole: answered by its outputs
            if not run.last_only:
                run.outputs[lo:hi] = self.outputs[row : row + piece.count]  # type: ignore[index]
            elif hi == run.count:  # only the last row is answered (the others may be unset)
                run.outputs[hi - 1] = self.outputs[row + piece.count - 1]  # type: ignore[index]
            if events:
                answered = not run.last_only or hi == run.count
                run.outcomes[hi - 1] = StepOutcome(
                    run.session_id, run.first + hi - 1,
                    output=run.outputs[hi - 1] if answered else None, snapshot_events=events,
                )  # fmt: skip
        else:  # a guarded step, a resend, a gap, an error: its own outcome
            for t in range(lo, hi):
                run.outcomes[t] = self._outcome(piece, run.first + t)
            if events:
                run.outcomes[hi - 1].snapshot_events += events  # type: ignore[union-attr]
        run.answer(lo, hi)

    def _outcome(self, piece: Piece, step: int) -> StepOutcome:
        outcome = StepOutcome(self.session.id, step)
        if self.fenced is not None:  # resends too: a new owner may have rolled back
            outcome.error = self.fenced
        elif piece.kind == RESEND:
            output = self.resent.get(step)
            if output is None and step > self.start and self.failed is None:
                k = step - self.start - 1  # applied earlier in this batch
                if k < self.applied and self.raw_at(k) != piece.entry.raw_of(
                    step - piece.entry.first, step - piece.entry.first + 1
                ):
                    outcome.error = input_mismatch(self.session.id, step)
                    return outcome
                output = self._output_of(step)
            if output is not None:
                outcome.output, outcome.replayed = output, True
            else:  # an error, or a last_only run's step answered without its output
                outcome.error = self.resend_errors.get(step) or self.failed
                outcome.replayed = outcome.error is None
        elif piece.kind == GAP:
            outcome.error = self._gap(step, piece.at)
        elif self.failed is not None:
            outcome.error = self.failed
        elif step in self.guarded:
            verdict = self.guarded[step]
            outcome.output, outcome.guard_events = verdict.output, verdict.events
            outcome.error = verdict.error
        else:
            outcome.output = self._output_of(step)
        return outcome

    def _output_of(self, step: int) -> np.ndarray | None:
        """The output of a step applied in this batch; None if not applied or not computed
        (a prefill computes only the outputs somebody is answered with)."""
        k = step - self.start - 1
        if self.outputs is None or not 0 <= k < self.applied:
            return None
        computed = self.plan.computed
        if computed is not None and not computed[k]:
            return None
        return self.outputs[k]

    def _gap(self, step: int, at: int) -> StepGapError:
        s = self.session
        if at == s.restored_step:
            return SessionRewoundError(
                f"session {s.id!r} came back from the store at step {at}, behind step "
                f"{step - 1} (its durability keeps steps in memory between flushes, or the "
                f"store lost writes): resend from step {at + 1}",
                session_step=at,
            )
        return StepGapError(
            f"step {step} of session {s.id!r} skips ahead: the session is at step {at}, so "
            f"the next input is step {at + 1}",
            session_step=at,
        )
