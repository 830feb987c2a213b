"""bench/trace_path.py runs: one Stream step and one Migrate traced on two real workers (a
real redis-server, real sockets), the last line of its output one JSON object that
BENCHMARKS.md's rows are read from (bench/summary.py). Its shape, and that each side's
figures add up, are checked; and the crossings between components of both paths are held
at their recorded figures (``RECORDED_COMPONENT_CROSSINGS``).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "trace_path.py"
#: A run starts a redis-server and two workers and traces each path ``REPEATS`` times:
#: about 8 s here, 13-21 s beside two CPU hogs; the bound leaves room for a busy machine.
RUN_TIMEOUT_S = 240
#: Each path's crossings between components (``component_of``: api, sessions, cluster,
#: state, engine, observability, server) on the server side, as measured: a change that
#: adds one fails here. The figure is lowered, never raised, in the commit that lowers
#: the count (issue 51), and BENCHMARKS.md's two trace rows follow it.
RECORDED_COMPONENT_CROSSINGS = {"stream_step": 51, "migrate": 77}
#: Runs of each trace; the held count is their fewest. The workers' background work
#: (lease renewals and heartbeats every ~1.7 s, their metrics) lands in a trace now and
#: then and only ever adds: here in 0-3 runs of 9, also beside two CPU hogs (a Migrate's
#: trace lasts longest, ~0.3 s of a renewal period). With 7 runs the fewest is a clean
#: one unless every run is hit: under 1e-3 at 3 in 9.
REPEATS = 7


def _summary() -> ModuleType:
    spec = importlib.util.spec_from_file_location("trace_path_summary", REPO / "bench/summary.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _check_side(side: dict[str, Any], threads: set[str], package: str) -> None:
    assert isinstance(side["crossings"], int) and side["crossings"] > 0
    assert isinstance(side["events"], int) and side["events"] > side["crossings"]
    modules = side["module_list"]
    assert side["modules"] == len(modules) == len(set(modules)) > 1
    assert all(m.startswith(package) for m in modules), modules
    assert set(side["events_per_module"]) == set(modules)
    assert sum(side["events_per_module"].values()) == side["events"]
    assert set(side["entries_per_module"]) <= set(modules)
    assert sum(side["entries_per_module"].values()) == side["crossings"]
    assert threads <= set(side["crossings_per_thread"])
    assert sum(side["crossings_per_thread"].values()) == side["crossings"]


@pytest.fixture(scope="module")
def trace_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """One run of the script, ``REPEATS`` traces of each path: its JSON and the results
    folder it wrote it to (as ``./dev bench trace_path`` does)."""
    results = tmp_path_factory.mktemp("trace-path")
    out = results / "trace_path.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--repeats", str(REPEATS), "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == result
    return result, results


@pytest.mark.parametrize("trace", sorted(RECORDED_COMPONENT_CROSSINGS))
def test_the_crossings_between_components_stay_within_their_recorded_figure(
    trace_run: tuple[dict[str, Any], Path], trace: str
) -> None:
    result, _ = trace_run
    runs = result[trace]["component_runs"]
    assert len(runs) == REPEATS
    fewest, recorded = min(runs), RECORDED_COMPONENT_CROSSINGS[trace]
    assert fewest <= recorded, (
        f"{trace}: {fewest} crossings between components, recorded {recorded} (runs {runs}): "
        f"a call on the path goes into another component and back; see where with "
        f"`.venv/bin/python bench/trace_path.py --show-path`"
    )


def test_the_trace_ends_with_one_json_object_of_both_paths(
    trace_run: tuple[dict[str, Any], Path],
) -> None:
    result, results = trace_run

    for trace, workers in (("stream_step", {"worker-a"}), ("migrate", {"worker-a", "worker-b"})):
        traced = result[trace]
        # The headline is the server side: the workers' threads, server code first of all.
        _check_side(traced, workers, "ssmserve.")
        assert "MainThread" not in traced["crossings_per_thread"]
        assert any(m.startswith("ssmserve.server.api.") for m in traced["module_list"])
        # The headline is the run with the fewest crossings; every run is kept.
        assert len(traced["runs"]) == len(traced["component_runs"]) == REPEATS
        assert traced["crossings"] == min(traced["runs"])
        assert traced["component_crossings"] in traced["component_runs"]
        assert set(traced["components"]) <= {
            "api", "sessions", "cluster", "state", "engine", "observability", "server", "client"
        }  # fmt: skip
        assert set(traced["path"]) == set(traced["crossings_per_thread"])
        # The client side: the main thread, client code only.
        _check_side(traced["client"], {"MainThread"}, "ssmserve.client.")
        assert set(traced["client"]["crossings_per_thread"]) == {"MainThread"}
    assert Path(result["code"], "server", "ssmserve", "server").is_dir()
    assert result["commit"]

    # BENCHMARKS.md's two rows, from the results folder holding just this run.
    rows = _summary().rows_from(results)
    assert len(rows) == 2, list(rows)
    for trace, row in zip(("stream_step", "migrate"), rows.values(), strict=True):
        d = result[trace]
        assert row[1] == f"{d['crossings']} / {d['modules']}"
        between = f"between components: {d['component_crossings']} / {len(d['components'])}"
        assert between in row[2]


def test_a_baseline_tree_that_is_no_checkout_is_refused_before_anything_runs(
    tmp_path: Path,
) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", "--baseline-tree", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert proc.stdout == ""
    message = proc.stderr.strip()
    assert message.startswith(f"--baseline-tree {tmp_path}: no server/ssmserve/server/worker.py")
    assert "e.g. a git worktree" in message and len(message) < 300
