"""Which Redis the store talks to, read from its URL: one server, a Redis Cluster, or a
master watched by Sentinel.

    redis://[USER:PASS@]HOST:PORT[/DB]                 one server (``rediss://`` for TLS,
    unix:///path/to/redis.sock                         ``unix://`` for a socket)
    redis+cluster://[USER:PASS@]HOST:PORT[,HOST:PORT]  a Redis Cluster, from seed nodes
    redis+sentinel://[USER:PASS@]HOST:PORT[,HOST:PORT]/MASTER_NAME
                                                       the master Sentinel names

``rediss+cluster://`` and ``rediss+sentinel://`` use TLS. Query options, all optional:
``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile`` (TLS files); with Sentinel,
``sentinel_username`` and ``sentinel_password`` when the sentinels have their own auth
(the user and password in front of the hosts are the master's).

Every client made here never retries a command after a connection error (``retry``
off): a write whose answer was lost has an unknown outcome, which the store reports rather
than guesses. Redirections that say a command was *not* run (MOVED, ASK, TRYAGAIN) are
followed by redis-py's cluster client and, past its own attempts, by ``StoreCalls._call``.

Deadlines (:func:`keeps_socket_timeout`). On one server and behind Sentinel,
``StoreCalls._call`` bounds every operation with its own ``asyncio.timeout`` (the whole
operation: pool, connect, send, answer), and that is the only bound on sending and
reading: redis-py's ``socket_timeout`` wraps every write in ``asyncio.wait_for``, a task
and an event-loop turn per command (without it a lone session's step costs ~10-16% less
server CPU: ``bench/bench_service.py``). Cancelling a command mid-way is safe
there: redis-py drops the connection when a send or a read is interrupted by any exception
(since its fix of CVE-2023-28858, long before the 5.0 we require), so a late answer is
never read as the next command's
(``test_store.test_an_answer_held_past_the_deadline_is_never_read_as_a_later_one``).
A Redis Cluster client keeps ``socket_timeout`` and gets no deadline of ours around it:
its own timeout error is what makes redis-py forget a dead node and read the cluster's
slots again, which a cancellation could cut short.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qs, unquote

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

from ssmserve.server.errors import SsmserveError, clip

Kind = Literal["single", "cluster", "sentinel"]

_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


class BadRedisUrlError(SsmserveError, ValueError):
    """A ``--redis-url`` this module cannot read."""


@dataclass(frozen=True)
class RedisUrl:
    """A parsed multi-host URL (``redis+cluster://`` and ``redis+sentinel://``)."""

    kind: Kind
    tls: bool
    hosts: tuple[tuple[str, int], ...]
    username: str | None
    password: str | None
    master_name: str  # Sentinel only
    options: dict[str, str]

    @classmethod
    def parse(cls, url: str) -> RedisUrl:
        scheme, sep, rest = url.partition("://")
        kind, tls = topology_of(url), scheme.startswith("rediss")
        if not sep or kind == "single" or scheme.partition("+")[0] not in ("redis", "rediss"):
            raise BadRedisUrlError(f"not a cluster or sentinel URL: {clip(url)}")
        rest, _, query = rest.partition("?")
        netloc, _, path = rest.partition("/")
        userinfo, at, hostlist = netloc.rpartition("@")
        if not at:
            hostlist = netloc
        username = password = None
        if userinfo:
            user, colon, secret = userinfo.partition(":")
            username, password = (unquote(user) or None), (unquote(secret) if colon else None)
        hosts = []
        for item in hostlist.split(","):
            host, colon, port = item.strip().rpartition(":")
            if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise BadRedisUrlError(
                    f"{clip(item)!r} in {scheme}:// is not HOST:PORT (give each node as "
                    f"HOST:PORT, separated by commas)"
                )
            hosts.append((host.strip("[]"), int(port)))
        master_name = unquote(path.strip("/"))
        if kind == "sentinel" and not master_name:
            raise BadRedisUrlError(
                f"{scheme}:// needs the master's name after the hosts: "
                f"{scheme}://HOST:PORT[,HOST:PORT]/MASTER_NAME"
            )
        if kind == "cluster" and master_name:
            raise BadRedisUrlError(
                "a Redis Cluster has one database and no master name: drop the path "
                f"{clip(path)!r} from the URL"
            )
        options = {k: v[-1] for k, v in parse_qs(query).items()}
        known = (*_TLS_OPTIONS, "sentinel_username", "sentinel_password")
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise BadRedisUrlError(
                f"unknown option {clip(unknown[0])!r} in the Redis URL (known: {', '.join(known)})"
            )
        return cls(kind, tls, tuple(hosts), username, password, master_name, options)


def topology_of(url: str) -> Kind:
    """What kind of Redis ``url`` names."""
    scheme = url.partition("://")[0]
    if scheme.endswith("+cluster"):
        return "cluster"
    if scheme.endswith("+sentinel"):
        return "sentinel"
    return "single"


def keeps_socket_timeout(kind: Kind) -> bool:
    """Whether the client for ``kind`` bounds its own reads and writes (a cluster: its
    recovery from a dead node starts from its timeout error); the others' commands must run
    under a deadline of the caller's (``StoreCalls._until_run``)."""
    return kind == "cluster"


#: Connections a worker's client opens to one Redis server at most (its pool, per node
#: on a cluster). Each store call holds one for its duration, so this bounds the calls in
#: flight at once; a call past it fails at once as UNAVAILABLE ("Too many connections").
#: redis-py 8's default, 100, is below a burst of ~110 concurrent CreateSession calls
#: (test_bad_input's paging test, beside CPU load). Redis's own maxclients is 10,000 by
#: default: room for several workers at this bound.
MAX_CONNECTIONS = 1024


def connect(url: str, timeout_s: float) -> aioredis.Redis | RedisCluster:
    """A client for ``url`` (see the module docstring), not connected yet."""
    kind = topology_of(url)
    common: dict[str, Any] = {
        "decode_responses": False,
        "socket_timeout": timeout_s if keeps_socket_timeout(kind) else None,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),  # a lost answer is an unknown outcome, not a retry
        "max_connections": MAX_CONNECTIONS,
    }
    if kind == "single":
        return aioredis.Redis.from_url(url, **common)
    parsed = RedisUrl.parse(url)
    tls: dict[str, Any] = {}
    if parsed.tls:
        tls = {"ssl": True} | {k: parsed.options[k] for k in _TLS_OPTIONS if k in parsed.options}
    auth = {"username": parsed.username, "password": parsed.password}
    if kind == "cluster":
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in parsed.hosts],
            require_full_coverage=True,
            **common,
            **auth,
            **tls,
        )
    sentinel_kwargs: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "username": parsed.options.get("sentinel_username"),
        "password": parsed.options.get("sentinel_password"),
    } | tls
    sentinel = Sentinel(list(parsed.hosts), sentinel_kwargs=sentinel_kwargs)
    return sentinel.master_for(
        parsed.master_name, redis_class=aioredis.Redis, **common, **auth, **tls
    )
