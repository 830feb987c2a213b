"""Weights at their stored precision and in Q8_0 against float32, side by side.

Writes a mamba-130m-shaped model (random weights, ``--preset``) stored in BF16, and the
same values stored as float32, then loads three models: ``bf16`` (the BF16 file, kept
16-bit), ``f32`` (the float32 file) and ``q8_0`` (the float32 file with
``quantize="q8_0"``), and measures in one run:

- resident memory of each loaded model, in a fresh process each (RSS after the load minus
  RSS after the imports), against its ``model.safetensors``;
- decode at batch 1 and 8: median ms per step over ``--rounds`` interleaved rounds of
  ``--steps`` steps (the models take turns, so drift on a shared machine hits each).

    python bench/bench_bf16.py --json bench/results/bf16.json
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import standard_parser, write_result
from safetensors.numpy import load_file

from ssmserve.server.engine.loader import (
    bf16_bits,
    load_model,
    read_config,
    save_model,
)
from ssmserve.server.engine.numerics import widened
from ssmserve.server.engine.recurrent_state import BatchState

RSS_PROBE = """
import os, sys
from ssmserve.server.engine import kernels, products, loader
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
model = loader.load_model(sys.argv[1], quantize=sys.argv[2])
print(rss() - before)
"""


def write_pair(root: Path, preset: str) -> tuple[Path, Path]:
    source = root / "source"
    subprocess.run(
        [sys.executable, "-m", "ssmserve.client.cli", "model", "init-demo", str(source),
         "--preset", preset],
        check=True, capture_output=True,
    )  # fmt: skip
    config = read_config(source)
    tensors = load_file(source / "model.safetensors")
    save_model(root / "bf16", config, tensors, dtype="BF16")
    save_model(root / "f32", config, {k: widened(bf16_bits(v)) for k, v in tensors.items()})
    return root / "bf16", root / "f32"


def resident(directory: Path, quantize: str = "none") -> int:
    out = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, str(directory), quantize], check=True,
        capture_output=True, text=True,
    )  # fmt: skip
    return int(out.stdout.strip().splitlines()[-1])


def decode_ms(models: dict[str, object], batch: int, steps: int, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in models}
    order = list(models)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            model = models[name]
            state = BatchState.stack([model.new_state() for _ in range(batch)])  # type: ignore[attr-defined]
            ids = np.arange(batch) % 100
            for _ in range(2):
                state, _ = model.step(state, ids)  # type: ignore[attr-defined]
            started = time.perf_counter()
            for _ in range(steps):
                state, _ = model.step(state, ids)  # type: ignore[attr-defined]
            times[name].append((time.perf_counter() - started) / steps * 1e3)
    return {name: float(np.median(v)) for name, v in times.items()}


def main() -> None:
    parser = standard_parser(__doc__, rounds=7)
    parser.add_argument("--preset", default="mamba-130m")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bf16_dir, f32_dir = write_pair(Path(tmp), args.preset)
        stored = {
            name: (d / "model.safetensors").stat().st_size
            for name, d in (("bf16", bf16_dir), ("f32", f32_dir))
        }
        held = {
            "bf16": resident(bf16_dir),
            "f32": resident(f32_dir),
            "q8_0": resident(f32_dir, "q8_0"),
        }
        models = {
            "bf16": load_model(bf16_dir),
            "f32": load_model(f32_dir),
            "q8_0": load_model(f32_dir, quantize="q8_0"),
        }
        decode = {b: decode_ms(models, b, args.steps, args.rounds) for b in (1, 8)}
    result = {
        "preset": args.preset,
        "stored_bytes": stored,
        "resident_bytes": held,
        "resident_over_stored": {k: held[k] / stored[k] for k in stored},
        "q8_0_resident_over_f32": held["q8_0"] / held["f32"],
        "decode_ms": {str(b): d for b, d in decode.items()},
        "decode_bf16_over_f32": {str(b): d["bf16"] / d["f32"] for b, d in decode.items()},
        "decode_q8_0_over_f32": {str(b): d["q8_0"] / d["f32"] for b, d in decode.items()},
    }
    for name in ("bf16", "f32"):
        print(
            f"{name}: stored {stored[name] / 2**20:.0f} MiB, resident "
            f"{held[name] / 2**20:.0f} MiB ({held[name] / stored[name]:.3f}x); decode "
            f"batch 1 {decode[1][name]:.2f} ms, batch 8 {decode[8][name]:.2f} ms"
        )
    print(
        f"q8_0: resident {held['q8_0'] / 2**20:.0f} MiB ({held['q8_0'] / held['f32']:.3f}x "
        f"f32's); decode batch 1 {decode[1]['q8_0']:.2f} ms, batch 8 {decode[8]['q8_0']:.2f} ms"
    )
    for name in ("bf16", "q8_0"):
        ratio = result[f"decode_{name}_over_f32"]
        print(f"{name} / f32 decode time: batch 1 {ratio['1']:.3f}, batch 8 {ratio['8']:.3f}")
    if args.json:
        write_result(args.json, result, line=False)


if __name__ == "__main__":
    main()
