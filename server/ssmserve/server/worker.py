"""One worker process: models, the store, ownership, the session manager and gRPC.

:class:`Worker` starts them in order and stops them in reverse. Stopping is a drain:
health turns NOT_SERVING, every resident session is handed to another live worker (or,
with none left, snapshotted and released for later pickup) while the gRPC server still
answers, so open streams get redirects; then the server stops taking calls and gives
running ones ``shutdown_grace_s`` to finish, the worker leaves the registry, and the
embedded Redis, if any, is shut down (it flushes its AOF on SIGTERM). With ``--http`` the
OpenAI-compatible door (``http``) binds its port first thing (a port in use refuses the
start), serves once everything else does, and stops first (its requests in flight get
``shutdown_grace_s``, then the sessions it kept are closed), before the drain.

Readiness (``readiness``) also follows the store: NOT_SERVING while it does not answer.
A worker without ``--redis-url`` locks its data directory (``data_dir_lock``), runs a
private redis-server there and restarts it when it dies (``embedded_redis_keeper``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ssmserve.server.advertise_lock import AdvertiseLock, claim_address
from ssmserve.server.api.auth import (
    Authenticator,
    Authorization,
    TokenFile,
    load_cluster_secret,
    peer_metadata,
)
from ssmserve.server.api.cluster_service import ClusterService
from ssmserve.server.api.rpc_metrics import RpcMetrics
from ssmserve.server.api.service import ServiceSettings, SessionService
from ssmserve.server.api.serving_gate import ServingGate
from ssmserve.server.api.status import UndecodableRequests
from ssmserve.server.api.tls import ReloadingCertificates, TlsSettings
from ssmserve.server.cluster.ownership import Ownership, OwnershipSettings, new_worker_id
from ssmserve.server.cluster.peers import Peers, PeerSettings
from ssmserve.server.cluster.store_guard import StoreGuard
from ssmserve.server.data_dir_lock import DataDirLock, DataDirLockSettings
from ssmserve.server.embedded_redis import EmbeddedRedis, EmbeddedRedisSettings
from ssmserve.server.embedded_redis_keeper import EmbeddedRedisKeeper, KeeperSettings
from ssmserve.server.engine.interface import ENGINES, Engine
from ssmserve.server.engine.loader import load_model
from ssmserve.server.engine.numerics import (
    numerics_description,
    numerics_signature,
    pin_blas_threads,
)
from ssmserve.server.engine.quantize import QUANTIZATIONS
from ssmserve.server.engine.tokenizer import ModelTokenizer, load_tokenizer, read_eos_ids
from ssmserve.server.errors import ErrorKind, SsmserveError, clip
from ssmserve.server.http.listener import HttpSettings
from ssmserve.server.observability.http import MetricsEndpoint
from ssmserve.server.observability.metrics import Metrics, WorkerView
from ssmserve.server.observability.tracing import Tracing
from ssmserve.server.readiness import Readiness, ReadinessSettings
from ssmserve.server.sessions.manager import ManagerSettings, SessionManager
from ssmserve.server.sessions.memory import WorkerMemory, default_memory_budget
from ssmserve.server.sessions.migration import DrainProgress, MigrationSettings, Migrator
from ssmserve.server.sessions.models import KEY_PATTERN
from ssmserve.server.sessions.rebalance import Rebalancer, RebalanceSettings
from ssmserve.server.startup_checks import (
    bind_listener,
    refuse_later_twin,
)
from ssmserve.server.state.store import Store
from ssmserve.server.state.store_calls import StoreSettings
from ssmserve.server.state.store_errors import StoreUnavailableError
from ssmserve.server.state.store_records import WorkerStats
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from ssmserve.server.http.door import HttpDoor

log = logging.getLogger(__name__)
T = TypeVar("T")


class ModelTooLargeError(SsmserveError):
    """A model whose one answer cannot fit in a gRPC message of the configured size."""


class BadModelKeyError(SsmserveError):
    """A model key that is not NAME or NAME@VERSION (INVALID_ARGUMENT)."""


SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SessionService"].full_name
CLUSTER_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ClusterService"].full_name
#: A health "service" for liveness probes: SERVING from start to exit, draining included
#: (readiness probes ask for "", which turns NOT_SERVING while the worker drains; a
#: liveness probe on "" would kill a worker in the middle of its drain). An answer also
#: shows the event loop is turning: a frozen worker does not answer at all.
LIVENESS_SERVICE = "ssmserve.v1.Liveness"


@dataclass(frozen=True)
class WorkerSettings:
    """Everything a worker needs; ``ssmserve.server.main`` fills it from flags and environment."""

    models: tuple[tuple[str, Path], ...]  # (name, model directory) pairs
    listen: str = "127.0.0.1:50051"  # host:port; port 0 picks a free one
    redis_url: str | None = None  # None: start a private redis-server (embedded)
    data_dir: Path = Path("ssmserve-data")  # the embedded Redis keeps its AOF here
    advertise: str = ""  # address shown as a session's owner; default: the bound address
    key_prefix: str = "ssm"
    max_message_bytes: int = 4 << 20  # gRPC receive/send limit per message
    # gRPC keepalive: the server pings each client connection this long after it last
    # heard from it and closes it when no answer comes within the timeout, so the streams
    # of a client that vanished (crashed host, half-open connection) end within about
    # the sum. Clients may ping as often as they like (no "too many pings" strikes).
    keepalive_time_s: float = 5.0
    keepalive_timeout_s: float = 3.0
    redis_timeout_s: float = 2.0  # every Redis operation's deadline (StoreSettings)
    # Replicas that must hold each write (StoreSettings); None (auto): 1 where the store
    # has replicas, else 0.
    redis_wait_replicas: int | None = None
    startup_timeout_s: float = 30.0  # how long a starting worker waits for Redis
    shutdown_grace_s: float = 5.0
    blas_threads: int | None = None  # None: SSMSERVE_BLAS_THREADS or 2
    drain_on_stop: bool = True  # hand sessions to other workers on stop (else snapshot them)
    # After a drain moved sessions away, keep answering (with redirects) this long before
    # refusing calls: a client whose redirect was lost in flight, and that knows no other
    # worker, can still ask this one where its session went.
    lame_duck_s: float = 1.0
    manager: ManagerSettings = field(default_factory=ManagerSettings)
    service: ServiceSettings = field(default_factory=ServiceSettings)
    ownership: OwnershipSettings = field(default_factory=OwnershipSettings)
    migration: MigrationSettings = field(default_factory=MigrationSettings)
    rebalance: RebalanceSettings = field(default_factory=RebalanceSettings)
    peers: PeerSettings = field(default_factory=PeerSettings)
    tls: TlsSettings | None = None  # None: a plaintext listener (and plaintext peer channels)
    # Bearer tokens (TOML of sha256 hashes, tenants and roles; api/auth.py). None: no
    # authentication, which is allowed on a loopback address only, unless ``insecure``.
    auth_tokens: Path | None = None
    cluster_secret: Path | None = None  # shared by the workers; their calls to each other
    insecure: bool = False  # listen beyond loopback without tokens (a warning is logged)
    # host:port of the Prometheus endpoint (/metrics); "": none. Port 0 picks a free one.
    metrics_listen: str = ""
    # OTLP/gRPC endpoint for OpenTelemetry spans (pip install 'ssmserve[tracing]'); "": off.
    trace_otlp_endpoint: str = ""
    stored_count_every_s: float = 15.0  # how often ssmserve_sessions_stored is counted
    # Serve from a Redis whose maxmemory-policy lets it delete keys (a warning instead of
    # a refusal; ``cluster.store_guard``): acknowledged steps may then vanish.
    allow_evicting_redis: bool = False
    # The engine that steps every model of this worker (``engine.interface.ENGINES``): cpu
    # (numpy + numba, the default) or cuda (Triton kernels on a GPU, ``ssmserve[cuda]``).
    # Its numerics signature is the worker's, so sessions never replay across engines.
    engine: str = "cpu"
    # How the cpu engine holds the products' weights (``engine.quantize.QUANTIZATIONS``):
    # none (at the stored precision; BF16 stays 16-bit) or q8_0 (llama.cpp's 8-bit blocks).
    # Q8_0 models have fingerprints of their own, so sessions never replay across formats.
    quantize: str = "none"
    readiness: ReadinessSettings = field(default_factory=ReadinessSettings)
    embedded_redis: KeeperSettings = field(default_factory=KeeperSettings)
    # The OpenAI-compatible HTTP API (``--http``; ``http.listen`` "": none).
    http: HttpSettings = field(default_factory=HttpSettings)


def server_options(s: WorkerSettings) -> list[tuple[str, int]]:
    """gRPC server channel arguments: message limits and keepalive (both directions)."""
    return [
        ("grpc.max_receive_message_length", s.max_message_bytes),
        ("grpc.max_send_message_length", s.max_message_bytes),
        ("grpc.keepalive_time_ms", int(s.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(s.keepalive_timeout_s * 1000)),
        # Since grpc 1.60 an unanswered ping fails the connection after this (default 60 s,
        # which would override the keepalive timeout).
        ("grpc.http2.ping_timeout_ms", int(s.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 100),
        ("grpc.http2.max_ping_strikes", 0),
        # gRPC's default SO_REUSEPORT lets a second worker bind a taken port and take half
        # of its new connections; off, that bind fails (startup_checks says so).
        ("grpc.so_reuseport", 0),
    ]


class WorkerStoppingError(SsmserveError):
    kind = ErrorKind.FAILED_PRECONDITION


class ExposedWithoutAuthError(SsmserveError):
    """A listener beyond loopback with no authentication, and no --insecure."""


class EngineUnavailableError(SsmserveError):
    """``--engine cuda`` where its packages or a device are missing (refused at start)."""


def check_engine(s: WorkerSettings) -> None:
    """Refuse an engine this machine cannot run, before any model loads."""
    if s.quantize not in QUANTIZATIONS:
        raise EngineUnavailableError(
            f"--quantize {clip(s.quantize)}: expected one of {', '.join(QUANTIZATIONS)}"
        )
    if s.quantize != "none" and s.engine != "cpu":
        raise EngineUnavailableError(
            f"--quantize {s.quantize} runs on the cpu engine only; drop --engine {s.engine} "
            f"or --quantize"
        )
    if s.engine == "cpu":
        return
    if s.engine != "cuda":
        raise EngineUnavailableError(f"--engine {clip(s.engine)}: expected one of {ENGINES}")
    from ssmserve.server.engine.gpu.runtime import INSTALL_HINT, missing_packages

    if missing := missing_packages():
        raise EngineUnavailableError(
            f"--engine cuda needs {' and '.join(missing)}, not installed: {INSTALL_HINT}"
        )
    from ssmserve.server.engine.gpu.runtime import default_device

    try:
        default_device()
    except RuntimeError as exc:
        raise EngineUnavailableError(f"--engine cuda: {exc}") from None


def check_exposure(s: WorkerSettings) -> None:
    """Without tokens a worker serves loopback only (gRPC and --http), unless told
    ``insecure``."""
    for listen in (s.listen, s.http.listen):
        if listen:
            _check_exposed(listen, s)


def _check_exposed(listen: str, s: WorkerSettings) -> None:
    host = listen.rsplit(":", 1)[0].strip("[]")
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback or s.auth_tokens is not None:
        return
    if not s.insecure:
        raise ExposedWithoutAuthError(
            f"refusing to listen on {listen} without --auth-tokens: anyone who reaches it "
            f"could read, change or close every session; give --auth-tokens FILE, or "
            f"--insecure to serve it unauthenticated anyway"
        )
    log.warning(
        "listening on %s WITHOUT authentication (--insecure): every peer that reaches it "
        "can call every RPC",
        listen,
    )


class Worker:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.embedded: EmbeddedRedis | None = None
        self.data_dir_lock: DataDirLock | None = None
        self.advertise_lock: AdvertiseLock | None = None
        self.embedded_keeper: EmbeddedRedisKeeper | None = None
        self.store: Store | None = None
        self.guard: StoreGuard | None = None  # the store's eviction policy and identity
        self.manager: SessionManager | None = None
        self.memory = WorkerMemory(
            settings.manager.memory_budget_bytes or default_memory_budget()
        )  # the worker's one budget: sessions, forecasts, imports being decoded
        self.ownership: Ownership | None = None
        self.migrator: Migrator | None = None
        self.rebalancer: Rebalancer | None = None
        self.service: SessionService | None = None
        secret = load_cluster_secret(settings.cluster_secret)
        self.tokens = TokenFile(settings.auth_tokens) if settings.auth_tokens else None
        self.authenticator = Authenticator(self.tokens, secret)
        self.peers = Peers(
            settings.peers,
            settings.tls.peer_config() if settings.tls else None,
            peer_metadata(secret),
        )
        self.certificates: ReloadingCertificates | None = None
        self.stopping = False  # stop() began: no undrain
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.readiness: Readiness | None = None
        self.address = ""
        self.numerics = ""
        self.metrics = Metrics(enabled=bool(settings.metrics_listen))  # off: no-ops
        self.worker_id = new_worker_id()  # in the registry, the leases and the logs
        self.metrics.tracing = Tracing(settings.trace_otlp_endpoint, self.worker_id)
        self.peers.metrics = self.metrics
        self.metrics_endpoint: MetricsEndpoint | None = None
        self.metrics_address = ""  # host:port of /metrics once started
        self._stored_sessions: int | None = None
        self._counter: asyncio.Task[None] | None = None
        self.http_door: HttpDoor | None = None  # --http: the OpenAI-compatible API
        self.model_paths: dict[str, Path] = dict(settings.models)  # where a key's files are

    async def start(self) -> str:
        """Start everything; returns the address the server listens on (host:port)."""
        s = self.settings
        check_exposure(s)  # before anything starts: refuse, or warn
        check_engine(s)
        self.http_door = bound_http_door(s)  # a taken port refuses the start at once
        pin_blas_threads(s.blas_threads)
        models: dict[str, Engine] = {}
        tokenizers: dict[str, ModelTokenizer | None] = {}
        for name, directory in s.models:
            models[name], tokenizers[name] = await asyncio.to_thread(_load, directory, name, s)
            log.info("model %s loaded from %s (%s)", name, directory, models[name].fingerprint[:16])
        for name, model in models.items():
            check_fits(name, model, s.max_message_bytes)
        url = s.redis_url if s.redis_url is not None else await self._start_embedded_redis()
        self.store = Store(
            StoreSettings(
                url=url,
                key_prefix=s.key_prefix,
                socket_timeout_s=s.redis_timeout_s,
                wait_replicas=s.redis_wait_replicas,
                wait_timeout_ms=int(s.redis_timeout_s * 500),
            ),
            self.metrics,
        )
        await self._patiently("reach Redis", self.store.ping)
        replication = await self._patiently(
            "count the store's replicas", self.store.settle_replica_confirmation
        )
        log.log(
            logging.INFO
            if replication.replicas or not any(replication.found.values())
            else logging.WARNING,
            "store: %s", replication.describe(),
        )  # fmt: skip
        guard = self.guard = StoreGuard(self.store, s.allow_evicting_redis)
        await self._patiently("check the store's settings", guard.start)
        self.numerics = engine_numerics(s.engine, s.quantize)
        log.info("numerics %s: %s", numerics_signature(self.numerics), self.numerics)

        interceptors: list[grpc.aio.ServerInterceptor] = [
            ServingGate(lambda: guard.refusal),
            UndecodableRequests(),
        ]
        if self.tokens is not None:  # first: a refused call is never parsed
            interceptors.insert(0, Authorization(self.authenticator))
            self.tokens.start()
        interceptors.insert(0, RpcMetrics(self.metrics))  # outermost: refusals are timed too
        self.server = grpc.aio.server(options=server_options(s), interceptors=interceptors)
        if s.tls is not None:
            self.certificates = ReloadingCertificates(s.tls)
        credentials = self.certificates.credentials() if self.certificates else None
        port = bind_listener(self.server, s.listen, credentials)
        host = s.listen.rsplit(":", 1)[0]
        self.address = f"{host}:{port}"
        self.ownership = Ownership(
            self.store,
            s.ownership,
            s.advertise or self.address,
            sorted(models),
            numerics_signature(self.numerics),
            held=lambda: manager.held(),
            on_lost=lambda lease, error: manager.lost_lease(lease, error),
            on_expired=lambda lease: manager.expired_lease(lease),
            worker_id=self.worker_id,
            stats=self._stats,
        )
        self.advertise_lock = await claim_address(self.ownership, s.data_dir, self.address)
        self.ownership.store_checks = self._store_checks
        manager = self.manager = SessionManager(
            models, self.store, self.ownership, self.memory, engine_manager_settings(s), guard
        )
        for name, directory in s.models:
            manager.models.set_tokenizer(name, tokenizers[name])
            manager.models.set_eos_ids(name, _eos_ids(models[name], directory))
        self.migrator = Migrator(
            self.store, self.ownership, self.peers,
            manager.residents, manager.loader, manager.checkpoints, manager.lifecycle,
            s.migration, on_drain=self._not_serving, on_undrain=self._serving_again,
        )  # fmt: skip
        await manager.warm_up()  # ready means warm: no request compiles a kernel
        manager.start()
        self.service = SessionService(
            manager,
            manager.intake,
            replace(s.service, max_message_bytes=s.max_message_bytes),
            self.migrator,
            store=self.store,
            memory=self.memory,
            metrics=self.metrics,
            authenticator=self.authenticator,
            refusal=lambda: guard.refusal,
        )
        pb_grpc.add_SessionServiceServicer_to_server(self.service, self.server)
        pb_grpc.add_ClusterServiceServicer_to_server(
            ClusterService(self.migrator, self.ownership, self.peers, manager, self),
            self.server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, CLUSTER_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
            self.server,
        )
        # grpc's health servicer starts with "" SERVING: not before the worker is ready.
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        await self._patiently("register in Redis", self.ownership.start)
        await refuse_later_twin(self.ownership, self.address, self.ownership.predecessors)
        self.rebalancer = Rebalancer(
            self.migrator, manager.residents, manager.loader, self.ownership, s.rebalance
        )
        self.rebalancer.start()
        if s.metrics_listen:
            self._start_metrics(s.metrics_listen)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self.readiness = Readiness(
            self.health, ("", SERVICE_NAME, CLUSTER_SERVICE_NAME), self._store_usable, s.readiness
        )
        await self.readiness.start()
        if self.http_door is not None:
            await self.http_door.start(self)
        return self.address

    async def _store_checks(self) -> None:
        """What each heartbeat reads about the store itself: its eviction policy and
        identity (``StoreGuard``), and its replicas (``Store.follow_replicas``)."""
        assert self.guard is not None and self.store is not None
        try:
            raised = await self.store.follow_replicas()
        except SsmserveError as exc:
            log.debug("could not count the store's replicas: %s", exc)
        else:
            if raised:
                log.warning(
                    "store: replicas appeared; every write now waits until %d of them hold "
                    "it (--redis-wait-replicas auto)", raised,
                )  # fmt: skip
        await self.guard.check()

    async def _start_embedded_redis(self) -> str:
        """Lock the data directory, start the private redis-server, keep it running;
        returns its URL (which holds the password: never logged)."""
        s = self.settings
        lock_settings = DataDirLockSettings(data_dir=s.data_dir)
        self.data_dir_lock = await asyncio.to_thread(DataDirLock(lock_settings).acquire)
        redis_dir = s.data_dir / "redis"
        embedded = EmbeddedRedis(EmbeddedRedisSettings(data_dir=redis_dir), self.data_dir_lock.fd)
        # Started from the event loop's thread, which lives as long as the process: on
        # Linux the redis-server dies with the thread that started it.
        self.embedded = embedded.start()
        self.data_dir_lock.note(redis=embedded.pid)

        def restarted() -> None:
            self.metrics.embedded_redis_restarts.inc()
            if self.data_dir_lock is not None:
                self.data_dir_lock.note(redis=embedded.pid)

        self.embedded_keeper = EmbeddedRedisKeeper(embedded, s.embedded_redis, restarted)
        self.embedded_keeper.start()
        log.info(
            "embedded redis-server on %s:%d (data in %s)",
            embedded.settings.host, embedded.port, redis_dir,
        )  # fmt: skip
        return embedded.url

    async def _store_usable(self) -> None:
        """What readiness asks: the store answers, and this worker may serve from it (not
        while the store guard refuses it: an evicting Redis)."""
        assert self.store is not None and self.guard is not None
        await self.store.ping()
        if self.guard.refusal is not None:
            raise self.guard.refusal

    def _stats(self) -> WorkerStats:
        """What the heartbeat reports (``ssmserve workers``, ``ssmserve top``)."""
        manager, service = self.manager, self.service
        if manager is None or service is None:
            return WorkerStats()
        p50, p99 = service.recent_latency.percentiles_ms(0.5, 0.99)
        return WorkerStats(
            steps=manager.steps_taken,
            snapshots=manager.snapshots_committed,
            open_streams=service.open_streams,
            step_p50_ms=p50,
            step_p99_ms=p99,
            memory_held=self.memory.held,
            memory_budget=self.memory.budget_bytes,
        )

    def _start_metrics(self, listen: str) -> None:
        manager, ownership, memory = self.manager, self.ownership, self.memory
        assert manager is not None and ownership is not None
        self.metrics.watch(
            WorkerView(
                residents=manager.resident_counts,
                memory_held=lambda: memory.held,
                memory_budget=lambda: memory.budget_bytes,
                open_streams=lambda: self.service.open_streams if self.service else 0,
                forecasts_running=manager.forecasts_running,
                draining=lambda: ownership.draining,
                stored_sessions=lambda: self._stored_sessions,
                replicas_confirming=lambda: self.store.wait_replicas if self.store else 0,
            )
        )
        self.metrics_endpoint = MetricsEndpoint(listen, self.metrics.registry)
        self.metrics_address = self.metrics_endpoint.start()
        self._counter = asyncio.create_task(self._count_stored(), name="count-stored")
        log.info("metrics on http://%s/metrics", self.metrics_address)

    async def _count_stored(self) -> None:
        """Keep ``ssmserve_sessions_stored`` fresh (one ZCARD-like count per period)."""
        assert self.store is not None
        while True:
            try:
                self._stored_sessions = await self.store.count_sessions("")
            except SsmserveError as exc:
                log.debug("could not count stored sessions: %s", exc)
            await asyncio.sleep(self.settings.stored_count_every_s)

    async def load_model(self, key: str, directory: Path) -> None:
        """Serve another model (version) without a restart (LoadModel, admin)."""
        assert self.manager is not None and self.ownership is not None, "start() first"
        if not KEY_PATTERN.fullmatch(key):
            raise BadModelKeyError(
                f"model {clip(key)}: expected NAME or NAME@VERSION of letters, digits, '.', "
                f"'_' or '-'"
            )
        model, tokenizer = await asyncio.to_thread(_load, directory, key, self.settings)
        check_fits(key, model, self.settings.max_message_bytes)
        await self.manager.load_model(key, model, tokenizer, _eos_ids(model, directory))
        self.model_paths[key] = directory  # (an unloaded key's entry is never read)
        await self._models_changed()

    async def unload_model(self, key: str) -> None:
        """Stop serving a model (version) (UnloadModel, admin)."""
        assert self.manager is not None, "start() first"
        await self.manager.unload_model(key)
        await self._models_changed()

    async def _models_changed(self) -> None:
        """Tell the registry at once: routing and migration pick workers by model."""
        assert self.manager is not None and self.ownership is not None
        self.ownership.models = tuple(sorted(self.manager.models))
        try:
            await self.ownership.heartbeat()
        except SsmserveError as exc:  # the next heartbeat says it
            log.warning("could not announce the models at once: %s", exc)

    async def _patiently(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """Retry ``call`` while Redis is unavailable, up to ``startup_timeout_s``: a store
        that is restarting, or slow for a moment, does not stop a worker from starting."""
        deadline = time.monotonic() + self.settings.startup_timeout_s
        delay = 0.05
        while True:
            try:
                return await call()
            except StoreUnavailableError as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("could not %s yet (%s); retrying", what, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _serving_again(self) -> None:
        if self.stopping:
            raise WorkerStoppingError("this worker is stopping; it cannot be undrained")
        if self.readiness is not None:
            await self.readiness.set_draining(False)

    async def _not_serving(self) -> None:
        if self.readiness is not None:
            await self.readiness.set_draining(True)
        else:  # still starting: nothing says SERVING yet
            for service in ("", SERVICE_NAME, CLUSTER_SERVICE_NAME):
                await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def drain(self) -> list[DrainProgress]:
        """Move every session to other workers (or park it); the worker keeps running."""
        assert self.migrator is not None, "start() first"
        return [p async for p in self.migrator.drain()]

    async def stop(self) -> None:
        self.stopping = True
        if self.http_door is not None:  # first: no new completions; its sessions closed
            await self.http_door.stop()
        if self.rebalancer is not None:
            await self.rebalancer.stop()
        await self._not_serving()
        if self.migrator is not None and self.settings.drain_on_stop:
            try:
                progress = await self.drain()
                for p in progress:
                    log.info(
                        "drain %d/%d: session %s -> %s%s",
                        p.done,
                        p.total,
                        p.session_id,
                        p.target or "parked in Redis",
                        f" ({p.error})" if p.error else "",
                    )
                if any(p.target for p in progress):
                    await asyncio.sleep(self.settings.lame_duck_s)
            except Exception:  # never let a failed drain keep the worker from stopping
                log.exception("drain failed; the remaining sessions are snapshotted instead")
        if self.server is not None:
            await self.server.stop(self.settings.shutdown_grace_s)
        if self.manager is not None:
            await self.manager.stop()
        if self.ownership is not None:
            await self.ownership.stop()
        await self._close_connections()
        await self._stop_embedded_redis(kill=False)

    async def abort(self) -> None:
        """Stop serving at once, without the shutdown snapshots (as a crash would)."""
        if self.http_door is not None:
            await self.http_door.abort()
        if self.rebalancer is not None:
            await self.rebalancer.stop()
        if self.ownership is not None:
            await self.ownership.stop(deregister=False)
        if self.server is not None:
            await self.server.stop(0)
        if self.manager is not None:
            await self.manager.abandon()
        await self._close_connections()
        await self._stop_embedded_redis(kill=True)

    async def _stop_embedded_redis(self, kill: bool) -> None:
        """The keeper first (so it does not start Redis again), then Redis, then the lock."""
        if self.embedded_keeper is not None:
            await self.embedded_keeper.stop()
        if self.embedded is not None:
            await asyncio.to_thread(self.embedded.kill if kill else self.embedded.stop)
        if self.data_dir_lock is not None:
            self.data_dir_lock.release()
        if self.advertise_lock is not None:  # last: nothing of this worker runs any more
            self.advertise_lock.release()

    async def _close_connections(self) -> None:
        """Peer channels, the token file watcher and the store: last, after serving."""
        if self.readiness is not None:
            await self.readiness.stop()
        if self._counter is not None:
            self._counter.cancel()
            await asyncio.gather(self._counter, return_exceptions=True)
            self._counter = None
        if self.metrics_endpoint is not None:
            await asyncio.to_thread(self.metrics_endpoint.stop)
            self.metrics_endpoint = None
        await asyncio.to_thread(self.metrics.tracing.shutdown)  # flushes spans still queued
        await self.peers.close()
        if self.tokens is not None:
            await self.tokens.stop()
        if self.store is not None:
            await self.store.aclose()


def check_fits(key: str, model: Engine, limit: int) -> None:
    """One step's answer (float32 outputs, packed) must fit in one message of ``limit``."""
    if model.config.output_dim * 4 + 4096 > limit // 2:
        raise ModelTooLargeError(
            f"model {key}: one output of {model.config.output_dim} values does not fit "
            f"in half a {limit}-byte message; raise max_message_bytes"
        )


