"""The benchmark suite: its manifest and its runner (``./dev bench``).

Usage (``./dev bench`` runs this with ``.venv/bin/python``)::

    ./dev bench NAME [ARGS...]   one benchmark: its runs, or the one ARGS name (--quick ...)
    ./dev bench --list           every benchmark, what it needs, the figures it makes
    ./dev bench --summary        BENCHMARKS.md's table from the results already there
    ./dev bench --summary RESULTS --write PAGE   the same from other results, into PAGE
    ./dev bench --all            every benchmark, then the table (also: plain ./dev bench)

The manifest (:data:`BENCHMARKS`) names every benchmark: its script (``bench/NAME.py``,
most ``bench/bench_NAME.py``), its runs (each run: the arguments that BENCHMARKS.md's rows
name, the arguments that only set it up, such as where its models go, and its result
file), and what it needs beyond ``.venv-bench``. Every benchmark makes at least one row
of BENCHMARKS.md's table; ``bench/summary.py`` turns each result file into its rows.

A run writes ``RESULTS/RESULT.json`` (``$BENCH_OUT``, default ``bench/results``), stamped
by the harness with the date and the ``./dev bench`` command that made it. Benchmarks run
in ``.venv-bench`` (``$BENCH_PYTHON`` names another interpreter), which holds the peers
(kizzasi, torch, transformers) and is never ``.venv``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
COMMAND_ENV = "SSMSERVE_BENCH_COMMAND"  # harness.COMMAND_ENV: the result's "command"

#: The peers every benchmark's interpreter holds (``.venv-bench``; never ``.venv``).
PEERS = [
    "cryptography>=42",
    "kizzasi==0.2.3",
    "torch==2.13.0",
    "transformers==5.24.0",
    "bokeh-sampledata==2026.1",
]


@dataclass(frozen=True)
class Run:
    """One run of a benchmark: ``row`` are the arguments BENCHMARKS.md's rows name (the
    run's identity), ``setup`` those that only say where things go ({models} is
    ``RESULTS/models``), ``result`` the name of its result file."""

    result: str
    row: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()


@dataclass(frozen=True)
class Benchmark:
    name: str
    runs: tuple[Run, ...]
    needs: str = ""  # beyond .venv-bench: a peer of its own, disk, a long run
    script: str = ""  # under bench/; default bench_NAME.py

    @property
    def path(self) -> Path:
        return BENCH / (self.script or f"bench_{self.name}.py")


def _one(name: str, *row: str, needs: str = "") -> Benchmark:
    return Benchmark(name, (Run(name, tuple(row)),), needs)


_LLAMA = "llama.cpp's binding and converter ($LLAMA_CPP_PYTHON, $LLAMA_CPP_CONVERTER)"

#: Every benchmark, in the order ``--all`` runs them (BENCHMARKS.md's rows keep this order).
BENCHMARKS: tuple[Benchmark, ...] = (
    _one("engine", needs="kizzasi 0.2.3 (in .venv-bench)"),
    _one("hf_peer", needs="torch + transformers (in .venv-bench)"),
    _one("mamba2", needs="torch + transformers (in .venv-bench)"),
    Benchmark(
        "llama_cpp",
        (
            Run("llama_cpp", (), ("--model", "{models}/mamba-130m",
                                  "--gguf", "{models}/mamba-130m-f32.gguf")),
            Run("llama_cpp_mamba2", ("--arch", "mamba2"),
                ("--model", "{models}/mamba2-130m", "--gguf", "{models}/mamba2-130m-f32.gguf")),
            Run("llama_cpp_q8", ("--quantize", "q8_0"),
                ("--model", "{models}/mamba-130m", "--gguf", "{models}/mamba-130m-q8_0.gguf",
                 "--llama-no-extra-bufts")),
            Run("llama_cpp_mamba2_q8", ("--arch", "mamba2", "--quantize", "q8_0"),
                ("--model", "{models}/mamba2-130m", "--gguf", "{models}/mamba2-130m-q8_0.gguf",
                 "--llama-no-extra-bufts")),
        ),
        needs=_LLAMA,
    ),
    Benchmark(
        "q8_accuracy",
        (
            Run("q8_accuracy_mamba", (), ("--model", "{models}/mamba-130m")),
            Run("q8_accuracy_mamba2", ("--arch", "mamba2"), ("--model", "{models}/mamba2-130m")),
        ),
        needs=_LLAMA,
    ),
    Benchmark(
        "accuracy",
        (Run("accuracy", (), ("--models", "{models}")),),
        needs="torch + transformers in $ACCURACY_PEER_PYTHON (default /work/peers/llama)",
    ),
    _one("memory"),
    _one("served_memory", "--sessions", "3000", "--steps", "40"),
    _one("checkpoint"),
    _one("service"),
    _one("server_cpu", "--sessions", "3000", "--orders", "session,step"),
    _one("migration"),
    _one("failover"),
    _one("replication", needs="redis-sentinel (Redis 7)"),
    _one("fsync"),
    _one("forecast"),
    _one("http_chat"),
    _one("fair_prefill"),
    _one("signal_model", needs="bokeh-sampledata (in .venv-bench): the held-out readings"),
    _one("bf16"),
    Benchmark(
        "big_model",
        (
            Run("big_model", (), ("--model-dir", "{models}/mamba-2.8b")),
            Run("big_model_7b_q8", ("--preset", "falcon-mamba-7b", "--quantize", "q8_0"),
                ("--model-dir", "{models}/falcon-mamba-7b")),
        ),
        needs="disk: 5.5 GB + 14.6 GB of models; ~10 minutes",
    ),
    _one("security"),
    _one("metrics"),
    _one("scale", needs="redis-server with cluster mode (Redis 7)"),
    Benchmark("trace_path", (Run("trace_path"),), script="trace_path.py"),
)  # fmt: skip

BY_NAME = {b.name: b for b in BENCHMARKS}
RUN_OF_RESULT = {run.result: (b, run) for b in BENCHMARKS for run in b.runs}


def row_command(result: str) -> str:
    """The command BENCHMARKS.md's rows from ``result`` name: ``./dev bench NAME ARGS``."""
    bench, run = RUN_OF_RESULT[result]
    return shlex.join(["./dev", "bench", bench.name, *run.row])


