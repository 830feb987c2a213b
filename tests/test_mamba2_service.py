"""Mamba-2 served with Mamba-1's guarantees: every session RPC on a real worker (and a
second one for migration and crash recovery), each output compared bit for bit with the
offline engine. Two Mamba-2 models: ``m2``, a signal Mamba-2 with odd dims (3 groups of
2 heads, n = 5, k = 3), and ``lm2``, transformers' own ``Mamba2ForCausalLM`` files
(sharded, untied, with biases)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ssmserve.client.sync import Client
from ssmserve.server.cluster.ownership import OwnershipSettings
from ssmserve.server.state.checkpoint import Checkpoint
from ssmserve.v1 import ssmserve_pb2 as pb
from tests.conftest import random_inputs
from tests.test_forecast_fork import offline_forecast
from tests.test_service import as_inputs, assert_bit_equal, reference, stream

MAMBA2 = ["m2", "lm2"]


@pytest.mark.parametrize("name", MAMBA2)
def test_rollback_fork_and_forecast_are_exact(worker, served_models, name):
    model = served_models[name]
    x = random_inputs(model, 40, seed=61)
    ref = reference(model, x)
    sid = worker.client.create_session(name, snapshot_every=6).session_id
    stream(worker, sid, as_inputs(model, x[:20]))
    # rollback to a step between snapshots: snapshot 18 + 1 replayed step
    reply = worker.client.rollback(sid, to_step=13)
    assert (reply.step, reply.replayed_steps) == (13, 1)
    ckpt = Checkpoint.decode(worker.client.export_checkpoint(sid))
    assert ckpt.state.bit_equal(model.run(x[:13])[1])
    got, _ = stream(worker, sid, as_inputs(model, x[13:30]))
    assert_bit_equal(got, ref[13:30])
    # fork at 25, and both go on exactly
    fork = worker.client.fork(sid, at_step=25).session.session_id
    got, _ = stream(worker, fork, as_inputs(model, x[25:40]))
    assert_bit_equal(got, ref[25:40])
    assert worker.client.get_session(sid).step == 30
    # forecast from 30: the engine fed its own outputs, and nothing moved
    fc = worker.client.forecast(sid, 6)
    assert fc.from_step == 30
    assert_bit_equal(fc.outputs, offline_forecast(model, x, 6, at=30))
    assert worker.client.get_session(sid).step == 30


@pytest.mark.parametrize("name", MAMBA2)
def test_export_import_round_trip(worker, served_models, name):
    model = served_models[name]
    x = random_inputs(model, 24, seed=62)
    ref = reference(model, x)
    sid = worker.client.create_session(name, snapshot_every=5).session_id
    stream(worker, sid, as_inputs(model, x[:11]))
    blob = worker.client.export_checkpoint(sid)
    ckpt = Checkpoint.decode(blob)
    c = model.config
    assert ckpt.state.layers[0].ssm.shape == (c.num_heads, c.head_dim, c.state_size)
    info = worker.client.import_checkpoint(blob, f"{name}-copy")
    assert (info.step, info.model) == (11, name)
    for target in (sid, f"{name}-copy"):
        got, _ = stream(worker, target, as_inputs(model, x[11:]))
        assert_bit_equal(got, ref[11:])


@pytest.mark.parametrize("name", MAMBA2)
def test_migration_and_a_crash_lose_nothing(start_worker, served_models, name):
    model = served_models[name]
    x = random_inputs(model, 36, seed=63)
    ref = reference(model, x)
    a = start_worker(ownership=OwnershipSettings(lease_ttl_s=0.4))
    b = start_worker()
    sid = a.client.create_session(name, snapshot_every=7, durability=pb.DURABILITY_LOG)
    sid = sid.session_id
    stream(a, sid, as_inputs(model, x[:10]))
    with Client(b.address) as via_b:
        moved = via_b.migrate(sid, a.address)  # to where it is: nothing happens
        assert moved.target == a.address
    a.client.migrate(sid, b.address)
    got, _ = stream(a, sid, as_inputs(model, x[10:20]))  # the client follows
    assert_bit_equal(got, ref[10:20])
    b.client.migrate(sid, a.address)
    stream(a, sid, as_inputs(model, x[20:26]))
    a.crash()  # no shutdown snapshot: b reloads snapshot 21 + the logged steps
    deadline = time.monotonic() + 10  # bound: a's lease runs out 0.4 s after the crash
    while b.client.get_session(sid).owner == a.address:
        assert time.monotonic() < deadline, "the crashed worker's lease never ran out"
        time.sleep(0.05)
    got, _ = stream(b, sid, as_inputs(model, x[26:]))
    assert_bit_equal(got, ref[26:])
    assert b.client.get_session(sid).step == 36


@pytest.mark.parametrize("name", MAMBA2)
def test_served_outputs_equal_ssmserve_model_run(worker, model_dirs, served_models, name, tmp_path):
    """What a client is answered is what ``ssmserve model run`` writes, bit for bit (the
    CLI in its own process)."""
    import subprocess
    import sys

    model = served_models[name]
    x = random_inputs(model, 25, seed=64)
    np.save(tmp_path / "in.npy", x)
    run = subprocess.run(
        [sys.executable, "-m", "ssmserve.client.cli", "model", "run", str(model_dirs[name]),
         "--input", str(tmp_path / "in.npy"), "--output", str(tmp_path / "out.npy")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    sid = worker.client.create_session(name).session_id
    got, _ = stream(worker, sid, as_inputs(model, x))
    assert_bit_equal(got, np.load(tmp_path / "out.npy"))


def test_the_demo_cli_writes_a_signal_mamba2(tmp_path, capsys):
    from ssmserve.client.cli import main
    from ssmserve.server.engine.loader import load_model

    target = tmp_path / "m2"
    args = ["model", "init-demo", str(target), "--arch", "mamba2", "--hidden", "32"]
    assert main([*args, "--head-dim", "8", "--groups", "2"]) == 0
    assert "wrote signal Mamba-2" in capsys.readouterr().out
    model = load_model(target)
    assert (model.config.num_heads, model.config.n_groups) == (8, 2)
    assert main(["model", "inspect", str(target), "--json"]) == 0
    assert '"num_heads": 8' in capsys.readouterr().out
    assert main([*args, "--head-dim", "5", "--force"]) == 2  # 64 is no multiple of 5
    assert "multiple of head_dim" in capsys.readouterr().err
    np.testing.assert_equal(model.run(np.zeros((2, 4), np.float32))[0].shape, (2, 4))
