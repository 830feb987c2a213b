"""Accuracy at real shapes: ssmserve's float32 logits and transformers' float32 step path,
each against a float64 reference, on random-weight models at released checkpoints' shapes.

Usage (from the repo root)::

    .venv/bin/python bench/bench_accuracy.py [--models DIR] [--presets mamba-130m,...]
        [--tokens 16] [--peer-python PY] [--diagnose] [--json OUT.json]

The models are ``ssmserve model init-demo DIR --preset NAME`` (seed 0), written into
``--models`` (default ``/work/peers/models`` where it exists, else ``bench/results/models``)
when missing: mamba-130m (0.5 GB), mamba2-130m (0.5 GB), mamba-790m (3.2 GB).

The peer is torch + transformers in a virtual environment of its own (never the
project's): ``--peer-python`` (default ``$ACCURACY_PEER_PYTHON`` or
``/work/peers/llama/bin/python``, torch 2.13 CPU, transformers 4.57.6). Without it the
script says so, writes ``{"skipped": 1, ...}`` and exits 0. Every side runs in a child
process of its own (one model in memory at a time: mamba-790m in float64 is 6.3 GB), and
they exchange ``.npy`` files.

What is measured, per preset, on ``--tokens`` random token ids (below 50277) from a fresh
state, every position's logits:

* ssmserve: ``MambaModel.run`` (the engine's float32 step, one token at a time).
* transformers float32: ``*ForCausalLM`` in float32 through its step path
  (``use_cache=True``, the returned cache fed back, one token per call).
* the reference: the same transformers model in float64, step path, with its float32
  casts turned off. transformers computes parts of a float64 model in float32 whatever
  the model's dtype: ``residual_in_fp32`` (default True) keeps the residual stream in
  float32, ``MambaRMSNorm`` normalises in float32, ``A = -exp(A_log.float())``, B and x
  are cast with ``.float()``, Mamba-2's ``A`` with ``.to(torch.float32)``, and the
  logits are returned ``.float()``. In the reference child ``Tensor.float`` and
  ``Tensor.to(float32)`` of a float64 tensor return it unchanged and
  ``residual_in_fp32`` is off, so every operation is float64. The as-shipped float64
  model (casts on) is run too and reported as ``shipped_f64``: its own error against the
  true float64 reference says how much a reference with the casts would blur.

Reported per preset: the largest absolute logit error over all positions and the vocab
against the reference, of ssmserve and of transformers float32, their ratio, the largest
|logit| (scale), and in how many of the positions the argmax agrees with the reference's.

``--diagnose`` (Mamba-1 presets) adds the attribution of bench/tools/accuracy_diagnosis.py: a
float64 re-implementation of the engine's step in which ssmserve's float32 kernels are
swapped in one piece at a time (see that module).

Prints a table, then one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PEER = "/work/peers/llama/bin/python"
SHARED_MODELS = Path("/work/peers/models")
PRESETS = ("mamba-130m", "mamba2-130m", "mamba-790m")
#: Token ids below this are real tokens of the GPT-NeoX vocabulary.
TOKEN_LIMIT = 50277


def token_ids(count: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, TOKEN_LIMIT, count).astype(np.int64)


# ----------------------------------------------------------------------------- children


def child_ours(model_dir: Path, ids_path: Path, out_path: Path) -> None:
    """ssmserve's engine, float32, one token at a time (``MambaModel.run``)."""
    sys.path.insert(0, str(REPO))
    from ssmserve.server.engine.loader import load_model

    model = load_model(model_dir)
    logits, _ = model.run(np.load(ids_path))
    np.save(out_path, logits)


