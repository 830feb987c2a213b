"""From a PyTorch signal model to a model directory that ssmserve serves.

:class:`SignalMamba` is the reference signal model to train: an input ``nn.Linear``
(input_dim -> hidden), a transformers ``MambaModel`` or ``Mamba2Model`` backbone fed
through ``inputs_embeds``, and an output ``nn.Linear`` (hidden -> output_dim), with an
optional per-channel normalisation of the inputs, ``(x - mean) / std``, and of the
outputs, ``y * std + mean``. :func:`save_signal_model` writes the directory
(``config.json`` + ``model.safetensors``, architecture ``SsmserveSignalMamba`` or
``SsmserveSignalMamba2``) from such a module, or from the three parts of a module built
some other way. The served outputs equal the module's own forward within float32
rounding (``tests/test_export.py``: within 1e-5 of max |output| over 256 steps).

What it cannot represent exactly it refuses, naming it (:class:`ExportError`): another
backbone class, a config field whose value changes the math and that the engine does not
read, weights stored in float64 (float32 would round them), a std that is not > 0.

Needs PyTorch and transformers: ``pip install 'ssmserve[torch]'``; nothing else in
ssmserve imports this module.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

try:
    import torch
    from torch import nn
    from transformers import Mamba2Config, Mamba2Model
    from transformers import MambaConfig as HfMambaConfig
    from transformers import MambaModel as HfMambaModel
except ImportError as exc:  # pragma: no cover - the plain install's case, tested apart
    raise ImportError(
        "ssmserve.server.export needs PyTorch and transformers: pip install 'ssmserve[torch]'"
    ) from exc

from ssmserve.server.engine.config import (
    SIGNAL2_ARCHITECTURE_NAME,
    SIGNAL_ARCHITECTURE_NAME,
    MambaConfig,
)
from ssmserve.server.engine.loader import load_model, save_model
from ssmserve.server.engine.model_tensors import build_model
from ssmserve.server.errors import ModelFormatError

#: Config fields the engine reads (beyond the architecture), per backbone.
_READ_MAMBA1 = frozenset(
    {
        "hidden_size", "state_size", "num_hidden_layers", "intermediate_size", "expand",
        "conv_kernel", "time_step_rank", "use_bias", "use_conv_bias", "layer_norm_epsilon",
        "hidden_act",
    }
)  # fmt: skip
_READ_MAMBA2 = frozenset(
    {
        "hidden_size", "state_size", "num_hidden_layers", "expand", "num_heads", "head_dim",
        "n_groups", "conv_kernel", "use_bias", "use_conv_bias", "layer_norm_epsilon",
        "time_step_limit", "hidden_act",
    }
)  # fmt: skip
#: Fields whose value changes nothing a float32 forward computes: initialisation, the
#: kernel path (sequential or associative scan, chunk size), the unused token embedding,
#: the residual's dtype (already float32), bookkeeping.
_NO_EFFECT = frozenset(
    {
        "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
        "initializer_range", "rescale_prenorm_residual", "residual_in_fp32",
        "time_step_floor", "time_step_init_scheme", "time_step_max", "time_step_min",
        "time_step_scale", "use_cache", "use_mambapy", "use_associative_scan", "chunk_size",
        "transformers_version", "architectures", "model_type", "dtype", "torch_dtype",
        "_name_or_path", "output_hidden_states", "output_attentions", "return_dict",
        "name_or_path",
    }
)  # fmt: skip
#: Mamba-2's time_step_rank sizes nothing in its forward (Δ comes from in_proj per head).
_NO_EFFECT_MAMBA2 = frozenset({"time_step_rank"})


#: SignalMamba's optional normalisation buffers.
_STATISTICS = ("input_mean", "input_std", "output_mean", "output_std")


class ExportError(ValueError):
    """The module cannot be written as a model directory that computes the same thing."""


class SignalMamba(nn.Module):
    """A signal model: ``(b, t, input_dim)`` floats in, ``(b, t, output_dim)`` out.

    ``backbone_config``: a transformers ``MambaConfig`` (Mamba-1) or ``Mamba2Config``
    (Mamba-2) for the backbone; its ``vocab_size`` is set to 1, since the inputs come
    through ``inputs_embeds`` and the token embedding is never read. Normalisation
    statistics, when set (:meth:`set_normalization`), are buffers: they travel with
    ``state_dict`` and are exported.
    """

    def __init__(
        self, input_dim: int, output_dim: int, backbone_config: HfMambaConfig | Mamba2Config
    ) -> None:
        super().__init__()
        config = backbone_config.__class__.from_dict(backbone_config.to_dict())  # a copy
        config.vocab_size = 1
        config.bos_token_id = config.eos_token_id = config.pad_token_id = None  # no tokens
        hidden = config.hidden_size
        self.input_proj = nn.Linear(input_dim, hidden)  # i -> d
        if isinstance(config, Mamba2Config):
            self.backbone: HfMambaModel | Mamba2Model = Mamba2Model(config)
        else:
            self.backbone = HfMambaModel(config)
        self.output_head = nn.Linear(hidden, output_dim)  # d -> o
        for name in _STATISTICS:
            self.register_buffer(name, None)

    @classmethod
    def create(
        cls,
        input_dim: int,
        output_dim: int,
        *,
        arch: str = "mamba",
        hidden_size: int = 64,
        num_hidden_layers: int = 2,
        state_size: int = 16,
        **config: Any,
    ) -> SignalMamba:
        """A model with a fresh backbone config: ``arch`` is ``"mamba"`` or ``"mamba2"``;
        further keywords go to the transformers config (``expand``, ``conv_kernel``,
        ``num_heads``, ``head_dim``, ``n_groups``, ...)."""
        dims = {
            "hidden_size": hidden_size,
            "num_hidden_layers": num_hidden_layers,
            "state_size": state_size,
            "vocab_size": 1,
        }
        if arch == "mamba":
            return cls(input_dim, output_dim, HfMambaConfig(**dims, **config))
        if arch == "mamba2":
            return cls(input_dim, output_dim, Mamba2Config(**dims, **config))
        raise ValueError(f"arch must be 'mamba' or 'mamba2', got {arch!r}")

    def set_normalization(
        self,
        input_mean: Any = None,
        input_std: Any = None,
        output_mean: Any = None,
        output_std: Any = None,
    ) -> None:
        """Per-channel statistics (float32): inputs become ``(x - mean) / std`` before
        the input projection, outputs ``y * std + mean`` after the head. A pair left
        as None switches that side off."""
        for side, mean, std, width in (
            ("input", input_mean, input_std, self.input_proj.in_features),
            ("output", output_mean, output_std, self.output_head.out_features),
        ):
            pair = _normalization_pair(side, mean, std, width)
            stats = (None, None) if pair is None else (torch.from_numpy(a) for a in pair)
            for suffix, value in zip(("mean", "std"), stats, strict=True):
                setattr(self, f"{side}_{suffix}", value)

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        """A checkpoint's statistics load into a module that has none yet (they are
        optional buffers, None until set), so ``load_state_dict`` round-trips."""
        for name in _STATISTICS:
            key = prefix + name
            if key in state_dict and getattr(self, name) is None:
                setattr(self, name, torch.empty_like(state_dict[key]))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(b, t, i) -> (b, t, o): the whole sequence from a fresh state."""
        if self.input_mean is not None:
            x = (x - self.input_mean) / self.input_std  # (b, t, i)
        h = self.input_proj(x)  # (b, t, i) -> (b, t, d)
        h = self.backbone(inputs_embeds=h, use_cache=False).last_hidden_state  # (b, t, d)
        y = self.output_head(h)  # (b, t, d) -> (b, t, o)
        if self.output_mean is not None:
            y = y * self.output_std + self.output_mean  # (b, t, o)
        return y


