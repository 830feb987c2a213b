"""Typed errors raised inside ssmserve.

Every error carries an :class:`ErrorKind`; the gRPC edge maps kinds to status codes
in one place, and the CLI turns any of them into one line on stderr with exit code 2.
Messages say what was wrong and why, so they can be shown to users as they are.
"""

from __future__ import annotations

import asyncio
import enum


class ErrorKind(enum.Enum):
    """What kind of failure this is, independent of the transport that reports it."""

    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    ALREADY_EXISTS = "already_exists"
    FAILED_PRECONDITION = "failed_precondition"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    DATA_LOSS = "data_loss"
    INTERNAL = "internal"  # a bug or a version mismatch: retrying cannot help


#: Characters of a client's string that an error message may repeat back.
CLIP_CHARS = 128


def clip(text: object, limit: int = CLIP_CHARS) -> str:
    """``text`` quoted for an error message, cut to ``limit`` characters.

    Clients send ids, labels and names of any length; messages (and the status details
    that carry them) stay small whatever was sent.
    """
    s = str(text)
    if len(s) <= limit:
        return repr(s)
    return f"{s[:limit]!r}... ({len(s)} characters)"


class SsmserveError(Exception):
    """Base of every error ssmserve raises on purpose.

    ``reason`` is a stable machine-readable code (``google.rpc.ErrorInfo.reason`` at the
    gRPC edge, ``StepError.reason`` in a stream); by default it is derived from the class
    name (``StepGapError`` -> ``STEP_GAP``).
    """

    kind: ErrorKind = ErrorKind.INVALID_ARGUMENT

    @property
    def reason(self) -> str:
        name = type(self).__name__.removesuffix("Error") or "SSMSERVE"
        return "".join(f"_{c}" if c.isupper() and i else c for i, c in enumerate(name)).upper()


class ModelFormatError(SsmserveError):
    """A model directory is missing files, or its config or tensors are invalid."""


class InsufficientMemoryError(SsmserveError):
    """Loading a model would need more memory than the machine has available: refused
    before a byte of it is read, never an out-of-memory kill half-way."""

    kind = ErrorKind.RESOURCE_EXHAUSTED


class ModelInputError(SsmserveError):
    """Inputs given to a model have the wrong dtype, shape, or values (NaN, bad token id)."""


class CheckpointError(SsmserveError):
    """A checkpoint blob cannot be decoded; subclasses say why."""


class CheckpointMagicError(CheckpointError):
    """The blob does not start with the checkpoint magic: it is not a checkpoint."""


class CheckpointVersionError(CheckpointError):
    """The blob is a checkpoint of a format version this build cannot read."""


class CheckpointTruncatedError(CheckpointError):
    """The blob is shorter (or longer) than its header says."""


class CheckpointChecksumError(CheckpointError):
    """The checksum over the blob does not match: it was corrupted."""


class CheckpointLayoutError(CheckpointError):
    """The header is well-formed msgpack but its fields disagree (dtype, shape, offsets)."""


class CheckpointModelMismatchError(CheckpointError):
    """The checkpoint belongs to another model (fingerprint or state shapes differ)."""

    kind = ErrorKind.FAILED_PRECONDITION


class SessionMovedError(SsmserveError):
    """The session is owned by another worker (or being handed to one): ask that one.

    ``owner`` is the worker's advertised address (empty when the owner is unknown);
    ``retry_after_ms`` is how long the owner's lease still runs, so a client that cannot
    reach the owner (it died) knows when any worker may take the session over.
    """

    kind = ErrorKind.UNAVAILABLE

    def __init__(self, message: str, owner: str = "", retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.owner = owner
        self.retry_after_ms = retry_after_ms


class TakeoverPendingError(SessionMovedError):
    """The session's lease is held under this worker's own address by another worker id:
    a predecessor at this address that this worker cannot prove dead (or a twin that
    slipped past the start checks). A redirect would name this very worker, so the
    caller is told to retry here after ``retry_after_ms``, when this worker may take the
    session over (``cluster.takeover``). ``owner`` stays empty: nowhere else to go."""

    def __init__(self, message: str, retry_after_ms: int = 0) -> None:
        super().__init__(message, owner="", retry_after_ms=retry_after_ms)


def being_cancelled() -> bool:
    """True when the running task itself was asked to stop (``Task.cancel``), as opposed
    to a ``CancelledError`` raised by something it awaited that someone else cancelled."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
