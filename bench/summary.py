"""BENCHMARKS.md's table of current figures, from the result files the benchmarks write.

Usage::

    ./dev bench --summary                                         # RESULTS_DIR: bench/results
    python bench/summary.py [RESULTS_DIR]                         # print the rows
    python bench/summary.py RESULTS_DIR --write BENCHMARKS.md     # and update its table

Each headline figure below is one row: the figure, what it measured, its peer or limit
(measured in the same run, or a goal), the ratio of the two, the command that produced it
(the result file's own ``command``, else the run's in ``bench/suite.py``'s manifest), and
the date (the result file's ``date``, else the day it was written). ``--write`` replaces,
in the table between the markers of the page, every row whose result file is there, and
keeps the other rows as they stand, so the table always shows the latest measurement of
each figure; one benchmark run on its own (``./dev bench NAME``) updates just its rows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import suite

BEGIN = "<!-- current figures: bench/summary.py writes the rows between these markers -->"
END = "<!-- end of current figures -->"
HEADER = ["figure", "measured", "peer or limit (same run)", "ratio", "command", "date"]

#: How bench_server_cpu and bench_served_memory name this checkout's server (not a baseline).
SHIPPED = "as shipped"

#: One row's cells after the figure's name: measured, peer or limit, ratio.
Cells = tuple[str, str, str]


def fmt(value: float) -> str:
    """3 significant figures below 100, whole numbers with thousands separators above."""
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def joined(values: Sequence[float]) -> str:
    return " / ".join(fmt(v) for v in values)


@dataclass(frozen=True)
class Figure:
    name: str  # the row's first cell: the key the page's table is merged on
    source: str  # RESULTS_DIR/<source>.json: a run's result in bench/suite.py's manifest
    cells: Callable[[dict[str, Any]], Cells]


# ---------------------------------------------------------------------------- the rows


def _bf16_memory(d: dict[str, Any]) -> Cells:
    ratio = d["resident_over_stored"]
    return (
        fmt(ratio["bf16"]),
        f"goal <= 1.15; float32 model: {fmt(ratio['f32'])}",
        fmt(ratio["bf16"] / 1.15),
    )


def _bf16_decode(d: dict[str, Any]) -> Cells:
    ms = d["decode_ms"]
    ours = [ms[b]["bf16"] for b in ("1", "8")]
    peer = [ms[b]["f32"] for b in ("1", "8")]
    ratio = [d["decode_bf16_over_f32"][b] for b in ("1", "8")]
    return joined(ours), f"the same model in float32: {joined(peer)} (goal <= 0.6x)", joined(ratio)


def _q8_decode(d: dict[str, Any]) -> Cells:
    """bench_bf16: Q8_0 (quantised at load) beside the same model in float32."""
    ms = d["decode_ms"]
    ours = [ms[b]["q8_0"] for b in ("1", "8")]
    peer = [ms[b]["f32"] for b in ("1", "8")]
    ratio = [d["decode_q8_0_over_f32"][b] for b in ("1", "8")]
    held = d["q8_0_resident_over_f32"]
    return (
        joined(ours),
        f"the same model in float32: {joined(peer)} (resident {fmt(held)}x)",
        joined(ratio),
    )


def _q8_accuracy(d: dict[str, Any]) -> Cells:
    """bench_q8_accuracy: each engine's Q8_0 logit error against its float32 run."""
    ours, peer = d["ssmserve_q8_0_vs_own_f32"], d["llama_cpp_q8_0_vs_own_f32"]
    return (
        f"{fmt(ours)} (max abs logit {fmt(d['max_abs_logit'])})",
        f"llama.cpp's Q8_0 file: {fmt(peer)} (goal <= 1x)",
        fmt(ours / peer),
    )


