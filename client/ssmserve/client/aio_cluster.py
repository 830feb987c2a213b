"""The asyncio client's calls about the cluster: its workers and the models they serve.

:class:`~ssmserve.client.aio.AsyncClient` inherits them: users call them on it, this
class only keeps the facade's two halves (sessions there, cluster here) readable.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import grpc

from ssmserve.client.errors import from_rpc_error
from ssmserve.client.retry import RetryPolicy
from ssmserve.client.routing import WorkerRouter
from ssmserve.client.step_values import SessionRef, session_id_of
from ssmserve.v1 import ssmserve_pb2 as pb


@contextlib.contextmanager
def typed_errors(router: WorkerRouter, address: str) -> Iterator[None]:
    """A call's gRPC error as the client's typed one (ServerUnreachable for a first
    connection that failed: ``WorkerRouter.connection_failed``)."""
    try:
        yield
    except grpc.RpcError as exc:
        raise router.connection_failed(address, from_rpc_error(exc)) from None


class AsyncClusterCalls:
    """Workers and models: list, move sessions between, drain; load, unload, upgrade."""

    address: str
    retry: RetryPolicy
    router: WorkerRouter

    async def discover(self) -> None:
        """Learn the live workers' addresses from the cluster (best effort: raises
        nothing; ``addresses`` shows what it learned)."""
        await self.router.discover()

    async def list_workers(self) -> list[pb.WorkerInfo]:
        """The live workers of the cluster, as WorkerInfo: address, id, models, sessions,
        whether draining, and the stats of their last heartbeat."""
        reply = await self.router.call(lambda w: w.cluster.ListWorkers(pb.ListWorkersRequest()))
        return list(reply.workers)

    async def migrate(self, session: SessionRef, target: str) -> pb.MigrateResponse:
        """Move the session (an id or a SessionInfo) to the worker at ``target``
        (HOST:PORT). Returns where it went from and to, at which step, how long it took.
        Raises NotFound (no such session, or no live worker at ``target``), Unavailable
        (the target did not take it: the source keeps serving it)."""
        session_id = session_id_of(session)
        request = pb.MigrateRequest(session_id=session_id, target=target)
        reply: pb.MigrateResponse = await self.router.call(
            lambda w: w.cluster.Migrate(request), session_id, idempotent=False
        )
        self.router.remember_owner(session_id, reply.target)
        return reply

    async def drain(self, worker: str = "") -> AsyncIterator[pb.DrainProgress]:
        """Move every session off ``worker`` (HOST:PORT; default: the first address),
        which then refuses new ones; yields a DrainProgress per session moved.

        Each message within ``RetryPolicy.stall_timeout_s`` (heartbeats, not yielded,
        come while a move is slow) or DeadlineExceeded, not retried: that ends the drain
        (moves under way finish; drain again for the rest). Raises NotFound (no live
        worker there)."""
        call = self.router.worker(self.address).cluster.Drain(pb.DrainRequest(worker=worker))
        with typed_errors(self.router, self.address):
            async for progress in self.router.replies(call):
                self.router.served("", self.address)
                if not progress.heartbeat:
                    yield progress

    async def undrain(self, worker: str = "") -> pb.WorkerInfo:
        """Undo a drain of ``worker`` (HOST:PORT; default: the first address): it takes
        sessions again. Returns its WorkerInfo. Raises NotFound (no live worker there)."""
        request = pb.UndrainRequest(worker=worker)
        reply: pb.WorkerInfo = await self.router.call(lambda w: w.cluster.Undrain(request))
        return reply

    async def list_models(self, worker: str = "") -> pb.ListModelsResponse:
        """The models ``worker`` (HOST:PORT; default: the first address) serves, by name
        and version, with their fingerprints and resident sessions. Asks that worker
        only: no redirect, no retry."""
        reply: pb.ListModelsResponse = await self.router.call_at(
            worker, lambda w: w.sessions.ListModels(pb.ListModelsRequest())
        )
        return reply

    async def load_model(self, key: str, directory: str, worker: str = "") -> pb.ListModelsResponse:
        """Admin: ``worker`` (HOST:PORT; default: the first address) serves ``key``
        (NAME[@VERSION]) from ``directory`` on its host from now on, without a restart.

        Returns its models after. Raises InvalidArgument (a bad key or model directory,
        or a model too large for its messages), AlreadyExists (it serves that key),
        PermissionDenied (the token is not an admin's)."""
        request = pb.LoadModelRequest(key=key, directory=directory)
        timeout = max(self.retry.call_timeout_s, 120.0)  # the worker compiles its kernels
        reply: pb.ListModelsResponse = await self.router.call_at(
            worker, lambda w: w.cluster.LoadModel(request, timeout=timeout)
        )
        return reply

    async def unload_model(self, key: str, worker: str = "") -> pb.ListModelsResponse:
        """Admin: ``worker`` (HOST:PORT; default: the first address) stops serving
        ``key`` (NAME[@VERSION]). Returns its models after. Raises NotFound (it does not
        serve that key), FailedPrecondition (sessions there still run it)."""
        reply: pb.ListModelsResponse = await self.router.call_at(
            worker, lambda w: w.cluster.UnloadModel(pb.UnloadModelRequest(key=key))
        )
        return reply

    async def upgrade(self, session: SessionRef, model: str = "") -> pb.UpgradeResponse:
        """Move the session (an id or a SessionInfo) to another version of its model,
        ``model`` (NAME@VERSION; default: the newest), by replaying its kept inputs
        through it. Returns its new SessionInfo (``.session``), the model it ran before
        and the steps replayed (inputs older than its oldest kept snapshot are gone, so
        the new state is what the new version makes of the kept ones). Raises NotFound
        (no such session or model), FailedPrecondition (that model takes or gives other
        shapes)."""
        session_id = session_id_of(session)
        request = pb.UpgradeRequest(session_id=session_id, model=model)
        reply: pb.UpgradeResponse = await self.router.call(
            lambda w: w.sessions.Upgrade(request), session_id
        )  # idempotent: asking again for the version it now runs changes nothing
        return reply
