"""The blocking client's calls about the cluster: its workers and the models they serve.

:class:`~ssmserve.client.sync.Client` inherits them (as ``AsyncClient`` inherits
``aio_cluster.AsyncClusterCalls``); each waits for the async client's method.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

from ssmserve.client.aio import AsyncClient
from ssmserve.client.step_values import SessionRef
from ssmserve.v1 import ssmserve_pb2 as pb

T = TypeVar("T")


class ClusterCalls:
    """Workers and models: list, move sessions between, drain; load, unload, upgrade."""

    _aio: AsyncClient

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        raise NotImplementedError  # Client's

    def _iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        raise NotImplementedError  # Client's

    def discover(self) -> None:
        """Learn the live workers' addresses from the cluster (best effort: raises
        nothing; ``addresses`` shows what it learned)."""
        self._run(self._aio.discover())

    def list_workers(self) -> list[pb.WorkerInfo]:
        """The live workers of the cluster, as WorkerInfo: address, id, models, sessions,
        whether draining, and the stats of their last heartbeat."""
        return self._run(self._aio.list_workers())

    def migrate(self, session: SessionRef, target: str) -> pb.MigrateResponse:
        """Move the session (an id or a SessionInfo) to the worker at ``target``
        (HOST:PORT). Returns where it went from and to, at which step, how long it took.
        Raises NotFound (no such session, or no live worker at ``target``), Unavailable
        (the target did not take it: the source keeps serving it)."""
        return self._run(self._aio.migrate(session, target))

    def drain(self, worker: str = "") -> Iterator[pb.DrainProgress]:
        """Move every session off ``worker`` (HOST:PORT; default: the first address),
        which then refuses new ones; yields a DrainProgress per session moved.

        Each message within ``RetryPolicy.stall_timeout_s`` (heartbeats, not yielded,
        come while a move is slow) or DeadlineExceeded, not retried: that ends the drain
        (moves under way finish; drain again for the rest). Raises NotFound (no live
        worker there)."""
        return self._iterate(self._aio.drain(worker))

    def undrain(self, worker: str = "") -> pb.WorkerInfo:
        """Undo a drain of ``worker`` (HOST:PORT; default: the first address): it takes
        sessions again. Returns its WorkerInfo. Raises NotFound (no live worker there)."""
        return self._run(self._aio.undrain(worker))

    def list_models(self, worker: str = "") -> pb.ListModelsResponse:
        """The models ``worker`` (HOST:PORT; default: the first address) serves, by name
        and version, with their fingerprints and resident sessions. Asks that worker
        only: no redirect, no retry."""
        return self._run(self._aio.list_models(worker))

    def load_model(self, key: str, directory: str, worker: str = "") -> pb.ListModelsResponse:
        """Admin: ``worker`` (HOST:PORT; default: the first address) serves ``key``
        (NAME[@VERSION]) from ``directory`` on its host from now on, without a restart.

        Returns its models after. Raises InvalidArgument (a bad key or model directory,
        or a model too large for its messages), AlreadyExists (it serves that key),
        PermissionDenied (the token is not an admin's)."""
        return self._run(self._aio.load_model(key, directory, worker))

    def unload_model(self, key: str, worker: str = "") -> pb.ListModelsResponse:
        """Admin: ``worker`` (HOST:PORT; default: the first address) stops serving
        ``key`` (NAME[@VERSION]). Returns its models after. Raises NotFound (it does not
        serve that key), FailedPrecondition (sessions there still run it)."""
        return self._run(self._aio.unload_model(key, worker))

    def upgrade(self, session: SessionRef, model: str = "") -> pb.UpgradeResponse:
        """Move the session (an id or a SessionInfo) to another version of its model,
        ``model`` (NAME@VERSION; default: the newest), by replaying its kept inputs
        through it. Returns its new SessionInfo (``.session``), the model it ran before
        and the steps replayed (inputs older than its oldest kept snapshot are gone, so
        the new state is what the new version makes of the kept ones). Raises NotFound
        (no such session or model), FailedPrecondition (that model takes or gives other
        shapes)."""
        return self._run(self._aio.upgrade(session, model))
