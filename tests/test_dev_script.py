"""``./dev``'s install choice: the demo gets the two distributions and matplotlib, the
tests get the test extras too, and one .venv serves both (demo then test completes it,
test then demo installs nothing). A real install takes a minute and needs the package
index, so here ``dev`` runs as it is in a copy of the repository's install files whose
.venv/bin/python is a stand-in that records each call (pip's included) and succeeds."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RECORDER = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../calls.log"
echo "${PYTHONDONTWRITEBYTECODE:-}|${PYTHONPYCACHEPREFIX:-}" > "$(dirname "$0")/../bytecode.log"
[[ "$*" == *"pip install"* && -n "${FAIL_PIP:-}" ]] && { echo "pip: no such package"; exit 1; }
exit 0
"""


def checkout(tmp_path: Path) -> Path:
    """The files ``dev`` reads, and a .venv whose python records its calls."""
    repo = tmp_path / "repo"
    (repo / "client").mkdir(parents=True)
    for name in ("dev", "pyproject.toml", "client/pyproject.toml"):
        shutil.copy2(ROOT / name, repo / name)
    python = repo / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(RECORDER)
    python.chmod(0o755)
    return repo


def dev(repo: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(repo / "dev"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", **env},
    )


def calls(repo: Path) -> list[str]:
    log = repo / ".venv" / "calls.log"
    lines = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return lines


def installs(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("-m pip install") and " -e " in line]


def test_the_demo_installs_no_test_tools_and_says_what_it_does(tmp_path):
    repo = checkout(tmp_path)
    run = dev(repo, "demo", "--plot", "day.png")
    assert run.returncode == 0, run.stderr
    done = calls(repo)
    assert installs(done) == [
        "-m pip install --no-compile --no-build-isolation -e ./client[plot] -e ."
    ]
    assert done[-1] == "-m ssmserve.client.sensor_demo --plot day.png"
    said = run.stdout.splitlines()
    assert said[0].startswith("dev: upgrading pip")
    assert said[1].startswith("dev: installing ssmserve and ssmserve-client")
    assert "the test tools come with ./dev test" in said[1]
    assert said[2].startswith("dev: .venv ready for ./dev demo")


def test_demo_then_test_completes_the_venv_and_then_installs_nothing(tmp_path):
    repo = checkout(tmp_path)
    assert dev(repo, "demo").returncode == 0
    calls(repo)
    assert dev(repo, "demo").returncode == 0
    assert installs(calls(repo)) == []  # the stamp says the demo's set is there
    assert dev(repo, "protos").returncode == 0  # a task that needs the test set
    assert installs(calls(repo)) == [
        "-m pip install --no-compile --no-build-isolation -e ./client[plot] -e .[test]"
    ]
    for task in ("demo", "protos"):
        assert dev(repo, task).returncode == 0
        assert installs(calls(repo)) == []


def test_test_first_then_the_demo_reinstalls_nothing(tmp_path):
    repo = checkout(tmp_path)
    assert dev(repo, "protos").returncode == 0
    assert len(installs(calls(repo))) == 1
    run = dev(repo, "demo")
    assert run.returncode == 0
    assert installs(calls(repo)) == [] and run.stdout == ""


def test_a_changed_pyproject_or_a_failed_install_installs_again(tmp_path):
    repo = checkout(tmp_path)
    assert dev(repo, "demo").returncode == 0
    calls(repo)
    pyproject = repo / "client" / "pyproject.toml"
    pyproject.write_text(pyproject.read_text() + "\n# changed\n")
    assert dev(repo, "demo").returncode == 0
    assert len(installs(calls(repo))) == 1

    pyproject.write_text(pyproject.read_text() + "# changed again\n")
    run = dev(repo, "demo", FAIL_PIP="1")
    assert run.returncode == 1
    assert "pip: no such package" in run.stderr and "dev: pip install" in run.stderr
    assert calls(repo)[-1].startswith("-m pip install")  # the demo did not run
    assert dev(repo, "demo").returncode == 0  # no stamp was written: it tries again
    assert len(installs(calls(repo))) == 1


def test_a_stamp_that_names_no_set_counts_as_everything_installed(tmp_path):
    """The stamp of a .venv made when every task installed the test extras."""
    repo = checkout(tmp_path)
    assert dev(repo, "protos").returncode == 0
    stamp = repo / ".venv" / ".ssmserve-installed"
    digest, installed = stamp.read_text().split()
    assert installed == "test"
    stamp.write_text(digest + "\n")
    calls(repo)
    for task in ("demo", "protos"):
        assert dev(repo, task).returncode == 0
        assert installs(calls(repo)) == []


def test_dev_test_leaves_the_slow_tests_out_and_all_takes_them_in(tmp_path):
    """``./dev test``: pyproject's ``-m 'not slow'`` stands, the files spread over a process
    per CPU; ``--all``, wherever it is among the arguments, runs every test in one process;
    the other arguments go to pytest as they are."""
    repo = checkout(tmp_path)
    assert dev(repo, "test", "tests/test_store.py", "-x").returncode == 0
    assert calls(repo)[-1] == "-m pytest -n logical --dist loadfile tests/test_store.py -x"
    assert dev(repo, "test", "--all", "--durations=30").returncode == 0
    assert calls(repo)[-1] == "-m pytest -m slow or not slow --durations=30"
    assert dev(repo, "test", "-k", "lease", "--all").returncode == 0
    assert calls(repo)[-1] == "-m pytest -m slow or not slow -k lease"
    assert dev(repo, "test").returncode == 0
    assert calls(repo)[-1] == "-m pytest -n logical --dist loadfile"


def test_dev_without_a_task_prints_its_help(tmp_path):
    repo = checkout(tmp_path)
    run = dev(repo)
    assert run.returncode == 2
    assert "--all: every test" in run.stdout and "./dev soak N" in run.stdout
    assert not any(line and not line.startswith("#") for line in run.stdout.splitlines())


def test_dev_test_has_the_bytecode_written_under_the_venv_where_the_environment_forbids_it(
    tmp_path,
):
    """Where PYTHONDONTWRITEBYTECODE is set, every process the tests start would compile
    its imports from source again (the server's: 1.7 s of CPU against 0.6): ``./dev test``
    has it written under .venv; where it is not set, Python's own places stand."""
    repo = checkout(tmp_path)
    bytecode = repo / ".venv" / "bytecode.log"
    assert dev(repo, "test", PYTHONDONTWRITEBYTECODE="1").returncode == 0
    assert bytecode.read_text().strip() == f"|{repo / '.venv' / 'pycache'}"
    assert dev(repo, "test").returncode == 0
    assert bytecode.read_text().strip() == "|"
