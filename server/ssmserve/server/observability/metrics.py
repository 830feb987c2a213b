"""Metrics: every number a worker exports, named as Prometheus users expect.

Naming follows the Prometheus conventions that Triton and vLLM users know: the prefix
``ssmserve_``, base units in the name (``_seconds``, ``_bytes``), counters end in
``_total``, latencies are histograms. Label sets are bounded: models, durability modes,
reasons, causes, Store operations, RPC methods and status codes, tenants (from the token
file). Never a session id: there may be millions.

Each worker owns one :class:`Metrics` with its own registry (a process may run several
workers, as the tests do); ``--metrics-listen HOST:PORT`` serves it at ``/metrics``
(``observability.http``). Without it the metrics are disabled: every counter and
histogram is a no-op, so a worker nobody scrapes pays nothing. A worker's ``Metrics`` is
handed to its ``Store`` and read from there by the components that hold the store.
Counters and histograms are updated from the event loop only, without locks
(``loop_metrics``): a few additions per engine batch and per answered message, whatever
its number of steps (``bench/bench_metrics.py`` measures the cost).

Gauges that describe what is resident (sessions, queued steps, memory) are computed when
scraped, from a :class:`WorkerView` the worker provides, so nothing updates them per step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ssmserve.server.observability.loop_metrics import (
    LoopCounter,
    LoopHistogram,
    LoopMetricsCollector,
)
from ssmserve.server.observability.tracing import OFF

#: Latency buckets from 100 us (a small batch) to 10 s (a long replay or a stalled Redis).
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
#: Generate's token latencies: 1 ms (a token of a small model) to 30 s (a long prompt's
#: prefill before the first token).
TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


class Metrics:
    """The counters and histograms of one worker (gauges: :class:`WorkerView`)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.tracing = OFF  # the worker's spans (observability.tracing), set by the worker
        self.registry = CollectorRegistry(auto_describe=True)
        made: list[LoopCounter | LoopHistogram] = []

        def counter(name: str, doc: str, labels: Iterable[str] = ()) -> Any:
            if not enabled:
                return _NOOP
            made.append(LoopCounter(name, doc, list(labels)))
            return made[-1]

        def histogram(
            name: str, doc: str, labels: Iterable[str] = (), buckets: tuple[float, ...] = ()
        ) -> Any:
            if not enabled:
                return _NOOP
            made.append(LoopHistogram(name, doc, list(labels), buckets))
            return made[-1]

        # Steps and the engine
        self.steps = counter(
            "ssmserve_steps_total", "Steps applied to sessions.", ["model", "durability"]
        )
        self.step_latency = histogram(
            "ssmserve_step_latency_seconds",
            "Time from a Stream message's arrival to the answer of its steps being sent.",
            buckets=LATENCY_BUCKETS,
        )
        self.engine_batch_size = histogram(
            "ssmserve_engine_batch_size",
            "Sessions advanced together by one engine step of the stepper (a call that "
            "steps run chunks of n steps counts n times).",
            ["model"],
            BATCH_BUCKETS,
        )
        self.engine_batch_seconds = histogram(
            "ssmserve_engine_batch_seconds",
            "Time of one engine call of the stepper (one step, or n steps of run chunks).",
            ["model"],
            LATENCY_BUCKETS,
        )
        self.guard_events = counter(
            "ssmserve_guard_events_total",
            "Guard events on steps (their inputs and outputs), by action.",
            ["action"],
        )
        # Snapshots, rollbacks, replay, forks, forecasts
        self.snapshots = counter(
            "ssmserve_snapshots_total", "Snapshots committed to the store.", ["reason"]
        )
        self.snapshot_bytes = counter(
            "ssmserve_snapshot_bytes_total", "Checkpoint bytes of committed snapshots."
        )
        self.snapshot_seconds = histogram(
            "ssmserve_snapshot_write_seconds",
            "Time to flush, encode and commit one snapshot.",
            buckets=LATENCY_BUCKETS,
        )
        self.snapshots_dropped = counter(
            "ssmserve_snapshots_dropped_total",
            "Periodic snapshots superseded by a newer one before they were written.",
        )
        self.rollbacks = counter(
            "ssmserve_rollbacks_total",
            "Rollbacks, by cause: monitor (the Rollback RPC), guard (a ROLLBACK rule) or "
            "cancel (a cancelled Generate's step its client was not handed).",
            ["cause"],
        )
        self.replayed_steps = counter(
            "ssmserve_replayed_steps_total",
            "Steps recomputed from the input log (restores, rollbacks, loads).",
        )
        self.forks = counter("ssmserve_forks_total", "Sessions forked.")
        self.forecasts = counter("ssmserve_forecasts_total", "Forecasts started.", ["model"])
        self.forecast_seconds = histogram(
            "ssmserve_forecast_seconds",
            "Time of a Forecast call, from request to its last answer.",
            buckets=LATENCY_BUCKETS,
        )
        # Generate (language models), as vLLM names them
        self.time_to_first_token = histogram(
            "ssmserve_time_to_first_token_seconds",
            "Time of a Generate call from its arrival to its first token handed to gRPC "
            "(its prompt's prefill included).",
            ["model"],
            TOKEN_LATENCY_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "ssmserve_inter_token_latency_seconds",
            "Time between two tokens of a Generate call handed to gRPC (each token of a "
            "message that carries several counts the gap over their number).",
            ["model"],
            TOKEN_LATENCY_BUCKETS,
        )
        self.generation_tokens = counter(
            "ssmserve_generation_tokens_total",
            "Tokens Generate answered (a resumed call's tokens answered again included).",
            ["model"],
        )
        self.generations_finished = counter(
            "ssmserve_generations_finished_total",
            "Generate calls ended, by finish reason: length, stop, eos, cancelled (the "
            "worker stopped it), guard, monitor, error, or aborted (the client went away).",
            ["model", "reason"],
        )
        # Ownership and movement
        self.migrations = counter(
            "ssmserve_migrations_total", "Sessions handed off to another worker.", ["result"]
        )
        self.migration_downtime = histogram(
            "ssmserve_migration_downtime_seconds",
            "Time a migrating session answers nothing: from holding it to its hand-off.",
            buckets=LATENCY_BUCKETS,
        )
        self.takeovers = counter(
            "ssmserve_takeovers_total",
            "Sessions loaded here after their owner's lease ran out (a crash or a freeze).",
        )
        self.lease_renewals_failed = counter(
            "ssmserve_lease_renewals_failed_total", "Lease renewal rounds that failed."
        )
        self.fenced_writes = counter(
            "ssmserve_fenced_writes_total",
            "Writes the store refused because this worker's fencing token was stale.",
        )
        self.answers_fenced = counter(
            "ssmserve_answers_fenced_total",
            "Step answers not sent because their session's lease no longer surely ran when "
            "they were to leave (answered LEASE_LAPSED; the client sends them again).",
        )
        self.store_resets = counter(
            "ssmserve_store_resets_total",
            "Times the store turned out wiped or replaced (its identity changed or vanished): "
            "every session this worker held was lost.",
        )
        self.gc_pause = histogram(
            "ssmserve_gc_pause_seconds",
            "Pauses of Python's cyclic garbage collector (the event loop stands still), "
            "by generation.",
            ["generation"],
            LATENCY_BUCKETS,
        )
        # Redis and RPCs
        self.redis_seconds = histogram(
            "ssmserve_redis_command_seconds",
            "Time of one store operation (a command, script or pipeline) against Redis.",
            ["operation"],
            LATENCY_BUCKETS,
        )
        self.redis_errors = counter(
            "ssmserve_redis_errors_total",
            "Store operations that failed: unavailable, outcome_unknown or error.",
            ["operation", "kind"],
        )
        # A worker that runs its own Redis (no --redis-url, no --workers).
        self.embedded_redis_restarts = counter(
            EMBEDDED_REDIS_RESTARTS, EMBEDDED_REDIS_RESTARTS_HELP
        )
        # OpenTelemetry's rpc.server.call.duration, in Prometheus' naming.
        self.rpc_seconds = histogram(
            "ssmserve_rpc_server_call_duration_seconds",
            "Time of one RPC on the server, by method and gRPC status code.",
            ["rpc_method", "rpc_grpc_status_code"],
            LATENCY_BUCKETS,
        )

        self.registry.register(LoopMetricsCollector(made))

    def watch(self, view: WorkerView) -> None:
        """Export the gauges ``view`` computes, at every scrape."""
        self.registry.register(_WorkerCollector(view))


