"""What one stepper batch does, decided before anything runs: :func:`plan`.

As vLLM's scheduler makes a step's batch a complete value before the model runs, the
plan says, from each session's step and the head of its queue (runs of consecutive
steps, :class:`StepRun`; a single step is a run of one), what the batch will do with
every step it takes:

- **resend**: a step at or before the session's step, answered with its recorded output;
- **apply**: the session's next steps, ``step + 1, step + 2, ...`` (its *advance*), run
  as engine calls (*segments*) that end where a periodic snapshot falls due, so the
  state there can be copied for it; a session with guards advances one step per engine
  call, since a guard's verdict on one output decides whether the next step runs;
- **gap**: a step beyond the next one, answered with an error.

It also says whether a session's advance goes to the log ahead of the engine calls
(``log`` durability, no guards, nothing older waiting to be logged: then every step of
the advance is surely applied once computed) or in the group commit after them.

A session takes at most ``max_ticks`` steps per batch (resends and gaps count), so one
session cannot hold the others' answers for long; a control operation queued behind its
steps (a rollback, a snapshot) ends what the batch takes. The plan reads the sessions
and changes nothing: the stepper takes what it says (``Stepper._take``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ssmserve.server.sessions.config import Durability
from ssmserve.server.sessions.session import Session, StepRun

RESEND, APPLY, GAP = "resend", "apply", "gap"


@dataclass(slots=True)
class Piece:
    """Consecutive steps of one queued run that the batch treats alike: steps
    ``first .. first + count - 1``, indices ``lo .. lo + count - 1`` of ``entry``."""

    entry: StepRun
    lo: int
    count: int
    first: int
    kind: str  # RESEND, APPLY or GAP
    at: int  # the session's step when the batch comes to this piece (a gap's answer)


@dataclass(slots=True)
class SessionPlan:
    """What the batch does for one session."""

    session: Session
    start: int  # the session's step when the batch began
    pieces: list[Piece] = field(default_factory=list)  # every step taken, in queue order
    advance: int = 0  # steps applied: start + 1 .. start + advance
    segments: list[int] = field(default_factory=list)  # engine calls' lengths, in order
    log_ahead: bool = False  # the advance goes to the log before the engine calls
    guarded: bool = False  # one step per engine call, each output checked by the guards

    @property
    def due(self) -> list[int]:
        """Steps of the advance where a periodic snapshot falls due (segment ends)."""
        s, step, out = self.session, self.start, []
        for n in self.segments:
            step += n
            if _snapshot_due(s, step):
                out.append(step)
        return out


@dataclass(slots=True)
class BatchPlan:
    sessions: list[SessionPlan]

    @property
    def rounds(self) -> int:
        """Engine rounds the batch runs: the most segments any session has."""
        return max((len(p.segments) for p in self.sessions), default=0)


def plan(sessions: Sequence[Session], max_ticks: int) -> BatchPlan:
    """The plan of a batch of ``sessions`` (each with a step at the head of its queue)."""
    return BatchPlan([plan_session(s, max_ticks) for s in sessions])


def plan_session(s: Session, max_ticks: int) -> SessionPlan:
    """What a batch does with ``s``'s queued steps (see the module's docstring)."""
    p = SessionPlan(s, s.step, guarded=bool(s.config.guards))
    at, left = s.step, max_ticks  # the step the session will be at; steps still to take
    # A guarded session's pieces are single steps: a guard may stop it after any step,
    # and what it took after that step goes back to the queue (SessionWork.give_back).
    most = 1 if p.guarded else max_ticks
    for entry in s.queue.first(max_ticks):
        if not isinstance(entry, StepRun):
            break  # a control operation: it runs before anything queued behind it
        first, lo, end = entry.first, entry.taken, entry.count
        while lo < end and left:
            step = first + lo
            if step <= at:
                kind, n = RESEND, min(end - lo, at - step + 1, left, most)
            elif step == at + 1:
                kind, n = APPLY, min(end - lo, left, most)
            else:  # later steps of the entry are beyond the next one too
                kind, n = GAP, min(end - lo, left, most)
            p.pieces.append(Piece(entry, lo, n, step, kind, at))
            if kind == APPLY:
                at += n
            lo, left = lo + n, left - n
        if not left:
            break
    p.advance = at - s.step
    p.segments = [1] * p.advance if p.guarded else _segments(s, p.advance)
    p.log_ahead = (
        p.advance > 0
        and s.config.durability == Durability.LOG
        and not p.guarded
        and not s.recent.unflushed
    )
    return p


def _segments(s: Session, advance: int) -> list[int]:
    """``advance`` steps from ``s.step`` as engine calls that end at each step where a
    periodic snapshot falls due."""
    out, step, end = [], s.step, s.step + advance
    every, phase = s.config.snapshot_every, s.config.snapshot_phase
    snapshots = s.config.durability != Durability.NONE and phase is not None
    while step < end:
        n = end - step
        if snapshots:
            due = step + 1 + (phase - step - 1) % every  # the next due step after ``step``
            n = min(n, due - step)
        out.append(n)
        step += n
    return out


def _snapshot_due(s: Session, step: int) -> bool:
    return s.config.durability != Durability.NONE and s.config.snapshot_due(step)
