"""BENCHMARKS.md's table of current figures is written by bench/summary.py from the JSON
the benchmarks write: each figure's row is replaced when its result file is there, the
others are kept, and every figure comes from a run in bench/suite.py's manifest.

The result files in tests/fixtures/bench are real ones, written by the benchmarks'
``--quick`` runs (bench_engine's with ``--skip-130m`` and without kizzasi, so only its
floor row), with what summary.py never reads left out (bench_failover's per-round logs):
the fields summary.py reads are the ones the benchmarks write.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "fixtures" / "bench"
PAGE = REPO / "BENCHMARKS.md"


def _summary() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_summary", REPO / "bench" / "summary.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


summary = _summary()


def table_rows(page: str) -> dict[str, list[str]]:
    body = page.split(summary.BEGIN, 1)[1].split(summary.END, 1)[0]
    rows = [summary._cells_of(line) for line in body.strip().splitlines()[2:]]
    return {row[0]: row for row in rows}


def test_the_table_reads_back_as_it_was_written() -> None:
    page = PAGE.read_text()
    assert summary.merge(page, {}) == page


def test_every_row_is_a_figure_with_all_its_cells() -> None:
    rows = table_rows(PAGE.read_text())
    names = {f.name for f in summary.FIGURES}
    assert set(rows) <= names, f"rows that no figure writes: {sorted(set(rows) - names)}"
    for row in rows.values():
        assert len(row) == len(summary.HEADER) and all(row), row
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", row[-1]), row


def test_every_figure_comes_from_a_run_of_the_suite() -> None:
    results = {run.result for bench in summary.suite.BENCHMARKS for run in bench.runs}
    assert {f.source for f in summary.FIGURES} <= results


def test_results_replace_their_rows_and_keep_the_others(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    day = 1_700_000_000  # 2023-11-14, a date no row of the page has
    for path in results.iterdir():
        os.utime(path, (day, day))
    page = tmp_path / "BENCHMARKS.md"
    page.write_text(PAGE.read_text())

    assert summary.main([str(results), "--write", str(page)]) == 0
    before, after = table_rows(PAGE.read_text()), table_rows(page.read_text())
    fresh = summary.rows_from(results)
    sources = {p.stem for p in results.iterdir()}
    assert {f.source for f in summary.FIGURES if f.name in fresh} == sources
    for name, row in after.items():
        if name in fresh:
            assert row == fresh[name] and row[-1] == "2023-11-14"
            assert row[1:4] != before.get(name, [None] * 4)[1:4]
        else:
            assert row == before[name]
    assert set(after) == set(before) | set(fresh)
    text = page.read_text()
    assert summary.merge(text, fresh) == text  # written again: the same page
    outside = PAGE.read_text().split(summary.BEGIN)
    assert text.startswith(outside[0]) and text.endswith(outside[1].split(summary.END)[1])
