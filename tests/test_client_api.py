"""The Python client explains itself: real methods that ``help()`` and IDEs see, each
with a docstring, the same on Client and AsyncClient; and a session is taken as its id
or as the SessionInfo ``create_session`` returned, wherever a session is meant."""

from __future__ import annotations

import asyncio
import inspect
import pydoc
import threading
import time

import numpy as np
import pytest

from ssmserve.client import AsyncClient, Client
from tests.conftest import random_inputs


def public_methods(cls: type) -> dict[str, object]:
    return {
        name: member
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))
    }


# AsyncClient's raw bidirectional stream lives on its event loop: no blocking twin.
ASYNC_ONLY = {"open_stream"}


def test_client_and_async_client_have_the_same_documented_methods():
    sync, aio = public_methods(Client), public_methods(AsyncClient)
    assert set(aio) - ASYNC_ONLY == set(sync)
    for name, method in sync.items():
        twin = aio[name]
        doc = inspect.getdoc(method)
        assert doc and len(doc) > 40, f"Client.{name} has no docstring worth the name"
        assert doc == inspect.getdoc(twin), f"Client.{name} and AsyncClient.{name} differ"
        if isinstance(method, property):
            continue
        params = list(inspect.signature(method).parameters.values())
        twin_params = list(inspect.signature(twin).parameters.values())
        assert [(p.name, p.kind, p.default) for p in params] == [
            (p.name, p.kind, p.default) for p in twin_params
        ], name
    assert inspect.getdoc(AsyncClient.open_stream)


def test_help_shows_every_method_with_what_it_takes_returns_and_raises():
    text = pydoc.render_doc(Client, renderer=pydoc.plaintext)
    for name, method in public_methods(Client).items():
        assert f"{name}(" in text or (isinstance(method, property) and name in text), name
        first_line = (inspect.getdoc(method) or "").splitlines()[0]
        assert first_line in text, name
    # what a call raises beyond its own errors is said once, on the class
    assert "ServerUnreachable" in text and "Raises NotFound" in text


def test_a_session_is_its_id_or_its_session_info_everywhere(worker, served_models):
    model = served_models["demo"]
    x = random_inputs(model, 8, seed=30)
    client = worker.client
    info = client.create_session("demo", snapshot_every=4)
    assert client.get_session(info).session_id == info.session_id
    outs = [o.output for o in client.stream_steps(info, list(x[:6]))]
    assert client.step(info, x[6]).step == 7
    snap = client.snapshot(info, label="here")
    assert snap.snapshot_id in {s.snapshot_id for s in client.list_snapshots(info)}
    assert client.rollback(info, to_step=6).step == 6
    assert client.forecast(info, 2).from_step == 6
    history = client.history(info)
    np.testing.assert_array_equal(history.outputs[:6], np.stack(outs))
    assert client.fork(info, at_step=3).session.step == 3
    assert client.export_checkpoint(info)
    assert client.owner_of(info) == worker.address
    assert client.upgrade(info).session.session_id == info.session_id
    assert client.close_session(info).step == 6

    async def with_async_client() -> None:
        async with AsyncClient(worker.address) as aio:
            info = await aio.create_session("demo")
            assert (await aio.get_session(info)).step == 0
            assert [o.step async for o in aio.stream_steps(info, list(x[:2]))] == [1, 2]
            assert (await aio.rollback(info, back=1)).step == 1

    asyncio.run(with_async_client())

    with pytest.raises(
        TypeError, match="expected a session id \\(str\\) or a SessionInfo, got int"
    ):
        client.get_session(7)  # type: ignore[arg-type]


@pytest.mark.slow
def test_only_a_first_connection_fails_fast(model_dirs, redis_url, tmp_path):
    """The rule (``retry``): a client no worker ever answered says ServerUnreachable
    within seconds; one that was answered waits for its worker to come back, as a
    cluster's client must (a restart, a failover)."""
    from ssmserve.client import ServerUnreachable
    from ssmserve.client.retry import RetryPolicy
    from tests.worker_process import WorkerProcess

    worker = WorkerProcess({"demo": model_dirs["demo"]}, redis_url, tmp_path / "w").start()
    outage_s = 2 * RetryPolicy().connect_timeout_s  # longer than a first connection waits
    restart = threading.Timer(outage_s, worker.start)  # on the same port
    try:
        with Client(worker.address) as client:
            sid = client.create_session("demo").session_id
            worker.kill()
            down_at = time.monotonic()
            with Client(worker.address) as fresh, pytest.raises(ServerUnreachable):
                fresh.list_sessions()
            assert time.monotonic() - down_at < 10.0
            restart.start()
            asked_at = time.monotonic()
            assert client.get_session(sid).step == 0  # waited for it
            assert time.monotonic() - asked_at > outage_s
    finally:
        restart.join(60)
        worker.kill()


def test_closing_a_client_ends_every_task_left_on_its_loop():
    """A task still pending when the loop closes makes Python print "Task was destroyed
    but it is pending!" at exit, after the CLI's last line (its advice after Ctrl-C). gRPC
    can leave one per call a turn from its end; close() ends whatever is left."""
    client = Client("127.0.0.1:1")  # connects lazily: no worker needed
    # A stand-in for gRPC's status task: pending until cancelled. The loop is private;
    # this reaches it as gRPC does, by creating a task on it.
    left = asyncio.run_coroutine_threadsafe(_make_pending_task(), client._loop).result(5)
    client.close()
    assert left.done() and left.cancelled()


async def _make_pending_task() -> asyncio.Task[None]:
    return asyncio.get_running_loop().create_task(asyncio.Event().wait())
