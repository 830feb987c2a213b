"""Writes ssmserve-dashboard.json: the Grafana dashboard for a worker's metrics.

Usage: ``python deploy/grafana/make_dashboard.py`` (edit here, not in the JSON). Import
the JSON in Grafana (Dashboards -> New -> Import) and pick the Prometheus data source that
scrapes the workers' ``--metrics-listen``. Panels are laid out three to a line, rows in
the order an operator on call reads them: traffic, engine, sessions and memory,
snapshots, ownership, Redis and RPCs. ``tests/test_observability.py`` checks that every
metric the dashboard queries is one a worker exports.
"""

import json
from pathlib import Path
from typing import Any

Panel = dict[str, Any]
panels: list[Panel] = []


def row(title: str) -> None:
    panels.append({"type": "row", "title": title, "collapsed": False, "panels": []})


def ts(title: str, exprs: list[tuple[str, str]], unit: str = "short", desc: str = "") -> None:
    """A time series panel of PromQL ``exprs`` as (query, legend) pairs."""
    panels.append(
        {
            "type": "timeseries",
            "title": title,
            "description": desc,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {
                "legend": {"displayMode": "table", "placement": "bottom"},
                "tooltip": {"mode": "multi"},
            },
            "targets": [
                {"expr": expr, "legendFormat": legend, "refId": chr(65 + i)}
                for i, (expr, legend) in enumerate(exprs)
            ],
        }
    )


def sel() -> str:
    """The label selector every query shares: the chosen Prometheus jobs."""
    return '{job=~"$job"}'


class Quantile:
    """``histogram_quantile`` of a histogram, summed by ``by`` (and le)."""

    def __init__(self, metric: str, by: str) -> None:
        self.metric, self.by = metric, by

    def format(self, quantile: float) -> str:
        by = ", " + self.by if self.by else ""
        rate = f"rate({self.metric}_bucket{sel()}[$__rate_interval])"
        return f"histogram_quantile({quantile}, sum by (le{by}) ({rate}))"


def q(metric: str, by: str) -> Quantile:
    return Quantile(metric, by)


