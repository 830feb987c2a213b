"""The quick-start demo (``./dev demo``), offline until the service lands.

It writes the demo signal Mamba (once) to ``demo-data/model``, streams a synthetic
multi-channel signal through it one step at a time, checkpoints the session half-way,
restores it from the checkpoint bytes and shows the continuation is bit-identical, then
steps many sessions in one batch and shows each equals its solo run.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from server.checkpoint import Checkpoint, CheckpointMeta, InputHistory
from server.model.demo import DemoSpec, demo_config, random_tensors
from server.model.loader import CONFIG_FILE, load_model, save_model
from server.model.mamba import MambaModel
from server.state import BatchState


def synthetic_signal(steps: int, channels: int, seed: int = 0) -> np.ndarray:
    """Sum of sines per channel plus a little noise: (T, channels) float32."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps)[:, None]
    freq = rng.uniform(0.01, 0.1, channels)
    phase = rng.uniform(0, 2 * np.pi, channels)
    clean = np.sin(2 * np.pi * freq * t + phase)
    return (clean + 0.05 * rng.standard_normal((steps, channels))).astype(np.float32)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ssmserve-demo", description=__doc__)
    parser.add_argument("--model-dir", type=Path, default=Path("demo-data/model"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sessions", type=int, default=32)
    args = parser.parse_args(argv)

    if not (args.model_dir / CONFIG_FILE).exists():
        config = demo_config(DemoSpec())
        save_model(args.model_dir, config, random_tensors(config, DemoSpec().seed))
        print(f"wrote the demo model to {args.model_dir}")
    model = load_model(args.model_dir, name="demo")
    c = model.config
    print(
        f"model {model.name}: signal Mamba, {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
        f"state {c.state_size}, {c.state_bytes:,} state bytes/session, "
        f"fingerprint {model.fingerprint[:16]}"
    )

    signal = synthetic_signal(args.steps, c.input_dim)
    print(f"\nstreaming {args.steps} steps of a {c.input_dim}-channel signal, one at a time:")
    batch = BatchState.stack([model.new_state()])
    outputs = np.empty((args.steps, c.output_dim), np.float32)
    half = args.steps // 2
    blob = b""
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch, out = model.step(batch, signal[step - 1 : step])
        outputs[step - 1] = out[0]
        if step % max(1, args.steps // 8) == 0:
            print(
                f"  step {step:4d}  input {_fmt(signal[step - 1])}  ->  prediction {_fmt(out[0])}"
            )
        if step == half:
            blob = _checkpoint(model, batch, signal, half).encode()
    per_step_us = (time.perf_counter() - t0) / args.steps * 1e6

    restored = Checkpoint.decode(blob)
    restored.check_model(model)
    cont, _ = model.run(signal[half:], restored.state)
    exact_restore = np.array_equal(cont, outputs[half:])
    print(
        f"\ncheckpoint at step {half}: {len(blob):,} bytes; restored and continued "
        f"{args.steps - half} steps: {'bit-identical' if exact_restore else 'DIFFERENT'}"
    )

    sessions = [synthetic_signal(args.steps, c.input_dim, seed=s) for s in range(args.sessions)]
    solo = [model.run(sig[:16])[0] for sig in sessions]
    stacked = BatchState.stack([model.new_state() for _ in sessions])
    batched = np.empty((16, args.sessions, c.output_dim), np.float32)
    for t in range(16):
        stacked, out = model.step(stacked, np.stack([sig[t] for sig in sessions]))
        batched[t] = out
    exact_batch = all(np.array_equal(batched[:, i], solo[i]) for i in range(args.sessions))
    print(
        f"{args.sessions} sessions stepped in one batch: each "
        f"{'bit-identical' if exact_batch else 'DIFFERENT'} to its solo run"
    )
    print(
        f"\nsummary: {per_step_us:.0f} us/step at batch 1; exact restore {exact_restore}; "
        f"batch invariance {exact_batch}"
    )
    return 0 if exact_restore and exact_batch else 1


def _checkpoint(model: MambaModel, batch: BatchState, signal: np.ndarray, step: int) -> Checkpoint:
    return Checkpoint(
        session_id="demo-session",
        step=step,
        model_id=model.name,
        fingerprint=model.fingerprint,
        state=batch.session(0),
        history=InputHistory(1, signal[:step]),
        meta=CheckpointMeta(reason="demo"),
    )


def _fmt(vec: np.ndarray) -> str:
    return "[" + " ".join(f"{v:+.3f}" for v in vec) + "]"


if __name__ == "__main__":
    sys.exit(main())
