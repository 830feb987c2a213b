"""Which worker to ask: the client's channels, owner cache and retry/redirect rules.

A request goes to the worker that last served its session (or the first address). A
redirect (``SessionMoved``) sends it to the owner at once; a worker that cannot be
reached is marked unreachable and replaced by another known worker (the client also
learns the live ones from ``ListWorkers``); a call never starts at a worker marked
unreachable. A redirect to a worker marked unreachable before the operation (or its
last progress) first asks it once (a short GetSession): one that answers again
(restarted, back from a pause) is gone to at once. An owner that froze or died keeps its
lease until it runs out, so when a worker redirects to an owner that does not answer,
the client goes back to that worker and waits as long as it says the lease still runs
(``retry_after_ms``), until it takes the session over: at most
``RetryPolicy.takeover_wait`` (a WARNING on this module's logger says so when the wait
starts; then :class:`OwnerUnreachable`). A call that is not idempotent does the same when
it never reached the owner (no connection was made), and only then. How long all this
may go on is the ``RetryPolicy``'s.

The one exception is a client no worker has answered yet (``reached`` is false): when
connecting fails at every address it knows for ``RetryPolicy.connect_timeout_s``, it
raises :class:`ServerUnreachable` (what the connection ran into, e.g. "connection
refused") instead of retrying for ``give_up_after_s``; a worker that goes away after
answering is retried as above (see ``retry``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from ssmserve.client.errors import (
    OwnerUnreachable,
    SessionMoved,
    SsmserveClientError,
    from_rpc_error,
    never_sent,
    server_unreachable,
)
from ssmserve.client.retry import Backoff, RetryPolicy
from ssmserve.client.stall_bound import NO_REPLY, replies_within
from ssmserve.client.tls import TlsConfig
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc

T = TypeVar("T")
#: Says when a call waits for a takeover (a WARNING: the caller sees a pause of seconds
#: and should know why; the CLI prints it on stderr).
log = logging.getLogger(__name__)
_RECONNECT_MS = 2000
#: Every call about one session names it in this header, so that a front (Envoy, Istio)
#: can route by a consistent hash of it and a session's calls land on one worker; the
#: redirects stay the fallback (see the README's deployment section).
SESSION_HEADER = "ssmserve-session-id"
# Reasons of UNAVAILABLE that mean "this worker cannot reach the store right now".
_STORE_TROUBLE = frozenset({"STORE_UNAVAILABLE", "STORE_OUTCOME_UNKNOWN", "STORE"})
# Codes a call may be retried on (elsewhere): the worker is gone, stopping or unreachable.
TRANSIENT = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
)
TRANSIENT_NUMBERS = frozenset(code.value[0] for code in TRANSIENT)


@dataclass
class WorkerStubs:
    """One worker's channel and stubs."""

    channel: grpc.aio.Channel
    sessions: pb_grpc.SessionServiceStub
    cluster: pb_grpc.ClusterServiceStub