def child_torch(model_dir: Path, ids_path: Path, out_path: Path, mode: str) -> None:
    """transformers' step path: ``mode`` float32, shipped_f64 (float64 weights, its float32
    casts on) or reference (float64 throughout)."""
    import torch
    import transformers
    from safetensors import safe_open

    torch.set_num_threads(2)
    config = json.loads((model_dir / "config.json").read_text())
    arch = config["architectures"][0]
    cls = getattr(transformers, arch)
    cfg = cls.config_class.from_pretrained(model_dir)
    dtype = torch.float32 if mode == "float32" else torch.float64
    if mode == "reference":
        cfg.residual_in_fp32 = False
        _float64_throughout(torch, transformers)
    # Built on the meta device in the target dtype and filled tensor by tensor: mamba-790m
    # in float64 is 6.3 GB, and neither a float32 copy nor the whole file mapped at once
    # comes on top of it.
    torch.set_default_dtype(dtype)
    with torch.device("meta"):
        model = cls(cfg)
    # .to(dtype): parameters __init__ makes in a dtype of its own (A_log is float32) too
    model = model.to_empty(device="cpu").to(dtype)
    params = dict(model.named_parameters())
    weights = model_dir / "model.safetensors"
    with safe_open(weights, framework="pt") as f:
        names = list(f.keys())
    for name in names:
        with safe_open(weights, framework="pt") as f, torch.no_grad():
            params[name].copy_(f.get_tensor(name))
    model.tie_weights()
    head, emb = model.lm_head.weight, model.get_input_embeddings().weight
    assert head.data_ptr() == emb.data_ptr(), "the head is not tied to the embeddings"
    # Buffers transformers builds in __init__ (none hold weights here) were left empty by
    # to_empty: a model with any would need them re-initialised.
    assert not list(model.buffers()), [n for n, _ in model.named_buffers()]
    model.eval()
    ids = torch.from_numpy(np.load(ids_path)).reshape(1, -1)
    rows = []
    with torch.no_grad():
        out = model(input_ids=ids[:, :1], use_cache=True)
        rows.append(out.logits[0, -1].double().numpy())
        for t in range(1, ids.shape[1]):
            out = model(
                input_ids=ids[:, t : t + 1],
                cache_params=out.cache_params,
                use_cache=True,
                # as ``generate`` counts: the prefill's conv_kernel positions, then one
                # more per token (the conv cache writes its last column from there on)
                cache_position=torch.tensor([cfg.conv_kernel - 1 + t]),
            )
            rows.append(out.logits[0, -1].double().numpy())
    np.save(out_path, np.stack(rows))


