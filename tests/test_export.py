"""A signal model trained in PyTorch, exported (``ssmserve.server.export``) and served.

The reference is the real PyTorch forward of the module (transformers' ``MambaModel`` /
``Mamba2Model`` inside :class:`SignalMamba`), never a copy of its math. The bar: the
outputs a worker answers over 256 streamed steps are within 1e-5 of the module's own,
scaled by max |output|."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from ssmserve.client.sync import Client

torch = pytest.importorskip("torch", reason="the export needs ssmserve[torch]")
transformers = pytest.importorskip("transformers", reason="the export needs ssmserve[torch]")

from ssmserve.server.engine.loader import load_model  # noqa: E402
from ssmserve.server.errors import ModelFormatError  # noqa: E402
from ssmserve.server.export import (  # noqa: E402
    ExportError,
    SignalMamba,
    save_signal_model,
    stream_reference,
)

REPO = Path(__file__).resolve().parents[1]
STEPS = 256
IN, OUT = 3, 2
MAMBA2 = {"num_heads": 8, "head_dim": 16, "n_groups": 2, "expand": 2}
# Channels far from zero and of unlike scales, as sensors give them: the normalisation
# then matters, and a wrong one shows.
IN_MEAN, IN_STD = np.array([20.0, -3.0, 1013.0]), np.array([4.0, 0.25, 9.0])
OUT_MEAN, OUT_STD = np.array([18.0, 0.5]), np.array([3.0, 0.05])


def _module(arch: str, normalized: bool, seed: int) -> SignalMamba:
    torch.manual_seed(seed)  # random init, as transformers initialises the backbone
    model = SignalMamba.create(
        IN,
        OUT,
        arch=arch,
        hidden_size=64,
        num_hidden_layers=2,
        **(MAMBA2 if arch == "mamba2" else {}),
    )
    if normalized:
        model.set_normalization(IN_MEAN, IN_STD, OUT_MEAN, OUT_STD)
    return model.eval()


def _inputs(normalized: bool) -> np.ndarray:
    x = np.random.default_rng(7).standard_normal((STEPS, IN))
    return (x * IN_STD + IN_MEAN if normalized else x).astype(np.float32)  # (t, i)


@pytest.fixture(scope="module")
def exported(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, np.ndarray, np.ndarray]]:
    """name -> (model dir, inputs (t, i), the module's own outputs (t, o))."""
    root = tmp_path_factory.mktemp("exported")
    out: dict[str, tuple[Path, np.ndarray, np.ndarray]] = {}
    for seed, (arch, normalized) in enumerate(
        [("mamba", False), ("mamba", True), ("mamba2", False), ("mamba2", True)]
    ):
        name = f"{arch}{'-norm' if normalized else ''}"
        model = _module(arch, normalized, seed)
        save_signal_model(model, root / name)
        x = _inputs(normalized)
        out[name] = (root / name, x, stream_reference(model, x))
    # The parts-based call: a module people built themselves from the same parts.
    for arch, seed in (("mamba", 10), ("mamba2", 11)):
        name = f"parts-{arch}"
        model = _module(arch, True, seed)
        save_signal_model(
            backbone=model.backbone,
            input_proj=model.input_proj,
            output_head=model.output_head,
            out_dir=root / name,
            input_mean=IN_MEAN,
            input_std=IN_STD,
            output_mean=OUT_MEAN,
            output_std=OUT_STD,
        )
        x = _inputs(True)
        out[name] = (root / name, x, stream_reference(model, x))
    return out


def _scaled_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_exported_models_served_by_ssmserve_server_match_the_pytorch_forward(exported, tmp_path):
    """Done-when of issue 47 part 1: ``ssmserve-server --model NAME=DIR`` (the real
    process, on its embedded Redis) streams 256 steps of each exported model, Mamba-1 and
    Mamba-2, with and without normalisation, from the module and from its parts."""
    args = [sys.executable, "-m", "ssmserve.server.main", "--listen", "127.0.0.1:0"]
    args += ["--data-dir", str(tmp_path / "data")]
    for name, (directory, _, _) in exported.items():
        args += ["--model", f"{name}={directory}"]
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "SSMSERVE_LOG_LEVEL": "WARNING"},
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("ssmserve-server listening on "), proc.stderr.read()
        with Client(line.split()[-1]) as client:
            for name, (_, x, want) in exported.items():
                session = client.create_session(name)
                got = np.stack([o.output for o in client.stream_steps(session, x)])  # (t, o)
                assert got.shape == want.shape
                assert _scaled_error(got, want) <= 1e-5, name
                client.close_session(session)
    finally:
        proc.terminate()
        proc.wait(30)


def test_stepping_and_prefill_of_an_exported_model_agree_bit_for_bit(exported):
    for name, (directory, x, want) in exported.items():
        model = load_model(directory)
        stepped, _ = model.run(x)
        prefilled, _ = model.prefill(x)
        assert stepped.tobytes() == prefilled.tobytes(), name
        assert _scaled_error(stepped, want) <= 1e-5, name


