"""Two workers on one address, and one worker restarted on its own (issue 49, items 2, 3).

Clients and workers reach a session's owner by its advertised address, so a worker that
advertises the address of another live one (or listens on it) is refused at start, in
whichever order the two start; a worker restarted in place (the same address and data
directory, after ``kill -9``) takes its dead predecessor's sessions back at once, and one
that cannot prove its predecessor dead answers UNAVAILABLE ``TAKEOVER_PENDING`` with a
retry delay, never a redirect to its own address. Real worker processes on loopback."""

from __future__ import annotations

import time

import grpc
import pytest

from ssmserve.client.aio import step_input
from ssmserve.client.sync import Client
from ssmserve.server.embedded_redis import free_port
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc
from tests.conftest import random_inputs
from tests.worker_process import WorkerProcess


def worker_id_of(asked: str, advertised: str) -> str:
    """The id of the worker registered with address ``advertised``, asking ``asked``."""
    with grpc.insecure_channel(asked) as channel:
        reply = pb_grpc.ClusterServiceStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=10)
    (worker,) = [w for w in reply.workers if w.address == advertised]
    return worker.worker_id


def one_step(address: str, session_id: str, step: int, value: object) -> pb.StepResult:
    """One step sent on a stream of its own to ``address`` (no retries, no redirects
    followed): the worker's answer as it is."""
    request = pb.StreamRequest(steps=[step_input(session_id, step, value)])
    with grpc.insecure_channel(address) as channel:
        responses = pb_grpc.SessionServiceStub(channel).Stream(iter([request]), timeout=20)
        (result,) = next(responses).results
    return result


def test_a_worker_advertising_an_address_is_not_joined_by_one_listening_there(
    model_dirs, redis_url, tmp_path
):
    """B starts first, advertising A's address while it listens elsewhere; A, started on
    that address, is refused naming B (before: A took B's entry for its own dead
    predecessor, since it is of this host and the address A binds, and both served)."""
    a_port = free_port()
    a_address = f"127.0.0.1:{a_port}"
    models = {"demo": model_dirs["demo"]}
    b = WorkerProcess(models, redis_url, tmp_path / "b", extra_args=("--advertise", a_address))
    b.start()
    a = WorkerProcess(models, redis_url, tmp_path / "a", port=a_port)
    try:
        b_id = worker_id_of(b.address, a_address)  # B answers where it listens
        with pytest.raises(RuntimeError, match="did not start"):
            a.start()
        log = a.log_text()
        assert f"worker {b_id} already advertises {a_address} in this Redis" in log, log[-2000:]
        assert "Give each worker its own --advertise" in log
        assert b.alive
    finally:
        a.kill()
        b.kill()


def test_a_worker_is_refused_where_it_listens_on_an_address_a_live_worker_advertises(
    model_dirs, redis_url, tmp_path
):
    """A listens on X but advertises another address; B advertises X: clients sent to B
    at X would reach A. The later of the two to start is refused, naming the other."""
    x_port = free_port()
    x_address = f"127.0.0.1:{x_port}"
    models = {"demo": model_dirs["demo"]}
    b = WorkerProcess(models, redis_url, tmp_path / "b", extra_args=("--advertise", x_address))
    b.start()
    a = WorkerProcess(
        models, redis_url, tmp_path / "a", port=x_port,
        extra_args=("--advertise", f"127.0.0.1:{free_port()}"),
    )  # fmt: skip
    try:
        with pytest.raises(RuntimeError, match="did not start"):
            a.start()
        log = a.log_text()
        assert f"already advertises {x_address}, the address this worker listens on" in log, log[
            -2000:
        ]
        assert b.alive
    finally:
        a.kill()
        b.kill()


def test_a_worker_restarted_in_place_takes_its_sessions_back_at_once(
    model_dirs, served_models, tmp_path
):
    """kill -9, then the same port and data directory: the new worker holds the lock its
    predecessor held, which proves that one dead, so it starts at once and its
    predecessor's sessions are its own at the first request: answered, not redirected to
    its own address until the old lease's beat has stood a TTL (30 s here)."""
    x = random_inputs(served_models["demo"], 3, seed=49)
    worker = WorkerProcess({"demo": model_dirs["demo"]}, None, tmp_path / "data", lease_ttl_s=30)
    worker.start()
    try:
        with Client(worker.address, discover=False) as client:
            sid = client.create_session("demo").session_id
            client.step(sid, x[0], step=1)
            client.step(sid, x[1], step=2)
        worker.kill()
        started = time.monotonic()
        worker.start()
        assert time.monotonic() - started < 20  # no wait for the old registry entry (31 s)
        result = one_step(worker.address, sid, 3, x[2])
        assert not result.HasField("error"), result.error
        assert result.step == 3
        assert "taken over from worker" in worker.log_text()
    finally:
        worker.kill()


def test_a_worker_that_cannot_prove_its_predecessor_dead_never_redirects_to_itself(
    model_dirs, served_models, redis_url, tmp_path
):
    """Restarted on the same address with another data directory (a container that came
    back without its volume): nothing proves the old worker dead, so its sessions wait
    until their lease's beat has stood a TTL on this worker's clock. Meanwhile a request
    is answered UNAVAILABLE TAKEOVER_PENDING with the time left, never SESSION_MOVED
    naming this very worker; after that the session is served here."""
    x = random_inputs(served_models["demo"], 3, seed=50)
    models = {"demo": model_dirs["demo"]}
    port = free_port()
    first = WorkerProcess(models, redis_url, tmp_path / "one", lease_ttl_s=3, port=port)
    first.start()
    second = WorkerProcess(models, redis_url, tmp_path / "two", lease_ttl_s=3, port=port)
    try:
        with Client(first.address, discover=False) as client:
            sid = client.create_session("demo").session_id
            client.step(sid, x[0], step=1)
        first.kill()
        second.start()  # waits out the old registry entry: nothing proves it dead
        result = one_step(second.address, sid, 2, x[1])
        assert result.HasField("error")
        assert result.error.owner != second.address, result.error
        assert result.error.reason == "TAKEOVER_PENDING", result.error
        assert result.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert 0 < result.error.retry_after_ms <= 3000
        assert "takes the session over" in result.error.message
        time.sleep(result.error.retry_after_ms / 1000 + 0.2)
        result = one_step(second.address, sid, 2, x[1])
        assert not result.HasField("error"), result.error
        assert result.step == 2
    finally:
        first.kill()
        second.kill()
