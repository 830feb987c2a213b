"""Wire cost of one step's output: ``Vector.values`` (repeated float) against
``Vector.packed`` (little-endian float32 bytes), side by side in one run.

Usage (from the repo root)::

    .venv/bin/python bench/bench_wire.py

For each output width (a signal model's 8, a hidden-size vector, mamba-130m's 50,280
logits): the worker's cost to build and serialise a StepResult (``result_to_pb``) and the
client's cost to parse it and get a float32 array (``StepOutput.from_pb``), medians.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import median_seconds, table

from ssmserve.client.step_values import StepOutput
from ssmserve.server.api.conversions import result_to_pb
from ssmserve.server.sessions.stepper import StepOutcome
from ssmserve.v1 import ssmserve_pb2 as pb

WIDTHS = (8, 768, 50_280)


def main() -> int:
    rows = []
    for width in WIDTHS:
        outcome = StepOutcome("session-0001", 1)
        outcome.output = np.random.default_rng(width).standard_normal(width).astype(np.float32)
        figures = {}
        for packed in (False, True):
            repeats = 20 if width > 10_000 and not packed else 200

            def build(packed: bool = packed, outcome: StepOutcome = outcome) -> bytes:
                return result_to_pb(outcome, packed=packed).SerializeToString()

            wire = build()
            decoded = StepOutput.from_pb(pb.StepResult.FromString(wire)).output
            assert np.array_equal(decoded.view(np.uint32), outcome.output.view(np.uint32))
            figures[packed] = (
                median_seconds(build, repeats),
                median_seconds(
                    lambda w=wire: StepOutput.from_pb(pb.StepResult.FromString(w)), repeats
                ),
                len(wire),
            )
        (vb, vr, size), (pb_, pr, _) = figures[False], figures[True]
        rows.append([width, size, vb * 1e6, pb_ * 1e6, vb / pb_, vr * 1e6, pr * 1e6, vr / pr])
    heads = ["width", "bytes", "worker values us", "worker packed us", "ratio"]
    print(table([*heads, "client values us", "client packed us", "ratio"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
