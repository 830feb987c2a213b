"""gRPC channels from this worker to the other workers (migration hand-off, drain relay).

Every call has a deadline and every channel gRPC keepalive, so a peer that froze or
vanished behind a half-open connection fails the call within seconds instead of holding
a hand-off (and the session it holds) forever.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from ssmserve.client.stall_bound import replies_within
from ssmserve.client.tls import TlsConfig, TlsConfigError
from ssmserve.server.errors import ErrorKind, SsmserveError
from ssmserve.server.observability.metrics import Metrics
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc


class PeerError(SsmserveError):
    """Another worker could not be reached, or refused what this one asked of it."""

    kind = ErrorKind.UNAVAILABLE


@dataclass(frozen=True)
class PeerSettings:
    """Deadlines and keepalive of worker-to-worker calls (documented defaults)."""

    # AdoptSession: the target acquires and loads the session (restore + replay of up to
    # one snapshot interval; a 130m-shaped model replays ~20 steps/s).
    adopt_timeout_s: float = 30.0
    # A relayed Drain streams until the other worker has moved all of its sessions.
    drain_timeout_s: float = 600.0
    # ...and sends a message (progress or a heartbeat, every few seconds) at least this
    # often, or the relay gives up on it.
    drain_stall_s: float = 30.0
    keepalive_time_s: float = 2.0
    keepalive_timeout_s: float = 2.0


class Peers:
    """One channel per peer address, opened on first use and closed with :meth:`close`."""

    def __init__(
        self,
        settings: PeerSettings | None = None,
        tls: TlsConfig | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.settings = settings or PeerSettings()
        self.tls = tls  # the workers' listeners speak TLS: so do these channels
        self.metadata = metadata  # the cluster secret, when workers require one
        # The worker's metrics, whose tracer (read at each call: it may be replaced) puts
        # the caller's trace context on each peer call (none when tracing is off).
        self.metrics = Metrics(enabled=False)
        self._stubs: dict[str, tuple[grpc.aio.Channel, pb_grpc.ClusterServiceStub]] = {}

    def _call_metadata(self) -> tuple[tuple[str, str], ...]:
        """A peer call's metadata: the cluster secret, and the caller's trace context when
        tracing is on."""
        tracing = self.metrics.tracing
        return self.metadata + tracing.outgoing() if tracing.enabled else self.metadata

    def _stub(self, address: str) -> pb_grpc.ClusterServiceStub:
        if address not in self._stubs:
            s = self.settings
            options = [
                ("grpc.keepalive_time_ms", int(s.keepalive_time_s * 1000)),
                ("grpc.keepalive_timeout_ms", int(s.keepalive_timeout_s * 1000)),
                ("grpc.http2.ping_timeout_ms", int(s.keepalive_timeout_s * 1000)),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0),
            ]
            if self.tls is None:
                channel = grpc.aio.insecure_channel(address, options=options)
            else:
                try:
                    credentials = self.tls.credentials()
                except TlsConfigError as exc:
                    raise PeerError(
                        f"cannot open a TLS channel to worker {address}: {exc}"
                    ) from None
                channel = grpc.aio.secure_channel(address, credentials, options=options)
            self._stubs[address] = (channel, pb_grpc.ClusterServiceStub(channel))
        return self._stubs[address][1]

    async def adopt(self, address: str, session_id: str) -> pb.AdoptSessionResponse:
        try:
            return await self._stub(address).AdoptSession(
                pb.AdoptSessionRequest(session_id=session_id),
                timeout=self.settings.adopt_timeout_s,
                metadata=self._call_metadata(),
            )
        except grpc.RpcError as exc:
            raise PeerError(f"worker {address}: {_describe(exc)}") from None

    async def undrain(self, address: str) -> pb.WorkerInfo:
        try:
            return await self._stub(address).Undrain(
                pb.UndrainRequest(worker=address),
                timeout=self.settings.adopt_timeout_s,
                metadata=self._call_metadata(),
            )
        except grpc.RpcError as exc:
            raise PeerError(f"worker {address}: {_describe(exc)}") from None

    async def drain(self, address: str) -> AsyncIterator[pb.DrainProgress]:
        call = self._stub(address).Drain(
            pb.DrainRequest(worker=address),
            timeout=self.settings.drain_timeout_s,
            metadata=self._call_metadata(),
        )
        stall = self.settings.drain_stall_s
        try:
            async for progress in replies_within(call, stall, "PeerSettings.drain_stall_s"):
                yield progress
        except grpc.RpcError as exc:  # a stall too: DEADLINE_EXCEEDED, no reply for ...
            raise PeerError(f"worker {address}: {_describe(exc)}") from None
        finally:
            call.cancel()

    async def close(self) -> None:
        channels = [channel for channel, _ in self._stubs.values()]
        self._stubs.clear()
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)


def _describe(exc: grpc.RpcError) -> str:
    code = exc.code()  # type: ignore[attr-defined]
    details = (exc.details() or "")[:300]  # type: ignore[attr-defined]
    return f"{code.name if code else 'UNKNOWN'}: {details}"