def _flags(args: Sequence[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def run_for(bench: Benchmark, args: Sequence[str]) -> Run:
    """The run that ``args`` names: the one with the most of its row arguments among them
    (all of them), else the benchmark's first."""
    given = list(args)
    named = [
        run for run in bench.runs if all(a in given for a in run.row)
    ]  # fmt: skip
    return max(named, key=lambda r: len(r.row), default=bench.runs[0])


def command_for(
    bench: Benchmark, run: Run, args: Sequence[str], python: str, results: Path
) -> list[str]:
    """The script's command line: its run's set-up arguments (those ``args`` do not set),
    ``args`` (the run's row arguments when none are given), and ``--json`` into
    ``results`` unless ``args`` names a file of their own."""
    given = list(args) if args else list(run.row)
    setup = [a.replace("{models}", str(results / "models")) for a in run.setup]
    kept: list[str] = []
    i = 0
    while i < len(setup):  # a flag and, when one follows, its value
        flag = setup[i]
        value = (
            setup[i + 1 : i + 2] if i + 1 < len(setup) and not setup[i + 1].startswith("--") else []
        )
        if flag not in _flags(given):
            kept += [flag, *value]
        i += 1 + len(value)
    out = [] if "--json" in _flags(given) else ["--json", str(results / f"{run.result}.json")]
    return [python, str(bench.path), *kept, *given, *out]


def bench_python() -> str:
    """``$BENCH_PYTHON``, or ``.venv-bench``'s Python with the peers installed into it."""
    chosen = os.environ.get("BENCH_PYTHON")
    if chosen:
        return chosen
    venv = REPO / ".venv-bench"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    print("bench: installing ssmserve and the peers into .venv-bench ...", flush=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "-e", "./client", "-e", "."]
    subprocess.run([*pip, *PEERS], check=True, cwd=REPO)
    return str(python)


def run_benchmark(bench: Benchmark, args: Sequence[str], python: str, results: Path) -> int:
    """Run ``bench``: the run ``args`` names, or every one of its runs when ``args`` is empty."""
    results.mkdir(parents=True, exist_ok=True)
    (results / "models").mkdir(exist_ok=True)
    runs = [run_for(bench, args)] if args else list(bench.runs)
    worst = 0
    for run in runs:
        shown = shlex.join(["./dev", "bench", bench.name, *(args or run.row)])
        cmd = command_for(bench, run, args, python, results)
        print(f"bench: {shown}", flush=True)
        env = {**os.environ, COMMAND_ENV: shown}
        worst = max(worst, subprocess.run(cmd, cwd=REPO, env=env).returncode)
    return worst


def listing() -> str:
    import summary

    lines = []
    for bench in BENCHMARKS:
        needs = f"  (needs {bench.needs})" if bench.needs else ""
        lines.append(f"{bench.name}: bench/{bench.path.name}{needs}")
        for run in bench.runs:
            args = shlex.join(run.row)
            for figure in summary.FIGURES:
                if figure.source == run.result:
                    lines.append(f"    {args + ': ' if args else ''}{figure.name}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    results = Path(os.environ.get("BENCH_OUT", REPO / "bench" / "results"))
    sys.path.insert(0, str(BENCH))
    import summary

    first = args[0] if args else "--all"
    if first in ("-h", "--help"):
        print("\n\n".join(__doc__.split("\n\n")[1:3]))
        return 0
    if first == "--list":
        print(listing())
        return 0
    if first == "--summary":  # ARGS, when given, are bench/summary.py's (RESULTS --write PAGE)
        return summary.main(args[1:] or [str(results), "--write", str(REPO / "BENCHMARKS.md")])
    if first == "--all":
        python = bench_python()
        for bench in BENCHMARKS:
            run_benchmark(bench, [], python, results)
        return summary.main([str(results), "--write", str(REPO / "BENCHMARKS.md")])
    bench = BY_NAME.get(first)
    if bench is None:
        names = ", ".join(BY_NAME)
        print(f"bench: no benchmark {first!r}; the benchmarks: {names}", file=sys.stderr)
        return 2
    if {"-h", "--help"} & set(args[1:]):  # the script's own flags: no peers needed
        return subprocess.run([sys.executable, str(bench.path), "--help"], cwd=REPO).returncode
    return run_benchmark(bench, args[1:], bench_python(), results)


if __name__ == "__main__":
    sys.exit(main())
