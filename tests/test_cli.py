"""``ssmserve model ...``: the documented forms work; bad input is one line, exit 2, no files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ssmserve.server.engine.loader import load_model
from tests.conftest import HF_FIXTURES

REPO = Path(__file__).resolve().parent.parent
DEMO_ARGS = (
    *("--input-dim", "3", "--output-dim", "2", "--hidden", "32"),
    *("--layers", "2", "--state", "8", "--seed", "5"),
)


def ssmserve(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ssmserve.client.cli", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], message: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ssmserve: error: "), result.stderr
    assert message in lines[0], lines[0]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("cli") / "demo"
    result = ssmserve("model", "init-demo", directory, *DEMO_ARGS)
    assert result.returncode == 0, result.stderr
    return directory


def test_init_demo_is_deterministic(demo_dir: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    assert ssmserve("model", "init-demo", again, *DEMO_ARGS).returncode == 0
    assert (again / "model.safetensors").read_bytes() == (
        demo_dir / "model.safetensors"
    ).read_bytes()
    other = tmp_path / "other"
    assert ssmserve("model", "init-demo", other, "--seed", "6").returncode == 0
    assert load_model(other).fingerprint != load_model(demo_dir).fingerprint


def test_init_demo_refuses_to_overwrite(demo_dir: Path) -> None:
    before = (demo_dir / "model.safetensors").read_bytes()
    assert_one_line_error(ssmserve("model", "init-demo", demo_dir, "--seed", "9"), "--force")
    assert (demo_dir / "model.safetensors").read_bytes() == before


def test_inspect(demo_dir: Path) -> None:
    result = ssmserve("model", "inspect", demo_dir, "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    model = load_model(demo_dir)
    assert info["architecture"] == "mamba-signal"
    assert info["fingerprint"] == model.fingerprint
    assert info["state_bytes_per_session"] == 2 * 64 * (4 + 8) * 4
    assert info["parameters"] > 0
    text = ssmserve("model", "inspect", HF_FIXTURES / "base")
    assert text.returncode == 0 and "mamba-lm" in text.stdout and "logits[64]" in text.stdout


def test_run_signal_matches_engine(demo_dir: Path, tmp_path: Path) -> None:
    inputs = np.random.default_rng(0).standard_normal((30, 3)).astype(np.float32)
    np.save(tmp_path / "in.npy", inputs)
    result = ssmserve(
        "model", "run", demo_dir, "--input", tmp_path / "in.npy", "--output", tmp_path / "out.npy"
    )
    assert result.returncode == 0, result.stderr
    expected, _ = load_model(demo_dir).run(inputs)
    out = np.load(tmp_path / "out.npy")
    assert out.dtype == np.float32 and np.array_equal(out, expected)


def test_run_token_model_matches_reference(tmp_path: Path) -> None:
    case = HF_FIXTURES / "conv3_bias_rank5_untied"
    result = ssmserve(
        "model", "run", case, "--input", case / "ids.npy", "--output", tmp_path / "logits.npy"
    )
    assert result.returncode == 0, result.stderr
    logits = np.load(tmp_path / "logits.npy")
    assert np.abs(logits - np.load(case / "logits.npy")).max() <= 1e-5


@pytest.mark.parametrize(
    ("make_input", "message"),
    [
        (
            lambda p: np.save(p, np.zeros((4, 2), np.float32)),
            "needs float32 of shape (T, 3), got float32[4, 2]",
        ),
        (lambda p: np.save(p, np.zeros((4, 3), np.float64)), "got float64[4, 3]"),
        (lambda p: np.save(p, np.zeros(4, np.int64)), "got int64[4]"),
        (lambda p: np.save(p, np.array([[np.nan, 0, 0]], np.float32)), "NaN or Inf"),
        (
            lambda p: np.save(p, np.array([{"a": 1}], dtype=object), allow_pickle=True),
            "not a readable .npy",
        ),
        (lambda p: p.write_bytes(b"garbage"), "not a readable .npy"),
        (lambda p: None, "no such file"),
    ],
)
def test_run_bad_input_writes_nothing(
    demo_dir: Path, tmp_path: Path, make_input, message: str
) -> None:
    src = tmp_path / "in.npy"
    make_input(src)
    out = tmp_path / "out.npy"
    assert_one_line_error(
        ssmserve("model", "run", demo_dir, "--input", src, "--output", out), message
    )
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] in ([], ["in.npy"])


def test_run_bad_token_ids(tmp_path: Path) -> None:
    np.save(tmp_path / "ids.npy", np.array([1, 2, 64]))
    result = ssmserve(
        "model",
        "run",
        HF_FIXTURES / "base",
        "--input",
        tmp_path / "ids.npy",
        "--output",
        tmp_path / "o.npy",
    )
    assert_one_line_error(result, "token id 64 is outside [0, 64)")
    assert not (tmp_path / "o.npy").exists()


def test_run_bad_model_dir(tmp_path: Path) -> None:
    np.save(tmp_path / "in.npy", np.zeros((2, 3), np.float32))
    assert_one_line_error(
        ssmserve(
            "model",
            "run",
            tmp_path / "missing",
            "--input",
            tmp_path / "in.npy",
            "--output",
            tmp_path / "o.npy",
        ),
        "does not exist",
    )
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("[]")
    assert_one_line_error(
        ssmserve("model", "inspect", tmp_path / "broken"), "must hold a JSON object"
    )


def test_usage_errors_exit_2_in_one_line(tmp_path: Path) -> None:
    assert_one_line_error(
        ssmserve("model", "init-demo", tmp_path / "x", "--hidden", "0"),
        "argument --hidden: must be >= 1, got 0 (see ssmserve model init-demo --help)",
    )
    assert_one_line_error(ssmserve("model"), "required: ACTION (see ssmserve model --help)")
    assert_one_line_error(ssmserve("session", "list", "--bogus"), "unrecognized arguments")
    assert not (tmp_path / "x").exists()


def test_help_lists_service_and_server_side_commands():
    result = ssmserve("--help")
    assert result.returncode == 0, result.stderr
    for command in ("session", "rollback", "migrate", "drain", "model"):
        assert f"\n    {command} " in result.stdout, result.stdout
    model_help = ssmserve("model", "init-demo", "--help").stdout
    assert "--input-dim" in model_help and "directory" in model_help


def test_bench_prints_step_times(demo_dir: Path) -> None:
    result = ssmserve("model", "bench", demo_dir, "--batch", "3", "--steps", "7", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert (report["batch"], report["steps"]) == (3, 7)
    assert 0 < report["step_us_p10"] <= report["step_us_median"] <= report["step_us_p90"]
    assert report["steps_per_s"] == pytest.approx(3 / (report["step_us_median"] / 1e6))
    assert report["fingerprint"] == load_model(demo_dir).fingerprint
    text = ssmserve("model", "bench", demo_dir, "--steps", "3")
    assert text.returncode == 0 and "median" in text.stdout and "session-steps/s" in text.stdout


def test_bench_refuses_bad_sizes(demo_dir: Path, tmp_path: Path) -> None:
    assert_one_line_error(
        ssmserve("model", "bench", demo_dir, "--batch", "5000"), "batch must be in [1, 4096]"
    )
    assert ssmserve("model", "bench", demo_dir, "--batch", "0").returncode == 2
    assert ssmserve("model", "bench", demo_dir, "--steps", "-1").returncode == 2
    assert_one_line_error(ssmserve("model", "bench", tmp_path / "none"), "none")


def test_bench_refuses_a_batch_whose_state_does_not_fit_in_memory(tmp_path: Path) -> None:
    import os

    big = tmp_path / "big"  # 2 layers x (e 512 x n 512) floats: 2 MiB of state a session
    args = ("--input-dim", "1", "--output-dim", "1", "--hidden", "256", "--layers", "2")
    assert ssmserve("model", "init-demo", big, *args, "--state", "512").returncode == 0
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    need = 2 * 4096 * load_model(big).config.state_bytes
    if need <= 0.5 * ram:
        pytest.skip(f"this machine's RAM ({ram} B) holds {need} B of state")
    assert_one_line_error(
        ssmserve("model", "bench", big, "--batch", "4096"), "use a smaller --batch"
    )


def test_model_run_checks_its_output_before_it_loads_the_model(tmp_path: Path) -> None:
    np.save(tmp_path / "in.npy", np.zeros((2, 3), np.float32))
    out = tmp_path / "no-such-dir" / "o.npy"
    result = ssmserve(
        "model", "run", tmp_path / "missing-model", "--input", tmp_path / "in.npy",
        "--output", out,
    )  # fmt: skip
    assert_one_line_error(result, f"--output {out}: directory {out.parent} does not exist")


def test_auth_token_refuses_a_file_it_cannot_write_before_making_a_token(tmp_path: Path) -> None:
    out = tmp_path / "no-such-dir" / "tokens.toml"
    result = ssmserve("auth", "token", "--tenant", "t", "--role", "client", "--file", out)
    assert_one_line_error(result, f"--file {out}: directory {out.parent} does not exist")
    assert "ssm_" not in result.stdout  # no token shown that no file knows


def test_server_commands_show_the_engines_own_defaults_and_limits() -> None:
    """``ssmserve.server.cli`` writes them out (it must not import the engine to list its
    commands); they must be the engine's."""
    from dataclasses import asdict

    from ssmserve.server import cli
    from ssmserve.server.api.auth import Role
    from ssmserve.server.engine import bench, demo, interface, quantize

    spec = asdict(demo.DemoSpec())
    assert cli.ENGINES == interface.ENGINES
    assert cli.QUANTIZATIONS == quantize.QUANTIZATIONS
    assert {key: spec[key] for key in cli.DEMO_DEFAULTS} == cli.DEMO_DEFAULTS
    assert (cli.ARCHS, cli.MAX_BATCH, cli.MAX_STEPS) == (demo.ARCHS, bench.MAX_BATCH,
                                                         bench.MAX_STEPS)  # fmt: skip
    assert tuple(r.value for r in Role if r is not Role.WORKER) == cli.TOKEN_ROLES


