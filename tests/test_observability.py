"""Metrics scraped over HTTP move as the work they count happens; JSON logs carry the
fields an operator filters on."""

from __future__ import annotations

import json
import logging
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ssmserve.client.errors import FailedPrecondition, NotFound, StepFailed
from ssmserve.client.sync import Client
from ssmserve.server.cluster.ownership import OwnershipSettings
from ssmserve.server.observability.logs import JsonFormatter
from ssmserve.v1 import ssmserve_pb2 as pb
from tests.conftest import random_inputs
from tests.test_service import stream


def scrape(worker) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the worker's /metrics: (name, sorted labels) -> value."""
    url = f"http://{worker.worker.metrics_address}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_move_with_steps_snapshots_rollbacks_forks_and_forecasts(
    start_worker, served_models
):
    model = served_models["demo"]
    w = start_worker(metrics_listen="127.0.0.1:0")
    before = scrape(w)
    assert value(before, "ssmserve_steps_total", model="demo", durability="log") == 0
    sid = w.client.create_session("demo", snapshot_every=4).session_id
    stream(w, sid, random_inputs(model, 10, seed=71), per_message=5)
    w.client.snapshot(sid, label="ten")
    w.client.rollback(sid, to_step=6)  # snapshot 4 + 2 replayed
    w.client.fork(sid)
    w.client.forecast(sid, 5)
    with pytest.raises(NotFound):
        w.client.get_session("nobody")
    # An RPC is timed when its handler returns, which may be just after the client has
    # its answer (grpc.aio sends an abort's status first): wait for those two, bounded.
    rpc = "ssmserve_rpc_server_call_duration_seconds_count"
    after = scrape(w)
    deadline = time.monotonic() + 10
    while not (
        value(after, rpc, rpc_method="Stream", rpc_grpc_status_code="OK")
        and value(after, rpc, rpc_method="GetSession", rpc_grpc_status_code="NOT_FOUND")
    ):
        assert time.monotonic() < deadline, "the RPCs were never timed"
        time.sleep(0.05)
        after = scrape(w)
    assert value(after, "ssmserve_steps_total", model="demo", durability="log") == 10
    assert value(after, "ssmserve_step_latency_seconds_count") == 10
    assert value(after, "ssmserve_engine_batch_size_sum", model="demo") == 10
    assert value(after, "ssmserve_engine_batch_seconds_count", model="demo") >= 2
    assert value(after, "ssmserve_snapshots_total", reason="manual") == 1
    assert value(after, "ssmserve_snapshots_total", reason="periodic") == 2  # steps 4, 8
    assert value(after, "ssmserve_snapshot_bytes_total") > 0
    assert value(after, "ssmserve_rollbacks_total", cause="monitor") == 1
    assert value(after, "ssmserve_replayed_steps_total") >= 2
    assert value(after, "ssmserve_forks_total") == 1
    assert value(after, "ssmserve_forecasts_total", model="demo") == 1
    assert value(after, "ssmserve_forecast_seconds_count") == 1
    assert value(after, "ssmserve_sessions_resident", model="demo", tenant="") == 2
    assert value(after, "ssmserve_queued_steps", model="demo") == 0
    assert value(after, "ssmserve_memory_held_bytes") > 0
    assert value(after, rpc, rpc_method="Stream", rpc_grpc_status_code="OK") == 1
    assert value(after, rpc, rpc_method="GetSession", rpc_grpc_status_code="NOT_FOUND") >= 1
    assert value(after, "ssmserve_redis_command_seconds_count", operation="append_logs") >= 2
    names = {name for name, _ in after}
    assert all(name.startswith("ssmserve_") for name in names if not name.startswith("python"))
    assert not any("session_id" in dict(labels) for _, labels in after)  # bounded labels


def test_guard_rollbacks_and_guard_events_are_counted(start_worker, served_models):
    model = served_models["demo"]
    w = start_worker(metrics_listen="127.0.0.1:0")
    never = pb.GuardRule(
        name="never", check=pb.GuardRule.CHECK_RANGE, action=pb.GuardRule.ACTION_ROLLBACK, max=-1e9
    )
    sid = w.client.create_session("demo", snapshot_every=1, guards=[never]).session_id
    with pytest.raises(StepFailed, match="returned to step 0"):
        w.client.step(sid, random_inputs(model, 1, seed=72)[0])
    samples = scrape(w)
    assert value(samples, "ssmserve_rollbacks_total", cause="guard") == 1
    assert value(samples, "ssmserve_guard_events_total", action="rollback") == 1
    assert value(samples, "ssmserve_steps_total", model="demo", durability="log") == 0


