"""Q8_0 sessions served (issue 48 part 3): real workers started with ``--quantize q8_0``.

Every output is compared bit for bit with the offline engine loading the same directory
with ``quantize="q8_0"``; rollback and migration between two Q8_0 workers are exact and
lose nothing; and a session never crosses formats: a float32 worker refuses a Q8_0
session's checkpoint (its model's fingerprint names the format) and a migration to it
(its numerics name the format)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ssmserve.client.errors import FailedPrecondition
from ssmserve.server.cluster.ownership import OwnershipSettings
from ssmserve.server.engine.demo import DemoSpec, demo_config, random_tensors
from ssmserve.server.engine.loader import load_model, save_model
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.state.checkpoint import Checkpoint
from ssmserve.v1 import ssmserve_pb2 as pb
from tests.conftest import random_inputs, token_config
from tests.harness import WorkerHarness
from tests.test_service import as_inputs, assert_bit_equal, reference, stream

NAMES = ["lm8", "m2s8"]


@pytest.fixture(scope="module")
def q8_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A token Mamba (untied, biases) and a signal Mamba-2, widths multiples of 32 so
    their products are Q8_0 (dt_proj at rank 3 and the 3-wide input stay float32)."""
    root = tmp_path_factory.mktemp("q8-models")
    configs = {
        "lm8": token_config(hidden_size=64, intermediate_size=128, vocab_size=160),
        "m2s8": demo_config(
            DemoSpec(
                input_dim=3,
                output_dim=4,
                hidden=64,
                layers=2,
                state=8,
                arch="mamba2",
                head_dim=16,
                groups=2,
            )
        ),
    }
    for i, (name, config) in enumerate(configs.items()):
        save_model(root / name, config, random_tensors(config, seed=40 + i), dtype="BF16")
    return {name: root / name for name in configs}


@pytest.fixture(scope="module")
def q8_models(q8_dirs: dict[str, Path]) -> dict[str, MambaModel]:
    return {name: load_model(d, name=name, quantize="q8_0") for name, d in q8_dirs.items()}


@pytest.fixture
def start(q8_dirs: dict[str, Path], redis_url: str) -> Iterator[object]:
    started: list[WorkerHarness] = []

    def go(quantize: str = "q8_0", **overrides: object) -> WorkerHarness:
        harness = WorkerHarness(q8_dirs, redis_url, quantize=quantize, **overrides)
        started.append(harness)
        return harness

    yield go
    for harness in started:
        harness.stop()


@pytest.mark.parametrize("name", NAMES)
def test_q8_sessions_are_exact_through_rollback(start, q8_models, name):
    worker = start()
    model = q8_models[name]
    assert any(lin.format == "q8_0" for lin in model.linears)
    x = random_inputs(model, 30, seed=81)
    ref = reference(model, x)
    sid = worker.client.create_session(name, snapshot_every=6).session_id
    got, _ = stream(worker, sid, as_inputs(model, x[:20]))
    assert_bit_equal(got, ref[:20])
    reply = worker.client.rollback(sid, to_step=9)
    assert (reply.step, reply.replayed_steps) == (9, 3)
    assert Checkpoint.decode(worker.client.export_checkpoint(sid)).state.bit_equal(
        model.run(x[:9])[1]
    )
    got, _ = stream(worker, sid, as_inputs(model, x[9:30]))
    assert_bit_equal(got, ref[9:30])


def test_q8_migration_and_a_crash_lose_nothing(start, q8_models):
    name = "lm8"
    model = q8_models[name]
    x = random_inputs(model, 30, seed=82)
    ref = reference(model, x)
    a = start(ownership=OwnershipSettings(lease_ttl_s=0.4))
    b = start()
    sid = a.client.create_session(name, snapshot_every=7, durability=pb.DURABILITY_LOG)
    sid = sid.session_id
    stream(a, sid, as_inputs(model, x[:10]))
    a.client.migrate(sid, b.address)
    got, _ = stream(a, sid, as_inputs(model, x[10:20]))  # the client follows
    assert_bit_equal(got, ref[10:20])
    b.client.migrate(sid, a.address)
    stream(a, sid, as_inputs(model, x[20:24]))
    a.crash()  # no shutdown snapshot: b reloads a snapshot + the logged steps
    deadline = time.monotonic() + 10  # bound: a's lease runs out 0.4 s after the crash
    while b.client.get_session(sid).owner == a.address:
        assert time.monotonic() < deadline, "the crashed worker's lease never ran out"
        time.sleep(0.05)
    got, _ = stream(b, sid, as_inputs(model, x[24:]))
    assert_bit_equal(got, ref[24:])


def test_a_session_never_crosses_formats(start, q8_models):
    """A float32 worker serving the same directory: the Q8_0 session's checkpoint names
    a fingerprint it does not have, and its numerics differ, so both ways are refused
    with a message naming why, and the session stays where it was, untouched."""
    name = "lm8"
    model = q8_models[name]
    x = random_inputs(model, 12, seed=83)
    q8 = start()
    f32 = start(quantize="none")
    assert q8.worker.numerics.endswith("| weights q8_0")
    assert "q8_0" not in f32.worker.numerics
    sid = q8.client.create_session(name).session_id
    stream(q8, sid, as_inputs(model, x[:6]))
    blob = q8.client.export_checkpoint(sid)
    with pytest.raises(FailedPrecondition, match=r"fingerprint.*--quantize"):
        f32.client.import_checkpoint(blob, "copy")
    with pytest.raises(FailedPrecondition, match="numerics"):
        q8.client.migrate(sid, f32.address)
    assert q8.client.get_session(sid).owner == q8.address
    got, _ = stream(q8, sid, as_inputs(model, x[6:]))
    assert_bit_equal(got, reference(model, x)[6:])


def test_quantize_with_the_cuda_engine_is_refused_at_start(q8_dirs, redis_url):
    from ssmserve.server.worker import EngineUnavailableError, Worker, WorkerSettings

    settings = WorkerSettings(
        models=tuple(q8_dirs.items()), redis_url=redis_url, engine="cuda", quantize="q8_0"
    )
    with pytest.raises(EngineUnavailableError, match="cpu engine only"):
        asyncio.run(Worker(settings).start())
