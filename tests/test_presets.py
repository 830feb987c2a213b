"""Presets at released checkpoints' shapes (issue 48), the streaming writer that writes the
big ones one tensor at a time, and init-demo's disk and memory checks.

The published fields below are copied from each checkpoint's ``config.json`` (as public
code quotes it: the fields the engine reads, and the ones it must ignore, such as
falcon-mamba-7b's ``expand`` of 16 beside its explicit ``intermediate_size``); each preset
must be what the engine parses from it, and what transformers' config class makes of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tracemalloc

import numpy as np
import pytest

from ssmserve.server import cli
from ssmserve.server.engine import presets
from ssmserve.server.engine.config import MambaConfig
from ssmserve.server.engine.demo import DemoSpec, demo_config, random_tensor
from ssmserve.server.engine.loader import (
    bf16_bits,
    load_model,
    read_config,
    read_weights,
    save_model,
    save_model_streamed,
    weights_file_bytes,
)
from ssmserve.server.engine.model_tensors import expected_shapes
from ssmserve.server.engine.numerics import widened
from ssmserve.server.engine.presets import PresetDoesNotFit, check_room, preset_needs

#: state-spaces/mamba-2.8b-hf config.json (its MambaConfig fields; no tie_word_embeddings:
#: transformers' default, tied).
MAMBA_2_8B_HF = {
    "architectures": ["MambaForCausalLM"], "model_type": "mamba", "conv_kernel": 4,
    "expand": 2, "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 5120,
    "layer_norm_epsilon": 1e-05, "num_hidden_layers": 64, "state_size": 16,
    "time_step_rank": 160, "use_bias": False, "use_conv_bias": True, "vocab_size": 50280,
}  # fmt: skip
#: tiiuae/falcon-mamba-7b config.json (no mixer_rms_eps: FalconMambaConfig's default).
FALCON_MAMBA_7B = {
    "architectures": ["FalconMambaForCausalLM"], "model_type": "falcon_mamba",
    "conv_kernel": 4, "expand": 16, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 8192, "layer_norm_epsilon": 1e-05, "num_hidden_layers": 64,
    "state_size": 16, "tie_word_embeddings": False, "time_step_rank": 256,
    "use_bias": False, "use_conv_bias": True, "vocab_size": 65024,
}  # fmt: skip
#: mistralai/Mamba-Codestral-7B-v0.1 config.json.
CODESTRAL_MAMBA_7B = {
    "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2", "chunk_size": 256,
    "conv_kernel": 4, "expand": 2, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 8192, "layer_norm_epsilon": 1e-05,
    "n_groups": 8, "num_heads": 128, "num_hidden_layers": 64, "state_size": 128,
    "tie_word_embeddings": False, "time_step_limit": [0.0, math.inf], "time_step_rank": 256,
    "use_bias": False, "use_conv_bias": True, "vocab_size": 32768,
}  # fmt: skip
PUBLISHED = {
    "mamba-2.8b": MAMBA_2_8B_HF,
    "falcon-mamba-7b": FALCON_MAMBA_7B,
    "mamba-codestral-7b": CODESTRAL_MAMBA_7B,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_big_presets_are_their_checkpoints_configs(name):
    assert presets.preset_config(name) == MambaConfig.from_json(PUBLISHED[name])
    assert presets.PRESET_DTYPES[name] == "BF16"


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_big_presets_are_what_transformers_makes_of_the_configs(name):
    """Field by field against transformers' own config class built from the published
    config.json (which field wins where two disagree, defaults for the absent ones)."""
    transformers = pytest.importorskip("transformers")
    raw = {k: v for k, v in PUBLISHED[name].items() if k not in ("architectures", "model_type")}
    classes = {
        "mamba": transformers.MambaConfig,
        "falcon_mamba": transformers.FalconMambaConfig,
        "mamba2": transformers.Mamba2Config,
    }
    theirs = classes[PUBLISHED[name]["model_type"]](**raw)
    ours = presets.preset_config(name)
    fields = [
        "hidden_size", "intermediate_size", "num_hidden_layers", "state_size", "conv_kernel",
        "vocab_size", "tie_word_embeddings", "use_bias", "use_conv_bias", "layer_norm_epsilon",
    ]  # fmt: skip
    if ours.mamba_version == 2:
        fields += ["num_heads", "head_dim", "n_groups"]
        assert tuple(theirs.time_step_limit) == ours.time_step_limit
    else:
        fields += ["time_step_rank"]
    if name == "falcon-mamba-7b":
        fields += ["mixer_rms_eps"]
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}


def test_the_preset_table_and_the_cli_name_the_same_presets():
    assert cli.PRESETS == tuple(presets.PRESETS) == tuple(presets.PRESET_DTYPES)
    needs = {name: preset_needs(name) for name in presets.PRESETS}
    # presets.py's table: stored bytes (GB), parameters (M), state per session (MiB)
    assert {n: round(v.disk / 1e9, 2) for n, v in needs.items()} == {
        "mamba-130m": 0.52, "mamba2-130m": 0.52, "mamba-790m": 3.17, "mamba-2.8b": 5.54,
        "falcon-mamba-7b": 14.55, "mamba-codestral-7b": 14.57,
    }  # fmt: skip
    params = {
        n: round(sum(math.prod(s) for s in expected_shapes(c).values()) / 1e6)
        for n, c in presets.PRESETS.items()
    }
    assert params["mamba-2.8b"] == 2768
    assert params["falcon-mamba-7b"] == 7273
    assert params["mamba-codestral-7b"] == 7285
    assert {n: round(c.state_bytes / 2**20, 1) for n, c in presets.PRESETS.items()} == {
        "mamba-130m": 2.8, "mamba2-130m": 18.7, "mamba-790m": 11.2, "mamba-2.8b": 25.0,
        "falcon-mamba-7b": 40.0, "mamba-codestral-7b": 266.0,
    }  # fmt: skip


# ---------------------------------------------------------------- the streaming writer

SMALL = {
    "mamba": dataclasses.replace(
        presets.preset_config("mamba-2.8b"),
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=100,
        time_step_rank=4,
    ),
    "falcon-mamba": dataclasses.replace(
        presets.preset_config("falcon-mamba-7b"),
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=100,
        time_step_rank=8,
    ),
    "codestral-mamba2": dataclasses.replace(
        presets.preset_config("mamba-codestral-7b"),
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=96,
        num_heads=8, head_dim=16, state_size=16,
    ),
    "signal-normalised": dataclasses.replace(
        demo_config(DemoSpec(hidden=32, layers=2, arch="mamba2", head_dim=16, groups=2)),
        input_normalization=True, output_normalization=True,
    ),
}  # fmt: skip


def _source(config: MambaConfig, seed: int):  # type: ignore[no-untyped-def]
    return lambda name, shape: random_tensor(config, seed, name, shape)


@pytest.mark.parametrize("kind", sorted(SMALL))
def test_a_streamed_model_loads_as_its_description(tmp_path, kind):
    """What save_model_streamed writes is a model directory load_model reads back: the
    config it was given, every tensor the BF16 rounding of what the source gave, the
    fingerprint it returned, the size weights_file_bytes said, and the very bytes
    save_model writes of the same tensors held whole."""
    config = SMALL[kind]
    out = tmp_path / "m"
    fp = save_model_streamed(out, config, _source(config, 5))
    assert read_config(out).canonical() == config.canonical()  # the fields of its math
    model = load_model(out)
    assert model.fingerprint == fp
    assert (out / "model.safetensors").stat().st_size == weights_file_bytes(config, "BF16")
    tensors = read_weights(out, config, keep_bf16=True)
    shapes = expected_shapes(config)
    made = {name: random_tensor(config, 5, name, shape) for name, shape in shapes.items()}
    for name, values in made.items():
        assert values.dtype == np.float32 and np.isfinite(values).all(), name
        np.testing.assert_array_equal(widened(tensors[name]), widened(bf16_bits(values)), name)
    save_model(tmp_path / "whole", config, made, dtype="BF16")
    assert (tmp_path / "whole" / "model.safetensors").read_bytes() == (
        out / "model.safetensors"
    ).read_bytes()


def test_streamed_weights_are_deterministic_from_the_seed(tmp_path):
    config = SMALL["falcon-mamba"]
    first = save_model_streamed(tmp_path / "a", config, _source(config, 1))
    again = save_model_streamed(tmp_path / "b", config, _source(config, 1))
    other = save_model_streamed(tmp_path / "c", config, _source(config, 2))
    assert first == again != other
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()


def test_a_streamed_f32_model_holds_the_values_exactly(tmp_path):
    config = SMALL["mamba"]
    fp = save_model_streamed(tmp_path / "m", config, _source(config, 3), dtype="F32")
    assert load_model(tmp_path / "m").fingerprint == fp
    tensors = read_weights(tmp_path / "m", config)
    for name, shape in expected_shapes(config).items():
        np.testing.assert_array_equal(tensors[name], random_tensor(config, 3, name, shape))
    assert (tmp_path / "m" / "model.safetensors").stat().st_size == weights_file_bytes(
        config, "F32"
    )


def test_the_writer_holds_one_tensor_not_the_model(tmp_path):
    """tracemalloc's peak while writing a model of many tensors: its largest tensor (as
    the source makes it, float32) and the temporaries of rounding and hashing one chunk of
    it (a few copies of the chunk), far below the model."""
    from ssmserve.server.engine.loader import _WRITE_CHUNK_VALUES

    config = dataclasses.replace(SMALL["mamba"], hidden_size=256, intermediate_size=512,
                                 num_hidden_layers=24, time_step_rank=16)  # fmt: skip
    shapes = expected_shapes(config)
    total = 4 * sum(math.prod(s) for s in shapes.values())
    largest = 4 * max(math.prod(s) for s in shapes.values())
    chunk = min(largest, 4 * _WRITE_CHUNK_VALUES)
    tracemalloc.start()
    try:
        save_model_streamed(tmp_path / "m", config, _source(config, 0))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < largest + 4 * chunk + (1 << 20), (peak, largest)
    assert peak < total / 8, (peak, total)


def test_a_failed_write_leaves_nothing_behind(tmp_path):
    config = SMALL["mamba"]

    def source(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name.startswith("backbone.layers.1."):
            raise OSError(28, "No space left on device")
        return random_tensor(config, 0, name, shape)

    with pytest.raises(OSError):
        save_model_streamed(tmp_path / "m", config, source)
    assert list((tmp_path / "m").iterdir()) == []


# ---------------------------------------------------------------- init-demo's checks

GB, GIB = 10**9, 2**30


def test_a_preset_that_does_not_fit_on_the_disk_is_refused_with_the_figures():
    with pytest.raises(PresetDoesNotFit) as refused:
        check_room("falcon-mamba-7b", "/data/m", free_disk=10 * GB, available_memory=None)
    assert str(refused.value) == (
        "preset falcon-mamba-7b is 14.55 GB on disk (BF16) and 10.00 GB is free in /data/m: "
        "it needs 15.62 GB free (the file and 1.07 GB to spare); free some space, or write "
        "it to another disk"
    )
    assert check_room("falcon-mamba-7b", "/data/m", 16 * GB, None) == ""


def test_a_preset_that_fits_in_memory_only_as_q8_0_is_written_with_a_note():
    needs = preset_needs("falcon-mamba-7b")
    assert (round(needs.memory / GIB, 1), round(needs.memory_q8 / GIB, 1)) == (17.3, 10.5)
    note = check_room("falcon-mamba-7b", "m", free_disk=100 * GB, available_memory=12 * GIB)
    assert note == (
        "note: preset falcon-mamba-7b needs about 17.3 GiB of memory to load as stored "
        "(BF16, kept 16-bit) and 12.0 GiB is available here; with --quantize q8_0 (Q8_0 "
        "weights) it needs about 10.5 GiB, which fits: serve it with "
        "`ssmserve-server --quantize q8_0`"
    )
    assert check_room("falcon-mamba-7b", "m", 100 * GB, available_memory=18 * GIB) == ""


def test_a_preset_that_could_not_be_loaded_here_is_refused_with_the_figures():
    with pytest.raises(PresetDoesNotFit) as refused:
        check_room("mamba-codestral-7b", "m", free_disk=100 * GB, available_memory=6 * GIB)
    assert str(refused.value) == (
        "preset mamba-codestral-7b needs about 16.5 GiB of memory to load as stored (BF16, "
        "kept 16-bit) and 6.0 GiB is available here, and about 9.7 GiB even with "
        "--quantize q8_0: it could not be served here; free memory, or write it on a "
        "machine with more"
    )


def test_init_demo_writes_a_bf16_preset_tensor_by_tensor(tmp_path, monkeypatch, capsys):
    """The command's path for the big presets, at a small size: checked, streamed,
    fingerprint printed without loading, and the model loads with that fingerprint."""
    from ssmserve.server import offline_commands

    monkeypatch.setitem(presets.PRESETS, "falcon-mamba-7b", SMALL["falcon-mamba"])
    args = argparse.Namespace(
        dir=tmp_path / "m", force=False, preset="falcon-mamba-7b", **cli.DEMO_DEFAULTS
    )
    args.seed = 4
    offline_commands.init_demo(args)
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    model = load_model(tmp_path / "m")
    assert printed == (
        f"wrote falcon-mamba-7b-shaped language model (random weights, BF16) to "
        f"{tmp_path / 'm'} (fingerprint {model.fingerprint[:16]})"
    )
    assert model.config == SMALL["falcon-mamba"]
    assert model.fingerprint == save_model_streamed(
        tmp_path / "again", model.config, _source(model.config, 4)
    )
