"""The stepper on its own (``sessions/stepper.py``): built from its real collaborators
(residency, checkpoints, replay, the model's engine lane) on a real redis-server, with no
session manager and no gRPC. Runs of several sessions go through its batches; each test
checks every step's outcome, what the log in Redis holds, the engine calls the batches
made, and outputs bit-equal to the reference model."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import pytest

from ssmserve.server.cluster.ownership import Ownership, OwnershipSettings
from ssmserve.server.embedded_redis import EmbeddedRedis
from ssmserve.server.engine.lane import EngineLane
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.recurrent_state import BatchState, SessionState
from ssmserve.server.errors import SsmserveError
from ssmserve.server.sessions.checkpoints import Checkpoints
from ssmserve.server.sessions.config import Durability, SessionConfig, SessionDefaults
from ssmserve.server.sessions.guards import GuardAction, GuardCheck, GuardRule
from ssmserve.server.sessions.memory import WorkerMemory
from ssmserve.server.sessions.replay import Replay
from ssmserve.server.sessions.residency import ResidentSessions
from ssmserve.server.sessions.session import (
    GuardRejectedError,
    Session,
    StepGapError,
    StepOutcome,
    StepRun,
)
from ssmserve.server.sessions.stepper import PrefillPause, Stepper, StepperSettings
from ssmserve.server.state.input_log import RecentSteps
from ssmserve.server.state.lease import SessionLease, lease_clock, new_incarnation
from ssmserve.server.state.store import Store
from ssmserve.server.state.store_calls import StoreSettings
from ssmserve.server.state.store_errors import StoreError, StoreUnavailableError
from ssmserve.server.state.store_records import SessionMeta
from tests.conftest import random_inputs
from tests.test_service import assert_bit_equal, reference

MODEL = "demo"
OUTPUT_WINDOW = 4  # outputs a session keeps to answer resends from memory
ANSWER_S = 10.0  # bound on any batch's answer


class RecordingLane(EngineLane):
    """The model's real engine lane, which also notes each batched engine call as (steps
    per session, sessions), and the length of each replay. Every call runs inline, so
    calls come in the stepper's order."""

    def __init__(self, model: MambaModel) -> None:
        super().__init__(model, offload_min_flop=float("inf"))
        self.calls: list[tuple[int, int]] = []
        self.replays: list[int] = []  # prefills (replays, and runs the plan prefills)

    async def step(
        self, states: Sequence[SessionState], values: Sequence[np.ndarray]
    ) -> tuple[BatchState, np.ndarray]:
        self.calls.append((1, len(states)))
        return await super().step(states, values)

    async def step_many(
        self, states: Sequence[SessionState], inputs: np.ndarray
    ) -> tuple[BatchState, np.ndarray]:
        self.calls.append((inputs.shape[1], len(states)))
        return await super().step_many(states, inputs)

    async def prefill(
        self, inputs: np.ndarray, state: SessionState, outputs: object = "all"
    ) -> tuple[np.ndarray, SessionState]:
        self.replays.append(len(inputs))
        return await super().prefill(inputs, state, outputs)  # type: ignore[arg-type]