def _big_memory(d: dict[str, Any]) -> Cells:
    """bench_big_model: the serving worker's resident memory against the stored bytes."""
    return (
        fmt(d["resident_bytes"] / 1e9),
        f"stored bytes: {fmt(d['stored_bytes'] / 1e9)} (serving {fmt(d['load']['serving_s'])} s "
        f"after the process started)",
        fmt(d["resident_over_stored"]),
    )


def _big_decode(d: dict[str, Any]) -> Cells:
    ours, peer = d["batch_1"]["ms_per_token"], d["engine_alone"]["1"]["step_us_median"] / 1e3
    calls = d["batch_1"]["engine_calls"]
    inside = calls["seconds"] / calls["calls"] * 1e3
    return (
        fmt(ours),
        f"the engine alone: {fmt(peer)} (its calls inside the server: {fmt(inside)})",
        fmt(ours / peer),
    )


def _big_16(d: dict[str, Any]) -> Cells:
    ours, peer = d["sessions_16"]["tokens_per_s"], d["engine_alone"]["16"]["steps_per_s"]
    batch = d["sessions_16"]["engine_calls"]["mean_batch"]
    return (
        fmt(ours),
        f"the engine alone, batch 16: {fmt(peer)} (served engine calls: {fmt(batch)} "
        "sessions each)",
        fmt(ours / peer),
    )


def _big_64(d: dict[str, Any]) -> Cells:
    r = d["sessions_64"]
    per, bound = r["rss_growth_per_session_bytes"] / 2**20, d["session_bound_bytes"] / 2**20
    return (
        f"{fmt(per)} ({r['served']}/{r['sessions']} served, {fmt(r['tokens_per_s'])} tokens/s)",
        f"state + 64 kept outputs: {fmt(bound)}",
        fmt(per / bound),
    )


def _signal_model(kind: str) -> Callable[[dict[str, Any]], Cells]:
    """The trained model's error beside the best linear AR and the last value."""

    def cells(d: dict[str, Any]) -> Cells:
        errors = d["errors_over_std"]
        ours = errors[d["model"]][kind]["mean"]
        ar_name = f"linear AR({d['ar_order']})"
        ar, last = errors[ar_name][kind]["mean"], errors["last value"][kind]["mean"]
        return fmt(ours), f"{ar_name}: {fmt(ar)}; last value: {fmt(last)}", fmt(ours / ar)

    return cells


def _hf_peer(d: dict[str, Any]) -> Cells:
    peer = min(d["torch_p50_ms"], d["torch_flush_denormal_p50_ms"])
    return fmt(d["ours_p50_ms"]), f"transformers: {fmt(peer)}", fmt(d["ours_p50_ms"] / peer)


def _mamba2_token(d: dict[str, Any]) -> Cells:
    return fmt(d["ours_p50_ms"]), f"transformers: {fmt(d['torch_p50_ms'])}", fmt(d["ratio_p50"])


def _mamba2_batch(d: dict[str, Any]) -> Cells:
    ours, peer = d["ours_batch_tokens_per_s"], d["torch_batch_tokens_per_s"]
    return fmt(ours), f"transformers: {fmt(peer)}", fmt(ours / peer)


def _kizzasi(d: dict[str, Any]) -> tuple[float, float, dict[str, Any]]:
    peer = d["kizzasi"]
    return (
        min(peer["before"]["step_us_p50"], peer["after"]["step_us_p50"]),
        max(peer["before"]["steps_per_s"], peer["after"]["steps_per_s"]),
        d["signal"]["batches"],
    )


def _engine_batch_1(d: dict[str, Any]) -> Cells:
    peer_us, _, batches = _kizzasi(d)
    ours = batches["1"]["step_ms"] * 1e3
    return fmt(ours), f"kizzasi 0.2.3: {fmt(peer_us)}", fmt(ours / peer_us)


def _engine_batch_64(d: dict[str, Any]) -> Cells:
    _, peer_rate, batches = _kizzasi(d)
    ours = batches["64"]["steps_per_s"]
    return fmt(ours), f"kizzasi, one stream: {fmt(peer_rate)}", fmt(ours / peer_rate)


