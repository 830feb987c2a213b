"""gRPC channels from this worker to the other workers (migration hand-off, drain relay)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc

from server.errors import ErrorKind, SsmserveError


class PeerError(SsmserveError):
    """Another worker could not be reached, or refused what this one asked of it."""

    kind = ErrorKind.UNAVAILABLE


class Peers:
    """One channel per peer address, opened on first use and closed with :meth:`close`."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self._stubs: dict[str, tuple[grpc.aio.Channel, pb_grpc.ClusterServiceStub]] = {}

    def _stub(self, address: str) -> pb_grpc.ClusterServiceStub:
        if address not in self._stubs:
            channel = grpc.aio.insecure_channel(address)
            self._stubs[address] = (channel, pb_grpc.ClusterServiceStub(channel))
        return self._stubs[address][1]

    async def adopt(self, address: str, session_id: str) -> pb.AdoptSessionResponse:
        try:
            return await self._stub(address).AdoptSession(
                pb.AdoptSessionRequest(session_id=session_id), timeout=self.timeout_s
            )
        except grpc.RpcError as exc:
            raise PeerError(f"worker {address}: {_describe(exc)}") from None

    async def drain(self, address: str) -> AsyncIterator[pb.DrainProgress]:
        call = self._stub(address).Drain(pb.DrainRequest(worker=address))
        try:
            async for progress in call:
                yield progress
        except grpc.RpcError as exc:
            raise PeerError(f"worker {address}: {_describe(exc)}") from None

    async def close(self) -> None:
        channels = [channel for channel, _ in self._stubs.values()]
        self._stubs.clear()
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)


def _describe(exc: grpc.RpcError) -> str:
    code = exc.code()  # type: ignore[attr-defined]
    return f"{code.name if code else 'UNKNOWN'}: {exc.details()}"  # type: ignore[attr-defined]
