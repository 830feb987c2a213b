"""Shared fixtures: small models written to temp dirs, and the HF reference cases."""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# The GPU engine's tests run its Triton kernels on the CPU, under Triton's interpreter,
# which Triton chooses when it is first imported; transformers (the export's and the
# architectures' references) imports Triton too, and a test module that ran first would
# leave it compiling for a GPU there is none of. So the whole session decides it here.
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import redis

from ssmserve.server.embedded_redis import EmbeddedRedis, EmbeddedRedisSettings
from ssmserve.server.engine.config import Architecture, MambaConfig
from ssmserve.server.engine.demo import DemoSpec, demo_config, random_tensors
from ssmserve.server.engine.loader import load_model, save_model
from ssmserve.server.engine.mamba import MambaModel
from tests.harness import WorkerHarness
from tests.redis_topologies import RedisClusterHarness, SentinelHarness

HF_FIXTURES = Path(__file__).parent / "fixtures" / "hf"
HF2_FIXTURES = Path(__file__).parent / "fixtures" / "hf2"
HF_CASES = sorted(p.name for p in HF_FIXTURES.iterdir() if (p / "config.json").exists())


def token_config(**overrides: object) -> MambaConfig:
    fields: dict[str, object] = {
        "architecture": Architecture.LM,
        "hidden_size": 24,
        "state_size": 6,
        "num_hidden_layers": 2,
        "intermediate_size": 40,
        "conv_kernel": 3,
        "time_step_rank": math.ceil(24 / 16),
        "use_bias": True,
        "use_conv_bias": True,
        "layer_norm_epsilon": 1e-5,
        "vocab_size": 37,
        "tie_word_embeddings": False,
    }
    fields.update(overrides)
    return MambaConfig(**fields)  # type: ignore[arg-type]


def write_model(directory: Path, config: MambaConfig, seed: int = 0) -> MambaModel:
    save_model(directory, config, random_tensors(config, seed))
    return load_model(directory)


@pytest.fixture(scope="session")
def signal_model(tmp_path_factory: pytest.TempPathFactory) -> MambaModel:
    """Odd dims on purpose (e = 3 * 22, n = 7, k = 3) to hit SIMD tails."""
    spec = DemoSpec(
        input_dim=5, output_dim=3, hidden=22, layers=3, state=7, expand=3, conv_kernel=3, seed=11
    )
    return write_model(tmp_path_factory.mktemp("signal"), demo_config(spec), seed=11)


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> MambaModel:
    return write_model(tmp_path_factory.mktemp("demo"), demo_config(DemoSpec()))


@pytest.fixture(scope="session")
def token_model(tmp_path_factory: pytest.TempPathFactory) -> MambaModel:
    return write_model(tmp_path_factory.mktemp("token"), token_config(), seed=3)


@pytest.fixture(scope="session")
def mamba2_model(tmp_path_factory: pytest.TempPathFactory) -> MambaModel:
    """A signal Mamba-2 with odd dims (see ``MAMBA2_SPEC``)."""
    return write_model(tmp_path_factory.mktemp("mamba2"), demo_config(MAMBA2_SPEC), seed=12)


@pytest.fixture(scope="session")
def mamba2_token_model() -> MambaModel:
    """transformers' own Mamba2ForCausalLM files (sharded)."""
    return load_model(HF2_FIXTURES / "g2_k3_bias_untied_sharded")


def random_inputs(model: MambaModel, steps: int, seed: int) -> np.ndarray:
    """A sequence of valid inputs: ids (T,) or float32 (T, i)."""
    rng = np.random.default_rng(seed)
    c = model.config
    if c.is_token_model:
        return rng.integers(0, c.vocab_size, steps)
    return rng.standard_normal((steps, c.input_dim)).astype(np.float32)


