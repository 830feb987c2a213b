"""Operator mistakes a starting worker refuses, with a message that names the clash.

* **A listen port already in use.** gRPC turns SO_REUSEPORT on by default, so a second
  worker on a taken port starts and the kernel splits new connections between the two:
  a client's calls land on either at random. Workers listen with it off
  (``worker.server_options``), so the bind fails, and :func:`bind_listener` says why.
* **An advertised address another live worker of the same Redis already uses** (or
  advertises the address this worker listens on). Clients and workers reach a session's
  owner by that address: with two workers on one, a session's calls loop on redirects, a
  migration "succeeds" without moving, and a drain hands sessions to itself.
  :func:`refuse_taken_advertise` reads the registry before the worker registers; an
  entry with the address that is refreshed meanwhile belongs to a live worker (refused),
  one that expires belonged to a worker that died (waited out, at most one worker TTL).
  Entries of this worker's dead predecessors (``advertise_lock``: they held the lock of
  this address and data directory that this worker holds now) are not waited out but
  removed. Being of this host and the address this worker binds proves nothing: a live
  worker may advertise an address it does not listen on. Two workers that start at the
  same moment both pass that check; :func:`refuse_later_twin` after registering lets the
  earlier one stay.

(The third, a data directory held by a live process, is ``data_dir_lock``.)
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time

import grpc

from ssmserve.server.cluster.ownership import Ownership
from ssmserve.server.errors import ErrorKind, SsmserveError
from ssmserve.server.state.store_records import WorkerRecord

log = logging.getLogger(__name__)


class ListenPortInUseError(SsmserveError):
    kind = ErrorKind.FAILED_PRECONDITION


class AdvertiseInUseError(SsmserveError):
    kind = ErrorKind.FAILED_PRECONDITION


def bind_listener(
    server: grpc.aio.Server, listen: str, credentials: grpc.ServerCredentials | None
) -> int:
    """Bind ``listen`` (host:port); the bound port, or an error that says what is wrong."""
    try:
        if credentials is None:
            port = server.add_insecure_port(listen)
        else:
            port = server.add_secure_port(listen, credentials)
    except RuntimeError:  # grpc >= 1.5x: "Failed to bind to address ..."
        port = 0
    if port == 0:
        raise _bind_error(listen)
    return port


def _bind_error(listen: str) -> Exception:
    host, _, port_text = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(host, int(port_text), type=socket.SOCK_STREAM)
    except (OSError, ValueError) as exc:
        return OSError(f"cannot listen on {listen}: {exc}")
    problem: OSError | None = None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return ListenPortInUseError(
                        f"port {port_text} is already in use (another ssmserve worker?); "
                        f"pick another --listen or stop it"
                    )
                problem = exc
    return OSError(f"cannot listen on {listen}" + (f": {problem.strerror}" if problem else ""))


def _holders(
    records: list[WorkerRecord],
    ownership: Ownership,
    listening_on: str,
    predecessors: frozenset[str],
) -> dict[str, float]:
    """Other workers registered with an address clients would reach this worker at (the
    one it advertises, or the one it listens on): id -> last heartbeat. This worker's
    dead predecessors are left out (``advertise_lock``)."""
    mine = {ownership.address, listening_on}
    return {
        r.worker_id: r.heartbeat_at
        for r in records
        if r.address in mine
        and r.worker_id != ownership.worker_id
        and r.worker_id not in predecessors
    }


def _clash(record: WorkerRecord, ownership: Ownership) -> AdvertiseInUseError:
    if record.address == ownership.address:
        what = f"{ownership.address} in this Redis"
    else:  # it advertises the address this worker listens on
        what = (
            f"{record.address}, the address this worker listens on, in this Redis (this "
            f"worker advertises {ownership.address}; calls meant for that worker would "
            f"reach this one)"
        )
    return AdvertiseInUseError(
        f"worker {record.worker_id} already advertises {what} and is alive; clients and "
        f"other workers could not tell the two apart. Give each worker its own "
        f"--advertise (or --listen), or stop that worker"
    )


async def refuse_taken_advertise(
    ownership: Ownership,
    listening_on: str,
    wait_s: float,
    poll_s: float,
    predecessors: frozenset[str] = frozenset(),
) -> None:
    """Raise :class:`AdvertiseInUseError` if a live worker registered this worker's
    address (or the one it listens on); wait (at most ``wait_s``, the registry's TTL and
    a round) for the entry of a dead one to expire. ``listening_on``: the address this
    worker's socket is bound to; ``predecessors``: ids of workers known dead, whose
    entries are removed instead."""
    records = await ownership.live_workers()
    await _forget(records, ownership, predecessors)
    seen = _holders(records, ownership, listening_on, predecessors)
    if not seen:
        return
    log.warning(
        "%s is registered by %s; waiting up to %.1f s to see whether it is alive",
        ownership.address, ", ".join(sorted(seen)), wait_s,
    )  # fmt: skip
    deadline = time.monotonic() + wait_s
    while seen:
        await asyncio.sleep(poll_s)
        records = await ownership.live_workers()
        now = _holders(records, ownership, listening_on, predecessors)
        for record in records:
            beat = now.get(record.worker_id)
            if beat is not None and seen.get(record.worker_id) != beat:  # new, or refreshed
                raise _clash(record, ownership)
        seen = {k: v for k, v in seen.items() if k in now}  # expired entries drop out
        if seen and time.monotonic() >= deadline:  # still there: renewed in Redis
            first = min(seen)
            raise _clash(next(r for r in records if r.worker_id == first), ownership)


async def _forget(
    records: list[WorkerRecord], ownership: Ownership, predecessors: frozenset[str]
) -> None:
    """Remove the registry entries of this worker's dead predecessors (best effort: one
    left behind expires within the worker TTL), so that no worker sends a caller or a
    session to them meanwhile."""
    for record in records:
        if record.worker_id in predecessors:
            log.info(
                "worker %s, this worker's dead predecessor at %s (it held this address's "
                "lock), leaves the registry",
                record.worker_id, record.address,
            )  # fmt: skip
            with contextlib.suppress(SsmserveError):
                await ownership.store.deregister_worker(record.worker_id, record.address)


async def refuse_later_twin(
    ownership: Ownership, listening_on: str, predecessors: frozenset[str] = frozenset()
) -> None:
    """After registering: if another live worker registered the same address (or the
    one this worker listens on), the one that started later (by start time, then id)
    steps back."""
    me = (ownership.started_at, ownership.worker_id)
    records = await ownership.live_workers()
    holders = _holders(records, ownership, listening_on, predecessors)
    for record in records:
        if record.worker_id not in holders:
            continue
        if (record.started_at, record.worker_id) < me:
            raise _clash(record, ownership)
