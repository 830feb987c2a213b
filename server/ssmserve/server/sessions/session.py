"""A resident session: its state in memory, and the queue that orders everything done to it.

Steps and control operations (rollback, snapshot, export, close, eviction) of a session go
through one FIFO queue, so a rollback that arrives while a stream is open is ordered with
that session's steps: it runs after the steps queued before it and before those queued
after it. The stepper takes steps (runs of one or more: :class:`StepRun`) from the head; a
control operation waits in :meth:`Session.exclusive` until its gate reaches the head and
no batch holds the session, and holds the session until it leaves the ``async with`` block.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ssmserve.server.engine.interface import Engine
from ssmserve.server.engine.recurrent_state import SessionState
from ssmserve.server.errors import ErrorKind, SsmserveError
from ssmserve.server.sessions.config import SessionConfig
from ssmserve.server.sessions.guards import GuardEvent
from ssmserve.server.sessions.snapshot_writer import SnapshotWriter
from ssmserve.server.state.checkpoint import GuardState
from ssmserve.server.state.input_log import RecentSteps, input_codec
from ssmserve.server.state.lease import SessionLease


class StepGapError(SsmserveError):
    """A step number beyond the next one: an input is missing in between.

    ``session_step`` is the step the session is at (the next input it takes is one more)."""

    kind = ErrorKind.FAILED_PRECONDITION

    def __init__(self, message: str, session_step: int = 0) -> None:
        super().__init__(message)
        self.session_step = session_step


class SessionRewoundError(StepGapError):
    """A step beyond the next one, sent to a session that has just come back from the
    store at ``session_step`` and not stepped since: it is behind steps a client was
    answered (``snapshot`` and ``none`` durability keep the steps since the last flush in
    memory only, and a crash loses them; or the store lost writes). The client resends
    from ``session_step + 1`` if it still holds those inputs."""


class GuardRejectedError(SsmserveError):
    """A guard with action REJECT refused the step's output; the step was not applied."""

    kind = ErrorKind.FAILED_PRECONDITION


class GuardRolledBackError(SsmserveError):
    """A guard with action ROLLBACK returned the session to an earlier snapshot."""

    kind = ErrorKind.FAILED_PRECONDITION


class SessionGoneError(SsmserveError):
    """The session was closed or evicted while this request waited for it."""

    kind = ErrorKind.UNAVAILABLE


@dataclass(frozen=True)
class SnapshotEvent:
    snapshot_id: str
    step: int
    reason: str


@dataclass(slots=True)
class StepOutcome:
    session_id: str
    step: int
    output: np.ndarray | None = None  # (o,)
    replayed: bool = False
    # Tuples, replaced when they change: most steps have none, and () costs no object.
    guard_events: tuple[GuardEvent, ...] = ()
    snapshot_events: tuple[SnapshotEvent, ...] = ()
    error: SsmserveError | None = None
    # The lease it was answered under: checked again as the answer leaves the worker
    # (``api.answer_fence``); None for an answer that says nothing of the session's state.
    lease: SessionLease | None = None


