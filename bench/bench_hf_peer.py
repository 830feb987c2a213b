"""Per-token latency at batch 1, mamba-130m-shaped: ssmserve's engine vs transformers on CPU.

Usage (from the repo root)::

    .venv-bench/bin/python bench/bench_hf_peer.py [--warmup 5] [--tokens 30] [--json OUT.json]

Needs torch and transformers in ``.venv-bench`` (not project dependencies)::

    .venv-bench/bin/pip install torch==2.13.0 transformers==5.24.0

(``torch==2.13.0`` is the local CPU wheel; transformers does not require torch, so this
does not move it.) Without them the script prints one line, writes ``{"skipped": 1, ...}``
and exits 0.

What is measured. One model, the mamba-130m shape of ``harness.mamba_130m_model()``
(hidden 768, 24 layers, state 16, inner 1536, conv 4, Δ rank 48, vocab 50280, tied
embeddings), with the SAME random weights on both sides: the numpy tensors of
``random_tensors(config, 0)`` loaded into ``transformers.MambaForCausalLM`` with a strict
``load_state_dict``. Both are fed the same token ids one at a time from an empty state:

* ssmserve: what the stepper does per tick at batch 1 (``BatchState.stack`` of the
  session's state, ``model.step``, ``.session(0)``), BLAS pinned (``pin_blas_threads``).
* transformers: the recurrent cache path ``generate`` uses (5.x): a ``DynamicCache`` from
  the config, ``use_cache=True``, ``logits_to_keep=1``, the returned ``cache_params`` fed
  back; the first call is the prefill path, later ones the single-token update path.
  ``torch.set_num_threads(2)`` (the machine has 2 cores; ours uses 2 BLAS threads), eval
  mode, ``torch.no_grad()``. Run twice: default, then after ``torch.set_flush_denormal(True)``.

Each side runs in its own subprocess (no shared thread pools or allocator). Per token:
wall time of one call, ``--warmup`` tokens discarded, then p50 / p99 over ``--tokens``.
Agreement: max abs difference of the logits over the timed tokens, ours vs torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    median_seconds,
    peer_skipped,
    percentiles_ms,
    run_peer_child,
    standard_parser,
    table,
    write_result,
)

TORCH_THREADS = 2
TARGET_RATIO = 0.7


def token_ids(vocab: int, count: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, count)


# ---------------------------------------------------------------------------- children


def child_ours(warmup: int, tokens: int, out_dir: Path) -> dict[str, object]:
    from harness import mamba_130m_model

    from ssmserve.server.engine.numerics import blas_signature, pin_blas_threads
    from ssmserve.server.engine.recurrent_state import BatchState

    threads = pin_blas_threads()
    model = mamba_130m_model()
    ids = token_ids(model.config.vocab_size, warmup + tokens)
    state = model.new_state()
    samples: list[float] = []
    logits: list[np.ndarray] = []
    for i, tok in enumerate(ids):
        t0 = time.perf_counter()
        batch, out = model.step(BatchState.stack([state]), np.array([tok]))
        state = batch.session(0)
        elapsed = time.perf_counter() - t0
        if i >= warmup:
            samples.append(elapsed)
            logits.append(np.array(out[0], np.float32))
    np.save(out_dir / "ours.npy", np.stack(logits))

    # Reference point, not an engine: one plain 1-row product per weight matrix, i.e. every
    # weight read once, as batch 1 must (batch-invariant products pad to 16-row tiles).
    rng = np.random.default_rng(1)
    weights = [lin.weight for lin in model.linears]
    xs = [rng.standard_normal((1, w.shape[1])).astype(np.float32) for w in weights]
    gemv = median_seconds(lambda: [x @ w.T for x, w in zip(xs, weights, strict=True)], 10)
    weight_bytes = sum(w.nbytes for w in weights)
    return {
        "samples": samples,
        "blas_threads": threads,
        "blas": blas_signature(),
        "gemv_sweep_s": gemv,
        "weight_bytes": weight_bytes,
    }


def child_torch(warmup: int, tokens: int, out_dir: Path) -> dict[str, object]:
    import torch
    import transformers
    from harness import mamba_130m_model
    from transformers import DynamicCache, MambaForCausalLM
    from transformers import MambaConfig as HFMambaConfig

    from ssmserve.server.engine.demo import random_tensors

    torch.set_num_threads(TORCH_THREADS)
    c = mamba_130m_model().config
    hf_config = HFMambaConfig(
        hidden_size=c.hidden_size,
        state_size=c.state_size,
        num_hidden_layers=c.num_hidden_layers,
        intermediate_size=c.intermediate_size,
        conv_kernel=c.conv_kernel,
        time_step_rank=c.time_step_rank,
        use_bias=c.use_bias,
        use_conv_bias=c.use_conv_bias,
        layer_norm_epsilon=c.layer_norm_epsilon,
        vocab_size=c.vocab_size,
        tie_word_embeddings=c.tie_word_embeddings,
        hidden_act="silu",
    )
    model = MambaForCausalLM(hf_config).to(torch.float32).eval()
    tensors = {k: torch.from_numpy(v) for k, v in random_tensors(c, 0).items()}
    if c.tie_word_embeddings:  # HF's state dict lists the tied head under its own name too
        tensors["lm_head.weight"] = tensors["backbone.embeddings.weight"]
    model.load_state_dict(tensors, strict=True)
    emb, head = model.backbone.embeddings.weight, model.lm_head.weight
    if c.tie_word_embeddings and emb.data_ptr() != head.data_ptr():
        raise RuntimeError("lm_head is not tied to the embeddings after loading")

    ids = torch.from_numpy(token_ids(c.vocab_size, warmup + tokens))

    @torch.no_grad()
    def run(tag: str) -> list[float]:
        cache = DynamicCache(config=model.config)
        samples: list[float] = []
        logits: list[np.ndarray] = []
        for i in range(ids.shape[0]):
            t0 = time.perf_counter()
            out = model(
                input_ids=ids[None, i : i + 1],
                cache_params=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = out.cache_params
            elapsed = time.perf_counter() - t0
            if i >= warmup:
                samples.append(elapsed)
                logits.append(out.logits[0, -1].numpy().astype(np.float32))
        np.save(out_dir / f"{tag}.npy", np.stack(logits))
        return samples

    default = run("torch")
    flushed = bool(torch.set_flush_denormal(True))
    ftz = run("torch_ftz")
    torch.set_flush_denormal(False)
    return {
        "samples": default,
        "samples_ftz": ftz,
        "flush_denormal": flushed,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def run_child(which: str, args: argparse.Namespace, out_dir: Path) -> dict[str, object]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        which,
        "--warmup",
        str(args.warmup),
        "--tokens",
        str(args.tokens),
        "--out-dir",
        str(out_dir),
    ]
    return run_peer_child(cmd)


# ---------------------------------------------------------------------------- parent


def main() -> int:
    parser = standard_parser(__doc__)
    parser.add_argument("--warmup", type=int, default=5, help="tokens discarded first")
    parser.add_argument("--tokens", type=int, default=30, help="tokens timed")
    parser.add_argument("--child", choices=["ours", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        fn = child_ours if args.child == "ours" else child_torch
        print(json.dumps(fn(args.warmup, args.tokens, args.out_dir)))
        return 0

    missing = [name for name in ("torch", "transformers") if find_spec(name) is None]
    if missing:
        return peer_skipped("bench_hf_peer", f"{' and '.join(missing)} not installed", args.json)

    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        ours = run_child("ours", args, out_dir)
        peer = run_child("torch", args, out_dir)
        ours_logits = np.load(out_dir / "ours.npy")
        torch_logits = np.load(out_dir / "torch.npy")
        ftz_logits = np.load(out_dir / "torch_ftz.npy")

    o50, o99 = percentiles_ms(ours["samples"])  # type: ignore[arg-type]
    t50, t99 = percentiles_ms(peer["samples"])  # type: ignore[arg-type]
    f50, f99 = percentiles_ms(peer["samples_ftz"])  # type: ignore[arg-type]
    gemv_ms = float(ours["gemv_sweep_s"]) * 1e3  # type: ignore[arg-type]
    weight_mb = int(ours["weight_bytes"]) / 1e6  # type: ignore[call-overload]
    ratio, ratio99 = o50 / min(t50, f50), o99 / min(t99, f99)
    diff = float(np.abs(ours_logits - torch_logits).max())
    diff_ftz = float(np.abs(ours_logits - ftz_logits).max())
    scale = float(np.abs(torch_logits).max())

    print(
        f"# HF peer: mamba-130m-shaped MambaForCausalLM, batch 1, ms per token "
        f"({args.warmup} warmup, {args.tokens} timed)\n"
        f"ours: numpy engine, {ours['blas']}\n"
        f"torch {peer['torch']}, transformers {peer['transformers']}: "
        f"torch.set_num_threads({TORCH_THREADS}) -> {peer['threads']} threads; "
        f"set_flush_denormal(True) returned {peer['flush_denormal']}\n"
        f"load average before: {load[0]:.2f} (other work on the 2 cores skews p99)"
    )
    print(
        table(
            ["what", "p50 ms", "p99 ms"],
            [
                ["ssmserve engine (stack + step, batch 1)", o50, o99],
                ["transformers (default)", t50, t99],
                ["transformers (flush denormal)", f50, f99],
                [f"ratio ours / faster torch (target <= {TARGET_RATIO}x)", ratio, ratio99],
                [f"ref: plain 1-row x @ W.T over all {weight_mb:.0f} MB of weights", gemv_ms, ""],
            ],
        )
    )
    print(
        f"logits, {args.tokens} timed tokens: max |ours - torch| = {diff:.3g} "
        f"(flush-denormal run {diff_ftz:.3g}); max |logit| = {scale:.3g}, "
        f"relative {diff / scale:.2g}"
    )

    if args.json:
        notes = (
            f"mamba-130m-shaped, random weights (random_tensors seed 0) shared by both; "
            f"batch 1; {args.warmup} warmup + {args.tokens} timed tokens; ours: stack+step at "
            f"batch 1, {ours['blas']}; torch {peer['torch']} transformers "
            f"{peer['transformers']} cache path (DynamicCache, use_cache, logits_to_keep=1, "
            f"pure-torch fallbacks, no mamba_ssm/causal_conv1d), {peer['threads']} threads; "
            f"flush_denormal returned {peer['flush_denormal']}; ratio uses the faster torch "
            f"p50; load average before {load[0]:.2f}"
        )
        report: dict[str, object] = {
            "ours_p50_ms": o50,
            "ours_p99_ms": o99,
            "torch_p50_ms": t50,
            "torch_p99_ms": t99,
            "torch_flush_denormal_p50_ms": f50,
            "torch_flush_denormal_p99_ms": f99,
            "flush_denormal_supported": int(bool(peer["flush_denormal"])),
            "ratio_ours_over_faster_torch_p50": ratio,
            "ratio_ours_over_faster_torch_p99": ratio99,
            "target_ratio": TARGET_RATIO,
            "plain_gemv_sweep_ms": gemv_ms,
            "weight_mb": weight_mb,
            "max_abs_logit_diff": diff,
            "max_abs_logit_diff_flush_denormal": diff_ftz,
            "max_abs_logit": scale,
            "torch_threads": peer["threads"],
            "blas_threads": ours["blas_threads"],
            "warmup_tokens": args.warmup,
            "timed_tokens": args.tokens,
            "load_average_1m": load[0],
            "notes": notes,
        }
        write_result(args.json, report, line=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