@dataclass
class Rig:
    """A stepper and the collaborators it is made with, on one store."""

    model: MambaModel
    store: Store
    ownership: Ownership
    residents: ResidentSessions
    checkpoints: Checkpoints
    replay: Replay
    lane: RecordingLane
    stepper: Stepper
    sessions: list[Session] = field(default_factory=list)

    async def session(self, sid: str, **config: object) -> Session:
        """A new session at step 0, resident and owned here: its metadata, lease and
        first snapshot in the store, as a create writes them."""
        c = replace(SessionConfig(snapshot_phase=0), **config)  # type: ignore[arg-type]
        c = c.resolve(SessionDefaults(), self.model.config.output_dim)
        now = time.time()
        lease = SessionLease(sid, f"{new_incarnation()}.1", self.ownership.worker_id)
        s = Session(
            sid, self.model, MODEL, c, self.model.new_state(), 0, now,
            RecentSteps(max(c.history_window, 1), OUTPUT_WINDOW), lease, self.stepper.notify,
        )  # fmt: skip
        blob, record = await self.checkpoints.encode(
            self.checkpoints.checkpoint(s, 0, s.state, "create")
        )
        meta = SessionMeta(
            sid, MODEL, self.model.fingerprint, 0, 1, c.to_bytes(), now, now, False,
            epoch=1, owner=self.ownership.worker_id, owner_addr=self.ownership.address,
            token=lease.token, numerics=self.ownership.numerics,
        )  # fmt: skip
        sent_at = lease_clock()
        await self.store.create_session(meta, self.ownership.lease_ms, record, blob, 16)
        s.snapshotted(0)
        self.residents.add(s, 0, self.ownership.new_lease(sid, lease.token, sent_at))
        self.sessions.append(s)
        return s

    def run(self, s: Session, first: int, values: np.ndarray) -> asyncio.Future[StepRun]:
        """Steps ``first, first + 1, ...`` of ``s`` queued as one run."""
        future: asyncio.Future[StepRun] = asyncio.get_running_loop().create_future()
        raw = s.codec.encode(values)
        self.stepper.submit(
            s, StepRun(s.id, first, values, raw, self.model.config.output_dim, future)
        )
        return future

    def one(self, s: Session, step: int, value: np.ndarray) -> asyncio.Future[StepOutcome]:
        """Step ``step`` of ``s`` sent alone (a run of one, answered with its outcome)."""
        future: asyncio.Future[StepOutcome] = asyncio.get_running_loop().create_future()
        self.stepper.submit(s, StepRun.one(s.id, step, value, s.codec.encode(value), future))
        return future

    async def logged(self, s: Session, last: int) -> bytes:
        """The log's inputs of steps 1..``last``, back to back."""
        return b"".join(await self.store.read_log(s.id, 1, last))


def _with_rig(
    redis_server: EmbeddedRedis,
    model: MambaModel,
    body: Callable[[Rig], Awaitable[None]],
    settings: StepperSettings = StepperSettings(),  # noqa: B008 - frozen, shared
):
    async def main() -> None:
        store = Store(StoreSettings(url=redis_server.url, key_prefix=f"t{new_incarnation()}"))
        memory = WorkerMemory(1 << 30)
        ownership = Ownership(
            store, OwnershipSettings(lease_ttl_s=60.0), "127.0.0.1:1", [MODEL], "n" * 16,
            held=lambda: residents.held(),
            on_lost=lambda lease, error: residents.lost_lease(lease, error),
            on_expired=lambda lease: residents.expired_lease(lease),
        )  # fmt: skip
        residents = ResidentSessions(store, ownership, memory)
        checkpoints = Checkpoints(store, residents, writes_in_flight=2)
        lane = RecordingLane(model)
        replay = Replay(store, residents, checkpoints, {MODEL: lane})
        stepper = Stepper(model, store, residents, checkpoints, replay, settings, lane)
        rig = Rig(model, store, ownership, residents, checkpoints, replay, lane, stepper)
        stepper.start()
        try:
            await body(rig)
            for s in rig.sessions:
                assert s.queued_steps == 0 and not s.queue and s.gone is None
        finally:
            await stepper.stop()
            checkpoints.close()
            await store.aclose()

    asyncio.run(main())


async def _answers(*futures: asyncio.Future) -> list:
    return list(await asyncio.wait_for(asyncio.gather(*futures), ANSWER_S))


def _run_outputs(run: StepRun) -> np.ndarray:
    """Each step's output: its row of ``outputs``, or its own outcome's (checked clean)."""
    rows = []
    for t, outcome in enumerate(run.outcomes):
        if outcome is None:
            rows.append(run.outputs[t])  # type: ignore[index]
        else:
            assert outcome.error is None, outcome.error
            rows.append(outcome.output)
    return np.stack(rows)