class WorkerRouter:
    """The workers this client knows, where each session was last served, and the rules
    for going elsewhere after an error."""

    def __init__(
        self,
        addresses: list[str],
        retry: RetryPolicy,
        max_message_bytes: int,
        discover: bool,
        tls: TlsConfig | None = None,
        token: str | None = None,
    ) -> None:
        self.addresses = addresses
        self.tls = tls  # None: plaintext channels
        self.token = token  # sent as a bearer token with every call
        self.retry = retry
        self._max_message = max_message_bytes
        self._workers: dict[str, WorkerStubs] = {}
        self._owners: dict[str, str] = {}  # session id -> where it was last served
        # The workers marked unreachable, each with when (time.monotonic()) it was.
        self._unreachable: dict[str, float] = {}
        self.discover_pending = discover
        self.reached = False  # some worker has answered this client

    @property
    def first(self) -> str:
        return self.addresses[0]

    def worker(self, address: str) -> WorkerStubs:
        worker = self._workers.get(address)
        if worker is None:
            policy = self.retry
            options = [
                ("grpc.max_receive_message_length", self._max_message),
                ("grpc.max_send_message_length", self._max_message),
                ("grpc.keepalive_time_ms", int(policy.keepalive_time_s * 1000)),
                ("grpc.keepalive_timeout_ms", int(policy.keepalive_timeout_s * 1000)),
                # grpc >= 1.60 waits this long for a ping's answer (default 60 s).
                ("grpc.http2.ping_timeout_ms", int(policy.keepalive_timeout_s * 1000)),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0),
                # A connection attempt to a frozen worker gives up within seconds (the
                # default waits 20 s), and one that restarted is retried soon.
                ("grpc.min_reconnect_backoff_ms", _RECONNECT_MS),
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", _RECONNECT_MS),
            ]
            interceptors: list[Any] = [
                _DefaultDeadline(policy.call_timeout_s),
                _UnaryUnarySessionHeader(),
                _UnaryStreamSessionHeader(),
            ]
            if self.token:
                interceptors += _bearer_interceptors(self.token)
            if self.tls is None:
                channel = grpc.aio.insecure_channel(
                    address, options=options, interceptors=interceptors
                )
            else:
                channel = grpc.aio.secure_channel(
                    address, self.tls.credentials(), options=options, interceptors=interceptors
                )
            worker = WorkerStubs(
                channel, pb_grpc.SessionServiceStub(channel), pb_grpc.ClusterServiceStub(channel)
            )
            self._workers[address] = worker
        return worker

    def owner_of(self, session_id: str) -> str:
        """The worker this client last saw serving the session (or its first address)."""
        return self._owners.get(session_id, self.first)

    def remember_owner(self, session_id: str, address: str) -> None:
        """A worker said ``address`` serves ``session_id``."""
        self._owners[session_id] = address

    def served(self, session_id: str, address: str) -> None:
        """``address`` just answered for ``session_id``: it is reachable and the owner."""
        self.reached = True
        self._unreachable.pop(address, None)
        if session_id:
            self._owners[session_id] = address

    async def close(self) -> None:
        workers = list(self._workers.values())
        self._workers.clear()
        await asyncio.gather(*(w.channel.close() for w in workers), return_exceptions=True)

    def learn(self, address: str) -> None:
        if address and address not in self.addresses:
            self.addresses.append(address)

    def other(self, address: str) -> str:
        """The next known worker after ``address``, preferring reachable ones."""
        ring = self.addresses
        start = ring.index(address) + 1 if address in ring else 0
        ordered = ring[start:] + ring[:start]
        return next((a for a in ordered if a not in self._unreachable), ordered[0])

    def reachable(self, prefer: str = "") -> list[str]:
        """Known workers not marked unreachable, ``prefer`` first (all, if none is left)."""
        ordered = [prefer] if prefer in self.addresses else []
        ordered += [a for a in self.addresses if a != prefer]
        return [a for a in ordered if a not in self._unreachable] or ordered

    async def discover(self) -> None:
        """Learn the live workers' addresses from the cluster (best effort)."""
        self.discover_pending = False
        for address in self.reachable(self.first)[:2]:
            try:
                reply = await self.worker(address).cluster.ListWorkers(
                    pb.ListWorkersRequest(), timeout=2.0
                )
            except grpc.RpcError:
                continue
            self.reached = True
            for w in reply.workers:
                self.learn(w.address)
            return

    async def next_address(
        self,
        address: str,
        error: SsmserveClientError,
        backoff: Backoff,
        session_id: str = "",
    ) -> str:
        """Where to try after ``error`` at ``address``; raises it when retrying is over
        (or :class:`OwnerUnreachable` when a takeover was waited for in vain)."""
        if isinstance(error, SessionMoved):
            self.reached = True  # a worker answered: there is a cluster to wait for
            owner = error.owner
            if (
                owner
                and owner != address
                and owner not in self._unreachable
                and backoff.redirects < self.retry.max_redirects
            ):
                backoff.redirects += 1
                backoff.redirected_by, backoff.redirected_to = address, owner
                backoff.redirect_hint_ms = error.retry_after_ms
                self.learn(owner)
                return owner  # go there at once
            if backoff.expired():
                raise error
            if owner and owner in self._unreachable:
                if (
                    backoff.takeover_since is None
                    and self._unreachable[owner] < backoff.since
                    and await self._answers_again(owner, session_id)
                ):
                    # Given up on before this operation, and it answers now (restarted,
                    # or back from a pause): its lease is its own, so go there at once
                    # rather than wait it out.
                    backoff.redirects += 1
                    backoff.redirected_by, backoff.redirected_to = address, owner
                    return owner
                return await self._wait_for_takeover(address, error, backoff, session_id)
            await backoff.wait()
            return address
        if error.code not in TRANSIENT or backoff.expired():
            raise error
        if not error.reason:  # the worker itself is unreachable or stopping
            self._give_up_on(address)
            if not self.reached:  # nobody to ask for other workers, nothing to wait for
                if self._unreachable.keys() >= set(self.addresses) and (
                    backoff.elapsed() >= self.retry.connect_timeout_s
                ):
                    raise server_unreachable(list(self.addresses), error)
            elif self.discover_pending:
                await self.discover()
            via = backoff.redirected_by
            if address == backoff.redirected_to and via and via not in self._unreachable:
                # The owner a worker sent us to does not answer: that worker takes the
                # session over once the owner's lease runs out. Ask it again.
                self._start_takeover_wait(backoff, session_id, address, via)
                await backoff.wait(at_most_s=backoff.takeover_left())
                return via
            await backoff.wait()
            return self.other(address)
        await backoff.wait()
        if error.reason in _STORE_TROUBLE:
            # This worker cannot reach the store (a partition, or Redis is away): another
            # worker may, and takes the session over once this one's lease runs out.
            return self.other(address)
        return address  # e.g. the session is being reloaded there: same worker

    def _give_up_on(self, address: str) -> None:
        self._unreachable[address] = time.monotonic()

    async def _answers_again(self, address: str, session_id: str) -> bool:
        """Whether ``address``, marked unreachable, answers now: one GetSession within
        ``RetryPolicy.connect_timeout_s`` (any answer but a transient failure counts). A
        worker that died refuses the connection at once; a channel still waiting to
        reconnect fails at once too, and then the takeover is waited for as before."""
        request = pb.GetSessionRequest(session_id=session_id)
        try:
            await self.worker(address).sessions.GetSession(
                request, timeout=self.retry.connect_timeout_s
            )
        except grpc.RpcError as exc:
            if exc.code() in TRANSIENT:  # type: ignore[attr-defined]
                return False
        self._unreachable.pop(address, None)
        return True

    async def _wait_for_takeover(
        self, address: str, error: SessionMoved, backoff: Backoff, session_id: str
    ) -> str:
        """``address`` redirected to an owner that does not answer: wait (bounded by
        ``RetryPolicy.takeover_wait``, and saying so once) until its lease runs out and a
        worker may take the session over; where to ask then."""
        owner = error.owner
        if backoff.takeover_since is None:
            backoff.redirect_hint_ms = error.retry_after_ms
            self._start_takeover_wait(backoff, session_id, owner, address)
        left = backoff.takeover_left()
        if left <= 0:
            raise OwnerUnreachable(session_id, owner, address, backoff.takeover_bound_s)
        if backoff.waited_for == owner:
            # Its lease outlived our wait for it to run out: the owner renewed it, so it
            # is alive again (restarted, or back from a pause). Go there.
            self._unreachable.pop(owner, None)
            backoff.waited_for = ""
            backoff.redirects += 1
            backoff.redirected_by, backoff.redirected_to = address, owner
            return owner
        # The owner died or froze: its lease runs out in retry_after_ms, then any worker
        # (this one, or another reachable one) takes the session over.
        backoff.waited_for = owner
        wait_s = min(error.retry_after_ms / 1000, 10.0) + 0.005
        await backoff.wait(at_least_s=wait_s, at_most_s=left)
        return address if address not in self._unreachable else self.other(address)

    def _start_takeover_wait(self, backoff: Backoff, session_id: str, owner: str, via: str) -> None:
        """The owner of ``session_id`` does not answer: from now on, wait at most
        ``RetryPolicy.takeover_wait`` for ``via`` to take it over, and say so once."""
        if backoff.takeover_since is not None:
            return
        backoff.takeover_since = time.monotonic()
        backoff.takeover_bound_s = self.retry.takeover_wait(backoff.redirect_hint_ms)
        log.warning(
            "the owner %s of session %s does not answer; waiting up to %s s for %s to take "
            "it over",
            owner, session_id or "(unnamed)", seconds(backoff.takeover_bound_s), via,
        )  # fmt: skip

    async def call(
        self,
        invoke: Callable[[WorkerStubs], Awaitable[T]],
        session_id: str = "",
        idempotent: bool = True,
    ) -> T:
        """One request, following redirects; retried elsewhere only if ``idempotent``, or
        when it never reached a worker (the owner a redirect named does not answer: then
        the worker that redirected it is asked again until it takes the session over)."""
        backoff = Backoff(self.retry)
        address = self.owner_of(session_id) if session_id else self.first
        if address in self._unreachable:  # never start with a worker given up on
            address = self.other(address)
        while True:
            try:
                result = await invoke(self.worker(address))
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
                # A call that never reached the owner a redirect named cannot have been
                # done there: it may go on (to the worker that redirected it) as if it
                # were idempotent.
                unsent = address == backoff.redirected_to and never_sent(error)
                if not (idempotent or unsent or isinstance(error, SessionMoved)):
                    raise self.connection_failed(address, error) from None
                address = await self.next_address(address, error, backoff, session_id)
                continue
            self.served(session_id, address)
            return result

    def replies(self, call: Any) -> AsyncIterator[Any]:
        """A server-streaming call's replies, each within the policy's stall timeout
        (:func:`replies_within`)."""
        return replies_within(call, self.retry.stall_timeout_s)

    async def call_at(self, address: str, invoke: Callable[[WorkerStubs], Awaitable[T]]) -> T:
        """One request to one worker (``address``, or the first one): no redirect, no
        retry elsewhere; its error as a typed client error."""
        address = address or self.first
        try:
            result = await invoke(self.worker(address))
        except grpc.RpcError as exc:
            raise self.connection_failed(address, from_rpc_error(exc)) from None
        self.served("", address)
        return result

    def connection_failed(self, address: str, error: SsmserveClientError) -> SsmserveClientError:
        """``error`` of a call to ``address`` that is not retried: ServerUnreachable when
        it is a failed connection and no worker has answered this client yet (a call a
        worker took and then sent nothing for too long is a stall, not that)."""
        if (
            self.reached
            or error.reason
            or error.code not in TRANSIENT
            or error.message.startswith(NO_REPLY)
        ):
            return error
        return server_unreachable([address], error)

    async def locate(self, session_id: str, address: str) -> str:
        """The session's owner as the cluster reports it (``address`` if nobody holds it).

        Asks reachable workers only, each with a deadline: the one that just failed may
        be frozen, and a question to it would wait as long as it does.
        """
        request = pb.GetSessionRequest(session_id=session_id)
        for candidate in self.reachable()[:3]:
            try:
                info = await self.worker(candidate).sessions.GetSession(
                    request, timeout=min(self.retry.call_timeout_s, 5.0)
                )
            except grpc.RpcError as exc:
                if exc.code() in TRANSIENT:  # type: ignore[attr-defined]
                    self._give_up_on(candidate)
                    continue
                return address
            self.reached = True
            self._unreachable.pop(candidate, None)
            if info.owner and info.owner not in self._unreachable:
                return info.owner
            # Nobody holds it, or its owner is unreachable: this worker takes it over
            # (once the owner's lease runs out; its redirect says when).
            return candidate
        return self.other(address)


