"""Running one Lua script many times in one round trip, on each Redis topology.

The store's group commit (a tick's log appends) and other batched writes send many
EVALSHAs at once. How depends on where the keys live:

- **One server** (plain or Sentinel's master): one pipeline, ending in ``WAIT`` when
  replicas must confirm each write (``--redis-wait-replicas``).
- **Redis Cluster**: redis-py refuses EVALSHA in its cluster pipelines, so the calls are
  grouped by the node that serves their slot and each group goes as one pipeline on that
  node's own connection, all nodes at once, each ending in ``WAIT`` when replicas must
  confirm (``bench/bench_scale.py`` measures this against one concurrent call per
  script).

A reply that says a call did not run (MOVED, ASK, TRYAGAIN, CLUSTERDOWN while slots move;
NOSCRIPT) is safe to send again, writes included: :func:`until_run` does, within the
command deadline. Which outcome a lost answer has is the caller's (``StoreCalls._call``).

On a cluster each node's outcome is its own: a node whose answer is lost, or whose
replicas do not confirm its writes (a master just failed over, with no replica yet),
makes only its own calls' outcomes unknown (:class:`UnconfirmedWriteError` in their
places); the calls other nodes answered and confirmed stand. Otherwise one master without
a replica would stall every session of a batch, on every master, for as long as it lasts.
Only when no call has a known outcome is the error raised for the whole batch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from redis import exceptions as redis_errors
from redis.asyncio.cluster import PipelineCommand, RedisCluster
from redis.commands.core import AsyncScript

from ssmserve.server.state.held_connection import HeldConnection

T = TypeVar("T")

#: One call of a script: its keys and its arguments.
ScriptCall = tuple[Sequence[Any], Sequence[Any]]

#: Redis Cluster answers that say a command was *not* run (a slot moving or not served
#: for a moment): safe to send again, writes included, within the command deadline.
NOT_RUN = (
    redis_errors.TryAgainError,
    redis_errors.MovedError,
    redis_errors.AskError,
    redis_errors.ClusterDownError,
    redis_errors.SlotNotCoveredError,
    redis_errors.ClusterError,  # redis-py's "TTL exhausted": redirected too often
)

#: Replies in a batch that say the call did not run: NOT_RUN, or NOSCRIPT (load, resend).
_DID_NOT_RUN = (*NOT_RUN, redis_errors.NoScriptError)


class UnconfirmedWriteError(redis_errors.RedisError):
    """In a batch's replies: a call whose outcome is unknown because its node's answer was
    lost or its replicas did not confirm it (``store_errors.unknown_outcome_of`` maps it
    to StoreOutcomeUnknownError). It may have been applied; it is never sent again."""


async def until_run(
    call: Callable[[], Awaitable[T]],
    started: float,
    deadline_s: float,
    on_retry: Callable[[], None] = lambda: None,
) -> T:
    """``call()``, sent again while Redis Cluster answers that it did not run it (a slot
    is moving), until ``deadline_s`` after ``started`` (``time.perf_counter()``)."""
    delay = 0.01
    while True:
        try:
            return await call()
        except NOT_RUN:
            if time.perf_counter() - started + delay > deadline_s:
                raise
            on_retry()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)


class ScriptBatches:
    """Runs a script for many calls in one round trip (per node); one reply per call,
    refusals (error replies, or "did not run" once the deadline passed) as exceptions in
    the list, a lost answer raised."""

    def __init__(
        self,
        redis: Any,
        wait_replicas: int,
        wait_timeout_ms: int,
        deadline_s: float,
        on_retry: Callable[[], None] = lambda: None,
    ) -> None:
        self.redis = redis
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self.deadline_s = deadline_s
        self.on_retry = on_retry
        # Single calls on one server go on a connection of their own (held_connection).
        self._held = (
            None if isinstance(redis, RedisCluster) else HeldConnection(redis.connection_pool)
        )

    async def run(self, script: AsyncScript, calls: Sequence[ScriptCall]) -> list[Any]:
        if isinstance(self.redis, RedisCluster):
            return await self.per_node(script, calls)
        return await self.pipelined(script, calls)

    async def pipelined(self, script: AsyncScript, calls: Sequence[ScriptCall]) -> list[Any]:
        """One server: one pipeline, ending in WAIT when replicas must confirm. EVALSHA
        straight away (redis-py's own way asks SCRIPT EXISTS first, one more round trip
        per pipeline); a NOSCRIPT reply means the call did not run: load it, send again."""
        if len(calls) == 1 and not self.wait_replicas:
            return [await self._one(script, calls[0])]
        todo = list(range(len(calls)))
        replies: list[Any] = [None] * len(calls)
        for _ in range(2):
            async with self.redis.pipeline(transaction=False) as pipe:
                for i in todo:
                    keys, args = calls[i]
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
                if self.wait_replicas:
                    pipe.wait(self.wait_replicas, self.wait_timeout_ms)
                got = await pipe.execute(raise_on_error=False)
            acked = got.pop() if self.wait_replicas else None
            if self.wait_replicas and not all(
                isinstance(reply, redis_errors.NoScriptError) for reply in got
            ):
                self._check_replicas(acked)
            for i, reply in zip(todo, got, strict=True):
                replies[i] = reply
            todo = [i for i in todo if isinstance(replies[i], redis_errors.NoScriptError)]
            if not todo:
                break
            script.sha = await self.redis.script_load(script.script)
        return replies

    async def _one(self, script: AsyncScript, call: ScriptCall) -> Any:
        """One call on one server, without a pipeline (a lone session's step makes one per
        step): the reply, or the error reply as an exception, as in a pipeline's list.

        Why: a redis-py pipeline costs a task and three more event-loop turns on its way
        out (``Pipeline.reset`` shields a coroutine): ~35 us of client CPU per call
        (docs/benchmark-history.md, "Issue 19, stop 31"). It goes on the held connection
        when that is free (``held_connection``: ~35 us less again)."""
        keys, args = call
        for attempt in range(2):
            try:
                held = self._held
                if held is None or held.busy:
                    return await self.redis.evalsha(script.sha, len(keys), *keys, *args)
                return await held.execute("EVALSHA", script.sha, len(keys), *keys, *args)
            except redis_errors.NoScriptError as exc:  # not run: load it, send again
                if attempt:
                    return exc
                script.sha = await self.redis.script_load(script.script)
            except redis_errors.ResponseError as exc:  # the script answered an error
                return exc
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        if self._held is not None:
            await self._held.aclose()

    def _check_replicas(self, acked: Any) -> None:
        unconfirmed = self._unconfirmed(acked)
        if unconfirmed is not None:
            raise unconfirmed

    def _unconfirmed(self, acked: Any) -> redis_errors.TimeoutError | None:
        """A WAIT's reply as the error it stands for (fewer replicas than asked), or None."""
        if isinstance(acked, Exception) or int(acked) < self.wait_replicas:
            return redis_errors.TimeoutError(
                f"{acked} of {self.wait_replicas} replicas confirmed the write "
                f"within {self.wait_timeout_ms} ms"
            )
        return None

    async def per_node(self, script: AsyncScript, calls: Sequence[ScriptCall]) -> list[Any]:
        """Redis Cluster: one pipeline per node on that node's own connection, for the
        slots it serves, all nodes at once (redis-py refuses EVALSHA in its cluster
        pipelines), each ending in WAIT when replicas must confirm (on the connection
        that wrote: WAIT counts the writes of its own connection).

        A call a node answers with a redirection or NOSCRIPT did not run there; it goes
        again in the next round, within the command deadline: after MOVED to the slot's
        new node (the slot map patched as redis-py does), after ASK to the node named,
        preceded by ASKING on the same connection, after NOSCRIPT once the script is
        loaded, after TRYAGAIN or CLUSTERDOWN after a pause."""
        cluster: RedisCluster = self.redis
        started = time.perf_counter()
        replies: list[Any] = [None] * len(calls)
        todo: dict[int, Any] = dict.fromkeys(range(len(calls)))  # call -> ASK node or None
        delay, rounds = 0.01, 0
        unknown_calls: list[int] = []  # calls whose outcome is unknown (never sent again)
        first_unknown: Exception | None = None
        while True:
            rounds += 1
            if cluster._initialize:  # first use, or after a lost node: learn the slots
                await cluster.initialize()
            by_node: dict[str, tuple[Any, list[PipelineCommand]]] = {}
            unserved: dict[int, Exception] = {}  # calls whose slot has no node right now
            for i, asked in todo.items():
                keys, args = calls[i]
                try:
                    node = asked or cluster.nodes_manager.get_node_from_slot(
                        cluster.keyslot(keys[0])
                    )
                except redis_errors.SlotNotCoveredError as exc:  # a failover under way
                    unserved[i] = exc
                    cluster._initialize = True
                    continue
                commands = by_node.setdefault(node.name, (node, []))[1]
                if asked is not None:
                    commands.append(PipelineCommand(_ASKING, "ASKING"))
                commands.append(PipelineCommand(i, "EVALSHA", script.sha, len(keys), *keys, *args))
            if self.wait_replicas:
                for _node, commands in by_node.values():
                    commands.append(
                        PipelineCommand(_WAIT, "WAIT", self.wait_replicas, self.wait_timeout_ms)
                    )
            lost = await asyncio.gather(
                *(_on_node(cluster, node, commands) for node, commands in by_node.values())
            )
            todo, refused, load, pause = {}, None, False, False
            for i, exc in unserved.items():
                todo[i], refused, pause = None, exc, True
            for (_node, commands), answer_lost in zip(by_node.values(), lost, strict=True):
                unknown = answer_lost
                if unknown is None and self.wait_replicas and any(_ran(c) for c in commands):
                    unknown = self._unconfirmed(commands[-1].result)
                for command in commands:
                    i, reply = command.position, command.result
                    if i < 0:
                        continue
                    if unknown is not None and (answer_lost is not None or _ran(command)):
                        replies[i] = UnconfirmedWriteError(str(unknown))
                        unknown_calls.append(i)
                        continue
                    if not isinstance(reply, _DID_NOT_RUN):
                        replies[i] = reply
                        continue
                    refused, todo[i] = reply, None
                    if isinstance(reply, redis_errors.AskError):
                        todo[i] = cluster.nodes_manager.get_node(reply.host, reply.port)
                        if todo[i] is None:  # a node we do not know yet: learn the nodes
                            cluster._initialize = True
                    elif isinstance(reply, redis_errors.MovedError):
                        await cluster.nodes_manager.move_slot(reply)
                    elif isinstance(reply, redis_errors.NoScriptError):
                        load = True
                    else:  # TRYAGAIN, CLUSTERDOWN, not covered: give the cluster a moment
                        pause = True
                if unknown is not None and first_unknown is None:
                    first_unknown = unknown
            if first_unknown is not None and len(unknown_calls) == len(calls):
                raise first_unknown  # no call has a known outcome: the batch's is unknown
            if refused is None:
                return replies
            if time.perf_counter() - started + delay > self.deadline_s:
                if len(todo) == len(calls):  # nothing ran: the caller may send it all again
                    raise refused
                # Some ran: each of the others gets its refusal (it did not run), and the
                # batch is never sent again as a whole.
                for i in todo:
                    replies[i] = refused
                return replies
            self.on_retry()
            if load:
                script.sha = await cluster.script_load(script.script)  # on every master
            if pause or rounds > 2:  # a slot still moving: do not spin
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.2)


