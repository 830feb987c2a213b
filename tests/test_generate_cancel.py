"""A cancelled Generate applies no token its client did not get.

The worker takes a step only once the token before it was handed to gRPC, and takes back
(the session's rollback path) a step whose token it had not handed when the call was
cancelled. The Python clients, closed early, roll the session back to the last token they
yielded. Each round below cancels a generation part way, at a different token, then
checks the session's step against the last token received, and at the end that the
session's log is exactly the generation's tokens (nothing taken back left a trace in
what is generated next: the draws are keyed by step).
"""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np

from ssmserve.client.aio import AsyncClient
from ssmserve.v1 import ssmserve_pb2 as pb
from tests.test_generate import PARAMS, PROMPT, offline
from tests.test_service import stub

ROUNDS = 12


def settled_step(client, sid: str, quiet_s: float = 0.3, bound_s: float = 10.0) -> int:
    """The session's step once it has not changed for ``quiet_s`` (a take-back after a
    cancel is asynchronous to the cancelling client)."""
    deadline = time.monotonic() + bound_s
    step, since = client.get_session(sid).step, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = client.get_session(sid).step
        if now != step:
            step, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return step
    raise AssertionError(f"session {sid} did not settle within {bound_s} s")


def test_a_cancelled_raw_call_leaves_at_most_the_token_in_flight(worker, served_models):
    """A raw gRPC client that cancels after token k: the session keeps every token it
    received and what it holds past k are tokens the worker handed to gRPC (in flight:
    gRPC buffers several within its flow-control window, more when the client reads
    slowly), each the generation's draw; the step whose token was not handed is taken
    back, so rounds can end at k."""
    c = worker.client
    sid = c.create_session("lm", snapshot_every=8).session_id
    rng = random.Random(5)
    list(c.stream_steps(sid, PROMPT))
    exact = 0
    for _ in range(ROUNDS):
        start = c.get_session(sid).step
        want = rng.randint(1, 6)
        call = stub(worker).Generate(
            pb.GenerateRequest(
                session_id=sid, max_tokens=500, sampling=pb.SamplingParams(**PARAMS)
            ),
            timeout=30,
        )
        got: list[pb.GeneratedToken] = []
        for reply in call:
            got.extend(reply.tokens)
            if len(got) >= want:
                call.cancel()
                break
        last = got[-1].step
        assert last == start + len(got)
        step = settled_step(c, sid)
        assert last <= step, (last, step)
        exact += step == last
    assert exact, "no round ended at the last token received: nothing was taken back"
    step = c.get_session(sid).step
    tokens = offline(served_models["lm"], PROMPT, step - len(PROMPT))[0]
    np.testing.assert_array_equal(c.history(sid, 1).inputs, [*PROMPT, *tokens])
    # the take-backs are the session's rollbacks, recorded as such
    causes = {e.cause for e in c.history(sid, 1).events if e.kind == "rollback"}
    assert causes <= {"cancel"}, causes
    print(f"{exact} of {ROUNDS} rounds ended at the last token received")


def test_a_generation_the_client_breaks_off_leaves_the_session_at_its_last_token(
    worker, served_models
):
    """The blocking client's loop broken after k tokens: the session is at the step of
    the k-th token, every round."""
    c = worker.client
    sid = c.create_session("lm", snapshot_every=8).session_id
    list(c.stream_steps(sid, PROMPT))
    rng = random.Random(7)
    for _ in range(ROUNDS):
        want = rng.randint(1, 6)
        got = []
        for token in c.generate(sid, 500, **PARAMS):
            got.append(token)
            if len(got) == want:
                break
        assert settled_step(c, sid) == got[-1].step
    step = c.get_session(sid).step
    tokens = offline(served_models["lm"], PROMPT, step - len(PROMPT))[0]
    np.testing.assert_array_equal(c.history(sid, 1).inputs, [*PROMPT, *tokens])


def test_an_async_generation_closed_with_aclose_leaves_the_session_at_its_last_token(worker):
    c = worker.client
    sid = c.create_session("lm").session_id
    list(c.stream_steps(sid, PROMPT))

    async def rounds() -> list[tuple[int, int]]:
        seen = []
        async with AsyncClient(worker.address) as client:
            for want in (1, 3, 2, 5, 4):
                tokens = client.generate(sid, 500, **PARAMS)
                got = [await tokens.__anext__() for _ in range(want)]
                await tokens.aclose()
                # the worker takes back a step it had in flight once it lands
                seen.append((got[-1].step, await asyncio.to_thread(settled_step, c, sid)))
        return seen

    for last, step in asyncio.run(rounds()):
        assert step == last
