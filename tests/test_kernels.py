"""The fused step kernels: their exp, thread safety of the step, the snapshot writer."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from ssmserve.server.engine.kernels import dot_in_order_f32, exp_f32, log1p_f32
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.recurrent_state import BatchState, LayerState, SessionState
from ssmserve.server.sessions.snapshot_writer import (
    MAX_WAITING,
    SnapshotJob,
    SnapshotWriter,
    SnapshotWrites,
)
from tests.conftest import random_inputs


def test_exp_is_within_two_ulp_of_the_true_value() -> None:
    x = np.linspace(-87.0, 88.0, 2_000_001, dtype=np.float32)
    got = exp_f32(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got - want) / ulp) <= 2.0
    assert exp_f32(np.zeros(3, np.float32)).tolist() == [1.0, 1.0, 1.0]


def test_log1p_is_within_two_ulp_of_the_true_value() -> None:
    """Over softplus's whole range: log1p(exp(x)) for x in [-87, 20], and tiny inputs."""
    y = np.concatenate(
        [
            np.exp(np.linspace(-87.0, 20.0, 2_000_001)).astype(np.float32),
            np.array([0.0, 1e-38, 1e-10, 6e-8, 1.0, 1.4142135, 1e8], np.float32),
        ]
    )
    got = log1p_f32(y).astype(np.float64)
    want = np.log1p(y.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    ulp[want == 0] = np.spacing(np.float32(0))
    assert np.max(np.abs(got - want) / ulp) <= 2.0
    assert log1p_f32(np.zeros(2, np.float32)).tolist() == [0.0, 0.0]


def test_exp_flushes_below_the_normal_range_and_clamps_above() -> None:
    x = np.array([-1e30, -200.0, -87.4, 88.0, 100.0, 1e30], np.float32)
    got = exp_f32(x)
    assert got[:3].tolist() == [0.0, 0.0, 0.0]  # no denormals, no NaN
    assert np.isfinite(got).all() and got[3] == got[4] == got[5]


def test_exp_in_place_gives_the_same_bits() -> None:
    x = np.random.default_rng(0).normal(0, 30, 10_000).astype(np.float32)
    assert np.array_equal(exp_f32(x.copy()), exp_f32(x))


def _fma_f32(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """a * b + c rounded once to float32 (ties to even), from the exact rational value."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    near = np.float32(float(exact))  # within one float32 step (double rounding aside)
    down, up = np.float32(-np.inf), np.float32(np.inf)
    candidates = [np.nextafter(near, down), near, np.nextafter(near, up)]
    best = min(
        candidates,
        key=lambda f: (abs(Fraction(float(f)) - exact), int(np.array(f).view(np.int32)) & 1),
    )
    return np.float32(best)


def _readout_reference(h: np.ndarray, c: np.ndarray) -> np.float32:
    """The readout's documented order: four fma chains from 0.0 over s = j, j + 4, ...
    (the s past a multiple of 4 go on the first chain), then (a0 + a1) + (a2 + a3)."""
    n = c.shape[0]
    sums = [np.float32(0.0)] * 4
    for s in range(4 * (n // 4)):
        sums[s % 4] = _fma_f32(h[s], c[s], sums[s % 4])
    for s in range(4 * (n // 4), n):
        sums[0] = _fma_f32(h[s], c[s], sums[0])
    return (sums[0] + sums[1]) + (sums[2] + sums[3])


@pytest.mark.parametrize("n", [1, 3, 4, 13, 16, 64, 128])
def test_the_readout_adds_in_its_documented_order(n: int) -> None:
    """The scans' readout (a vector intrinsic, kernels._partial_sums4) gives exactly the
    bits of its documented order, computed here with exactly rounded fma: the order is
    what keeps a session's bits independent of its batch, so it must not drift with the
    compiler. Magnitudes spread over 2**±20 so that a different order would round
    differently."""
    rng = np.random.default_rng(n)
    scale = np.exp2(rng.integers(-20, 20, size=(24, n))).astype(np.float32)
    h = (rng.standard_normal((24, n)) * scale).astype(np.float32)
    c = rng.standard_normal(n).astype(np.float32)
    got = dot_in_order_f32(h, c)
    want = np.array([_readout_reference(row, c) for row in h], np.float32)
    assert np.array_equal(got.view(np.int32), want.view(np.int32))
    reordered = np.array([np.float32(np.dot(row.astype(np.float64), c)) for row in h], np.float32)
    if n >= 13:  # the check can tell orders apart: another order gives other bits here
        assert not np.array_equal(got.view(np.int32), reordered.view(np.int32))


def test_steps_on_two_threads_at_once_match_sequential(signal_model: MambaModel) -> None:
    """Each thread has its own step buffers: the engine thread and a replay on the loop."""
    model = signal_model
    inputs = random_inputs(model, 24, seed=3)
    sizes = {0: 5, 1: 20}  # different padded sizes and the same one, in both threads
    want = {}
    for t, size in sizes.items():
        outs = []
        state = BatchState.stack([model.new_state()] * size)
        for i in range(24):
            state, out = model.step(state, np.repeat(inputs[i][None], size, axis=0))
            outs.append(out.copy())
        want[t] = outs
    got: dict[int, list[np.ndarray]] = {0: [], 1: []}
    barrier = threading.Barrier(2)

    def run(t: int) -> None:
        barrier.wait()
        state = BatchState.stack([model.new_state()] * sizes[t])
        for i in range(24):
            state, out = model.step(state, np.repeat(inputs[i][None], sizes[t], axis=0))
            got[t].append(out.copy())

    threads = [threading.Thread(target=run, args=(t,)) for t in sizes]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t in sizes:
        for a, b in zip(got[t], want[t], strict=True):
            assert np.array_equal(a, b)


# ---------------------------------------------------------------------------- SnapshotWriter


def test_writer_runs_one_write_at_a_time_in_order_and_drops_the_oldest_waiting() -> None:
    async def main() -> None:
        writer = SnapshotWriter("s")
        running = 0
        peak = 0
        done: list[int] = []
        release = asyncio.Event()

        def job(n: int) -> Callable[[], Awaitable[None]]:
            async def write() -> None:
                nonlocal running, peak
                running += 1
                peak = max(peak, running)
                await release.wait()
                running -= 1
                done.append(n)

            return write

        writes = SnapshotWrites(4)
        for n in range(2 + MAX_WAITING + 2):  # 1 in flight, then 1 + MAX_WAITING + 2 waiting
            writer.schedule(job(n), writes)
            await asyncio.sleep(0)
        release.set()
        await writer.settled()
        assert peak == 1
        # 0 was in flight; of the 1 + MAX_WAITING + 2 that waited, the oldest 2 + 1 dropped
        kept = list(range(2 + MAX_WAITING + 2))[-MAX_WAITING:]
        assert done == [0, *kept]
        assert writer.superseded == 3 and writer.written == 1 + MAX_WAITING
        assert not writer.busy and writes.in_flight == 0

    asyncio.run(main())


def test_writer_survives_a_failing_write_and_cancel_stops_it() -> None:
    async def main() -> None:
        writer = SnapshotWriter("s")
        writes = SnapshotWrites(1)
        done: list[str] = []

        async def bad() -> None:
            raise RuntimeError("boom")

        async def good() -> None:
            done.append("good")

        writer.schedule(bad, writes)
        writer.schedule(good, writes)
        await writer.settled()
        assert done == ["good"]

        started = asyncio.Event()

        async def slow() -> None:
            started.set()
            await asyncio.sleep(60)

        writer.schedule(slow, writes)
        writer.schedule(good, writes)
        await started.wait()
        writer.cancel()
        await writer.settled()
        assert done == ["good"] and not writer.busy
        # its slot is free again: a write of another session runs
        other = SnapshotWriter("t")
        other.schedule(good, writes)
        await asyncio.wait_for(other.settled(), 5)
        assert done == ["good", "good"] and writes.in_flight == 0

    asyncio.run(main())


@pytest.mark.parametrize("cancelled", [False, True])
def test_a_session_a_guard_rollback_waits_for_writes_next(cancelled: bool) -> None:
    """A guard rollback waits for its session's writes inside a stepper batch
    (``settled(hurry=True)``): that session's writes go before the others waiting for a
    slot, and then the others go on in turn. A cancelled waiter hurries no further."""

    async def main() -> None:
        writes = SnapshotWrites(1)
        a, b, c = SnapshotWriter("a"), SnapshotWriter("b"), SnapshotWriter("c")
        order: list[str] = []
        release = asyncio.Event()

        def job(name: str, gate: asyncio.Event | None = None) -> SnapshotJob:
            async def run() -> None:
                if gate is not None:
                    await gate.wait()
                order.append(name)

            return run

        a.schedule(job("a1", release), writes)  # in flight, holding the only slot
        b.schedule(job("b1"), writes)
        c.schedule(job("c1"), writes)
        c.schedule(job("c2"), writes)
        await asyncio.sleep(0)
        waiter = asyncio.create_task(c.settled(hurry=True))
        await asyncio.sleep(0)
        if cancelled:
            waiter.cancel()
            await asyncio.gather(waiter, return_exceptions=True)
            assert c._hurried == 0
        release.set()
        await asyncio.wait_for(asyncio.gather(b.settled(), c.settled()), 5)
        # c's writes were due after b's. Hurried, both go first; a waiter cancelled after
        # it moved c up leaves that one move, and c's next write goes back in turn.
        expected = ["a1", "c1", "b1", "c2"] if cancelled else ["a1", "c1", "c2", "b1"]
        assert order == expected and writes.in_flight == 0

    asyncio.run(main())


def test_a_workers_writes_take_turns_in_its_slots() -> None:
    """Writes of many sessions due at once: at most ``limit`` in flight, one per session,
    sessions served in the order they came due (a session's next write queues behind the
    others), and a task exists only for a write in flight."""

    async def main() -> None:
        writes = SnapshotWrites(2)
        writers = [SnapshotWriter(f"s{i}") for i in range(5)]
        gates = {i: asyncio.Event() for i in range(5)}
        running: set[str] = set()
        started: list[tuple[str, int]] = []
        peak = 0

        def job(name: str, n: int) -> Callable[[], Awaitable[None]]:
            async def write() -> None:
                nonlocal peak
                assert name not in running  # one per session
                running.add(name)
                peak = max(peak, len(running))
                started.append((name, n))
                await gates[int(name[1:])].wait()
                running.discard(name)

            return write

        for i, w in enumerate(writers):
            w.schedule(job(w.session_id, 0), writes)
            if i == 0:
                w.schedule(job(w.session_id, 1), writes)  # s0 has a second write waiting
        await asyncio.sleep(0)
        tasks = [t for t in asyncio.all_tasks() if t.get_name().startswith("snapshot-writer")]
        assert len(tasks) == 2 and writes.in_flight == 2
        assert all(w.busy for w in writers)
        for i in range(5):
            gates[i].set()
        await asyncio.wait_for(asyncio.gather(*(w.settled() for w in writers)), 5)
        assert peak <= 2 and writes.in_flight == 0
        order = [name for name, _ in started]
        assert order[:2] == ["s0", "s1"] and order.index("s0", 1) == 5  # s0 again last
        assert sorted(started) == [("s0", 0), ("s0", 1)] + [(f"s{i}", 0) for i in range(1, 5)]

        # A session cancelled while it waited for a slot: its write never runs, its waiters
        # wake, and the slot goes to the next session.
        hold = asyncio.Event()
        gates[1] = hold
        gates[3] = hold
        writers[1].schedule(job("s1", 2), writes)
        writers[3].schedule(job("s3", 2), writes)
        writers[2].schedule(job("s2", 2), writes)  # waits: both slots are taken
        writers[4].schedule(job("s4", 2), writes)
        await asyncio.sleep(0)
        writers[2].cancel()
        await asyncio.wait_for(writers[2].settled(), 5)
        hold.set()
        await asyncio.wait_for(asyncio.gather(*(w.settled() for w in writers)), 5)
        assert ("s2", 2) not in started and ("s4", 2) in started

    asyncio.run(main())


def test_a_closed_workers_writes_do_not_start() -> None:
    """A worker that stops without writing (``abandon``): writes waiting for a slot never
    start, their sessions settle, the one in flight ends without starting the next, and
    nothing scheduled afterwards runs."""

    async def main() -> None:
        writes = SnapshotWrites(1)
        writers = [SnapshotWriter(f"s{i}") for i in range(3)]
        release = asyncio.Event()
        ran: list[str] = []

        def job(name: str) -> Callable[[], Awaitable[None]]:
            async def write() -> None:
                ran.append(name)
                await release.wait()

            return write

        for w in writers:
            w.schedule(job(w.session_id), writes)
        writers[0].schedule(job("s0 again"), writes)
        await asyncio.sleep(0)
        assert ran == ["s0"]
        writes.close()
        await asyncio.wait_for(asyncio.gather(writers[1].settled(), writers[2].settled()), 5)
        assert writers[0].busy
        release.set()
        await asyncio.wait_for(writers[0].settled(), 5)
        assert not writers[1].schedule(job("late"), writes)
        await asyncio.sleep(0)
        assert ran == ["s0"] and writes.in_flight == 0 and not any(w.busy for w in writers)

    asyncio.run(main())


def test_waiting_for_writes_to_settle_can_be_cancelled() -> None:
    """A caller that stops waiting (its RPC was cancelled) leaves the write and the other
    waiters be."""

    async def main() -> None:
        writes = SnapshotWrites(1)
        writer = SnapshotWriter("s")
        release = asyncio.Event()
        done: list[int] = []

        async def write() -> None:
            await release.wait()
            done.append(1)

        writer.schedule(write, writes)
        first = asyncio.create_task(writer.settled())
        second = asyncio.create_task(writer.settled())
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.sleep(0)
        assert first.cancelled() and not second.done() and writer.busy
        release.set()
        await asyncio.wait_for(second, 5)
        assert done == [1] and not writer.busy

    asyncio.run(main())


@pytest.mark.parametrize("fixture", ["demo_model", "token_model", "mamba2_model"])
def test_a_packed_state_unpacks_to_the_same_bits_and_checkpoint(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    """What a waiting periodic snapshot holds (``SessionState.packed``, one buffer) gives
    back the state bit for bit, and the same checkpoint bytes as a copy of the state would,
    for a batch row and for a state of its own; a buffer of the wrong size is refused."""
    from ssmserve.server.state.checkpoint import Checkpoint, CheckpointMeta, InputHistory

    model: MambaModel = request.getfixturevalue(fixture)
    c = model.config
    batch = BatchState.stack([model.new_state()] * 5)
    new, _ = model.step(batch, random_inputs(model, 5, seed=3))
    shapes = (c.num_hidden_layers, c.conv_state_shape, c.ssm_state_shape)
    history = InputHistory(7, random_inputs(model, 3, seed=4))
    for state in (new.session(2), new.session(4).copy()):
        buffer = state.packed()
        assert buffer.base is None and buffer.nbytes == state.nbytes  # a copy, one array
        back = SessionState.unpacked(buffer, *shapes)
        assert back.bit_equal(state)
        meta = CheckpointMeta(created_at=1.0, reason="periodic")
        blobs = [
            Checkpoint("s", 9, model.name, model.fingerprint, st, history, meta).encode()
            for st in (back, state.copy())
        ]
        assert blobs[0] == blobs[1]
    with pytest.raises(ValueError, match="packed state"):
        SessionState.unpacked(buffer[:-1], *shapes)


@pytest.mark.parametrize("size", [1, 17])
def test_idle_state_copy_owns_its_memory(demo_model: MambaModel, size: int) -> None:
    batch = BatchState.stack([demo_model.new_state()] * size)
    new, _ = demo_model.step(batch, random_inputs(demo_model, size, seed=1))
    row = new.session(0)
    assert row.is_view
    own = row.copy()
    assert not own.is_view and own.bit_equal(row)


def test_new_sessions_share_one_read_only_zero_state(demo_model: MambaModel) -> None:
    """Every new state is the same read-only zeros (a worker creates sessions by the
    thousand): writing into it raises, and what a session makes of it is its own."""
    a, b = demo_model.new_state(), demo_model.new_state()
    assert a._packed is b._packed and not a._packed.flags.writeable
    assert not a.is_view and not a._packed.any()
    with pytest.raises(ValueError, match="read-only"):
        a.layers[0].ssm[0, 0] = 1.0
    own = a.copy()
    own.layers[0].ssm[0, 0] = 1.0  # a copy is writable and its own
    assert not b._packed.any()
    new, _ = demo_model.step(BatchState.stack([a, b]), random_inputs(demo_model, 2, seed=2))
    assert new.conv[0].flags.writeable and not b._packed.any()


@pytest.mark.parametrize("fixture", ["demo_model", "mamba2_model"])
def test_the_three_forms_of_a_state_step_to_the_same_bits(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    """A batch row, a packed state (what ``copy`` makes for an idle session) and a state of
    per-layer arrays (a decoded checkpoint) are one state to the engine: stacked in any mix
    they step to the same bits. A packed state keeps one array of its own and no per-layer
    objects; its copies do not share memory."""
    model: MambaModel = request.getfixturevalue(fixture)
    batch = BatchState.stack([model.new_state()] * 3)
    new, _ = model.step(batch, random_inputs(model, 3, seed=5))
    row = new.session(1)
    packed = row.copy()
    per_layer = SessionState(tuple(LayerState(a.conv.copy(), a.ssm.copy()) for a in row.layers))
    assert packed._layers is None and packed._packed is not None  # nothing per layer kept
    assert not packed.is_view and packed.nbytes == row.nbytes
    assert all(layer.ssm.base is packed._packed for layer in packed.layers)
    again = packed.copy()
    again._packed[:] = 0  # the copy's own buffer: the original is untouched
    assert packed.bit_equal(row) and not again.bit_equal(row)

    inputs = np.repeat(random_inputs(model, 1, seed=6), 3, axis=0)  # one input, every row
    outputs = []
    for states in ([row, packed, per_layer], [per_layer, row, packed], [packed] * 3):
        stepped, out = model.step(BatchState.stack(states), inputs)
        outputs.append((out.tobytes(), [stepped.session(i).packed().tobytes() for i in range(3)]))
    assert outputs[0][1][0] == outputs[0][1][1] == outputs[0][1][2]
    assert all(o == outputs[0] for o in outputs)


WARM_CHECK = """
import asyncio, json, sys
from numba.core.registry import CPUDispatcher
from ssmserve.server.engine import kernels, products
from ssmserve.server.worker import Worker, WorkerSettings

async def main():
    dispatchers = [
        f for f in {id(f): f for f in [*vars(kernels).values(), *vars(products).values()]}.values()
        if isinstance(f, CPUDispatcher) and f.targetoptions.get("inline") != "always"
        # the tests' handles on the inlined exp, log1p and readout; steps never call them;
        # and FalconMamba's mixer norms, which only its steps call (test_hf_architectures.py)
        and f.__name__ not in ("exp_f32", "log1p_f32", "dot_in_order_f32", "mixer_rms_norms")
    ]
    cold_before = [f.__name__ for f in dispatchers if not f.signatures]
    w = Worker(WorkerSettings(models=(("demo", sys.argv[1]), ("m2", sys.argv[3])),
                              listen="127.0.0.1:0", redis_url=sys.argv[2]))
    await w.start()  # registered and SERVING when this returns
    cold_after = [f.__name__ for f in dispatchers if not f.signatures]
    await w.stop()
    print(json.dumps([cold_before, cold_after]))

asyncio.run(main())
"""


def test_a_worker_compiles_its_kernels_before_it_serves(model_dirs, redis_url, tmp_path) -> None:
    """With an empty numba cache, every kernel is compiled by the time start() returns (the
    worker is registered and reports SERVING then): no request pays for a compile, and no
    compile holds up the event loop and its lease renewals."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    out = subprocess.run(
        [sys.executable, "-c", WARM_CHECK, str(model_dirs["demo"]), redis_url,
         str(model_dirs["m2"])],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    )  # fmt: skip
    cold_before, cold_after = json.loads(out.stdout.strip().splitlines()[-1])
    # the kernels a step runs: the product, its column-range form and its tile, 4 of
    # Mamba-1 (2 of them through their channel-range forms) and the fused mixer that calls
    # them, 2 more of Mamba-2 (1 through its heads' form)
    assert len(cold_before) == 13, cold_before
    assert cold_after == []


def _kernel_signatures() -> dict[str, list[str]]:
    from numba.core.registry import CPUDispatcher

    from ssmserve.server.engine import kernels, products, spin, split_step

    return {
        f"{module.__name__}.{name}": [str(s) for s in f.signatures]
        for module in (kernels, products, spin, split_step)
        for name, f in vars(module).items()
        if isinstance(f, CPUDispatcher)
    }


@pytest.mark.parametrize("shared", [False, True], ids=["per-product", "shared-stack"])
def test_no_request_compiles_a_kernel(
    model_dirs, redis_url, served_models, shared, monkeypatch
) -> None:
    """numba compiles a kernel again for each new argument type (a read-only or
    non-contiguous array is another type): a request that met one would stall its worker
    for seconds. Every kind of request, on every served model, and sessions restored by a
    second worker from Redis (state decoded from checkpoint bytes) run on the kernels
    compiled at start: no new signature appears. ``shared-stack``: these small models'
    small batches run as one call per thread (``split_step``), as a big model's do."""
    from ssmserve.server.engine import split_step
    from tests.harness import WorkerHarness

    if shared:
        monkeypatch.setattr(split_step, "MIN_MODEL_BYTES", 0)

    sessions: dict[str, str] = {}
    first = WorkerHarness(model_dirs, redis_url)
    try:
        before = _kernel_signatures()
        client = first.client
        for name, model in served_models.items():
            x = random_inputs(model, 16, seed=1)
            sid = sessions[name] = client.create_session(name).session_id
            for t in range(12):
                client.step(sid, x[t], step=t + 1)
            client.snapshot(sid, label="a")
            if model.config.is_token_model or model.config.input_dim == model.config.output_dim:
                client.forecast(sid, 3)
            client.fork(sid)
            blob = client.export_checkpoint(sid)
            client.rollback(sid, to_step=5)
            client.import_checkpoint(blob, session_id=f"{sid}-copy")
            client.history(sid)
        served = _kernel_signatures()
    finally:
        first.stop()
    second = WorkerHarness(model_dirs, redis_url)
    try:
        for name, sid in sessions.items():
            x = random_inputs(served_models[name], 16, seed=1)
            second.client.step(sid, x[5], step=6)  # restored from its snapshot and log
            second.client.step(f"{sid}-copy", x[12], step=13)
        restored = _kernel_signatures()
    finally:
        second.stop()
    assert served == before
    assert restored == before
    if shared:  # both stacks ran, compiled at start (other tests may have compiled them too)
        stacks = [k for k, v in before.items() if k.endswith(("1_stack", "2_stack")) and v]
        assert len(stacks) == 2


def test_a_batched_step_reuses_the_last_steps_pages() -> None:
    """States are values, so each step allocates new state arrays; with glibc's default
    thresholds a step at batch 64 (8 MiB of state here) faulted ~1,300 fresh pages in and
    spent ~30% of its time in the kernel. ``keep_freed_pages`` (set when a model is built)
    keeps the freed pages: after a warm-up, steps fault in (almost) nothing."""
    import resource

    from ssmserve.server.engine.allocator import _LIBC, keep_freed_pages
    from ssmserve.server.engine.demo import DemoSpec, demo_config, random_tensors
    from ssmserve.server.engine.model_tensors import build_model

    config = demo_config(DemoSpec(input_dim=8, output_dim=8, hidden=256, layers=4, state=16))
    model = build_model(config, random_tensors(config, 0), name="signal-256x4")
    if _LIBC is None or not keep_freed_pages():
        pytest.skip("not glibc, or SSMSERVE_KEEP_FREED_MB=0")
    batch = 64
    state = BatchState.stack([model.new_state() for _ in range(batch)])
    assert sum(a.nbytes for a in state.ssm) >= 4 << 20  # past glibc's default thresholds
    x = np.zeros((batch, config.input_dim), np.float32)
    for _ in range(3):
        state, _ = model.step(state, x)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        state, _ = model.step(state, x)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    state_pages = sum(a.nbytes for a in (*state.ssm, *state.conv)) // 4096
    assert faults < state_pages  # 10 steps fault in less than one step's state


_ARENA_PROBE = """
import ctypes, json, os
from concurrent.futures import ThreadPoolExecutor
from ssmserve.server.engine import allocator

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

if allocator._LIBC is None or not allocator.keep_freed_pages():
    print(json.dumps(None))
    raise SystemExit
engine = ThreadPoolExecutor(1)
allocator.allocates_engine_arrays(engine)

libc = allocator._LIBC
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

def churn():  # a batch's state made and freed on the engine thread, the last block of its arena
    block = libc.malloc(24 << 20)  # under the mmap threshold: from the arena
    libc.memset(block, 1, 24 << 20)
    libc.free(block)

engine.submit(lambda: None).result()
before = rss()
engine.submit(churn).result()
churned = rss()
libc.malloc_trim(0)
trimmed = rss()
allocator.return_freed_memory()
engine.submit(lambda: None).result()  # the trim queued on the engine thread has run
print(json.dumps({"before": before, "churned": churned, "trimmed": trimmed, "after": rss()}))
"""


def test_an_engine_threads_arena_gives_its_freed_top_back() -> None:
    """Arrays made on an engine thread come from that thread's glibc arena. With the trim
    threshold ``keep_freed_pages`` sets, ``malloc_trim`` leaves the free top of such an
    arena in the process (a worker kept ~12 MB of freed batch states so);
    ``return_freed_memory`` has each registered engine thread give it back. In a fresh
    interpreter: there a new thread gets an arena of its own, not the main one."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "SSMSERVE_"))}
    out = subprocess.run(
        [sys.executable, "-c", _ARENA_PROBE], capture_output=True, text=True, timeout=60,
        check=True, env=env,
    )  # fmt: skip
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    if rss is None:
        pytest.skip("not glibc, or SSMSERVE_KEEP_FREED_MB=0")
    mib = 1 << 20
    # RSS is the whole process's: malloc_trim(0) also gives back free pages of the main
    # arena and of Python's own heaps (up to ~6 MiB seen), so the premise is checked with
    # half the 24 MiB block as its margin, and the guarantee against the block itself.
    assert rss["churned"] - rss["before"] >= 20 * mib, rss  # freed, kept for the next steps
    assert rss["trimmed"] - rss["before"] >= 12 * mib, rss  # malloc_trim leaves the top
    assert rss["trimmed"] - rss["after"] >= 12 * mib, rss  # the engine thread's trim frees it
    assert rss["after"] - rss["before"] <= 4 * mib, rss  # given back


def test_engine_settings_from_the_environment_are_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each engine knob in the environment: unset or empty gives its default, a value in
    range is used, anything else is an error that names the variable and its range."""
    from ssmserve.server.engine import allocator, numerics, threads

    knobs = {
        "SSMSERVE_KEEP_FREED_MB": (allocator.keep_freed_mb, allocator.DEFAULT_KEEP_FREED_MB, 0),
        "SSMSERVE_ENGINE_THREADS": (threads.engine_threads, threads.DEFAULT_ENGINE_THREADS, 3),
    }
    for name, (read, default, fine) in knobs.items():
        monkeypatch.delenv(name, raising=False)
        assert read() == default
        monkeypatch.setenv(name, "")
        assert read() == default
        monkeypatch.setenv(name, str(fine))
        assert read() == fine
        for bad in ("x", "-1", "2.5", str(2 << 20)):
            monkeypatch.setenv(name, bad)
            with pytest.raises(ValueError, match=f"{name} must be (an integer|in )"):
                read()
        monkeypatch.delenv(name)
    # BLAS threads are read when they are pinned; a bad value must not pin anything
    monkeypatch.setenv("SSMSERVE_BLAS_THREADS", "two")
    with pytest.raises(ValueError, match=r"SSMSERVE_BLAS_THREADS must be an integer, got 'two'"):
        numerics.pin_blas_threads()


@pytest.mark.parametrize("fixture", ["signal_model", "token_model", "demo_model"])
def test_the_fused_mixer_gives_the_bits_of_its_kernels_called_one_by_one(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    """``kernels.mamba_mixer`` (one compiled call per layer) against the same products and
    kernels called from Python (``mix_in_steps``): outputs and states bit for bit, alone
    and in a batch that is cut into row ranges on two threads."""
    from ssmserve.server.engine.mamba1 import MambaBlockWeights

    model: MambaModel = request.getfixturevalue(fixture)
    runs = {}
    for fused in (True, False):
        MambaBlockWeights.fused = fused
        try:
            for batch in (1, 7, 40):
                state = BatchState.stack([model.new_state() for _ in range(batch)])
                outputs = []
                for t in range(4):
                    x = random_inputs(model, batch, seed=100 * batch + t)
                    state, out = model.step(state, x)
                    outputs.append(out.tobytes())
                arrays = b"".join(a.tobytes() for a in (*state.conv, *state.ssm))
                runs[fused, batch] = (outputs, arrays)
        finally:
            MambaBlockWeights.fused = True
    for batch in (1, 7, 40):
        assert runs[True, batch] == runs[False, batch]


VECTOR_WIDTH_CHECK = """
import hashlib, json
import numpy as np
from ssmserve.server.engine import products
from ssmserve.server.engine.demo import DemoSpec, demo_config, random_tensors
from ssmserve.server.engine.model_tensors import build_model
from ssmserve.server.engine.numerics import RowStableLinear
from ssmserve.server.engine.recurrent_state import BatchState, SessionState
rng = np.random.default_rng(3)
weight = rng.standard_normal((101, 67)).astype(np.float32)
lin = RowStableLinear(weight, rng.standard_normal(101).astype(np.float32))
digest = hashlib.sha256()
for rows in (1, 3, 4, 9):
    digest.update(lin(rng.standard_normal((rows, 67)).astype(np.float32)).tobytes())
spec = DemoSpec(input_dim=5, output_dim=3, hidden=40, layers=2, state=7, expand=3,
                conv_kernel=3, seed=2)
config = demo_config(spec)
model = build_model(config, random_tensors(config, 2), name="width")
state = BatchState.stack([model.new_state() for _ in range(6)])
for _ in range(4):
    state, out = model.step(state, rng.standard_normal((6, 5)).astype(np.float32))
    digest.update(out.tobytes())
for a in state.conv + state.ssm:
    digest.update(a.tobytes())
print(json.dumps([products.COLUMNS, digest.hexdigest()]))
"""


def test_the_vector_width_changes_no_bits(tmp_path) -> None:
    """The product kernel uses 16-float vectors on AVX-512 CPUs and 8-float ones elsewhere
    (panels of 48 or 24 columns); each element's arithmetic is the same fma chain either
    way, so products and steps give the same bits. Compiled once for this CPU (in the
    engine's own cache, which the other tests keep warm: numba keys each cached kernel by the
    CPU it was compiled for) and once for a generic x86-64 with AVX-512 turned off (numba's
    NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, in a cold cache of its own)."""
    import llvmlite.binding as llvm

    host = llvm.get_host_cpu_features().flatten()
    if "+avx2" not in host.split(","):
        pytest.skip("needs an x86-64 CPU with AVX2")
    without_512 = ",".join(
        "-" + f[1:] if f[1:].startswith("avx512") else f for f in host.split(",")
    )
    results = []
    for env in (
        {},
        {
            "NUMBA_CACHE_DIR": str(tmp_path / "generic"),
            "NUMBA_CPU_NAME": "generic",
            "NUMBA_CPU_FEATURES": without_512,
        },
    ):
        out = subprocess.run(
            [sys.executable, "-c", VECTOR_WIDTH_CHECK],
            env={**os.environ, **env},
            capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    (host_columns, host_bits), (generic_columns, generic_bits) = results
    assert generic_columns == 24
    assert host_columns == (48 if "+avx512f" in host.split(",") else 24)
    assert host_bits == generic_bits


def test_compiled_kernels_are_cached_under_the_engine_sources_digest() -> None:
    """numba's cache checks only a function's own file, and the fused mixer inlines the
    product kernel of another file: the cache directory is keyed by a hash of every engine
    source, so a change to any of them starts cold (a stale mixer once ran 24-column code
    on 48-column panels)."""
    import numba

    from ssmserve.server.engine import compile_cache, kernels, products

    expected = f"ssmserve-engine-{compile_cache.engine_source_digest()[:16]}"
    assert Path(numba.config.CACHE_DIR).name == expected
    for kernel in (kernels.mamba_mixer, kernels.selective_scan, products.product_rows):
        path = Path(kernel._cache._impl.locator.get_cache_path())
        assert expected in path.parts, (kernel, path)
