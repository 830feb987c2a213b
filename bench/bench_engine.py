"""Engine benchmark: batched step throughput, batch-invariance cost, peers side by side.

Usage (from the repo root; ``./dev bench`` runs this with kizzasi installed)::

    .venv-bench/bin/python bench/bench_engine.py [--skip-130m] [--json OUT.json]

Models (random weights, deterministic):
  signal  signal Mamba, hidden 256, 4 layers, state 16, in/out 8 (the kizzasi peer's dims)
  130m    mamba-130m-shaped MambaForCausalLM: hidden 768, 24 layers, state 16, vocab 50280

For each: median step time at batch 1..256 (steps/s = batch / step time); the same step
with plain ``x @ W.T`` products (fast but not batch-invariant) to show what exactness
costs; and the sgemm ceiling: plain sgemm GFLOP/s measured now on the model's own weight
shapes at 64 rows, divided by the model's matmul FLOPs per session-step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import mamba_130m_model, median_seconds, standard_parser, table, write_result

from ssmserve.server.engine.config import MambaConfig
from ssmserve.server.engine.demo import DemoSpec, demo_config, random_tensors
from ssmserve.server.engine.loader import build_model
from ssmserve.server.engine.mamba import MambaBlockWeights, MambaModel
from ssmserve.server.engine.numerics import RowStableLinear, blas_signature
from ssmserve.server.engine.recurrent_state import BatchState

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def signal_model_config() -> MambaConfig:
    return demo_config(DemoSpec(input_dim=8, output_dim=8, hidden=256, layers=4, state=16))


def signal_model() -> MambaModel:
    config = signal_model_config()
    return build_model(config, random_tensors(config, 0), name="signal-256x4")


def kizzasi_flops(d: int, layers: int, n: int, i: int, o: int, r: int = 8) -> tuple[int, int]:
    """FLOPs of one step of kizzasi 0.2.3's "mamba2" ``Predictor`` (a multiply-add is 2):
    (matrix products, all arithmetic with transcendentals counted as 1).

    Read from its source (cool-japan/kizzasi, kizzasi-core ``ssm.rs``: ``recurrence_step``
    and ``selective_scan_step_into``): an input embedding i -> d, per layer a rank-``r``
    Δ projection d -> r -> d (r = 8, its config default), a per-channel selective scan
    over (d, n) with fixed B and C and a LayerNorm, then a head d -> o. No in_proj,
    out_proj, conv or gate: its work grows linearly in d (54 / 111 / 211 us at d = 128 /
    256 / 512 in an earlier run), where a Mamba block's grows with d x e.
    """
    products = 2 * i * d + 2 * d * o + layers * (4 * d * r + 2 * d * n)
    total = 2 * i * d + 2 * d * o + 9 * d + layers * (4 * d * r + 7 * d * n + 11 * d)
    return products, total


def inputs_for(model: MambaModel, batch: int, rng: np.random.Generator) -> np.ndarray:
    c = model.config
    if c.is_token_model:
        return rng.integers(0, c.vocab_size, batch)
    return rng.standard_normal((batch, c.input_dim)).astype(np.float32)


def step_time(model: MambaModel, batch: int, repeats: int) -> float:
    """Median time of a step of ``batch`` sessions, each step on the state the last one
    made (as a worker steps a batch: the old state is freed after the new one exists)."""
    rng = np.random.default_rng(batch)
    state = BatchState.stack([model.new_state() for _ in range(batch)])
    for _ in range(3):  # leave the all-zero state
        state, _ = model.step(state, inputs_for(model, batch, rng))
    x = inputs_for(model, batch, rng)

    def chained() -> None:
        nonlocal state
        state, _ = model.step(state, x)

    return median_seconds(chained, repeats)


class PlainProducts:
    """Context manager: swap RowStableLinear for plain BLAS ``x @ W.T`` (not batch-invariant).

    ``weights``: each product's ``(o, i)`` matrix by ``id(lin)`` (``plain_weights``)."""

    def __init__(self, weights: dict[int, np.ndarray]) -> None:
        self.weights = weights

    def __enter__(self) -> None:
        self.saved = RowStableLinear.into
        weights = self.weights

        def plain(
            lin: RowStableLinear,
            x: np.ndarray,
            out: np.ndarray,
            rows: int | None = None,
            threads: int = 1,  # BLAS uses its own threads
        ) -> np.ndarray:
            n = x.shape[0] if rows is None else rows
            np.matmul(x[:n], weights[id(lin)].T, out=out[:n])
            if lin.bias is not None:
                out[:n] += lin.bias
            return out

        RowStableLinear.into = plain  # type: ignore[method-assign]
        MambaBlockWeights.fused = False  # the fused mixer calls the exact products itself

    def __exit__(self, *exc: object) -> None:
        RowStableLinear.into = self.saved  # type: ignore[method-assign]
        MambaBlockWeights.fused = True


