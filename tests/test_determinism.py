"""Same weights + same inputs -> the same bits, in this process and in fresh ones."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from ssmserve.server.engine.loader import load_model
from tests.conftest import HF_FIXTURES

REPO = Path(__file__).resolve().parent.parent

_SCRIPT = """
import hashlib, sys
import numpy as np
from ssmserve.server.engine.loader import load_model
from ssmserve.server.engine.demo import DemoSpec, demo_config, random_tensors
from ssmserve.server.engine.loader import save_model
m = load_model(sys.argv[1])
ids = np.load(sys.argv[1] + "/ids.npy")
out, state = m.run(ids)
h = hashlib.sha256(out.tobytes())
for layer in state.layers:
    h.update(layer.conv.tobytes()); h.update(layer.ssm.tobytes())
print(m.fingerprint, h.hexdigest())
"""


def _digest_here(case: Path) -> tuple[str, str]:
    model = load_model(case)
    out, state = model.run(np.load(case / "ids.npy"))
    h = hashlib.sha256(out.tobytes())
    for layer in state.layers:
        h.update(layer.conv.tobytes())
        h.update(layer.ssm.tobytes())
    return model.fingerprint, h.hexdigest()


def test_bit_identical_across_runs_and_processes() -> None:
    case = HF_FIXTURES / "k5_deep"
    here = _digest_here(case)
    assert _digest_here(case) == here
    for hash_seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        result = subprocess.run(
            [sys.executable, "-c", _SCRIPT, str(case)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert tuple(result.stdout.split()) == here