def test_runs_of_several_sessions_go_in_one_batch_cut_where_snapshots_fall_due(
    redis_server: EmbeddedRedis, demo_model: MambaModel
) -> None:
    """Queued together: a run of 10 of ``a`` (snapshots every 4 steps), a run of 3 of
    ``b`` and its step 4 alone, step 1 of ``c`` alone (no durability). One batch: round 0
    runs a's first 4 steps with b's 4 in one call and c's step in another; a's 5..8 and
    9..10 follow, each a call ending where a snapshot falls due."""
    xa, xb, xc = (random_inputs(demo_model, n, seed) for n, seed in ((10, 1), (4, 2), (1, 3)))

    async def body(rig: Rig) -> None:
        a = await rig.session("a", snapshot_every=4, durability=Durability.LOG)
        b = await rig.session("b", durability=Durability.LOG)
        c = await rig.session("c", durability=Durability.NONE)
        run_a, run_b = rig.run(a, 1, xa), rig.run(b, 1, xb[:3])
        lone_b, lone_c = rig.one(b, 4, xb[3]), rig.one(c, 1, xc[0])
        run_a, run_b, lone_b, lone_c = await _answers(run_a, run_b, lone_b, lone_c)

        assert rig.lane.calls == [(4, 2), (1, 1), (4, 1), (2, 1)]
        assert rig.stepper.steps == 15
        assert_bit_equal(_run_outputs(run_a), reference(demo_model, xa))
        assert_bit_equal(_run_outputs(run_b), reference(demo_model, xb)[:3])
        assert isinstance(lone_b, StepOutcome) and lone_b.error is None and lone_b.step == 4
        assert_bit_equal(lone_b.output, reference(demo_model, xb)[3])
        assert lone_c.error is None and lone_c.step == 1
        assert_bit_equal(lone_c.output, reference(demo_model, xc)[0])
        assert (a.step, b.step, c.step) == (10, 4, 1)

        # The log holds every input of the log-durability sessions, as sent.
        assert await rig.logged(a, 10) == a.codec.encode(xa)
        assert await rig.logged(b, 4) == b.codec.encode(xb)
        # The snapshots due at a's steps 4 and 8 are written in the background.
        await asyncio.wait_for(rig.checkpoints.settled(a.id), ANSWER_S)
        steps = sorted(r.step for r in await rig.store.list_snapshots(a.id))
        assert steps == [0, 4, 8]

    _with_rig(redis_server, demo_model, body)


def test_resends_are_answered_from_memory_or_replay_and_a_gap_with_an_error(
    redis_server: EmbeddedRedis, demo_model: MambaModel
) -> None:
    """At step 5: a run of 4..7 (4 and 5 resent, answered from memory with the outputs
    first given; 6 and 7 applied), step 9 alone (a gap: the session will be at 7), step
    8 alone. Then at step 8, step 1 again: out of the output window, replayed from the
    snapshot and the log."""
    x = random_inputs(demo_model, 8, seed=4)
    want = reference(demo_model, x)

    async def body(rig: Rig) -> None:
        s = await rig.session("s", durability=Durability.LOG)
        (first,) = await _answers(rig.run(s, 1, x[:5]))
        assert_bit_equal(_run_outputs(first), want[:5])
        rig.lane.calls.clear()

        again, gap, eighth = await _answers(
            rig.run(s, 4, x[3:7]), rig.one(s, 9, x[0]), rig.one(s, 8, x[7])
        )
        assert rig.lane.calls == [(3, 1)]  # 6, 7 and 8 in one engine call
        assert rig.lane.replays == []  # 4 and 5 answered from memory
        for t in (0, 1):  # steps 4 and 5
            outcome = again.outcomes[t]
            assert outcome is not None and outcome.replayed and outcome.error is None
            assert_bit_equal(outcome.output, _run_outputs(first)[3 + t])
        assert again.outcomes[2] is None and again.outcomes[3] is None  # applied
        assert_bit_equal(_run_outputs(again)[2:], want[5:7])
        assert isinstance(gap.error, StepGapError) and gap.error.session_step == 7
        assert gap.output is None
        assert eighth.error is None and not eighth.replayed
        assert_bit_equal(eighth.output, want[7])

        rig.lane.calls.clear()
        (old,) = await _answers(rig.one(s, 1, x[0]))
        assert old.replayed and old.error is None and rig.lane.calls == []
        assert rig.lane.replays == [1]  # from the snapshot at step 0 and the log
        assert_bit_equal(old.output, want[0])
        assert s.step == 8
        assert await rig.logged(s, 8) == s.codec.encode(x)
        with pytest.raises(StoreError):  # the gap's input was never logged
            await rig.store.read_log(s.id, 9, 9)

    _with_rig(redis_server, demo_model, body)


