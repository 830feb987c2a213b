"""bench/trace_path.py runs: one Stream step and one Migrate traced on two real workers (a
real redis-server, real sockets), the last line of its output one JSON object that
BENCHMARKS.md's rows are read from (bench/summary.py). The counts are measured, not
asserted (they follow the code); their shape, and that each side's figures add up, are.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "trace_path.py"
#: A quick run starts a redis-server and two workers and traces each path once: about
#: 5 s here; the bound leaves room for a busy 2-core machine.
RUN_TIMEOUT_S = 240


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


def test_a_quick_trace_ends_with_one_json_object_of_both_paths(tmp_path: Path) -> None:
    out = tmp_path / "trace_path.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == result

    for trace, workers in (("stream_step", {"worker-a"}), ("migrate", {"worker-a", "worker-b"})):
        traced = result[trace]
        # The headline is the server side: the workers' threads, server code first of all.
        _check_side(traced, workers, "ssmserve.")
        assert "MainThread" not in traced["crossings_per_thread"]
        assert any(m.startswith("ssmserve.server.api.") for m in traced["module_list"])
        assert traced["runs"] == [traced["crossings"]]  # --quick: one run of each
        assert set(traced["path"]) == set(traced["crossings_per_thread"])
        # The client side: the main thread, client code only.
        _check_side(traced["client"], {"MainThread"}, "ssmserve.client.")
        assert set(traced["client"]["crossings_per_thread"]) == {"MainThread"}
    assert Path(result["code"], "server", "ssmserve", "server").is_dir()
    assert result["commit"]

    summary = _summary()
    rows = summary.rows_from(tmp_path)
    names = [f.name for f in summary.FIGURES if f.source == "trace_path"]
    assert len(names) == 2 and set(names) <= set(rows)
    step = rows[names[0]]
    assert step[1] == f"{result['stream_step']['crossings']} / {result['stream_step']['modules']}"


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
