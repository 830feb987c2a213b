"""What the benchmarks share: medians of repeated wall-clock runs, tables, starting a
server process, and the child processes of the side-by-side peers (torch/transformers)."""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

#: How to install the side-by-side peer (bench/run does it).
PEER_INSTALL = ".venv-bench/bin/pip install torch==2.13.0 transformers==5.24.0"


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def table(headers: list[str], rows: list[list[object]]) -> str:
    """A plain fixed-width table (also valid Markdown)."""
    cells = [headers] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def percentiles_ms(samples: list[float]) -> tuple[float, float]:
    """(p50, p99) of ``samples`` seconds, in milliseconds."""
    ms = np.asarray(samples) * 1e3
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


def start_server(cmd: list[str]) -> tuple[subprocess.Popen[str], str]:
    """Start a server process that prints ``... listening on ADDRESS`` first (ssmserve-server,
    ``echo_server.py``), log level WARNING; returns it and the address."""
    env = {**os.environ, "SSMSERVE_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        proc.wait()
        raise SystemExit(f"{shlex.join(cmd)} did not start")
    return proc, line.split()[-1]


def run_peer_child(cmd: list[str]) -> dict[str, Any]:
    """Run a benchmark's child process offline (no Hugging Face downloads); the JSON
    object on the last line of its output."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=True)
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def peer_skipped(script: str, reason: str, json_path: Path | None) -> int:
    """Say why the side-by-side run cannot happen (and write that to ``json_path``)."""
    print(f"{script}: skipped ({reason}); install with: {PEER_INSTALL}")
    if json_path:
        json_path.write_text(json.dumps({"skipped": 1, "notes": f"skipped: {reason}"}) + "\n")
    return 0


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    fields = text[text.rindex(")") + 2 :].split()  # fields from 3 (state) on
    return (int(fields[14 - 3]) + int(fields[15 - 3])) / os.sysconf("SC_CLK_TCK")
