"""A served prompt at prefill speed, beside the engine's own prefill and beside stepping.

Usage (from the repo root)::

    .venv/bin/python bench/bench_prompt.py [--model-dir DIR] [--prompt 512] [--rounds 3]
        [--stepped 8] [--replay 256] [--json OUT.json]

One redis-server (private), one ``ssmserve-server`` serving a mamba-130m-shaped causal LM
(``bench/make_mamba_130m.py`` writes it into a temp dir unless ``--model-dir`` names one);
this process is the client (grpc.aio) and also loads the model to time the engine alone.
Each round, interleaved so that all figures share the machine's load:

* ``served_prompt_ms``: a ``--prompt``-token prompt sent to a new session as one Stream
  message with ``last_outputs_only`` (packed outputs): from the write to the answer, whose
  last result carries the logits (the worker prefills it in chunks of its
  ``prefill_chunk``);
* ``engine_prefill_ms``: ``engine.bench.bench_prefill`` (what ``ssmserve model bench DIR
  --prefill 512`` runs) on the same prompt length, in this process: the engine alone;
* ``served_step_ms``: ``--stepped`` steps of a session sent one per message (ping-pong),
  the median; times ``--prompt`` it is the prompt sent step by step (extrapolated);
* ``served_rollback_ms``: a Rollback that replays ``--replay`` logged steps on top of the
  snapshot at step 0 (a replay is a prefill computing only the last output);
* ``engine_replay_stepped_ms`` / ``engine_replay_prefill_ms``: that replay in this process,
  stepped (``MambaModel.run``: how replays ran before) and prefilled.

Prints a table and one JSON object on its last line (medians over rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc
from common import start_server, table
from make_mamba_130m import config_for

from ssmserve.client.aio import step_input
from ssmserve.server.embedded_redis import EmbeddedRedis, EmbeddedRedisSettings
from ssmserve.server.engine.bench import bench_prefill
from ssmserve.server.engine.demo import random_tensors
from ssmserve.server.engine.loader import load_model, save_model
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc

CALL_S = 600.0  # bound on any one call (a prompt stepped on a loaded 2-core host)


async def new_session(stub: pb_grpc.SessionServiceStub) -> str:
    config = pb.SessionConfig(snapshot_every=1 << 20, snapshot_phase=0)
    info = await stub.CreateSession(
        pb.CreateSessionRequest(model="m", config=config), timeout=CALL_S
    )
    return info.session_id


async def served_prompt(stub: pb_grpc.SessionServiceStub, ids: np.ndarray) -> float:
    """Seconds from sending ``ids`` as one last_outputs_only message to its answer."""
    sid = await new_session(stub)
    request = pb.StreamRequest(
        steps=[step_input(sid, t + 1, int(v)) for t, v in enumerate(ids)],
        packed_outputs=True,
        last_outputs_only=True,
    )
    call = stub.Stream(timeout=CALL_S)
    started = time.perf_counter()
    await call.write(request)
    results: list[pb.StepResult] = []
    while len(results) < len(ids):
        results.extend((await call.read()).results)
    took = time.perf_counter() - started
    await call.done_writing()
    assert not any(r.HasField("error") for r in results), results[0].error
    assert results[-1].output.packed and not results[0].HasField("output")
    return took


async def served_steps(stub: pb_grpc.SessionServiceStub, ids: np.ndarray) -> list[float]:
    """Seconds per step of ``ids`` sent one per message, ping-pong."""
    sid = await new_session(stub)
    call = stub.Stream(timeout=CALL_S)
    out = []
    for t, v in enumerate(ids):
        started = time.perf_counter()
        await call.write(pb.StreamRequest(steps=[step_input(sid, t + 1, int(v))]))
        reply = await call.read()
        out.append(time.perf_counter() - started)
        assert not reply.results[0].HasField("error"), reply.results[0].error
    await call.done_writing()
    return out


async def served_rollback(stub: pb_grpc.SessionServiceStub, ids: np.ndarray) -> float:
    """Seconds of a Rollback to step ``len(ids)`` that replays them all (the session's
    only snapshot is at step 0); the session first takes one more step to cut."""
    sid = await new_session(stub)
    steps = [step_input(sid, t + 1, int(v)) for t, v in enumerate([*ids, ids[0]])]
    call = stub.Stream(timeout=CALL_S)
    await call.write(pb.StreamRequest(steps=steps, last_outputs_only=True))
    answered = 0
    while answered < len(steps):
        answered += len((await call.read()).results)
    await call.done_writing()
    started = time.perf_counter()
    reply = await stub.Rollback(pb.RollbackRequest(session_id=sid, step=len(ids)), timeout=CALL_S)
    took = time.perf_counter() - started
    assert reply.replayed_steps == len(ids), reply
    return took


def engine_replays(model: MambaModel, ids: np.ndarray) -> tuple[float, float]:
    """(stepped, prefilled) seconds of replaying ``ids`` from a fresh state."""
    started = time.perf_counter()
    model.run(ids)
    stepped = time.perf_counter() - started
    started = time.perf_counter()
    model.prefill(ids, outputs="last")
    return stepped, time.perf_counter() - started


async def bench(address: str, model: MambaModel, args: argparse.Namespace) -> dict[str, float]:
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    rows: dict[str, list[float]] = {
        k: []
        for k in (
            "served_prompt_ms", "engine_prefill_ms", "served_step_ms", "served_rollback_ms",
            "engine_replay_stepped_ms", "engine_replay_prefill_ms",
        )
    }  # fmt: skip
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.SessionServiceStub(channel)
        await served_prompt(stub, rng.integers(0, vocab, 16))  # warm: a first prefill
        for r in range(args.rounds):
            prompt = rng.integers(0, vocab, args.prompt)
            rows["served_prompt_ms"].append(await served_prompt(stub, prompt) * 1e3)
            engine = bench_prefill(model, args.prompt, rounds=1, steps=1, warmup=1)
            rows["engine_prefill_ms"].append(engine.prefill_ms)
            steps = await served_steps(stub, rng.integers(0, vocab, args.stepped))
            rows["served_step_ms"].append(statistics.median(steps) * 1e3)
            replay = rng.integers(0, vocab, args.replay)
            rows["served_rollback_ms"].append(await served_rollback(stub, replay) * 1e3)
            stepped, prefilled = engine_replays(model, replay)
            rows["engine_replay_stepped_ms"].append(stepped * 1e3)
            rows["engine_replay_prefill_ms"].append(prefilled * 1e3)
            print(f"round {r + 1}/{args.rounds}: "
                  + ", ".join(f"{k} {v[-1]:.0f}" for k, v in rows.items()), flush=True)  # fmt: skip
    out = {k: statistics.median(v) for k, v in rows.items()}
    out["prompt"] = args.prompt
    out["replay"] = args.replay
    out["served_over_engine"] = out["served_prompt_ms"] / out["engine_prefill_ms"]
    out["stepped_prompt_ms_extrapolated"] = out["served_step_ms"] * args.prompt
    out["prefill_speedup_served"] = out["stepped_prompt_ms_extrapolated"] / out["served_prompt_ms"]
    out["replay_speedup_engine"] = out["engine_replay_stepped_ms"] / out["engine_replay_prefill_ms"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, help="a mamba-130m-shaped model directory")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (512)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (3)")
    parser.add_argument("--stepped", type=int, default=8, help="steps sent one by one (8)")
    parser.add_argument("--replay", type=int, default=256, help="steps a rollback replays")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmbeddedRedis(EmbeddedRedisSettings(data_dir=Path(tmp) / "redis")) as redis_server,
    ):
        model_dir = args.model_dir
        if model_dir is None:
            model_dir = Path(tmp) / "mamba-130m"
            config = config_for("mamba")
            save_model(model_dir, config, random_tensors(config, 0))
        model = load_model(model_dir, name="m")
        server, address = start_server(
            [sys.executable, "-m", "ssmserve.server.main", "--model", f"m={model_dir}",
             "--listen", "127.0.0.1:0", "--redis-url", redis_server.url]
        )  # fmt: skip
        try:
            report = asyncio.run(bench(address, model, args))
        finally:
            server.terminate()
            server.wait(30)
    print(table(["figure", "value"], [[k, f"{v:.1f}"] for k, v in report.items()]))
    line = json.dumps(report)
    if args.json:
        args.json.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
