"""Checkpoint codec throughput for a mamba-130m-sized session state.

Usage: ``.venv/bin/python bench/bench_checkpoint.py [--json OUT]``

State: 24 layers x (conv (1536, 4) + ssm (1536, 16)) float32 = 2.95 MB (2.81 MiB), plus
a 64-token input history. Beside the codec, in the same run: sha256 alone over the same
bytes and a plain ``bytes`` copy, the two costs encode cannot avoid.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import median_seconds, table

from ssmserve.server.engine.recurrent_state import LayerState, SessionState
from ssmserve.server.state.checkpoint import Checkpoint, InputHistory


def mamba130m_checkpoint() -> Checkpoint:
    """A random mamba-130m-sized session (2.81 MiB state) with a 64-token history."""
    rng = np.random.default_rng(0)
    layers = tuple(
        LayerState(
            rng.standard_normal((1536, 4)).astype(np.float32),
            rng.standard_normal((1536, 16)).astype(np.float32),
        )
        for _ in range(24)
    )
    history = InputHistory(1, rng.integers(0, 50280, 64))
    return Checkpoint("bench", 64, "mamba-130m-shaped", "0" * 64, SessionState(layers), history)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = parser.parse_args()
    ckpt = mamba130m_checkpoint()
    state = ckpt.state
    layers = state.layers
    blob = ckpt.encode()
    mb = state.nbytes / 1e6
    raw = b"".join(layer.conv.tobytes() + layer.ssm.tobytes() for layer in layers)

    enc = median_seconds(ckpt.encode, 30)
    dec = median_seconds(lambda: Checkpoint.decode(blob), 30)
    sha = median_seconds(lambda: hashlib.sha256(raw).digest(), 30)
    copy = median_seconds(lambda: bytearray(raw), 30)
    print(
        f"# checkpoint codec: state {state.nbytes:,} bytes ({state.nbytes / 2**20:.2f} MiB), "
        f"blob {len(blob):,} bytes"
    )
    print(
        table(
            ["operation", "ms", "MB/s"],
            [
                ["encode (copy + sha256)", enc * 1e3, mb / enc],
                ["decode (sha256 verify + zero-copy views)", dec * 1e3, mb / dec],
                ["limit: sha256 alone", sha * 1e3, mb / sha],
                ["limit: one memory copy", copy * 1e3, mb / copy],
            ],
        )
    )
    if args.json:
        figures = {
            "state_bytes": state.nbytes,
            "blob_bytes": len(blob),
            "encode_ms": enc * 1e3,
            "decode_ms": dec * 1e3,
            "sha256_ms": sha * 1e3,
            "copy_ms": copy * 1e3,
        }
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
