"""The one place where typed errors become gRPC statuses.

Every :class:`~server.errors.SsmserveError` maps by its kind to a status code, with a
``google.rpc.Status`` in the trailing metadata (``grpc-status-details-bin``) carrying a
``google.rpc.ErrorInfo``: ``reason`` is the error's stable code (``STEP_GAP``,
``CHECKPOINT_CHECKSUM``, ...), ``domain`` is ``ssmserve.v1``. Clients turn that back into
typed exceptions (``client/errors.py``). Per-step errors inside a stream use the same
code and reason in a ``StepError``.
"""

from __future__ import annotations

import logging
from typing import NoReturn

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from ssmserve.v1 import ssmserve_pb2 as pb

from server.errors import ErrorKind, SsmserveError

log = logging.getLogger(__name__)

DOMAIN = "ssmserve.v1"
DETAILS_KEY = "grpc-status-details-bin"

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
    info.Pack(error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN))
    return status_pb2.Status(code=code.value[0], message=str(error), details=[info])


async def abort(context: grpc.aio.ServicerContext, error: SsmserveError) -> NoReturn:
    """End the RPC with ``error``'s status code, message and details."""
    status = rich_status(error)
    await context.abort(
        grpc_code(error),
        status.message,
        trailing_metadata=((DETAILS_KEY, status.SerializeToString()),),
    )
    raise AssertionError("context.abort returned")


async def abort_internal(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    """A bug: log it with its traceback, tell the client no more than that it happened."""
    log.error("internal error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__})")
    raise AssertionError("context.abort returned")


def step_error(error: SsmserveError) -> pb.StepError:
    return pb.StepError(code=grpc_code(error).value[0], reason=error.reason, message=str(error))
