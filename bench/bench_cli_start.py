"""How long the ``ssmserve`` command takes to start and answer, hyperfine-style.

Usage: ``.venv/bin/python bench/bench_cli_start.py [--runs N] [--baseline-tree PATH]
[--json OUT]``

Commands timed (each a fresh process, as a user runs it; wall clock from spawn to exit):

- ``ssmserve --help``: the parser alone;
- ``ssmserve --server A session list``: a service command against a running worker
  (``ssmserve-server --demo`` of this checkout, embedded Redis, started here);
- ``ssmserve model inspect DIR --json``: a server command (it loads the engine).

``--baseline-tree PATH`` (another checkout, e.g. a git worktree of an older commit) runs
the same commands with that tree's client and server code first on ``PYTHONPATH``, each
run interleaved with this checkout's, so load on this shared machine hits both alike.
Reported: median and p90 of the wall clock of ``--runs`` runs after 2 warm-up runs, and
the median CPU time (user + system) of the process: on a machine other work keeps busy
the wall clock waits for a core, the CPU time much less. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import start_server, table

CURRENT, BASELINE = "current", "baseline"
WARMUP = 2


def ssmserve_command() -> str:
    """The ``ssmserve`` console script of the interpreter running this benchmark."""
    script = Path(sys.executable).parent / "ssmserve"
    if not script.is_file():
        raise SystemExit(f"no {script}: install the client first (./dev test does)")
    return str(script)


def tree_env(tree: Path | None) -> dict[str, str]:
    """The environment that runs ``tree``'s code (None: this checkout's, as installed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("SSMSERVE_SERVER", "PYTHONPATH")}
    if tree is None:
        return env
    server, client = tree / "server", tree / "client"
    if not (server / "ssmserve" / "server" / "main.py").is_file() or not client.is_dir():
        raise SystemExit(f"--baseline-tree {tree}: not a checkout of this repository")
    return {**env, "PYTHONPATH": f"{client.resolve()}:{server.resolve()}"}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def once(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of ``argv``."""
    cpu = _children_cpu_s()
    started = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr[-500:]}")
    return elapsed, _children_cpu_s() - cpu


def p90(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="timed runs per command (20)")
    parser.add_argument("--baseline-tree", type=Path, metavar="PATH",
                        help="also time this checkout's code, interleaved")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = parser.parse_args()
    envs = {CURRENT: tree_env(None)}
    if args.baseline_tree:
        envs = {BASELINE: tree_env(args.baseline_tree), **envs}
    ssmserve = ssmserve_command()
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server_cmd = [str(Path(sys.executable).parent / "ssmserve-server"), "--demo",
                      "--listen", "127.0.0.1:0", "--data-dir", str(Path(tmp) / "data")]  # fmt: skip
        proc, address = start_server(server_cmd)
        try:
            model_dir = Path(tmp) / "model"
            subprocess.run([ssmserve, "model", "init-demo", str(model_dir)], check=True,
                           capture_output=True, env=envs[CURRENT], timeout=300)  # fmt: skip
            commands = {
                "ssmserve --help": ["--help"],
                "ssmserve session list": ["--server", address, "session", "list"],
                "ssmserve model inspect": ["model", "inspect", str(model_dir), "--json"],
            }
            for name, argv in commands.items():
                walls: dict[str, list[float]] = {code: [] for code in envs}
                cpus: dict[str, list[float]] = {code: [] for code in envs}
                for i in range(WARMUP + args.runs):
                    for code, env in envs.items():  # interleaved: drift hits both alike
                        elapsed, cpu = once([ssmserve, *argv], env)
                        if i >= WARMUP:
                            walls[code].append(elapsed)
                            cpus[code].append(cpu)
                results[name] = {
                    code: {
                        "median_ms": statistics.median(walls[code]) * 1e3,
                        "p90_ms": p90(walls[code]) * 1e3,
                        "cpu_median_ms": statistics.median(cpus[code]) * 1e3,
                        "runs": len(walls[code]),
                    }
                    for code in envs
                }
        finally:
            proc.terminate()
            proc.wait(30)
    rows = []
    for name, by_code in results.items():
        row: list[object] = [name]
        for code in envs:
            row += [by_code[code][k] for k in ("median_ms", "p90_ms", "cpu_median_ms")]
        if BASELINE in by_code:
            row.append(by_code[BASELINE]["median_ms"] / by_code[CURRENT]["median_ms"])
        rows.append(row)
    headers = ["command"]
    for code in envs:
        headers += [f"{code} median ms", f"{code} p90 ms", f"{code} CPU ms"]
    if BASELINE in envs:
        headers.append("baseline / current (median)")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"# ssmserve start-up, {args.runs} runs each after {WARMUP} warm-up: wall clock "
          f"and CPU time; load average at the end {load} on {os.cpu_count()} CPUs")  # fmt: skip
    print(table(headers, rows))
    report = {"runs": args.runs, "commands": results, "load_average": os.getloadavg(),
              "baseline_tree": str(args.baseline_tree) if args.baseline_tree else None}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
