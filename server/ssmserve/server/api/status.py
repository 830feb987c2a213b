"""The one place where typed errors become gRPC statuses.

Every :class:`~ssmserve.server.errors.SsmserveError` maps by its kind to a status code, with a
``google.rpc.Status`` in the trailing metadata (``grpc-status-details-bin``) carrying a
``google.rpc.ErrorInfo``: ``reason`` is the error's stable code (``STEP_GAP``,
``CHECKPOINT_CHECKSUM``, ...), ``domain`` is ``ssmserve.v1``. Clients turn that back into
typed exceptions (``ssmserve.client.errors``). Per-step errors inside a stream use the same
code and reason in a ``StepError``.

A :class:`~ssmserve.server.errors.SessionMovedError` (a redirect) also puts the owner's address in
the trailing metadata (``ssmserve-owner``) and in the ErrorInfo's metadata, with how long
the owner's lease still runs (``ssmserve-retry-after-ms``). Its subclass
:class:`~ssmserve.server.errors.TakeoverPendingError` (UNAVAILABLE ``TAKEOVER_PENDING``) has
no owner, only the delay: retry this worker then, as it takes the session over.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from ssmserve.server.errors import ErrorKind, SessionMovedError, SsmserveError
from ssmserve.v1 import ssmserve_pb2 as pb

log = logging.getLogger(__name__)

DOMAIN = "ssmserve.v1"
DETAILS_KEY = "grpc-status-details-bin"
OWNER_KEY = "ssmserve-owner"
RETRY_AFTER_KEY = "ssmserve-retry-after-ms"

GRPC_CODES: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.DATA_LOSS: grpc.StatusCode.DATA_LOSS,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


def grpc_code(error: SsmserveError) -> grpc.StatusCode:
    return GRPC_CODES[error.kind]


#: The longest message an error carries (client strings in it are clipped already; this
#: bounds the rest, so status details always fit in gRPC's metadata limits).
MAX_MESSAGE_CHARS = 2048


def message_of(error: BaseException) -> str:
    text = str(error)
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


def rich_status(error: SsmserveError, clean: Callable[[str], str] = str) -> status_pb2.Status:
    """``clean``: takes the caller's own tenant out of the ids in the message."""
    code = grpc_code(error)
    info = any_pb2.Any()
    info.Pack(
        error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN, metadata=_redirect(error))
    )
    message = clean(message_of(error))
    return status_pb2.Status(code=code.value[0], message=message, details=[info])


def _redirect(error: SsmserveError) -> dict[str, str]:
    if not isinstance(error, SessionMovedError):
        return {}
    return {OWNER_KEY: error.owner, RETRY_AFTER_KEY: str(error.retry_after_ms)}


async def abort(
    context: grpc.aio.ServicerContext, error: SsmserveError, clean: Callable[[str], str] = str
) -> NoReturn:
    """End the RPC with ``error``'s status code, message and details."""
    status = rich_status(error, clean)
    await context.abort(
        grpc_code(error),
        status.message,
        trailing_metadata=(
            (DETAILS_KEY, status.SerializeToString()),
            *_redirect(error).items(),
        ),
    )
    raise AssertionError("context.abort returned")


@contextlib.asynccontextmanager
async def edge(
    context: grpc.aio.ServicerContext, clean: Callable[[str], str] = str
) -> AsyncIterator[None]:
    """Wrap a handler: typed errors end the RPC with their status, bugs with INTERNAL."""
    try:
        yield
    except SsmserveError as exc:
        await abort(context, exc, clean)
    except (asyncio.CancelledError, grpc.aio.AbortError):
        raise
    except Exception as exc:
        await abort_internal(context, exc)


async def abort_internal(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    """A bug: log it with its traceback, tell the client no more than that it happened."""
    log.error("internal error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__})")
    raise AssertionError("context.abort returned")


def step_error(error: SsmserveError, clean: Callable[[str], str] = str) -> pb.StepError:
    out = pb.StepError(
        code=grpc_code(error).value[0], reason=error.reason, message=clean(message_of(error))
    )
    if isinstance(error, SessionMovedError):  # a redirect: where to go, and from when
        out.owner = error.owner
        out.retry_after_ms = max(0, min(error.retry_after_ms, 2**32 - 1))
    session_step = getattr(error, "session_step", None)  # a gap: where the session is
    if isinstance(session_step, int) and session_step >= 0:
        out.session_step = session_step
    return out


# ---------------------------------------------------------------------------- undecodable


class UndecodableRequestError(SsmserveError):
    """A request message that is not valid protobuf for its method."""


@dataclass(frozen=True)
class _Undecodable:
    """What a request that fails to parse becomes, instead of an exception inside grpcio
    (which would answer UNKNOWN, with the Python exception's class, and log a traceback)."""

    method: str
    size: int
    problem: str

    def error(self) -> UndecodableRequestError:
        return UndecodableRequestError(
            f"the request is not a valid message for {self.method} ({self.size} bytes: "
            f"{self.problem[:200]})"
        )


class UndecodableRequests(grpc.aio.ServerInterceptor):
    """Requests that do not parse get INVALID_ARGUMENT and one log line.

    Wraps every async handler: its deserializer returns an :class:`_Undecodable` marker
    instead of raising, and the handler answers the marker with the error (a streamed
    request's iterator raises it where the handler reads it).
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = details.method  # type: ignore[attr-defined]
        parse = handler.request_deserializer

        def deserialize(raw: bytes) -> object:
            try:
                return parse(raw)
            except Exception as exc:
                log.warning("undecodable request to %s (%d bytes): %s", method, len(raw), exc)
                return _Undecodable(method, len(raw), str(exc) or type(exc).__name__)

        serialize = handler.response_serializer
        if handler.request_streaming and handler.response_streaming:
            inner_ss = handler.stream_stream
            if not inspect.isasyncgenfunction(inner_ss):
                return handler

            async def stream_stream(requests: Any, context: Any) -> AsyncIterator[Any]:
                async for response in inner_ss(_checked(requests), context):
                    yield response

            return grpc.stream_stream_rpc_method_handler(stream_stream, deserialize, serialize)
        if handler.request_streaming:
            inner_su = handler.stream_unary
            if not inspect.iscoroutinefunction(inner_su):
                return handler

            async def stream_unary(requests: Any, context: Any) -> Any:
                return await inner_su(_checked(requests), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, deserialize, serialize)
        if handler.response_streaming:
            inner_us = handler.unary_stream
            if not inspect.isasyncgenfunction(inner_us):
                return handler

            async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
                if isinstance(request, _Undecodable):
                    await abort(context, request.error())
                async for response in inner_us(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream, deserialize, serialize)
        inner_uu = handler.unary_unary
        if not inspect.iscoroutinefunction(inner_uu):
            return handler

        async def unary_unary(request: Any, context: Any) -> Any:
            if isinstance(request, _Undecodable):
                await abort(context, request.error())
            return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, deserialize, serialize)


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Undecodable):
            raise request.error()
        yield request
