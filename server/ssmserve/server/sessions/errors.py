"""Typed errors of session operations (each kind maps to a gRPC code in ``api.status``)."""

from __future__ import annotations

from ssmserve.server.errors import ErrorKind, SsmserveError, clip


class UnknownModelError(SsmserveError):
    kind = ErrorKind.NOT_FOUND


class BadStepInputError(SsmserveError):
    pass


class SnapshotMissingError(SsmserveError):
    kind = ErrorKind.NOT_FOUND


class RollbackRangeError(SsmserveError):
    """A rollback target outside the steps the session can still reach."""

    kind = ErrorKind.FAILED_PRECONDITION


class ModelMismatchError(SsmserveError):
    """A stored session or checkpoint belongs to another model than the one loaded."""

    kind = ErrorKind.FAILED_PRECONDITION


class CapacityError(SsmserveError):
    kind = ErrorKind.RESOURCE_EXHAUSTED


class WorkerDrainingError(SsmserveError):
    """This worker is draining and no other live worker can take the request."""

    kind = ErrorKind.UNAVAILABLE


class BadLabelError(SsmserveError):
    pass


class BadPageTokenError(SsmserveError):
    pass


class StepRangeError(SsmserveError):
    """A step number beyond what the store can represent exactly (``MAX_STEP``)."""


class NumericsMismatchError(SsmserveError):
    """The session's history was computed with other numerics than this worker's."""

    kind = ErrorKind.FAILED_PRECONDITION


class ReloadingError(SsmserveError):
    """The session left memory to be reloaded from the store (an unknown write outcome,
    or memory and store diverged); retrying the request reloads it."""

    kind = ErrorKind.UNAVAILABLE


class LeaseLapsedError(SsmserveError):
    """An answer for a session was ready, but this worker could no longer prove it owns
    the session when the answer was to leave (its lease ran out by its own clock: Redis
    did not confirm a renewal in time, or the worker was stopped). Nothing is answered;
    a retry reaches the session's owner, this worker once it proves its lease again."""

    kind = ErrorKind.UNAVAILABLE


def lease_lapsed(session_id: str, what: str) -> LeaseLapsedError:
    """LEASE_LAPSED for ``what`` (``"the answer to step 7"``) of session ``session_id``."""
    return LeaseLapsedError(
        f"this worker's lease on session {clip(session_id)} ran out before {what} could be "
        f"sent (its store did not confirm a renewal in time, or the worker was paused); "
        f"ask again: the session's owner answers"
    )


class InputMismatchError(SsmserveError):
    """A resend of a step the session already took carries another input than the one
    it was taken with (as an idempotency key reused with other parameters): refused,
    nothing changed. A true resend gets its recorded answer."""

    kind = ErrorKind.FAILED_PRECONDITION


def input_mismatch(session_id: str, step: int) -> InputMismatchError:
    return InputMismatchError(
        f"step {step} of session {clip(session_id)} was already taken with another input; "
        f"a resend must carry the input it was taken with (its answer is then sent again). "
        f"To give the session another input there, roll it back to step {step - 1} first"
    )


class HandOffError(SsmserveError):
    """A migration's target did not take the session; the source keeps serving it."""

    kind = ErrorKind.UNAVAILABLE