class StepRun:
    """Consecutive steps ``first, first + 1, ...`` of one session, queued as one entry:
    every step a session's queue holds is in a run, and a single step is a run of one.

    A message's consecutive steps of one session are one run, answered with one future
    resolved to the run itself: a step with nothing else to say is answered by its row
    of ``outputs``, any other by its own outcome in ``outcomes``. A step sent alone is a
    run of one (:meth:`one`) without ``outputs``, whose future resolves to that step's
    :class:`StepOutcome` (its outcome always carries its output).

    Why runs: a multiplexed stream sends several steps of each session per message.
    Queued and answered one by one, each step costs the server an entry, a future, an
    outcome and its own pass through the stepper's Python, which at thousands of
    sessions is most of the server's CPU per step. The batch plan cuts the runs at the
    head of a session's queue into pieces (resends, applied steps, gaps); a batch may
    take part of a run (``max_ticks``, a control operation queued behind it) and leave
    the rest queued, from ``next_step`` on. The applied steps of a session without
    guards run in chunks, each one engine call over all its steps
    (``EngineLane.step_many``) with bookkeeping per chunk, not per step. A guarded
    session's pieces are single steps, and the steps a guard keeps from running go back
    to the queue (``SessionWork.give_back``), so every outcome is exactly what separate
    steps would get.

    ``last_only`` (``StreamRequest.last_outputs_only``): only the run's last step is
    answered with its output, the others with none; a prefill then computes only the
    outputs somebody is answered with (``batch_plan``). The session steps the same.
    """

    __slots__ = (
        "count",
        "first",
        "future",
        "last_only",
        "lease",
        "outcomes",
        "outputs",
        "pending",
        "raw",
        "session_id",
        "taken",
        "values",
    )

    def __init__(
        self,
        session_id: str,
        first: int,
        values: np.ndarray,
        raw: bytes,
        output_dim: int,
        future: asyncio.Future[StepRun] | None,
        last_only: bool = False,
    ) -> None:
        count = len(values)
        self.last_only = last_only
        self.session_id = session_id  # as stored
        self.first = first
        self.values = values  # (T,) int64 token ids or (T, i) float32, checked finite
        self.raw = raw  # the T inputs as the log stores them, back to back
        self.future: asyncio.Future[StepRun] | asyncio.Future[StepOutcome] | None = future
        self.count = count
        # (T, o), filled as batches answer (of a ``last_only`` run, only its last row:
        # the rest stay unwritten, so untouched pages); None for a step sent alone.
        self.outputs: np.ndarray | None = np.empty((count, output_dim), np.float32)
        # Per step: None while it is answered by its row of ``outputs`` (applied, nothing
        # else to say), else its outcome (an error, a resend, a guarded step's verdict).
        self.outcomes: list[StepOutcome | None] = [None] * count
        self.taken = 0  # steps the stepper has taken; those from here on are queued
        self.pending = count  # steps not answered yet
        # The lease its latest answers were made under (checked as they leave the worker).
        self.lease: SessionLease | None = None

    @classmethod
    def one(
        cls,
        session_id: str,
        step: int,
        value: np.ndarray,
        raw: bytes,
        future: asyncio.Future[StepOutcome] | None,
    ) -> StepRun:
        """Step ``step`` sent alone, ``value`` its input (a () token id or an (i,)
        vector): a run of one answered with its StepOutcome. Made field by field, not
        through ``__init__``: every step sent alone is made here, and the general
        constructor (its keyword checks, the outputs array) cost it 0.7 us."""
        run = cls.__new__(cls)
        run.session_id, run.first, run.values, run.raw = session_id, step, value[None], raw
        run.future, run.count, run.outputs, run.outcomes = future, 1, None, [None]
        run.taken, run.pending, run.last_only, run.lease = 0, 1, False, None
        return run

    @property
    def next_step(self) -> int:
        """The step number of the first step not taken yet."""
        return self.first + self.taken

    def answer(self, lo: int, hi: int, error: SsmserveError | None = None) -> None:
        """Steps ``lo:hi`` (indices) are answered: by their outputs or outcomes, or with
        ``error``. The future resolves once every step is."""
        if error is not None:
            for t in range(lo, hi):
                self.outcomes[t] = StepOutcome(self.session_id, self.first + t, error=error)
        self.pending -= hi - lo
        if self.pending == 0 and self.future is not None:
            # The future lets go of the run's side: a run holding the future that holds
            # the run is a cycle, which only the cyclic collector frees (thousands of runs
            # and their outputs stayed in an idle worker: 2.4 KiB per demo session).
            future, self.future = self.future, None
            if not future.done():
                # A step sent alone (no ``outputs``) is answered with its own outcome.
                future.set_result(self if self.outputs is not None else self.outcomes[0])  # type: ignore[arg-type]

    def answer_alone(self, outcome: StepOutcome) -> None:
        """A step sent alone (:meth:`one`) is answered with ``outcome``."""
        self.outcomes[0], self.pending = outcome, 0
        future, self.future = self.future, None
        if future is not None and not future.done():
            future.set_result(outcome)  # type: ignore[arg-type]

    def raw_of(self, lo: int, hi: int) -> bytes:
        """The logged bytes of steps ``lo:hi`` (indices), back to back."""
        width = len(self.raw) // self.count  # bytes per input
        return self.raw[lo * width : hi * width]


@dataclass(eq=False, slots=True)
class _Gate:
    opened: asyncio.Future[None]


QueueEntry = StepRun | _Gate


