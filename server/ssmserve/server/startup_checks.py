"""Operator mistakes a starting worker refuses, with a message that names the clash.

* **A listen port already in use.** gRPC turns SO_REUSEPORT on by default, so a second
  worker on a taken port starts and the kernel splits new connections between the two:
  a client's calls land on either at random. Workers listen with it off
  (``worker.server_options``), so the bind fails, and :func:`bind_listener` says why.
* **An advertised address another live worker of the same Redis already uses.** Clients
  and workers reach a session's owner by that address: with two workers on one, a
  session's calls loop on redirects, a migration "succeeds" without moving, and a drain
  hands sessions to itself. :func:`refuse_taken_advertise` reads the registry before
  the worker registers; an entry with the address that is refreshed meanwhile belongs
  to a live worker (refused), one that expires belonged to a worker that died (a
  restarted worker waits that out, at most one worker TTL, unless the entry is of its
  own host and address: the port it just bound proves that one dead). Two workers that start at
  the same moment both pass that check; :func:`refuse_later_twin` after registering
  lets the earlier one stay.

(The third, a data directory held by a live process, is ``data_dir_lock``.)
"""

from __future__ import annotations

import asyncio
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
    records: list[WorkerRecord], ownership: Ownership, listening_on: str
) -> dict[str, float]:
    """Other workers registered with this worker's address: id -> last heartbeat. An
    entry of a worker on this host (its id starts with this host's name) for the address
    this worker itself listens on now is left out: that worker is dead, since the port
    could not be bound while it lived (SO_REUSEPORT is off). So a worker restarted in
    place after a crash starts at once instead of waiting its predecessor's entry out."""
    return {
        r.worker_id: r.heartbeat_at
        for r in records
        if r.address == ownership.address
        and r.worker_id != ownership.worker_id
        and not (ownership.address == listening_on and _same_host(r.worker_id, ownership))
    }


def _same_host(worker_id: str, ownership: Ownership) -> bool:
    """Whether ``worker_id`` was made on this host (``ownership.new_worker_id``)."""
    return worker_id.rpartition("-")[0] == ownership.worker_id.rpartition("-")[0]


def _clash(record_id: str, ownership: Ownership) -> AdvertiseInUseError:
    return AdvertiseInUseError(
        f"worker {record_id} already advertises {ownership.address} in this Redis and is "
        f"alive; clients and other workers could not tell the two apart. Give each worker "
        f"its own --advertise (or --listen), or stop that worker"
    )


async def refuse_taken_advertise(
    ownership: Ownership, listening_on: str, wait_s: float, poll_s: float
) -> None:
    """Raise :class:`AdvertiseInUseError` if a live worker registered this worker's
    address; wait (at most ``wait_s``, the registry's TTL and a round) for the entry of
    a dead one to expire. ``listening_on``: the address this worker's socket is bound
    to."""
    seen = _holders(await ownership.live_workers(), ownership, listening_on)
    if not seen:
        return
    log.warning(
        "%s is registered by %s; waiting up to %.1f s to see whether it is alive",
        ownership.address, ", ".join(sorted(seen)), wait_s,
    )  # fmt: skip
    deadline = time.monotonic() + wait_s
    while seen:
        await asyncio.sleep(poll_s)
        now = _holders(await ownership.live_workers(), ownership, listening_on)
        for worker_id, beat in now.items():
            if worker_id not in seen or seen[worker_id] != beat:  # a new one, or refreshed
                raise _clash(worker_id, ownership)
        seen = {k: v for k, v in seen.items() if k in now}  # expired entries drop out
        if seen and time.monotonic() >= deadline:  # still there: renewed in Redis
            raise _clash(next(iter(sorted(seen))), ownership)


async def refuse_later_twin(ownership: Ownership, listening_on: str) -> None:
    """After registering: if another live worker registered the same address, the one
    that started later (by start time, then id) steps back."""
    me = (ownership.started_at, ownership.worker_id)
    holders = _holders(await ownership.live_workers(), ownership, listening_on)
    for record in await ownership.live_workers():
        if record.worker_id not in holders:
            continue
        if (record.started_at, record.worker_id) < me:
            raise _clash(record.worker_id, ownership)
