"""What every benchmark shares: the standard flags and the result file, random-weight models,
a private redis-server, worker processes, interleaved rounds and their ratios, tables, and
the child processes of the side-by-side peers.

A benchmark script (``bench/bench_NAME.py``, listed in ``bench/suite.py``'s manifest) is a
plain script that builds its parser with :func:`standard_parser`, measures, and ends with
:func:`write_result`. Every figure of BENCHMARKS.md is a ratio against a peer or a limit
measured in the same run, because this host is shared and its absolute figures drift by
20-40% between runs: :func:`interleaved` runs the cases of one round one after the other,
the first case alternating between rounds, and :func:`ratio` takes each round's ratio and
their median, so both sides of a ratio see the same load.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent

#: How to install the side-by-side peers (``./dev bench`` does it for every benchmark).
PEER_INSTALL = ".venv-bench/bin/pip install torch==2.13.0 transformers==5.24.0"

#: The environment variable through which ``bench/suite.py`` tells a script the command
#: that ran it (``./dev bench NAME ARGS``), for its result file.
COMMAND_ENV = "SSMSERVE_BENCH_COMMAND"

#: Bound on a worker's start-up: its first line, ``... listening on ADDRESS`` (a 2.8B model
#: takes ~50 s to load on this host; the bigger ones pass their own bound).
WORKER_START_S = 120.0
#: Bound on a worker's clean stop after SIGTERM, then SIGKILL.
WORKER_STOP_S = 20.0


# ---------------------------------------------------------------------------- flags, results


def standard_parser(
    doc: str | None, rounds: int | None = None, quick: str | None = None
) -> argparse.ArgumentParser:
    """The parser of a benchmark script: its description (the docstring's first paragraph)
    and the standard flags: ``--json OUT`` always, ``--rounds N`` when ``rounds`` is its
    default, ``--quick`` when ``quick`` says what the smoke run does."""
    first = (doc or "").split("\n\n")[0].strip()
    p = argparse.ArgumentParser(description=first)
    p.add_argument("--json", type=Path, metavar="OUT", help="also write the result (JSON) here")
    if rounds is not None:
        p.add_argument("--rounds", type=int, default=rounds, help=f"interleaved rounds ({rounds})")
    if quick is not None:
        p.add_argument("--quick", action="store_true", help=quick)
    return p


def run_command() -> str:
    """How this run was started: ``./dev bench NAME ARGS`` when the suite ran it, else the
    script's own command line."""
    given = os.environ.get(COMMAND_ENV)
    if given:
        return given
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    return shlex.join([str(shown), *sys.argv[1:]])


#: Bound on ``git describe`` for a result's commit.
GIT_TIMEOUT_S = 10.0


def checkout_commit() -> str:
    """The commit this checkout's code is at (``-dirty`` with uncommitted changes), as asv
    files each result under the commit it measured; ``?`` where git does not answer."""
    try:
        done = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return done.stdout.strip() or "?"


def host_cpu() -> str:
    """The CPU's model name and count: this host is an AMD EPYC on some days, an Intel Xeon
    on others, and absolute figures differ between them."""
    model = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model} x {os.cpu_count()}"


def write_result(path: Path | None, result: Mapping[str, Any], line: bool = True) -> None:
    """Print ``result`` as JSON on one line (the last line of a benchmark's output) unless
    ``line`` is false, and write it to ``path`` stamped with the date (UTC), the command,
    the commit and the host's CPU."""
    if line:
        print(json.dumps(result, default=str))
    if path is None:
        return
    stamped = {
        **result,
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "command": run_command(),
        "commit": checkout_commit(),
        "host": host_cpu(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stamped, indent=2, default=str) + "\n")


# ---------------------------------------------------------------------------- models


def preset_model_config(preset: str) -> Any:
    """The ``ssmserve model init-demo --preset`` config (``engine/presets.py``): a released
    checkpoint's shapes, its weights stood in for by random ones."""
    from ssmserve.server.engine.presets import preset_config

    return preset_config(preset)


def mamba_130m_config() -> Any:
    """state-spaces/mamba-130m's dims: hidden 768, 24 layers, state 16, vocab 50,280."""
    return preset_model_config("mamba-130m")


def config_for(arch: str) -> Any:
    """The 130m preset of that architecture: ``mamba`` or ``mamba2``."""
    return preset_model_config("mamba2-130m" if arch == "mamba2" else "mamba-130m")


def mamba_130m_model() -> Any:
    """A mamba-130m-shaped ``MambaModel`` in memory (random weights, seed 0)."""
    from ssmserve.server.engine.demo import random_tensors
    from ssmserve.server.engine.loader import build_model

    config = mamba_130m_config()
    return build_model(config, random_tensors(config, 0), name="mamba-130m-shaped")


