"""Read and write model directories: ``config.json`` + ``model.safetensors``.

Two layouts share the residual blocks (tensor names follow Hugging Face ``MambaForCausalLM``):

=============================================  ==============  ===========================
tensor                                          shape           when
=============================================  ==============  ===========================
``backbone.embeddings.weight``                  (v, d)          token models
``input_proj.weight`` / ``.bias``               (d, i) / (d,)   signal models
``backbone.layers.{l}.norm.weight``             (d,)
``backbone.layers.{l}.mixer.in_proj.weight``    (2e, d)         ``.bias`` (2e,) if use_bias
``backbone.layers.{l}.mixer.conv1d.weight``     (e, 1, k)       ``.bias`` (e,) if use_conv_bias
``backbone.layers.{l}.mixer.x_proj.weight``     (r + 2n, e)     never a bias
``backbone.layers.{l}.mixer.dt_proj.weight``    (e, r)          ``.bias`` (e,) always
``backbone.layers.{l}.mixer.A_log``             (e, n)
``backbone.layers.{l}.mixer.D``                 (e,)
``backbone.layers.{l}.mixer.out_proj.weight``   (d, e)          ``.bias`` (d,) if use_bias
``backbone.norm_f.weight``                      (d,)
``lm_head.weight``                              (v, d)          token models, unless tied
``output_head.weight`` / ``.bias``              (o, d) / (o,)   signal models
=============================================  ==============  ===========================

Loading is strict: a missing, unexpected, misshapen, non-float or non-finite tensor is a
:class:`~ssmserve.server.errors.ModelFormatError` that names it. Weights are converted to float32.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from ssmserve.client.atomic_file import atomic_write
from ssmserve.server.engine.config import MambaConfig
from ssmserve.server.engine.mamba import MambaBlockWeights, MambaModel
from ssmserve.server.engine.numerics import RowStableLinear, pin_blas_threads
from ssmserve.server.errors import ModelFormatError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

_FLOAT_DTYPES = {"F16", "F32", "F64"}


def expected_shapes(config: MambaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model directory must hold, with its shape."""
    c = config
    d, e, n, k, r = (
        c.hidden_size,
        c.intermediate_size,
        c.state_size,
        c.conv_kernel,
        c.time_step_rank,
    )
    shapes: dict[str, tuple[int, ...]] = {}
    if c.is_token_model:
        shapes["backbone.embeddings.weight"] = (c.vocab_size, d)
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, d)
    else:
        shapes["input_proj.weight"] = (d, c.input_dim)
        shapes["input_proj.bias"] = (d,)
        shapes["output_head.weight"] = (c.output_dim, d)
        shapes["output_head.bias"] = (c.output_dim,)
    for layer in range(c.num_hidden_layers):
        p = f"backbone.layers.{layer}."
        shapes[p + "norm.weight"] = (d,)
        shapes[p + "mixer.in_proj.weight"] = (2 * e, d)
        shapes[p + "mixer.conv1d.weight"] = (e, 1, k)
        shapes[p + "mixer.x_proj.weight"] = (r + 2 * n, e)
        shapes[p + "mixer.dt_proj.weight"] = (e, r)
        shapes[p + "mixer.dt_proj.bias"] = (e,)
        shapes[p + "mixer.A_log"] = (e, n)
        shapes[p + "mixer.D"] = (e,)
        shapes[p + "mixer.out_proj.weight"] = (d, e)
        if c.use_bias:
            shapes[p + "mixer.in_proj.bias"] = (2 * e,)
            shapes[p + "mixer.out_proj.bias"] = (d,)
        if c.use_conv_bias:
            shapes[p + "mixer.conv1d.bias"] = (e,)
    shapes["backbone.norm_f.weight"] = (d,)
    return shapes


def fingerprint(config: MambaConfig, tensors: dict[str, np.ndarray]) -> str:
    """sha256 over the canonical config and every tensor (name, shape, float32 bytes)."""
    h = hashlib.sha256()
    h.update(b"ssmserve-model-v1\0")
    h.update(json.dumps(config.canonical(), sort_keys=True).encode())
    for name in sorted(expected_shapes(config)):
        arr = np.ascontiguousarray(tensors[name], dtype="<f4")
        h.update(f"\0{name}\0{arr.shape}\0".encode())
        h.update(memoryview(arr).cast("B"))
    return h.hexdigest()


def load_model(directory: str | os.PathLike[str], name: str | None = None) -> MambaModel:
    """Load and validate a model directory. ``name`` defaults to the directory's name."""
    path = Path(directory)
    config = read_config(path)
    tensors = read_tensors(path / WEIGHTS_FILE, config)
    return build_model(config, tensors, name=name or path.resolve().name)


