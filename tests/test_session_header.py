"""Every client call about one session carries the ``ssmserve-session-id`` header (what a
front such as Envoy or Istio hashes to route a session's calls to one worker).

The server here is a real gRPC server on a loopback socket that records the headers it
receives and refuses every call (FAILED_PRECONDITION, which the client never retries):
what is tested is what the client sends, for each kind of call."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from ssmserve.client.aio import AsyncClient
from ssmserve.client.errors import FailedPrecondition
from ssmserve.client.retry import RetryPolicy
from ssmserve.client.routing import SESSION_HEADER
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc

SID = "robot-7"


class RecordingService(pb_grpc.SessionServiceServicer):
    def __init__(self) -> None:
        self.seen: dict[str, str | None] = {}

    async def _refuse(self, name: str, context: grpc.aio.ServicerContext) -> None:
        headers = dict(context.invocation_metadata() or ())
        self.seen[name] = headers.get(SESSION_HEADER)
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "recorded")

    async def CreateSession(self, request, context):
        await self._refuse("CreateSession", context)

    async def GetSession(self, request, context):
        await self._refuse("GetSession", context)

    async def ListSessions(self, request, context):
        await self._refuse("ListSessions", context)

    async def Rollback(self, request, context):
        await self._refuse("Rollback", context)

    async def Forecast(self, request, context):
        await self._refuse("Forecast", context)

    async def Stream(self, request_iterator, context):
        await self._refuse("Stream", context)

    async def ImportCheckpoint(self, request_iterator, context):
        await self._refuse("ImportCheckpoint", context)


def test_every_call_about_a_session_names_it_in_a_header() -> None:
    asyncio.run(_every_call())


async def _every_call() -> None:
    service = RecordingService()
    server = grpc.aio.server()
    pb_grpc.add_SessionServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        retry = RetryPolicy(call_timeout_s=5.0, give_up_after_s=5.0)
        async with AsyncClient(f"127.0.0.1:{port}", retry=retry, discover=False) as client:
            calls = {
                "CreateSession": client.create_session("demo", session_id=SID),
                "GetSession": client.get_session(SID),
                "ListSessions": client.list_sessions(),
                "Rollback": client.rollback(SID, to_step=3),
                "Forecast": client.forecast(SID, horizon=2),
                "Stream": _drain(client.stream_steps(SID, [np.zeros(4, np.float32)], first_step=1)),
                "ImportCheckpoint": client.import_checkpoint(b"x", SID),
            }
            for name, call in calls.items():
                with pytest.raises(FailedPrecondition):
                    await asyncio.wait_for(call, 10)
                assert name in service.seen, name
    finally:
        await server.stop(None)
    assert service.seen == {
        "CreateSession": SID,
        "GetSession": SID,
        "ListSessions": None,  # about no one session: a front routes it anywhere
        "Rollback": SID,
        "Forecast": SID,
        "Stream": SID,
        "ImportCheckpoint": SID,
    }


async def _drain(stream) -> None:
    async for _ in stream:
        pass