def test_a_guarded_session_steps_once_per_engine_call_and_a_rejection_stops_its_run(
    redis_server: EmbeddedRedis, demo_model: MambaModel
) -> None:
    """``g`` rejects any output whose dim 0 is above the largest of its first two: the
    first such step ``k`` is not applied, the steps of its run after it go back to the
    queue and the next batch answers them as gaps. In the same batch ``a`` (no guards)
    takes its run of 6 in one engine call while ``g`` goes one step per call."""
    x = random_inputs(demo_model, 12, seed=5)
    want = reference(demo_model, x)
    bound = float(want[:2, 0].max())
    k = 3 + int(np.argmax(want[2:, 0] > bound))  # the first step whose output breaks it
    assert want[k - 1, 0] > bound and k + 2 <= len(x), "the inputs must break the guard"
    rule = GuardRule(
        name="cap", check=GuardCheck.RANGE, action=GuardAction.REJECT, max=bound, dims=(0,)
    )
    xa = random_inputs(demo_model, 6, seed=6)

    async def body(rig: Rig) -> None:
        a = await rig.session("a", durability=Durability.LOG)
        g = await rig.session("g", durability=Durability.LOG, guards=(rule,))
        run_a, run_g = await _answers(rig.run(a, 1, xa), rig.run(g, 1, x[: k + 2]))

        assert rig.lane.calls == [(6, 1)] + [(1, 1)] * k  # a whole; g's 1..k one by one
        assert_bit_equal(_run_outputs(run_a), reference(demo_model, xa))
        for t in range(k - 1):  # applied, checked by the guard
            outcome = run_g.outcomes[t]
            assert outcome is not None and outcome.error is None and not outcome.guard_events
            assert_bit_equal(outcome.output, want[t])
        rejected = run_g.outcomes[k - 1]
        assert rejected is not None and isinstance(rejected.error, GuardRejectedError)
        assert [e.action for e in rejected.guard_events] == [GuardAction.REJECT]
        for t in (k, k + 1):  # given back, then answered by the next batch
            outcome = run_g.outcomes[t]
            assert outcome is not None and isinstance(outcome.error, StepGapError)
            assert outcome.error.session_step == k - 1
        assert g.step == k - 1 and a.step == 6

        assert await rig.logged(a, 6) == a.codec.encode(xa)
        assert await rig.logged(g, k - 1) == g.codec.encode(x[: k - 1])
        with pytest.raises(StoreError):  # the rejected step's input is not in the log
            await rig.store.read_log(g.id, k, k)

    _with_rig(redis_server, demo_model, body)


def test_a_session_to_be_proven_ours_first_is_proven_apart_and_holds_up_no_batch(
    redis_server: EmbeddedRedis, demo_model: MambaModel
) -> None:
    """``u``'s lease lapsed by this worker's clock, so it must be proven this worker's
    before it steps, and its proof is held up (as by a Cluster master whose replica cannot
    confirm a write: the whole write deadline). ``a``'s run is answered meanwhile, in a
    batch without ``u``; once the proof comes, ``u``'s run is applied. A proof that fails
    answers ``u``'s queued steps with its error, none applied; proven later, it goes on."""
    xa, xu = random_inputs(demo_model, 3, seed=7), random_inputs(demo_model, 4, seed=8)

    async def body(rig: Rig) -> None:
        a = await rig.session("a", durability=Durability.LOG)
        u = await rig.session("u", durability=Durability.LOG)
        real = rig.residents.revalidate
        proof = asyncio.Event()
        refusals: list[SsmserveError] = []

        async def revalidate(sessions: list[Session]) -> dict[str, SsmserveError]:
            if any(s is u for s in sessions):  # u's proof waits for the test's word
                await proof.wait()
                if refusals:
                    return {u.id: refusals.pop()}
            return await real(sessions)

        rig.residents.revalidate = revalidate  # type: ignore[method-assign]
        u.lease.expire()
        run_u = rig.run(u, 1, xu[:2])
        (run_a,) = await _answers(rig.run(a, 1, xa))  # while u's proof is held up
        assert_bit_equal(_run_outputs(run_a), reference(demo_model, xa))
        assert not run_u.done() and u.step == 0
        proof.set()
        (run_u,) = await _answers(run_u)
        assert_bit_equal(_run_outputs(run_u), reference(demo_model, xu)[:2])
        assert u.step == 2 and u.lease.valid()

        proof.clear()
        refusals.append(StoreUnavailableError("the session store is unavailable: test"))
        u.lease.expire()
        refused = rig.run(u, 3, xu[2:])
        proof.set()
        (refused,) = await _answers(refused)
        for outcome in refused.outcomes:
            assert outcome is not None and isinstance(outcome.error, StoreUnavailableError)
        assert u.step == 2 and u.gone is None
        (again,) = await _answers(rig.run(u, 3, xu[2:]))  # proven now: applied
        assert_bit_equal(_run_outputs(again), reference(demo_model, xu)[2:])
        assert await rig.logged(u, 4) == u.codec.encode(xu)

    _with_rig(redis_server, demo_model, body)


