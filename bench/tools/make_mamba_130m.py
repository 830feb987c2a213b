"""Write a mamba-130m-shaped (or mamba2-130m-shaped) causal LM directory with random
weights (nothing is downloaded): the model ``ssmserve model bench DIR --prefill 512`` is
measured on.

The same model as ``ssmserve model init-demo DIR --preset mamba-130m|mamba2-130m``.
Usage (from the repo root)::

    .venv/bin/python bench/tools/make_mamba_130m.py DIR [--arch mamba|mamba2] [--seed N]
    .venv/bin/ssmserve model bench DIR --prefill 512 --steps 40 --json

``--arch mamba`` (the default): state-spaces/mamba-130m's dims
(``harness.config_for("mamba")``: hidden 768, 24 layers, state 16, expand 2, conv 4,
vocab 50280, tied embeddings). ``--arch mamba2``: state-spaces/mamba2-130m's dims
(``harness.config_for("mamba2")``: hidden 768, 24 layers, state 128, head dim 64 so 24
heads, 1 group, expand 2, conv 4, tied embeddings) with its padded vocab of 50288 (a
multiple of 16, as its checkpoint and llama.cpp's converter have it). The files are what
``engine/loader.py`` reads from a Hugging Face checkpoint (``config.json`` and
``model.safetensors`` with ``backbone.*`` tensor names, F32), ~0.5 GB.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import config_for, write_preset_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="directory to write config.json and weights to")
    parser.add_argument(
        "--arch", choices=("mamba", "mamba2"), default="mamba", help="Mamba-1 or Mamba-2 (mamba)"
    )
    parser.add_argument("--seed", type=int, default=0, help="weights seed (0)")
    args = parser.parse_args()
    write_preset_model(args.dir, config_for(args.arch), args.seed)
    print(f"wrote a {args.arch}-130m-shaped model to {args.dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
