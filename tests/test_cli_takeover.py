"""Commands against a frozen owner wait out the takeover through the worker that answered.

Worker A owns the sessions and is frozen (SIGSTOP); every command is given worker B. B
redirects to A (SESSION_MOVED), A does not answer; the client says so on stderr ("the
owner A of session X does not answer; waiting up to N s for B to take it over"), goes
back to B, which takes the session over once it has watched A's lease stand for a TTL,
and the command does what it was asked: a close and a labelled snapshot (neither is
idempotent), a stream.
Real worker processes on a real Redis, the CLI as a real process.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ssmserve.client.errors import NotFound, OwnerUnreachable
from ssmserve.client.retry import RetryPolicy
from ssmserve.client.sync import Client
from tests.cluster_helpers import start_workers
from tests.conftest import random_inputs

REPO = Path(__file__).resolve().parent.parent
TTL_S = 1.0
# A redirect to the frozen owner fails within the client's connect time (about 2 s), then
# B watches A's lease stand for a TTL before it takes the session over; the rest is margin
# for a loaded 2-core machine.
WITHIN_S = 2.5 + TTL_S + 8.0


def ssmserve(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ssmserve.client.cli", *argv],
        capture_output=True, text=True, timeout=timeout, cwd=REPO,
    )  # fmt: skip


def waiting_line(err: str, owner: str, session_id: str, via: str) -> str:
    pattern = (
        rf"ssmserve: the owner {re.escape(owner)} of session {re.escape(session_id)} does "
        rf"not answer; waiting up to [\d.]+ s for {re.escape(via)} to take it over"
    )
    match = re.search(pattern, err)
    assert match, err
    return match.group(0)


@pytest.mark.slow
def test_cli_commands_wait_out_the_takeover_of_a_frozen_owner(
    model_dirs, served_models, redis_url, tmp_path
):
    model = served_models["demo"]
    a, b = start_workers(2, model_dirs, redis_url, tmp_path, TTL_S)
    try:
        with Client(a.address) as client:
            closing, labelled, streamed = (
                client.create_session("demo").session_id for _ in range(3)
            )
            x = random_inputs(model, 12, seed=49)
            for sid in (closing, labelled, streamed):
                for _ in client.stream_steps(sid, list(x[:4])):
                    pass
        np.save(tmp_path / "rest.npy", x[4:])
        a.pause()

        started = time.monotonic()
        done = ssmserve("--server", b.address, "session", "close", closing)
        took = time.monotonic() - started
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"closed {closing} at step 4"
        waiting_line(done.stderr, a.address, closing, b.address)
        assert "error" not in done.stderr
        assert took < WITHIN_S, f"{took:.1f} s"

        done = ssmserve("--server", b.address, "snapshot", labelled, "--label", "calm")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("snapshot at step 4 ")
        waiting_line(done.stderr, a.address, labelled, b.address)

        out = tmp_path / "out.npy"
        done = ssmserve("--server", b.address, "session", "stream", streamed,
                        "--input", str(tmp_path / "rest.npy"), "--output", str(out))  # fmt: skip
        assert done.returncode == 0, done.stderr
        waiting_line(done.stderr, a.address, streamed, b.address)
        np.testing.assert_array_equal(np.load(out), model.run(x)[0][4:])

        with Client(b.address) as via_b:
            assert via_b.get_session(streamed).step == 12
            assert [s.label for s in via_b.list_snapshots(labelled)][-1] == "calm"
            with pytest.raises(NotFound):
                via_b.get_session(closing)
    finally:
        a.kill()
        b.kill()


@pytest.mark.slow
def test_the_library_says_it_waits_and_bounds_the_wait(
    model_dirs, served_models, redis_url, tmp_path, caplog
):
    """The library does what the CLI does (a warning on ``ssmserve.client``), at the
    default lease TTL (5 s): by default it waits as long as any retry (give_up_after_s,
    60 s). With a wait shorter than the takeover needs it gives up and says so."""
    a, b = start_workers(2, model_dirs, redis_url, tmp_path, 5.0)
    try:
        with Client(a.address) as client:
            forked_from, bounded = (client.create_session("demo").session_id for _ in range(2))
        a.pause()
        caplog.set_level(logging.WARNING, logger="ssmserve.client")
        with Client(b.address) as via_b:
            fork = via_b.fork(forked_from, new_session_id="the-fork")  # not idempotent
            assert fork.session.session_id == "the-fork"
        assert (
            f"the owner {a.address} of session {forked_from} does not answer; waiting up to "
            f"60 s for {b.address} to take it over" in caplog.text
        )

        policy = RetryPolicy(takeover_wait_s=0.2)
        started = time.monotonic()
        with (
            Client(b.address, retry=policy) as impatient,
            pytest.raises(OwnerUnreachable) as raised,
        ):
            impatient.close_session(bounded)
        assert time.monotonic() - started < 10.0
        message = str(raised.value)
        assert f"the owner {a.address} of session {bounded} does not answer" in message
        assert "waited 0.2 s" in message and "takeover_wait_s" in message
    finally:
        a.kill()
        b.kill()