def read_config(directory: Path) -> MambaConfig:
    if not directory.is_dir():
        raise ModelFormatError(f"model directory {str(directory)!r} does not exist")
    cfg_path = directory / CONFIG_FILE
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFormatError(f"{str(cfg_path)!r} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{str(cfg_path)!r} is not valid JSON: {exc}") from None
    return MambaConfig.from_json(raw)


def read_tensors(path: Path, config: MambaConfig) -> dict[str, np.ndarray]:
    """Read the tensors ``config`` needs from a safetensors file, checked and as float32."""
    want = expected_shapes(config)
    if not path.is_file():
        raise ModelFormatError(f"{str(path)!r} is missing")
    tensors: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(path), framework="numpy") as f:
            present = set(f.keys())
            # A tied LM head stored anyway is ignored, as transformers does.
            tolerated = {"lm_head.weight"} if config.is_token_model else set()
            missing = sorted(set(want) - present)
            unexpected = sorted(present - set(want) - tolerated)
            if missing:
                raise ModelFormatError(
                    f"{path.name}: missing tensor(s) {', '.join(missing[:5])}"
                    + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                )
            if unexpected:
                raise ModelFormatError(
                    f"{path.name}: unexpected tensor(s) {', '.join(unexpected[:5])} "
                    f"for a {config.architecture} model with this config"
                )
            for name, shape in want.items():
                dtype = f.get_slice(name).get_dtype()
                if dtype not in _FLOAT_DTYPES:
                    raise ModelFormatError(
                        f"{path.name}: tensor {name!r} has dtype {dtype}; "
                        f"supported: {', '.join(sorted(_FLOAT_DTYPES))}"
                    )
                arr = f.get_tensor(name)
                if arr.shape != shape:
                    raise ModelFormatError(
                        f"{path.name}: tensor {name!r} has shape {list(arr.shape)}, "
                        f"config needs {list(shape)}"
                    )
                arr = np.ascontiguousarray(arr, dtype=np.float32)
                if not np.isfinite(arr).all():
                    raise ModelFormatError(f"{path.name}: tensor {name!r} contains NaN or Inf")
                tensors[name] = arr
    except SafetensorError as exc:
        raise ModelFormatError(f"{path.name}: not a valid safetensors file: {exc}") from None
    except OSError as exc:
        raise ModelFormatError(f"{path.name}: cannot read: {exc}") from None
    return tensors


def build_model(config: MambaConfig, tensors: dict[str, np.ndarray], name: str) -> MambaModel:
    """Assemble a :class:`MambaModel` from checked float32 tensors."""
    pin_blas_threads()
    t = tensors
    blocks = []
    for layer in range(config.num_hidden_layers):
        p = f"backbone.layers.{layer}.mixer."
        blocks.append(
            MambaBlockWeights(
                norm=t[f"backbone.layers.{layer}.norm.weight"],
                in_proj=RowStableLinear(t[p + "in_proj.weight"], t.get(p + "in_proj.bias")),
                conv_weight=np.ascontiguousarray(t[p + "conv1d.weight"][:, 0, :]),  # (e, k)
                conv_bias=t.get(p + "conv1d.bias"),
                x_proj=RowStableLinear(t[p + "x_proj.weight"]),
                dt_proj=RowStableLinear(t[p + "dt_proj.weight"], t[p + "dt_proj.bias"]),
                A=-np.exp(t[p + "A_log"]),  # (e, n)
                D=t[p + "D"],
                out_proj=RowStableLinear(t[p + "out_proj.weight"], t.get(p + "out_proj.bias")),
            )
        )
    if config.is_token_model:
        embeddings = t["backbone.embeddings.weight"]
        head_weight = embeddings if config.tie_word_embeddings else t["lm_head.weight"]
        return MambaModel(
            config,
            blocks,
            t["backbone.norm_f.weight"],
            RowStableLinear(head_weight),
            embeddings=embeddings,
            fingerprint=fingerprint(config, t),
            name=name,
        )
    return MambaModel(
        config,
        blocks,
        t["backbone.norm_f.weight"],
        RowStableLinear(t["output_head.weight"], t["output_head.bias"]),
        input_proj=RowStableLinear(t["input_proj.weight"], t["input_proj.bias"]),
        fingerprint=fingerprint(config, t),
        name=name,
    )


def save_model(
    directory: str | os.PathLike[str], config: MambaConfig, tensors: dict[str, np.ndarray]
) -> None:
    """Write ``config.json`` + ``model.safetensors`` (each atomically) into ``directory``."""
    want = expected_shapes(config)
    if set(want) != set(tensors):
        raise ModelFormatError(
            f"tensors do not match the config: {sorted(set(want) ^ set(tensors))}"
        )
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    arrays = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}
    atomic_write(path / WEIGHTS_FILE, lambda tmp: save_file(arrays, tmp, metadata={"format": "np"}))
    text = json.dumps(config.to_json(), indent=2, sort_keys=True) + "\n"
    atomic_write(path / CONFIG_FILE, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
