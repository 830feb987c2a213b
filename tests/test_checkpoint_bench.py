"""``ssmserve model bench DIR --checkpoint``: the codec's figures beside a memory copy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ssmserve.server.engine.demo import DemoSpec, demo_config
from ssmserve.server.state.checkpoint import Checkpoint
from ssmserve.server.state.checkpoint_bench import bench_checkpoint, random_checkpoint

REPO = Path(__file__).resolve().parent.parent


def ssmserve(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ssmserve.client.cli", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_model_bench_checkpoint_prints_the_codec_beside_memcpy(tmp_path: Path) -> None:
    model = tmp_path / "m"
    made = ssmserve("model", "init-demo", model, "--hidden", "32", "--layers", "3")
    assert made.returncode == 0, made.stderr
    result = ssmserve("model", "bench", model, "--checkpoint", "--json")
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["format_version"] == 2 and figures["model"] == "m"
    assert figures["state_bytes"] == 3 * (64 * 4 + 64 * 16) * 4  # e = 2 * hidden, k 4, n 16
    for key in ("encode_ms", "decode_ms", "memcpy_ms", "format1_encode_ms"):
        assert figures[key] > 0
    assert figures["encode_over_memcpy"] == pytest.approx(
        figures["encode_ms"] / figures["memcpy_ms"]
    )
    text = ssmserve("model", "bench", model, "--checkpoint")
    assert text.returncode == 0 and "x memcpy" in text.stdout, text.stderr
    missing = ssmserve("model", "bench", tmp_path / "none", "--checkpoint")
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_the_bench_checkpoint_is_of_the_models_shapes() -> None:
    config = demo_config(DemoSpec(arch="mamba2", hidden=32, layers=2, head_dim=8, groups=2))
    ckpt = random_checkpoint(config, "m2")
    assert ckpt.state.layout.ssm_shape == config.ssm_state_shape
    assert Checkpoint.decode(ckpt.encode()).state.bit_equal(ckpt.state)
    result = bench_checkpoint(config, "m2", rounds=3)
    assert result.state_bytes == config.state_bytes and result.rounds == 3