def test_migrations_and_takeovers_are_counted(start_worker, served_models):
    model = served_models["demo"]
    a = start_worker(metrics_listen="127.0.0.1:0", ownership=OwnershipSettings(lease_ttl_s=0.5))
    b = start_worker(metrics_listen="127.0.0.1:0")
    moved = a.client.create_session("demo").session_id
    stream(a, moved, random_inputs(model, 3, seed=73))
    a.client.migrate(moved, b.address)
    samples = scrape(a)
    assert value(samples, "ssmserve_migrations_total", result="ok") == 1
    assert value(samples, "ssmserve_migration_downtime_seconds_count") == 1
    assert value(scrape(b), "ssmserve_takeovers_total") == 0  # a hand-off is no takeover
    drained = b.client.create_session("demo").session_id
    stream(b, drained, random_inputs(model, 2, seed=76))
    assert [p.target for p in b.client.drain(b.address)] == [a.address, a.address]
    b.client.undrain(b.address)
    assert value(scrape(b), "ssmserve_migrations_total", result="ok") == 2  # drains count
    orphan = a.client.create_session("demo").session_id
    stream(a, orphan, random_inputs(model, 3, seed=74))
    a.crash()
    deadline = time.monotonic() + 30  # bound: the lease runs out 0.5 s after the crash
    while b.client.get_session(orphan).owner == a.address:
        assert time.monotonic() < deadline, "the crashed worker's lease never ran out"
        time.sleep(0.05)
    stream(b, orphan, random_inputs(model, 2, seed=75), first_step=4)
    assert value(scrape(b), "ssmserve_takeovers_total") == 1


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.formatter_json = JsonFormatter()
        self.formatter_json.worker_id = "w-test"
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("ssmserve"):
            self.lines.append(self.formatter_json.format(record))


def test_json_logs_carry_worker_session_step_token_and_tenant(start_worker, served_models):
    lines = _Lines()
    root = logging.getLogger()
    root.addHandler(lines)
    try:
        w = start_worker()
        sid = w.client.create_session("demo", "acme~robot-7", snapshot_every=2).session_id
        stream(w, sid, random_inputs(served_models["demo"], 4, seed=76))
        w.client.rollback(sid, to_step=2)
        w.client.close_session(sid)
    finally:
        root.removeHandler(lines)
    records = [json.loads(line) for line in lines.lines]  # every line is one JSON object
    assert all({"time", "level", "logger", "message", "worker_id"} <= r.keys() for r in records)
    events = {r["event"]: r for r in records if r.get("session_id") == sid and "event" in r}
    assert {"created", "rolled_back", "closed"} <= events.keys()
    for r in events.values():
        assert r["tenant"] == "acme" and r["worker_id"] == "w-test"
        assert isinstance(r["step"], int) and r["token"]
    assert events["rolled_back"]["step"] == 2 and events["rolled_back"]["cause"] == "monitor"
    per_step = [r for r in records if r["logger"].endswith("stepper") and "event" not in r]
    assert per_step == []  # nothing is logged per step at INFO


def test_the_metrics_endpoint_stops_with_the_worker(start_worker):
    w = start_worker(metrics_listen="127.0.0.1:0")
    url = f"http://{w.worker.metrics_address}/metrics"
    w.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=5)


def test_server_flags_for_metrics_and_json_logs(tmp_path):
    from ssmserve.server.main import build_parser, settings_from_args

    args = build_parser().parse_args(
        ["--demo", "--data-dir", str(tmp_path), "--metrics-listen", "127.0.0.1:9400",
         "--log-format", "json"]
    )  # fmt: skip
    assert settings_from_args(args).metrics_listen == "127.0.0.1:9400"
    assert args.log_format == "json"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--log-format", "xml"])


def test_a_client_sees_no_difference_with_metrics_on(start_worker, served_models):
    """Metrics are a side channel: the same steps give the same bits."""
    model = served_models["demo"]
    x = random_inputs(model, 6, seed=77)
    plain, measured = start_worker(), start_worker(metrics_listen="127.0.0.1:0")
    out = []
    for w in (plain, measured):
        sid = w.client.create_session("demo").session_id
        got, _ = stream(w, sid, x)
        out.append(got)
    assert out[0].tobytes() == out[1].tobytes()
    with Client(measured.address) as c:
        assert c.get_session(sid).step == 6


