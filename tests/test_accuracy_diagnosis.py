"""The accuracy diagnosis (``bench/tools/accuracy_diagnosis.py``) re-implements the Mamba-1 step
in float64 with the engine's kernels swappable piece by piece; its figures in
BENCHMARKS.md mean something only if, with every piece swapped in, it is the engine."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from tests.conftest import token_config, write_model

REPO = Path(__file__).resolve().parent.parent


def _diagnosis() -> ModuleType:
    path = REPO / "bench" / "tools" / "accuracy_diagnosis.py"
    spec = importlib.util.spec_from_file_location("accuracy_diagnosis", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["accuracy_diagnosis"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def diagnosis() -> ModuleType:
    return _diagnosis()


def test_every_piece_swapped_in_is_the_engine_bit_for_bit(
    diagnosis: ModuleType, tmp_path: Path
) -> None:
    # k of 96 and 160: the products and the head span more than one 64-term block
    config = token_config(
        hidden_size=96, intermediate_size=160, use_bias=False, vocab_size=101, time_step_rank=6
    )
    model = write_model(tmp_path, config, seed=3)
    ids = (np.arange(9) * 13) % 101
    engine, _ = model.run(ids)  # (T, v) float32
    weights = diagnosis.Weights(tmp_path)
    logits = diagnosis.forward(weights, ids, diagnosis._config(set(diagnosis.PIECES)))
    assert np.array_equal(logits.astype(np.float32).view(np.uint32), engine.view(np.uint32))
    # and the float64 re-implementation is the same model, to float32's precision
    exact = diagnosis.forward(weights, ids, diagnosis._config(set()))
    np.testing.assert_allclose(exact, engine, rtol=1e-4, atol=1e-4)
    # one fma chain over all of k is another order: other bits
    chain = diagnosis.forward(
        weights,
        ids,
        diagnosis._config(set(diagnosis.PIECES) - {"products", "head"}, products="chain",
                          head="chain"),
    )  # fmt: skip
    assert not np.array_equal(chain.astype(np.float32), engine)
