"""Model configuration: the dims of a Mamba stack and which kind of model it is.

Two architectures share the same residual Mamba blocks:

* ``mamba-lm``: Hugging Face ``MambaForCausalLM`` (token id in, logits out).
* ``mamba-signal``: ssmserve's signal Mamba (float vector in, float vector out): a linear
  input projection replaces the embedding and a linear head replaces the LM head.

Shape letters used across the engine (see ``ssmserve.server.engine.mamba``):
    d: hidden size            r: time-step (Δ) rank
    e: inner size (d_inner)   n: SSM state size
    k: conv kernel width
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass
from typing import Any

from ssmserve.server.errors import ModelFormatError

#: ``architectures`` entry that marks a signal-Mamba ``config.json``.
SIGNAL_ARCHITECTURE_NAME = "SsmserveSignalMamba"
HF_ARCHITECTURE_NAME = "MambaForCausalLM"

# Guards against configs that would allocate absurd amounts of memory before the
# tensor shapes could even be checked.
_MAX_DIM = 1 << 20
_MAX_LAYERS = 4096


class Architecture(enum.StrEnum):
    LM = "mamba-lm"
    SIGNAL = "mamba-signal"


@dataclass(frozen=True)
class MambaConfig:
    """Dims of a Mamba stack. Field names follow Hugging Face's ``MambaConfig``."""

    architecture: Architecture
    hidden_size: int  # d
    state_size: int  # n
    num_hidden_layers: int
    intermediate_size: int  # e (HF: explicit value wins over expand * hidden)
    conv_kernel: int  # k
    time_step_rank: int  # r
    use_bias: bool  # in_proj / out_proj biases (dt_proj always has one, x_proj never)
    use_conv_bias: bool
    layer_norm_epsilon: float
    vocab_size: int = 0  # LM only
    tie_word_embeddings: bool = True  # LM only
    input_dim: int = 0  # signal only
    signal_output_dim: int = 0  # signal only; use ``output_dim``

    @property
    def output_dim(self) -> int:
        """Width of one step's output: vocab size (logits) or the signal head's width."""
        return self.vocab_size if self.architecture is Architecture.LM else self.signal_output_dim

    @property
    def is_token_model(self) -> bool:
        return self.architecture is Architecture.LM

    @property
    def state_bytes(self) -> int:
        """Bytes of recurrent state per session: per layer conv (e, k) + ssm (e, n), float32."""
        e, k, n = self.intermediate_size, self.conv_kernel, self.state_size
        return self.num_hidden_layers * e * (k + n) * 4

    def canonical(self) -> dict[str, Any]:
        """The fields that define the model's math, for fingerprints and checkpoints."""
        per_arch = ("vocab_size", "tie_word_embeddings", "input_dim", "signal_output_dim")
        out = {k: v for k, v in asdict(self).items() if k not in per_arch}
        out["architecture"] = str(self.architecture)
        out["output_dim"] = self.output_dim
        if self.is_token_model:
            out["vocab_size"] = self.vocab_size
            out["tie_word_embeddings"] = self.tie_word_embeddings
        else:
            out["input_dim"] = self.input_dim
        return out

    def to_json(self) -> dict[str, Any]:
        """A ``config.json`` for this model (HF-compatible for token models)."""
        common = {
            "hidden_size": self.hidden_size,
            "state_size": self.state_size,
            "num_hidden_layers": self.num_hidden_layers,
            "intermediate_size": self.intermediate_size,
            "expand": max(1, self.intermediate_size // self.hidden_size),
            "conv_kernel": self.conv_kernel,
            "time_step_rank": self.time_step_rank,
            "use_bias": self.use_bias,
            "use_conv_bias": self.use_conv_bias,
            "layer_norm_epsilon": self.layer_norm_epsilon,
        }
        if self.is_token_model:
            return {
                "architectures": [HF_ARCHITECTURE_NAME],
                "model_type": "mamba",
                "vocab_size": self.vocab_size,
                "tie_word_embeddings": self.tie_word_embeddings,
                **common,
            }
        return {
            "architectures": [SIGNAL_ARCHITECTURE_NAME],
            "model_type": "ssmserve-signal-mamba",
            "input_dim": self.input_dim,
            "output_dim": self.signal_output_dim,
            **common,
        }

    @classmethod
    def from_json(cls, raw: Any) -> MambaConfig:
        """Parse a ``config.json`` object; unknown keys are ignored, bad values named."""
        if not isinstance(raw, dict):
            raise ModelFormatError("config.json must hold a JSON object")
        archs = raw.get("architectures") or []
        if not isinstance(archs, list):
            raise ModelFormatError("config.json: 'architectures' must be a list")
        if SIGNAL_ARCHITECTURE_NAME in archs:
            architecture = Architecture.SIGNAL
        elif HF_ARCHITECTURE_NAME in archs or raw.get("model_type") == "mamba":
            architecture = Architecture.LM
        else:
            raise ModelFormatError(
                f"config.json: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"expected {HF_ARCHITECTURE_NAME!r} or {SIGNAL_ARCHITECTURE_NAME!r}"
            )

        hidden = _int(raw, "hidden_size")
        expand = _int(raw, "expand", default=2)
        inner = raw.get("intermediate_size")
        intermediate = _int(raw, "intermediate_size") if inner is not None else expand * hidden
        rank_raw = raw.get("time_step_rank", "auto")
        rank = math.ceil(hidden / 16) if rank_raw == "auto" else _int(raw, "time_step_rank")
        cfg = cls(
            architecture=architecture,
            hidden_size=hidden,
            state_size=_int(raw, "state_size", default=16),
            num_hidden_layers=_int(raw, "num_hidden_layers", maximum=_MAX_LAYERS),
            intermediate_size=intermediate,
            conv_kernel=_int(raw, "conv_kernel", default=4),
            time_step_rank=rank,
            use_bias=_bool(raw, "use_bias", default=False),
            use_conv_bias=_bool(raw, "use_conv_bias", default=True),
            layer_norm_epsilon=_float(raw, "layer_norm_epsilon", default=1e-5),
            vocab_size=_int(raw, "vocab_size") if architecture is Architecture.LM else 0,
            tie_word_embeddings=_bool(raw, "tie_word_embeddings", default=True),
            input_dim=_int(raw, "input_dim") if architecture is Architecture.SIGNAL else 0,
            signal_output_dim=_int(raw, "output_dim") if architecture is Architecture.SIGNAL else 0,
        )
        return cfg


def _int(raw: dict[str, Any], key: str, default: int | None = None, maximum: int = _MAX_DIM) -> int:
    value = raw.get(key, default)
    if value is None:
        raise ModelFormatError(f"config.json: missing required field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelFormatError(f"config.json: {key!r} must be an integer, got {value!r}")
    if not 1 <= value <= maximum:
        raise ModelFormatError(f"config.json: {key!r} must be in 1..{maximum}, got {value}")
    return value


def _bool(raw: dict[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ModelFormatError(f"config.json: {key!r} must be true or false, got {value!r}")
    return value


def _float(raw: dict[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelFormatError(f"config.json: {key!r} must be a number, got {value!r}")
    if not (0.0 < float(value) < 1.0):
        raise ModelFormatError(f"config.json: {key!r} must be in (0, 1), got {value!r}")
    return float(value)