def write_preset_model(directory: Path, config: Any, seed: int = 0) -> Path:
    """A model directory (``config.json`` + ``model.safetensors``, as ``engine/loader.py``
    reads a Hugging Face checkpoint) with random weights of ``seed``."""
    from ssmserve.server.engine.demo import random_tensors
    from ssmserve.server.engine.loader import save_model

    save_model(directory, config, random_tensors(config, seed))
    return directory


# ---------------------------------------------------------------------------- Redis, workers


@contextlib.contextmanager
def private_redis(data_dir: Path) -> Iterator[Any]:
    """A redis-server of this run's own (``EmbeddedRedis``: AOF on, appendfsync everysec,
    loopback, a free port), stopped on exit; yields it (``.url``)."""
    from ssmserve.server.embedded_redis import EmbeddedRedis, EmbeddedRedisSettings

    with EmbeddedRedis(EmbeddedRedisSettings(data_dir=data_dir)) as redis:
        yield redis


def worker_args(
    models: list[tuple[str, Path]], redis_url: str, data_dir: Path, lease_ttl: float = 5.0
) -> list[str]:
    """The arguments after ``python`` of an ``ssmserve-server`` on a free loopback port."""
    cmd = ["-m", "ssmserve.server.main", "--listen", "127.0.0.1:0", "--redis-url", redis_url]
    cmd += ["--data-dir", str(data_dir), "--lease-ttl", str(lease_ttl)]
    for name, directory in models:
        cmd += ["--model", f"{name}={directory}"]
    return cmd


def start_server(cmd: list[str]) -> tuple[subprocess.Popen[str], str]:
    """Start a server process that prints ``... listening on ADDRESS`` first (ssmserve-server,
    ``bench/tools/echo_server.py``), log level WARNING; returns it and the address."""
    env = {**os.environ, "SSMSERVE_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        proc.wait()
        raise SystemExit(f"{shlex.join(cmd)} did not start")
    return proc, line.split()[-1]


class Workers:
    """Worker subprocesses (``sys.executable ARGS``, each logging to ``LOGS/NAME.log``);
    every one is stopped and reaped on :meth:`close`."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[subprocess.Popen[str]] = []

    def start(
        self, args: list[str], name: str, env: Mapping[str, str] | None = None
    ) -> tuple[subprocess.Popen[str], str]:
        """Start one and wait for its ``listening on ADDRESS`` line; returns it and ADDRESS."""
        env = {**os.environ, "SSMSERVE_LOG_LEVEL": "WARNING", **(env or {})}
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 - the child keeps it
        proc = subprocess.Popen(
            [sys.executable, *args], stdout=subprocess.PIPE, stderr=log, text=True, env=env
        )
        log.close()
        self.procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "listening on" not in line:
            proc.kill()
            proc.wait()
            tail = (self.logs / f"{name}.log").read_text()[-2000:]
            raise SystemExit(f"worker {name} did not start:\n{tail}")
        return proc, line.split()[-1]

    def stop(self, proc: subprocess.Popen[str]) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(WORKER_STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        for proc in self.procs:
            self.stop(proc)

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------- rounds, ratios


def interleaved(cases: Mapping[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each case's figure in every round, the cases of a round run one after the other and
    the first of them rotating from round to round, so that every case sees the host's
    drift alike. A case returns its figure of the round (seconds, a rate)."""
    names = list(cases)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(cases[name]())
    return samples


@dataclass(frozen=True)
class Ratio:
    """The per-round ratios of A over B: their median and their spread."""

    median: float
    low: float
    high: float
    rounds: int

    def as_dict(self) -> dict[str, float]:
        return {"median": self.median, "low": self.low, "high": self.high, "rounds": self.rounds}


def ratio(a: list[float], b: list[float]) -> Ratio:
    """A / B round by round (both lists from the same rounds), as their median and range."""
    per_round = [x / y for x, y in zip(a, b, strict=True)]
    return Ratio(statistics.median(per_round), min(per_round), max(per_round), len(per_round))


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


def percentiles_ms(samples: list[float]) -> tuple[float, float]:
    """(p50, p99) of ``samples`` seconds, in milliseconds."""
    ms = np.asarray(samples) * 1e3
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    fields = text[text.rindex(")") + 2 :].split()  # fields from 3 (state) on
    return (int(fields[14 - 3]) + int(fields[15 - 3])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------- tables, peers


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
        write_result(json_path, {"skipped": 1, "notes": f"skipped: {reason}"}, line=False)
    return 0
