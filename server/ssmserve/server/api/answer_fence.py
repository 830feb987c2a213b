"""The last check before an answer leaves the worker: is its session still surely ours?

A worker answers for a session only while the session's lease surely runs by the
worker's own clock (``state.lease``): past that bound another worker may have taken the
session over and answered later steps of it. The stepper proves the leases of a batch
before it answers, but an answer can wait after that proof: behind another session's
store round trip in the same batch (up to ``--redis-timeout``), in a stream's queue of
answers, behind gRPC flow control. So the check that counts is made here, just before
each answer is handed to gRPC, against the lease it was made under: an answer whose
lease no longer surely runs is replaced by LEASE_LAPSED (UNAVAILABLE: the client sends
the step again and gets it from the session's owner, from its history if it was
applied). A session that left memory (taken over, moved, released, dropped to reload)
has its lease expired at once (``ResidentSessions.drop``), so its answers stop here too.

The bound this gives: an answer leaves this worker at least the lease margin
(``--lease-margin`` x ``--lease-ttl``, 0.5 s at the defaults) before Redis can let the
lease go, on clocks that run at the same rate; what remains is the handful of
instructions between this check and the socket write (docs/fault-model.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from ssmserve.server.sessions.errors import LeaseLapsedError, lease_lapsed
from ssmserve.server.sessions.session import StepOutcome, StepRun
from ssmserve.server.state.lease import SessionLease, lease_clock


def lapsed(session_id: str, step: int) -> LeaseLapsedError:
    return lease_lapsed(session_id, f"the answer to step {step}")


def lapsed_stream() -> LeaseLapsedError:
    """The error a stream ends with when a lease runs out between the parts of one
    message's answers (gRPC flow control held them back): the client resumes it."""
    return LeaseLapsedError(
        "this worker's lease on a session of this stream ran out while its answers waited "
        "for the client to read them; the stream resumes from its first unanswered step"
    )


def fence_outcomes(outcomes: list[StepOutcome | StepRun], now: float | None = None) -> int:
    """Replace, in place, every answer of ``outcomes`` made under a lease that no longer
    surely runs at ``now`` (default: the lease clock now) by LEASE_LAPSED. Returns how
    many steps were replaced. Errors carry no session state and are sent as they are."""
    now = lease_clock() if now is None else now
    replaced = 0
    for i, outcome in enumerate(outcomes):
        if isinstance(outcome, StepRun):
            replaced += _fence_run(outcome, now)
        elif _stale(outcome.lease, now) and outcome.error is None:
            error = lapsed(outcome.session_id, outcome.step)
            outcomes[i] = StepOutcome(outcome.session_id, outcome.step, error=error)
            replaced += 1
    return replaced


def any_stale(outcomes: Sequence[StepOutcome | StepRun], now: float | None = None) -> bool:
    """Whether any answer of ``outcomes`` was made under a lease that no longer surely runs."""
    now = lease_clock() if now is None else now
    return any(_stale(outcome.lease, now) for outcome in outcomes)


def _fence_run(run: StepRun, now: float) -> int:
    if not _stale(run.lease, now):
        return 0
    replaced = 0
    for t, outcome in enumerate(run.outcomes):
        if outcome is None or outcome.error is None:
            step = run.first + t
            run.outcomes[t] = StepOutcome(run.session_id, step, error=lapsed(run.session_id, step))
            replaced += 1
    return replaced


def _stale(lease: SessionLease | None, now: float) -> bool:
    return lease is not None and not lease.valid(now)
