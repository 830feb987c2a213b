"""Memory per resident session in a served process, and how it settles after the steps.

Usage: ``.venv-bench/bin/python bench/bench_served_memory.py [--sessions 3000]
[--steps 40,80] [--baseline OTHER/.venv/bin/python] [--json OUT.json]``

Each (server, steps) pair is a fresh ``ssmserve-server`` process (demo model, log level
WARNING) on a private redis-server, so no round reuses heap an earlier one freed. In it:

1. RSS (``VmRSS``) is read, N sessions are created (durability LOG, default snapshot
   period: 64 steps at phase 0, so with 64 steps or more every session comes due at step
   64 in the same tick: a burst of N background snapshot writes), and RSS is read again
   after 3 s.
2. The sessions are stepped ``steps`` times in multiplexed streams, as
   ``bench_server_cpu.py`` does (50 sessions per stream, 8 steps of each per message,
   packed inputs and outputs, all streams at once).
3. RSS is read right after, then at 2, 4, 8 and 12 s idle. Meanwhile the worker gives
   idle sessions state arrays of their own (after 1 s), finishes the background snapshot
   writes the steps started, and returns freed heap to the system. Nothing forces a
   garbage collection: an idle worker collects only when it allocates.

Reported per row: RSS growth per session (RSS - RSS before creating, / N) at each point,
the session's own data (state bytes + min(history_window, steps) inputs +
min(output_window, steps) outputs) and the ratio of the last reading to it. Alternating
servers within a step count, so drift on a shared machine hits them alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc
from bench_server_cpu import (
    CREATE_AT_ONCE,
    SESSIONS_PER_STREAM,
    STREAMS_PER_CHANNEL,
    UNARY_TIMEOUT_S,
    bounded,
    messages,
    rss_bytes,
    run_stream,
    server_variants,
    start_demo_server,
)
from harness import standard_parser, table, write_result

from ssmserve.server.engine.loader import read_config
from ssmserve.server.main import ensure_demo_model
from ssmserve.server.sessions.config import SessionDefaults
from ssmserve.server.sessions.manager import ManagerSettings
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc

CREATED_WAIT_S = 3.0
IDLE_READINGS_S = (2.0, 4.0, 8.0, 12.0)  # after the steps


@dataclass
class Row:
    server: str
    sessions: int
    steps: int
    own_kib: float
    created_kib: float
    stepped_kib: float
    idle_kib: list[float]

    @property
    def ratio(self) -> float:
        return self.idle_kib[-1] / self.own_kib


async def measure(label: str, address: str, pid: int, n: int, steps: int, state_bytes: int) -> Row:
    streams = math.ceil(n / SESSIONS_PER_STREAM)
    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(math.ceil(streams / STREAMS_PER_CHANNEL))
    ]
    try:
        stubs = [pb_grpc.SessionServiceStub(c) for c in channels]
        before = rss_bytes(pid)
        per_session = lambda: (rss_bytes(pid) - before) / n / 1024  # noqa: E731
        request = pb.CreateSessionRequest(
            model="demo", config=pb.SessionConfig(durability=pb.DURABILITY_LOG)
        )
        infos: list[pb.SessionInfo] = await bounded(  # type: ignore[assignment]
            [lambda: stubs[0].CreateSession(request, timeout=UNARY_TIMEOUT_S)] * n,
            CREATE_AT_ONCE,
        )
        await asyncio.sleep(CREATED_WAIT_S)
        created = per_session()
        sids = [info.session_id for info in infos]
        info = infos[0]
        rng = np.random.default_rng(0)
        groups = [sids[i : i + SESSIONS_PER_STREAM] for i in range(0, n, SESSIONS_PER_STREAM)]
        plans = [messages(g, steps, info.input_dim, rng, "session") for g in groups]
        done = await asyncio.gather(
            *(
                run_stream(stubs[i // STREAMS_PER_CHANNEL], plan, info.output_dim * 4)
                for i, plan in enumerate(plans)
            )
        )
        assert sum(done) == n * steps, (sum(done), n * steps)
        ended = time.monotonic()
        stepped = per_session()
        idle = []
        for at in IDLE_READINGS_S:
            await asyncio.sleep(max(0.0, ended + at - time.monotonic()))
            idle.append(per_session())
        history = info.config.history_window or SessionDefaults().history_window
        own = (
            state_bytes
            + min(history, steps) * info.input_dim * 4
            + min(ManagerSettings().output_window, steps) * info.output_dim * 4
        )
        return Row(label, n, steps, own / 1024, created, stepped, idle)
    finally:
        for c in channels:
            await c.close()


def main() -> int:
    parser = standard_parser(__doc__)
    parser.add_argument("--sessions", type=int, default=3000)
    parser.add_argument("--steps", default="40,80", help="comma-separated steps per session")
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="PYTHON",
        help="also run another checkout's server (the Python of its venv)",
    )
    args = parser.parse_args()
    step_counts = [int(s) for s in args.steps.split(",")]
    if args.sessions < 1 or not step_counts or min(step_counts) < 1:
        parser.error("--sessions and --steps must be positive")
    variants = server_variants(args.baseline)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = ensure_demo_model(Path(tmp) / "demo")
        state_bytes = read_config(model_dir).state_bytes
        for steps in step_counts:
            for i, (label, cmd) in enumerate(variants.items()):
                with contextlib.ExitStack() as stack:  # a fresh server and Redis per row
                    redis_dir = Path(tmp) / f"r{steps}-{i}"
                    address, pid = start_demo_server(stack, cmd, model_dir, redis_dir)
                    row = asyncio.run(
                        measure(label, address, pid, args.sessions, steps, state_bytes)
                    )
                    print(f"  {label}: {steps} steps: {row.idle_kib[-1]:.1f} KiB", flush=True)
                    rows.append(row)

    headers = ["server", "sessions", "steps", "own KiB", "created", "right after steps"]
    headers += [f"{at:g} s idle" for at in IDLE_READINGS_S] + [f"{IDLE_READINGS_S[-1]:g} s / own"]
    body = [
        [r.server, r.sessions, r.steps, f"{r.own_kib:.1f}", f"{r.created_kib:.1f}",
         f"{r.stepped_kib:.1f}", *(f"{v:.1f}" for v in r.idle_kib), f"{r.ratio:.2f}"]
        for r in rows
    ]  # fmt: skip
    print("\n# memory per resident session, served demo model, fresh process per row\n")
    print(table(headers, body))
    print("\nKiB = RSS growth per session since before the sessions were created")
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    if args.json:
        write_result(args.json, {"rows": [asdict(r) for r in rows]}, line=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