class SessionQueue:
    """A session's FIFO of runs of steps and control gates: a list read from ``_head``.

    Why not ``collections.deque``: an empty deque still holds a 528-byte block, and a
    worker keeps thousands of resident sessions whose queues are empty almost always
    (two deques were ~7% of a small session's memory). Popping advances an index; the
    list is compacted once the popped part is half of it, so each operation is O(1)
    amortized however deep the queue (up to ``max_queued_steps``).
    """

    __slots__ = ("_head", "_items")

    def __init__(self) -> None:
        # Entries from ``_head`` on; the popped ones before it are None (a popped entry
        # is not kept alive by an idle session's queue: its future holds its answer).
        self._items: list[QueueEntry | None] = []
        self._head = 0  # index of the first entry in ``_items``

    def __len__(self) -> int:
        return len(self._items) - self._head

    def __bool__(self) -> bool:
        return len(self._items) > self._head

    def __iter__(self) -> Iterator[QueueEntry]:
        return iter(self._entries())

    def __getitem__(self, index: int) -> QueueEntry:
        """Only the head (``queue[0]``) is ever read by position."""
        if index != 0 or not self:
            raise IndexError("SessionQueue gives only its head, queue[0], when not empty")
        entry = self._items[self._head]
        assert entry is not None
        return entry

    def first(self, count: int) -> list[QueueEntry]:
        """The first ``count`` entries (all, if fewer), oldest first, left queued."""
        return self._items[self._head : self._head + max(count, 0)]  # type: ignore[return-value]

    def append(self, entry: QueueEntry) -> None:
        self._items.append(entry)

    def popleft(self) -> QueueEntry:
        if not self:
            raise IndexError("pop from an empty SessionQueue")
        entry = self._items[self._head]
        assert entry is not None
        self._items[self._head] = None
        self._head += 1
        if self._head == len(self._items):
            self._items.clear()
            self._head = 0
        elif 2 * self._head >= len(self._items):
            del self._items[: self._head]
            self._head = 0
        return entry

    def push_front(self, entries: list[StepRun]) -> None:
        """``entries`` at the head, in their order (runs a guard sent back)."""
        self._items[self._head : self._head] = entries

    def take_steps(self) -> list[StepRun]:
        """Take every run out, in order; control gates stay, in order."""
        entries = self._entries()
        self._items = [e for e in entries if isinstance(e, _Gate)]
        self._head = 0
        return [e for e in entries if not isinstance(e, _Gate)]

    def remove(self, entry: QueueEntry) -> None:
        """Take ``entry`` out wherever it is (by identity); ValueError if absent."""
        for i in range(self._head, len(self._items)):
            if self._items[i] is entry:
                del self._items[i]
                if self._head == len(self._items):  # empty now: nothing popped is kept
                    self._items.clear()
                    self._head = 0
                return
        raise ValueError("entry not in the session's queue")

    def _entries(self) -> list[QueueEntry]:
        return [e for e in self._items[self._head :] if e is not None]


