"""One live worker per advertised address and data directory, and proof of the dead ones.

A worker restarted in place (systemd, a container restart, the ``--workers`` supervisor)
comes back on the address its predecessor advertised, and finds that one's registry
entry and session leases still standing: nothing in Redis tells a dead worker from a
live one until its heartbeat and leases have stood unrenewed for a TTL. So each worker
holds ``DATA_DIR/workers/<address>.lock`` (``flock``) for its whole life, from before
it registers until after it leaves the registry, and writes its worker id into it. The
kernel drops the lock when the process ends, however it ends, so whoever takes the lock
next knows every worker id the file names as a process that no longer runs: its
*predecessors*. The start check does not wait out their registry entries, and their
sessions are taken over at the first request (``sessions.loading``).

A second live worker on the same address and data directory finds the lock held and is
refused at once, naming the worker and the pid that hold it. A data directory that
cannot be written (a read-only image with ``--redis-url``) proves nothing, and the
worker goes on without: its start check and takeovers then wait, as across machines.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
import re
from pathlib import Path

from ssmserve.server.cluster.ownership import Ownership
from ssmserve.server.startup_checks import AdvertiseInUseError, refuse_taken_advertise

log = logging.getLogger(__name__)

#: Earlier workers whose ids the file keeps (each restart adds one); a dead worker whose
#: entry outlives this many restarts in a row is waited out instead, as before.
KEPT_PREDECESSORS = 8
_READ_BYTES = 4096


class AdvertiseLock:
    """The lock of one advertised address in one data directory."""

    def __init__(self, data_dir: Path, address: str) -> None:
        self.address = address
        self.path = data_dir / "workers" / lock_name(address)
        self.predecessors: frozenset[str] = frozenset()
        self._fd: int | None = None

    def acquire(self, worker_id: str) -> AdvertiseLock:
        """Take the lock for ``worker_id``, learning the ids of the workers that held it
        before; :class:`AdvertiseInUseError` if a live process holds it now. A lock file
        that cannot be made is logged and skipped (no predecessor is then known)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            log.info(
                "no lock for address %s in %s (%s): a restart here waits out this "
                "worker's registry entry and leases instead",
                self.address, self.path.parent, exc.strerror or exc,
            )  # fmt: skip
            return self
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fields = _read(fd)
            os.close(fd)
            holder = fields.get("worker", ["?"])[0]
            pid = fields.get("owner", ["?"])[0]
            raise AdvertiseInUseError(
                f"worker {holder} (process {pid}) already advertises {self.address} from "
                f"this data directory ({self.path.parent.parent}) and is alive; clients and "
                f"other workers could not tell the two apart. Give each worker its own "
                f"--advertise (or --listen), or stop that worker"
            ) from None
        except OSError:
            os.close(fd)
            raise
        before = _read(fd)
        earlier = before.get("worker", []) + before.get("before", [])
        kept = [w for w in dict.fromkeys(earlier) if w and w != worker_id][:KEPT_PREDECESSORS]
        self.predecessors = frozenset(kept)
        text = f"owner {os.getpid()}\nworker {worker_id}\n" + "".join(f"before {w}\n" for w in kept)
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Let the lock go: after the worker left the registry and wrote its last."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


async def claim_address(ownership: Ownership, data_dir: Path, listening_on: str) -> AdvertiseLock:
    """Before the worker registers: take its address's lock (held from now until after
    it leaves the registry, so whoever takes it next knows this worker dead), learn its
    dead predecessors, and refuse the start if a live worker has its address
    (``startup_checks.refuse_taken_advertise``)."""
    lock = await asyncio.to_thread(
        AdvertiseLock(data_dir, ownership.address).acquire, ownership.worker_id
    )
    ownership.predecessors = lock.predecessors
    timing = ownership.settings  # a dead worker's entry is gone one TTL after its last beat
    try:
        await refuse_taken_advertise(
            ownership, listening_on, timing.worker_ttl_s + timing.period_s,
            timing.period_s / 8, lock.predecessors,
        )  # fmt: skip
    except BaseException:
        lock.release()
        raise
    return lock


def lock_name(address: str) -> str:
    """A file name for ``address``: readable, and distinct for distinct addresses."""
    readable = re.sub(r"[^A-Za-z0-9.-]", "_", address)[:96]
    digest = hashlib.sha256(address.encode()).hexdigest()[:12]
    return f"{readable}-{digest}.lock"


def _read(fd: int) -> dict[str, list[str]]:
    fields: dict[str, list[str]] = {}
    with contextlib.suppress(OSError):
        for line in os.pread(fd, _READ_BYTES, 0).decode(errors="replace").splitlines():
            key, _, value = line.partition(" ")
            if key in ("owner", "worker", "before") and value.strip():
                fields.setdefault(key, []).append(value.strip()[:128])
    return fields
