"""The batch-invariant product kernel against another checkout's, side by side in one process.

Usage (from the repo root)::

    .venv/bin/python bench/bench_products.py --baseline-tree PATH [--rounds 7] [--json]

``--baseline-tree`` is another checkout (e.g. ``git worktree add /tmp/base <commit>``); its
``engine/products.py`` is loaded under another module name beside this tree's, so both
kernels run on the same packed weights, interleaved round by round. Shapes: mamba-130m's
in_proj (768 -> 3,072), out_proj (1,536 -> 768) and head (768 -> 50,280) at batch 1, 8 and
64 (the head to 8), one thread. Reported per shape: each kernel's fastest round (ms) and
this tree's time over the baseline's, as the median of the paired rounds and as
min / min. The machine is shared: read the ratios, not the times.

Prints a table, then one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np

REPO = Path(__file__).resolve().parent.parent
PRODUCTS = Path("server/ssmserve/server/engine/products.py")
SHAPES = [(3072, 768), (768, 1536), (50280, 768)]  # (o, i)
BATCHES = (1, 8, 64)
#: Multiply-adds per timed repetition group, so each round lasts ~0.1 s on this machine.
WORK_PER_ROUND = 2e8


def load_products(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def product(k: ModuleType, x: np.ndarray, panels: np.ndarray, out: np.ndarray) -> None:
    """``out = x @ w.T`` by kernel module ``k`` (one without Q8_0 scales, as a baseline
    from before them, takes no scales argument)."""
    no_bias = np.zeros(1, np.float32)
    if hasattr(k, "NO_SCALES"):
        k.product_rows(x, panels, k.NO_SCALES, no_bias, False, 0, x.shape[0], out)
    else:
        k.product_rows(x, panels, no_bias, False, 0, x.shape[0], out)


def time_shape(
    kernels: dict[str, ModuleType], o: int, i: int, b: int, rounds: int
) -> dict[str, float]:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((o, i)).astype(np.float32)  # (o, i)
    x = rng.standard_normal((b, i)).astype(np.float32)  # (b, i)
    out = np.empty((b, o), np.float32)
    panels = {name: k.pack_panels(w) for name, k in kernels.items()}
    reps = max(3, int(WORK_PER_ROUND / (o * i * b)))
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for name, k in kernels.items():  # compile and warm
        product(k, x, panels[name], out)
    for _ in range(rounds):
        for name, k in kernels.items():
            start = time.perf_counter()
            for _ in range(reps):
                product(k, x, panels[name], out)
            times[name].append((time.perf_counter() - start) / reps)
    ours, base = np.array(times["this"]), np.array(times["baseline"])
    return {
        "o": o,
        "i": i,
        "batch": b,
        "this_ms": float(ours.min() * 1e3),
        "baseline_ms": float(base.min() * 1e3),
        "ratio_median": float(np.median(ours / base)),
        "ratio_min": float(ours.min() / base.min()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-tree", type=Path, required=True, help="another checkout")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (7)")
    parser.add_argument("--json", type=Path, help="also write the JSON object here")
    args = parser.parse_args()
    base_path = args.baseline_tree / PRODUCTS
    if not base_path.exists():
        raise SystemExit(f"--baseline-tree {args.baseline_tree}: no {PRODUCTS} there")
    sys.path.insert(0, str(REPO / "server"))
    # numba's cache is keyed by file, not by the module name given here: a cache of its own
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-products-")
    kernels = {
        "this": load_products(REPO / PRODUCTS, "products_this"),
        "baseline": load_products(base_path, "products_baseline"),
    }
    rows = []
    for o, i in SHAPES:
        for b in BATCHES:
            if o * b > 50280 * 8:
                continue
            row = time_shape(kernels, o, i, b, args.rounds)
            rows.append(row)
            print(
                f"{o:>6} x {i:<5} batch {b:>2}: this {row['this_ms']:.3f} ms, baseline "
                f"{row['baseline_ms']:.3f} ms, this / baseline {row['ratio_median']:.3f} "
                f"(median of paired rounds), {row['ratio_min']:.3f} (min / min)",
                flush=True,
            )
    result = {"baseline_tree": str(args.baseline_tree), "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