def save_signal_model(
    model: SignalMamba | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    *,
    backbone: nn.Module | None = None,
    input_proj: nn.Module | None = None,
    output_head: nn.Module | None = None,
    input_mean: Any = None,
    input_std: Any = None,
    output_mean: Any = None,
    output_std: Any = None,
) -> str:
    """Write ``out_dir`` (``config.json`` + ``model.safetensors``) from ``model``, or from
    ``backbone`` (a transformers ``MambaModel`` / ``Mamba2Model``), ``input_proj`` and
    ``output_head`` (``nn.Linear``) with the optional normalisation statistics. The
    directory is loaded back as a worker would load it; returns the model's fingerprint.
    Raises :class:`ExportError` naming what cannot be represented exactly."""
    if out_dir is None:
        raise ExportError("out_dir is required: the directory to write the model into")
    if model is not None:
        if any(p is not None for p in (backbone, input_proj, output_head)):
            raise ExportError("pass either a SignalMamba or its parts, not both")
        if not isinstance(model, SignalMamba) or type(model).forward is not SignalMamba.forward:
            raise ExportError(
                f"{type(model).__name__} is not a SignalMamba (a subclass that overrides "
                f"forward computes something else); pass its parts with backbone=, "
                f"input_proj= and output_head="
            )
        if any(s is not None for s in (input_mean, input_std, output_mean, output_std)):
            raise ExportError(
                "a SignalMamba carries its own statistics: set them with "
                "model.set_normalization(...)"
            )
        backbone, input_proj, output_head = model.backbone, model.input_proj, model.output_head
        input_mean, input_std = _numpy(model.input_mean), _numpy(model.input_std)
        output_mean, output_std = _numpy(model.output_mean), _numpy(model.output_std)
    if backbone is None or input_proj is None or output_head is None:
        raise ExportError("backbone=, input_proj= and output_head= are all required")
    config, tensors = _backbone(backbone)
    tensors.update(_linear("input_proj", input_proj, out_features=config["hidden_size"]))
    tensors.update(_linear("output_head", output_head, in_features=config["hidden_size"]))
    config["input_dim"] = tensors["input_proj.weight"].shape[1]
    config["output_dim"] = tensors["output_head.weight"].shape[0]
    for side, mean, std in (("input", input_mean, input_std), ("output", output_mean, output_std)):
        pair = _normalization_pair(side, mean, std, config[f"{side}_dim"])
        if pair is not None:
            config[f"{side}_normalization"] = True
            tensors[f"{side}_norm.mean"], tensors[f"{side}_norm.std"] = pair
    try:
        parsed = MambaConfig.from_json(config)
        if MambaConfig.from_json(parsed.to_json()) != parsed:  # e.g. a fractional expand
            raise ExportError(
                f"backbone config does not survive config.json: {parsed.to_json()} reads "
                f"back as another model"
            )
        build_model(parsed, dict(tensors), name="export")  # checks everything, in memory
        save_model(out_dir, parsed, tensors)
        return load_model(out_dir).fingerprint
    except ModelFormatError as exc:
        raise ExportError(f"the exported model does not load: {exc}") from exc


