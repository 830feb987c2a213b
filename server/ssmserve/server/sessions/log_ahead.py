"""Log ahead: a batch's log appends sent before its engine calls, so Redis writes while
the engine computes.

A ``log``-durability step is answered only once its input is in Redis (durable before
acknowledged). The append needs the input, not the output, so the stepper sends it just
before the batch's first engine call and reads the reply after: the round trip and the
computation overlap. It still waits for the reply before answering. For a lone session
stepping one input at a time the two ran one after the other (in the served process
~70 us of engine call, then ~260 us of append; docs/benchmark-history.md, "Issue 19,
stop 37").

Which steps go ahead is the batch plan's (``batch_plan``): a session's whole advance,
when it is surely applied once computed: ``log`` durability, no guards (a guard may
refuse an output or roll back), nothing older waiting to be logged. One append per
session per batch, so two can never overtake each other on two connections (the log
script would refuse the later one as a gap).

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
from ssmserve.server.sessions.session import Session
from ssmserve.server.state.input_log import InputBlock
from ssmserve.server.state.lease import SessionLease
from ssmserve.server.state.store import Store

#: Per session of an append: the session, the lease the append was sent with.
_Sent = list[tuple[Session, SessionLease]]


class LogAhead:
    """The appends one stepper batch sent ahead of its engine calls (one object per batch)."""

    __slots__ = ("_appends", "store")

    def __init__(self, store: Store) -> None:
        self.store = store
        self._appends: list[tuple[asyncio.Task[list[SsmserveError | None]], _Sent]] = []

    async def send(self, blocks: list[tuple[Session, InputBlock]]) -> None:
        """Start one group append of ``blocks`` (one per session); returns after one turn
        of the event loop, in which the append writes its command to the socket. Its
        reply is read by :meth:`settle`. Nothing to send: returns at once."""
        if not blocks:
            return
        sent = [(s, s.lease) for s, _ in blocks]
        appends = [(lease, block) for (_, lease), (_, block) in zip(sent, blocks, strict=True)]
        task = asyncio.ensure_future(self.store.append_logs(appends, time.time()))
        self._appends.append((task, sent))
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