def _engine_floor(d: dict[str, Any]) -> Cells:
    ratios = [d["signal"]["batches"][b]["vs_floor"] for b in ("1", "64", "256")]
    return joined(ratios), "goal <= 1.5", joined([r / 1.5 for r in ratios])


def _served_p50(d: dict[str, Any]) -> Cells:
    parts = d["served_p50_parts_ms"]
    return (
        fmt(parts["served"]),
        f"budget (echo + engine + append + 0.1 ms): {fmt(parts['budget'])}",
        fmt(parts["served"] / parts["budget"]),
    )


def _snapshot_p99(d: dict[str, Any]) -> Cells:
    p99 = d["snapshot_p99_ms"]
    return (
        fmt(p99["snapshot every 8 steps, one phase"]),
        f"without snapshots: {fmt(p99['no snapshot due'])} (goal <= 1.25x)",
        fmt(d["snapshot_p99_rise"]),
    )


def _snapshot_write(d: dict[str, Any]) -> Cells:
    r = d["redis"]
    return (
        fmt(r["snapshot_big_p50_ms"]),
        f"a bare SET of the same bytes: {fmt(r['setbig_p50_ms'])}",
        fmt(r["snapshot_big_p50_ms"] / r["setbig_p50_ms"]),
    )


def _rollback(d: dict[str, Any]) -> Cells:
    ms = d["rollback_p50_ms"]["32"]
    return fmt(ms), "goal <= 5", fmt(ms / 5)


