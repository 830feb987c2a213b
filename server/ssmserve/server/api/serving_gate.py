"""While the worker must not serve (an evicting Redis, ``cluster.store_guard``), every
SessionService call is answered UNAVAILABLE with the reason, before its handler runs.

``refusal()`` says why not (None: serve). Stream is let through: its steps are answered
one by one with the refusal (``stream_pipeline.StreamReader``), since ending a bidi call
while the client still writes can reach the client as INTERNAL with the status lost.
Health checks, reflection and ClusterService (workers listing, drains, migrations) are
not touched.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from ssmserve.server.api.status import abort
from ssmserve.server.errors import SsmserveError
from ssmserve.v1 import ssmserve_pb2 as pb

_SESSION_SERVICE = "/" + pb.DESCRIPTOR.services_by_name["SessionService"].full_name + "/"
_STREAM = _SESSION_SERVICE + "Stream"


class ServingGate(grpc.aio.ServerInterceptor):
    def __init__(self, refusal: Callable[[], SsmserveError | None]) -> None:
        self.refusal = refusal

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method: str = details.method  # type: ignore[attr-defined]
        if handler is None or not method.startswith(_SESSION_SERVICE) or method == _STREAM:
            return handler
        refusal = self.refusal
        de, ser = handler.request_deserializer, handler.response_serializer
        if handler.request_streaming and not handler.response_streaming:
            inner_su = handler.stream_unary
            if not inspect.iscoroutinefunction(inner_su):
                return handler

            async def stream_unary(requests: Any, context: Any) -> Any:
                if (error := refusal()) is not None:
                    await abort(context, error)
                return await inner_su(requests, context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, de, ser)
        if handler.response_streaming and not handler.request_streaming:
            inner_us = handler.unary_stream
            if not inspect.isasyncgenfunction(inner_us):
                return handler

            async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
                if (error := refusal()) is not None:
                    await abort(context, error)
                async for response in inner_us(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream, de, ser)
        inner_uu = handler.unary_unary
        if handler.request_streaming or not inspect.iscoroutinefunction(inner_uu):
            return handler

        async def unary_unary(request: Any, context: Any) -> Any:
            if (error := refusal()) is not None:
                await abort(context, error)
            return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, de, ser)
