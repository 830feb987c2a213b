"""Write a mamba-130m-shaped MambaForCausalLM directory with random weights (nothing is
downloaded): the model ``ssmserve model bench DIR --prefill 512`` is measured on.

Usage (from the repo root)::

    .venv/bin/python bench/make_mamba_130m.py DIR [--seed N]
    .venv/bin/ssmserve model bench DIR --prefill 512 --steps 40 --json

The dims are state-spaces/mamba-130m's (``bench_engine.mamba_130m_config``: hidden 768,
24 layers, state 16, expand 2, conv 4, vocab 50280, tied embeddings, F32); the files are
what ``engine/loader.py`` reads from a Hugging Face checkpoint (``config.json`` and
``model.safetensors`` with ``backbone.*`` tensor names), ~0.5 GB.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import mamba_130m_config

from ssmserve.server.engine.demo import random_tensors
from ssmserve.server.engine.loader import save_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="directory to write config.json and weights to")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (0)")
    args = parser.parse_args()
    config = mamba_130m_config()
    save_model(args.dir, config, random_tensors(config, args.seed))
    print(f"wrote a mamba-130m-shaped model to {args.dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