row("Traffic and latency")
ts(
    "Steps/s by model and durability",
    [
        (
            f"sum by (model, durability) (rate(ssmserve_steps_total{sel()}[$__rate_interval]))",
            "{{model}} {{durability}}",
        )
    ],
    "ops",
    desc="Steps applied. A drop with steady clients means steps are failing or queueing.",
)
ts(
    "Step latency p50 / p99 (arrival to answer)",
    [
        (q("ssmserve_step_latency_seconds", "").format(0.5), "p50"),
        (q("ssmserve_step_latency_seconds", "").format(0.99), "p99"),
    ],
    "s",
    desc="From a Stream message's arrival to its answer being sent; log durability includes the Redis write.",
)
ts(
    "Queued steps by model",
    [(f"sum by (model) (ssmserve_queued_steps{sel()})", "{{model}}")],
    "short",
    desc="Steps received and not yet answered. Growing: the engine or Redis cannot keep up.",
)
row("Engine")
ts(
    "Engine batch size (mean)",
    [
        (
            f"sum by (model) (rate(ssmserve_engine_batch_size_sum{sel()}[$__rate_interval])) / sum by (model) (rate(ssmserve_engine_batch_size_count{sel()}[$__rate_interval]))",
            "{{model}}",
        )
    ],
    "short",
)
ts(
    "Engine time per batch p50 / p99",
    [
        (q("ssmserve_engine_batch_seconds", "model").format(0.5), "p50 {{model}}"),
        (q("ssmserve_engine_batch_seconds", "model").format(0.99), "p99 {{model}}"),
    ],
    "s",
)
ts(
    "Forecasts running and forecast time p99",
    [
        (f"sum by (model) (ssmserve_forecasts_running{sel()})", "running {{model}}"),
        (q("ssmserve_forecast_seconds", "").format(0.99), "p99 seconds"),
    ],
    "short",
)
row("Generation (language models)")
ts(
    "Time to first token p50 / p99",
    [
        (q("ssmserve_time_to_first_token_seconds", "model").format(0.5), "p50 {{model}}"),
        (q("ssmserve_time_to_first_token_seconds", "model").format(0.99), "p99 {{model}}"),
    ],
    "s",
    desc="A Generate call's arrival to its first token handed to gRPC (the prompt's prefill "
    "included).",
)
ts(
    "Time between tokens p50 / p99, tokens/s",
    [
        (q("ssmserve_inter_token_latency_seconds", "model").format(0.5), "p50 {{model}}"),
        (q("ssmserve_inter_token_latency_seconds", "model").format(0.99), "p99 {{model}}"),
    ],
    "s",
)
ts(
    "Generated tokens/s and finished generations/s by reason",
    [
        (
            f"sum by (model) (rate(ssmserve_generation_tokens_total{sel()}[$__rate_interval]))",
            "tokens/s {{model}}",
        ),
        (
            f"sum by (model, reason) (rate(ssmserve_generations_finished_total{sel()}[$__rate_interval]))",
            "{{reason}} {{model}}",
        ),
    ],
    "short",
    desc="Finish reasons: length, stop, eos, cancelled (the worker stopped it), guard, "
    "monitor, error, aborted (the client went away).",
)
row("Sessions and memory")
ts(
    "Sessions resident by model and tenant / stored",
    [
        (
            f"sum by (model, tenant) (ssmserve_sessions_resident{sel()})",
            "resident {{model}} {{tenant}}",
        ),
        (f"max(ssmserve_sessions_stored{sel()})", "stored (all workers)"),
    ],
    "short",
)
ts(
    "Memory held vs budget",
    [
        (f"sum by (instance) (ssmserve_memory_held_bytes{sel()})", "held {{instance}}"),
        (f"sum by (instance) (ssmserve_memory_budget_bytes{sel()})", "budget {{instance}}"),
    ],
    "bytes",
    desc="Sessions at their bounds, forecasts and imports being decoded. Near the budget, new sessions are refused (RESOURCE_EXHAUSTED).",
)
ts(
    "Open streams and draining workers",
    [
        (f"sum by (instance) (ssmserve_open_streams{sel()})", "streams {{instance}}"),
        (f"sum(ssmserve_worker_draining{sel()})", "workers draining"),
    ],
    "short",
)
row("Snapshots, rollbacks, replay")
ts(
    "Snapshots/s by reason, dropped/s",
    [
        (
            f"sum by (reason) (rate(ssmserve_snapshots_total{sel()}[$__rate_interval]))",
            "{{reason}}",
        ),
        (
            f"sum(rate(ssmserve_snapshots_dropped_total{sel()}[$__rate_interval]))",
            "dropped (superseded)",
        ),
    ],
    "ops",
)
ts(
    "Snapshot write time p50 / p99",
    [
        (q("ssmserve_snapshot_write_seconds", "").format(0.5), "p50"),
        (q("ssmserve_snapshot_write_seconds", "").format(0.99), "p99"),
    ],
    "s",
)
ts(
    "Snapshot bytes written/s",
    [
        (
            f"sum by (instance) (rate(ssmserve_snapshot_bytes_total{sel()}[$__rate_interval]))",
            "{{instance}}",
        )
    ],
    "Bps",
    desc="What snapshots cost Redis in bandwidth; large models write MBs per snapshot.",
)
ts(
    "Rollbacks/s by cause, replayed steps/s",
    [
        (
            f"sum by (cause) (rate(ssmserve_rollbacks_total{sel()}[$__rate_interval]))",
            "rollbacks {{cause}}",
        ),
        (f"sum(rate(ssmserve_replayed_steps_total{sel()}[$__rate_interval]))", "replayed steps"),
        (
            f"sum by (action) (rate(ssmserve_guard_events_total{sel()}[$__rate_interval]))",
            "guard {{action}}",
        ),
    ],
    "ops",
)
row("Ownership and movement (on call: any non-zero line here deserves a look)")
ts(
    "Takeovers, fenced writes and answers, failed renewals",
    [
        (
            f"sum(increase(ssmserve_takeovers_total{sel()}[$__rate_interval]))",
            "takeovers (owner crashed or froze)",
        ),
        (
            f"sum(increase(ssmserve_fenced_writes_total{sel()}[$__rate_interval]))",
            "writes refused by fencing",
        ),
        (
            f"sum(increase(ssmserve_answers_fenced_total{sel()}[$__rate_interval]))",
            "answers held back (lease no longer sure)",
        ),
        (
            f"sum by (instance) (increase(ssmserve_lease_renewals_failed_total{sel()}[$__rate_interval]))",
            "renewals failed {{instance}}",
        ),
    ],
    "short",
)
ts(
    "Migrations and their downtime p99",
    [
        (
            f"sum by (result) (increase(ssmserve_migrations_total{sel()}[$__rate_interval]))",
            "migrations {{result}}",
        ),
        (q("ssmserve_migration_downtime_seconds", "").format(0.99), "downtime p99 (s)"),
    ],
    "short",
)
ts(
    "Forks/s, forecasts/s",
    [
        (f"sum(rate(ssmserve_forks_total{sel()}[$__rate_interval]))", "forks"),
        (
            f"sum by (model) (rate(ssmserve_forecasts_total{sel()}[$__rate_interval]))",
            "forecasts {{model}}",
        ),
    ],
    "ops",
)
row("Redis and RPCs")
ts(
    "Redis operation time p99 by operation",
    [
        (q("ssmserve_redis_command_seconds", "operation").format(0.99), "{{operation}}"),
    ],
    "s",
)
ts(
    "Redis errors/s by kind",
    [
        (
            f"sum by (operation, kind) (rate(ssmserve_redis_errors_total{sel()}[$__rate_interval]))",
            "{{operation}} {{kind}}",
        ),
    ],
    "ops",
)
ts(
    "Embedded Redis restarts",
    [
        (
            f"sum by (instance) (increase(ssmserve_embedded_redis_restarts_total{sel()}[$__rate_interval]))",
            "{{instance}}",
        ),
    ],
    "short",
    desc="A worker without --redis-url started its redis-server again after it died (a "
    "crash, the OOM killer: look at the memory limit); steps fail with UNAVAILABLE meanwhile.",
)
ts(
    "Replicas confirming each write",
    [(f"min by (instance) (ssmserve_store_replicas_confirming{sel()})", "{{instance}}")],
    "short",
    desc="How many replicas every write waits for (Redis WAIT) before a step is answered "
    "(--redis-wait-replicas; auto: every replica the masters had at start). 0 on a "
    "replicated Redis means a failover can lose acknowledged steps.",
)
ts(
    "Store wiped or replaced",
    [
        (
            f"sum by (instance) (increase(ssmserve_store_resets_total{sel()}[$__rate_interval]))",
            "{{instance}}",
        ),
    ],
    "short",
    desc="The store's identity changed or vanished (FLUSHALL, a Redis restarted without "
    "persistence, another Redis at its address): every session the worker held was lost "
    "and answers DATA_LOSS. Any point here deserves a look.",
)
ts(
    "RPCs/s by method and code",
    [
        (
            f"sum by (rpc_method, rpc_grpc_status_code) (rate(ssmserve_rpc_server_call_duration_seconds_count{sel()}[$__rate_interval]))",
            "{{rpc_method}} {{rpc_grpc_status_code}}",
        ),
    ],
    "ops",
    desc="UNAVAILABLE and INTERNAL deserve a look; NOT_FOUND and INVALID_ARGUMENT are clients' mistakes.",
)
ts(
    "RPC time p99 by method",
    [(q("ssmserve_rpc_server_call_duration_seconds", "rpc_method").format(0.99), "{{rpc_method}}")],
    "s",
    desc="Stream and Forecast calls last as long as the client keeps them open.",
)
ts(
    "Garbage collector pauses: p99 and seconds/s by generation",
    [
        (q("ssmserve_gc_pause_seconds", "generation").format(0.99), "p99 gen {{generation}}"),
        (
            f"sum by (instance, generation) (rate(ssmserve_gc_pause_seconds_sum{sel()}[$__rate_interval]))",
            "{{instance}} gen {{generation}} s/s",
        ),
    ],
    "s",
    desc="While Python's collector runs, the event loop stands still (no answers, no lease "
    "renewals). A full collection (generation 2) of a big heap takes ~100 ms; see "
    "--gc-young-threshold.",
)

