"""Prefill at mamba-130m's shapes: the exact prefill, the decode step, and what BLAS would give.

Usage (from the repo root)::

    .venv/bin/python bench/bench_prefill.py [--prompt 512] [--rounds 5] [--steps 40]
        [--json OUT.json]

One mamba-130m-shaped MambaForCausalLM (random weights, ``bench_engine.mamba_130m_config``)
in memory. Each round, interleaved so that all figures share the machine's load:

* ``prefill``: ``MambaModel.prefill`` of a ``--prompt``-token prompt from a fresh state,
  the last logits only (the exact path: the same bits as stepping);
* ``step``: decode steps of that session (batch 1), ``--steps`` over all rounds;
* ``prefill_blas_1runner``: the same prefill with every product a plain ``x @ W.T``
  (OpenBLAS sgemm on its 2 pinned threads, one runner). Not batch-invariant, hence not
  exact: what exactness costs, never a path the engine takes;
* ``prefill_blas_pipelined``: the same, the chunks on two runners as the exact path runs
  them, each runner's sgemm on one BLAS thread.

Prints one JSON object on its last line: medians in ms, and ``ratio`` = (prefill ms /
prompt) / step ms.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import mamba_130m_model
from threadpoolctl import threadpool_limits

from ssmserve.server.engine import prefill as prefill_module
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.numerics import RowStableLinear, blas_signature
from ssmserve.server.engine.recurrent_state import BatchState


def blas_products(model: MambaModel) -> Callable[..., None]:
    """A stand-in for ``prefill._product``: ``x @ W.T + b`` by sgemm (not exact)."""
    weights = {id(lin): lin.weight for lin in model.linears}  # (o, i), unpacked once

    def product(linear: RowStableLinear, x: np.ndarray, out: np.ndarray, rows: int, _: int) -> None:
        np.matmul(x[:rows], weights[id(linear)].T, out=out[:rows])  # (t, i) @ (i, o)
        if linear.bias is not None:
            out[:rows] += linear.bias

    return product


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=512, help="tokens in the prompt (512)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (5)")
    parser.add_argument("--steps", type=int, default=40, help="decode steps over all rounds")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    model = mamba_130m_model()
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, args.prompt)
    exact = prefill_module._product
    blas = blas_products(model)
    runners = prefill_module.MIN_ROWS_PER_RUNNER

    def exact_prefill() -> None:
        model.prefill(ids, outputs="last")

    def blas_one_runner() -> None:
        prefill_module._product, prefill_module.MIN_ROWS_PER_RUNNER = blas, 1 << 40
        try:
            model.prefill(ids, outputs="last")
        finally:
            prefill_module._product, prefill_module.MIN_ROWS_PER_RUNNER = exact, runners

    def blas_pipelined() -> None:
        prefill_module._product = blas
        try:
            with threadpool_limits(limits=1, user_api="blas"):
                model.prefill(ids, outputs="last")
        finally:
            prefill_module._product = exact

    kinds = {
        "prefill": exact_prefill,
        "prefill_blas_1runner": blas_one_runner,
        "prefill_blas_pipelined": blas_pipelined,
    }
    for run in kinds.values():  # compile, allocate
        run()
    times: dict[str, list[float]] = {name: [] for name in kinds}
    step_times: list[float] = []
    _, state = model.prefill(ids, outputs="last")
    batch = BatchState.stack([state])
    batch, _ = model.step(batch, ids[:1])
    for r in range(args.rounds):
        for name, run in kinds.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
        for i in range(args.steps * r // args.rounds, args.steps * (r + 1) // args.rounds):
            start = time.perf_counter()
            batch, _ = model.step(batch, ids[i % args.prompt : i % args.prompt + 1])
            step_times.append(time.perf_counter() - start)
    report: dict[str, object] = {
        f"{name}_ms": float(np.median(t) * 1e3) for name, t in times.items()
    }
    report.update({f"{name}_ms_min": float(np.min(t) * 1e3) for name, t in times.items()})
    step_ms = float(np.median(step_times) * 1e3)
    report.update(
        prompt=args.prompt,
        rounds=args.rounds,
        step_ms=step_ms,
        step_ms_min=float(np.min(step_times) * 1e3),
        ratio=float(report["prefill_ms"]) / args.prompt / step_ms,  # type: ignore[arg-type]
        engine_threads=model.threads,
        blas=blas_signature(),
    )
    for name in ("prefill", "prefill_blas_1runner", "prefill_blas_pipelined"):
        print(
            f"{name:24s} median {report[f'{name}_ms']:8.1f} ms  min {report[f'{name}_ms_min']:8.1f}"
        )
    print(f"{'step (batch 1)':24s} median {step_ms:8.1f} ms  min {report['step_ms_min']:8.1f}")
    print(f"ratio (prefill / prompt / step) {report['ratio']:.4f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
