"""A generating session's time between tokens while another session prefills a prompt,
beside its time alone, in one run (issue 50: fair scheduling of prefill beside decode).

Usage (from the repo root)::

    .venv/bin/python bench/bench_fair_prefill.py [--model-dir DIR] [--prompt 1024]
        [--tokens 24] [--rounds 3] [--worker-arg=--max-batch-tokens=32 ...] [--json OUT]

One redis-server (private), one ``ssmserve-server`` serving a mamba-130m-shaped causal LM
(``bench/tools/make_mamba_130m.py`` writes it into a temp dir unless ``--model-dir`` names one),
started with the ``--worker-arg`` flags; this process is the client
(``ssmserve.client.aio.AsyncClient``). Each round, interleaved so that all figures share
the machine's load:

* ``alone``: session D, fed a 4-token prompt, generates ``--tokens`` tokens (greedy) with
  nothing else on the worker: its time between tokens (the mean gap after the first), once
  before and once after the other two (the host's load drifts within a round);
* ``prompt alone``: session P generates 1 token after a ``--prompt``-token prompt
  (Generate feeds it as runs of 512, prefilled in chunks): the time to that token;
* ``beside``: D generates while P's prompt runs: D starts, and once it has yielded 3
  tokens P's Generate starts; every gap between D's tokens that ends inside P's window
  (its call to its token) is counted; D stops once P has its token.

Figures (medians over the rounds): D's mean gap alone and beside the prompt, and the
median of each round's ratio of the two (the goal: <= 1.5); the largest single gap beside
the prompt; the prompt's time alone and beside D, and their ratio (what fairness costs the
prompt). The worker's flags for these are ``--max-batch-tokens``, ``--prefill-chunk`` and
``--prefill-share`` (docs/serving.md). Prints a table and one JSON object on
its last line.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    Workers,
    config_for,
    private_redis,
    standard_parser,
    table,
    worker_args,
    write_preset_model,
    write_result,
)

from ssmserve.client.aio import AsyncClient
from ssmserve.client.retry import RetryPolicy

DECODE_PROMPT = [3, 1, 4, 1]
#: Tokens the decoder may generate in one round beside the prompt (it stops before).
DECODE_BOUND = 4000
CALL_S = 600.0  # bound on a round: a 1,024-token prompt on a loaded 2-core host


async def new_session(client: AsyncClient) -> str:
    return (await client.create_session("m")).session_id


async def decode_alone(client: AsyncClient, tokens: int) -> list[float]:
    """The gaps (s) between D's tokens, generating ``tokens`` alone."""
    sid = await new_session(client)
    arrivals = []
    async for _ in client.generate(sid, tokens, prompt_ids=DECODE_PROMPT, at_step=0):
        arrivals.append(time.perf_counter())
    await client.close_session(sid)
    return list(np.diff(arrivals))


async def prompt_alone(client: AsyncClient, prompt: np.ndarray) -> float:
    """Seconds from P's Generate call to its one token."""
    sid = await new_session(client)
    started = time.perf_counter()
    async for _ in client.generate(sid, 1, prompt_ids=prompt.tolist(), at_step=0):
        pass
    took = time.perf_counter() - started
    await client.close_session(sid)
    return took


async def beside(client: AsyncClient, prompt: np.ndarray) -> tuple[list[float], float]:
    """D generating while P's prompt runs: the gaps between D's tokens that end inside
    P's window, and P's time to its token."""
    d, p = await new_session(client), await new_session(client)
    arrivals: list[float] = []
    window: list[float] = []  # P's call, P's token
    three = asyncio.Event()
    done = asyncio.Event()

    async def decoder() -> None:
        generation = client.generate(d, DECODE_BOUND, prompt_ids=DECODE_PROMPT, at_step=0)
        async for _ in generation:
            arrivals.append(time.perf_counter())
            if len(arrivals) == 3:
                three.set()
            if done.is_set():
                break
        await generation.aclose()

    async def prompter() -> None:
        await three.wait()
        window.append(time.perf_counter())
        async for _ in client.generate(p, 1, prompt_ids=prompt.tolist(), at_step=0):
            pass
        window.append(time.perf_counter())
        done.set()

    await asyncio.wait_for(asyncio.gather(decoder(), prompter()), CALL_S)
    start, end = window
    gaps = [b - a for a, b in itertools.pairwise(arrivals) if start < b <= end]
    # The gap that spans P's end is beside the prompt too (D waited through its last part).
    after = [b - a for a, b in itertools.pairwise(arrivals) if b > end]
    if after:
        gaps.append(after[0])
    for sid in (d, p):
        await client.close_session(sid)
    return gaps, end - start