def bound_http_door(s: WorkerSettings) -> HttpDoor | None:
    """With ``--http``: the door, its port taken (HttpListenError names one in use); its
    requests in flight get the worker's ``shutdown_grace_s`` when it stops."""
    if not s.http.listen:
        return None
    from ssmserve.server.http.door import HttpDoor

    door = HttpDoor(replace(s.http, shutdown_grace_s=s.shutdown_grace_s))
    door.bind()
    return door


def engine_manager_settings(s: WorkerSettings) -> ManagerSettings:
    """The manager's settings for the worker's engine: a GPU call always runs on the
    engine thread (offload threshold 0), since it waits on the device and the event loop
    must never do that; the CPU engine runs small calls inline, where the thread hop costs
    more (``StepperSettings.offload_min_flop``)."""
    if s.engine != "cuda":
        return s.manager
    return replace(s.manager, stepper=replace(s.manager.stepper, offload_min_flop=0.0))


def engine_numerics(engine: str, quantize: str = "none") -> str:
    """What ``engine``'s bits depend on here, one line (the worker's numerics): its
    description, and the weights' format where ``--quantize`` sets one."""
    if engine == "cuda":
        from ssmserve.server.engine.gpu.numerics import gpu_numerics_description
        from ssmserve.server.engine.gpu.runtime import default_device

        return gpu_numerics_description(default_device())
    weights = f" | weights {quantize}" if quantize != "none" else ""
    return numerics_description() + weights


def _eos_ids(model: Engine, directory: Path) -> tuple[int, ...]:
    """A token model's end-of-sequence ids (Generate stops on them by default)."""
    c = model.config
    return read_eos_ids(directory, c.vocab_size) if c.is_token_model else ()


def _load(directory: Path, key: str, s: WorkerSettings) -> tuple[Engine, ModelTokenizer | None]:
    """A model directory's model on ``s.engine`` (its weights as ``s.quantize`` says)
    and, for a token model with a ``tokenizer.json``, its tokenizer (both checked: a bad
    one refuses the model)."""
    engine = s.engine
    model: Engine
    if engine == "cuda":
        from ssmserve.server.engine.gpu.model import GpuMambaModel

        model = GpuMambaModel.load(directory, key)
    else:
        model = load_model(directory, key, s.quantize)
    c = model.config
    tokenizer = load_tokenizer(directory, c.vocab_size) if c.is_token_model else None
    if tokenizer is not None:
        log.info("model %s: tokenizer.json loaded (%s)", key, tokenizer.fingerprint[:16])
    return model, tokenizer
