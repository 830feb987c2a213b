"""Log ahead: a batch's log appends sent before its engine call, so Redis writes while
the engine computes.

A ``log``-durability step is answered only once its input is in Redis (durable before
acknowledged). The append needs the input, not the output, so the stepper sends it just
before the engine call that computes the step and reads the reply after: the round trip
and the computation overlap. It still waits for the reply before answering. For a lone
session stepping one input at a time the two ran one after the other (in the served
process ~70 us of engine call, then ~260 us of append).

Which steps go ahead (:meth:`LogAhead.takes`): those that are surely applied once
computed. That is a session's next step (the stepper checked step numbers already), of a
session without guards (a guard may refuse the output or roll back), in the first engine
call of the batch that steps the session, while nothing earlier of it waits to be
logged; with it, the single steps queued right behind it with the next step numbers, as
many as the batch has ticks left (:func:`steps_block`): each later tick applies one.
One append per session per batch, because two could overtake each other on two
connections (the log script would refuse the later step as a gap); any further steps of
the session in the batch go in the group commit at its end, sent after these replies.

If a step logged ahead is not applied after all (the engine call raised, the batch was
cancelled), Redis may hold an input that memory does not: the stepper drops the session
(:meth:`LogAhead.abandon`) and the next request reloads it from Redis. It does not guess
which of the two is right.

On Redis Cluster the append is one pipeline per node, each started as a task of its own,
so one turn of the event loop does not put it on the wire: it overlaps an engine call
that runs on the engine thread (a large batch), not one that runs inline.
"""

from __future__ import annotations

import asyncio
import time

from ssmserve.server.errors import SsmserveError
from ssmserve.server.sessions.config import Durability
from ssmserve.server.sessions.session import Session, StepJob
from ssmserve.server.state.input_log import InputBlock
from ssmserve.server.state.lease import SessionLease
from ssmserve.server.state.store import Store

#: Per session of an append: the session, the lease the append was sent with.
_Sent = list[tuple[Session, SessionLease]]


class LogAhead:
    """The appends one stepper batch sent ahead of its engine calls (one object per batch)."""

    __slots__ = ("_appends", "_upto", "enabled", "store")

    def __init__(self, store: Store, enabled: bool = True) -> None:
        self.store = store
        self.enabled = enabled  # off: nothing goes ahead (``StepperSettings.log_ahead``)
        self._appends: list[tuple[asyncio.Task[list[SsmserveError | None]], _Sent]] = []
        self._upto: dict[str, int] = {}  # session id -> the last step its append holds

    def takes(self, s: Session) -> bool:
        """Whether this batch may log the next step of ``s`` ahead of computing it."""
        return (
            self.enabled
            and s.config.durability == Durability.LOG
            and not s.config.guards
            and not s.recent.unflushed
            and s.id not in self._upto
        )

    def upto(self, s: Session) -> int:
        """The last step of ``s`` this batch sent ahead (0: none)."""
        return self._upto.get(s.id, 0)

    async def send(self, blocks: list[tuple[Session, InputBlock]]) -> None:
        """Start one group append of ``blocks`` (one per session, each taken by
        :meth:`takes`); returns after one turn of the event loop, in which the append
        writes its command to the socket. Its reply is read by :meth:`settle`. Nothing
        to send: returns at once."""
        if not blocks:
            return
        sent = [(s, s.lease) for s, _ in blocks]
        appends = [(lease, block) for (_, lease), (_, block) in zip(sent, blocks, strict=True)]
        task = asyncio.ensure_future(self.store.append_logs(appends, time.time()))
        self._appends.append((task, sent))
        for s, block in blocks:
            self._upto[s.id] = block.last
        await asyncio.sleep(0)

    async def settle(self) -> list[tuple[Session, SessionLease, SsmserveError | None]]:
        """Each session's append replied: (session, lease sent with, None if its steps are
        in the log, else the error). A lost reply is StoreOutcomeUnknownError for every
        session of that append."""
        out: list[tuple[Session, SessionLease, SsmserveError | None]] = []
        for task, sent in self._appends:  # kept until all replied, for abandon() meanwhile
            try:
                errors: list[SsmserveError | None] = await task
            except SsmserveError as exc:
                errors = [exc] * len(sent)
            out.extend((s, lease, e) for (s, lease), e in zip(sent, errors, strict=True))
        self._appends.clear()
        return out

    async def abandon(self) -> list[tuple[Session, SessionLease, SsmserveError | None]]:
        """The batch failed before :meth:`settle` finished: appends still on their way
        are cancelled, and all are waited for. Per session of each: (session, lease sent
        with, None) when Redis holds its steps or may (done, or cancelled: unknown), else
        the error its append was refused with (``hooks.lost`` decides from it)."""
        for task, _ in self._appends:
            task.cancel()  # nothing when it is done
        await asyncio.gather(*(task for task, _ in self._appends), return_exceptions=True)
        out: list[tuple[Session, SessionLease, SsmserveError | None]] = []
        for task, sent in self._appends:
            if task.cancelled():
                errors: list[SsmserveError | None] = [None] * len(sent)
            elif isinstance(exc := task.exception(), SsmserveError):
                errors = [exc] * len(sent)
            elif exc is not None:  # not a refusal: the outcome is not known
                errors = [None] * len(sent)
            else:
                errors = task.result()
            out.extend((s, lease, e) for (s, lease), e in zip(sent, errors, strict=True))
        self._appends.clear()
        return out


def steps_block(s: Session, job: StepJob, ticks: int) -> InputBlock:
    """The inputs of ``job`` (just taken from the head of ``s``'s queue, its next step)
    and of the single steps queued right behind it with the next step numbers, up to
    ``ticks`` steps in all: the ticks left in the batch apply one each, surely (no
    guards: :meth:`LogAhead.takes`)."""
    raws = [job.raw]
    for entry in s.queue.first(ticks - 1):
        if not isinstance(entry, StepJob) or entry.step != job.step + len(raws):
            break
        raws.append(entry.raw)
    return InputBlock.of(job.step, raws)