EMBEDDED_REDIS_RESTARTS = "ssmserve_embedded_redis_restarts_total"
EMBEDDED_REDIS_RESTARTS_HELP = (
    "Times the embedded redis-server died (a crash, the OOM killer) and was started again "
    "from its AOF."
)


class SupervisorMetrics:
    """The counters of the ``--workers N`` supervisor process; its workers export their
    own :class:`Metrics` (updated from the supervisor's event loop only)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.embedded_redis_restarts = LoopCounter(
            EMBEDDED_REDIS_RESTARTS, EMBEDDED_REDIS_RESTARTS_HELP
        )
        self.worker_restarts = LoopCounter(
            "ssmserve_worker_restarts_total",
            "Times a worker process died and the supervisor started it again.",
        )
        self.registry.register(
            LoopMetricsCollector([self.embedded_redis_restarts, self.worker_restarts])
        )


class _Noop:
    """A counter or histogram (labelled or not) that records nothing."""

    def labels(self, *_values: str) -> _Noop:
        return self

    def inc(self, _amount: float = 1) -> None:
        pass

    def observe(self, _value: float, _count: int = 1) -> None:
        pass


_NOOP = _Noop()


@dataclass
class ResidentCounts:
    """What one scrape reads off the resident sessions."""

    sessions: dict[tuple[str, str], int] = field(default_factory=dict)  # (model, tenant)
    queued_steps: dict[str, int] = field(default_factory=dict)  # by model


@dataclass
class WorkerView:
    """Callables the worker provides for the scrape-time gauges. They run on the HTTP
    server's thread: each must only read (a copy of) plain Python state."""

    residents: Callable[[], ResidentCounts]
    memory_held: Callable[[], int]
    memory_budget: Callable[[], int]
    open_streams: Callable[[], int]
    forecasts_running: Callable[[], dict[str, int]]
    draining: Callable[[], bool]
    stored_sessions: Callable[[], int | None]  # as last counted (None: not yet)
    replicas_confirming: Callable[[], int] = lambda: 0  # the WAIT behind each write