def _backbone(backbone: nn.Module) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The signal config.json (without dims of the ends) and the backbone's tensors."""
    kind = type(backbone)
    if kind not in (HfMambaModel, Mamba2Model):
        hint = " (pass its .backbone)" if hasattr(backbone, "backbone") else ""
        raise ExportError(
            f"backbone is a {kind.__name__}{hint}; only transformers' MambaModel and "
            f"Mamba2Model are exported (the engine computes exactly their forward)"
        )
    hf = backbone.config
    mamba2 = kind is Mamba2Model
    read = _READ_MAMBA2 if mamba2 else _READ_MAMBA1
    ignored = _NO_EFFECT | (_NO_EFFECT_MAMBA2 if mamba2 else frozenset())
    unknown = sorted(set(hf.to_diff_dict()) - read - ignored)
    if unknown:
        raise ExportError(
            f"backbone config sets {', '.join(unknown[:8])}, which the engine does not "
            f"read: it cannot serve that model exactly"
        )
    if hf.hidden_act != "silu":
        raise ExportError(f"backbone config hidden_act is {hf.hidden_act!r}; only 'silu' is served")
    config: dict[str, Any] = {
        "architectures": [SIGNAL2_ARCHITECTURE_NAME if mamba2 else SIGNAL_ARCHITECTURE_NAME],
        "hidden_size": hf.hidden_size,
        "state_size": hf.state_size,
        "num_hidden_layers": hf.num_hidden_layers,
        "conv_kernel": hf.conv_kernel,
        "use_bias": bool(hf.use_bias),
        "use_conv_bias": bool(hf.use_conv_bias),
        "layer_norm_epsilon": float(hf.layer_norm_epsilon),
    }
    if mamba2:
        config.update(
            expand=hf.expand,
            num_heads=hf.num_heads,
            head_dim=hf.head_dim,
            n_groups=hf.n_groups,
            time_step_limit=[float(v) for v in hf.time_step_limit],
        )
    else:
        config.update(intermediate_size=hf.intermediate_size, time_step_rank=hf.time_step_rank)
    tensors = {
        f"backbone.{name}": _array(f"backbone.{name}", value)
        for name, value in backbone.state_dict().items()
        if name != "embeddings.weight"  # inputs come through inputs_embeds
    }
    return config, tensors