def plain_weights(model: MambaModel) -> dict[int, np.ndarray]:
    """Every product's ``(o, i)`` weight as a plain array, by ``id(lin)``: rebuilt from the
    packed panels once per model, for the BLAS comparisons."""
    return {id(lin): np.ascontiguousarray(lin.weight) for lin in model.linears}


def memory_bandwidth(repeats: int = 5) -> float:
    """Bytes per second of a large copy (one read + one write of 256 MiB), measured now."""
    src = np.ones(64 * 2**20, np.float32)
    dst = np.empty_like(src)
    return 2 * src.nbytes / median_seconds(lambda: np.copyto(dst, src), repeats)


def products_floor(weights: list[np.ndarray], batch: int, repeats: int) -> float:
    """Seconds for the step's products (``weights``, each (o, i)) done the fastest plain
    way: one matrix-vector product each at batch 1 (``W @ x``), one sgemm each above
    (``x @ W.T``)."""
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((batch, w.shape[1])).astype(np.float32) for w in weights]
    if batch == 1:
        vs = [x[0] for x in xs]
        return median_seconds(lambda: [w @ v for w, v in zip(weights, vs, strict=True)], repeats)
    wts = [w.T for w in weights]
    return median_seconds(lambda: [x @ w for x, w in zip(xs, wts, strict=True)], repeats)


