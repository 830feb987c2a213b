"""Who is calling: bearer tokens, their tenants and roles, and what each role may call.

``--auth-tokens FILE`` names a TOML file of tokens, each stored as its sha256 (the file
never holds a token, so reading it grants nothing)::

    [[token]]
    sha256 = "9f2c..."         # hex sha256 of the token's UTF-8 bytes
    tenant = "acme"            # 1-64 letters, digits, '.', '_' or '-'
    role = "client"            # client | operator | admin
    note = "robot fleet 7"     # optional

``ssmserve auth token --tenant T --role R --file F`` makes a token and appends its entry.
The file is read again when it changes (checked once a second) and on SIGHUP; a file
that cannot be read or parsed keeps the previous tokens and is logged.

Clients send ``authorization: Bearer <token>``. :class:`Authorization` (a grpc.aio server
interceptor) refuses a call without a known token (UNAUTHENTICATED) or whose role may not
call the method (PERMISSION_DENIED), before any handler runs; health checks and
reflection stay open for probes. Workers call each other's AdoptSession (and relay
Migrate and Drain) with the cluster secret (``--cluster-secret FILE``), in
``ssmserve-cluster-secret`` metadata, which counts as the ``worker`` role.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import logging
import re
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ssmserve.server.errors import SsmserveError
from ssmserve.v1 import ssmserve_pb2 as pb

log = logging.getLogger(__name__)

AUTHORIZATION_KEY = "authorization"
CLUSTER_SECRET_KEY = "ssmserve-cluster-secret"
TENANT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class Role(enum.Enum):
    CLIENT = "client"  # every session RPC, on its own tenant's sessions
    OPERATOR = "operator"  # read every tenant's sessions; move sessions, drain workers
    ADMIN = "admin"  # everything
    WORKER = "worker"  # another worker of the cluster (the cluster secret)


SESSION_SERVICE = "/ssmserve.v1.SessionService/"
CLUSTER_SERVICE = "/ssmserve.v1.ClusterService/"
_SESSION_RPCS = (
    "CreateSession", "GetSession", "ListSessions", "CloseSession", "Stream", "Snapshot",
    "ListSnapshots", "Rollback", "ExportCheckpoint", "ImportCheckpoint", "Forecast", "Fork",
    "GetHistory", "ListModels", "Upgrade", "Generate",
)  # fmt: skip
_READ_RPCS = ("GetSession", "ListSessions", "ListSnapshots", "GetHistory", "ListModels")
_CLUSTER_OPERATIONS = ("ListWorkers", "Migrate", "Drain", "Undrain")

#: Each role's methods (full gRPC names). Health and reflection are open to anyone.
ALLOWED: dict[Role, frozenset[str]] = {
    Role.CLIENT: frozenset(SESSION_SERVICE + m for m in _SESSION_RPCS),
    Role.OPERATOR: frozenset(
        [SESSION_SERVICE + m for m in _READ_RPCS]
        + [CLUSTER_SERVICE + m for m in _CLUSTER_OPERATIONS]
    ),
    Role.ADMIN: frozenset(
        [SESSION_SERVICE + m for m in _SESSION_RPCS]
        + [CLUSTER_SERVICE + m for m in (*_CLUSTER_OPERATIONS, "AdoptSession")]
        + [CLUSTER_SERVICE + m for m in ("LoadModel", "UnloadModel")]
    ),
    Role.WORKER: frozenset(
        [SESSION_SERVICE + m for m in _READ_RPCS]
        + [CLUSTER_SERVICE + m for m in (*_CLUSTER_OPERATIONS, "AdoptSession")]
    ),
}
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class TokenFileError(SsmserveError):
    """The token file cannot be read, or an entry in it is not what it must be."""


@dataclass(frozen=True)
class Principal:
    """The caller of one RPC, as its token says."""

    tenant: str  # '' for workers
    role: Role
    token_hash: str  # the sha256 (a handle for logs; never the token)

    @property
    def sees_every_tenant(self) -> bool:
        return self.role in (Role.OPERATOR, Role.ADMIN, Role.WORKER)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def parse_token_file(text: str, source: str = "token file") -> dict[str, Principal]:
    """sha256 -> principal, from the TOML text of a token file."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TokenFileError(f"{source}: not TOML: {exc}") from None
    entries = data.get("token", [])
    if not isinstance(entries, list):
        raise TokenFileError(f"{source}: 'token' must be an array of tables ([[token]])")
    principals: dict[str, Principal] = {}
    for i, entry in enumerate(entries, 1):
        where = f"{source}: token {i}"
        if not isinstance(entry, dict):
            raise TokenFileError(f"{where}: not a table")
        digest, tenant, role = entry.get("sha256"), entry.get("tenant"), entry.get("role")
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise TokenFileError(f"{where}: sha256 must be 64 lowercase hex digits")
        if not isinstance(tenant, str) or not TENANT_PATTERN.fullmatch(tenant):
            raise TokenFileError(f"{where}: tenant must be 1-64 letters, digits, '.', '_' or '-'")
        roles = [r.value for r in Role if r is not Role.WORKER]
        if role not in roles:
            raise TokenFileError(f"{where}: role must be one of {', '.join(roles)}")
        principals[digest] = Principal(tenant, Role(role), digest)
    return principals


def token_entry(digest: str, tenant: str, role: str, note: str = "") -> str:
    """One ``[[token]]`` table for a token file."""
    lines = ["", "[[token]]", f'sha256 = "{digest}"', f'tenant = "{tenant}"', f'role = "{role}"']
    if note:
        escaped = note.replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'note = "{escaped}"')
    return "\n".join(lines) + "\n"


