"""The one place where typed errors become gRPC statuses.

Every :class:`~server.errors.SsmserveError` maps by its kind to a status code, with a
``google.rpc.Status`` in the trailing metadata (``grpc-status-details-bin``) carrying a
``google.rpc.ErrorInfo``: ``reason`` is the error's stable code (``STEP_GAP``,
``CHECKPOINT_CHECKSUM``, ...), ``domain`` is ``ssmserve.v1``. Clients turn that back into
typed exceptions (``client/errors.py``). Per-step errors inside a stream use the same
code and reason in a ``StepError``.

A :class:`~server.errors.SessionMovedError` (a redirect) also puts the owner's address in
the trailing metadata (``ssmserve-owner``) and in the ErrorInfo's metadata, with how long
the owner's lease still runs (``ssmserve-retry-after-ms``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from ssmserve.v1 import ssmserve_pb2 as pb

from server.errors import ErrorKind, SessionMovedError, SsmserveError

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
}


def grpc_code(error: SsmserveError) -> grpc.StatusCode:
    return GRPC_CODES[error.kind]


def rich_status(error: SsmserveError) -> status_pb2.Status:
    code = grpc_code(error)
    info = any_pb2.Any()
    info.Pack(
        error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN, metadata=_redirect(error))
    )
    return status_pb2.Status(code=code.value[0], message=str(error), details=[info])


def _redirect(error: SsmserveError) -> dict[str, str]:
    if not isinstance(error, SessionMovedError):
        return {}
    return {OWNER_KEY: error.owner, RETRY_AFTER_KEY: str(error.retry_after_ms)}


async def abort(context: grpc.aio.ServicerContext, error: SsmserveError) -> NoReturn:
    """End the RPC with ``error``'s status code, message and details."""
    status = rich_status(error)
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
async def edge(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Wrap a handler: typed errors end the RPC with their status, bugs with INTERNAL."""
    try:
        yield
    except SsmserveError as exc:
        await abort(context, exc)
    except (asyncio.CancelledError, grpc.aio.AbortError):
        raise
    except Exception as exc:
        await abort_internal(context, exc)


async def abort_internal(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    """A bug: log it with its traceback, tell the client no more than that it happened."""
    log.error("internal error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__})")
    raise AssertionError("context.abort returned")


def step_error(error: SsmserveError) -> pb.StepError:
    return pb.StepError(code=grpc_code(error).value[0], reason=error.reason, message=str(error))
