"""The trained signal model's one-step prediction error on held-out data, beside baselines.

The model is ``examples/models/cgm-mamba`` (``examples/train_signal.py``: a SignalMamba
trained on the first 70% of a continuous glucose monitor's readings); the data is the
held-out last 20% (``examples/data/cgm-heldout.npy``). Each method predicts reading t+1
from readings 1..t of the held-out stream:

- **last value**: reading t;
- **linear AR(p)**: one least-squares linear model of readings t-p+1..t (both channels)
  plus a bias, fitted on the same training part as the model (``--ar-orders``; the best
  order on held-out data is reported, which favours the baseline);
- **ssmserve**: the served engine stepping the exported model from a fresh state.

The first ``--warm`` readings only warm each method up (no error counted). Error: mean
absolute error per channel, in units of the channel's training std, and its mean over
channels (the headline). Needs the training part, so ``bokeh-sampledata`` (its source).

    python bench/bench_signal_model.py --json bench/results/signal_model.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from harness import standard_parser, write_result

REPO = Path(__file__).resolve().parents[1]
MODEL = "ssmserve (cgm-mamba)"
sys.path.insert(0, str(REPO / "examples"))

from cgm_data import HELDOUT, MODEL_DIR, load_series, split  # noqa: E402

from ssmserve.server.engine.loader import load_model  # noqa: E402


def ar_design(x: np.ndarray, p: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows [x_(t-p+1) .. x_t, 1] (t - p + 1, p c + 1) and targets x_(t+1) (t - p + 1, c)."""
    t = x.shape[0]
    lags = [x[p - 1 - k : t - 1 - k] for k in range(p)]  # each (t - p, c)
    return np.concatenate([*lags, np.ones((t - p, 1))], axis=1), x[p:]


def ar_predictions(train: np.ndarray, test: np.ndarray, p: int) -> np.ndarray:
    """Predictions of test[t+1] for t = p-1 .. T-2: (T - p, c)."""
    a, b = ar_design(train.astype(np.float64), p)
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    rows, _ = ar_design(test.astype(np.float64), p)
    return rows @ coef


def scaled_errors(pred: np.ndarray, want: np.ndarray, std: np.ndarray) -> dict[str, list[float]]:
    """Per channel, in units of its training std: mean absolute and root mean square."""
    err = (pred - want) / std  # (t, c)
    return {
        "mae": [float(v) for v in np.abs(err).mean(axis=0)],
        "rmse": [float(v) for v in np.sqrt((err**2).mean(axis=0))],
    }


def main() -> None:
    parser = standard_parser(__doc__)
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    parser.add_argument("--warm", type=int, default=64)
    parser.add_argument("--ar-orders", default="1,2,4,8,16,32")
    args = parser.parse_args()

    train, _, heldout = split(load_series())
    committed = np.load(HELDOUT)
    if committed.tobytes() != heldout.tobytes():
        sys.exit(f"{HELDOUT} is not the held-out part of the data set: run train_signal.py")
    std = train.std(axis=0)
    t, w = heldout.shape[0], args.warm
    want = heldout[w + 1 :]  # readings w+2 .. T: (T - w - 1, c)
    results: dict[str, dict[str, list[float]]] = {}
    results["last value"] = scaled_errors(heldout[w:-1], want, std)
    best_ar: tuple[float, int, dict[str, list[float]]] | None = None
    for p in (int(v) for v in args.ar_orders.split(",")):
        pred = ar_predictions(train, heldout, p)[w - p + 1 :]  # from reading w+1 on
        errors = scaled_errors(pred, want, std)
        mae = float(np.mean(errors["mae"]))
        print(f"  AR({p}): MAE {mae:.5f}, RMSE {np.mean(errors['rmse']):.5f}")
        if best_ar is None or mae < best_ar[0]:
            best_ar = (mae, p, errors)
    assert best_ar is not None
    results[f"linear AR({best_ar[1]})"] = best_ar[2]
    outputs, _ = load_model(args.model).run(heldout)  # (T, c): output t predicts t+1
    results[MODEL] = scaled_errors(outputs[w:-1], want, std)

    print(f"one-step error on {t - w - 1:,} held-out readings, in training stds")
    print(f"{'method':<24} {'MAE isig':>9} {'glucose':>8} {'mean':>7} {'RMSE mean':>10}")
    for name, errors in results.items():
        mae = errors["mae"]
        print(
            f"{name:<24} {mae[0]:>9.4f} {mae[1]:>8.4f} {np.mean(mae):>7.4f} "
            f"{np.mean(errors['rmse']):>10.4f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = {
            "readings": t - w - 1,
            "errors_over_std": {
                name: {kind: {"channels": v, "mean": float(np.mean(v))} for kind, v in e.items()}
                for name, e in results.items()
            },
            "model": MODEL,
            "ar_order": best_ar[1],
        }
        write_result(args.json, out, line=False)


if __name__ == "__main__":
    main()