def _float64_throughout(torch: Any, transformers: Any) -> None:
    """Turn off the float32 casts transformers applies to a float64 Mamba model."""
    to, to_float = torch.Tensor.to, torch.Tensor.float
    f32, f64 = torch.float32, torch.float64

    def keep_to(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.dtype == f64:
            args = tuple(f64 if a is f32 else a for a in args)
            if kwargs.get("dtype") is f32:
                kwargs["dtype"] = f64
        return to(self, *args, **kwargs)

    def keep_float(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self if self.dtype == f64 else to_float(self, *args, **kwargs)

    torch.Tensor.to = keep_to
    torch.Tensor.float = keep_float


# ----------------------------------------------------------------------------- parent


def default_models() -> Path:
    return SHARED_MODELS if SHARED_MODELS.is_dir() else REPO / "bench" / "results" / "models"


def ensure_model(models: Path, preset: str) -> Path:
    """``models/preset``, written by ``ssmserve model init-demo --preset`` when missing."""
    directory = models / preset
    if not (directory / "model.safetensors").exists():
        print(f"writing {directory} (ssmserve model init-demo --preset {preset})", flush=True)
        cli = Path(sys.executable).parent / "ssmserve"
        subprocess.run(
            [str(cli), "model", "init-demo", str(directory), "--preset", preset, "--force"],
            check=True,
        )
    return directory


def run_child(python: str, args: list[str]) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="2")
    subprocess.run([python, str(Path(__file__).resolve()), *args], check=True, env=env)


def compare(logits: np.ndarray, reference: np.ndarray) -> dict[str, Any]:
    diff = np.abs(logits.astype(np.float64) - reference)
    agree = logits.argmax(axis=1) == reference.argmax(axis=1)
    return {
        "max_abs": float(diff.max()),
        "mean_abs": float(diff.mean()),
        "argmax_agree": int(agree.sum()),
        "positions": int(agree.size),
    }


def measure(preset: str, model_dir: Path, peer: str, tokens: int, work: Path) -> dict[str, Any]:
    ids_path = work / "ids.npy"
    np.save(ids_path, token_ids(tokens))
    paths = {name: work / f"{preset}-{name}.npy" for name in ("ours", "float32", "shipped_f64",
                                                              "reference")}  # fmt: skip
    run_child(
        sys.executable, ["--child", "ours", str(model_dir), str(ids_path), str(paths["ours"])]
    )
    for mode in ("reference", "shipped_f64", "float32"):
        run_child(peer, ["--child", mode, str(model_dir), str(ids_path), str(paths[mode])])
    reference = np.load(paths["reference"])
    result: dict[str, Any] = {"tokens": tokens, "max_abs_logit": float(np.abs(reference).max())}
    for name in ("ours", "float32", "shipped_f64"):
        result[name] = compare(np.load(paths[name]), reference)
    result["ours_over_float32"] = result["ours"]["max_abs"] / result["float32"]["max_abs"]
    # The errors as the issue measured them: against the float64 model with its casts on.
    shipped = np.load(paths["shipped_f64"])
    result["against_shipped_f64"] = {
        name: compare(np.load(paths[name]), shipped)["max_abs"] for name in ("ours", "float32")
    }
    np.save(work / f"{preset}-reference-keep.npy", reference)
    return result


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import standard_parser, write_result

    parser = standard_parser(__doc__)
    parser.add_argument("--models", type=Path, default=None, help="model cache directory")
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated presets")
    parser.add_argument("--tokens", type=int, default=16, help="token ids per run (16)")
    parser.add_argument(
        "--peer-python",
        default=os.environ.get("ACCURACY_PEER_PYTHON", DEFAULT_PEER),
        help="python of the venv with torch and transformers",
    )
    parser.add_argument("--diagnose", action="store_true", help="attribute ssmserve's error")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("child_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model_dir, ids_path, out_path = (Path(a) for a in args.child_args)
        if args.child == "ours":
            child_ours(model_dir, ids_path, out_path)
        else:
            child_torch(model_dir, ids_path, out_path, args.child)
        return 0

    peer = Path(args.peer_python)
    if not peer.exists():
        reason = f"no peer python at {peer} (torch + transformers; --peer-python)"
        print(f"bench_accuracy.py: skipped ({reason})")
        result = {"skipped": 1, "notes": f"skipped: {reason}"}
        if args.json:
            write_result(args.json, result, line=False)
        print(json.dumps(result))
        return 0
    models = args.models or default_models()
    presets = [p for p in args.presets.split(",") if p]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ssmserve-accuracy-") as tmp:
        work = Path(tmp)
        for preset in presets:
            model_dir = ensure_model(models, preset)
            results[preset] = measure(preset, model_dir, str(peer), args.tokens, work)
            if args.diagnose and not preset.startswith("mamba2"):
                sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))
                from accuracy_diagnosis import diagnose

                reference = np.load(work / f"{preset}-reference-keep.npy")
                ids = np.load(work / "ids.npy")
                engine = np.load(work / f"{preset}-ours.npy")
                results[preset]["diagnosis"] = diagnose(model_dir, ids, reference, engine)
    print_table(results)
    summary = {"presets": results, "peer": str(peer), "models": str(models)}
    if args.json:
        write_result(args.json, summary, line=False)
    print(json.dumps(summary))
    return 0


def print_table(results: dict[str, Any]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import table

    rows = []
    for preset, r in results.items():
        rows.append([
            preset,
            f"{r['ours']['max_abs']:.3g}",
            f"{r['float32']['max_abs']:.3g}",
            f"{r['ours_over_float32']:.2f}",
            f"{r['ours']['argmax_agree']}/{r['ours']['positions']}",
            f"{r['float32']['argmax_agree']}/{r['float32']['positions']}",
            f"{r['shipped_f64']['max_abs']:.3g}",
            f"{r['max_abs_logit']:.3g}",
        ])  # fmt: skip
    print(table(
        ["preset", "ssmserve max abs", "transformers f32", "ratio", "ssmserve argmax",
         "transformers argmax", "f64 with casts", "max |logit|"],
        rows,
    ))  # fmt: skip
    for preset, r in results.items():
        for name, err in r.get("diagnosis", {}).get("table", []):
            print(f"  {preset}: {name}: {err:.3g}")


if __name__ == "__main__":
    raise SystemExit(main())