def _server_rounds(d: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rounds = [r for r in d["rounds"] if r["sessions"] == 3000 and r["server"].startswith(SHIPPED)]
    if not rounds:
        raise KeyError("no round of 3,000 sessions")
    return (
        [r for r in rounds if not r["server"].endswith("by step")],
        [r for r in rounds if r["server"].endswith("by step")],
    )


def _server_cpu(d: dict[str, Any]) -> Cells:
    runs, _ = _server_rounds(d)
    us = statistics.median(r["server_cpu_us_per_step"] for r in runs)
    return fmt(us), "goal <= 25", fmt(us / 25)


def _served_at_scale(d: dict[str, Any]) -> Cells:
    runs, per_step = _server_rounds(d)
    ours = statistics.median(r["steps_per_s"] for r in runs)
    peer = statistics.median(r["steps_per_s"] for r in per_step)
    return fmt(ours), f"the same steps one by one (per-step path): {fmt(peer)}", fmt(ours / peer)


def _served_memory(d: dict[str, Any]) -> Cells:
    rows = [
        r
        for r in d["rows"]
        if r["steps"] == 40 and r["sessions"] == 3000 and r["server"] == SHIPPED
    ]
    if not rows:
        raise KeyError("no row of 3,000 sessions at 40 steps")
    kib = statistics.median(r["idle_kib"][-1] for r in rows)
    own = rows[0]["own_kib"]
    return (
        fmt(kib),
        f"own data (state + history + outputs): {fmt(own)} (goal <= 1.3x)",
        fmt(kib / own),
    )


def _memory_130m(d: dict[str, Any]) -> Cells:
    rss = d["130m_batched_rss_per_session_bytes"] / 1024
    held = (d["130m_batched_state_bytes"] + d["130m_batched_history_bytes"]) / 1024
    return fmt(rss), f"state + history: {fmt(held)}", f"{rss / held:.3f}"


def _migration(d: dict[str, Any]) -> Cells:
    p50 = [d["downtime_p50_ms"]["demo"], d["downtime_p50_ms"]["m130"]]
    return joined(p50), "goal <= 20", joined([v / 20 for v in p50])


def _checkpoint(d: dict[str, Any]) -> Cells:
    ms = [d["encode_ms"], d["decode_ms"]]
    format1 = joined([d["format1_encode_ms"], d["format1_decode_ms"]])
    return (
        joined(ms),
        f"memcpy of the state: {fmt(d['memcpy_ms'])} (goal <= 3x; format 1: {format1})",
        joined([v / d["memcpy_ms"] for v in ms]),
    )


def _takeover(event: str, keepalive: list[float]) -> Callable[[dict[str, Any]], Cells]:
    def cells(d: dict[str, Any]) -> Cells:
        rows = sorted(
            (r for r in d["rows"]
             if r["code"] != "baseline" and r["event"] == event and r["keepalive_s"] == keepalive),
            key=lambda r: r["ttl_s"],
        )  # fmt: skip
        if not rows:
            raise KeyError(event)
        return (
            joined([r["p50_ms"] for r in rows]),
            f"the lease TTL: {joined([r['ttl_s'] * 1e3 for r in rows])}",
            joined([r["p50_over_ttl"] for r in rows]),
        )

    return cells


def _replication(sessions: int, per_message: int) -> Callable[[dict[str, Any]], Cells]:
    def cells(d: dict[str, Any]) -> Cells:
        rate = {
            r["wait_replicas"]: r["steps_per_s"]
            for r in d["rows"]
            if r["sessions"] == sessions and r["per_message"] == per_message
        }
        return (
            fmt(rate["auto"]),
            f"--redis-wait-replicas 0: {fmt(rate['0'])}",
            fmt(rate["auto"] / rate["0"]),
        )

    return cells


def _fsync(cases: Sequence[tuple[int, int]]) -> Callable[[dict[str, Any]], Cells]:
    """bench_fsync: served steps/s with the Redis at appendfsync always beside everysec, per
    (sessions, steps per message), and everysec's aof_delayed_fsync over the run."""

    def cells(d: dict[str, Any]) -> Cells:
        rate = {
            (r["sessions"], r["per_message"], r["appendfsync"]): r["steps_per_s"] for r in d["rows"]
        }
        ours = [rate[(k, m, "always")] for k, m in cases]
        peer = [rate[(k, m, "everysec")] for k, m in cases]
        delayed = d["redis"]["everysec"]["aof_delayed_fsync"]
        return (
            joined(ours),
            f"appendfsync everysec: {joined(peer)} (its aof_delayed_fsync: {delayed})",
            joined([a / b for a, b in zip(ours, peer, strict=True)]),
        )

    return cells


def _side_by_side(name: str, base: str, goal: str) -> Callable[[dict[str, Any]], Cells]:
    def cells(d: dict[str, Any]) -> Cells:
        rate = d["steps_per_s"]
        return (
            fmt(rate[name]),
            f"{base}: {fmt(rate[base])} ({goal})",
            f"{rate[name] / rate[base]:.3g}",
        )

    return cells


def _llama_prefill(d: dict[str, Any]) -> Cells:
    ours, peer = d["ssmserve_ms"]["prefill"], d["llama_cpp_ms"]["prefill"]
    return fmt(ours), f"llama.cpp: {fmt(peer)} (goal <= {d['prefill_goal']:g}x)", fmt(ours / peer)


def _llama_decode(d: dict[str, Any]) -> Cells:
    ours, peer = d["ssmserve_ms"], d["llama_cpp_ms"]
    ratios = [ours[k] / peer[k] for k in ("step", "step8")]
    return (
        joined([ours["step"], ours["step8"]]),
        f"llama.cpp: {joined([peer['step'], peer['step8']])}",
        joined(ratios),
    )


def _llama_save(d: dict[str, Any]) -> Cells:
    ours, peer = d["ssmserve_ms"], d["llama_cpp_ms"]
    limit = (
        f"memcpy of the state: {fmt(ours['memcpy'])} (goal <= {d['save_over_memcpy_goal']:g}x); "
        f"llama.cpp's state save: {fmt(peer['save'])}"
    )
    return fmt(ours["save"]), limit, fmt(ours["save"] / ours["memcpy"])


def _accuracy(preset: str) -> Callable[[dict[str, Any]], Cells]:
    """bench_accuracy's max abs logit error against float64, ssmserve beside transformers'
    float32 step path, and the argmaxes that agree with the reference's."""

    def cells(d: dict[str, Any]) -> Cells:
        r = d["presets"][preset]
        ours, peer = r["ours"], r["float32"]
        return (
            f"{ours['max_abs']:.3g} ({ours['argmax_agree']}/{ours['positions']} argmax)",
            f"transformers float32: {peer['max_abs']:.3g} "
            f"({peer['argmax_agree']}/{peer['positions']} argmax)",
            fmt(ours["max_abs"] / peer["max_abs"]),
        )

    return cells


def _fair_prefill(d: dict[str, Any]) -> Cells:
    """bench_fair_prefill: a generating session's mean time between tokens while another
    session's prompt is prefilled, beside its time alone (the ratio: the median of each
    round's), and what the prompt pays."""
    return (
        fmt(d["decode_gap_beside_prompt_ms"]),
        f"alone: {fmt(d['decode_gap_alone_ms'])} (goal <= 1.5x; the prompt took "
        f"{fmt(d['prompt_ratio'])}x its time alone)",
        fmt(d["gap_ratio"]),
    )


def _http_chat(d: dict[str, Any]) -> Cells:
    """bench_http_chat: time to first token of the chat's last turn and the mean of its
    turns after the first, with the prefix cache beside without it."""
    cached, uncached = d["ttft_ms"]["cached"], d["ttft_ms"]["uncached"]
    ours = [cached[-1], statistics.mean(cached[1:])]
    peer = [uncached[-1], statistics.mean(uncached[1:])]
    return (
        joined(ours),
        f"no prefix cache: {joined(peer)}",
        joined([a / b for a, b in zip(ours, peer, strict=True)]),
    )


def _forecast(d: dict[str, Any]) -> Cells:
    f = d["demo"]["forecast"]["128"]
    return (
        fmt(f["served_ms"]),
        f"by hand (fork + ping-pong): {fmt(f['by_hand_ms'])}",
        fmt(f["served_ms"] / f["by_hand_ms"]),
    )


def _workers(d: dict[str, Any]) -> Cells:
    rate = {(r["topology"], r["workers"]): r["steps_per_s"] for r in d["workers"]}
    ours, base = rate[("cluster", 2)], rate[("single", 1)]
    return fmt(ours), f"1 worker on one Redis: {fmt(base)}", fmt(ours / base)


def _group_commit(d: dict[str, Any]) -> Cells:
    (row,) = (r for r in d["group_commit"] if r["topology"] == "cluster" and r["sessions"] == 64)
    return (
        fmt(row["grouped_appends_per_s"]),
        f"one call per session: {fmt(row['concurrent_appends_per_s'])}",
        fmt(row["grouped_over_concurrent"]),
    )


def _path(trace: str, goals: tuple[int, ...]) -> Callable[[dict[str, Any]], Cells]:
    """bench/trace_path.py's server side of one trace: crossings / modules, against the
    goals for the crossings (and the modules, when there are two), and the baseline
    checkout's figures when it ran beside one."""

    def cells(d: dict[str, Any]) -> Cells:
        measured = [d[trace]["crossings"], d[trace]["modules"]]
        limit = "goal " + " / ".join(f"<= {g}" for g in goals)
        limit += " crossings" if len(goals) == 1 else ""
        if "baseline" in d:
            base = d["baseline"]
            limit += f" ({base['commit']}: {base[trace]['crossings']} / {base[trace]['modules']})"
        if "components" in d[trace]:
            between = d[trace]["component_crossings"], len(d[trace]["components"])
            limit += f"; between components: {between[0]} / {between[1]}"
        ratios = [m / g for m, g in zip(measured, goals, strict=False)]
        return " / ".join(str(m) for m in measured), limit, joined(ratios)

    return cells


FIGURES = [
    Figure("mamba-130m-shaped decode, batch 1, ms per token (p50)", "hf_peer", _hf_peer),
    Figure("mamba2-130m-shaped decode, batch 1, ms per token (p50)", "mamba2", _mamba2_token),
    Figure("mamba2-130m-shaped decode, batch 64, tokens/s", "mamba2", _mamba2_batch),
    Figure("mamba-130m-shaped 512-token prompt, last logits, ms", "llama_cpp", _llama_prefill),
    Figure(
        "mamba2-130m-shaped 512-token prompt, last logits, ms", "llama_cpp_mamba2", _llama_prefill
    ),
    Figure(
        "mamba-130m-shaped decode step beside llama.cpp, batch 1 / 8, ms",
        "llama_cpp",
        _llama_decode,
    ),
    Figure(
        "mamba2-130m-shaped decode step beside llama.cpp, batch 1 / 8, ms",
        "llama_cpp_mamba2",
        _llama_decode,
    ),
    Figure(
        "mamba-130m-shaped Q8_0 decode step beside llama.cpp's Q8_0, batch 1 / 8, ms",
        "llama_cpp_q8",
        _llama_decode,
    ),
    Figure(
        "mamba2-130m-shaped Q8_0 decode step beside llama.cpp's Q8_0, batch 1 / 8, ms",
        "llama_cpp_mamba2_q8",
        _llama_decode,
    ),
    Figure(
        "mamba-130m-shaped Q8_0 max abs logit error vs the float32 model, 16 rows",
        "q8_accuracy_mamba",
        _q8_accuracy,
    ),
    Figure(
        "mamba2-130m-shaped Q8_0 max abs logit error vs the float32 model, 16 rows",
        "q8_accuracy_mamba2",
        _q8_accuracy,
    ),
    Figure(
        "mamba-130m-shaped session state saved (checkpoint encode), ms", "llama_cpp", _llama_save
    ),
    Figure(
        "mamba2-130m-shaped session state saved (checkpoint encode), ms",
        "llama_cpp_mamba2",
        _llama_save,
    ),
    Figure(
        "mamba-130m-shaped max abs logit error vs float64, 16 tokens",
        "accuracy",
        _accuracy("mamba-130m"),
    ),
    Figure(
        "mamba2-130m-shaped max abs logit error vs float64, 16 tokens",
        "accuracy",
        _accuracy("mamba2-130m"),
    ),
    Figure(
        "mamba-790m-shaped max abs logit error vs float64, 16 tokens",
        "accuracy",
        _accuracy("mamba-790m"),
    ),
    Figure("engine step, signal 256x4 model, batch 1, us", "engine", _engine_batch_1),
    Figure("engine steps/s, signal 256x4 model, batch 64", "engine", _engine_batch_64),
    Figure("engine step / floor, signal 256x4 model, batch 1 / 64 / 256", "engine", _engine_floor),
    Figure("served step p50, one session, durability log, ms", "service", _served_p50),
    Figure(
        "step p99 while snapshots are written, 64 lockstep sessions, ms", "service", _snapshot_p99
    ),
    Figure("snapshot write of a 2.8 MiB state to Redis, p50 ms", "service", _snapshot_write),
    Figure("rollback with 32 replayed steps, p50 ms", "service", _rollback),
    Figure(
        "server CPU per step, 3,000 sessions, 8 steps of each per message, us",
        "server_cpu",
        _server_cpu,
    ),
    Figure(
        "served steps/s, 3,000 sessions, 8 steps of each per message",
        "server_cpu",
        _served_at_scale,
    ),
    Figure(
        "memory per resident session, demo model, served, 40 steps, KiB",
        "served_memory",
        _served_memory,
    ),
    Figure("memory per resident session, mamba-130m-shaped, KiB", "memory", _memory_130m),
    Figure("migration downtime p50, demo / 2.81 MiB state, ms", "migration", _migration),
    Figure("checkpoint encode / decode, 2.81 MiB state, ms", "checkpoint", _checkpoint),
    Figure(
        "takeover after kill -9, p50 ms, lease TTL 0.5 / 1 / 2 s",
        "failover",
        _takeover("kill -9", [2.0, 2.0]),
    ),
    Figure(
        "takeover after a freeze, client keepalive 2 s + 2 s, p50 ms, TTL 0.5 / 1 / 2 s",
        "failover",
        _takeover("freeze", [2.0, 2.0]),
    ),
    Figure(
        "served steps/s on Sentinel + 1 replica, 1 session, 1 step per message",
        "replication",
        _replication(1, 1),
    ),
    Figure(
        "served steps/s on Sentinel + 1 replica, 64 sessions, 8 steps per message",
        "replication",
        _replication(64, 8),
    ),
    Figure(
        "appendfsync always / everysec, served steps/s, 1 session x 1 step / 64 sessions x 8 "
        "steps per message",
        "fsync",
        _fsync([(1, 1), (64, 8)]),
    ),
    Figure(
        "served steps/s with TLS and tokens, 64 sessions",
        "security",
        _side_by_side("TLS + token", "plaintext", "goal: >= 0.9x"),
    ),
    Figure(
        "served steps/s with metrics scraped every second, 64 sessions",
        "metrics",
        _side_by_side("metrics on, scraped 1/s", "metrics off", "goal: >= 0.97x"),
    ),
    Figure("forecast of 128 steps, demo model, ms", "forecast", _forecast),
    Figure(
        "10-turn chat over --http, mamba-130m-shaped, time to first token at turn 10 / "
        "mean of turns 2-10, ms",
        "http_chat",
        _http_chat,
    ),
    Figure(
        "time between generated tokens beside another session's 1,024-token prompt, "
        "mamba-130m-shaped, mean ms",
        "fair_prefill",
        _fair_prefill,
    ),
    Figure("served steps/s, 2 workers on a 3-master Redis Cluster", "scale", _workers),
    Figure("log appends/s, 64 sessions a tick, Redis Cluster", "scale", _group_commit),
    Figure(
        "mamba-130m-shaped BF16 model kept 16-bit: resident memory / stored bytes",
        "bf16",
        _bf16_memory,
    ),
    Figure(
        "mamba-130m-shaped Q8_0 decode (--quantize q8_0), batch 1 / 8, ms per token",
        "bf16",
        _q8_decode,
    ),
    Figure("mamba-130m-shaped BF16 decode, batch 1 / 8, ms per token", "bf16", _bf16_decode),
    Figure(
        "mamba-2.8b-shaped BF16 model served: worker resident memory, GB", "big_model", _big_memory
    ),
    Figure("mamba-2.8b-shaped BF16 served decode, batch 1, ms per token", "big_model", _big_decode),
    Figure(
        "mamba-2.8b-shaped BF16 served, 16 sessions generating at once, tokens/s",
        "big_model",
        _big_16,
    ),
    Figure(
        "mamba-2.8b-shaped BF16 served, 64 sessions at once: memory per session, MiB",
        "big_model",
        _big_64,
    ),
    Figure(
        "falcon-mamba-7b-shaped Q8_0 model served: worker resident memory, GB",
        "big_model_7b_q8",
        _big_memory,
    ),
    Figure(
        "falcon-mamba-7b-shaped Q8_0 served decode, batch 1, ms per token",
        "big_model_7b_q8",
        _big_decode,
    ),
    Figure(
        "falcon-mamba-7b-shaped Q8_0 served, 16 sessions generating at once, tokens/s",
        "big_model_7b_q8",
        _big_16,
    ),
    Figure(
        "falcon-mamba-7b-shaped Q8_0 served, 64 sessions at once: memory per session, MiB",
        "big_model_7b_q8",
        _big_64,
    ),
    Figure(
        "trained CGM model (examples/), one-step MAE on held-out readings, training stds",
        "signal_model",
        _signal_model("mae"),
    ),
    Figure(
        "trained CGM model (examples/), one-step RMSE on held-out readings, training stds",
        "signal_model",
        _signal_model("rmse"),
    ),
    Figure(
        "one Stream step, server side: ssmserve module crossings / modules",
        "trace_path",
        _path("stream_step", (35, 12)),
    ),
    Figure(
        "one Migrate, server side: ssmserve module crossings / modules",
        "trace_path",
        _path("migrate", (45,)),
    ),
]


# ---------------------------------------------------------------------------- the table


def rows_from(results: Path) -> dict[str, list[str]]:
    """The rows the result files in ``results`` give, by figure; a missing file, or one
    without a figure's fields (a skipped peer, an older benchmark), gives none."""
    rows: dict[str, list[str]] = {}
    for figure in FIGURES:
        path = results / f"{figure.source}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        try:
            cells = figure.cells(data)
        except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as exc:
            print(f"({figure.source}.json: no {figure.name!r}: {exc!r})", file=sys.stderr)
            continue
        day = data.get("date") or (
            datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.UTC).date().isoformat()
        )
        command = data.get("command")
        if not (isinstance(command, str) and command.startswith("./dev bench ")):
            command = suite.row_command(figure.source)  # a result written outside the suite
        rows[figure.name] = [figure.name, *cells, f"`{command}`", day]
    return rows


