"""One table of every issue-5 figure, from the JSON the benchmarks of one run wrote.

Usage: ``python bench/summary.py RESULTS_DIR`` (``bench/run`` calls it last). Reads
``engine.json``, ``hf_peer.json``, ``service.json`` and ``memory.json``; a missing or
skipped file leaves its rows out and says so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import table


def load(directory: Path, name: str) -> dict[str, Any] | None:
    path = directory / f"{name}.json"
    if not path.exists():
        print(f"({name}: no results)")
        return None
    data = json.loads(path.read_text())
    if data.get("skipped"):
        print(f"({name}: {data.get('notes', 'skipped')})")
        return None
    return data


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def main() -> int:
    directory = Path(sys.argv[1])
    rows: list[list[object]] = []
    engine = load(directory, "engine")
    if engine is not None:
        small = engine["signal"]
        ours_1 = small["batches"]["1"]["step_ms"] * 1e3
        ours_64 = small["batches"]["64"]["steps_per_s"]
        peer = engine.get("kizzasi")
        if peer:
            p_us = min(peer["before"]["step_us_p50"], peer["after"]["step_us_p50"])
            p_sps = max(peer["before"]["steps_per_s"], peer["after"]["steps_per_s"])
            r1, r64 = ours_1 / p_us, ours_64 / p_sps
            rows.append(["engine batch-1 step, us", ours_1, f"kizzasi {p_us:.0f}", r1,
                         "<= 1.0x", verdict(r1 <= 1.0)])  # fmt: skip
            rows.append(["engine steps/s at 64 vs peer single", ours_64, f"kizzasi {p_sps:,.0f}",
                         r64, ">= 5x", verdict(r64 >= 5)])  # fmt: skip
        rows.append(["  same, share of sgemm ceiling", ours_64,
                     f"ceiling {small['ceiling_steps_per_s']:,.0f}",
                     small["ceiling_fraction_64"], "-", "-"])  # fmt: skip
    hf = load(directory, "hf_peer")
    if hf is not None:
        faster = min(hf["torch_p50_ms"], hf["torch_flush_denormal_p50_ms"])
        ratio = hf["ours_p50_ms"] / faster
        peers = f"torch {hf['torch_p50_ms']:.1f} / ftz {hf['torch_flush_denormal_p50_ms']:.1f}"
        rows.append(["130m per token batch 1, ms", hf["ours_p50_ms"], peers, ratio,
                     "<= 0.7x", verdict(ratio <= 0.7)])  # fmt: skip
    service = load(directory, "service")
    if service is not None:
        for count, t in service["throughput"].items():
            best = max(t["stream_per_session"], t["mux_1"], t["mux_8_pipelined"])
            target = ">= 20k" if count == "64" else "-"
            rows.append([f"served steps/s, {count} sessions (demo)", best,
                         f"echo {t['echo_msgs_per_s']:,.0f} msg/s",
                         best / t["echo_msgs_per_s"], target,
                         verdict(best >= 20_000) if count == "64" else "-"])  # fmt: skip
            rows.append([f"  message p50 / p99 ms, {count} x 8 steps",
                         t["mux_8_msg_p50_ms"], f"p99 {t['mux_8_msg_p99_ms']:.2f}",
                         "-", "-", "-"])  # fmt: skip
        p99 = service["snapshot_p99_ms"]
        quiet = p99["no snapshot due"]
        rows.append(["p99 with snapshots being written (one phase), ms",
                     p99["snapshot every 8 steps, one phase"], f"without {quiet:.2f}",
                     service["snapshot_p99_rise"], "<= 1.25x",
                     verdict(service["snapshot_p99_rise"] <= 1.25)])  # fmt: skip
        rows.append(["p99 with snapshots being written (phases spread), ms",
                     p99["snapshot every 8 steps, phases spread"], f"without {quiet:.2f}",
                     service["snapshot_p99_rise_spread"], "<= 1.25x",
                     verdict(service["snapshot_p99_rise_spread"] <= 1.25)])  # fmt: skip
        lat = service["latency_ms"]
        rows.append(["served step p50, 1 session (log), ms", lat["log"][0],
                     f"bare echo {lat['echo'][0]:.3f}", lat["log"][0] / lat["echo"][0],
                     "-", "-"])  # fmt: skip
        redis = service["redis"]
        rows.append(["log append (Lua) p50, ms", redis["log_append_p50_ms"],
                     f"bare SET {redis['set16_p50_ms']:.3f}",
                     redis["log_append_p50_ms"] / redis["set16_p50_ms"], "-", "-"])  # fmt: skip
        rows.append(["2.8 MiB snapshot write p50, ms", redis["snapshot_big_p50_ms"],
                     f"bare SET {redis['setbig_p50_ms']:.2f}",
                     redis["snapshot_big_p50_ms"] / redis["setbig_p50_ms"], "-", "-"])  # fmt: skip
    memory = load(directory, "memory")
    if memory is not None:
        for key in sorted(k for k in memory if k.endswith("_rss_per_session_bytes")):
            stem = key.removesuffix("_rss_per_session_bytes")
            held = memory[f"{stem}_state_bytes"] + memory[f"{stem}_history_bytes"]
            rows.append([f"memory per session, {stem}, KiB", memory[key] / 1024,
                         f"state+history {held / 1024:,.1f}", memory[key] / held,
                         "-", "-"])  # fmt: skip
    print("\n# issue 5 summary: ours, the reference beside it, ratio, target\n")
    print(table(["figure", "ssmserve", "reference (same run)", "ratio", "target", "verdict"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