def measure_peer() -> dict[str, float] | None:
    """kizzasi in its own process: in ours, its thread pools (it loads torch when torch is
    installed) spin beside OpenBLAS's on 2 cores and slowed our step ~30x in one run."""
    try:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).parent / "tools" / "kizzasi_peer.py"),
             "--steps", "3000", "--warmup", "300"],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        print("(peer skipped: timed out)")
        return None
    if proc.returncode != 0:
        print(f"(peer skipped: {proc.stderr.strip().splitlines()[-1:]})")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_model(model: MambaModel, big: bool) -> dict[str, object]:
    c = model.config
    print(
        f"\n## {model.name}: {c.architecture}, hidden {c.hidden_size}, {c.num_hidden_layers} "
        f"layers, state {c.state_size}, inner {c.intermediate_size}, out {c.output_dim}"
    )
    rows = []
    results: dict[str, object] = {"model": model.name, "batches": {}}
    bandwidth = memory_bandwidth()
    state_bytes = c.state_bytes
    weights = plain_weights(model)
    # Every engine step first, then every BLAS floor: OpenBLAS's threads spin for a while
    # after a call and took one of the two cores from the engine's second thread (the
    # step at batch 64 measured 5.2 ms right after a BLAS call, 2.7 ms a second later).
    repeats_of = {batch: max(3, (12 if big else 400) // batch) for batch in BATCHES}
    steps = {batch: step_time(model, batch, repeats_of[batch]) for batch in BATCHES}
    for batch in BATCHES:
        repeats = repeats_of[batch]
        t = steps[batch]
        products = products_floor(list(weights.values()), batch, repeats)
        # The goal's floor: the products, plus (batch > 1) one read and one write of the
        # batch's state at the bandwidth measured in this run.
        floor = products + (2 * batch * state_bytes / bandwidth if batch > 1 else 0.0)
        results["batches"][batch] = {  # type: ignore[index]
            "step_ms": t * 1e3,
            "steps_per_s": batch / t,
            "floor_ms": floor * 1e3,
            "products_ms": products * 1e3,
            "vs_floor": t / floor,
        }
        rows.append([batch, t * 1e3, t * 1e6 / batch, batch / t, products * 1e3, floor * 1e3,
                     t / floor])  # fmt: skip
    heads = ["batch", "step ms", "us/session-step", "steps/s", "plain products ms"]
    print(table([*heads, "floor ms", "step / floor"], rows))
    print(
        f"floor: plain matrix-vector products at batch 1, sgemm above, plus one read and one "
        f"write of the batch's state ({state_bytes:,} B/session) at {bandwidth / 1e9:.1f} GB/s "
        f"(a 256 MiB copy, this run); goal: step <= 1.5x floor"
    )
    results["bandwidth_gb_s"] = bandwidth / 1e9

    with PlainProducts(weights):
        plain = {b: step_time(model, b, max(3, (12 if big else 400) // b)) for b in (1, 64)}
    exact = {b: results["batches"][b]["step_ms"] / 1e3 for b in (1, 64)}  # type: ignore[index]
    # sgemm speed on these weights: the floor's own 64-row products, measured above.
    products_64 = results["batches"][64]["products_ms"] / 1e3  # type: ignore[index]
    gflops = 64 * model.flops_per_step / products_64 / 1e9
    ceiling = gflops * 1e9 / model.flops_per_step
    reached = results["batches"][64]["steps_per_s"] / ceiling  # type: ignore[index]
    print(
        table(
            ["what", "batch 1", "batch 64"],
            [
                ["exact (RowStableLinear) step ms", exact[1] * 1e3, exact[64] * 1e3],
                ["plain x @ W.T step ms", plain[1] * 1e3, plain[64] * 1e3],
                ["cost of batch invariance (x)", exact[1] / plain[1], exact[64] / plain[64]],
            ],
        )
    )
    print(
        f"sgemm at 64 rows on these weights: {gflops:.0f} GFLOP/s -> ceiling "
        f"{ceiling:,.0f} steps/s ({model.flops_per_step / 1e6:.2f} MFLOP/step); "
        f"reached at batch 64: {reached:.0%}"
    )
    results.update(
        plain_ms={b: v * 1e3 for b, v in plain.items()},
        sgemm_gflops=gflops,
        ceiling_steps_per_s=ceiling,
        ceiling_fraction_64=reached,
    )
    return results


def main() -> int:
    parser = standard_parser(__doc__)
    parser.add_argument("--skip-130m", action="store_true", help="only the small signal model")
    args = parser.parse_args()
    print(f"# engine benchmark\nBLAS: {blas_signature()}")

    peer_before = measure_peer()
    small = bench_model(signal_model(), big=False)
    peer_after = measure_peer()
    report: dict[str, object] = {"blas": blas_signature(), "signal": small}
    if peer_before and peer_after:
        peer_us = min(peer_before["step_us_p50"], peer_after["step_us_p50"])
        peer_sps = max(peer_before["steps_per_s"], peer_after["steps_per_s"])
        ours_1 = small["batches"][1]["step_ms"] * 1e3  # type: ignore[index]
        ours_64 = small["batches"][64]["steps_per_s"]  # type: ignore[index]
        print("\n## side by side: kizzasi 0.2.3 Predictor (mamba2, hidden 256, 4 layers, state 16)")
        print(
            "(kizzasi's 'mamba2' has no per-layer projections, so it does far fewer FLOPs per "
            "step than a real Mamba block; see BENCHMARKS.md)"
        )
        print(
            table(
                ["figure", "ssmserve", "kizzasi", "ratio", "target"],
                [
                    ["batch-1 step us (p50)", ours_1, peer_us, ours_1 / peer_us, "<= 1.0x"],
                    [
                        "steps/s: ours at 64 vs peer single",
                        ours_64,
                        peer_sps,
                        ours_64 / peer_sps,
                        ">= 5x",
                    ],
                ],
            )
        )
        print(
            f"peer runs before/after ours: {peer_before['step_us_p50']:.0f} / "
            f"{peer_after['step_us_p50']:.0f} us p50"
        )
        # Per FLOP: the same dims do very different work in the two models.
        c = signal_model_config()
        ours_flops = signal_model().flops_per_step
        peer_products, peer_total = kizzasi_flops(
            c.hidden_size, c.num_hidden_layers, c.state_size, c.input_dim, c.output_dim
        )
        ns = {
            "ours": ours_1 * 1e3 / ours_flops,
            "kizzasi, products": peer_us * 1e3 / peer_products,
            "kizzasi, all arithmetic": peer_us * 1e3 / peer_total,
        }
        print(
            table(
                ["batch 1, per FLOP", "FLOPs per step", "ns per FLOP", "kizzasi / ours"],
                [
                    ["ssmserve (matrix products)", ours_flops, ns["ours"], 1.0],
                    ["kizzasi (matrix products)", peer_products, ns["kizzasi, products"],
                     ns["kizzasi, products"] / ns["ours"]],
                    ["kizzasi (all arithmetic)", peer_total, ns["kizzasi, all arithmetic"],
                     ns["kizzasi, all arithmetic"] / ns["ours"]],
                ],
            )
        )  # fmt: skip
        report["kizzasi"] = {"before": peer_before, "after": peer_after, "ns_per_flop": ns}
    else:
        print("\n(kizzasi not installed: run ./dev bench for the side-by-side figures)")
    if not args.skip_130m:
        report["mamba_130m"] = bench_model(mamba_130m_model(), big=True)
    if args.json:
        write_result(args.json, report, line=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
