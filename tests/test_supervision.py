"""Health follows the store; the embedded Redis and the workers of ``--workers N`` are
supervised: a dead one is started again, and what clients were told survives.

Real redis-server and worker processes on loopback; waits are polled with a bound."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ssmserve.client.sync import Client
from ssmserve.server.embedded_redis import EmbeddedRedis, EmbeddedRedisSettings, free_port
from ssmserve.server.readiness import ReadinessSettings
from ssmserve.server.worker import LIVENESS_SERVICE, SERVICE_NAME
from ssmserve.v1 import ssmserve_pb2 as pb
from tests.cluster_helpers import check_exact, moving_on, stream_in_background, wait_for
from tests.conftest import random_inputs
from tests.worker_process import WorkerProcess

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health_of(address: str, service: str = "") -> int:
    """The health status a probe gets (-1: no answer)."""
    with grpc.insecure_channel(address) as channel:
        try:
            request = health_pb2.HealthCheckRequest(service=service)
            return health_pb2_grpc.HealthStub(channel).Check(request, timeout=2).status
        except grpc.RpcError:
            return -1


def until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)


def test_health_is_not_serving_while_the_store_does_not_answer(
    start_worker, tmp_path: Path
) -> None:
    """Any Redis (here one the worker does not own): NOT_SERVING for "" and the
    SessionService while it is down, SERVING once it answers again; Liveness stays
    SERVING. A draining worker stays NOT_SERVING when its store comes back."""
    store = EmbeddedRedis(EmbeddedRedisSettings(data_dir=tmp_path / "redis")).start()
    try:
        w = start_worker(store.url, readiness=ReadinessSettings(check_every_s=0.05))
        readiness = w.worker.readiness

        def everything_is(status: int) -> bool:
            return all(health_of(w.address, s) == status for s in ("", SERVICE_NAME))

        assert everything_is(SERVING)
        store.kill()
        until(lambda: everything_is(NOT_SERVING), 10, "NOT_SERVING after Redis died")
        assert health_of(w.address, LIVENESS_SERVICE) == SERVING
        store.restart()
        until(lambda: everything_is(SERVING), 10, "SERVING once Redis answers")

        w.call(w.worker.drain())
        assert everything_is(NOT_SERVING)
        store.kill()
        until(lambda: not readiness.store_answers, 10, "the dead store seen")
        store.restart()
        until(lambda: readiness.store_answers, 10, "the store answering seen")
        checks = readiness.checks
        until(lambda: readiness.checks >= checks + 3, 10, "three more checks")
        assert everything_is(NOT_SERVING)  # draining wins
        w.call(w.worker.migrator.undrain())
        assert everything_is(SERVING)
        w.stop()  # while its store runs: a drain needs it
    finally:
        store.stop()


def redis_pid_in(data_dir: Path) -> int | None:
    """The redis-server working in ``data_dir`` (it chdirs into its --dir)."""
    want = data_dir.resolve()
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            if cwd.resolve(strict=True) == want:
                return int(cwd.parent.name)
        except OSError:
            continue
    return None


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else float("nan")


@pytest.mark.slow
def test_a_killed_embedded_redis_is_restarted_and_no_answered_step_is_lost(
    model_dirs, served_models, tmp_path
):
    """kill -9 of a running worker's embedded redis-server, mid-stream: the worker starts
    it again (same port, same password, from its AOF), health comes back to SERVING, and
    the `log` session goes on from exactly the step its client was told, bit-exact."""
    model = served_models["demo"]
    data = tmp_path / "data"
    metrics_port = free_port()
    worker = WorkerProcess(
        {"demo": model_dirs["demo"]}, None, data,
        extra_args=("--metrics-listen", f"127.0.0.1:{metrics_port}"),
    ).start()  # fmt: skip
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    stop = threading.Event()
    try:
        with Client(worker.address) as client:
            sid = client.create_session("demo", durability=pb.DURABILITY_LOG).session_id
        xs = [random_inputs(model, 20_000, seed=71)]
        thread, outs, errors = stream_in_background([worker.address], [sid], xs, stop)
        wait_for(lambda: len(outs[0]) >= 50, errors)
        killed = redis_pid_in(data / "redis")
        assert killed is not None
        seen: list[int] = []
        killed_at = time.monotonic()
        os.kill(killed, signal.SIGKILL)

        def serving_again() -> bool:
            status = health_of(worker.address)
            if not seen or seen[-1] != status:
                seen.append(status)
            return (
                status == SERVING
                and metric(metrics_url, "ssmserve_embedded_redis_restarts_total") == 1
            )

        until(serving_again, 30, "SERVING after the restart")
        recovered_s = time.monotonic() - killed_at
        restarted = redis_pid_in(data / "redis")
        assert restarted not in (None, killed)
        moving_on(outs, errors, more=100)
        stop.set()
        thread.join(60)
        assert not errors, errors
        with Client(worker.address) as client:
            check_exact(model, [sid], xs, outs, client)  # the session is where its client is
        log = worker.log_text()
        assert "the embedded redis-server runs again on port" in log
        print(f"health seen: {seen}; SERVING again {recovered_s:.2f} s after the kill")
    finally:
        stop.set()
        worker.kill()


def supervisor_ready(proc: subprocess.Popen[str], count: int, timeout_s: float) -> list[str]:
    assert proc.stdout is not None
    addresses: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(addresses) < count and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        if line.startswith("ssmserve-server listening on "):
            addresses.append(line.split()[-1])
    assert len(addresses) == count, f"supervisor did not start (exit code {proc.poll()})"
    return addresses


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
def test_workers_n_restarts_a_killed_worker_and_stops_cleanly(model_dirs, served_models, tmp_path):
    """``--workers 2``: two worker processes on one embedded Redis, sessions on both;
    kill -9 of one: the supervisor starts it again on its port and its sessions answer
    again; SIGTERM to the supervisor drains both, stops Redis and exits 0."""
    data = tmp_path / "data"
    x = random_inputs(served_models["demo"], 2, seed=72)
    log = (tmp_path / "supervisor.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ssmserve.server.main", "--workers", "2",
         "--listen", "127.0.0.1:0", "--data-dir", str(data), "--lease-ttl", "1",
         "--model", f"demo={model_dirs['demo']}"],
        stdout=subprocess.PIPE, stderr=log, text=True,
    )  # fmt: skip
    try:
        addresses = supervisor_ready(proc, 2, 60)
        assert len(set(addresses)) == 2
        sids = []
        for address in addresses:
            with Client(address, discover=False) as client:
                sid = client.create_session("demo").session_id
                client.step(sid, x[0], step=1)
                sids.append(sid)
        workers = [p for p in children_of(proc.pid) if redis_pid_in(data / "redis") != p]
        assert len(workers) == 2
        victim_address = addresses[0]
        victim = next(
            p for p in workers
            if f"--listen\x00{victim_address}" in Path(f"/proc/{p}/cmdline").read_text()
        )  # fmt: skip
        os.kill(victim, signal.SIGKILL)

        def restarted() -> bool:
            return "worker 0 runs again on" in (tmp_path / "supervisor.log").read_text()

        until(restarted, 30, "the killed worker started again")
        assert health_of(victim_address) == SERVING
        with Client(addresses) as client:
            for sid in sids:
                assert client.get_session(sid).step == 1
                assert client.step(sid, x[1], step=2).step == 2
        running = children_of(proc.pid)  # the two workers (one restarted) and Redis
        assert len(running) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert not [p for p in running if Path(f"/proc/{p}").exists()]
        assert redis_pid_in(data / "redis") is None
        assert any((data / "redis").glob("appendonly*"))
        assert "drained: 1 sessions moved or parked" in (tmp_path / "supervisor.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
