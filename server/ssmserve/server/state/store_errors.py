"""Typed errors of the session store, and the one place script replies become them.

Every Lua script in ``store_layout`` answers a table: ``{'OK', ...}``, ``{'HANDOFF'}``,
or ``{'ERR_<CODE>', message, ...}``. :data:`SCRIPT_ERRORS` maps each code to its exception
class; a code missing from it is a store/worker version mismatch or a bug, and raises
:class:`UnknownReplyError` (INTERNAL), never a transient error that a client would retry
forever. ``tests/test_store.py`` checks that every code the scripts can send is mapped.
"""

from __future__ import annotations

from typing import Any

from redis import exceptions as redis_errors

from ssmserve.server.errors import ErrorKind, SessionMovedError, SsmserveError, clip
from ssmserve.server.state.script_batches import NOT_RUN, UnconfirmedWriteError


class StoreError(SsmserveError):
    """Redis said no in a way that is not the caller's fault."""

    kind = ErrorKind.UNAVAILABLE


class StoreUnavailableError(StoreError):
    """Redis cannot be reached (or timed out); nothing was written; retry."""


class StoreOutcomeUnknownError(StoreUnavailableError):
    """A write was sent but its answer never came: it may or may not have run.

    Never guessed at: the session is reloaded from Redis before anything else about it
    is answered.
    """


class StoreDataError(SsmserveError):
    """What Redis holds for a session cannot be read back (a field is not what it must be)."""

    kind = ErrorKind.DATA_LOSS


class StoreResetError(SsmserveError):
    """The store was wiped or replaced (its identity changed, ``state.store_facts``) while
    this worker held the session: what it had in Redis is gone, and memory is not served
    as if nothing had happened. Creating or importing the id again starts it anew."""

    kind = ErrorKind.DATA_LOSS

    def __init__(self, session_id: str, step: int) -> None:
        super().__init__(
            f"the store was wiped or replaced; session {session_id!r} at step {step} is lost"
        )
        self.session_id = session_id
        self.step = step


class SessionMissingError(SsmserveError):
    kind = ErrorKind.NOT_FOUND


class SessionVanishedError(SessionMissingError):
    """A fenced write found its session's metadata gone while the writer held the lease.

    Not NOT_FOUND yet: a new owner may have closed it after this worker's lease ran out,
    or the store was wiped. The worker drops the session and checks the store's identity;
    the request is retried and then answered NOT_FOUND or DATA_LOSS (``StoreResetError``).
    """

    kind = ErrorKind.UNAVAILABLE


class SessionExistsError(SsmserveError):
    kind = ErrorKind.ALREADY_EXISTS


class SessionClosedError(SsmserveError):
    kind = ErrorKind.FAILED_PRECONDITION


class LabelTakenError(SsmserveError):
    kind = ErrorKind.ALREADY_EXISTS


class StaleEpochError(SessionMovedError):
    """A write carried a fencing token that is no longer the session's: another worker (or
    another incarnation of the id) owns it now. For the client a redirect like any other
    (``owner`` says where to go); the reason code keeps its historic name."""


class LeaseHeldError(SessionMovedError):
    """Another worker holds the session's lease, or may still trust it by its own clock.

    ``beat`` is the session's lease beat as Redis has it now (it moves with every
    acquisition and renewal); ``owner_lease_ms`` is the TTL its owner's lease was given
    (``cluster.takeover`` waits that long, on this worker's clock, for the beat to move);
    ``owner_id`` is the worker id of the session's last acquirer (whose beat that is)."""

    def __init__(
        self,
        message: str,
        owner: str = "",
        retry_after_ms: int = 0,
        beat: str = "",
        owner_lease_ms: int = 0,
        owner_id: str = "",
    ) -> None:
        super().__init__(message, owner=owner, retry_after_ms=retry_after_ms)
        self.beat = beat
        self.owner_lease_ms = owner_lease_ms
        self.owner_id = owner_id

    @property
    def reason(self) -> str:
        return "SESSION_MOVED"  # a redirect to the owner, as clients know it


class LeaseExpiredError(StoreError):
    """This worker's lease ran out before it was renewed (nobody took the session yet)."""


class LogDivergedError(StoreError):
    """A write does not continue what Redis holds: memory and store diverged. The session
    is reloaded from Redis (the source of truth); the request may be retried."""


class StagedPiecesMissingError(StoreError):
    """Staged pieces are gone (they expired first): a snapshot commit committed nothing
    and stages again on the next try; an import is refused and may be sent again."""


class SnapshotsChangedError(StoreError):
    """A script found the session's snapshots other than the caller read them just before
    (another write of the same owner came between): nothing was changed; the store reads
    them again and retries, and this reaches a caller only if that keeps happening."""


class UnknownReplyError(SsmserveError):
    """A script answered something this worker does not know: a bug, or a worker and a
    store of different versions. Not transient: retrying cannot help."""

    kind = ErrorKind.INTERNAL


