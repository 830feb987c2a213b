"""Q8_0 accuracy: ssmserve's ``quantize="q8_0"`` against llama.cpp's Q8_0 file, each
measured against the float32 model on the same weights.

Usage (from the repo root; the peer and converter as in ``bench/bench_llama_cpp.py``)::

    .venv/bin/python bench/bench_q8_accuracy.py --model MODEL_DIR \\
        [--converter CONVERT_HF_TO_GGUF] [--peer-python PEER/bin/python] \\
        [--arch mamba|mamba2] [--json OUT.json]

Four children answer the same 16 logit rows (the last of a 16-token prompt's prefill,
then 15 decode steps, random real token ids): ssmserve on the float32 directory, ssmserve
with ``quantize="q8_0"``, llama.cpp on the F32 GGUF and llama.cpp on the Q8_0 GGUF
(``convert_hf_to_gguf.py --outtype f32 / q8_0``, written next to the model when missing).
The error of each 8-bit engine is the largest absolute logit difference from its own
float32 run (``*_vs_own_f32``), and from ssmserve's float32 run (``*_vs_ssmserve_f32``),
with the largest |logit| for scale. The goal: ssmserve's error no worse than llama.cpp's.

Why they differ: both quantise the weights alike (the same bytes, ``tests/test_q8_weights.py``);
llama.cpp also rounds each activation row to Q8_0 before its integer dot products, while
ssmserve keeps activations float32 and widens the weights exactly.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from harness import standard_parser, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_llama_cpp import DEFAULT_PEER, TOKEN_LIMIT, Child, skipped

ROWS = 16


def _gguf(args: argparse.Namespace, outtype: str) -> Path | None:
    """The model's GGUF of ``outtype`` next to it, written by the converter if missing."""
    path = args.model.parent / f"{args.model.name}-{outtype}.gguf"
    if path.is_file():
        return path
    if not args.converter or not Path(args.converter).is_file():
        return None
    cmd = [args.peer_python, args.converter, str(args.model), "--outtype", outtype]
    subprocess.run([*cmd, "--outfile", str(path)], check=True, timeout=1800)
    return path


def _child_args(args: argparse.Namespace, gguf: Path, quantize: str) -> argparse.Namespace:
    return argparse.Namespace(model=args.model, gguf=gguf, quantize=quantize)


def main() -> int:
    parser = standard_parser(__doc__)
    parser.add_argument("--model", type=Path, required=True, help="HF-format model directory")
    parser.add_argument(
        "--converter",
        default=os.environ.get("LLAMA_CPP_CONVERTER"),
        help="llama.cpp's convert_hf_to_gguf.py ($LLAMA_CPP_CONVERTER)",
    )
    parser.add_argument("--peer-python", default=DEFAULT_PEER)
    parser.add_argument("--arch", choices=("mamba", "mamba2"), default="mamba")
    args = parser.parse_args()
    if not Path(args.peer_python).is_file():
        return skipped(f"no llama.cpp peer interpreter at {args.peer_python}", args.json)
    if not args.model.joinpath("config.json").is_file():
        maker = Path(__file__).resolve().parent / "tools" / "make_mamba_130m.py"
        subprocess.run([sys.executable, str(maker), str(args.model), "--arch", args.arch],
                       check=True, timeout=600)  # fmt: skip
    ggufs = {outtype: _gguf(args, outtype) for outtype in ("f32", "q8_0")}
    if None in ggufs.values():
        return skipped("no GGUFs of the model and no converter (--converter)", args.json)
    rng = np.random.default_rng(0)
    logits: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory(prefix="bench-q8-") as tmp:
        ids = Path(tmp) / "ids.npz"
        np.savez(ids, prompt=rng.integers(0, TOKEN_LIMIT, ROWS),
                 decode=rng.integers(0, TOKEN_LIMIT, ROWS - 1), saves=np.zeros(1),
                 batch=rng.integers(0, TOKEN_LIMIT, (1, 2)))  # fmt: skip
        runs = {
            "ssmserve_f32": ("ours", sys.executable, ggufs["f32"], "none"),
            "ssmserve_q8_0": ("ours", sys.executable, ggufs["f32"], "q8_0"),
            "llama_cpp_f32": ("llama", args.peer_python, ggufs["f32"], "none"),
            "llama_cpp_q8_0": ("llama", args.peer_python, ggufs["q8_0"], "none"),
        }
        # llama.cpp's AMX repacking of Q8_0 crashes on CPUs with AMX (0.3.36): plain
        # buffers for both of its runs (the same arithmetic otherwise)
        env = {"BENCH_LLAMA_NO_EXTRA_BUFTS": "1"}
        for name, (kind, python, gguf, quantize) in runs.items():
            assert gguf is not None
            child = Child(kind, python, _child_args(args, gguf, quantize), ids, env)
            out = Path(tmp) / f"{name}.npy"
            child.ask(op="check", path=str(out), steps=ROWS - 1)
            child.close()
            logits[name] = np.load(out).astype(np.float64)
    vocab = min(v.shape[1] for v in logits.values())
    rows = {k: v[:, :vocab] for k, v in logits.items()}

    def err(a: str, b: str) -> float:
        return float(np.max(np.abs(rows[a] - rows[b])))

    report: dict[str, Any] = {
        "arch": args.arch,
        "model": str(args.model),
        "rows": ROWS,
        "max_abs_logit": float(np.max(np.abs(rows["ssmserve_f32"]))),
        "ssmserve_q8_0_vs_own_f32": err("ssmserve_q8_0", "ssmserve_f32"),
        "llama_cpp_q8_0_vs_own_f32": err("llama_cpp_q8_0", "llama_cpp_f32"),
        "ssmserve_q8_0_vs_ssmserve_f32": err("ssmserve_q8_0", "ssmserve_f32"),
        "llama_cpp_q8_0_vs_ssmserve_f32": err("llama_cpp_q8_0", "ssmserve_f32"),
        "f32_engines_apart": err("llama_cpp_f32", "ssmserve_f32"),
    }
    report["error_ratio"] = report["ssmserve_q8_0_vs_own_f32"] / report["llama_cpp_q8_0_vs_own_f32"]
    report["goal_met"] = report["error_ratio"] <= 1.0
    for key, value in report.items():
        print(f"{key:32} {value}")
    if args.json:
        write_result(args.json, report, line=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