class Session:
    """One resident session (``__slots__``: a worker holds thousands)."""

    __slots__ = (
        "_on_release",
        "busy",
        "codec",
        "config",
        "created_at",
        "gone",
        "guard_state",
        "id",
        "last_active",
        "last_snapshot_step",
        "lease",
        "model",
        "model_name",
        "queue",
        "queued_steps",
        "recent",
        "restored_step",
        "snapshot_events",
        "snapshots",
        "state",
        "step",
        "unsettled",
        "updated_at",
    )

    def __init__(
        self,
        session_id: str,
        model: Engine,
        model_name: str,
        config: SessionConfig,
        state: SessionState,
        step: int,
        created_at: float,
        recent: RecentSteps,
        lease: SessionLease,
        on_release: Callable[[Session], None],
    ) -> None:
        self.id = session_id
        self.model = model
        self.model_name = model_name
        self.codec = input_codec(model.config)  # one per model, shared
        self.config = config
        self.state = state
        self.step = step
        self.created_at = created_at
        self.updated_at = time.time()
        self.last_active = time.monotonic()
        self.recent = recent
        # What its stateful guards carry from its step to the next (``stateful_guards``;
        # None: it has none). A value, replaced as the session steps or rolls back.
        self.guard_state: GuardState | None = None
        self.queue = SessionQueue()
        self.queued_steps = 0  # steps in ``queue`` (a run counts each of its steps)
        self.busy = False  # a stepper batch or a control operation holds the session
        self.lease = lease  # this worker's ownership: every store write carries it
        self.last_snapshot_step = -1  # step of the newest snapshot this worker knows of
        self.gone: SsmserveError | None = None  # set once closed or evicted
        # Why memory may not match the store (a write of it had an unknown outcome): set,
        # nothing is answered for it until the store says which it was (``residency``).
        self.unsettled: SsmserveError | None = None
        # The step memory was rebuilt at from a store that may hold less than was
        # answered (a takeover, a reload after a drop); -1: none (SESSION_REWOUND).
        self.restored_step = -1
        self.snapshots = SnapshotWriter(session_id)  # periodic snapshots, in the background
        # Committed, not yet in an answer: a tuple, replaced when it changes (most
        # sessions have none, and () is one shared object where a list is 56 bytes each).
        self.snapshot_events: tuple[SnapshotEvent, ...] = ()
        self._on_release = on_release  # tells the stepper the head of the queue moved

    def answerable(self, now: float | None = None) -> bool:
        """Whether memory may answer for this session now (``now``: ``lease_clock()``, if
        the caller read it once for many sessions): its lease surely still runs by this
        worker's clock, and the store agrees with memory as far as anyone knows."""
        return self.unsettled is None and self.lease.valid(now)

    def rebuilt_at(
        self,
        state: SessionState,
        step: int,
        snapshot_step: int,
        may_be_behind: bool = False,
        guards: GuardState | None = None,
    ) -> None:
        """Memory rebuilt at ``step`` from the snapshot at ``snapshot_step`` plus replay (a
        load, a rollback), ``guards`` its guard state there. ``may_be_behind``: from a
        store that may hold less than was answered (a takeover, a reload after a drop:
        SESSION_REWOUND)."""
        self.state, self.step, self.last_snapshot_step = state, step, snapshot_step
        self.guard_state = guards
        # A periodic snapshot committed but not announced yet, of a step past ``step``,
        # belongs to steps the session no longer has (a rollback cut them): announced, it
        # would tell the client a snapshot stands that the cut removed.
        self.snapshot_events = tuple(e for e in self.snapshot_events if e.step <= step)
        if may_be_behind:
            self.restored_step = step

    def snapshotted(self, step: int) -> None:
        """A snapshot of this session at ``step`` is committed."""
        self.last_snapshot_step = max(self.last_snapshot_step, step)

    def announce(self, event: SnapshotEvent) -> None:
        """``event`` goes with the session's next answer (a periodic snapshot committed)."""
        self.snapshot_events += (event,)

    def own_state(self) -> None:
        """State arrays of its own: a batch row keeps its whole batch array alive, so a
        session that stopped stepping copies its row, and holds just its state's size."""
        self.state = self.state.copy()

    @property
    def head_is_step(self) -> bool:
        return bool(self.queue) and isinstance(self.queue[0], StepRun)

    def touch(self, now: tuple[float, float] | None = None) -> None:
        """Active just now; ``now`` is (``time.monotonic()``, ``time.time()``) read once
        for a whole batch: its sessions then share two float objects instead of holding
        two each, made anew at every step (survivors of a tick's garbage that keep the
        allocator's pools from being freed)."""
        self.last_active, self.updated_at = now or (time.monotonic(), time.time())

    def open_gate(self) -> None:
        """Let the control operation at the head of the queue run, if nothing holds us."""
        head = self.queue[0] if self.queue else None
        if not self.busy and isinstance(head, _Gate) and not head.opened.done():
            self.busy = True
            head.opened.set_result(None)

    @contextlib.asynccontextmanager
    async def exclusive(self, read_only: bool = False) -> AsyncIterator[None]:
        """Hold the session between two steps: queued steps before us run first.

        ``read_only``: the holder changes nothing (forecast, fork), so ``updated_at``
        stays; the session still counts as active for idle eviction.
        """
        if self.gone is not None:
            raise self.gone
        gate = _Gate(asyncio.get_running_loop().create_future())
        self.queue.append(gate)
        self.open_gate()
        try:
            await gate.opened
        except BaseException:
            if gate.opened.done() and not gate.opened.cancelled():
                self.busy = False  # opened just as we were cancelled
            self.queue.remove(gate)
            self._after_release()
            raise
        try:
            if self.gone is not None:
                raise self.gone
            await self.snapshots.settled()  # no background write lands under our feet
            yield
        finally:
            self.queue.remove(gate)
            self.busy = False
            if read_only:
                self.last_active = time.monotonic()
            else:
                self.touch()
            self._after_release()

    def _after_release(self) -> None:
        self.open_gate()
        self._on_release(self)

    def answer_queued(self, error: SsmserveError) -> None:
        """Every queued step is answered with ``error``, none applied (control operations
        stay queued, in order)."""
        for run in self.queue.take_steps():
            taken, run.taken = run.taken, run.count
            run.answer(taken, run.count, error)
        self.queued_steps = 0

    def fail_queued(self, error: SsmserveError) -> None:
        """The session is leaving memory: everything still queued gets ``error``."""
        self.gone = error
        self.snapshots.cancel()
        self.answer_queued(error)
        # A control operation that waited behind those steps is at the head now: open its
        # gate so it sees ``gone`` and raises. Nothing else would (the session has left
        # the stepper and the residents), and it would wait forever.
        self.open_gate()