# lay out: three panels per row line
x = 0
yy = 0
for p in panels:
    if p["type"] == "row":
        if x:
            yy += 8
        x = 0
        p["gridPos"] = {"h": 1, "w": 24, "x": 0, "y": yy}
        yy += 1
        continue
    p["gridPos"] = {"h": 8, "w": 8, "x": x, "y": yy}
    x += 8
    if x >= 24:
        x = 0
        yy += 8
for i, p in enumerate(panels, start=1):
    p["id"] = i

dash = {
    "title": "ssmserve",
    "uid": "ssmserve-overview",
    "description": "Workers of ssmserve: traffic, latency, engine, sessions, snapshots, ownership, Redis and RPCs. Metrics from --metrics-listen (see README).",
    "tags": ["ssmserve"],
    "timezone": "utc",
    "schemaVersion": 39,
    "version": 1,
    "refresh": "10s",
    "time": {"from": "now-1h", "to": "now"},
    "templating": {
        "list": [
            {
                "name": "datasource",
                "type": "datasource",
                "query": "prometheus",
                "label": "Data source",
            },
            {
                "name": "job",
                "type": "query",
                "label": "Job",
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "query": "label_values(ssmserve_steps_total, job)",
                "includeAll": True,
                "multi": True,
                "current": {"text": "All", "value": "$__all"},
                "refresh": 2,
            },
        ]
    },
    "panels": panels,
}
Path(__file__).with_name("ssmserve-dashboard.json").write_text(json.dumps(dash, indent=2) + "\n")
