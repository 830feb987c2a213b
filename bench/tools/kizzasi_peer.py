"""Peer benchmark: single-stream step latency of ``kizzasi.Predictor`` ("mamba2").

The peer is the ``kizzasi`` PyPI package (a Rust/PyO3 extension, tested at
version :data:`KIZZASI_VERSION`), configured to match our reference model:

* ``model_type="mamba2"``, ``hidden_dim=256``, ``num_layers=4``,
  ``state_dim=16``, ``input_dim=8``, ``output_dim=8``;
* batch 1, one ``Predictor.step`` call per step: a float32 vector of shape
  ``(8,)`` in, a float32 vector of shape ``(8,)`` out. The predictor keeps
  its recurrent state across calls (O(1) work per step, no window recompute).

``kizzasi`` is imported lazily, so this module can be imported anywhere; only
:func:`measure_kizzasi` needs the package. To keep it out of the main
environment, run it as a subprocess from a private venv, e.g.::

    /tmp/kz-venv/bin/python bench/tools/kizzasi_peer.py --steps 2000 --warmup 200

which prints one JSON object on stdout (exit status 2 if kizzasi is missing).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from types import ModuleType
from typing import Any

#: The kizzasi release these measurements were written and checked against.
KIZZASI_VERSION = "0.2.3"

#: Keyword arguments for ``kizzasi.Config``: our benchmark's reference shape.
PEER_CONFIG: dict[str, Any] = {
    "input_dim": 8,
    "output_dim": 8,
    "hidden_dim": 256,
    "num_layers": 4,
    "state_dim": 16,
    "model_type": "mamba2",
}

_INPUT_SEED = 0


def _import_kizzasi() -> ModuleType:
    """Import and return the ``kizzasi`` module, or raise a clear error."""
    try:
        return importlib.import_module("kizzasi")
    except ImportError as exc:
        raise RuntimeError(
            f"kizzasi is not installed: pip install kizzasi=={KIZZASI_VERSION}"
        ) from exc


def kizzasi_version() -> str:
    """Return the installed kizzasi version (raises if it is not installed)."""
    return str(_import_kizzasi().__version__)


def measure_kizzasi(steps: int, warmup: int) -> dict[str, float]:
    """Time single-stream ``Predictor.step`` calls for the peer config.

    A fresh predictor (random, unseeded weights: kizzasi offers no seed) is
    built, run for ``warmup`` untimed steps, then ``steps`` timed steps, each
    timed on its own with :func:`time.perf_counter_ns`. Inputs are seeded
    standard-normal float32 vectors generated ahead of time, so input
    creation is not timed.

    Args:
        steps: Number of timed steps (>= 1).
        warmup: Number of untimed steps run first (>= 0).

    Returns:
        ``step_us_p50`` and ``step_us_mean``: per-step latency in
        microseconds; ``steps_per_s``: timed steps divided by the wall time
        of the whole timed loop.

    Raises:
        ValueError: If ``steps < 1`` or ``warmup < 0``.
        RuntimeError: If kizzasi is not installed.

    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")

    kizzasi = _import_kizzasi()
    import numpy as np  # kizzasi depends on numpy, so it is present here

    predictor = kizzasi.Predictor(kizzasi.Config(**PEER_CONFIG))
    rng = np.random.default_rng(_INPUT_SEED)
    inputs = rng.standard_normal((warmup + steps, PEER_CONFIG["input_dim"]), dtype=np.float32)
    rows = list(inputs)  # contiguous float32 (8,) views, indexed outside timing

    step = predictor.step
    for x in rows[:warmup]:
        step(x)

    durations_ns: list[int] = [0] * steps
    clock = time.perf_counter_ns
    loop_start = clock()
    for i, x in enumerate(rows[warmup:]):
        t0 = clock()
        step(x)
        durations_ns[i] = clock() - t0
    loop_ns = clock() - loop_start

    return {
        "step_us_p50": statistics.median(durations_ns) / 1e3,
        "step_us_mean": statistics.fmean(durations_ns) / 1e3,
        "steps_per_s": steps / (loop_ns / 1e9),
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: measure and print one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="timed steps")
    parser.add_argument("--warmup", type=int, default=200, help="untimed steps")
    args = parser.parse_args(argv)

    try:
        metrics = measure_kizzasi(args.steps, args.warmup)
        version = kizzasi_version()
    except (RuntimeError, ValueError) as exc:
        print(f"kizzasi_peer: {exc}", file=sys.stderr)
        return 2

    report: dict[str, Any] = {
        "peer": "kizzasi",
        "kizzasi_version": version,
        **PEER_CONFIG,
        "steps": args.steps,
        "warmup": args.warmup,
        **metrics,
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
