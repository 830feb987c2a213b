"""One session, one step per message: served p50/p90 and server CPU per step, this
checkout beside another build of the server, interleaved in one run.

``.venv-bench/bin/python bench/bench_lone_step.py --baseline OTHER-PYTHON [--steps 4000]
[--block 250] [--durability log,none]``

Why interleaved: on this shared host a lone step's figures drift by 20-30% between runs
minutes apart, more than most changes to that path.
Each server gets its own Redis; the client steps one server for ``--block`` steps, then
the other, and so on, so both see the same drift. ``OTHER-PYTHON`` is a Python that
imports the other build (e.g. a script running ``.venv-bench/bin/python`` with
``PYTHONPATH=OTHER/server:OTHER/client``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
from pathlib import Path

import grpc
from bench_service import ping_pong
from common import cpu_seconds, start_server, table

from ssmserve.server.embedded_redis import EmbeddedRedis, EmbeddedRedisSettings
from ssmserve.server.main import ensure_demo_model
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc


async def interleaved(
    servers: dict[str, tuple[int, str]], durability: str, steps: int, block: int
) -> dict[str, tuple[list[float], float]]:
    """Per server: its round trips and its CPU seconds over its own blocks."""
    streams = {}
    async with contextlib.AsyncExitStack() as stack:
        for label, (_pid, address) in servers.items():
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(address))
            stub = pb_grpc.SessionServiceStub(channel)
            config = pb.SessionConfig(durability=getattr(pb, f"DURABILITY_{durability.upper()}"))
            info = await stub.CreateSession(
                pb.CreateSessionRequest(model="demo", config=config), timeout=10
            )
            await ping_pong(stub, info.session_id, 300)  # warm-up
            streams[label] = (stub, info.session_id)
        got: dict[str, tuple[list[float], float]] = {k: ([], 0.0) for k in servers}
        for _ in range(steps // block):
            for label, (pid, _address) in servers.items():
                stub, sid = streams[label]
                c0 = cpu_seconds(pid)
                samples = await ping_pong(stub, sid, block)
                samples_so_far, cpu = got[label]
                got[label] = (samples_so_far + samples, cpu + cpu_seconds(pid) - c0)
        return got


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", type=Path, required=True, help="Python of the other build")
    parser.add_argument("--steps", type=int, default=4000, help="steps per server")
    parser.add_argument("--block", type=int, default=250, help="steps in a row on one server")
    parser.add_argument("--durability", default="log,none", help="comma-separated")
    args = parser.parse_args()
    commands = {"baseline": str(args.baseline), "this": sys.executable}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model_dir = ensure_demo_model(Path(tmp) / "demo")
        servers = {}
        for label, python in commands.items():
            redis_server = stack.enter_context(
                EmbeddedRedis(EmbeddedRedisSettings(data_dir=Path(tmp) / f"redis-{label}"))
            )
            process, address = start_server(
                [python, "-m", "ssmserve.server.main", "--model", f"demo={model_dir}",
                 "--listen", "127.0.0.1:0", "--redis-url", redis_server.url]
            )  # fmt: skip
            stack.callback(process.wait, 30)
            stack.callback(process.terminate)
            servers[label] = (process.pid, address)
        rows = []
        for durability in args.durability.split(","):
            got = asyncio.run(interleaved(servers, durability, args.steps, args.block))
            (base, base_cpu), (this, this_cpu) = got["baseline"], got["this"]
            for label, samples, cpu in (("baseline", base, base_cpu), ("this", this, this_cpu)):
                rows.append(
                    [durability, label, pct(samples, 0.5), pct(samples, 0.9),
                     cpu / len(samples) * 1e6]
                )  # fmt: skip
            rows.append(
                [durability, "this / baseline", pct(this, 0.5) / pct(base, 0.5),
                 pct(this, 0.9) / pct(base, 0.9), this_cpu / base_cpu]
            )  # fmt: skip
    print(table(["durability", "server", "p50 ms", "p90 ms", "server CPU us/step"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
