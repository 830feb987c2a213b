"""Model directories: strict loading with errors that name the problem; fingerprints."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ssmserve.server.engine.config import MambaConfig
from ssmserve.server.engine.demo import DemoSpec, demo_config, random_tensors
from ssmserve.server.engine.loader import load_model, save_model
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.model_tensors import fingerprint
from ssmserve.server.errors import ModelFormatError, ModelInputError
from tests.conftest import HF_FIXTURES, token_config, write_model

# Pinned so that a change to the fingerprint scheme (which would orphan every stored
# checkpoint) cannot slip in unnoticed. The file's bytes are committed.
BASE_FIXTURE_FINGERPRINT = "ea05052bc9142afc"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    config = demo_config(DemoSpec(hidden=16, layers=2, state=4))
    save_model(tmp_path, config, random_tensors(config, 0))
    return tmp_path


def _rewrite_tensors(directory: Path, edit) -> None:
    tensors = load_file(str(directory / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


def _rewrite_config(directory: Path, edit) -> None:
    raw = json.loads((directory / "config.json").read_text())
    edit(raw)
    (directory / "config.json").write_text(json.dumps(raw))


def test_fingerprint_is_pinned_and_stable() -> None:
    model = load_model(HF_FIXTURES / "base")
    assert model.fingerprint[:16] == BASE_FIXTURE_FINGERPRINT
    assert load_model(HF_FIXTURES / "base").fingerprint == model.fingerprint


def test_fingerprint_covers_config_and_every_weight(model_dir: Path) -> None:
    model = load_model(model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    base = fingerprint(model.config, tensors)
    assert base == model.fingerprint
    for name in ("backbone.layers.1.mixer.D", "output_head.bias"):
        changed = dict(tensors)
        changed[name] = tensors[name].copy()
        changed[name].flat[0] = np.nextafter(changed[name].flat[0], np.float32(np.inf))
        assert fingerprint(model.config, changed) != base, name
    other = MambaConfig(**{**model.config.__dict__, "layer_norm_epsilon": 1e-6})
    assert fingerprint(other, tensors) != base


def test_missing_directory_and_files(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ModelFormatError, match="does not exist"):
        load_model(tmp_path / "nope")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(
        ModelFormatError, match=r"neither model\.safetensors nor model\.safetensors\.index\.json"
    ):
        load_model(model_dir)
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelFormatError, match=r"config\.json' is missing"):
        load_model(model_dir)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda c: c.update(architectures=["GPT2LMHeadModel"], model_type="gpt2"),
            "unsupported architecture",
        ),
        (lambda c: c.pop("hidden_size"), "missing required field 'hidden_size'"),
        (lambda c: c.update(state_size="16"), "'state_size' must be an integer"),
        (lambda c: c.update(num_hidden_layers=0), "'num_hidden_layers' must be in"),
        (lambda c: c.update(use_bias="no"), "'use_bias' must be true or false"),
        (lambda c: c.update(layer_norm_epsilon=2.0), "'layer_norm_epsilon' must be in"),
        (lambda c: c.update(conv_kernel=5), r"conv1d\.weight' has shape"),
        (lambda c: c.update(use_bias=True), r"missing tensor\(s\)"),
        (lambda c: c.update(use_conv_bias=False), r"unexpected tensor\(s\)"),
    ],
)
def test_bad_config(model_dir: Path, edit, message: str) -> None:
    _rewrite_config(model_dir, edit)
    with pytest.raises(ModelFormatError, match=message):
        load_model(model_dir)


def test_config_not_json(model_dir: Path) -> None:
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="not valid JSON"):
        load_model(model_dir)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.pop("backbone.layers.1.mixer.A_log"),
            r"missing tensor\(s\) backbone\.layers\.1\.mixer\.A_log",
        ),
        (lambda t: t.update(extra=np.zeros(3, np.float32)), r"unexpected tensor\(s\) extra"),
        (
            lambda t: t.update({"backbone.norm_f.weight": np.ones(17, np.float32)}),
            r"norm_f\.weight' has shape \[17\], config needs \[16\]",
        ),
        (
            lambda t: t["backbone.layers.0.mixer.D"].__setitem__(3, np.nan),
            r"mixer\.D' contains NaN or Inf",
        ),
        (
            lambda t: t["input_proj.weight"].__setitem__((0, 0), np.inf),
            r"input_proj\.weight' contains NaN",
        ),
        (lambda t: t.update({"backbone.layers.0.mixer.D": np.ones(32, np.int32)}), "has dtype I32"),
    ],
)
def test_bad_tensors(model_dir: Path, edit, message: str) -> None:
    _rewrite_tensors(model_dir, edit)
    with pytest.raises(ModelFormatError, match=message):
        load_model(model_dir)


def test_not_a_safetensors_file(model_dir: Path) -> None:
    (model_dir / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelFormatError, match="not a valid safetensors file"):
        load_model(model_dir)


def test_half_precision_weights_are_converted(model_dir: Path) -> None:
    _rewrite_tensors(model_dir, lambda t: t.update({k: v.astype(np.float16) for k, v in t.items()}))
    model = load_model(model_dir)
    assert model.blocks[0].D.dtype == np.float32


def test_tied_head_present_in_file_is_ignored(tmp_path: Path) -> None:
    config = token_config(tie_word_embeddings=True)
    tensors = random_tensors(config, 1)
    save_model(tmp_path, config, tensors)
    _rewrite_tensors(
        tmp_path, lambda t: t.update({"lm_head.weight": np.zeros((37, 24), np.float32)})
    )
    model = load_model(tmp_path)
    # One copy of the matrix: the head's panels, which the embedding lookup reads.
    assert model.embeddings is None
    assert np.array_equal(model.head.weight, tensors["backbone.embeddings.weight"])


def test_time_step_rank_auto_is_ceil_hidden_over_16(tmp_path: Path) -> None:
    write_model(tmp_path / "r3", token_config(hidden_size=40, time_step_rank=3))
    _rewrite_config(tmp_path / "r3", lambda c: c.update(time_step_rank="auto"))
    assert load_model(tmp_path / "r3").config.time_step_rank == 3  # ceil(40 / 16)
    write_model(tmp_path / "r2", token_config(hidden_size=40, time_step_rank=2))
    _rewrite_config(tmp_path / "r2", lambda c: c.update(time_step_rank="auto"))
    with pytest.raises(ModelFormatError, match=r"x_proj\.weight' has shape"):
        load_model(tmp_path / "r2")


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (np.zeros((2, 4), np.float32), r"shape \(batch, 5\)"),
        (np.zeros((2, 5, 1), np.float32), r"shape \(batch, 5\)"),
        (np.array([[np.nan, 0, 0, 0, 0]], np.float32), "NaN or Inf"),
        (np.array([[np.inf, 0, 0, 0, 0]], np.float32), "NaN or Inf"),
        (np.array([["a"] * 5]), "must be numbers"),
    ],
)
def test_signal_input_errors(signal_model: MambaModel, inputs: np.ndarray, message: str) -> None:
    with pytest.raises(ModelInputError, match=message):
        signal_model.check_inputs(inputs)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (np.array([0.5]), "integer token ids"),
        (np.array([[1, 2]]), "integer token ids"),
        (np.array([37]), r"token id 37 is outside \[0, 37\)"),
        (np.array([3, -1]), "token id -1"),
    ],
)
def test_token_input_errors(token_model: MambaModel, inputs: np.ndarray, message: str) -> None:
    with pytest.raises(ModelInputError, match=message):
        token_model.check_inputs(inputs)


def test_batch_size_mismatch(signal_model: MambaModel) -> None:
    with pytest.raises(ModelInputError, match="inputs for 2 sessions, state has 3"):
        signal_model.check_inputs(np.zeros((2, 5), np.float32), batch=3)


def test_check_state(signal_model: MambaModel, token_model: MambaModel) -> None:
    signal_model.check_state(signal_model.new_state())
    with pytest.raises(ModelInputError, match="layers"):
        signal_model.check_state(token_model.new_state())


def _too_big_for_this_machine(directory: Path) -> int:
    """A config.json (no weights) of a Mamba LM needing twice the memory available here
    even if its weights were BF16 kept 16-bit; returns the bytes it needs at least."""
    from ssmserve.server.engine.machine_memory import available_memory
    from ssmserve.server.engine.model_tensors import load_bytes

    have = available_memory()
    if have is None:
        pytest.skip("no MemAvailable to read here (not Linux)")
    # two layers of the model, at the least a load of it can take (BF16 weights kept)
    two = token_config(hidden_size=4096, intermediate_size=8192, num_hidden_layers=2,
                       time_step_rank=256, vocab_size=8)  # fmt: skip
    per_layer = load_bytes(two, None, True) // 2
    layers = min(4096, 2 * (2 * have // per_layer + 1))
    config = token_config(hidden_size=4096, intermediate_size=8192, num_hidden_layers=layers,
                          time_step_rank=256, vocab_size=8)  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_json()))
    need = load_bytes(config, None, True)
    assert need > have
    return need


def test_a_model_bigger_than_the_available_memory_is_refused_before_it_is_read(tmp_path):
    from ssmserve.server.errors import InsufficientMemoryError

    need = _too_big_for_this_machine(tmp_path / "big")
    # no model.safetensors at all: the refusal comes before any file of weights is opened
    with pytest.raises(
        InsufficientMemoryError, match=r"'big' needs about [\d.]+ GiB of memory to load"
    ) as err:
        load_model(tmp_path / "big")
    assert f"{need / 2**30:.1f} GiB" in str(err.value) and "GiB is available here" in str(err.value)
    assert err.value.reason == "INSUFFICIENT_MEMORY"


def test_the_server_refuses_at_start_a_model_bigger_than_the_available_memory(tmp_path):
    import os
    import subprocess
    import sys

    _too_big_for_this_machine(tmp_path / "big")
    result = subprocess.run(
        [sys.executable, "-m", "ssmserve.server.main", "--model", f"big={tmp_path / 'big'}",
         "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "SSMSERVE_LOG_LEVEL": "WARNING"},
    )  # fmt: skip
    assert result.returncode != 0
    assert "needs about" in result.stderr and "GiB is available here" in result.stderr, (
        result.stderr
    )
    assert "listening" not in result.stdout
