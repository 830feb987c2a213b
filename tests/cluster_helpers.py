"""Helpers of the tests that run workers as processes and stream through faults."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np

from ssmserve.client.aio import AsyncClient
from ssmserve.client.retry import RetryPolicy
from tests.test_service import assert_bit_equal, reference
from tests.worker_process import WorkerProcess


def start_workers(count, model_dirs, redis_url, tmp_path: Path, lease_ttl_s=1.0, extra_args=()):
    started = []
    threads = []
    for i in range(count):
        w = WorkerProcess(
            {"demo": model_dirs["demo"]}, redis_url, tmp_path / f"w{i}", lease_ttl_s,
            extra_args=tuple(extra_args),
        )  # fmt: skip
        started.append(w)
        threads.append(threading.Thread(target=w.start))
    for t in threads:  # in parallel: a worker takes about a second to start
        t.start()
    for t in threads:
        t.join(60)
    dead = [w for w in started if not w.alive]
    if dead:  # stop the others: a worker left running would join later tests' Redis
        for w in started:
            w.kill()
        raise AssertionError(
            "workers did not start: "
            + "; ".join(f"{w.address}: {w.log_text()[-600:]}" for w in dead)
        )
    return started


def stream_in_background(
    addresses,
    sids,
    xs,
    stop: threading.Event,
    pace_s=0.003,
    discover=True,
    stamps: list[list[float]] | None = None,
    raise_on_error=True,
    **retry,
):
    """Stream every session (one client each) until ``stop``; returns (thread, outputs,
    errors). ``stamps``, if given, gets the monotonic time of every answer per session."""
    outs: list[list] = [[] for _ in sids]

    async def one(i: int) -> None:
        policy = RetryPolicy(**retry)
        async with AsyncClient(addresses, retry=policy, discover=discover) as client:

            async def source():
                for row in xs[i]:
                    if stop.is_set():
                        return
                    await asyncio.sleep(pace_s)
                    yield row

            answers = client.stream_steps(
                sids[i], source(), first_step=1, raise_on_error=raise_on_error
            )
            async for out in answers:
                outs[i].append(out)
                if stamps is not None:
                    stamps[i].append(time.monotonic())

    async def main() -> None:
        await asyncio.gather(*(one(i) for i in range(len(sids))))

    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outs, errors


def wait_for(condition, errors, timeout_s=30.0, what="the streams"):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert not errors, errors
        assert time.monotonic() < deadline, f"{what}: timed out"
        time.sleep(0.01)


def moving_on(outs, errors, more: int = 20, timeout_s: float = 20.0, what: str = "") -> None:
    """Wait until every stream has answered ``more`` steps past where it is now."""
    counts = [len(o) for o in outs]
    wait_for(
        lambda: all(len(o) >= c + more for o, c in zip(outs, counts, strict=True)),
        errors,
        timeout_s,
        what or "the streams after the fault",
    )


def check_exact(model, sids, xs, outs, client):
    for i, sid in enumerate(sids):
        steps = [o.step for o in outs[i]]
        assert steps == list(range(1, len(steps) + 1)), f"session {i}: a step is missing or doubled"
        assert_bit_equal(
            np.stack([o.output for o in outs[i]]), reference(model, xs[i][: len(steps)])
        )
        assert client.get_session(sid).step == len(steps)  # every acknowledged step is there