class _WorkerCollector(Collector):
    def __init__(self, view: WorkerView) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        v = self.view
        counts = v.residents()
        resident = GaugeMetricFamily(
            "ssmserve_sessions_resident",
            "Sessions in this worker's memory.",
            labels=["model", "tenant"],
        )
        for (model, tenant), n in sorted(counts.sessions.items()):
            resident.add_metric([model, tenant], n)
        yield resident
        queued = GaugeMetricFamily(
            "ssmserve_queued_steps", "Steps received and not yet answered.", labels=["model"]
        )
        for model, n in sorted(counts.queued_steps.items()):
            queued.add_metric([model], n)
        yield queued
        running = GaugeMetricFamily(
            "ssmserve_forecasts_running", "Forecasts running.", labels=["model"]
        )
        for model, n in sorted(v.forecasts_running().items()):
            running.add_metric([model], n)
        yield running
        stored = v.stored_sessions()
        if stored is not None:
            yield GaugeMetricFamily(
                "ssmserve_sessions_stored",
                "Sessions in the store, on every worker (counted at each heartbeat).",
                value=stored,
            )
        yield GaugeMetricFamily(
            "ssmserve_memory_held_bytes",
            "Bytes counted against the worker's memory budget (sessions at their bounds, "
            "forecasts, imports being decoded).",
            value=v.memory_held(),
        )
        yield GaugeMetricFamily(
            "ssmserve_memory_budget_bytes", "The worker's memory budget.", value=v.memory_budget()
        )
        yield GaugeMetricFamily(
            "ssmserve_open_streams", "Stream calls open.", value=v.open_streams()
        )
        yield GaugeMetricFamily(
            "ssmserve_worker_draining", "1 while this worker drains.", value=int(v.draining())
        )
        yield GaugeMetricFamily(
            "ssmserve_store_replicas_confirming",
            "Replicas that must hold each write before it counts (Redis WAIT); 0: a write "
            "counts once the master has it, and a failover may lose acknowledged steps.",
            value=v.replicas_confirming(),
        )