class _DefaultDeadline(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Gives every unary call without a deadline of its own the policy's deadline."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    async def intercept_unary_unary(
        self,
        continuation: Callable[[Any, Any], Awaitable[Any]],
        client_call_details: Any,
        request: Any,
    ) -> Any:
        if client_call_details.timeout is None:
            client_call_details = client_call_details._replace(timeout=self.timeout_s)
        return await continuation(client_call_details, request)


def seconds(value: float) -> str:
    """``value`` seconds for a message: to a tenth, without a trailing ``.0``."""
    return f"{value:.1f}".removesuffix(".0")


def session_metadata(session_id: str) -> tuple[tuple[str, str], ...]:
    """The :data:`SESSION_HEADER` of a call about ``session_id`` (none without one)."""
    return ((SESSION_HEADER, session_id),) if session_id else ()


def _with_session_header(details: Any, request: Any) -> Any:
    session_id = getattr(request, "session_id", "")
    metadata = list(details.metadata or ())
    if not session_id or any(key == SESSION_HEADER for key, _ in metadata):
        return details
    return details._replace(metadata=grpc.aio.Metadata(*metadata, (SESSION_HEADER, session_id)))


class _UnaryUnarySessionHeader(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Adds :data:`SESSION_HEADER` to a unary call whose request names a session (calls
    that stream their requests pass it themselves: their first message comes later)."""

    async def intercept_unary_unary(
        self, continuation: Callable[[Any, Any], Awaitable[Any]], details: Any, request: Any
    ) -> Any:
        return await continuation(_with_session_header(details, request), request)


class _UnaryStreamSessionHeader(grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(
        self, continuation: Callable[[Any, Any], Awaitable[Any]], details: Any, request: Any
    ) -> Any:
        return await continuation(_with_session_header(details, request), request)


class _BearerToken:
    """Sends ``authorization: Bearer <token>`` with every call (over TLS or loopback: a
    token on a plaintext network can be read by anyone on the path). grpc.aio files each
    interceptor under one kind of call only, so :func:`_bearer_interceptors` makes one
    of each kind."""

    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: Any) -> Any:
        metadata = [m for m in (details.metadata or ()) if m[0] != "authorization"]
        return details._replace(metadata=grpc.aio.Metadata(*metadata, self.header))


class _UnaryUnaryToken(_BearerToken, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(
        self, continuation: Callable[[Any, Any], Awaitable[Any]], details: Any, request: Any
    ) -> Any:
        return await continuation(self._with_token(details), request)


class _UnaryStreamToken(_BearerToken, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(
        self, continuation: Callable[[Any, Any], Awaitable[Any]], details: Any, request: Any
    ) -> Any:
        return await continuation(self._with_token(details), request)


class _StreamUnaryToken(_BearerToken, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(
        self, continuation: Callable[[Any, Any], Awaitable[Any]], details: Any, requests: Any
    ) -> Any:
        return await continuation(self._with_token(details), requests)


class _StreamStreamToken(_BearerToken, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_stream(
        self, continuation: Callable[[Any, Any], Awaitable[Any]], details: Any, requests: Any
    ) -> Any:
        return await continuation(self._with_token(details), requests)


def _bearer_interceptors(token: str) -> list[Any]:
    kinds = (_UnaryUnaryToken, _UnaryStreamToken, _StreamUnaryToken, _StreamStreamToken)
    return [kind(token) for kind in kinds]
