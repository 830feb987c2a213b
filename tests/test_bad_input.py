"""Bad input gets a clear error and changes nothing: adversarial probes of a real worker.

Every probe goes over a socket to a real worker (grpc.aio on loopback, a real
redis-server), through raw stubs (to send what no client would) or the real client, and
checks afterwards that the session it aimed at is as it was and the worker still serves
it bit-exactly.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import redis
from google.rpc import status_pb2

from ssmserve.client.aio import AsyncClient, step_input
from ssmserve.server.engine.demo import DemoSpec, demo_config
from ssmserve.server.engine.loader import load_model
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.state.checkpoint import Checkpoint, InputHistory
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc
from tests.conftest import random_inputs, write_model
from tests.harness import WorkerHarness

LONG = "L" * 10_000  # id characters, far too many of them
LONG_BRACES = "{" + "B" * 9_998 + "}"  # too long, and braces (the Redis hash tag)
BRACES = "a{b}c"
EMPTY = ""
MAX_MESSAGE_CHARS = 2_100  # an error message (or StepError.message) is at most about this
CLEAR_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
MESSAGE_LIMIT = 4 << 20  # the server's message size limit (4 MiB)
BIG_CHANNEL = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]
TIMEOUT = 15.0  # of every raw call: a hang fails the test instead of stalling the run
DETAILS_KEY = "grpc-status-details-bin"
GARBAGE = b"\xff\xff\xff\xff"  # a truncated varint: no message parses from it
SERVICE = "/ssmserve.v1.SessionService/"


def bits(a: Any) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def assert_bit_equal(a: Any, b: Any) -> None:
    np.testing.assert_array_equal(bits(a), bits(b))


# ---------------------------------------------------------------------------- answers


@dataclass
class Answer:
    """What a probe got back: a status (code, message, details) or a StepError."""

    code: grpc.StatusCode | None  # None: the request succeeded
    message: str
    detail_messages: list[str] = field(default_factory=list)
    stream_ended: bool = False  # a step's problem ended its Stream instead of a StepError

    def problems(self, bad: str) -> list[str]:
        if self.code is None:
            return [f"no error; answered {self.message[:300]}"]
        out = []
        if self.stream_ended:
            out.append(f"the Stream ended with {self.code.name} instead of a StepError")
        if self.code not in CLEAR_CODES:
            out.append(
                f"{self.code.name} (want INVALID_ARGUMENT or NOT_FOUND): {self.message[:300]}"
            )
        for where, text in (
            ("message", self.message),
            *(("details", m) for m in self.detail_messages),
        ):
            if len(text) > MAX_MESSAGE_CHARS:
                out.append(f"{self.code.name}: {where} of {len(text)} characters: {text[:200]}...")
            if len(bad) > 1000 and bad in text:
                out.append(f"{self.code.name}: {where} repeats the whole {len(bad)}-char string")
        return out


def answer_of(exc: grpc.RpcError) -> Answer:
    details = []
    for key, value in exc.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == DETAILS_KEY:
            details.append(status_pb2.Status.FromString(value).message)
    return Answer(exc.code(), exc.details() or "", details)  # type: ignore[attr-defined]


def unary(call: Callable[[], Any]) -> Answer:
    """Run a call (a streamed answer is read to the end); its status as an Answer."""
    try:
        reply = call()
        if isinstance(reply, Iterator):
            reply = list(reply)
    except grpc.RpcError as exc:
        return answer_of(exc)
    return Answer(None, repr(reply))


def step_error(stub: pb_grpc.SessionServiceStub, sid: str, step: int, value: Any) -> Answer:
    """One step on a raw stream; the StepError it must be answered with, as an Answer."""
    request = pb.StreamRequest(steps=[step_input(sid, step, value)])
    try:
        responses = list(stub.Stream(iter([request]), timeout=TIMEOUT))
    except grpc.RpcError as exc:  # the stream itself failed: reported as such
        answer = answer_of(exc)
        answer.stream_ended = True
        return answer
    results = [r for response in responses for r in response.results]
    assert len(results) == 1, responses
    if not results[0].HasField("error"):
        return Answer(None, f"step {results[0].step} applied")
    error = results[0].error
    code = next((c for c in grpc.StatusCode if c.value[0] == error.code), grpc.StatusCode.UNKNOWN)
    return Answer(code, error.message)


def import_requests(blob: bytes, **header: Any) -> Iterator[pb.ImportCheckpointRequest]:
    yield pb.ImportCheckpointRequest(header=pb.ImportHeader(**header))
    chunk = pb.CheckpointChunk(index=0, data=blob, total_size=len(blob), last=True)
    yield pb.ImportCheckpointRequest(chunk=chunk)


# ---------------------------------------------------------------------------- 1. long strings


@dataclass
class Env:
    """A worker with one session (3 steps in, a labelled snapshot) to aim probes at."""

    worker: WorkerHarness
    start_worker: Callable[..., WorkerHarness]
    model: MambaModel
    channel: grpc.Channel
    stub: pb_grpc.SessionServiceStub
    cluster: pb_grpc.ClusterServiceStub
    sid: str
    x: np.ndarray
    blob: bytes
    other: str = ""

    def other_worker(self) -> str:
        """A second live worker on the same Redis (a real target for Migrate)."""
        if not self.other:
            self.other = self.start_worker().address
        return self.other

    def ids(self) -> list[tuple[str, int]]:
        return [(s.session_id, s.step) for s in self.worker.client.list_sessions()]


@pytest.fixture
def env(worker, start_worker, served_models) -> Iterator[Env]:
    model = served_models["demo"]
    x = random_inputs(model, 4, seed=40)
    sid = worker.client.create_session("demo", "target").session_id
    list(worker.client.stream_steps(sid, list(x[:3])))
    worker.client.snapshot(sid, label="kept")
    blob = worker.client.export_checkpoint(sid)
    channel = grpc.insecure_channel(worker.address)
    yield Env(
        worker,
        start_worker,
        model,
        channel,
        pb_grpc.SessionServiceStub(channel),
        pb_grpc.ClusterServiceStub(channel),
        sid,
        x,
        blob,
    )
    channel.close()


def _finite_guard(name: str) -> pb.GuardRule:
    return pb.GuardRule(name=name, check=pb.GuardRule.CHECK_FINITE)


T = TIMEOUT
TOO_LONG = (LONG, LONG_BRACES)
NO_EMPTY = (*TOO_LONG, BRACES)  # where an empty string means a default
ALL = (*NO_EMPTY, EMPTY)
# name -> (probe(env, bad) -> Answer, the bad values for it)
CASES: dict[str, tuple[Callable[[Env, str], Answer], tuple[str, ...]]] = {
    # every RPC that takes a session id
    "GetSession": (
        lambda e, bad: unary(
            lambda: e.stub.GetSession(pb.GetSessionRequest(session_id=bad), timeout=T)
        ),
        ALL,
    ),
    "CloseSession": (
        lambda e, bad: unary(
            lambda: e.stub.CloseSession(pb.CloseSessionRequest(session_id=bad), timeout=T)
        ),
        ALL,
    ),
    "CloseSession(final_snapshot)": (
        lambda e, bad: unary(
            lambda: e.stub.CloseSession(
                pb.CloseSessionRequest(session_id=bad, final_snapshot=True), timeout=T
            )
        ),
        ALL,
    ),
    "Snapshot": (
        lambda e, bad: unary(
            lambda: e.stub.Snapshot(pb.SnapshotRequest(session_id=bad), timeout=T)
        ),
        ALL,
    ),
    "ListSnapshots": (
        lambda e, bad: unary(
            lambda: e.stub.ListSnapshots(pb.ListSnapshotsRequest(session_id=bad), timeout=T)
        ),
        ALL,
    ),
    "Rollback": (
        lambda e, bad: unary(
            lambda: e.stub.Rollback(pb.RollbackRequest(session_id=bad, step=0), timeout=T)
        ),
        ALL,
    ),
    "ExportCheckpoint": (
        lambda e, bad: unary(
            lambda: e.stub.ExportCheckpoint(pb.ExportCheckpointRequest(session_id=bad), timeout=T)
        ),
        ALL,
    ),
    "Forecast": (
        lambda e, bad: unary(
            lambda: e.stub.Forecast(pb.ForecastRequest(session_id=bad, horizon=1), timeout=T)
        ),
        ALL,
    ),
    "Fork(session_id)": (
        lambda e, bad: unary(lambda: e.stub.Fork(pb.ForkRequest(session_id=bad), timeout=T)),
        ALL,
    ),
    "Fork(new_session_id)": (
        lambda e, bad: unary(
            lambda: e.stub.Fork(pb.ForkRequest(session_id=e.sid, new_session_id=bad), timeout=T)
        ),
        NO_EMPTY,  # empty: the server picks an id
    ),
    "Stream": (lambda e, bad: step_error(e.stub, bad, 1, np.zeros(4, np.float32)), ALL),
    "Migrate(session_id)": (
        lambda e, bad: unary(
            lambda: e.cluster.Migrate(
                pb.MigrateRequest(session_id=bad, target=e.other_worker()), timeout=T
            )
        ),
        ALL,
    ),
    "Migrate(target)": (
        lambda e, bad: unary(
            lambda: e.cluster.Migrate(pb.MigrateRequest(session_id=e.sid, target=bad), timeout=T)
        ),
        ALL,
    ),
    "ImportCheckpoint(session_id)": (
        lambda e, bad: unary(
            lambda: e.stub.ImportCheckpoint(import_requests(e.blob, session_id=bad), timeout=T)
        ),
        NO_EMPTY,  # empty: the id stored in the checkpoint
    ),
    # other client strings
    "Snapshot(label)": (
        lambda e, bad: unary(
            lambda: e.stub.Snapshot(pb.SnapshotRequest(session_id=e.sid, label=bad), timeout=T)
        ),
        TOO_LONG,  # labels may hold any characters; empty: no label
    ),
    "Rollback(snapshot_id)": (
        lambda e, bad: unary(
            lambda: e.stub.Rollback(
                pb.RollbackRequest(session_id=e.sid, snapshot_id=bad), timeout=T
            )
        ),
        ALL,
    ),
    "Rollback(label)": (
        lambda e, bad: unary(
            lambda: e.stub.Rollback(pb.RollbackRequest(session_id=e.sid, label=bad), timeout=T)
        ),
        ALL,
    ),
    "ExportCheckpoint(snapshot_id)": (
        lambda e, bad: unary(
            lambda: e.stub.ExportCheckpoint(
                pb.ExportCheckpointRequest(session_id=e.sid, snapshot_id=bad), timeout=T
            )
        ),
        NO_EMPTY,  # empty: the current state
    ),
    "Fork(snapshot_id)": (
        lambda e, bad: unary(
            lambda: e.stub.Fork(pb.ForkRequest(session_id=e.sid, snapshot_id=bad), timeout=T)
        ),
        ALL,
    ),
    "Fork(label)": (
        lambda e, bad: unary(
            lambda: e.stub.Fork(pb.ForkRequest(session_id=e.sid, label=bad), timeout=T)
        ),
        ALL,
    ),
    "CreateSession(model)": (
        lambda e, bad: unary(
            lambda: e.stub.CreateSession(pb.CreateSessionRequest(model=bad), timeout=T)
        ),
        ALL,
    ),
    "CreateSession(session_id)": (
        lambda e, bad: unary(
            lambda: e.stub.CreateSession(
                pb.CreateSessionRequest(model="demo", session_id=bad), timeout=T
            )
        ),
        NO_EMPTY,  # empty: the server picks an id
    ),
    "CreateSession(guard name)": (
        lambda e, bad: unary(
            lambda: e.stub.CreateSession(
                pb.CreateSessionRequest(
                    model="demo", config=pb.SessionConfig(guards=[_finite_guard(bad)])
                ),
                timeout=T,
            )
        ),
        (*TOO_LONG, EMPTY),  # names may hold any characters
    ),
    "CreateSession(label key)": (
        lambda e, bad: unary(
            lambda: e.stub.CreateSession(
                pb.CreateSessionRequest(model="demo", config=pb.SessionConfig(labels={bad: "v"})),
                timeout=T,
            )
        ),
        TOO_LONG,
    ),
    "ImportCheckpoint(model)": (
        lambda e, bad: unary(
            lambda: e.stub.ImportCheckpoint(
                import_requests(e.blob, session_id="imported", model=bad), timeout=T
            )
        ),
        NO_EMPTY,  # empty: the model with the checkpoint's fingerprint
    ),
    "ListSessions(page_token)": (
        lambda e, bad: unary(
            lambda: e.stub.ListSessions(pb.ListSessionsRequest(page_token=bad), timeout=T)
        ),
        TOO_LONG,  # a short one is a position in the list; empty: the first
    ),
    "Drain(worker)": (
        lambda e, bad: unary(lambda: e.cluster.Drain(pb.DrainRequest(worker=bad), timeout=T)),
        NO_EMPTY,  # empty: this worker (a real drain)
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_client_strings_are_never_echoed_whole(env, case):
    probe, variants = CASES[case]
    before = env.ids()
    problems = []
    for bad in variants:
        answer = probe(env, bad)
        shown = f"{len(bad)} chars" if len(bad) > 16 else repr(bad)
        problems += [f"{case} with {shown}: {p}" for p in answer.problems(bad)]
        after = env.ids()
        if after != before:
            problems.append(f"{case} with {shown}: sessions changed from {before} to {after}")
            before = after
    assert not problems, "\n".join(problems)
    # the session is as it was, and the worker still serves it exactly
    assert env.worker.client.get_session(env.sid).step == 3
    out = env.worker.client.step(env.sid, env.x[3], step=4)
    assert_bit_equal(out.output, env.model.run(env.x)[0][3])


# ---------------------------------------------------------------------------- 2, 3. big answers

WIDE = 300  # output dim: 4,096 answers of it do not fit in one 4 MiB message


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("wide") / "wide"
    write_model(directory, demo_config(DemoSpec(input_dim=4, output_dim=WIDE, seed=5)), seed=5)
    return directory


@pytest.fixture(scope="module")
def wide_model(wide_dir: Path) -> MambaModel:
    return load_model(wide_dir, name="wide")


@pytest.fixture
def wide_worker(model_dirs, wide_dir, redis_url) -> Iterator[WorkerHarness]:
    harness = WorkerHarness({**model_dirs, "wide": wide_dir}, redis_url)
    try:
        yield harness
    finally:
        harness.stop()


def test_a_stream_answer_over_the_limit_is_split(wide_worker, wide_model):
    x = random_inputs(wide_model, 4096, seed=41)
    want = wide_model.run(x)[0]
    sid = wide_worker.client.create_session("wide").session_id
    request = pb.StreamRequest(steps=[step_input(sid, t + 1, x[t]) for t in range(4096)])
    with grpc.insecure_channel(wide_worker.address, options=BIG_CHANNEL) as channel:
        responses = list(pb_grpc.SessionServiceStub(channel).Stream(iter([request]), timeout=60))
    assert len(responses) >= 2, "4,096 outputs of 300 floats cannot fit in one 4 MiB answer"
    assert [r.continued for r in responses] == [True] * (len(responses) - 1) + [False]
    sizes = [r.ByteSize() for r in responses]
    assert max(sizes) < MESSAGE_LIMIT, sizes
    results = [r for response in responses for r in response.results]
    assert [r.step for r in results] == list(range(1, 4097))
    assert {r.session_id for r in results} == {sid}
    assert not [r.error for r in results if r.HasField("error")]
    assert_bit_equal(np.stack([np.asarray(r.output.values, np.float32) for r in results]), want)
    assert wide_worker.client.get_session(sid).step == 4096


def test_client_stream_steps_with_4096_steps_per_message(wide_worker, wide_model):
    x = random_inputs(wide_model, 4096, seed=42)
    want = wide_model.run(x)[0]
    sid = wide_worker.client.create_session("wide").session_id

    async def body() -> list[Any]:
        outs: list[Any] = []
        async with AsyncClient(wide_worker.address) as client:  # the default retry policy
            try:
                # The bug this guards against was a deadlock (no answer ever), so the bound is
                # far above the ~2 s this takes; 10 s failed once beside two CPU hogs.
                async with asyncio.timeout(60):
                    async for out in client.stream_steps(sid, list(x), steps_per_message=4096):
                        outs.append(out)
            except TimeoutError:
                pytest.fail(f"stream_steps stalled: {len(outs)} of 4096 answers after 60 s")
        return outs

    outs = asyncio.run(body())
    assert [o.step for o in outs] == list(range(1, 4097))  # each once, in order
    assert_bit_equal(np.stack([o.output for o in outs]), want)
    assert wide_worker.client.get_session(sid).step == 4096


def _fat_config() -> pb.SessionConfig:
    labels = {f"k{i:02d}".ljust(64, "k"): f"v{i:02d}".ljust(256, "v") for i in range(32)}
    guards = [
        pb.GuardRule(
            name=f"g{i:02d}",
            check=pb.GuardRule.CHECK_RANGE,
            min=-1e6,
            max=1e6,
            dims=list(range(WIDE)),
            action=pb.GuardRule.ACTION_REPORT,
        )
        for i in range(32)
    ]
    return pb.SessionConfig(labels=labels, guards=guards)


def test_list_sessions_pages_stay_under_the_message_limit(wide_worker):
    config = _fat_config()
    with grpc.insecure_channel(wide_worker.address, options=BIG_CHANNEL) as channel:
        stub = pb_grpc.SessionServiceStub(channel)

        def create(i: int) -> Any:
            request = pb.CreateSessionRequest(
                model="wide", session_id=f"fat-{i:04d}", config=config
            )
            return stub.CreateSession.future(request, timeout=60)

        first = create(0).result()
        one = first.ByteSize()
        count = MESSAGE_LIMIT // one + 10  # just over one message's worth
        assert count * one > MESSAGE_LIMIT + 5 * one
        futures = [create(i) for i in range(1, count)]
        created = [first.session_id] + [f.result().session_id for f in futures]

        pages, token = [], ""
        for _ in range(count + 2):
            page = stub.ListSessions(
                pb.ListSessionsRequest(page_size=1000, page_token=token), timeout=T
            )
            pages.append(page)
            token = page.next_page_token
            if not token:
                break
    sizes = [p.ByteSize() for p in pages]
    assert max(sizes) < MESSAGE_LIMIT, sizes
    assert len(pages) >= 2, sizes
    listed = [s.session_id for p in pages for s in p.sessions]
    assert sorted(listed) == sorted(created)  # every session exactly once
    assert all(len(p.sessions) for p in pages), [len(p.sessions) for p in pages]


# ---------------------------------------------------------------------------- 4. undecodable

_CLASS_NAME = re.compile(r"\b\w+(Error|Exception|Warning)\b")


def _raw_session(worker: WorkerHarness, model: MambaModel) -> tuple[str, np.ndarray]:
    x = random_inputs(model, 4, seed=43)
    sid = worker.client.create_session("demo").session_id
    list(worker.client.stream_steps(sid, list(x[:2])))
    return sid, x


def _garbage_call(
    channel: grpc.Channel, sid: str, x: np.ndarray, kind: str, got: list[bytes]
) -> None:
    """Send undecodable bytes; the raw answers read before the error go to ``got``."""
    if kind == "GetSession (unary)":
        channel.unary_unary(SERVICE + "GetSession")(GARBAGE, timeout=T)
    elif kind == "Forecast (server stream)":
        got.extend(channel.unary_stream(SERVICE + "Forecast")(GARBAGE, timeout=T))
    elif kind == "ImportCheckpoint (client stream)":
        channel.stream_unary(SERVICE + "ImportCheckpoint")(iter([GARBAGE]), timeout=T)
    elif kind == "Stream (first message)":
        got.extend(channel.stream_stream(SERVICE + "Stream")(iter([GARBAGE]), timeout=T))
    elif kind == "Stream (after a valid message)":
        valid = pb.StreamRequest(steps=[step_input(sid, 3, x[2])]).SerializeToString()
        call = channel.stream_stream(SERVICE + "Stream")(iter([valid, GARBAGE]), timeout=T)
        for raw in call:
            got.append(raw)


@pytest.mark.parametrize(
    "kind",
    [
        "GetSession (unary)",
        "Forecast (server stream)",
        "ImportCheckpoint (client stream)",
        "Stream (first message)",
        "Stream (after a valid message)",
    ],
)
def test_undecodable_requests_get_invalid_argument(worker, served_models, caplog, kind):
    model = served_models["demo"]
    sid, x = _raw_session(worker, model)
    before = worker.client.list_sessions()
    caplog.set_level(logging.INFO)
    with grpc.insecure_channel(worker.address) as channel:
        caplog.clear()
        got: list[bytes] = []
        with pytest.raises(grpc.RpcError) as err:
            _garbage_call(channel, sid, x, kind, got)
        time.sleep(0.2)  # a late log line still counts
        records = [r for r in caplog.records if r.name.startswith("ssmserve.server")]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    message = err.value.details() or ""
    assert not _CLASS_NAME.search(message), message
    assert "traceback" not in message.lower() and 'File "' not in message, message
    assert len(message) <= MAX_MESSAGE_CHARS
    lines = [f"{r.name} {r.levelname}: {r.getMessage()}" for r in records]
    assert len(records) == 1, lines
    assert records[0].exc_info is None and "\n" not in records[0].getMessage(), lines
    step = 2
    if kind == "Stream (after a valid message)":
        # the valid message was answered before the error, and applied
        assert len(got) == 1, got
        response = pb.StreamResponse.FromString(got[0])
        (result,) = response.results
        assert (result.step, result.HasField("error")) == (3, False), result
        assert_bit_equal(result.output.values, model.run(x[:3])[0][2])
        step = 3
    else:
        assert got == []
    info = worker.client.get_session(sid)
    assert info.step == step
    assert [s.session_id for s in worker.client.list_sessions()] == [s.session_id for s in before]
    out = worker.client.step(sid, x[step], step=step + 1)  # still served, exactly
    assert_bit_equal(out.output, model.run(x[: step + 1])[0][step])


# ---------------------------------------------------------------------------- 5. step numbers

HUGE = 10**14 + 5


def _moved_checkpoint(blob: bytes, step: int, session_id: str) -> bytes:
    """The checkpoint in ``blob`` renumbered to ``step`` (its history moved along)."""
    ckpt = Checkpoint.decode(blob)
    n = len(ckpt.history.inputs)
    assert n and ckpt.history.last_step == ckpt.step  # a history to move
    history = InputHistory(step - n + 1, np.array(ckpt.history.inputs))
    return replace(ckpt, step=step, session_id=session_id, history=history).encode()


def test_huge_step_numbers_are_exact_across_import_rollback_and_restart(
    model_dirs, redis_url, served_models
):
    model = served_models["demo"]
    x = random_inputs(model, 8, seed=44)
    y = random_inputs(model, 11, seed=45)
    start = model.run(x)[1]  # the state the checkpoint holds (after 8 inputs)
    harness = WorkerHarness(model_dirs, redis_url)
    try:
        client = harness.client
        src = client.create_session("demo").session_id
        list(client.stream_steps(src, list(x)))
        blob = _moved_checkpoint(client.export_checkpoint(src), HUGE, "huge")
        info = client.import_checkpoint(blob)
        assert (info.session_id, info.step) == ("huge", HUGE)

        outs = list(client.stream_steps("huge", list(y[:5])))
        assert [o.step for o in outs] == list(range(HUGE + 1, HUGE + 6))
        assert_bit_equal(np.stack([o.output for o in outs]), model.run(y[:5], start)[0])
        again = client.step("huge", y[0], step=HUGE + 1)  # a resend: the recorded answer
        assert again.replayed
        assert_bit_equal(again.output, outs[0].output)

        back = client.rollback("huge", to_step=HUGE + 2)
        assert (back.step, back.replayed_steps) == (HUGE + 2, 2)
        info = client.get_session("huge")
        assert (info.step, info.oldest_rollback_step) == (HUGE + 2, HUGE)
        listed = {s.session_id: s.step for s in client.list_sessions()}
        assert listed == {src: 8, "huge": HUGE + 2}
        ckpt = Checkpoint.decode(client.export_checkpoint("huge"))
        assert ckpt.step == HUGE + 2 and ckpt.history.last_step == HUGE + 2
        assert ckpt.state.bit_equal(model.run(y[:2], start)[1])
        assert_bit_equal(ckpt.history.inputs[-2:], y[:2])

        y2 = np.concatenate([y[:2], y[5:8]])  # after the rollback: y[5:8] as steps +3..+5
        outs = list(client.stream_steps("huge", list(y[5:8])))
        assert [o.step for o in outs] == list(range(HUGE + 3, HUGE + 6))
        assert_bit_equal(np.stack([o.output for o in outs]), model.run(y2, start)[0][2:])
    finally:
        harness.stop()

    harness = WorkerHarness(model_dirs, redis_url)  # a new worker on the same Redis
    try:
        client = harness.client
        assert client.get_session("huge").step == HUGE + 5
        outs = list(client.stream_steps("huge", list(y[8:])))
        assert [o.step for o in outs] == list(range(HUGE + 6, HUGE + 9))
        y3 = np.concatenate([y2, y[8:]])
        assert_bit_equal(np.stack([o.output for o in outs]), model.run(y3, start)[0][5:])
        assert {s.session_id: s.step for s in client.list_sessions()}["huge"] == HUGE + 8
    finally:
        harness.stop()


@pytest.mark.parametrize("step", [2**53 + 1, 2**62 - 1])
def test_checkpoint_beyond_the_step_range_is_refused(worker, served_models, redis_url, step):
    model = served_models["demo"]
    src = worker.client.create_session("demo").session_id
    list(worker.client.stream_steps(src, list(random_inputs(model, 3, seed=46))))
    blob = _moved_checkpoint(worker.client.export_checkpoint(src), step, "far")
    before = [(s.session_id, s.step) for s in worker.client.list_sessions()]
    with grpc.insecure_channel(worker.address) as channel:
        answer = unary(
            lambda: pb_grpc.SessionServiceStub(channel).ImportCheckpoint(
                import_requests(blob), timeout=T
            )
        )
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT, answer
    assert len(answer.message) <= MAX_MESSAGE_CHARS
    assert [(s.session_id, s.step) for s in worker.client.list_sessions()] == before
    with redis.Redis.from_url(redis_url) as r:
        assert r.keys("ssm:{far}*") == []
        assert r.zscore("ssm:sessions", "far") is None


@pytest.mark.parametrize("step", [2**53 + 1, 2**64 - 1])
def test_stream_steps_beyond_the_step_range_are_refused(worker, served_models, step):
    model = served_models["demo"]
    x = random_inputs(model, 3, seed=47)
    sid = worker.client.create_session("demo").session_id
    list(worker.client.stream_steps(sid, list(x[:2])))
    with grpc.insecure_channel(worker.address) as channel:
        answer = step_error(pb_grpc.SessionServiceStub(channel), sid, step, x[2])
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT, answer
    assert len(answer.message) <= MAX_MESSAGE_CHARS
    assert worker.client.get_session(sid).step == 2
    out = worker.client.step(sid, x[2], step=3)
    assert_bit_equal(out.output, model.run(x)[0][2])