#: Pipeline positions of the commands that are not calls (their replies are not replies).
_ASKING, _WAIT = -1, -2


def _ran(command: PipelineCommand) -> bool:
    """Whether a call in a pipeline ran (a WAIT after calls that all did not run has
    nothing to confirm)."""
    return command.position >= 0 and not isinstance(command.result, _DID_NOT_RUN)


async def _on_node(
    cluster: RedisCluster, node: Any, commands: list[PipelineCommand]
) -> redis_errors.ConnectionError | redis_errors.TimeoutError | None:
    """One node's pipeline; returns the error that lost its answer, or None. A lost
    connection is handled as redis-py's cluster client handles it for its own commands:
    the node's connections are renewed and the slot map is learned again before the next
    use (a failover may have moved its slots).

    redis-py files an error met while reading the replies as that command's result; a
    connection error there means every command sent to this node may or may not have run,
    so it is returned (an unknown outcome for each of this node's calls), never read as a
    refusal."""
    try:
        await node.execute_pipeline(commands)
        for command in commands:
            if isinstance(command.result, redis_errors.ConnectionError | redis_errors.TimeoutError):
                raise command.result
    except (redis_errors.ConnectionError, redis_errors.TimeoutError) as exc:
        node.update_active_connections_for_reconnect()
        await node.disconnect_free_connections()
        cluster.nodes_manager.move_node_to_end_of_cached_nodes(node.name)
        cluster._initialize = True
        return exc
    return None
