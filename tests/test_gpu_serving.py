"""A worker on the GPU engine (``ssmserve-server --engine cuda``), end to end over gRPC.

Without a GPU the engine's Triton kernels run under Triton's interpreter
(``TRITON_INTERPRET=1``, set for the worker process): the same kernels, the same
per-element operations. The worker answers with the GPU engine's bits (checked against the
engine offline), within float32 rounding of the CPU engine, publishes the GPU engine's
numerics, and never lets a CPU worker replay its sessions. Without torch / triton the
flag is refused at start in one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ssmserve.client.errors import FailedPrecondition, StepFailed
from ssmserve.client.sync import Client
from ssmserve.server.embedded_redis import EmbeddedRedis, free_port
from ssmserve.server.engine.gpu.runtime import missing_packages
from ssmserve.server.engine.loader import load_model
from tests.test_generate import PARAMS, offline
from tests.worker_process import WorkerProcess

needs_torch = pytest.mark.skipif(
    bool(missing_packages()), reason="the GPU engine needs torch and triton (ssmserve[cuda])"
)
INTERPRETED = {"TRITON_INTERPRET": "1"}  # no GPU here: the kernels on the CPU


def bit_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@needs_torch
def test_a_cuda_worker_answers_with_the_gpu_engines_bits_and_keeps_its_sessions(
    model_dirs: dict[str, Path], redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # this process's offline reference too
    from ssmserve.server.engine.gpu.model import GpuMambaModel

    directory = model_dirs["lm"]
    gpu, cpu = GpuMambaModel.load(directory, "lm"), load_model(directory, "lm")
    ids = np.random.default_rng(9).integers(0, cpu.config.vocab_size, 30)
    a = WorkerProcess(
        {"lm": directory}, redis_server.url, tmp_path / "a", lease_ttl_s=5.0,
        extra_args=("--engine", "cuda"), env=INTERPRETED,
    ).start(timeout_s=120)  # fmt: skip
    b = WorkerProcess({"lm": directory}, redis_server.url, tmp_path / "b", lease_ttl_s=5.0)
    b.start(timeout_s=60)
    try:
        with Client(a.address, discover=False) as via_a:
            sid = via_a.create_session("lm").session_id
            # steps one by one, then a run of 12 in one message (served as a prefill)
            one = [o.output for o in via_a.stream_steps(sid, list(ids[:6]), first_step=1)]
            run = [
                o.output
                for o in via_a.stream_steps(sid, list(ids[6:18]), first_step=7,
                                            steps_per_message=12)
            ]  # fmt: skip
            want, _ = gpu.run(ids[:18])
            assert bit_equal(np.stack(one + run), want)
            np.testing.assert_allclose(want, cpu.run(ids[:18])[0], rtol=1e-4, atol=1e-4)
            # a seeded generation draws from the GPU engine's logits
            tokens = [t.token_id for t in via_a.generate(sid, 6, **PARAMS)]
            assert tokens == offline(gpu, [], 6, history=list(ids[:18]))[0]
            numerics = {w.address: w.numerics for w in via_a.list_workers()}
            assert len(set(numerics.values())) == 2 and all(numerics.values())
            with pytest.raises(FailedPrecondition, match="numerics"):
                via_a.migrate(sid, b.address)
        assert a.terminate() == 0  # a drain with no worker of its numerics parks the session
        with Client(b.address, discover=False) as via_b:
            with pytest.raises(StepFailed) as refused:
                list(via_b.stream_steps(sid, [int(ids[0])], first_step=25))
            assert refused.value.reason == "NUMERICS_MISMATCH"
            assert via_b.get_session(sid).step == 24  # nothing changed
    finally:
        a.kill()
        b.kill()


def test_engine_cuda_without_its_packages_is_refused_at_start(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    hide = "import sys; sys.modules['torch'] = sys.modules['triton'] = None; "
    argv = [
        "--listen", f"127.0.0.1:{free_port()}", "--data-dir", str(tmp_path / "d"),
        "--model", f"lm={model_dirs['lm']}", "--engine", "cuda",
    ]  # fmt: skip
    code = hide + f"from ssmserve.server.main import main; sys.exit(main({argv!r}))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "--engine cuda needs torch and triton" in last and "ssmserve[cuda]" in last
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())


@needs_torch
def test_engine_cuda_without_a_gpu_or_the_interpreter_is_refused_at_start(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, even on a machine with one
    result = subprocess.run(
        [
            sys.executable, "-m", "ssmserve.server.main", "--listen",
            f"127.0.0.1:{free_port()}", "--data-dir", str(tmp_path / "d"),
            "--model", f"lm={model_dirs['lm']}", "--engine", "cuda",
        ],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--engine cuda: no CUDA device" in result.stderr.strip().splitlines()[-1]
