"""A small batch's stack shared over threads in one compiled call each (``split_step``):
the bits of one thread, whatever the thread count, the architecture or the weights'
format, and whether or not the helpers join in time; the spin barrier and the join."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ssmserve.server.engine import split_step
from ssmserve.server.engine.config import Architecture
from ssmserve.server.engine.demo import DemoSpec, demo_config, random_tensors
from ssmserve.server.engine.loader import load_model, save_model
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.recurrent_state import BatchState
from ssmserve.server.engine.spin import atomic_add, barrier, join_as_helper, new_sync, open_helpers
from tests.conftest import random_inputs, token_config

CONFIGS = {
    "mamba": token_config(
        hidden_size=64, intermediate_size=128, vocab_size=300, time_step_rank=4,
        num_hidden_layers=3,
    ),
    "falcon": token_config(
        hidden_size=64, intermediate_size=128, vocab_size=300, time_step_rank=4,
        num_hidden_layers=3, mixer_rms_eps=1e-6, use_bias=False,
    ),
    "mamba2": demo_config(
        DemoSpec(input_dim=3, output_dim=5, hidden=64, layers=3, state=8, arch="mamba2",
                 head_dim=16, groups=2)
    ),
    "mamba2-lm": token_config(
        architecture=Architecture.MAMBA2_LM, hidden_size=64, intermediate_size=128, vocab_size=200,
        time_step_rank=0, num_hidden_layers=2, state_size=16, num_heads=8, head_dim=16,
        n_groups=1, use_bias=False, tie_word_embeddings=True,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, MambaModel]:
    root = tmp_path_factory.mktemp("split")
    out = {}
    for i, (name, config) in enumerate(CONFIGS.items()):
        save_model(root / name, config, random_tensors(config, seed=i), dtype="BF16")
        out[name] = load_model(root / name, name=name)
        out[f"{name}-q8"] = load_model(root / name, name=name, quantize="q8_0")
    return out


def _steps(model: MambaModel, threads: int, batch: int, seed: int) -> tuple[bytes, BatchState]:
    model.threads = threads
    rng = np.random.default_rng(seed)
    c = model.config
    state = BatchState.stack([model.new_state() for _ in range(batch)])
    outs = []
    for _ in range(4):
        x = (rng.integers(0, c.vocab_size, batch) if c.is_token_model
             else rng.standard_normal((batch, c.input_dim)).astype(np.float32))  # fmt: skip
        state, out = model.step(state, x)
        outs.append(out.tobytes())
    return b"".join(outs), state


@pytest.mark.parametrize("name", [*CONFIGS, *(f"{n}-q8" for n in CONFIGS)])
def test_a_shared_step_has_the_bits_of_one_thread(models, name, monkeypatch):
    monkeypatch.setattr(split_step, "MIN_MODEL_BYTES", 0)  # share even these small models
    model = models[name]
    for batch in (1, 2, 3):
        want, want_state = _steps(model, 1, batch, seed=batch)
        for threads in (2, 3):
            got, state = _steps(model, threads, batch, seed=batch)
            assert got == want, (name, batch, threads)
            for a, b in zip(state.conv + state.ssm, want_state.conv + want_state.ssm, strict=True):
                assert a.tobytes() == b.tobytes()
    assert getattr(model, "_stack_weights", None) is not None  # the shared path ran


def test_helpers_that_do_not_join_in_time_leave_the_step_to_the_caller(models, monkeypatch):
    """A pool busy elsewhere: the caller closes the call at once and runs alone (a helper
    arriving later leaves), with the same bits."""
    monkeypatch.setattr(split_step, "MIN_MODEL_BYTES", 0)
    monkeypatch.setattr(split_step, "JOIN_SPINS", 0)
    model = models["mamba"]
    want, _ = _steps(model, 1, 2, seed=5)
    got, _ = _steps(model, 2, 2, seed=5)
    assert got == want


def test_the_barrier_holds_every_thread_until_all_arrive():
    parties, rounds = 3, 2000
    sync, counter, late = new_sync(), np.zeros(1, np.int64), np.zeros(parties, np.int64)

    def run(tid: int) -> None:
        _count_rounds(sync, parties, counter, rounds, tid, late)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(1, parties)]
    for t in threads:
        t.start()
    run(0)
    for t in threads:
        t.join(timeout=60)
    assert counter[0] == parties * rounds
    assert not late.any()  # after each barrier every thread had counted that round


def _count_rounds(sync, parties, counter, rounds, tid, late):
    from numba import njit

    @njit(nogil=True, cache=False)
    def rounds_of(sync, parties, counter, rounds, tid, late):
        for i in range(rounds):
            atomic_add(counter, 0, 1)
            barrier(sync, parties)
            if counter[0] < parties * (i + 1):
                late[tid] += 1
            barrier(sync, parties)

    rounds_of(sync, parties, counter, rounds, tid, late)


def test_a_call_counts_the_helpers_that_joined_and_closes_to_later_ones():
    sync = new_sync()
    got: list[tuple[int, int]] = []
    helper = threading.Thread(target=lambda: got.append(join_as_helper(sync)))
    helper.start()
    assert open_helpers(sync, 1, 10**9) == 2  # waits for the one submitted
    helper.join(timeout=60)
    assert got == [(1, 2)]
    late = new_sync()
    assert open_helpers(late, 2, 0) == 1  # nobody joined in time: alone
    assert join_as_helper(late) == (0, 0)  # a latecomer leaves


def test_the_chooser_takes_the_faster_way_and_tries_the_other_now_and_then():
    """Shared first, then alone (each way's first call is not counted: it may compile),
    then whichever was faster, with the other tried every PROBE_EVERY calls, so a change
    of the machine's load changes the choice."""
    chooser = split_step.ShareChooser()
    picks = []
    for _ in range(4):  # two calls of each way before both are known
        shared = chooser.share_next(1)
        picks.append(shared)
        chooser.record(1, shared, 0.010 if shared else 0.020)
    assert picks == [True, True, False, False]
    picks = []
    for _ in range(2 * split_step.PROBE_EVERY):
        shared = chooser.share_next(1)
        picks.append(shared)
        chooser.record(1, shared, 0.010 if shared else 0.020)
    assert picks.count(False) == 2  # the probes of the slower way, alone
    for _ in range(3 * split_step.PROBE_EVERY):  # sharing turns slow: another process
        shared = chooser.share_next(1)
        chooser.record(1, shared, 0.040 if shared else 0.020)
    assert [chooser.share_next(1) for _ in range(split_step.PROBE_EVERY - 1)].count(False) >= 30
    assert chooser.share_next(2)  # each batch size has its own record


@pytest.mark.parametrize("name", ["lm", "lm2", "m2"])
def test_a_worker_serves_shared_steps_with_the_offline_bits(
    start_worker, served_models, name, monkeypatch
):
    """Through a real worker (its lanes, its pool, its warm-up): one session's steps, a
    rollback and the steps again, every output the offline engine's."""
    from tests.test_service import as_inputs, assert_bit_equal, reference, stream

    monkeypatch.setattr(split_step, "MIN_MODEL_BYTES", 0)
    model = served_models[name]
    worker = start_worker()
    x = random_inputs(model, 24, seed=9)
    ref = reference(model, x)
    sid = worker.client.create_session(name, snapshot_every=5).session_id
    got, _ = stream(worker, sid, as_inputs(model, x[:16]), per_message=1)
    assert_bit_equal(got, ref[:16])
    worker.client.rollback(sid, to_step=7)
    got, _ = stream(worker, sid, as_inputs(model, x[7:24]), per_message=1)
    assert_bit_equal(got, ref[7:24])
