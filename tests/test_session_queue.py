"""The order of work inside a resident session (``Session``): steps and control operations
through one queue; a session leaving memory answers everything that waits in it."""

from __future__ import annotations

import asyncio

import numpy as np

from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.errors import ErrorKind, SsmserveError
from ssmserve.server.sessions.config import SessionConfig
from ssmserve.server.sessions.locks_while_used import LocksWhileUsed
from ssmserve.server.sessions.session import Session, StepRun
from ssmserve.server.state.input_log import RecentSteps
from ssmserve.server.state.lease import SessionLease


class _Moved(SsmserveError):
    kind = ErrorKind.UNAVAILABLE


def test_a_control_operation_queued_behind_steps_is_answered_when_the_session_leaves(
    demo_model: MambaModel,
) -> None:
    """Found by a full run on a loaded machine: a Migrate waited behind steps the stepper
    had not taken yet, the lease was lost, the session left memory, and the Migrate's gate
    never opened (it hung until the client's deadline). Now it gets the session's error."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        s = Session(
            "s1", demo_model, "demo", SessionConfig(), demo_model.new_state(), 0, 0.0,
            RecentSteps(4, 4), SessionLease("s1", "x.1", "w1"), lambda _s: None,
        )  # fmt: skip
        value = np.zeros(demo_model.config.input_dim, np.float32)
        future = loop.create_future()
        s.queue.append(
            StepRun.one(s.id, 1, value, value.tobytes(), future)
        )  # queued, not yet taken by a stepper: the session is not busy

        async def control() -> None:
            async with s.exclusive():
                raise AssertionError("must not get the session once it left")

        waiter = asyncio.create_task(control())
        await asyncio.sleep(0)  # its gate is in the queue, behind the step
        assert not waiter.done() and not s.busy
        s.fail_queued(_Moved("moved to worker B"))
        try:
            await asyncio.wait_for(waiter, 5)  # a bound on the guarantee, not a guess
        except _Moved:
            pass
        else:
            raise AssertionError("the control operation should have failed")
        assert future.result().error is not None
        assert not s.queue and not s.busy

    asyncio.run(scenario())


def test_a_stream_cancelled_while_its_session_loads_does_not_fail_the_other_streams(
    start_worker, served_models
) -> None:
    """Found by the soak (a black-holed Redis, then two streams on a reloading session): the
    first stream's reader ran the load itself, so cancelling that stream cancelled the load
    under a second stream waiting for it. The second stream's handler then raised a
    CancelledError that was not its own, gRPC sent its client no status, and the client
    waited for its stall timer. Now the load is a task of its own."""
    import threading
    import time

    import grpc

    from ssmserve.client.aio import step_input
    from ssmserve.v1 import ssmserve_pb2 as pb
    from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc
    from tests.conftest import random_inputs

    w = start_worker()
    x = random_inputs(served_models["demo"], 4, seed=3)
    sid = w.client.create_session("demo").session_id
    list(w.client.stream_steps(sid, list(x[:3]), first_step=1))
    w.call(w.loader.park(sid, "test"))  # out of memory: the next step loads it
    store = w.store
    gate = w.call(_make_event())
    load_started = threading.Event()
    real_meta_to_load = store.meta_to_load

    async def held_meta_to_load(session_id: str):  # the load waits until the test lets it go
        if session_id == sid:
            load_started.set()
            await gate.wait()
        return await real_meta_to_load(session_id)

    store.meta_to_load = held_meta_to_load
    request = pb.StreamRequest(steps=[step_input(sid, 4, x[3])])
    keep_open = threading.Event()

    def requests():
        yield request
        keep_open.wait(30)

    def loading() -> bool:
        return load_started.is_set()

    with grpc.insecure_channel(w.address) as channel:
        stub = pb_grpc.SessionServiceStub(channel)
        first = stub.Stream(requests())
        _wait(loading, "the first stream's load to start")
        second = stub.Stream(requests(), timeout=20)
        _wait(lambda: w.worker.service.open_streams == 2, "the second stream to wait for it")
        time.sleep(0.2)  # its reader is waiting for the same load now (no bound needed)
        first.cancel()
        _wait(lambda: w.worker.service.open_streams == 1, "the first stream to end")
        w.loop.call_soon_threadsafe(gate.set)
        response = next(second)  # before the fix: no answer, DEADLINE_EXCEEDED after 20 s
        keep_open.set()
    (result,) = response.results
    assert result.step == 4 and not result.HasField("error")


async def _make_event() -> asyncio.Event:
    return asyncio.Event()


def _wait(condition, what: str, timeout_s: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_the_session_queue_behaves_as_a_deque_under_random_operations() -> None:
    """``SessionQueue`` (a list read from an index, compacted as it goes) against
    ``collections.deque`` over random appends, pops, front pushes, removals and step
    drains: the same entries in the same order after every operation."""
    from collections import deque

    from ssmserve.server.sessions.session import SessionQueue, _Gate

    rng = np.random.default_rng(19)
    value = np.zeros(4, np.float32)
    for _round in range(20):
        queue, model = SessionQueue(), deque[object]()
        for _op in range(300):
            op = rng.integers(6)
            if op <= 1:  # append a step or a gate
                entry: object = (
                    StepRun.one("s", int(rng.integers(100)), value, b"", None)  # type: ignore[arg-type]
                    if op == 0
                    else _Gate(None)  # type: ignore[arg-type]
                )
                queue.append(entry)  # type: ignore[arg-type]
                model.append(entry)
            elif op == 2 and model:
                assert queue.popleft() is model.popleft()
            elif op == 3:
                jobs = [StepRun.one("s", i, value, b"", None) for i in range(int(rng.integers(4)))]  # type: ignore[arg-type]
                queue.push_front(jobs)
                model.extendleft(reversed(jobs))
            elif op == 4 and model:
                entry = model[int(rng.integers(len(model)))]
                queue.remove(entry)  # type: ignore[arg-type]
                model.remove(entry)
            elif op == 5 and rng.random() < 0.1:
                steps = queue.take_steps()
                assert steps == [e for e in model if not isinstance(e, _Gate)]
                model = deque(e for e in model if isinstance(e, _Gate))
            assert list(queue) == list(model) and len(queue) == len(model)
            # What was taken out is not kept alive by the queue (an idle session's queue
            # would otherwise hold answered steps and their outputs).
            held = [e for e in queue._items if e is not None]
            assert len(held) == len(model) and all(any(e is m for m in model) for e in held)
            assert bool(queue) == bool(model)
            if model:
                assert queue[0] is model[0]
        while model:
            assert queue.popleft() is model.popleft()
        assert not queue


def test_a_lock_while_used_serialises_per_key_in_order_and_lives_only_while_used() -> None:
    """``LocksWhileUsed`` (a session's lease check and log flush): one holder per key, in
    arrival order, other keys not held up; the entry goes when the last user leaves,
    also when that user was cancelled while waiting."""

    async def scenario() -> None:
        locks = LocksWhileUsed()
        order: list[str] = []
        release_a = asyncio.Event()

        async def user(key: str, name: str, until: asyncio.Event | None = None) -> None:
            async with locks.hold(key):
                order.append(f"{name} in")
                if until is not None:
                    await until.wait()
                order.append(f"{name} out")

        first = asyncio.create_task(user("s1", "a", release_a))
        await asyncio.sleep(0)
        second = asyncio.create_task(user("s1", "b"))
        cancelled = asyncio.create_task(user("s1", "c"))
        other = asyncio.create_task(user("s2", "d"))
        await other  # another key does not wait for s1's holder
        assert order == ["a in", "d in", "d out"]
        assert len(locks) == 1  # s1's entry; s2's went with its only user
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        release_a.set()
        await asyncio.gather(first, second)
        assert order == ["a in", "d in", "d out", "a out", "b in", "b out"]
        assert len(locks) == 0

        # The last user cancelled while waiting takes the entry away too.
        hold = asyncio.Event()
        holder = asyncio.create_task(user("s3", "e", hold))
        await asyncio.sleep(0)
        waiter = asyncio.create_task(user("s3", "f"))
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        hold.set()
        await holder
        assert len(locks) == 0 and "f in" not in order

    asyncio.run(asyncio.wait_for(scenario(), 10))