async def bench(address: str, args: argparse.Namespace) -> dict[str, float | str]:
    rng = np.random.default_rng(0)
    vocab = config_for("mamba").vocab_size
    rows: dict[str, list[float]] = {
        "decode_gap_alone_ms": [],
        "decode_gap_beside_prompt_ms": [],
        "decode_gap_beside_prompt_max_ms": [],
        "prompt_alone_ms": [],
        "prompt_beside_decode_ms": [],
    }
    # A round's calls give up with the round (a prompt's progress messages, one per run
    # of 512 ids, keep the default stall bound satisfied).
    retry = RetryPolicy(stall_timeout_s=CALL_S, give_up_after_s=CALL_S)
    async with AsyncClient(address, retry=retry) as client:
        await decode_alone(client, 4)  # warm: the first steps and prefills compile nothing
        await prompt_alone(client, rng.integers(0, vocab, 64))
        for r in range(args.rounds):
            prompt = rng.integers(0, vocab, args.prompt)
            before = await decode_alone(client, args.tokens)
            rows["prompt_alone_ms"].append(await prompt_alone(client, prompt) * 1e3)
            gaps, took = await beside(client, prompt)
            after = await decode_alone(client, args.tokens)
            # Alone on both sides of the window: the host's load drifts over a round.
            rows["decode_gap_alone_ms"].append(statistics.fmean(before + after) * 1e3)
            rows["decode_gap_beside_prompt_ms"].append(statistics.fmean(gaps) * 1e3)
            rows["decode_gap_beside_prompt_max_ms"].append(max(gaps) * 1e3)
            rows["prompt_beside_decode_ms"].append(took * 1e3)
            print(f"round {r + 1}/{args.rounds}: "
                  + ", ".join(f"{k} {v[-1]:.0f}" for k, v in rows.items())
                  + f" ({len(gaps)} gaps beside)", flush=True)  # fmt: skip
    out: dict[str, float | str] = {k: statistics.median(v) for k, v in rows.items()}
    pairs = zip(rows["decode_gap_alone_ms"], rows["decode_gap_beside_prompt_ms"], strict=True)
    ratios = [b / a for a, b in pairs]
    out["gap_ratio"] = statistics.median(ratios)  # of each round's ratio
    out["gap_ratio_per_round_max"] = max(ratios)
    prompts = zip(rows["prompt_alone_ms"], rows["prompt_beside_decode_ms"], strict=True)
    out["prompt_ratio"] = statistics.median(b / a for a, b in prompts)
    out["rounds"] = args.rounds
    out["prompt"] = args.prompt
    out["worker_flags"] = " ".join(args.worker_arg)
    return out


def main() -> int:
    parser = standard_parser(__doc__, rounds=3)
    parser.add_argument("--model-dir", type=Path, help="a mamba-130m-shaped model directory")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens (1024)")
    parser.add_argument("--tokens", type=int, default=24, help="tokens D generates alone (24)")
    parser.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a flag for ssmserve-server (repeatable), e.g. --worker-arg=--prefill-chunk=16",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = args.model_dir
        if model_dir is None:
            model_dir = write_preset_model(root / "mamba-130m", config_for("mamba"))
        workers = Workers(root)
        with private_redis(root / "redis") as redis:
            try:
                cmd = worker_args([("m", model_dir)], redis.url, root / "w0") + args.worker_arg
                _proc, address = workers.start(cmd, "w0")
                report = asyncio.run(bench(address, args))
            finally:
                workers.close()
    report_args = " ".join(args.worker_arg) or "(defaults)"
    print(f"worker flags: {report_args}")
    print(
        table(
            ["figure", "value"],
            [[k, v if isinstance(v, str) else f"{v:.2f}"] for k, v in report.items()],
        )
    )
    write_result(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
