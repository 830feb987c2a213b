"""The benchmark suite (bench/suite.py): every benchmark in its manifest is a script that
exists and takes the arguments the manifest gives it, every row of BENCHMARKS.md's table
names a benchmark of the manifest with arguments its script takes, ``--summary`` rebuilds
the rows from a results directory, and an unknown name is refused in one line. No
benchmark is run here: each script is asked only for its ``--help``."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SUITE = REPO / "bench" / "suite.py"
FIXTURES = Path(__file__).parent / "fixtures" / "bench"
PAGE = REPO / "BENCHMARKS.md"
#: Bound on every script's ``--help`` in one process (the imports are shared: ~10 s here,
#: a minute on a loaded 2-core host).
HELP_TIMEOUT_S = 300
#: Runs each script given as ``__main__`` with ``--help`` in this one process; prints
#: their outputs as one JSON object, by path, a script that failed to parse its
#: ``--help`` giving its error instead.
HELP_ALL = """
import contextlib, io, json, runpy, sys, traceback
out = {}
for path in sys.argv[1:]:
    buffer = io.StringIO()
    sys.argv = [path, "--help"]
    try:
        with contextlib.redirect_stdout(buffer):
            runpy.run_path(path, run_name="__main__")
        out[path] = "did not exit on --help"
    except SystemExit as exc:
        out[path] = buffer.getvalue() if exc.code in (0, None) else f"exit {exc.code}"
    except Exception:
        out[path] = "error: " + traceback.format_exc()
print(json.dumps(out))
"""

sys.path.insert(0, str(REPO / "bench"))
import suite  # noqa: E402 - bench/ is not a package
import summary  # noqa: E402


def _suite(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SUITE), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    """Every benchmark script's ``--help`` output, by name."""
    paths = [str(bench.path) for bench in suite.BENCHMARKS]
    done = subprocess.run(
        [sys.executable, "-c", HELP_ALL, *paths],
        capture_output=True,
        text=True,
        timeout=HELP_TIMEOUT_S,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    by_path = json.loads(done.stdout.strip().splitlines()[-1])
    out = {bench.name: by_path[str(bench.path)] for bench in suite.BENCHMARKS}
    for name, text in out.items():
        assert text.startswith("usage:"), f"{name} --help: {text[-2000:]}"
    return out


def _flags(args: list[str] | tuple[str, ...]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def _rows() -> list[list[str]]:
    body = PAGE.read_text().split(summary.BEGIN, 1)[1].split(summary.END, 1)[0]
    return [summary._cells_of(line) for line in body.strip().splitlines()[2:]]


def test_every_benchmark_is_a_script_that_takes_its_runs_arguments(helps: dict[str, str]) -> None:
    assert len({b.path for b in suite.BENCHMARKS}) == len(suite.BENCHMARKS)
    for bench in suite.BENCHMARKS:
        assert bench.path.is_file(), bench.path
        assert "--json" in helps[bench.name], bench.name
        for run in bench.runs:
            for flag in _flags(run.row + run.setup):
                assert flag in helps[bench.name], f"{bench.name}: {flag} ({run.result})"


def test_every_script_in_bench_is_in_the_manifest() -> None:
    scripts = {p.name for p in (REPO / "bench").glob("*.py")}
    shared = {"harness.py", "suite.py", "summary.py"}
    assert scripts - shared == {b.path.name for b in suite.BENCHMARKS}


def test_every_row_names_a_benchmark_with_arguments_its_script_takes(
    helps: dict[str, str],
) -> None:
    rows = _rows()
    assert rows
    for row in rows:
        words = shlex.split(row[4].strip("`"))
        assert words[:2] == ["./dev", "bench"] and words[2] in suite.BY_NAME, row[4]
        for flag in _flags(words[3:]):
            assert flag in helps[words[2]], row[4]


def test_every_benchmark_makes_a_row_of_the_table() -> None:
    on_page = {shlex.split(row[4].strip("`"))[2] for row in _rows()}
    assert on_page == set(suite.BY_NAME)
    for bench in suite.BENCHMARKS:  # and every run a figure
        for run in bench.runs:
            assert any(f.source == run.result for f in summary.FIGURES), run.result


def test_summary_rebuilds_the_rows_from_a_results_directory(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(FIXTURES, results)
    page = tmp_path / "BENCHMARKS.md"
    page.write_text(PAGE.read_text())
    done = _suite("--summary", str(results), "--write", str(page))
    assert done.returncode == 0, done.stderr
    fresh = summary.rows_from(results)
    assert {f.source for f in summary.FIGURES if f.name in fresh} == {
        p.stem for p in results.iterdir()
    }
    body = page.read_text().split(summary.BEGIN, 1)[1].split(summary.END, 1)[0]
    written = {cells[0]: cells for cells in map(summary._cells_of, body.strip().splitlines()[2:])}
    for name, row in fresh.items():
        assert written[name] == row
        bench = suite.RUN_OF_RESULT[next(f.source for f in summary.FIGURES if f.name == name)]
        assert row[4] == f"`{suite.row_command(bench[1].result)}`"


def test_a_result_written_by_the_suite_names_its_command_and_date(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(FIXTURES, results)
    data = (results / "checkpoint.json").read_text()
    stamp = ', "date": "2001-02-03", "command": "./dev bench checkpoint --rounds 3"}'
    (results / "checkpoint.json").write_text(data.rstrip()[:-1] + stamp)
    row = summary.rows_from(results)["checkpoint encode / decode, 2.81 MiB state, ms"]
    assert row[4:] == ["`./dev bench checkpoint --rounds 3`", "2001-02-03"]


def test_a_run_is_chosen_by_its_row_arguments_and_given_its_set_up() -> None:
    bench = suite.BY_NAME["llama_cpp"]
    results = Path("/r")
    run = suite.run_for(bench, ["--arch", "mamba2", "--rounds", "1"])
    assert run.result == "llama_cpp_mamba2"
    cmd = suite.command_for(bench, run, ["--arch", "mamba2", "--rounds", "1"], "py", results)
    assert cmd == [
        "py", str(bench.path), "--model", "/r/models/mamba2-130m",
        "--gguf", "/r/models/mamba2-130m-f32.gguf", "--arch", "mamba2", "--rounds", "1",
        "--json", "/r/llama_cpp_mamba2.json",
    ]  # fmt: skip
    given = ["--arch", "mamba2", "--model", "M", "--json", "o"]
    mine = suite.command_for(bench, run, given, "py", results)
    assert mine == ["py", str(bench.path), "--gguf", "/r/models/mamba2-130m-f32.gguf",
                    "--arch", "mamba2", "--model", "M", "--json", "o"]  # fmt: skip
    assert suite.run_for(bench, []).result == "llama_cpp"
    assert suite.run_for(bench, ["--quantize", "q8_0"]).result == "llama_cpp_q8"


def test_list_names_every_benchmark_and_figure() -> None:
    done = _suite("--list")
    assert done.returncode == 0, done.stderr
    for bench in suite.BENCHMARKS:
        assert re.search(rf"^{bench.name}: bench/{bench.path.name}", done.stdout, re.M)
    for figure in summary.FIGURES:
        assert figure.name in done.stdout


def test_an_unknown_benchmark_is_refused_in_one_line() -> None:
    done = _suite("no_such_bench", env={"BENCH_PYTHON": "/nonexistent"})
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no_such_bench" in lines[0]
    assert all(name in lines[0] for name in suite.BY_NAME)