def _linear(
    name: str,
    layer: nn.Module,
    *,
    in_features: int | None = None,
    out_features: int | None = None,
) -> dict[str, np.ndarray]:
    """``{name}.weight`` and ``{name}.bias`` of an ``nn.Linear`` (no bias: zeros, exact)."""
    if type(layer) is not nn.Linear:
        raise ExportError(f"{name} is a {type(layer).__name__}; an nn.Linear is required")
    weight = _array(f"{name}.weight", layer.weight)
    if in_features is not None and weight.shape[1] != in_features:
        raise ExportError(
            f"{name} takes {weight.shape[1]} features; the backbone's hidden_size is {in_features}"
        )
    if out_features is not None and weight.shape[0] != out_features:
        raise ExportError(
            f"{name} gives {weight.shape[0]} features; the backbone's hidden_size is {out_features}"
        )
    bias = (
        np.zeros(weight.shape[0], np.float32)
        if layer.bias is None
        else _array(f"{name}.bias", layer.bias)
    )
    return {f"{name}.weight": weight, f"{name}.bias": bias}


def _array(name: str, value: torch.Tensor) -> np.ndarray:
    """A float32 copy of ``value``; float64 (which float32 would round) is refused."""
    if value.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ExportError(
            f"tensor {name} is {value.dtype}; export float32, float16 or bfloat16 weights "
            f"(model.float() first): float32 cannot hold {value.dtype} exactly"
        )
    out = value.detach().to(device="cpu", dtype=torch.float32).numpy().copy()
    if not np.isfinite(out).all():
        raise ExportError(f"tensor {name} contains NaN or Inf")
    return out


def _numpy(value: torch.Tensor | None) -> np.ndarray | None:
    return None if value is None else _array("normalisation statistic", value)


def _normalization_pair(
    side: str, mean: Any, std: Any, width: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """Checked float32 ``(mean, std)`` of one side, or None when both are None."""
    if mean is None and std is None:
        return None
    if mean is None or std is None:
        raise ExportError(f"{side} normalisation needs both {side}_mean and {side}_std")
    pair = []
    for what, value in (("mean", mean), ("std", std)):
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        arr = np.asarray(value, dtype=np.float64)
        if arr.shape != (width,):
            raise ExportError(f"{side}_{what} has shape {list(arr.shape)}; ({width},) is needed")
        if not np.isfinite(arr).all():
            raise ExportError(f"{side}_{what} contains NaN or Inf")
        pair.append(arr.astype(np.float32))
    if not (pair[1] > 0).all():
        bad = int(np.flatnonzero(~(pair[1] > 0))[0])
        raise ExportError(f"{side}_std[{bad}] is {pair[1][bad]}; every std must be > 0")
    return pair[0], pair[1]


def stream_reference(model: nn.Module, inputs: np.ndarray) -> np.ndarray:
    """The module's own forward over ``inputs`` (t, i) from a fresh state: (t, o)."""
    with torch.no_grad():
        out = model(torch.from_numpy(np.asarray(inputs, np.float32))[None])  # (1, t, o)
    return out[0].numpy()


__all__ = ["ExportError", "SignalMamba", "save_signal_model", "stream_reference"]
