"""A worker stops answering for a session, reads included, before any other worker can
take it over, whatever waits inside its batches (``api.answer_fence``).

Worker A streams three sessions, one of each durability, in one stream (so one batch
holds all three); its link to Redis is black-holed right after a lease renewal. The
``log`` session's append then waits a whole ``--redis-timeout`` in that batch, and the
settling of its unknown outcome another, long enough for the leases of the other two to
run out by A's own clock and for B to take them over. Every answer A's client receives
for a session must arrive before B's first answer for it: the rule is checked on what a
client sees, not on when A decided.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from ssmserve.client.step_values import step_input
from ssmserve.server.cluster.ownership import OwnershipSettings
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc
from tests.cluster_helpers import wait_for
from tests.conftest import random_inputs
from tests.tcp_proxy import TcpProxy

# A lease of 3 s trusted for 2.7 s, renewed every second; a Redis call's deadline of 2 s,
# so one append and one settling in a row (4 s) outlast the lease.
TTL_S = 3.0
REDIS_TIMEOUT_S = 2.0
SETTINGS = {
    "ownership": OwnershipSettings(lease_ttl_s=TTL_S, worker_ttl_s=TTL_S),
    "redis_timeout_s": REDIS_TIMEOUT_S,
}
DURABILITIES = (pb.DURABILITY_LOG, pb.DURABILITY_SNAPSHOT, pb.DURABILITY_NONE)


class OnlyTo:
    """A client of one worker and nothing else: one bidi stream, one message per round
    with the next step of every session, no redirects followed. ``answered`` gets
    (session id, step, arrival on ``time.monotonic()``) of every answer with an output."""

    def __init__(self, address: str, sids: list[str], inputs: np.ndarray) -> None:
        self.sids = sids
        self.inputs = inputs  # (T, i)
        self.acked = dict.fromkeys(sids, 0)
        self.answered: list[tuple[str, int, float]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self._outbox: queue.Queue[pb.StreamRequest | None] = queue.Queue()
        self._channel = grpc.insecure_channel(address)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> OnlyTo:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._outbox.put(None)
        self._thread.join(30)
        self._channel.close()

    def _message(self) -> pb.StreamRequest:
        steps = [
            step_input(sid, self.acked[sid] + 1, self.inputs[self.acked[sid]]) for sid in self.sids
        ]
        return pb.StreamRequest(steps=steps)

    def _requests(self) -> Iterator[pb.StreamRequest]:
        while (message := self._outbox.get()) is not None:
            yield message

    def _run(self) -> None:
        stub = pb_grpc.SessionServiceStub(self._channel)
        self._outbox.put(self._message())
        try:
            for response in stub.Stream(self._requests(), timeout=120):
                arrived = time.monotonic()
                for result in response.results:
                    if result.HasField("error"):
                        self.errors.append(result.error.reason)
                    else:
                        self.answered.append((result.session_id, result.step, arrived))
                        self.acked[result.session_id] = result.step
                if response.continued:
                    continue
                if self.stop.is_set():
                    self._outbox.put(None)
                    continue
                time.sleep(0.01)
                self._outbox.put(self._message())
        except grpc.RpcError as exc:
            if not self.stop.is_set():
                self.errors.append(f"stream ended: {exc.code().name}")


def first_answer_from(address: str, sid: str, x: np.ndarray, timeout_s: float) -> float:
    """Ask ``address`` for session ``sid`` (no redirects followed) until it answers a step
    of it, the step after the store's; when that answer arrived (``time.monotonic()``)."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.SessionServiceStub(channel)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                info = stub.GetSession(pb.GetSessionRequest(session_id=sid), timeout=5)
                request = pb.StreamRequest(steps=[step_input(sid, info.step + 1, x)])
                (response,) = stub.Stream(iter([request]), timeout=5)
            except grpc.RpcError:
                time.sleep(0.05)  # held by A still (a redirect), or loading
                continue
            (result,) = response.results
            if not result.HasField("error"):
                return time.monotonic()
            time.sleep(0.05)
        raise AssertionError(f"{address} never answered a step of session {sid}")


@pytest.mark.slow
def test_a_worker_cut_off_from_redis_answers_nothing_after_another_took_over(
    start_worker, served_models, redis_url
):
    model = served_models["demo"]
    x = random_inputs(model, 5000, seed=49)
    with TcpProxy.to_url(redis_url) as proxy:
        a = start_worker(url=proxy.url, **SETTINGS)
        b = start_worker(**SETTINGS)
        sids = [
            a.client.create_session("demo", durability=d, snapshot_every=1 << 20).session_id
            for d in DURABILITIES
        ]
        with OnlyTo(a.address, sids, x) as client:
            wait_for(lambda: min(client.acked.values()) >= 20, [], 30, "A answering")
            # Right after a renewal, so the leases run their longest past the cut: a
            # batch under way then waits out a whole Redis timeout with them still valid.
            renewals = a.worker.ownership.renewals
            wait_for(lambda: a.worker.ownership.renewals > renewals, [], 10, "a renewal")
            proxy.black_hole()
            with ThreadPoolExecutor(len(sids)) as pool:  # B asks for all three at once
                firsts = [pool.submit(first_answer_from, b.address, sid, x[0], 30) for sid in sids]
                taken = dict(zip(sids, (f.result() for f in firsts), strict=True))
            time.sleep(REDIS_TIMEOUT_S * 2)  # what A still holds would be answered by now
            client.stop.set()
        proxy.heal(deliver=False)
    late = {
        sid: [(step, round(t - taken[sid], 3)) for s, step, t in client.answered if s == sid]
        for sid in sids
    }
    late = {sid: [a for a in answers if a[1] > 0] for sid, answers in late.items()}
    assert not any(late.values()), (
        f"A answered after B took over (step, seconds after B's first answer): {late}"
    )
