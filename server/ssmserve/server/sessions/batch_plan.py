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

**Prefill.** A segment of at least ``PrefillLimits.min_steps`` steps of a session without
guards runs as one prefill of that session (``MambaModel.prefill``: each layer's products
over all its positions at once) instead of steps batched with other sessions; the plan
then also says which of its outputs the prefill computes (``SessionPlan.rows``): those
answered with an output, and the segment's last (a snapshot due there, and the session's
newest output, keep it). Prefill reads each weight once per segment where batched steps
read it once per step for all the sessions that step together, so it pays when the run is
long and few sessions have one. A session whose queue starts with a run of at least
``min_steps`` next steps is a *candidate*; a session whose snapshots fall due more often
than every ``min_steps`` steps is none (its segments would be too short), so a
candidate's segments that step instead (before its first due snapshot, after its last)
are under ``min_steps`` each.

**The token budget** (vLLM's chunked prefill, ``vllm/v1/core/sched/scheduler.py``): a batch
computes at most ``PrefillLimits.batch_tokens`` steps, decode first. The sessions that are
no candidates (a generated token, a stream's step: up to ``max_ticks`` each) are planned
first and their advance counts against the budget; the candidates share what is left,
each a chunk of at most ``PrefillLimits.chunk`` steps. What is left is never under
``min_steps``, so a prompt goes on however many sessions decode. When a candidate's share
is under ``min_steps`` (many sessions each sending runs: a multiplexed stream), batched
steps already amortize the weights over the sessions, and every session steps instead,
``max_ticks`` each.

**Pause.** On a CPU a prefill call reads every weight once, as a decode step does, so
even a short chunk costs the sessions decoding beside it a step's time. The stepper
therefore gives prefill a share of its time while sessions decode
(``StepperSettings.prefill_share``): after a prefill beside decode steps it pauses
prefill, and a batch planned ``paused`` takes nothing of the candidates while other
sessions step (a batch of candidates alone prefills: a prompt never waits for nothing).

**Phases.** The batch runs in two phases (``BatchPlan.phases``): the sessions that only
step, then the sessions that prefill. The stepper answers the first phase before the
second computes, so a decode step's answer is never held behind prefill work planned
after it, and its session's next step is queued while the prefill runs.

A session takes at most ``max_ticks`` steps per batch (a prefill candidate its chunk;
resends and gaps count), so one session cannot hold the others' answers for long; a
control operation queued behind its steps (a rollback, a snapshot) ends what the batch
takes. The plan reads the sessions
and changes nothing: the stepper takes what it says (``SessionWork.take``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ssmserve.server.sessions.config import Durability
from ssmserve.server.sessions.session import Session, StepRun

RESEND, APPLY, GAP = "resend", "apply", "gap"


@dataclass(frozen=True, slots=True)
class PrefillLimits:
    """When a session's run is prefilled (see the module's docstring)."""

    min_steps: int  # the shortest segment prefilled; 0: never prefill
    batch_tokens: int  # steps per batch: decode steps first, then prefill chunks
    chunk: int  # the most steps one session prefills per batch


#: No prefill: every segment is stepped (``plan``'s default).
NO_PREFILL = PrefillLimits(0, 0, 0)


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
    # Per segment (empty: none is): the outputs a prefill computes, as indices into the
    # segment (strictly increasing), or None for a segment stepped (every output).
    rows: list[np.ndarray | None] = field(default_factory=list)

    def prefilled(self, r: int) -> bool:
        """Whether the session's ``r``-th engine call is a prefill."""
        return bool(self.rows) and self.rows[r] is not None

    @property
    def computed(self) -> np.ndarray | None:
        """Which steps of the advance get an output ``(advance,)`` bool; None: all."""
        if not any(r is not None for r in self.rows):
            return None
        out, at = np.ones(self.advance, np.bool_), 0
        for n, rows in zip(self.segments, self.rows, strict=True):
            if rows is not None:
                out[at : at + n] = False
                out[at + rows] = True
            at += n
        return out

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
    sessions: list[SessionPlan]  # in the order the batch was given them

    @property
    def rounds(self) -> int:
        """Engine rounds the batch runs: the most segments any session has."""
        return max((len(p.segments) for p in self.sessions), default=0)

    @property
    def phases(self) -> list[list[SessionPlan]]:
        """The sessions in the order the batch runs them: those that only step, then
        those that prefill (the module's docstring tells why); a session the batch takes
        nothing of (a prompt whose prefill is paused) and empty phases left out."""
        stepping = [p for p in self.sessions if p.pieces and not p.rows]
        prefilling = [p for p in self.sessions if p.rows]
        return [phase for phase in (stepping, prefilling) if phase]

    @property
    def steps(self) -> int:
        """Steps the batch computes (its token count): every session's advance."""
        return sum(p.advance for p in self.sessions)


def plan(
    sessions: Sequence[Session],
    max_ticks: int,
    prefill: PrefillLimits = NO_PREFILL,
    paused: bool = False,
) -> BatchPlan:
    """The plan of a batch of ``sessions`` (each with a step at the head of its queue).
    ``paused``: prefill is paused (the stepper's share of time for it is spent): the
    batch takes nothing of the candidates while other sessions step."""
    least = prefill.min_steps
    if not least:
        return BatchPlan([plan_session(s, max_ticks) for s in sessions])
    candidates = {id(s) for s in sessions if prefill_candidate(s, least)}
    if not candidates:
        return BatchPlan([plan_session(s, max_ticks) for s in sessions])
    # Decode first: the sessions that step take their steps, counted against the budget.
    stepping = {id(s): plan_session(s, max_ticks) for s in sessions if id(s) not in candidates}
    decoded = sum(p.advance for p in stepping.values())
    if paused and decoded:
        return BatchPlan([stepping.get(id(s)) or SessionPlan(s, s.step) for s in sessions])
    left = max(prefill.batch_tokens - decoded, least)
    share = min(prefill.chunk, left // len(candidates))
    if share < least:
        return BatchPlan([stepping.get(id(s)) or plan_session(s, max_ticks) for s in sessions])
    return BatchPlan([stepping.get(id(s)) or plan_session(s, share, least) for s in sessions])


def prefill_candidate(s: Session, min_steps: int) -> bool:
    """Whether ``s`` may prefill this batch: no guards, its snapshots due no more often
    than every ``min_steps`` steps, and its queue starting with a run of at least
    ``min_steps`` steps, the first of them its next step."""
    if s.config.guards or not s.queue:
        return False
    c = s.config
    snapshots = c.durability != Durability.NONE and c.snapshot_phase is not None
    if snapshots and c.snapshot_every < min_steps:
        return False
    head = s.queue[0]
    return (
        isinstance(head, StepRun)
        and head.next_step == s.step + 1
        and head.count - head.taken >= min_steps
    )


def plan_session(s: Session, max_ticks: int, prefill_min: int = 0) -> SessionPlan:
    """What a batch does with ``s``'s queued steps (see the module's docstring); segments
    of at least ``prefill_min`` steps are prefilled (0: none)."""
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
    if prefill_min and not p.guarded and any(n >= prefill_min for n in p.segments):
        p.rows = _prefill_rows(p, prefill_min)
    p.log_ahead = (
        p.advance > 0
        and s.config.durability == Durability.LOG
        and not p.guarded
        and not s.recent.unflushed
    )
    return p


def _prefill_rows(p: SessionPlan, prefill_min: int) -> list[np.ndarray | None]:
    """Per segment: the outputs its prefill computes (None: stepped). An output is
    computed where a step of the advance is answered with one (every step of a run, or
    only the last of a ``last_only`` run; a resend, later in the queue, of a step of the
    advance), and at each segment's end."""
    wanted = np.zeros(p.advance, np.bool_)
    for piece in p.pieces:
        run = piece.entry
        if piece.kind == APPLY:
            k = piece.first - p.start - 1  # the piece's first step, as an index of the advance
            if not run.last_only:
                wanted[k : k + piece.count] = True
            elif piece.lo <= run.count - 1 < piece.lo + piece.count:
                wanted[k + run.count - 1 - piece.lo] = True
        elif piece.kind == RESEND:
            for step in range(piece.first, piece.first + piece.count):
                k = step - p.start - 1
                if k >= 0 and (not run.last_only or step == run.first + run.count - 1):
                    wanted[k] = True
    rows: list[np.ndarray | None] = []
    at = 0
    for n in p.segments:
        if n < prefill_min:
            rows.append(None)
        else:
            picked = wanted[at : at + n].copy()
            picked[-1] = True
            rows.append(np.flatnonzero(picked))
        at += n
    return rows


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