#: Each error code a script can answer -> the exception it stands for. ``ERR_STALE``
#: (a redirect with the owner) and ``ERR_OWNED`` (``Store.acquire``) carry more fields.
SCRIPT_ERRORS: dict[str, type[SsmserveError]] = {
    "ERR_EXISTS": SessionExistsError,
    "ERR_MISSING": SessionMissingError,
    "ERR_CLOSED": SessionClosedError,
    "ERR_LABEL": LabelTakenError,
    "ERR_EXPIRED": LeaseExpiredError,
    "ERR_GAP": LogDivergedError,
    "ERR_STAGE": StagedPiecesMissingError,
    "ERR_RACE": SnapshotsChangedError,
    "ERR_STALE": StaleEpochError,
    "ERR_OWNED": SessionMovedError,
}
SUCCESS_CODES = frozenset({"OK", "HANDOFF"})


def is_out_of_memory(error: BaseException) -> bool:
    """Whether Redis refused a command for lack of memory (``maxmemory`` reached under
    ``noeviction``). Redis 7 keeps the OOM code of a write a script made; Redis 6.2 wraps
    it in the script's ERR."""
    return isinstance(error, redis_errors.OutOfMemoryError) or (
        isinstance(error, redis_errors.ResponseError) and "OOM command not allowed" in str(error)
    )


def out_of_memory(error: BaseException) -> StoreOutcomeUnknownError:
    """An OOM refusal as an unknown outcome: never an acknowledgement, and never a plain
    error either, since what else the same script or pipeline wrote is not known."""
    return StoreOutcomeUnknownError(
        f"the session store (Redis) is out of memory and refused a write "
        f"({str(error)[:200]}); what the operation wrote is not known (a session it wrote "
        f"for is reloaded from Redis): raise Redis's maxmemory, or free memory"
    )


def is_demoted(error: BaseException) -> bool:
    """Whether the server refused a write because it is a replica now (READONLY): a
    failover demoted the master this connection was made to."""
    return isinstance(error, redis_errors.ReadOnlyError) or (
        isinstance(error, redis_errors.ResponseError) and str(error).startswith("READONLY")
    )


def demoted(error: BaseException) -> StoreOutcomeUnknownError:
    """A READONLY refusal as an unknown outcome: what this connection wrote before it, on
    a master that is a replica now, may be gone (the new master never had it)."""
    return StoreOutcomeUnknownError(
        f"the Redis server this worker wrote to is a replica now (a failover demoted it: "
        f"{str(error)[:200]}); what was written there may be lost, so the session is "
        f"reloaded from the new master"
    )


#: Error replies with which Redis refuses a write it will not run now: too few replicas
#: (``min-replicas-to-write``), a replica cut off from its master, a dataset loading, a
#: script running past its limit, a failed background save (``stop-writes-on-bgsave-error``).
_REFUSALS = ("NOREPLICAS", "MASTERDOWN", "LOADING", "BUSY", "MISCONF")


def unknown_outcome_of(error: BaseException) -> StoreOutcomeUnknownError | None:
    """The unknown outcome an error reply stands for (OOM, READONLY, the refusals above,
    one cluster node's lost or unconfirmed part of a batch), or None. Refused writes did
    not run; they still count as unknown, which is what a session's memory is safe under
    (a refused script may have been one of a batch)."""
    if isinstance(error, UnconfirmedWriteError):  # one node's part of a cluster batch
        return StoreOutcomeUnknownError(
            f"the session store (Redis Cluster) did not confirm a write, which may or may "
            f"not have been applied: {str(error)[:200]}"
        )
    if is_out_of_memory(error):
        return out_of_memory(error)
    if is_demoted(error):
        return demoted(error)
    if isinstance(error, redis_errors.ResponseError) and str(error).startswith(_REFUSALS):
        return StoreOutcomeUnknownError(
            f"the session store (Redis) refused a write ({str(error)[:200]}); the session "
            f"is reloaded once Redis takes writes again"
        )
    return None


def reply_fields(raw: Any) -> list[str]:
    """A script's reply as a list of strings."""
    if isinstance(raw, Exception) and (unknown := unknown_outcome_of(raw)) is not None:
        raise unknown
    if isinstance(raw, list) and raw:
        return [v.decode(errors="replace") if isinstance(v, bytes) else str(v) for v in raw]
    raise UnknownReplyError(f"unexpected reply from the session store: {raw!r:.200}")


def check_reply(raw: Any) -> list[str]:
    """A script's reply as a list of strings; raises the typed error its code stands for."""
    reply = reply_fields(raw)
    code, rest = reply[0], reply[1:]
    if code in SUCCESS_CODES:
        return reply
    message = rest[0] if rest else code
    if code == "ERR_STALE":
        owner = rest[1] if len(rest) > 1 else ""
        raise StaleEpochError(f"{message} by {owner or 'no live worker'}", owner=owner)
    error = SCRIPT_ERRORS.get(code)
    if error is None:
        raise UnknownReplyError(
            f"the session store answered an unknown code {code[:40]!r}: {message[:200]}"
        )
    raise error(message)


def reply_outcome(raw: Any) -> SsmserveError | None:
    """A pipelined script reply as None (success) or the typed error it stands for."""
    if isinstance(raw, NOT_RUN):  # Redis Cluster did not run it (a slot moving): retry
        return StoreUnavailableError(
            f"the session store (Redis Cluster) did not run the command: {clip(str(raw))}"
        )
    if isinstance(raw, Exception):
        unknown = unknown_outcome_of(raw)
        if unknown is not None:
            return unknown
        return StoreError(f"the session store (Redis) failed: {raw}")
    try:
        check_reply(raw)
    except SsmserveError as exc:
        return exc
    return None