def test_a_decode_step_is_answered_before_the_prompt_beside_it_prefills_then_prefill_pauses(
    redis_server: EmbeddedRedis, demo_model: MambaModel
) -> None:
    """Queued together: step 1 of ``d`` alone (a generated token) and a run of 100 of
    ``p`` (a prompt). The token budget is 32: ``d``'s step counts first and ``p``
    prefills the 31 left, in the batch's second phase, so ``d`` is answered while ``p`` is
    still at step 0. That prefill ran beside a decode step, so prefill pauses (its share
    is 0.1): ``d``'s step 2 runs in a batch of its own while ``p`` waits, then ``p`` goes
    on in chunks of 32. Every output is the bits of stepping one step at a time."""
    xd, xp = random_inputs(demo_model, 2, seed=4), random_inputs(demo_model, 100, seed=5)
    settings = StepperSettings(max_batch_tokens=32, prefill_chunk=32, prefill_share=0.1)

    async def body(rig: Rig) -> None:
        d = await rig.session("d", durability=Durability.LOG)
        p = await rig.session("p", durability=Durability.LOG, snapshot_every=1024)
        seen: list[tuple[int, list[int]]] = []  # p's step and the prefills, at d's answers

        def note(_future: asyncio.Future) -> None:
            seen.append((p.step, list(rig.lane.replays)))

        first = rig.one(d, 1, xd[0])
        first.add_done_callback(note)
        run_p = rig.run(p, 1, xp)
        (first,) = await _answers(first)
        second = rig.one(d, 2, xd[1])  # queued while p's first chunk computes
        second.add_done_callback(note)
        second, run_p = await _answers(second, run_p)

        assert seen == [(0, []), (31, [31])]
        # The last 5 steps of p, under min_steps, are stepped.
        assert rig.lane.replays == [31, 32, 32] and rig.lane.calls == [(1, 1), (1, 1), (5, 1)]
        assert [o.error for o in (first, second)] == [None, None]
        assert_bit_equal(np.stack([first.output, second.output]), reference(demo_model, xd))
        assert_bit_equal(_run_outputs(run_p), reference(demo_model, xp))
        assert await rig.logged(p, 100) == p.codec.encode(xp)

    _with_rig(redis_server, demo_model, body, settings)


def test_the_prefill_pause_keeps_prefill_to_its_share_while_sessions_decode() -> None:
    """PrefillPause on a clock of its own: a chunk of 0.2 s while sessions decode pauses
    prefill 0.6 s at share 0.25; a chunk with nobody decoding (no phase of steps within
    ACTIVE_S) pauses nothing; just after a phase of steps, prompts alone are held for that
    phase's time, at most GRACE_S."""
    now = [100.0]
    pause = PrefillPause(0.25, 8, clock=lambda: now[0])
    assert not pause.paused() and pause.holds_until() < now[0]
    pause.decoded(0.03)  # a phase of steps of 30 ms ends at 100.0
    assert pause.holds_until() == pytest.approx(100.03)  # its steps' grace
    now[0] = 100.2
    pause.prefilled(0.2)  # a chunk right after it: sessions decode
    assert pause.paused() and pause.resumes_at == pytest.approx(100.8)
    now[0] = 100.81
    assert not pause.paused()
    now[0] = 102.0
    pause.prefilled(0.2)  # 2 s after the last phase of steps: nobody decodes
    assert not pause.paused()
    pause.decoded(0.5)  # a slow phase of steps: the grace is bounded
    assert pause.holds_until() == pytest.approx(102.0 + PrefillPause.GRACE_S)
    pause.prefilled(3.0)  # a chunk a slow store held 3 s: the pause is bounded
    assert pause.resumes_at == pytest.approx(102.0 + PrefillPause.MAX_PAUSE_S)
    now[0] = 102.0 + PrefillPause.ACTIVE_S + 0.01  # the decoders stopped: nothing holds
    assert pause.paused() and pause.holds_until() < now[0]
    never = PrefillPause(0.25, 0, clock=lambda: now[0])  # prefill_min_steps 0: none
    never.decoded(0.05)
    assert not asyncio.run(never.wait_for_decode([], asyncio.Event()))  # holds nothing
