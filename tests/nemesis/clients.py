"""The workloads: clients that use sessions through the real client library while the
nemesis injects faults, recording every request and its outcome in the history.

Each session client (``SessionClient``) owns a few sessions and uses each one request
at a time (a stream of steps, a rollback, a snapshot, a forecast, a read, a fork, a
generation), so its own view of a session (``Timeline``: the inputs and answers of every
step acknowledged, after the rollbacks acknowledged) is exact: the checker compares the
session's final history against it. An operator migrates sessions and drains workers;
an observer asks random single workers for forecasts of random sessions, which makes
workers that do not own a session try to take it over (where two owners would show).

Which worker answered: each worker is reached through its own proxy (it advertises the
proxy's address), and the client library records, with every answer, the address it came
from (``AsyncClient.owner_of`` just after the answer). Every request has a bound
(``OP_BOUND_S`` since its last answer): one that gets neither an answer nor an error
within it is recorded as hung.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from ssmserve.client.aio import AsyncClient
from ssmserve.client.errors import (
    DataLoss,
    NotFound,
    SessionRewound,
    SsmserveClientError,
)
from ssmserve.client.retry import RetryPolicy
from ssmserve.v1 import ssmserve_pb2 as pb
from tests.nemesis.history import History, Op, digest
from tests.nemesis.topology import Topology

T = TypeVar("T")
#: A request with neither an answer nor an error for this long is hung (the client gives
#: up after ``give_up_after_s`` without progress, well within it).
OP_BOUND_S = 60.0
POLICY = RetryPolicy(
    give_up_after_s=20.0, call_timeout_s=5.0, stall_timeout_s=8.0,
    keepalive_time_s=0.5, keepalive_timeout_s=0.5, connect_timeout_s=10.0,
)  # fmt: skip
DURABILITIES = {"log": pb.DURABILITY_LOG, "snapshot": pb.DURABILITY_SNAPSHOT,
                "none": pb.DURABILITY_NONE}  # fmt: skip


class Hung(Exception):
    """A request got neither an answer nor an error within its bound."""


async def bounded(awaitable: Awaitable[T], bound_s: float = OP_BOUND_S) -> T:
    try:
        return await asyncio.wait_for(awaitable, bound_s)
    except TimeoutError:
        raise Hung(f"HUNG: no answer and no error within {bound_s:.0f} s") from None


def out_digest(output: np.ndarray) -> str:
    return digest(np.asarray(output, "<f4").tobytes())


def in_digest(value: Any) -> str:
    if isinstance(value, int | np.integer):
        return digest(int(value).to_bytes(8, "little", signed=True))
    return digest(np.asarray(value, "<f4").reshape(-1).tobytes())


@dataclass
class Timeline:
    """A session as its client knows it: each acknowledged step's input and output
    digests (the output None where the answer never came, e.g. a step applied just
    before its stream broke), and the step below which nothing may be lost (``floor``:
    the last acknowledged snapshot, rollback or creation; ``log`` sessions lose nothing)."""

    sid: str
    model: str
    durability: str
    inputs: dict[int, Any] = field(default_factory=dict)  # step -> value (to resend)
    steps: dict[int, tuple[str, str | None]] = field(default_factory=dict)
    step: int = 0
    floor: int = 0
    lost: str = ""  # why the session is gone (a wiped store); it is then left alone
    pending_rollback: int | None = None  # a rollback sent whose outcome is not known
    closed: bool = False

    def acknowledge(self, step: int, value: Any, output: str | None) -> None:
        self.inputs[step] = value
        self.steps[step] = (in_digest(value), output)
        self.step = max(self.step, step)

    snapshots: list[int] = field(default_factory=list)  # acknowledged snapshot steps

    def snapshotted(self, step: int) -> None:
        """A snapshot of ``step`` was acknowledged: a ``snapshot``/``none`` session never
        comes back behind it (until a rollback goes behind it)."""
        if step <= self.step and step not in self.snapshots:
            self.snapshots.append(step)
            self.floor = max(self.floor, step)

    def cut(self, step: int) -> None:
        """A rollback to ``step`` landed: later steps are no longer the session's. A
        ``log`` session keeps every step; a ``snapshot``/``none`` one may come back at its
        newest snapshot at or before ``step`` (a rollback writes no snapshot)."""
        for s in [s for s in self.steps if s > step]:
            del self.steps[s]
            self.inputs.pop(s, None)
        self.step = step
        self.snapshots = [s for s in self.snapshots if s <= step]
        self.floor = step if self.durability == "log" else max(self.snapshots, default=0)


class Shared:
    """What the clients share: the history, the topology, the sessions, the stop flag."""

    def __init__(self, topo: Topology, history: History, seed: int) -> None:
        self.topo = topo
        self.history = history
        self.seed = seed
        self.timelines: dict[str, Timeline] = {}
        self.stop = threading.Event()

    def worker(self, client: AsyncClient, sid: str) -> str:
        return self.topo.name_of(client.owner_of(sid))


class SessionClient:
    """One client using its sessions one request at a time (see the module doc)."""

    def __init__(self, shared: Shared, name: str, durability: str, model: str) -> None:
        self.s = shared
        self.name = name
        self.durability = durability
        self.model = model
        self.rng = random.Random(f"{shared.seed}/{name}")
        self.np = np.random.default_rng(self.rng.getrandbits(32))
        self.mine: list[Timeline] = []
        self.made = 0

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        async with AsyncClient(self.s.topo.addresses, retry=POLICY) as client:
            self.c = client
            while not self.s.stop.is_set():
                live = [t for t in self.mine if not t.lost and not t.closed]
                if not live:
                    await self.create()
                    continue
                t = self.rng.choice(live)
                action = self.rng.choices(
                    ["stream", "rollback", "snapshot", "forecast", "get", "fork", "generate"],
                    [10, 2, 2, 2, 1, 1, 3 if self.model == "lm" else 0],
                )[0]
                if t.step == 0:  # a forecast or generation needs an output to feed back
                    action = "stream"
                try:
                    await getattr(self, action)(t)
                except (DataLoss, NotFound) as exc:
                    t.lost = f"{type(exc).__name__}: {exc}"
                except (SsmserveClientError, Hung, SessionRewound):
                    await self.resync(t)
                await asyncio.sleep(self.rng.uniform(0.0, 0.05))

    def value(self) -> Any:
        if self.model == "lm":
            return int(self.np.integers(0, 37))
        return self.np.standard_normal(4).astype(np.float32)

    async def call(self, op: Op, awaitable: Awaitable[T]) -> T:
        try:
            return await bounded(awaitable)
        except BaseException as exc:
            History.fail(op, exc)
            raise

    # ------------------------------------------------------------------ requests

    async def create(self) -> None:
        self.made += 1
        sid = f"n{self.s.seed}-{self.name}-{self.made}"
        op = self.s.history.invoke(self.name, sid, "create", durability=self.durability)
        try:
            await self.call(
                op,
                self.c.create_session(
                    self.model, sid, snapshot_every=self.rng.choice([4, 16, 64]),
                    durability=DURABILITIES[self.durability],
                ),
            )  # fmt: skip
        except (SsmserveClientError, Hung):
            await asyncio.sleep(0.5)  # it may exist now: the next create uses a new id
            return
        History.ok(op, self.s.worker(self.c, sid), 0)
        t = Timeline(sid, self.model, self.durability)
        self.mine.append(t)
        self.s.timelines[sid] = t

    async def stream(self, t: Timeline, values: list[Any] | None = None, first: int = 0) -> None:
        first = first or t.step + 1
        if values is None:
            values = [self.value() for _ in range(self.rng.randint(1, 40))]
        op = self.s.history.invoke(self.name, t.sid, "stream", first=first, n=len(values))
        pulled: dict[int, float] = {}

        async def source() -> AsyncIterator[Any]:
            for i, v in enumerate(values):
                pulled[first + i] = time.time()
                yield v

        answers = self.c.stream_steps(t.sid, source(), first_step=first)
        try:
            while True:
                try:
                    out = await bounded(answers.__anext__())
                except StopAsyncIteration:
                    break
                worker = self.s.worker(self.c, t.sid)
                d = out_digest(out.output)
                step_op = self.s.history.invoke(self.name, t.sid, "step")
                step_op.invoke = pulled.get(out.step, op.invoke)
                before = t.steps.get(out.step)
                if before is not None and before[1] is not None and out.step <= t.step:
                    step_op.args["expected"] = before[1]  # a resend: the same answer
                History.ok(step_op, worker, out.step, d)
                t.acknowledge(out.step, values[out.step - first], d)
                for event in out.snapshot_events:
                    t.snapshotted(event.step)
        except BaseException as exc:
            History.fail(op, exc)
            # Steps sent but not answered may have been applied: keep their inputs so a
            # resync can adopt them.
            for step in pulled:
                if step > t.step:
                    t.inputs[step] = values[step - first]
            raise
        finally:
            await answers.aclose()
        History.ok(op, self.s.worker(self.c, t.sid), t.step)

    async def rollback(self, t: Timeline) -> None:
        if t.step <= t.floor:
            return
        to = self.rng.randint(max(t.floor, t.step - 60), t.step - 1)
        op = self.s.history.invoke(self.name, t.sid, "rollback", to=to, at=t.step)
        t.pending_rollback = to
        await self.call(op, self.c.rollback(t.sid, to_step=to))
        t.pending_rollback = None
        History.ok(op, self.s.worker(self.c, t.sid), to)
        t.cut(to)

    async def snapshot(self, t: Timeline) -> None:
        op = self.s.history.invoke(self.name, t.sid, "snapshot", expect=t.step)
        info = await self.call(op, self.c.snapshot(t.sid))
        History.ok(op, self.s.worker(self.c, t.sid), info.step)
        if info.step == t.step:
            t.snapshotted(info.step)

    async def forecast(self, t: Timeline) -> None:
        op = self.s.history.invoke(
            self.name, t.sid, "forecast", expect=t.step, floor=t.floor, durability=t.durability
        )
        f = await self.call(op, self.c.forecast(t.sid, self.rng.randint(1, 4)))
        History.ok(op, self.s.worker(self.c, t.sid), f.from_step, out_digest(f.outputs))

    async def get(self, t: Timeline) -> None:
        op = self.s.history.invoke(
            self.name, t.sid, "get", expect=t.step, floor=t.floor, durability=t.durability
        )
        info = await self.call(op, self.c.get_session(t.sid))
        History.ok(op, self.s.worker(self.c, t.sid), info.step)

    async def fork(self, t: Timeline) -> None:
        if len([m for m in self.mine if not m.closed and not m.lost]) >= 3:
            old = next(m for m in self.mine if not m.closed and not m.lost and m is not t)
            op = self.s.history.invoke(self.name, old.sid, "close")
            # Closed from here on, whatever the answer: a close whose outcome is unknown
            # (UNAVAILABLE after the store took the write) may have landed, and then the
            # session is rightly gone.
            old.closed = True
            await self.call(op, self.c.close_session(old.sid))
            History.ok(op, self.s.worker(self.c, old.sid), old.step)
            return
        at = self.rng.randint(t.floor, t.step) if t.durability != "log" else t.step
        self.made += 1
        new = f"n{self.s.seed}-{self.name}-{self.made}"
        op = self.s.history.invoke(self.name, t.sid, "fork", at=at, new=new)
        reply = await self.call(op, self.c.fork(t.sid, at_step=at, new_session_id=new))
        History.ok(op, self.s.worker(self.c, t.sid), reply.step)
        child = Timeline(new, t.model, t.durability, step=reply.step, floor=reply.step)
        for s in range(1, reply.step + 1):
            if s in t.steps:
                child.steps[s] = t.steps[s]
                child.inputs[s] = t.inputs.get(s)
        self.mine.append(child)
        self.s.timelines[new] = child

    async def generate(self, t: Timeline) -> None:
        n = self.rng.randint(1, 12)
        seed = self.rng.getrandbits(31)
        op = self.s.history.invoke(self.name, t.sid, "generate", at=t.step, n=n, seed=seed)
        tokens = self.c.generate(t.sid, n, at_step=t.step, temperature=0.9, seed=seed)
        try:
            while True:
                try:
                    tok = await bounded(tokens.__anext__())
                except StopAsyncIteration:
                    break
                step_op = self.s.history.invoke(self.name, t.sid, "token")
                History.ok(step_op, self.s.worker(self.c, t.sid), tok.step, str(tok.token_id))
                t.acknowledge(tok.step, int(tok.token_id), None)
        except BaseException as exc:
            History.fail(op, exc)
            raise
        finally:
            await tokens.aclose()
        History.ok(op, self.s.worker(self.c, t.sid), t.step)

    # ------------------------------------------------------------------ after an error

    async def resync(self, t: Timeline) -> None:
        """After a request failed: learn where the session is and bring the timeline and
        the session together (a rollback that landed, steps applied without an answer,
        steps a snapshot/none session lost and the client sends again)."""
        pending, t.pending_rollback = t.pending_rollback, None
        for _ in range(3):
            if self.s.stop.is_set() or t.lost:
                return
            op = self.s.history.invoke(
                self.name, t.sid, "get", expect=t.step, floor=t.floor, durability=t.durability,
                after_error=True, pending_rollback=pending,
            )  # fmt: skip
            try:
                info = await self.call(op, self.c.get_session(t.sid))
            except (DataLoss, NotFound) as exc:
                t.lost = f"{type(exc).__name__}: {exc}"
                return
            except (SsmserveClientError, Hung):
                continue
            History.ok(op, self.s.worker(self.c, t.sid), info.step)
            at = info.step
            if pending is not None and at == pending:
                t.cut(at)
            elif at > t.step and all(s in t.inputs for s in range(t.step + 1, at + 1)):
                for s in range(t.step + 1, at + 1):  # applied, never answered to us
                    t.acknowledge(s, t.inputs[s], None)
            elif at < t.step and t.durability != "log":
                values = [t.inputs[s] for s in range(at + 1, t.step + 1) if s in t.inputs]
                if len(values) == t.step - at:
                    try:
                        await self.stream(t, values, first=at + 1)
                    except (SsmserveClientError, Hung, SessionRewound):
                        continue
            return


class Operator:
    """Migrates random sessions to random workers and drains a worker now and then
    (undraining it soon after), as an operator or a rebalancer would."""

    def __init__(self, shared: Shared) -> None:
        self.s = shared
        self.rng = random.Random(f"{shared.seed}/operator")

    async def run(self) -> None:
        async with AsyncClient(self.s.topo.addresses, retry=POLICY) as client:
            while not self.s.stop.wait(0):
                await asyncio.sleep(self.rng.uniform(0.5, 2.0))
                live = [t for t in self.s.timelines.values() if not t.lost and not t.closed]
                if not live:
                    continue
                if self.rng.random() < 0.85:
                    await self.migrate(client, self.rng.choice(live).sid)
                else:
                    await self.drain(client)

    async def migrate(self, client: AsyncClient, sid: str) -> None:
        target = self.rng.choice(self.s.topo.addresses)
        op = self.s.history.invoke("operator", sid, "migrate", to=self.s.topo.name_of(target))
        try:
            reply = await bounded(client.migrate(sid, target))
        except (SsmserveClientError, Hung) as exc:
            History.fail(op, exc)
            return
        History.ok(op, self.s.topo.name_of(reply.target), int(reply.step))

    async def drain(self, client: AsyncClient) -> None:
        target = self.rng.choice(self.s.topo.addresses)
        name = self.s.topo.name_of(target)
        op = self.s.history.invoke("operator", "", "drain", worker=name)
        moved = 0
        try:

            async def all_of() -> None:
                nonlocal moved
                async for _ in client.drain(target):
                    moved += 1

            await bounded(all_of())
            History.ok(op, name)
            op.args["moved"] = moved
        except (SsmserveClientError, Hung) as exc:
            History.fail(op, exc)
        await asyncio.sleep(self.rng.uniform(0.5, 3.0))
        op = self.s.history.invoke("operator", "", "undrain", worker=name)
        for _ in range(10):  # a drained worker left drained would starve the run
            try:
                await bounded(client.undrain(target))
                History.ok(op, name)
                return
            except (SsmserveClientError, Hung) as exc:
                error: BaseException = exc
                await asyncio.sleep(1.0)
        History.fail(op, error)


class Observer:
    """Asks one random worker (no other address known) for a forecast of a random
    session: a worker that does not own it redirects or, if the owner looks gone, takes
    the session over. Its answers take part in the ownership check."""

    def __init__(self, shared: Shared) -> None:
        self.s = shared
        self.rng = random.Random(f"{shared.seed}/observer")

    async def run(self) -> None:
        while not self.s.stop.wait(0):
            await asyncio.sleep(self.rng.uniform(0.2, 0.8))
            live = [t for t in self.s.timelines.values() if not t.lost and not t.closed]
            if not live:
                continue
            sid = self.rng.choice(live).sid
            address = self.rng.choice(self.s.topo.addresses)
            policy = RetryPolicy(
                give_up_after_s=3.0, call_timeout_s=3.0, keepalive_time_s=0.5,
                keepalive_timeout_s=0.5, connect_timeout_s=2.0,
            )  # fmt: skip
            op = self.s.history.invoke(
                "observer", sid, "forecast", asked=self.s.topo.name_of(address)
            )
            async with AsyncClient([address], retry=policy, discover=False) as client:
                try:
                    f = await bounded(client.forecast(sid, 1), 30.0)
                except (SsmserveClientError, Hung) as exc:
                    History.fail(op, exc)
                    continue
                History.ok(op, self.s.worker(client, sid), f.from_step, out_digest(f.outputs))


def run_clients(shared: Shared, clients: list[Any]) -> threading.Thread:
    """Every client's loop on one asyncio loop, in a thread; it ends when ``shared.stop``
    is set and every request under way has an outcome."""

    async def main() -> None:
        results = await asyncio.gather(*(c.run() for c in clients), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                shared.history.note(f"a client loop ended with {type(r).__name__}: {r}")

    thread = threading.Thread(target=lambda: asyncio.run(main()), name="clients", daemon=True)
    thread.start()
    return thread