def test_the_grafana_dashboard_queries_only_metrics_a_worker_exports():
    import re
    from pathlib import Path

    from ssmserve.server.observability.metrics import Metrics, ResidentCounts, WorkerView

    metrics = Metrics()
    metrics.watch(
        WorkerView(
            residents=ResidentCounts, memory_held=lambda: 0, memory_budget=lambda: 1,
            open_streams=lambda: 0, forecasts_running=dict, draining=lambda: False,
            stored_sessions=lambda: 0,
        )
    )  # fmt: skip
    exported, families = set(), set()
    for family in metrics.registry.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
        exported |= {family.name + s for s in suffixes.get(family.type, [""])}
        families.add(family.name)
    path = Path(__file__).parent.parent / "deploy" / "grafana" / "ssmserve-dashboard.json"
    dashboard = json.loads(path.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(queries) >= 20
    used = {name for q in queries for name in re.findall(r"ssmserve_[a-z_]+", q)}
    assert used - exported == set()
    unused = {f for f in families if not any(u.startswith(f) for u in used)}
    assert unused == set(), "metrics no panel shows"


def test_top_shows_workers_and_sessions_from_the_registry(start_worker, served_models, capsys):
    from ssmserve.client.cli import main
    from tests.test_service import stream as stream_steps

    w = start_worker(ownership=OwnershipSettings(renew_every_s=0.05))
    sid = w.client.create_session("demo", snapshot_every=4).session_id
    stream_steps(w, sid, random_inputs(served_models["demo"], 10, seed=78), per_message=1)
    assert [x.step for x in w.client.list_snapshots(sid)] == [0, 4, 8]  # written by now
    deadline = time.monotonic() + 30  # bound: the next heartbeats carry the new stats
    while (stats := w.client.list_workers()[0].stats).steps < 10 or stats.snapshots < 2:
        assert time.monotonic() < deadline, "the heartbeat never reported the steps"
        time.sleep(0.05)
    assert main(["--server", w.address, "top", "--json", "--interval", "0.1"]) == 0
    data = json.loads(capsys.readouterr().out)
    (worker,) = data["workers"]
    assert (worker["address"], worker["state"], worker["sessions"]) == (w.address, "serving", 1)
    assert worker["step_p50_ms"] > 0 and worker["step_p99_ms"] >= worker["step_p50_ms"]
    assert worker["snapshots"] == 2 and worker["memory_held_bytes"] > 0  # periodic 4 and 8
    (session,) = data["sessions"]
    assert (session["session_id"], session["step"]) == (sid, 10)
    assert session["lease"] == f"held by {w.address}"
    assert main(["--server", w.address, "top", "--once", "--interval", "0.1"]) == 0
    screen = capsys.readouterr().out
    assert "WORKER" in screen and "STEPS/S" in screen and sid in screen and w.address in screen


def test_top_rates_are_differences_over_the_interval():
    from ssmserve.client.top import Look, render, summary

    def worker(steps: int) -> pb.WorkerInfo:
        return pb.WorkerInfo(worker_id="w1", address="a:1", load=1,
                             stats=pb.WorkerStats(steps=steps))  # fmt: skip

    def session(sid: str, step: int, owner: str = "a:1") -> pb.SessionInfo:
        return pb.SessionInfo(session_id=sid, model="m", step=step, resident=bool(owner),
                              owner=owner)  # fmt: skip

    before = Look(10.0, [worker(100)], [session("s1", 5), session("s2", 7)])
    after = Look(12.0, [worker(300)], [session("s1", 205), session("s2", 7, owner="")])
    data = summary(before, after, max_sessions=1)
    assert data["workers"][0]["steps_per_s"] == 100.0
    assert data["sessions"] == [
        {"session_id": "s1", "model": "m", "step": 205, "steps_per_s": 100.0, "snapshots": 0,
         "lease": "held by a:1"}
    ]  # fmt: skip
    assert data["sessions_total"] == 2
    restarted = Look(14.0, [worker(10)], after.sessions)
    assert summary(after, restarted, 5)["workers"][0]["steps_per_s"] == 0.0  # not negative
    assert "released (restorable)" in render(summary(before, after, 5))


def test_loop_histograms_and_counters_expose_what_prometheus_client_would():
    """The lock-free metrics give the same exposition as prometheus-client's own."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from ssmserve.server.observability.loop_metrics import (
        LoopCounter,
        LoopHistogram,
        LoopMetricsCollector,
    )

    buckets = (0.001, 0.01, 0.1)
    ours = CollectorRegistry()
    hist = LoopHistogram("x_seconds", "doc", ["m"], buckets)
    count = LoopCounter("y_total", "doc", ["m"])
    ours.register(LoopMetricsCollector([hist, count]))
    theirs = CollectorRegistry()
    ref_hist = Histogram("x_seconds", "doc", ["m"], registry=theirs, buckets=buckets)
    ref_count = Counter("y_total", "doc", ["m"], registry=theirs)
    for seconds, n in ((0.0005, 1), (0.001, 3), (0.05, 2), (7.0, 1)):
        hist.labels("a").observe(seconds, n)
        count.labels("a").inc(n)
        for _ in range(n):
            ref_hist.labels("a").observe(seconds)
            ref_count.labels("a").inc()

    def samples(registry):
        text = generate_latest(registry).decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if not s.name.endswith("_created")
        }

    assert samples(ours) == pytest.approx(samples(theirs))
    assert value(samples(ours), "x_seconds_bucket", m="a", le="0.001") == 4  # le is inclusive
    assert value(samples(ours), "x_seconds_count", m="a") == 7


# ---------------------------------------------------------------------------- history, plot


def test_history_gives_the_answered_outputs_snapshots_and_events(start_worker, served_models):
    from ssmserve.client.errors import ResourceExhausted
    from ssmserve.server.sessions.manager import ManagerSettings
    from tests.test_service import assert_bit_equal

    model = served_models["demo"]
    w = start_worker(manager=ManagerSettings(max_history_steps=25))
    clamp = pb.GuardRule(name="cap", check=pb.GuardRule.CHECK_RANGE,
                         action=pb.GuardRule.ACTION_CLAMP, max=0.5)  # fmt: skip
    sid = w.client.create_session("demo", snapshot_every=8, guards=[clamp]).session_id
    x = random_inputs(model, 30, seed=79)
    answered, _ = stream(w, sid, x, per_message=4)
    w.client.snapshot(sid, label="mark")
    w.client.rollback(sid, to_step=20)
    h = w.client.history(sid, from_step=3)
    assert (h.first_step, len(h.outputs)) == (3, 18)
    assert_bit_equal(h.outputs, answered[2:20])  # replayed, guards applied: as answered
    assert h.inputs.tobytes() == x[2:20].tobytes()
    assert [s.step for s in h.snapshots] == [0, 8, 16]  # 24 and "mark" at 30 were cut
    guard = [e for e in h.events if e.kind == "guard"]
    assert guard and {e.action for e in guard} == {"clamp"} and guard[0].guard == "cap"
    rollback = [e for e in h.events if e.kind == "rollback"]
    assert [(e.step, e.to_step, e.cause) for e in rollback] == [(30, 20, "monitor")]
    assert len(w.client.history(sid).outputs) == 20  # default: everything replayable
    with pytest.raises(ResourceExhausted, match="at most 25"):
        _too_long(w, model)
    with pytest.raises(FailedPrecondition, match=r"can show steps 1\.\.20"):
        w.client.history(sid, from_step=5, to_step=21)
    assert w.client.get_session(sid).step == 20  # reading changed nothing


def _too_long(w, model):
    sid = w.client.create_session("demo").session_id
    stream(w, sid, random_inputs(model, 26, seed=80))
    return w.client.history(sid)


def test_guard_rollbacks_are_recorded_as_events(start_worker, served_models):
    model = served_models["demo"]
    w = start_worker()
    never = pb.GuardRule(name="never", check=pb.GuardRule.CHECK_RANGE,
                         action=pb.GuardRule.ACTION_ROLLBACK, max=-1e9)  # fmt: skip
    sid = w.client.create_session("demo", snapshot_every=1, guards=[never]).session_id
    with pytest.raises(StepFailed):
        w.client.step(sid, random_inputs(model, 1, seed=81)[0])
    events = w.client.history(sid).events
    assert [(e.kind, e.step) for e in events] == [("guard", 1), ("rollback", 1)]
    assert events[1].cause == "guard" and events[1].to_step == 0


def test_plot_writes_a_png_of_the_session(start_worker, served_models, tmp_path, capsys):
    import struct

    from ssmserve.client.cli import main

    model = served_models["demo"]
    w = start_worker()
    clamp = pb.GuardRule(name="cap", check=pb.GuardRule.CHECK_RANGE,
                         action=pb.GuardRule.ACTION_CLAMP, max=1.0)  # fmt: skip
    sid = w.client.create_session("demo", snapshot_every=10, guards=[clamp]).session_id
    stream(w, sid, random_inputs(model, 40, seed=82))
    w.client.snapshot(sid, label="before-rollback")
    w.client.rollback(sid, to_step=25)
    out = tmp_path / "session.png"
    assert main(["--server", w.address, "plot", sid, "--output", str(out)]) == 0
    assert "steps 1..25" in capsys.readouterr().out
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert (width, height) == (1200, 750)
    missing_dir = str(tmp_path / "no" / "x.png")
    assert main(["--server", w.address, "plot", sid, "--output", missing_dir]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---------------------------------------------------------------------------- tracing


def test_spans_cover_rpcs_engine_batches_redis_writes_and_follow_a_hand_off(
    start_worker, served_models
):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from ssmserve.server.observability.tracing import Tracing

    spans = InMemorySpanExporter()
    a, b = start_worker(), start_worker()
    for w in (a, b):  # one provider per worker, both into the same memory
        w.worker.metrics.tracing = Tracing(exporter=spans, worker_id=w.worker.worker_id)
    sid = a.client.create_session("demo").session_id
    stream(a, sid, random_inputs(served_models["demo"], 4, seed=83))
    with pytest.raises(NotFound):
        a.client.get_session("nobody")
    a.client.migrate(sid, b.address)
    done = spans.get_finished_spans()
    names = [s.name for s in done]
    assert "ssmserve.v1.SessionService/Stream" in names
    assert "engine.batch" in names and "redis.append_logs" in names
    codes = {s.attributes["rpc.grpc.status_code"] for s in done if s.name.endswith("/GetSession")}
    assert 5 in codes  # the refused one: NOT_FOUND
    stream_span = next(s for s in done if s.name.endswith("/Stream"))
    assert stream_span.attributes["rpc.method"] == "Stream"
    assert stream_span.attributes["rpc.service"] == "ssmserve.v1.SessionService"
    migrate = next(s for s in done if s.name.endswith("/Migrate"))
    adopt = next(s for s in done if s.name.endswith("/AdoptSession"))
    assert adopt.context.trace_id == migrate.context.trace_id  # one trace across workers
    assert adopt.resource.attributes["ssmserve.worker_id"] == b.worker.worker_id
    assert {s.resource.attributes["service.name"] for s in done} == {"ssmserve"}


def test_tracing_is_off_and_free_unless_configured():
    from ssmserve.server.observability.tracing import OFF, Tracing

    assert not OFF.enabled and OFF.outgoing() == ()
    with OFF.span("x") as span:
        assert span is None
    assert Tracing().span("a") is Tracing().span("b")  # the one shared no-op


def test_the_serving_gc_sets_its_threshold_freezes_times_pauses_and_puts_all_back():
    import gc

    from ssmserve.server.observability.garbage_collector import GcSettings, ServingGc
    from ssmserve.server.observability.loop_metrics import LoopHistogram

    pauses = LoopHistogram("ssmserve_gc_pause_seconds", "pauses", ["generation"], (0.01, 1.0))
    before, frozen_before = gc.get_threshold(), gc.get_freeze_count()
    collector = ServingGc(GcSettings(young_threshold=12_345), pauses)
    collector.start()
    try:
        assert gc.get_threshold() == (12_345, *before[1:])
        assert gc.get_freeze_count() > frozen_before  # the heap as it was when ready
        gc.collect(0)
        gc.collect(2)
        counts = {values: sum(child.counts) for values, child in pauses._children.items()}
        assert counts[("0",)] >= 1 and counts[("2",)] >= 1 and counts[("1",)] == 0
    finally:
        collector.stop()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
    gc.collect(0)  # no longer observed
    assert sum(sum(c.counts) for c in pauses._children.values()) == 2


def test_the_gc_and_snapshot_spread_flags(tmp_path):
    from ssmserve.server.main import build_parser, settings_from_args

    assert build_parser().parse_args([]).gc_young_threshold == 50_000
    assert build_parser().parse_args(["--gc-young-threshold", "0"]).gc_young_threshold == 0
    base = ["--demo", "--data-dir", str(tmp_path)]
    plain = settings_from_args(build_parser().parse_args(base))
    spread = settings_from_args(build_parser().parse_args([*base, "--spread-snapshots"]))
    assert not plain.manager.defaults.spread_snapshots
    assert spread.manager.defaults.spread_snapshots
