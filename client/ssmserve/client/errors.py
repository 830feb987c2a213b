"""Typed exceptions for clients, rebuilt from the server's status details.

The server sends a ``google.rpc.Status`` with an ``ErrorInfo`` (reason, domain) in the
trailing metadata of every error (``ssmserve.server.api.status``). :func:`from_rpc_error` turns
that back into one exception class per status code, carrying the reason, so callers can
``except NotFound`` or look at ``err.reason == "STEP_GAP"``.
"""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2

from ssmserve.v1 import ssmserve_pb2 as pb

DETAILS_KEY = "grpc-status-details-bin"
OWNER_KEY = "ssmserve-owner"
RETRY_AFTER_KEY = "ssmserve-retry-after-ms"


class SsmserveClientError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, reason: str = "", code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return self.message


class InvalidArgument(SsmserveClientError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(SsmserveClientError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(SsmserveClientError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(SsmserveClientError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(SsmserveClientError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(SsmserveClientError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(SsmserveClientError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class DataLoss(SsmserveClientError):
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(SsmserveClientError):
    """No token, or one the server does not know."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(SsmserveClientError):
    """The token's role may not call this method."""

    code = grpc.StatusCode.PERMISSION_DENIED


class SessionMoved(Unavailable):
    """The session is served by another worker: ``owner`` (may be empty when unknown).

    ``retry_after_ms`` is how long the owner's lease still runs: if the owner cannot be
    reached (it died), any worker can take the session over after that.
    """

    def __init__(
        self, message: str, reason: str = "", owner: str = "", retry_after_ms: int = 0
    ) -> None:
        super().__init__(message, reason, grpc.StatusCode.UNAVAILABLE)
        self.owner = owner
        self.retry_after_ms = retry_after_ms


class ServerUnreachable(Unavailable):
    """No worker at any of ``addresses`` could be connected to, and none ever answered
    this client: nothing is listening there, a wrong address, or TLS on one side only.
    ``cause`` says what the connection attempt ran into; the message adds what to
    check."""

    def __init__(self, addresses: list[str], cause: str, advice: str = "") -> None:
        where = ", ".join(addresses)
        advice = advice or ("is it running?" if len(addresses) == 1 else "is one running?")
        super().__init__(f"no ssmserve server at {where}: {cause}; {advice}")
        self.addresses = addresses
        self.cause = cause


class OwnerUnreachable(Unavailable):
    """A worker redirected a call about ``session_id`` to its owner ``owner``, which does
    not answer, and the worker that redirected it (``via``) did not take the session over
    within ``waited_s`` (``RetryPolicy.takeover_wait_s``): the owner may be alive but cut
    off from this client (it keeps renewing its lease), or ``via`` cannot reach the store.
    Nothing was done."""

    def __init__(self, session_id: str, owner: str, via: str, waited_s: float) -> None:
        waited = f"{waited_s:.1f}".removesuffix(".0")
        super().__init__(
            f"the owner {owner} of session {session_id} does not answer and {via} has not "
            f"taken it over: waited {waited} s (RetryPolicy.takeover_wait_s); nothing "
            f"was done. Is {owner} alive but out of this client's reach? Retry later, or see "
            "`ssmserve workers`",
            "OWNER_UNREACHABLE",
        )
        self.session_id = session_id
        self.owner = owner
        self.via = via
        self.waited_s = waited_s


#: What grpc says of a call that never got a connection, so was never sent: the channel
#: had no worker to send it to (nothing listening, or a worker that never sent the HTTP/2
#: SETTINGS of a live server: frozen).
_NEVER_SENT = ("failed to connect to all addresses", "before receiving SETTINGS frame")


def never_sent(error: SsmserveClientError) -> bool:
    """Whether ``error`` says its call never reached a worker (no connection was made), so
    that sending it elsewhere cannot do it twice."""
    if error.code != grpc.StatusCode.UNAVAILABLE or error.reason:
        return False
    return any(needle.lower() in error.message.lower() for needle in _NEVER_SENT)


_TLS = ("the TLS handshake failed", "do both sides use TLS, and does the CA trust its certificate?")
_CLOSED = "does the server use TLS (then give the client its CA) or is that another service?"
#: What a failed connection's status details say: (text in them, the cause in a few
#: words, what to check; "" for "is it running?").
_CONNECTION_CAUSES = (
    ("Connection refused", "connection refused", ""),
    ("Domain name not found", "no such host", "is the host name right?"),
    ("DNS resolution failed", "no such host", "is the host name right?"),
    ("errors resolving", "no such host", "is the host name right?"),
    ("Failed parsing HTTP/2", "something else than a gRPC server answers", "is the port right?"),
    ("handshake", *_TLS),
    ("Ssl", *_TLS),
    ("Connection reset", "the connection was reset", _CLOSED),
    ("Socket closed", "the connection was closed", _CLOSED),
    ("Deadline Exceeded", "no answer in time", ""),
    ("Timeout occurred", "no answer in time", ""),
    ("No route to host", "no route to host", "is the address right?"),
    ("Network is unreachable", "the network is unreachable", "is the address right?"),
)


def server_unreachable(addresses: list[str], error: SsmserveClientError) -> ServerUnreachable:
    """The ServerUnreachable that the failed connection ``error`` means: what it ran
    into, in a few words (the status details' last error when it is none of the known
    causes), and what to check."""
    details = error.message.lower()
    for needle, cause, advice in _CONNECTION_CAUSES:
        if needle.lower() in details:
            return ServerUnreachable(addresses, cause, advice)
    if error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ServerUnreachable(addresses, "no answer in time")
    return ServerUnreachable(addresses, error.message.rpartition("last error: ")[2])


_BY_CODE: dict[grpc.StatusCode, type[SsmserveClientError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        DataLoss,
        Unauthenticated,
        PermissionDenied,
    )
}
_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}
REDIRECT_REASONS = frozenset({"SESSION_MOVED", "STALE_EPOCH"})


def step_redirect(error: pb.StepError) -> SessionMoved | None:
    """The redirect a step's error carries (reason SESSION_MOVED / STALE_EPOCH), if any."""
    if error.reason not in REDIRECT_REASONS:
        return None
    return SessionMoved(error.message, error.reason, error.owner, error.retry_after_ms)


class StepFailed(SsmserveClientError):
    """A step in a stream was answered with an error (the stream itself goes on)."""

    def __init__(self, result: pb.StepResult) -> None:
        code = _BY_NUMBER.get(result.error.code, grpc.StatusCode.UNKNOWN)
        super().__init__(result.error.message, result.error.reason, code)
        self.session_id = result.session_id
        self.step = result.step
        self.result = result


class SessionRewound(FailedPrecondition):
    """A session came back at ``session_step``, behind steps this stream was answered
    (its durability keeps steps in memory between flushes and its worker crashed, or the
    store lost writes), and the stream no longer holds the inputs from there on
    (``RetryPolicy.rewind_window``): send them again from ``session_step + 1``."""

    def __init__(self, message: str, session_id: str, session_step: int, answered: int) -> None:
        super().__init__(message, "SESSION_REWOUND")
        self.session_id = session_id
        self.session_step = session_step
        self.answered = answered  # the last step this stream was answered


#: Reasons of a step error that say where the session is (``StepError.session_step``).
GAP_REASONS = frozenset({"STEP_GAP", "SESSION_REWOUND"})


def from_rpc_error(error: grpc.RpcError) -> SsmserveClientError:
    code: grpc.StatusCode = error.code()  # type: ignore[attr-defined]
    message: str = error.details() or code.name  # type: ignore[attr-defined]
    reason = ""
    metadata: dict[str, str] = {}
    for key, value in error.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == DETAILS_KEY:
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    reason = info.reason
                    metadata.update(info.metadata)
        elif key in (OWNER_KEY, RETRY_AFTER_KEY) and isinstance(value, str):
            metadata[key] = value
    if reason in REDIRECT_REASONS:
        retry_after = metadata.get(RETRY_AFTER_KEY, "0")
        return SessionMoved(
            message,
            reason,
            owner=metadata.get(OWNER_KEY, ""),
            retry_after_ms=int(retry_after) if retry_after.isdigit() else 0,
        )
    return _BY_CODE.get(code, SsmserveClientError)(message, reason, code)