def test_init_demo_presets_have_the_released_shapes() -> None:
    """Each preset's config has its checkpoint's parameter count and state size (the
    weights are random; the costs are the real model's)."""
    from ssmserve.server.engine.model_tensors import expected_shapes
    from ssmserve.server.engine.presets import PRESETS, preset_config

    def params(name: str) -> float:
        shapes = expected_shapes(preset_config(name)).values()
        return sum(int(np.prod(s)) for s in shapes) / 1e6

    assert {k: round(params(k)) for k in PRESETS} == {
        "mamba-130m": 129,
        "mamba2-130m": 129,
        "mamba-790m": 793,
        "mamba-2.8b": 2768,
        "falcon-mamba-7b": 7273,
        "mamba-codestral-7b": 7285,
    }
    c = preset_config("mamba2-130m")
    assert (c.num_heads, c.head_dim, c.n_groups, c.state_size) == (24, 64, 1, 128)
    with pytest.raises(ValueError, match="one of mamba-130m"):
        preset_config("mamba-7b")


@pytest.mark.slow
def test_init_demo_writes_a_preset_that_loads(tmp_path: Path) -> None:
    """``init-demo --preset mamba-130m`` writes a loadable 0.5 GB language model; the
    shape flags are refused beside a preset, naming them."""
    out = tmp_path / "m"
    result = ssmserve("model", "init-demo", out, "--preset", "mamba-130m", "--seed", "3")
    assert result.returncode == 0, result.stderr
    assert "mamba-130m-shaped language model" in result.stdout
    info = ssmserve("model", "inspect", out, "--json")
    described = json.loads(info.stdout)
    assert described["hidden_size"] == 768 and described["num_hidden_layers"] == 24
    assert_one_line_error(
        ssmserve("model", "init-demo", tmp_path / "x", "--preset", "mamba-130m", "--hidden", "8"),
        "drop --hidden",
    )
