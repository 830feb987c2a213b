"""RpcMetrics: every RPC timed by method and status code (OpenTelemetry's
``rpc.server.call.duration``, exported as ``ssmserve_rpc_server_call_duration_seconds``),
and, when tracing is on, one SERVER span per RPC (``observability.tracing``).

The outermost interceptor, so a call refused by authorization is counted with its code.
The code is the one the handler set or aborted with (``context.code()``), OK when it set
none, CANCELLED when the client went away, UNKNOWN for an exception nobody mapped. A
streaming call is timed until its last message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from ssmserve.server.observability.metrics import Metrics

_CODES = {"OK": 0, "CANCELLED": 1, "UNKNOWN": 2}


class RpcMetrics(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.seconds = metrics.rpc_seconds

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method: str = details.method  # type: ignore[attr-defined]
        service, _, name = method.strip("/").rpartition("/")  # .../Stream -> Stream
        seconds, metrics = self.seconds, self.metrics
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}

        def observe(
            context: grpc.aio.ServicerContext, started: float, fallback: str, span: Any
        ) -> None:
            code = context.code()
            label = code.name if isinstance(code, grpc.StatusCode) else fallback
            seconds.labels(name, label).observe(time.perf_counter() - started)
            if span is not None:
                number = code.value[0] if isinstance(code, grpc.StatusCode) else _CODES[label]
                span.set_attribute("rpc.grpc.status_code", number)

        def traced(context: grpc.aio.ServicerContext) -> Any:
            metadata = context.invocation_metadata()
            return metrics.tracing.server_span(method.strip("/"), metadata, attributes)

        def unary_response(behavior: Any) -> Any:
            async def timed(request: Any, context: grpc.aio.ServicerContext) -> Any:
                started, fallback = time.perf_counter(), "OK"
                with traced(context) as span:
                    try:
                        return await behavior(request, context)
                    except asyncio.CancelledError:
                        fallback = "CANCELLED"
                        raise
                    except BaseException:
                        fallback = "UNKNOWN"
                        raise
                    finally:
                        observe(context, started, fallback, span)

            return timed

        def stream_response(behavior: Any) -> Any:
            async def timed(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                started, fallback = time.perf_counter(), "OK"
                with traced(context) as span:
                    try:
                        responses = behavior(request, context)
                        if hasattr(responses, "__aiter__"):
                            async for response in responses:
                                yield response
                        else:  # a coroutine that writes with context.write()
                            await responses
                    except (asyncio.CancelledError, GeneratorExit):
                        fallback = "CANCELLED"
                        raise
                    except BaseException:
                        fallback = "UNKNOWN"
                        raise
                    finally:
                        observe(context, started, fallback, span)

            return timed

        parse, render = handler.request_deserializer, handler.response_serializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                unary_response(handler.unary_unary), parse, render
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                unary_response(handler.stream_unary), parse, render
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                stream_response(handler.unary_stream), parse, render
            )
        return grpc.stream_stream_rpc_method_handler(
            stream_response(handler.stream_stream), parse, render
        )