def test_normalisation_is_in_the_directory_and_the_fingerprint(exported):
    plain, normed = load_model(exported["mamba"][0]), load_model(exported["mamba-norm"][0])
    assert plain.input_norm is None and plain.output_norm is None
    assert normed.input_norm is not None and normed.output_norm is not None
    np.testing.assert_array_equal(normed.input_norm.std, IN_STD.astype(np.float32))
    np.testing.assert_array_equal(normed.output_norm.mean, OUT_MEAN.astype(np.float32))
    assert plain.config.canonical().get("input_normalization") is None
    assert normed.config.canonical()["input_normalization"] is True


def test_what_cannot_be_represented_exactly_is_refused_by_name(tmp_path):
    model = _module("mamba", False, 0)
    parts = {"input_proj": model.input_proj, "output_head": model.output_head}

    lm = transformers.MambaForCausalLM(
        transformers.MambaConfig(hidden_size=64, num_hidden_layers=1, vocab_size=8)
    )
    with pytest.raises(ExportError, match=r"MambaForCausalLM \(pass its \.backbone\)"):
        save_signal_model(backbone=lm, out_dir=tmp_path / "a", **parts)

    gelu = transformers.MambaModel(
        transformers.MambaConfig(
            hidden_size=64, num_hidden_layers=1, vocab_size=1, hidden_act="gelu"
        )
    )
    with pytest.raises(ExportError, match="hidden_act is 'gelu'"):
        save_signal_model(backbone=gelu, out_dir=tmp_path / "b", **parts)

    config = transformers.MambaConfig(hidden_size=64, num_hidden_layers=1, vocab_size=1)
    config.attention_sink = 4  # a field the engine does not read
    with pytest.raises(ExportError, match="sets attention_sink, which the engine does not read"):
        save_signal_model(backbone=transformers.MambaModel(config), out_dir=tmp_path / "c", **parts)

    wide = _module("mamba", False, 0).double()
    with pytest.raises(ExportError, match=r"torch.float64.*model.float\(\) first"):
        save_signal_model(wide, tmp_path / "d")

    class Other(SignalMamba):
        def forward(self, x):
            return super().forward(x) * 2

    other = Other(IN, OUT, transformers.MambaConfig(hidden_size=64, num_hidden_layers=1))
    with pytest.raises(ExportError, match="Other is not a SignalMamba"):
        save_signal_model(other, tmp_path / "e")

    with pytest.raises(ExportError, match=r"an nn\.Linear is required"):
        save_signal_model(
            backbone=model.backbone,
            input_proj=torch.nn.Sequential(model.input_proj),
            output_head=model.output_head,
            out_dir=tmp_path / "f",
        )
    narrow = torch.nn.Linear(IN, 32)
    with pytest.raises(
        ExportError, match="input_proj gives 32 features; the backbone's hidden_size is 64"
    ):
        save_signal_model(
            backbone=model.backbone,
            input_proj=narrow,
            output_head=model.output_head,
            out_dir=tmp_path / "g",
        )
    with pytest.raises(ExportError, match=r"input_std\[1\] is 0.0; every std must be > 0"):
        save_signal_model(
            backbone=model.backbone, **parts, out_dir=tmp_path / "h",
            input_mean=[0, 0, 0], input_std=[1, 0, 1],
        )  # fmt: skip
    with pytest.raises(ExportError, match="needs both output_mean and output_std"):
        save_signal_model(
            backbone=model.backbone, **parts, out_dir=tmp_path / "i", output_mean=[0, 0]
        )
    assert not any((tmp_path / d).exists() for d in "abcdefghi")  # nothing half-written


def test_a_linear_without_bias_exports_as_a_zero_bias(tmp_path):
    model = _module("mamba", False, 3)
    head = torch.nn.Linear(64, OUT, bias=False)
    head.weight.data.copy_(model.output_head.weight.data)
    model.output_head.bias.data.zero_()
    save_signal_model(
        backbone=model.backbone,
        input_proj=model.input_proj,
        output_head=head,
        out_dir=tmp_path / "m",
    )
    x = _inputs(False)
    got, _ = load_model(tmp_path / "m").run(x)
    assert _scaled_error(got, stream_reference(model, x)) <= 1e-5


def test_a_directory_with_a_nonpositive_std_does_not_load(exported, tmp_path):
    from safetensors.numpy import load_file, save_file

    directory = tmp_path / "bad"
    directory.mkdir()
    source = exported["mamba-norm"][0]
    (directory / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    tensors["output_norm.std"] = np.array([1.0, -0.5], np.float32)
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(
        ModelFormatError, match=r"output_norm.std: channel 1 is .*-0.5.*must be > 0"
    ):
        load_model(directory)


def test_the_plain_install_does_not_pull_torch_or_transformers():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=!~;\[ ]", r)[0] for r in project["dependencies"]]
    assert "torch" not in names and "transformers" not in names
    extra = [re.split(r"[<>=!~;\[ ]", r)[0] for r in project["optional-dependencies"]["torch"]]
    assert extra == ["torch", "transformers"]
    # Serving an exported model imports neither: the worker and the CLI stay without them.
    probe = (
        "import sys, ssmserve.server.main, ssmserve.server.worker, ssmserve.client.cli; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_normalised_module_round_trips_through_its_state_dict():
    trained = _module("mamba2", True, 5)
    fresh = _module("mamba2", False, 6)
    fresh.load_state_dict(trained.state_dict())
    x = _inputs(True)
    assert np.array_equal(stream_reference(fresh, x), stream_reference(trained, x))
