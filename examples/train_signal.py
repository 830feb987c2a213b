"""Train a small signal Mamba on a real sensor series with PyTorch, on the CPU, and export it.

The data: a continuous glucose monitor's readings, two channels every 5 minutes
(``cgm_data.py`` says what they are, where they come from and their licence). The task:
one step ahead. At step t the model has seen readings 1..t and predicts reading t+1 (both
channels), so a served session's answer to a reading is its forecast of the next one,
and the model can run ahead on its own outputs (Forecast) or stand in for a bad reading
(a guard's IMPUTE). The first 70% of the readings trains, the next 10% picks the
checkpoint, the last 20% is held out (``bench/bench_signal_model.py``).

The model: :class:`ssmserve.server.export.SignalMamba` with a Mamba-2 backbone, hidden 64,
2 layers, 8 heads of 16, state 16, and per-channel normalisation from the training part.
Training: windows of 256 readings from random places of the training part, the first 64
positions of each only warm the state (no loss); mean squared error of the prediction in
training stds; Adam at 3e-3 with a cosine schedule, 2,000 steps of 32 windows. Seeded and
single-threaded, so a rerun writes the same bytes.

Run (needs ``pip install 'ssmserve[torch]' bokeh-sampledata``; about 13 minutes here)::

    python examples/train_signal.py            # writes examples/models/cgm-mamba
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from cgm_data import HELDOUT, MODEL_DIR, load_series, split

from ssmserve.server.export import SignalMamba, save_signal_model

WINDOW, WARM = 256, 64  # positions per training window; the first WARM have no loss


def one_step_loss(model: SignalMamba, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the prediction of x[:, t+1] from x[:, :t+1], in units of
    the training std, over positions WARM.. of each window (b, t, c)."""
    pred = model(x[:, :-1])  # (b, t-1, c)
    err = (pred - x[:, 1:]) / scale  # (b, t-1, c)
    return (err[:, WARM:] ** 2).mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="optimiser steps")
    parser.add_argument("--batch", type=int, default=32, help="windows per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64, help="hidden size")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", type=Path, default=MODEL_DIR)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the same sums in the same order on every run
    rng = np.random.default_rng(args.seed)

    train, valid, heldout = split(load_series())
    mean, std = train.mean(0), train.std(0)  # (c,)
    model = SignalMamba.create(
        2, 2, arch="mamba2", hidden_size=args.hidden, num_hidden_layers=args.layers,
        state_size=16, num_heads=2 * args.hidden // 16, head_dim=16, n_groups=1, chunk_size=64,
    )  # fmt: skip
    model.set_normalization(mean, std, mean, std)  # predicts the next reading, in its units
    scale = torch.from_numpy(std)
    optimiser = torch.optim.Adam(model.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, args.steps)
    valid_x = torch.from_numpy(valid)[None]  # (1, t, c): one long window
    best, started = float("inf"), time.monotonic()
    for step in range(1, args.steps + 1):
        starts = rng.integers(0, train.shape[0] - WINDOW - 1, args.batch)
        x = torch.from_numpy(np.stack([train[s : s + WINDOW + 1] for s in starts]))  # (b, t, c)
        loss = one_step_loss(model, x, scale)
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        schedule.step()
        if step % 25 == 0 or step == args.steps:
            with torch.no_grad():
                valid_loss = float(one_step_loss(model, valid_x, scale))
            mark = ""
            if valid_loss < best:
                best, mark = valid_loss, " (kept)"
                save_signal_model(model, args.out)
            print(
                f"step {step}: train {loss.item():.5f}, valid {valid_loss:.5f}{mark} "
                f"({time.monotonic() - started:.0f} s)"
            )
    HELDOUT.parent.mkdir(parents=True, exist_ok=True)
    np.save(HELDOUT, heldout)
    print(f"model: {args.out} (validation mse {best:.5f}); held-out readings: {HELDOUT}")


if __name__ == "__main__":
    main()
