"""``ssmserve-server --workers N``: N worker processes on one machine, one supervisor.

One worker process steps its sessions on one core for Python's part of the work; N
workers use N cores, as ``uvicorn --workers`` / gunicorn users expect. The supervisor
process owns what the workers share, so no worker's life decides another's:

* **One store.** Without ``--redis-url`` the supervisor locks the data directory
  (``data_dir_lock``), runs the embedded redis-server there and keeps it running
  (``embedded_redis_keeper``); the workers join it as an external Redis (its URL, with
  the password, reaches them through their environment, never a command line). A
  worker's drain or death never stops the Redis the others use.
* **Addresses.** Worker i listens on PORT+i of ``--listen`` and advertises PORT+i of
  ``--advertise`` when one is given (port 0: N free ports picked at start, kept across
  restarts). With ``--metrics-listen HOST:M`` the supervisor serves its own counters at
  M (Redis and worker restarts) and worker i at M+1+i.
* **Restarts.** A worker that dies is started again on its port with the same flags
  (``restart_backoff``: 0.1 s, doubling to 10 s while it keeps dying); its sessions are
  served again by it or, once their leases run out, by the others.
* **Stop.** SIGTERM or SIGINT drains every worker at once (each moves its sessions to a
  worker still serving, or parks them in Redis), waits for them (``stop_timeout_s``,
  then SIGKILL), then stops Redis (its AOF flushed) and frees the data directory. SIGHUP
  is passed on (the workers read their token files again).

Workers run in their own session (a Ctrl-C reaches the supervisor only, which drains them
in order) and, on Linux, get SIGTERM if the supervisor dies (``parent_death``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ssmserve.server.data_dir_lock import DataDirLock, DataDirLockSettings
from ssmserve.server.embedded_redis import EmbeddedRedis, EmbeddedRedisSettings, free_port
from ssmserve.server.embedded_redis_keeper import EmbeddedRedisKeeper, KeeperSettings
from ssmserve.server.errors import ErrorKind, SsmserveError
from ssmserve.server.observability.http import MetricsEndpoint
from ssmserve.server.observability.metrics import SupervisorMetrics
from ssmserve.server.parent_death import terminate_with_parent
from ssmserve.server.restart_backoff import BackoffSettings, RestartBackoff

log = logging.getLogger(__name__)

READY_LINE = "ssmserve-server listening on "
MAX_WORKERS = 64


class SupervisorError(SsmserveError):
    kind = ErrorKind.FAILED_PRECONDITION


@dataclass(frozen=True)
class SupervisorSettings:
    workers: int
    listen: str  # HOST:PORT of worker 0; worker i gets PORT+i
    data_dir: Path
    # The flags every worker gets, as the supervisor got them; the supervisor appends
    # each worker's own --listen, --advertise and --metrics-listen (the last one wins).
    worker_args: tuple[str, ...]
    redis_url: str | None = None  # None: the supervisor runs the embedded Redis
    advertise: str = ""  # HOST:PORT of worker 0; worker i advertises PORT+i
    metrics_listen: str = ""  # HOST:PORT of the supervisor's /metrics; workers after it
    ready_timeout_s: float = 600.0  # a worker loads its models and compiles its kernels
    stop_timeout_s: float = 120.0  # for every worker's drain, then SIGKILL
    backoff: BackoffSettings = field(default_factory=BackoffSettings)
    embedded_redis: KeeperSettings = field(default_factory=KeeperSettings)


@dataclass
class WorkerSlot:
    index: int
    listen: str
    advertise: str
    metrics_listen: str
    backoff: RestartBackoff
    process: asyncio.subprocess.Process | None = None
    ready: asyncio.Future[str] | None = None  # the address it printed when ready
    restarts: int = 0


def split_address(address: str, flag: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise SupervisorError(f"{flag} {address!r}: expected HOST:PORT")
    return host, int(port)


def worker_addresses(base: str, count: int, flag: str, pick_free: bool) -> list[str]:
    """HOST:PORT+i for i < count; port 0 gives N free ports (``pick_free``) or N zeros."""
    host, port = split_address(base, flag)
    if port == 0:
        if not pick_free:
            return [f"{host}:0"] * count
        return [f"{host}:{free_port(host.strip('[]'))}" for _ in range(count)]
    if port + count - 1 > 65535:
        raise SupervisorError(f"{flag} {base}: {count} workers need ports up to {port + count - 1}")
    return [f"{host}:{port + i}" for i in range(count)]


class Supervisor:
    def __init__(self, settings: SupervisorSettings) -> None:
        s = self.settings = settings
        if not 2 <= s.workers <= MAX_WORKERS:
            raise SupervisorError(f"--workers must be 1..{MAX_WORKERS}")
        listens = worker_addresses(s.listen, s.workers, "--listen", pick_free=True)
        advertised = (
            worker_addresses(s.advertise, s.workers, "--advertise", pick_free=False)
            if s.advertise
            else [""] * s.workers
        )
        metrics = [""] * s.workers
        self.metrics_listen = ""
        if s.metrics_listen:
            host, port = split_address(s.metrics_listen, "--metrics-listen")
            self.metrics_listen = s.metrics_listen
            metrics = [f"{host}:{port + 1 + i if port else 0}" for i in range(s.workers)]
        self.slots = [
            WorkerSlot(i, listens[i], advertised[i], metrics[i], RestartBackoff(s.backoff))
            for i in range(s.workers)
        ]
        self.metrics = SupervisorMetrics()
        self.metrics_endpoint: MetricsEndpoint | None = None
        self.metrics_address = ""
        self.lock: DataDirLock | None = None
        self.redis: EmbeddedRedis | None = None
        self.keeper: EmbeddedRedisKeeper | None = None
        self.stopping = False
        self._redis_url = s.redis_url
        self._watchers: list[asyncio.Task[None]] = []
        self._readers: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ start

    async def start(self) -> list[str]:
        """Start Redis (if embedded) and every worker; the workers' addresses once all
        are ready. A worker that is not ready stops everything with its reason."""
        if self._redis_url is None:
            self._redis_url = await self._start_embedded_redis()
        if self.metrics_listen:
            self.metrics_endpoint = MetricsEndpoint(self.metrics_listen, self.metrics.registry)
            self.metrics_address = self.metrics_endpoint.start()
            log.info("supervisor metrics on http://%s/metrics", self.metrics_address)
        for slot in self.slots:
            await self._spawn(slot)
        addresses: list[str] = []
        for slot in self.slots:
            address = await self._until_ready(slot)
            if address is None:
                raise SupervisorError(
                    f"worker {slot.index} ({slot.listen}) did not start "
                    f"({self._how_it_ended(slot)}); its error is in the log above"
                )
            addresses.append(address)
        self._watchers = [
            asyncio.create_task(self._keep(slot), name=f"worker-{slot.index}")
            for slot in self.slots
        ]
        return addresses

    async def _start_embedded_redis(self) -> str:
        s = self.settings
        lock_settings = DataDirLockSettings(data_dir=s.data_dir)
        self.lock = await asyncio.to_thread(DataDirLock(lock_settings).acquire)
        redis = EmbeddedRedis(EmbeddedRedisSettings(data_dir=s.data_dir / "redis"), self.lock.fd)
        self.redis = redis.start()  # from the loop thread: see parent_death
        self.lock.note(redis=redis.pid)

        def restarted() -> None:
            self.metrics.embedded_redis_restarts.inc()
            if self.lock is not None:
                self.lock.note(redis=redis.pid)

        self.keeper = EmbeddedRedisKeeper(redis, s.embedded_redis, restarted)
        self.keeper.start()
        log.info(
            "embedded redis-server on %s:%d for %d workers (data in %s)",
            redis.settings.host, redis.port, s.workers, s.data_dir / "redis",
        )  # fmt: skip
        return redis.url

    def _argv(self, slot: WorkerSlot) -> list[str]:
        argv = [sys.executable, "-m", "ssmserve.server.main", *self.settings.worker_args]
        argv += ["--workers", "1", "--listen", slot.listen]
        if slot.advertise:
            argv += ["--advertise", slot.advertise]
        if slot.metrics_listen:
            argv += ["--metrics-listen", slot.metrics_listen]
        return argv

    async def _spawn(self, slot: WorkerSlot) -> None:
        env = dict(os.environ)
        if self.settings.redis_url is None:  # the embedded one: its URL holds the password
            assert self._redis_url is not None
            env["SSMSERVE_REDIS_URL"] = self._redis_url
        slot.process = await asyncio.create_subprocess_exec(
            *self._argv(slot),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
            preexec_fn=terminate_with_parent(),
        )
        slot.backoff.started()
        slot.ready = asyncio.get_running_loop().create_future()
        reader = asyncio.create_task(self._read(slot, slot.process, slot.ready))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)

    async def _read(
        self, slot: WorkerSlot, process: asyncio.subprocess.Process, ready: asyncio.Future[str]
    ) -> None:
        """A worker's stdout: its ready line resolves ``ready``; the rest is passed on."""
        assert process.stdout is not None
        while line := (await process.stdout.readline()).decode(errors="replace"):
            if line.startswith(READY_LINE) and not ready.done():
                ready.set_result(line.removeprefix(READY_LINE).strip())
            else:
                sys.stdout.write(line)
                sys.stdout.flush()
        if not ready.done():
            ready.set_result("")

    async def _until_ready(self, slot: WorkerSlot) -> str | None:
        """The worker's address once it is ready; None if it ended or took too long."""
        assert slot.ready is not None and slot.process is not None
        try:
            async with asyncio.timeout(self.settings.ready_timeout_s):
                address = await asyncio.shield(slot.ready)
        except TimeoutError:
            log.error("worker %d (%s) was not ready in time", slot.index, slot.listen)
            address = ""
        if not address:
            await _end(slot.process, 0.0)
            return None
        return address

    # ------------------------------------------------------------------ restarts

    async def _keep(self, slot: WorkerSlot) -> None:
        """Start the worker again whenever it dies (until the supervisor stops)."""
        while True:
            assert slot.process is not None
            await slot.process.wait()
            if self.stopping:
                return
            delay = slot.backoff.delay()
            log.error(
                "worker %d (%s) died (%s); starting it again in %.1f s",
                slot.index, slot.listen, self._how_it_ended(slot), delay,
            )  # fmt: skip
            await asyncio.sleep(delay)
            if self.stopping:
                return
            await self._spawn(slot)
            if await self._until_ready(slot) is None:
                continue  # the next round backs off longer
            slot.restarts += 1
            self.metrics.worker_restarts.inc()
            log.warning(
                "worker %d runs again on %s (restart %d)", slot.index, slot.listen, slot.restarts
            )

    @staticmethod
    def _how_it_ended(slot: WorkerSlot) -> str:
        code = slot.process.returncode if slot.process else None
        if code is None:
            return "still running"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    # ------------------------------------------------------------------ signals, stop

    def signal_workers(self, sig: signal.Signals) -> None:
        for slot in self.slots:
            if slot.process is not None and slot.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.process.send_signal(sig)

    async def stop(self) -> None:
        """Drain every worker at once, then stop Redis and free the data directory."""
        self.stopping = True
        for watcher in self._watchers:
            watcher.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        self._watchers = []
        running = [s.process for s in self.slots if s.process is not None]
        await asyncio.gather(*(_end(p, self.settings.stop_timeout_s) for p in running))
        await asyncio.gather(*self._readers, return_exceptions=True)
        if self.keeper is not None:
            await self.keeper.stop()
        if self.redis is not None:
            await asyncio.to_thread(self.redis.stop)
        if self.lock is not None:
            self.lock.release()
        if self.metrics_endpoint is not None:
            await asyncio.to_thread(self.metrics_endpoint.stop)


async def _end(process: asyncio.subprocess.Process, grace_s: float) -> None:
    """SIGTERM (a worker drains), SIGKILL after ``grace_s``; returns once it has ended."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
        try:
            async with asyncio.timeout(grace_s or None):
                await process.wait()
        except TimeoutError:
            log.error("a worker (pid %d) did not stop in %.0f s: killed", process.pid, grace_s)
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()


async def supervise(settings: SupervisorSettings) -> None:
    """Run until SIGTERM or SIGINT; print each worker's ready line once all are ready."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    supervisor = Supervisor(settings)
    loop.add_signal_handler(signal.SIGHUP, supervisor.signal_workers, signal.SIGHUP)
    starting = asyncio.create_task(supervisor.start())
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait((starting, stopped), return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # SIGTERM while the workers start: stop them all
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            log.info("stopped while starting")
            return
        addresses = starting.result()
        for address in addresses:
            print(f"{READY_LINE}{address}", flush=True)
        log.info("%d workers ready: %s", len(addresses), ", ".join(addresses))
        await stop.wait()
        log.info("shutting down: draining %d workers", len(addresses))
    finally:
        stopped.cancel()
        await supervisor.stop()