def suite_command(cell: str) -> str:
    """A kept row's command in the suite's form: ``bench/bench_NAME.py ARGS`` (or
    ``bench/NAME.py``) as ``./dev bench NAME ARGS``; any other command as it is."""
    match = re.fullmatch(r"`bench/(?:bench_)?(\w+)\.py( [^`]*)?`", cell)
    if match is None or match[1] not in suite.BY_NAME:
        return cell
    return f"`./dev bench {match[1]}{match[2] or ''}`"


def render(rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _cells_of(line: str) -> list[str]:
    inner = line.strip().removeprefix("|").removesuffix("|")
    parts, cell, escaped = [], "", False
    for ch in inner:
        if ch == "|" and not escaped:
            parts.append(cell.strip())
            cell = ""
        else:
            cell += ch
        escaped = ch == "\\"
    parts.append(cell.strip())
    return [p.replace("\\|", "|") for p in parts]


def merge(page: str, fresh: dict[str, list[str]]) -> str:
    """``page`` with the rows of ``fresh`` in its table (by figure), the others kept."""
    if BEGIN not in page or END not in page:
        raise SystemExit(f"the page has no table between {BEGIN!r} and {END!r}")
    head, rest = page.split(BEGIN, 1)
    body, tail = rest.split(END, 1)
    kept = {}
    for line in body.strip().splitlines()[2:]:
        cells = _cells_of(line)
        cells[4] = suite_command(cells[4])
        kept[cells[0]] = cells
    order = [f.name for f in FIGURES] + [name for name in kept if name not in fresh]
    rows = [
        fresh.get(name) or kept[name]
        for name in dict.fromkeys(order)
        if name in fresh or name in kept
    ]
    return f"{head}{BEGIN}\n{render(rows)}\n{END}{tail}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", type=Path, default=Path("bench/results"))
    parser.add_argument("--write", type=Path, metavar="PAGE", help="update this page's table")
    args = parser.parse_args(argv)
    fresh = rows_from(args.results)
    print(render(list(fresh.values())) if fresh else f"(no results in {args.results})")
    if args.write:
        args.write.write_text(merge(args.write.read_text(), fresh))
        print(f"\n{len(fresh)} of {len(FIGURES)} figures written to {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