# ---------------------------------------------------------------------------- service


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Models a test worker serves: the demo signal model, an odd-dims one, a token one,
    a signal Mamba-2 with odd dims and a Hugging Face Mamba2ForCausalLM (sharded, as
    transformers saved it)."""
    root = tmp_path_factory.mktemp("served-models")
    odd = DemoSpec(
        input_dim=5, output_dim=3, hidden=22, layers=3, state=7, expand=3, conv_kernel=3, seed=11
    )
    dirs = {
        "demo": root / "demo", "odd": root / "odd", "lm": root / "lm",
        "m2": root / "m2", "lm2": root / "lm2",
    }  # fmt: skip
    write_model(dirs["demo"], demo_config(DemoSpec()))
    write_model(dirs["odd"], demo_config(odd), seed=11)
    write_model(dirs["lm"], token_config(), seed=3)
    write_model(dirs["m2"], demo_config(MAMBA2_SPEC), seed=12)
    shutil.copytree(HF2_FIXTURES / "g2_k3_bias_untied_sharded", dirs["lm2"])
    return dirs


#: The served signal Mamba-2: odd dims (e = 48, 6 heads of 8 in 3 groups, n = 5, k = 3).
MAMBA2_SPEC = DemoSpec(
    input_dim=3, output_dim=3, hidden=24, layers=2, state=5, expand=2, conv_kernel=3,
    seed=12, arch="mamba2", head_dim=8, groups=3,
)  # fmt: skip


@pytest.fixture(scope="session")
def served_models(model_dirs: dict[str, Path]) -> dict[str, MambaModel]:
    """The same models loaded offline: the reference the served outputs must equal."""
    return {name: load_model(d, name=name) for name, d in model_dirs.items()}


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A private redis-server on a free loopback port (never 6379) in a temp dir."""
    data = tmp_path_factory.mktemp("redis")
    with EmbeddedRedis(EmbeddedRedisSettings(data_dir=data)) as server:
        assert server.port != 6379
        yield server


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterHarness]:
    """A 3-master Redis Cluster on loopback (started once, when a test first asks)."""
    with RedisClusterHarness(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelHarness]:
    """A master, a replica and three sentinels on loopback."""
    with SentinelHarness(tmp_path_factory.mktemp("redis-sentinel")) as sentinel:
        yield sentinel


#: Where the store can live. A module that sets ``ALL_TOPOLOGIES = True`` runs each of its
#: tests that use ``redis_url`` on every one (the cluster and Sentinel runs are slow-marked:
#: ``./dev test --all`` and CI run them, ``./dev test`` does not).
TOPOLOGIES = [
    pytest.param("single", id="single"),
    pytest.param("cluster", id="cluster", marks=[pytest.mark.slow, pytest.mark.topology]),
    pytest.param("sentinel", id="sentinel", marks=[pytest.mark.slow, pytest.mark.topology]),
]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "redis_url" in metafunc.fixturenames and getattr(metafunc.module, "ALL_TOPOLOGIES", False):
        metafunc.parametrize("redis_topology", TOPOLOGIES, indirect=True)


@pytest.fixture
def redis_topology(request: pytest.FixtureRequest) -> str:
    return getattr(request, "param", "single")


@pytest.fixture
def redis_url(request: pytest.FixtureRequest, redis_topology: str) -> str:
    """The test Redis, emptied for this test: one redis-server, unless the module asks
    for every topology (``ALL_TOPOLOGIES``)."""
    if redis_topology == "cluster":
        cluster: RedisClusterHarness = request.getfixturevalue("redis_cluster")
        cluster.flushall()
        return cluster.url
    if redis_topology == "sentinel":
        sentinel: SentinelHarness = request.getfixturevalue("redis_sentinel")
        sentinel.flushall()
        return sentinel.url
    server: EmbeddedRedis = request.getfixturevalue("redis_server")
    with redis.Redis.from_url(server.url) as conn:
        conn.flushall()
    return server.url


@pytest.fixture
def worker(model_dirs: dict[str, Path], redis_url: str) -> Iterator[WorkerHarness]:
    harness = WorkerHarness(model_dirs, redis_url)
    yield harness
    harness.stop()


@pytest.fixture
def start_worker(
    model_dirs: dict[str, Path], redis_url: str
) -> Iterator[Callable[..., WorkerHarness]]:
    """Start workers with custom settings; all are stopped after the test."""
    started: list[WorkerHarness] = []

    def start(url: str | None = None, **overrides: Any) -> WorkerHarness:
        harness = WorkerHarness(model_dirs, url or redis_url, **overrides)
        started.append(harness)
        return harness

    yield start
    for harness in started:
        harness.stop()


def make_token(capsys: pytest.CaptureFixture[str], path: Path, tenant: str, role: str) -> str:
    """A new token of ``tenant`` and ``role`` in the token file ``path`` (by the CLI)."""
    from ssmserve.client.cli import main as cli_main

    assert cli_main(["auth", "token", "--tenant", tenant, "--role", role, "--file", str(path)]) == 0
    return capsys.readouterr().out.strip().splitlines()[-1]


@pytest.fixture
def tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """A token file with a client of tenant-a and of tenant-b, an operator and an admin."""
    path = tmp_path / "tokens.toml"
    made = {
        "a": make_token(capsys, path, "tenant-a", "client"),
        "b": make_token(capsys, path, "tenant-b", "client"),
        "operator": make_token(capsys, path, "ops", "operator"),
        "admin": make_token(capsys, path, "ops", "admin"),
    }
    return {"path": path, **made}