class TokenFile:
    """The tokens of ``--auth-tokens``, read again when the file changes."""

    def __init__(self, path: Path, check_every_s: float = 1.0) -> None:
        self.path = path
        self.check_every_s = check_every_s
        self._stamp = self._stat()
        self.principals = parse_token_file(self._read(), str(path))
        self.loads = 1
        self._task: asyncio.Task[None] | None = None

    def lookup(self, token: str) -> Principal | None:
        return self.principals.get(token_hash(token))

    def reload(self, force: bool = False) -> bool:
        """Read the file again if it changed (or ``force``); True if the tokens changed.
        A file that cannot be used keeps the tokens as they were."""
        try:
            stamp = self._stat()
            if stamp == self._stamp and not force:
                return False
            principals = parse_token_file(self._read(), str(self.path))
        except TokenFileError as exc:
            log.warning("auth tokens not reloaded (the previous ones stay): %s", exc)
            return False
        self._stamp, self.principals = stamp, principals
        self.loads += 1
        log.info("auth tokens reloaded from %s: %d tokens", self.path, len(principals))
        return True

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="auth-token-file")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.check_every_s)
            self.reload()

    def _stat(self) -> tuple[int, int]:
        try:
            st = self.path.stat()
        except OSError as exc:
            raise TokenFileError(f"{self.path}: {exc.strerror or exc}") from None
        return st.st_mtime_ns, st.st_size

    def _read(self) -> str:
        try:
            return self.path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenFileError(f"{self.path}: {exc}") from None


class Authenticator:
    """Tokens and the cluster secret -> the caller of an RPC."""

    def __init__(self, tokens: TokenFile | None, cluster_secret: bytes | None) -> None:
        self.tokens = tokens
        self.cluster_secret = cluster_secret

    @property
    def enabled(self) -> bool:
        return self.tokens is not None

    def principal(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> Principal | None:
        """Who the metadata says is calling; None if nobody known."""
        found = dict(metadata or ())
        secret = found.get(CLUSTER_SECRET_KEY)
        if secret is not None and self.cluster_secret is not None:
            given = secret.encode() if isinstance(secret, str) else secret
            if hmac.compare_digest(given, self.cluster_secret):
                return Principal("", Role.WORKER, "cluster-secret")
            return None
        value = found.get(AUTHORIZATION_KEY)
        if self.tokens is None or not isinstance(value, str):
            return None
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return self.tokens.lookup(token.strip())


def peer_metadata(cluster_secret: bytes | None) -> tuple[tuple[str, str], ...]:
    """What a worker sends with its calls to other workers."""
    return ((CLUSTER_SECRET_KEY, cluster_secret.decode()),) if cluster_secret else ()


class Authorization(grpc.aio.ServerInterceptor):
    """Every RPC but health and reflection needs a known token whose role allows it."""

    def __init__(self, authenticator: Authenticator) -> None:
        self.authenticator = authenticator

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = details.method  # type: ignore[attr-defined]
        handler = await continuation(details)
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        who = self.authenticator.principal(details.invocation_metadata)  # type: ignore[attr-defined]
        if who is None:
            return _refusal(
                handler,
                grpc.StatusCode.UNAUTHENTICATED,
                "a known token is needed: send 'authorization: Bearer <token>'",
            )
        if method not in ALLOWED[who.role]:
            return _refusal(
                handler,
                grpc.StatusCode.PERMISSION_DENIED,
                f"role {who.role.value} may not call {method.rsplit('/', 1)[-1]}",
            )
        return handler


def caller(authenticator: Authenticator, context: grpc.aio.ServicerContext) -> Principal | None:
    """The caller of the RPC ``context`` belongs to (None when auth is off)."""
    if not authenticator.enabled:
        return None
    return authenticator.principal(context.invocation_metadata())


#: Requests a refused client-streaming call reads (and drops) before it answers.
_DRAIN_MESSAGES = 2048


def _refusal(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that refuses the call with ``code``.

    Unary requests are refused at once. A call whose client streams requests is refused
    only once the client has finished writing (or after ``_DRAIN_MESSAGES``), since grpcio
    turns a status sent while the client still writes into INTERNAL, its cause lost; a
    Stream call answers each step with a StepError carrying ``code``, as the contract
    does for every per-step problem, and ends when the client does.
    """
    parse, render = handler.request_deserializer, handler.response_serializer

    async def unary(_request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    async def unary_stream(
        _request: object, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[None]:
        await context.abort(code, message)
        yield  # an async generator (abort raises before this)

    async def stream_unary(requests: AsyncIterator[object], context: Any) -> None:
        count = 0
        async for _ in requests:
            count += 1
            if count >= _DRAIN_MESSAGES:
                break
        await context.abort(code, message)

    async def stream_stream(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StreamResponse]:
        error = pb.StepError(code=code.value[0], reason=code.name, message=message)
        async for request in requests:
            steps = getattr(request, "steps", ())
            yield pb.StreamResponse(
                results=[
                    pb.StepResult(session_id=s.session_id, step=s.step, error=error) for s in steps
                ]
            )
        await context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream_stream, parse, render)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(stream_unary, parse, render)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(unary_stream, parse, render)
    return grpc.unary_unary_rpc_method_handler(unary, parse, render)


def load_cluster_secret(path: Path | None) -> bytes | None:
    return None if path is None else load_secret(path, "cluster secret")


def load_secret(path: Path, what: str) -> bytes:
    """A shared secret from a file (surrounding whitespace dropped; 16 bytes at least)."""
    try:
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise TokenFileError(f"{what} {path}: {exc.strerror or exc}") from None
    if len(secret) < 16:
        raise TokenFileError(f"{what} {path}: use at least 16 random characters")
    return secret
