"""``ssmserve-server``: run one worker until SIGTERM or SIGINT.

    ssmserve-server --model NAME=DIR [--model ...] [--listen HOST:PORT] [--redis-url URL]
                    [--data-dir DIR] [--advertise HOST:PORT] [--lease-ttl S]
                    [--redis-timeout S] [--keepalive S] [--keepalive-timeout S]
                    [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]]
                    [--auth-tokens FILE] [--cluster-secret FILE] [--insecure]
                    [--checkpoint-key FILE [--require-signed-checkpoints]] [--demo]
                    [--workers N]

Every flag has an environment variable, used when the flag is absent:
``SSMSERVE_MODELS`` (``name=dir,name=dir``), ``SSMSERVE_LISTEN``, ``SSMSERVE_REDIS_URL``,
``SSMSERVE_DATA_DIR``, ``SSMSERVE_ADVERTISE``, ``SSMSERVE_LEASE_TTL``,
``SSMSERVE_REDIS_TIMEOUT``, ``SSMSERVE_KEEPALIVE``, ``SSMSERVE_KEEPALIVE_TIMEOUT``,
``SSMSERVE_TLS_CERT``, ``SSMSERVE_TLS_KEY``, ``SSMSERVE_TLS_CLIENT_CA``,
``SSMSERVE_AUTH_TOKENS``, ``SSMSERVE_CLUSTER_SECRET``, ``SSMSERVE_INSECURE=1``,
``SSMSERVE_CHECKPOINT_KEY``, ``SSMSERVE_REQUIRE_SIGNED_CHECKPOINTS=1``.
Without ``--auth-tokens`` the worker serves loopback addresses only, unless
``--insecure``. SIGHUP reads the token file again.
Without a Redis URL the worker starts a private redis-server (AOF on) in
``DATA_DIR/redis`` and stops it on exit. Workers that share one Redis form a cluster:
sessions move between them.

SIGTERM or SIGINT drains the worker (its sessions move to the other live workers, or are
snapshotted for later pickup when none is left), then stops it.

``--workers N`` (N >= 2) runs N worker processes on PORT..PORT+N-1 under one supervisor
process that owns the embedded Redis, restarts a worker that dies and drains them all
on SIGTERM (``ssmserve.server.supervisor``).

``--demo`` also serves the demo signal model as ``demo`` (written once to
``DATA_DIR/models/demo``; ``--demo mamba2``: a signal Mamba-2, in ``demo-mamba2``).
When the server is ready it prints one line, ``ssmserve-server listening on
HOST:PORT``, on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from ssmserve.server.api.auth import load_secret
from ssmserve.server.api.budgets import BudgetSettings
from ssmserve.server.api.service import ServiceSettings
from ssmserve.server.api.tls import TlsSettings
from ssmserve.server.cluster.ownership import OwnershipSettings
from ssmserve.server.engine.demo import ARCHS, DemoSpec, demo_config, random_tensors
from ssmserve.server.engine.interface import ENGINES
from ssmserve.server.engine.loader import CONFIG_FILE, save_model
from ssmserve.server.engine.quantize import QUANTIZATIONS
from ssmserve.server.errors import SsmserveError
from ssmserve.server.http.listener import HttpSettings
from ssmserve.server.observability.garbage_collector import (
    PYTHON_DEFAULT_YOUNG,
    GcSettings,
    ServingGc,
)
from ssmserve.server.observability.logs import JsonFormatter
from ssmserve.server.observability.logs import configure as configure_logging
from ssmserve.server.sessions.config import SessionDefaults
from ssmserve.server.sessions.manager import ManagerSettings
from ssmserve.server.sessions.models import KEY_PATTERN
from ssmserve.server.sessions.rebalance import RebalanceSettings
from ssmserve.server.sessions.stepper import MAX_BATCH_TOKENS, StepperSettings
from ssmserve.server.state.redis_topology import BadRedisUrlError, RedisUrl, topology_of
from ssmserve.server.supervisor import MAX_WORKERS, SupervisorSettings, supervise
from ssmserve.server.worker import Worker, WorkerSettings

log = logging.getLogger("ssmserve.server")


def _model_arg(text: str) -> tuple[str, Path]:
    name, sep, directory = text.partition("=")
    if not sep or not name or not directory:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR or NAME@VERSION=DIR, got {text!r}")
    if not KEY_PATTERN.fullmatch(name):
        raise argparse.ArgumentTypeError(
            f"{name!r}: a model is NAME or NAME@VERSION, each of letters, digits, '.', '_' "
            f"or '-' (at most 64)"
        )
    return name, Path(directory)


def _wait_replicas_arg(text: str) -> int | None:
    """``--redis-wait-replicas``: ``auto`` (None) or a number of replicas, 0..16."""
    if text.strip().lower() == "auto":
        return None
    if not text.strip().isdigit() or not 0 <= int(text) <= 16:
        raise argparse.ArgumentTypeError(f"must be auto or a number 0..16, got {text[:40]!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="ssmserve-server", description="Serve stateful SSM sessions over gRPC."
    )
    parser.add_argument(
        "--model",
        action="append",
        type=_model_arg,
        default=[],
        metavar="NAME[@VERSION]=DIR",
        help="a model to serve (repeatable; several versions of a name may be served: new "
        "sessions take the newest unless they name one, and each session stays on its "
        "version); env SSMSERVE_MODELS=name=dir,name@2=dir",
    )
    parser.add_argument(
        "--listen",
        default=env("SSMSERVE_LISTEN", "127.0.0.1:50051"),
        metavar="HOST:PORT",
        help="where to serve gRPC; port 0 picks a free one (default 127.0.0.1:50051; env "
        "SSMSERVE_LISTEN)",
    )
    parser.add_argument(
        "--redis-url",
        default=env("SSMSERVE_REDIS_URL"),
        help="external Redis: redis://[USER:PASS@]HOST:PORT/DB (rediss:// for TLS), "
        "redis+cluster://HOST:PORT[,HOST:PORT...] (Redis Cluster seed nodes) or "
        "redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER_NAME (Sentinel); default: start a "
        "private redis-server (env SSMSERVE_REDIS_URL)",
    )
    parser.add_argument(
        "--redis-wait-replicas",
        type=_wait_replicas_arg,
        default=env("SSMSERVE_REDIS_WAIT_REPLICAS", "auto"),
        metavar="auto|N",
        help="wait until N replicas hold every write (Redis WAIT) before it counts: "
        "acknowledged steps then survive a master failover, at the cost of a replication "
        "round trip per write; fewer replicas in time reloads the session. auto (the "
        "default): every replica the master(s) have at start (a Sentinel master, Cluster "
        "masters: the fewest any master has), none where there are none; 0 opts out (on "
        "Redis Cluster, replicas of the master that holds the session; env "
        "SSMSERVE_REDIS_WAIT_REPLICAS)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=int(env("SSMSERVE_WORKERS", "1")),
        metavar="N",
        help="run N worker processes on ports PORT..PORT+N-1 of --listen (and of "
        "--advertise), under one supervisor that owns the embedded Redis, restarts a "
        "worker that dies and drains them all on SIGTERM; one process per core it should "
        "use (default 1; env SSMSERVE_WORKERS)",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path(env("SSMSERVE_DATA_DIR", "ssmserve-data")),
        help="the embedded Redis's data and the demo model (default ./ssmserve-data; env "
        "SSMSERVE_DATA_DIR)",
    )
    parser.add_argument(
        "--advertise",
        default=env("SSMSERVE_ADVERTISE", ""),
        help="address other workers and clients reach this one at (default: the bound one)",
    )
    parser.add_argument(
        "--lease-ttl",
        type=float,
        default=float(env("SSMSERVE_LEASE_TTL", "5")),
        metavar="S",
        help="session lease and worker heartbeat TTL in seconds: how long a crashed "
        "worker's sessions wait before another worker takes them over (default 5)",
    )
    parser.add_argument(
        "--redis-timeout",
        type=float,
        default=float(env("SSMSERVE_REDIS_TIMEOUT", "2")),
        metavar="S",
        help="deadline of every Redis operation (a command or a pipeline) in seconds; a "
        "write that gets no answer in time has an unknown outcome and its session is "
        "reloaded from Redis (default 2)",
    )
    parser.add_argument(
        "--keepalive",
        type=float,
        default=float(env("SSMSERVE_KEEPALIVE", "5")),
        metavar="S",
        help="gRPC keepalive: ping a client connection after S seconds without news and "
        "close it (ending its streams) when no answer comes within --keepalive-timeout",
    )
    parser.add_argument(
        "--keepalive-timeout",
        type=float,
        default=float(env("SSMSERVE_KEEPALIVE_TIMEOUT", "3")),
        metavar="S",
        help="seconds a keepalive ping may go unanswered (default 3)",
    )
    parser.add_argument(
        "--tls-cert",
        type=Path,
        default=env("SSMSERVE_TLS_CERT"),
        metavar="FILE",
        help="PEM certificate chain: the listener speaks TLS only (needs --tls-key); "
        "the files are read again when they change, without a restart",
    )
    parser.add_argument(
        "--tls-key", type=Path, default=env("SSMSERVE_TLS_KEY"), metavar="FILE",
        help="PEM private key of --tls-cert",
    )  # fmt: skip
    parser.add_argument(
        "--tls-client-ca",
        type=Path,
        default=env("SSMSERVE_TLS_CLIENT_CA"),
        metavar="FILE",
        help="PEM CA: every client (and worker) must present a certificate it signed "
        "(mTLS); other workers' listeners are trusted through it too",
    )
    parser.add_argument(
        "--auth-tokens",
        type=Path,
        default=env("SSMSERVE_AUTH_TOKENS"),
        metavar="FILE",
        help="TOML file of token hashes, tenants and roles (make tokens with 'ssmserve auth "
        "token'); every RPC but health then needs 'authorization: Bearer <token>'. Read "
        "again when it changes and on SIGHUP",
    )
    parser.add_argument(
        "--cluster-secret",
        type=Path,
        default=env("SSMSERVE_CLUSTER_SECRET"),
        metavar="FILE",
        help="file holding a secret every worker of the cluster shares: workers send it "
        "with their calls to each other (hand-offs, relayed drains)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        default=env("SSMSERVE_INSECURE", "") == "1",
        help="serve a non-loopback address without --auth-tokens (anyone who reaches it "
        "can call every RPC); refused otherwise",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default=env("SSMSERVE_ENGINE", "cpu"),
        help="what steps the models: cpu (default; numpy + numba) or cuda (Triton kernels "
        "on a GPU: pip install 'ssmserve[cuda]'); refused at start where it cannot run. "
        "Sessions never replay across engines (env SSMSERVE_ENGINE)",
    )
    parser.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        default=env("SSMSERVE_QUANTIZE", "none"),
        help="how the cpu engine holds the models' product weights: none (default; at "
        "their stored precision, BF16 kept 16-bit) or q8_0 (llama.cpp's blocks of 32 int8 "
        "with a float16 scale, quantised at load: ~1.1 bytes a parameter). A Q8_0 model "
        "has its own fingerprint: sessions never replay across formats (env SSMSERVE_QUANTIZE)",
    )
    parser.add_argument(
        "--allow-evicting-redis",
        action="store_true",
        default=env("SSMSERVE_ALLOW_EVICTING_REDIS", "") == "1",
        help="serve even though Redis's maxmemory-policy is not noeviction (a warning "
        "instead of a refusal): such a Redis deletes session keys, leases and registry "
        "entries when it fills up, so acknowledged steps may vanish (env "
        "SSMSERVE_ALLOW_EVICTING_REDIS=1)",
    )
    parser.add_argument(
        "--checkpoint-key",
        type=Path,
        default=env("SSMSERVE_CHECKPOINT_KEY"),
        metavar="FILE",
        help="HMAC key (16+ bytes) that signs every exported checkpoint; imports signed "
        "with another key are refused",
    )
    parser.add_argument(
        "--require-signed-checkpoints",
        action="store_true",
        default=env("SSMSERVE_REQUIRE_SIGNED_CHECKPOINTS", "") == "1",
        help="import only checkpoints signed with --checkpoint-key",
    )
    defaults = BudgetSettings()
    for flag, attr, what in (
        ("--tenant-sessions", "sessions_per_tenant", "stored sessions per tenant"),
        ("--tenant-imports", "imports_per_tenant", "imports one tenant runs at once here"),
        ("--tenant-forecasts", "forecasts_per_tenant", "forecasts one tenant runs at once here"),
        ("--import-buffer", "import_buffer_bytes", "bytes of checkpoints received at once here"),
        (
            "--tenant-resident-bytes",
            "resident_bytes_per_tenant",
            "bytes one tenant's sessions resident here may hold (0: no per-tenant bound)",
        ),
    ):
        variable = "SSMSERVE_" + flag.removeprefix("--").replace("-", "_").upper()
        parser.add_argument(
            flag,
            type=int,
            default=int(env(variable, str(getattr(defaults, attr)))),
            metavar="N",
            dest=attr,
            help=f"budget: {what} (default {getattr(defaults, attr):,}; env {variable})",
        )
    parser.add_argument(
        "--rebalance-every",
        type=float,
        default=float(env("SSMSERVE_REBALANCE_EVERY", "0")),
        metavar="S",
        help="every S seconds (jittered), hand sessions to a worker holding at least 2 "
        "fewer, down to the cluster's mean and at most 4 per round: sessions spread over "
        "workers as they join (default 0: off; env SSMSERVE_REBALANCE_EVERY)",
    )
    parser.add_argument(
        "--spread-snapshots",
        action="store_true",
        default=env("SSMSERVE_SPREAD_SNAPSHOTS", "") == "1",
        help="a session that does not choose a snapshot phase gets a random one, so sessions "
        "created together do not all snapshot on the same tick (default: phase 0, snapshots "
        "at multiples of snapshot_every; env SSMSERVE_SPREAD_SNAPSHOTS=1)",
    )
    parser.add_argument(
        "--memory-budget",
        type=int,
        default=int(env("SSMSERVE_MEMORY_BUDGET", "0")),
        metavar="BYTES",
        help="what this worker may hold for resident sessions (at their bounds), running "
        "forecasts and imports being decoded, all together; past it they are refused "
        "(default 0: three quarters of the machine's memory; env SSMSERVE_MEMORY_BUDGET)",
    )
    stepper = StepperSettings()
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=int(env("SSMSERVE_MAX_BATCH_TOKENS", str(stepper.max_batch_tokens))),
        metavar="N",
        help="steps one stepper batch computes: decode steps first, then prompt chunks fill "
        "what is left (vLLM's chunked prefill); lower keeps the sessions that decode beside "
        f"a long prompt faster, higher prefills it sooner (default {stepper.max_batch_tokens}; "
        "env SSMSERVE_MAX_BATCH_TOKENS)",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=int(env("SSMSERVE_PREFILL_CHUNK", str(stepper.prefill_chunk))),
        metavar="N",
        help=f"the most prompt steps one session prefills per batch, at least "
        f"{stepper.prefill_min_steps} (default {stepper.prefill_chunk}; env "
        "SSMSERVE_PREFILL_CHUNK)",
    )
    parser.add_argument(
        "--prefill-share",
        type=float,
        default=float(env("SSMSERVE_PREFILL_SHARE", str(stepper.prefill_share))),
        metavar="F",
        help="the share of the stepper's time prompts' prefill takes while other sessions "
        "decode: after a chunk beside them prefill pauses so that theirs is the rest; 1 "
        f"never pauses (default {stepper.prefill_share}; env SSMSERVE_PREFILL_SHARE)",
    )
    parser.add_argument(
        "--demo",
        nargs="?",
        const="mamba",
        choices=ARCHS,
        metavar="ARCH",
        help="also serve the demo signal model as 'demo': a Mamba (default) or, with "
        "--demo mamba2, a Mamba-2",
    )
    parser.add_argument(
        "--log-level",
        default=env("SSMSERVE_LOG_LEVEL", "INFO"),
        help="DEBUG, INFO, WARNING or ERROR (default INFO; env SSMSERVE_LOG_LEVEL)",
    )
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=env("SSMSERVE_LOG_FORMAT", "text"),
        help="text for people, json for one object per line with worker id, session id, "
        "step, lease token and tenant (default text; env SSMSERVE_LOG_FORMAT)",
    )
    parser.add_argument(
        "--trace-otlp-endpoint",
        default=env("SSMSERVE_TRACE_OTLP_ENDPOINT", ""),
        metavar="URL",
        help="send OpenTelemetry spans (RPCs, engine batches, Redis writes) to this OTLP/gRPC "
        "collector, e.g. http://localhost:4317; needs pip install 'ssmserve[tracing]' "
        "(default: off; env SSMSERVE_TRACE_OTLP_ENDPOINT)",
    )
    parser.add_argument(
        "--gc-young-threshold",
        type=int,
        default=int(env("SSMSERVE_GC_YOUNG_THRESHOLD", str(GcSettings.young_threshold))),
        metavar="N",
        help="net allocations between young garbage collections while serving (default "
        f"{GcSettings.young_threshold:,}; Python's own is {PYTHON_DEFAULT_YOUNG}, which "
        "makes a busy worker walk its whole heap again and again); 0 leaves Python's "
        "settings and does not freeze the startup heap (env SSMSERVE_GC_YOUNG_THRESHOLD)",
    )
    parser.add_argument(
        "--metrics-listen",
        default=env("SSMSERVE_METRICS_LISTEN", ""),
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off; env "
        "SSMSERVE_METRICS_LISTEN)",
    )
    http = HttpSettings()
    parser.add_argument(
        "--http",
        default=env("SSMSERVE_HTTP", ""),
        metavar="HOST:PORT",
        help="also serve the OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models) at http://HOST:PORT/v1, with the same tokens "
        "(default: off; env SSMSERVE_HTTP)",
    )
    parser.add_argument(
        "--http-prefix-cache",
        type=int,
        default=int(env("SSMSERVE_HTTP_PREFIX_CACHE", str(http.prefix_cache))),
        metavar="N",
        help="sessions of recent HTTP requests kept per tenant and model, continued by a "
        "request whose prompt extends one (a chat's next turn); 0: none (default "
        f"{http.prefix_cache}; env SSMSERVE_HTTP_PREFIX_CACHE)",
    )
    parser.add_argument(
        "--http-max-requests",
        type=int,
        default=int(env("SSMSERVE_HTTP_MAX_REQUESTS", str(http.max_requests))),
        metavar="N",
        help="HTTP requests running at once (streams until they end); past it a 429 "
        f"(default {http.max_requests}; env SSMSERVE_HTTP_MAX_REQUESTS)",
    )
    return parser


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    models: list[tuple[str, Path]] = list(args.model)
    if not models and os.environ.get("SSMSERVE_MODELS"):
        models = [_model_arg(item.strip()) for item in os.environ["SSMSERVE_MODELS"].split(",")]
    if args.demo:
        folder = "demo" if args.demo == "mamba" else f"demo-{args.demo}"
        models.append(("demo", ensure_demo_model(args.data_dir / "models" / folder, args.demo)))
    names = [name for name, _ in models]
    if not models:
        raise SystemExit(
            "ssmserve-server: error: no model to serve (use --model NAME=DIR or --demo)"
        )
    if len(set(names)) != len(names):
        raise SystemExit(f"ssmserve-server: error: model names repeat: {', '.join(names)}")
    if not 0.1 <= args.lease_ttl <= 600:
        raise SystemExit("ssmserve-server: error: --lease-ttl must be between 0.1 and 600 s")
    if not 0.05 <= args.redis_timeout <= 60:
        raise SystemExit("ssmserve-server: error: --redis-timeout must be between 0.05 and 60 s")
    if args.redis_wait_replicas and not args.redis_url:
        raise SystemExit(
            "ssmserve-server: error: --redis-wait-replicas needs --redis-url (the embedded "
            "Redis has no replicas)"
        )
    if args.redis_url:
        try:
            if topology_of(args.redis_url) != "single":
                RedisUrl.parse(args.redis_url)
        except BadRedisUrlError as exc:
            raise SystemExit(f"ssmserve-server: error: --redis-url: {exc}") from None
    if not (0.1 <= args.keepalive <= 3600 and 0.1 <= args.keepalive_timeout <= 600):
        raise SystemExit(
            "ssmserve-server: error: --keepalive must be 0.1..3600 s, --keepalive-timeout "
            "0.1..600 s"
        )
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise SystemExit("ssmserve-server: error: TLS needs both --tls-cert and --tls-key")
        tls = TlsSettings(
            Path(args.tls_cert),
            Path(args.tls_key),
            Path(args.tls_client_ca) if args.tls_client_ca else None,
        )
    elif args.tls_client_ca:
        raise SystemExit("ssmserve-server: error: --tls-client-ca needs --tls-cert and --tls-key")
    if not (args.rebalance_every == 0 or 1 <= args.rebalance_every <= 3600):
        raise SystemExit("ssmserve-server: error: --rebalance-every must be 0 (off) or 1..3600 s")
    if args.memory_budget < 0:
        raise SystemExit("ssmserve-server: error: --memory-budget must be 0 (auto) or more")
    least = StepperSettings.prefill_min_steps
    if not 1 <= args.max_batch_tokens <= MAX_BATCH_TOKENS:
        raise SystemExit(
            f"ssmserve-server: error: --max-batch-tokens must be 1..{MAX_BATCH_TOKENS}, got "
            f"{args.max_batch_tokens}"
        )
    if not least <= args.prefill_chunk <= MAX_BATCH_TOKENS:
        raise SystemExit(
            f"ssmserve-server: error: --prefill-chunk must be {least}..{MAX_BATCH_TOKENS} "
            f"(a shorter run is stepped, not prefilled), got {args.prefill_chunk}"
        )
    if not 0.01 <= args.prefill_share <= 1:
        raise SystemExit(
            f"ssmserve-server: error: --prefill-share must be 0.01..1, got {args.prefill_share}"
        )
    if args.require_signed_checkpoints and not args.checkpoint_key:
        raise SystemExit(
            "ssmserve-server: error: --require-signed-checkpoints needs --checkpoint-key"
        )
    if not 0 <= args.http_prefix_cache <= 4096:
        raise SystemExit("ssmserve-server: error: --http-prefix-cache must be 0..4096")
    if not 1 <= args.http_max_requests <= 65536:
        raise SystemExit("ssmserve-server: error: --http-max-requests must be 1..65536")
    if args.http and args.workers > 1:
        raise SystemExit(
            "ssmserve-server: error: --http serves from one worker process: run it without "
            "--workers (or one ssmserve-server --http per port)"
        )
    service = ServiceSettings(
        checkpoint_key=load_secret(Path(args.checkpoint_key), "checkpoint key")
        if args.checkpoint_key
        else None,
        require_signed_checkpoints=args.require_signed_checkpoints,
        budgets=BudgetSettings(
            sessions_per_tenant=args.sessions_per_tenant,
            imports_per_tenant=args.imports_per_tenant,
            forecasts_per_tenant=args.forecasts_per_tenant,
            import_buffer_bytes=args.import_buffer_bytes,
            resident_bytes_per_tenant=args.resident_bytes_per_tenant,
        ),
    )
    return WorkerSettings(
        service=service,
        tls=tls,
        auth_tokens=Path(args.auth_tokens) if args.auth_tokens else None,
        cluster_secret=Path(args.cluster_secret) if args.cluster_secret else None,
        insecure=args.insecure,
        models=tuple(models),
        listen=args.listen,
        redis_url=args.redis_url or None,
        data_dir=args.data_dir,
        advertise=args.advertise,
        ownership=OwnershipSettings(lease_ttl_s=args.lease_ttl, worker_ttl_s=args.lease_ttl),
        redis_timeout_s=args.redis_timeout,
        redis_wait_replicas=args.redis_wait_replicas,
        allow_evicting_redis=args.allow_evicting_redis,
        engine=args.engine,
        quantize=args.quantize,
        keepalive_time_s=args.keepalive,
        keepalive_timeout_s=args.keepalive_timeout,
        manager=ManagerSettings(
            stepper=StepperSettings(
                max_batch_tokens=args.max_batch_tokens,
                prefill_chunk=args.prefill_chunk,
                prefill_share=args.prefill_share,
            ),
            memory_budget_bytes=args.memory_budget or None,
            defaults=SessionDefaults(spread_snapshots=args.spread_snapshots),
        ),
        rebalance=RebalanceSettings(every_s=args.rebalance_every),
        metrics_listen=args.metrics_listen,
        trace_otlp_endpoint=args.trace_otlp_endpoint,
        http=HttpSettings(
            listen=args.http,
            prefix_cache=args.http_prefix_cache,
            max_requests=args.http_max_requests,
        ),
    )


def supervisor_settings(
    args: argparse.Namespace, argv: Sequence[str], settings: WorkerSettings
) -> SupervisorSettings:
    """``--workers N``: what the supervisor needs; each worker gets ``argv`` as given."""
    return SupervisorSettings(
        workers=args.workers,
        listen=settings.listen,
        data_dir=settings.data_dir,
        worker_args=tuple(argv),
        redis_url=settings.redis_url,
        advertise=settings.advertise,
        metrics_listen=settings.metrics_listen,
    )


def ensure_demo_model(directory: Path, arch: str = "mamba") -> Path:
    if not (directory / CONFIG_FILE).exists():
        spec = DemoSpec(arch=arch)
        config = demo_config(spec)
        save_model(directory, config, random_tensors(config, spec.seed))
    return directory


async def serve(
    settings: WorkerSettings,
    json_logs: JsonFormatter | None = None,
    gc_settings: GcSettings | None = None,
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    worker = Worker(settings)
    collector: ServingGc | None = None
    if worker.tokens is not None:  # SIGHUP: read the token file again now
        tokens = worker.tokens
        loop.add_signal_handler(signal.SIGHUP, lambda: tokens.reload(force=True))
    try:
        if json_logs is not None:
            json_logs.worker_id = worker.worker_id
        address = await worker.start()
        collector = ServingGc(gc_settings or GcSettings(), worker.metrics.gc_pause)
        collector.start()  # the worker is ready: its startup heap is final
        print(f"ssmserve-server listening on {address}", flush=True)
        await stop.wait()
        log.info("shutting down")
    finally:
        with contextlib.suppress(asyncio.CancelledError):
            await worker.stop()
        if collector is not None:
            collector.stop()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    json_logs = configure_logging(args.log_level, args.log_format)
    if not 1 <= args.workers <= MAX_WORKERS:
        raise SystemExit(f"ssmserve-server: error: --workers must be 1..{MAX_WORKERS}")
    try:
        if args.workers > 1:
            settings = settings_from_args(args)  # refuses bad flags before anything starts
            asyncio.run(supervise(supervisor_settings(args, argv, settings)))
            return 0
        gc_settings = GcSettings(
            young_threshold=max(args.gc_young_threshold, 0),
            freeze_when_ready=args.gc_young_threshold > 0,
        )
        asyncio.run(serve(settings_from_args(args), json_logs, gc_settings))
    except (SsmserveError, OSError) as exc:
        print(f"ssmserve-server: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
