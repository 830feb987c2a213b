"""``bench/tools/gpu_check.py --smoke`` and ``ssmserve model run/bench --engine``: the device
check runs end to end on the CPU (Triton's interpreter, tiny models) and reports every
check passed; ``--engine cuda`` runs under the interpreter, and without torch / triton
it is refused in one line naming ``ssmserve[cuda]``. The refusal and the cpu default run
whether or not torch is installed; the rest is skipped without it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from ssmserve.server.engine.gpu.runtime import missing_packages
from ssmserve.server.engine.loader import load_model

REPO = Path(__file__).resolve().parent.parent
needs_torch = pytest.mark.skipif(
    bool(missing_packages()), reason="the GPU engine needs torch and triton (ssmserve[cuda])"
)


def run(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gpu-cli") / "m"
    flags = ("--hidden", "16", "--layers", "1", "--state", "4", "--input-dim", "3")
    result = run("-m", "ssmserve.client.cli", "model", "init-demo", directory, *flags)
    assert result.returncode == 0, result.stderr
    return directory


def test_the_plain_install_does_not_pull_torch_or_triton() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=!~;\[ ]", r)[0] for r in project["dependencies"]]
    assert "torch" not in names and "triton" not in names
    extra = [re.split(r"[<>=!~;\[ ]", r)[0] for r in project["optional-dependencies"]["cuda"]]
    assert extra == ["torch", "triton"]


@needs_torch
def test_the_device_check_passes_on_the_cpu_interpreter() -> None:
    result = run("bench/tools/gpu_check.py", "--smoke")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert (report["ok"], report["smoke"], report["device"]) == (
        True,
        True,
        "cpu triton-interpreter",
    )
    assert set(report["models"]) == {"tiny-mamba", "tiny-mamba2"}
    for model in report["models"].values():
        exact = model["exact"]
        assert exact["batch_sizes_differing"] == [] and exact["prefill_lengths_differing"] == []
        assert exact["permutation_equal"] and exact["checkpoint_continues"]
        assert model["fidelity"]["gpu_vs_cpu_engine"] <= 1e-4
        assert model["fidelity"]["plain_torch_vs_cpu_engine"] <= 1e-4
        assert model["speed"]["engine_b1_ms"] > 0 and model["speed"]["prefill_ms"] > 0


def test_engine_cuda_without_torch_is_refused_in_one_line(model_dir: Path, tmp_path: Path) -> None:
    np.save(tmp_path / "in.npy", np.zeros((2, 3), np.float32))
    hide = "import sys; sys.modules['torch'] = sys.modules['triton'] = None; "  # not installed
    for command in (
        ["run", model_dir, "--input", tmp_path / "in.npy", "--output", tmp_path / "out.npy"],
        ["bench", model_dir, "--steps", "1"],
    ):
        argv = ["model", *map(str, command), "--engine", "cuda"]
        code = hide + f"from ssmserve.client.cli import main; sys.exit(main({argv!r}))"
        result = run("-c", code)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "pip install 'ssmserve[cuda]'" in lines[0], result.stderr
    assert not (tmp_path / "out.npy").exists()


def test_engine_cpu_is_the_default(model_dir: Path, tmp_path: Path) -> None:
    inputs = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    np.save(tmp_path / "in.npy", inputs)
    for name, flags in (("default", ()), ("cpu", ("--engine", "cpu"))):
        cli = ("-m", "ssmserve.client.cli", "model", "run", model_dir, "--input")
        result = run(*cli, tmp_path / "in.npy", "--output", tmp_path / f"{name}.npy", *flags)
        assert result.returncode == 0, result.stderr
    expected, _ = load_model(model_dir).run(inputs)
    assert np.load(tmp_path / "default.npy").tobytes() == expected.tobytes()
    assert np.load(tmp_path / "cpu.npy").tobytes() == expected.tobytes()


@needs_torch
def test_engine_cuda_runs_under_the_interpreter(model_dir: Path, tmp_path: Path) -> None:
    inputs = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
    np.save(tmp_path / "in.npy", inputs)
    cli = ("-m", "ssmserve.client.cli", "model", "run", model_dir, "--input", tmp_path / "in.npy")
    result = run(
        *cli, "--output", tmp_path / "out.npy", "--engine", "cuda", "--prefill",
        env={"TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    expected, _ = load_model(model_dir).run(inputs)
    got = np.load(tmp_path / "out.npy")
    assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()
    bench = run(
        "-m", "ssmserve.client.cli", "model", "bench", model_dir, "--engine", "cuda",
        "--steps", "2", "--warmup", "1", "--json", env={"TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    report = json.loads(bench.stdout.strip().splitlines()[-1])
    from ssmserve.server.engine.numerics import numerics_signature

    assert report["steps"] == 2 and report["numerics"] != numerics_signature()
