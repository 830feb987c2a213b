"""Constrained output and text monitors through a real worker: the client-side monitor
(the caller's check, the session's Rollback, the next attempt of the seed), the server's
constraint and text monitor, against an offline reference that draws the same tokens
(``tests/test_constraints.py`` tests the parts below the server)."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from ssmserve.client.monitored import (
    MonitorRejected,
    attempt_seed,
    generate_monitored,
    generate_monitored_sync,
)
from ssmserve.server.sessions import text_monitor
from ssmserve.server.sessions.sampling import draw
from tests.test_generate import PARAMS, PROMPT, sampling


def offline_monitored(model, prompt, n, check, params=PARAMS, retries_cap=100):
    """The tokens (and retries) a monitor with rollback_tokens 1 keeps: each step drawn
    with the seed of the rejections so far, a rejected draw never applied."""
    p = sampling(**params)
    outs, state = model.run(np.asarray(prompt, np.int64))
    out, step, tokens, retries = outs[-1], len(prompt), [], 0
    while len(tokens) < n:
        d = draw(p, (attempt_seed(p.seed, retries), step), out)
        if not check([*tokens, d.token]):
            retries += 1
            assert retries < retries_cap
            continue
        tokens.append(d.token)
        o, state = model.run(np.array([d.token]), state)
        out, step = o[0], step + 1
    return tokens, retries


def no_multiple_of_3(tokens):
    return tokens[-1].token_id % 3 != 0


def test_the_client_and_server_attempt_seeds_agree():
    for seed in (0, 77, 2**64 - 1):
        for attempt in range(6):
            assert attempt_seed(seed, attempt) == text_monitor.attempt_seed(seed, attempt)


def test_a_client_side_monitor_rolls_back_and_resamples_exactly(worker, served_models):
    c = worker.client
    a, b = (c.create_session("lm").session_id for _ in range(2))
    run = generate_monitored_sync(
        c, a, 40, no_multiple_of_3, max_retries=60, prompt_ids=PROMPT, **PARAMS
    )
    ids = [t.token_id for t in run.tokens]
    assert all(i % 3 for i in ids) and len(ids) == 40 and run.retries > 3
    expected, retries = offline_monitored(
        served_models["lm"], PROMPT, 40, lambda ts: ts[-1] % 3 != 0
    )
    assert ids == expected and run.retries == retries
    assert [t.step for t in run.tokens] == list(range(len(PROMPT) + 1, len(PROMPT) + 41))
    np.testing.assert_array_equal(c.history(a, 1).inputs, [*PROMPT, *ids])  # what it holds
    again = generate_monitored_sync(
        c, b, 40, no_multiple_of_3, max_retries=60, prompt_ids=PROMPT, **PARAMS
    )
    assert [t.token_id for t in again.tokens] == ids


def test_a_client_side_monitor_rolls_back_several_tokens_and_bounds_its_retries(worker):
    c = worker.client
    sid = c.create_session("lm").session_id

    def no_repeats(tokens):
        return len(tokens) < 2 or tokens[-1].token_id != tokens[-2].token_id

    run = generate_monitored_sync(
        c, sid, 30, no_repeats, rollback_tokens=3, max_retries=60, prompt_ids=PROMPT, **PARAMS
    )
    ids = [t.token_id for t in run.tokens]
    assert all(x != y for x, y in itertools.pairwise(ids)) and len(ids) == 30
    np.testing.assert_array_equal(c.history(sid, 1).inputs, [*PROMPT, *ids])
    never = c.create_session("lm").session_id
    with pytest.raises(MonitorRejected, match="3 times, over max_retries 2") as caught:
        generate_monitored_sync(
            c, never, 10, lambda ts: len(ts) < 4, max_retries=2, prompt_ids=PROMPT, **PARAMS
        )
    assert len(caught.value.tokens) == 3
    assert c.get_session(never).step == len(PROMPT) + 3  # left at the last accepted token


def test_the_async_client_side_monitor_gives_the_sync_ones_tokens(worker):
    from ssmserve.client.aio import AsyncClient

    c = worker.client
    a, b = (c.create_session("lm").session_id for _ in range(2))
    sync = generate_monitored_sync(
        c, a, 25, no_multiple_of_3, max_retries=60, prompt_ids=PROMPT, **PARAMS
    )

    async def body() -> object:
        async with AsyncClient(worker.address) as ac:
            return await generate_monitored(
                ac, b, 25, no_multiple_of_3, max_retries=60, prompt_ids=PROMPT, **PARAMS
            )

    run = asyncio.run(asyncio.wait_for(body(), 60))
    assert [t.token_id for t in run.tokens] == [t.token_id for t in sync.tokens]
    assert run.retries == sync.retries
