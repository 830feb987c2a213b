"""Model configuration: the dims of a Mamba stack and which kind of model it is.

Four architectures share the same residual stack (embedding or input projection, blocks
of RMSNorm + mixer + residual, final norm, head); they differ in the mixer and in what
goes in and out:

* ``mamba-lm``: Hugging Face ``MambaForCausalLM`` (token id in, logits out).
* ``mamba-signal``: ssmserve's signal Mamba (float vector in, float vector out): a linear
  input projection replaces the embedding and a linear head replaces the LM head.
* ``mamba2-lm``: Hugging Face ``Mamba2ForCausalLM`` (the Mamba-2 mixer, ``mamba2.py``).
* ``mamba2-signal``: the signal model with Mamba-2 mixers.

Shape letters used across the engine (see ``ssmserve.server.engine.mamba``):
    d: hidden size            r: time-step (Δ) rank (Mamba-1)
    e: inner size (d_inner)   n: SSM state size
    k: conv kernel width
    h: heads, p: head dim, g: groups of B and C (Mamba-2; e = h p)
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass
from typing import Any

from ssmserve.server.errors import ModelFormatError, clip

#: ``architectures`` entry that marks a signal-Mamba ``config.json``.
SIGNAL_ARCHITECTURE_NAME = "SsmserveSignalMamba"
HF_ARCHITECTURE_NAME = "MambaForCausalLM"
SIGNAL2_ARCHITECTURE_NAME = "SsmserveSignalMamba2"
HF2_ARCHITECTURE_NAME = "Mamba2ForCausalLM"
FALCON_ARCHITECTURE_NAME = "FalconMambaForCausalLM"

# Guards against configs that would allocate absurd amounts of memory before the
# tensor shapes could even be checked.
_MAX_DIM = 1 << 20
_MAX_LAYERS = 4096


class Architecture(enum.StrEnum):
    LM = "mamba-lm"
    SIGNAL = "mamba-signal"
    MAMBA2_LM = "mamba2-lm"
    MAMBA2_SIGNAL = "mamba2-signal"

    @property
    def is_token_model(self) -> bool:
        return self in (Architecture.LM, Architecture.MAMBA2_LM)

    @property
    def mamba_version(self) -> int:
        """1: the selective scan of Mamba; 2: the multi-head SSD mixer of Mamba-2."""
        return 2 if self in (Architecture.MAMBA2_LM, Architecture.MAMBA2_SIGNAL) else 1


#: Fields only Mamba-2 has (left out of a Mamba-1 model's canonical form, so its
#: fingerprint does not depend on them and stays the one its stored sessions carry).
_MAMBA2_FIELDS = ("num_heads", "head_dim", "n_groups", "time_step_limit")
#: Signal-model normalisation flags: named in the canonical form only when on.
_NORMALIZATION_FIELDS = ("input_normalization", "output_normalization")


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
    # Mamba-2 only (HF ``Mamba2Config`` names):
    num_heads: int = 0  # h
    head_dim: int = 0  # p (h p = e)
    n_groups: int = 0  # g: each group of h / g heads shares one B and C (h % g == 0)
    time_step_limit: tuple[float, float] = (0.0, math.inf)  # Δ clamped to this range
    # Signal only: per-channel (x - mean) / std before the input projection, and
    # y * std + mean after the head (tensors ``input_norm.*`` / ``output_norm.*``).
    input_normalization: bool = False
    output_normalization: bool = False
    # FalconMamba (a Mamba-1 LM): weightless RMS norms of Δ's low rank, B and C inside
    # the mixer, with this epsilon (HF ``mixer_rms_eps``); 0: none, as in Mamba.
    mixer_rms_eps: float = 0.0

    def __post_init__(self) -> None:
        # FalconMamba's mixer norms exist in Mamba-1 language models only: set elsewhere,
        # config.json would drop them while the fingerprint kept them.
        if self.mixer_rms_eps and self.architecture is not Architecture.LM:
            raise ModelFormatError(
                f"mixer_rms_eps is FalconMamba's (a Mamba-1 language model); a "
                f"{self.architecture} model has none"
            )

    @property
    def output_dim(self) -> int:
        """Width of one step's output: vocab size (logits) or the signal head's width."""
        return self.vocab_size if self.is_token_model else self.signal_output_dim

    @property
    def is_token_model(self) -> bool:
        return self.architecture.is_token_model

    @property
    def mamba_version(self) -> int:
        return self.architecture.mamba_version

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: e (Mamba-1), or x, B and C: e + 2 g n (Mamba-2)."""
        if self.mamba_version == 2:
            return self.intermediate_size + 2 * self.n_groups * self.state_size
        return self.intermediate_size

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """One layer's conv window: (e, k) or (e + 2 g n, k)."""
        return (self.conv_dim, self.conv_kernel)

    @property
    def ssm_state_shape(self) -> tuple[int, ...]:
        """One layer's SSM state: (e, n) for Mamba-1, (h, p, n) for Mamba-2."""
        if self.mamba_version == 2:
            return (self.num_heads, self.head_dim, self.state_size)
        return (self.intermediate_size, self.state_size)

    @property
    def state_bytes(self) -> int:
        """Bytes of recurrent state per session: per layer conv + ssm state, float32."""
        per_layer = math.prod(self.conv_state_shape) + math.prod(self.ssm_state_shape)
        return self.num_hidden_layers * per_layer * 4

    def canonical(self) -> dict[str, Any]:
        """The fields that define the model's math, for fingerprints and checkpoints."""
        per_arch = ("vocab_size", "tie_word_embeddings", "input_dim", "signal_output_dim")
        if self.mamba_version == 1:
            per_arch += _MAMBA2_FIELDS
        else:
            per_arch += ("time_step_rank",)
        per_arch += _NORMALIZATION_FIELDS
        if not self.mixer_rms_eps:  # named only for FalconMamba: older fingerprints stand
            per_arch += ("mixer_rms_eps",)
        out = {k: v for k, v in asdict(self).items() if k not in per_arch}
        for key in _NORMALIZATION_FIELDS:  # named only when on: older fingerprints stand
            if getattr(self, key):
                out[key] = True
        if self.mamba_version == 2:  # JSON has no infinity: name it
            out["time_step_limit"] = [_float_text(v) for v in self.time_step_limit]
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
        if self.mamba_version == 2:
            return self._to_json_mamba2()
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
        if self.is_token_model and self.mixer_rms_eps:
            return {
                "architectures": [FALCON_ARCHITECTURE_NAME],
                "model_type": "falcon_mamba",
                "vocab_size": self.vocab_size,
                "tie_word_embeddings": self.tie_word_embeddings,
                "mixer_rms_eps": self.mixer_rms_eps,
                **common,
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
            **self._normalization_json(),
            **common,
        }

    def _normalization_json(self) -> dict[str, bool]:
        return {key: True for key in _NORMALIZATION_FIELDS if getattr(self, key)}

    def _to_json_mamba2(self) -> dict[str, Any]:
        common = {
            "hidden_size": self.hidden_size,
            "state_size": self.state_size,
            "num_hidden_layers": self.num_hidden_layers,
            "expand": self.intermediate_size // self.hidden_size,
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "n_groups": self.n_groups,
            "conv_kernel": self.conv_kernel,
            "use_bias": self.use_bias,
            "use_conv_bias": self.use_conv_bias,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            # as transformers writes it (Python's json: Infinity)
            "time_step_limit": list(self.time_step_limit),
        }
        if self.is_token_model:
            return {
                "architectures": [HF2_ARCHITECTURE_NAME],
                "model_type": "mamba2",
                "vocab_size": self.vocab_size,
                "tie_word_embeddings": self.tie_word_embeddings,
                **common,
            }
        return {
            "architectures": [SIGNAL2_ARCHITECTURE_NAME],
            "model_type": "ssmserve-signal-mamba2",
            "input_dim": self.input_dim,
            "output_dim": self.signal_output_dim,
            **self._normalization_json(),
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
        model_type = raw.get("model_type")
        falcon = FALCON_ARCHITECTURE_NAME in archs or model_type == "falcon_mamba"
        if falcon:
            architecture = Architecture.LM
        elif SIGNAL_ARCHITECTURE_NAME in archs:
            architecture = Architecture.SIGNAL
        elif SIGNAL2_ARCHITECTURE_NAME in archs:
            architecture = Architecture.MAMBA2_SIGNAL
        elif HF_ARCHITECTURE_NAME in archs or model_type == "mamba":
            architecture = Architecture.LM
        elif HF2_ARCHITECTURE_NAME in archs or model_type == "mamba2":
            architecture = Architecture.MAMBA2_LM
        else:
            raise ModelFormatError(
                f"config.json: unsupported architecture {clip(str(archs or model_type))}; "
                f"expected one of {HF_ARCHITECTURE_NAME!r}, {HF2_ARCHITECTURE_NAME!r}, "
                f"{FALCON_ARCHITECTURE_NAME!r}, {SIGNAL_ARCHITECTURE_NAME!r}, "
                f"{SIGNAL2_ARCHITECTURE_NAME!r} (or model_type 'mamba', 'mamba2' or "
                f"'falcon_mamba')"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelFormatError(
                f"config.json: hidden_act {clip(repr(act))} is not supported (only 'silu')"
            )
        if architecture.mamba_version == 2:
            return cls._from_json_mamba2(raw, architecture)

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
            **_normalization(raw, architecture),
            mixer_rms_eps=_float(raw, "mixer_rms_eps", default=1e-6) if falcon else 0.0,
        )
        return cfg

    @classmethod
    def _from_json_mamba2(cls, raw: dict[str, Any], architecture: Architecture) -> MambaConfig:
        hidden = _int(raw, "hidden_size")
        # transformers: intermediate_size = int(expand * hidden_size), always
        expand = raw.get("expand", 2)
        if isinstance(expand, bool) or not isinstance(expand, int | float) or expand <= 0:
            raise ModelFormatError(
                f"config.json: 'expand' must be a positive number, got {expand!r}"
            )
        inner = int(expand * hidden)
        heads = _int(raw, "num_heads")
        head_dim = _int(raw, "head_dim")
        groups = _int(raw, "n_groups", default=8)  # transformers' Mamba2Config default
        if heads * head_dim != inner:
            raise ModelFormatError(
                f"config.json: num_heads * head_dim ({heads} * {head_dim}) must equal "
                f"expand * hidden_size ({inner})"
            )
        if heads % groups:
            raise ModelFormatError(
                f"config.json: num_heads ({heads}) must be a multiple of n_groups ({groups})"
            )
        return cls(
            architecture=architecture,
            hidden_size=hidden,
            state_size=_int(raw, "state_size", default=128),
            num_hidden_layers=_int(raw, "num_hidden_layers", maximum=_MAX_LAYERS),
            intermediate_size=inner,
            conv_kernel=_int(raw, "conv_kernel", default=4),
            time_step_rank=0,
            use_bias=_bool(raw, "use_bias", default=False),
            use_conv_bias=_bool(raw, "use_conv_bias", default=True),
            layer_norm_epsilon=_float(raw, "layer_norm_epsilon", default=1e-5),
            vocab_size=_int(raw, "vocab_size") if architecture.is_token_model else 0,
            tie_word_embeddings=_bool(raw, "tie_word_embeddings", default=False),
            input_dim=0 if architecture.is_token_model else _int(raw, "input_dim"),
            signal_output_dim=0 if architecture.is_token_model else _int(raw, "output_dim"),
            num_heads=heads,
            head_dim=head_dim,
            n_groups=groups,
            time_step_limit=_time_step_limit(raw.get("time_step_limit", [0.0, math.inf])),
            **_normalization(raw, architecture),
        )


def _normalization(raw: dict[str, Any], architecture: Architecture) -> dict[str, bool]:
    """A signal model's normalisation flags (default off); a token model takes none."""
    flags = {key: _bool(raw, key, default=False) for key in _NORMALIZATION_FIELDS}
    if architecture.is_token_model and any(flags.values()):
        raise ModelFormatError(
            "config.json: input_normalization / output_normalization apply to signal "
            "models only (a token model's inputs are ids)"
        )
    return flags


def _time_step_limit(value: Any) -> tuple[float, float]:
    """``[low, high]``, either bound a number, ``Infinity`` (Python's json reads it), or
    ``{"__float__": "Infinity"}`` (how some writers spell a float JSON cannot hold)."""
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ModelFormatError(
            f"config.json: 'time_step_limit' must be [low, high], got {clip(str(value))}"
        )
    bounds = []
    for bound in value:
        if isinstance(bound, dict) and set(bound) == {"__float__"}:
            bound = bound["__float__"]
            try:
                bound = float(bound) if isinstance(bound, str) else bound
            except ValueError:
                bound = None
        if isinstance(bound, bool) or not isinstance(bound, int | float) or math.isnan(bound):
            raise ModelFormatError(
                f"config.json: 'time_step_limit' bounds must be numbers, got {clip(str(value))}"
            )
        bounds.append(float(bound))
    low, high = bounds
    if not 0.0 <= low < high:
        raise ModelFormatError(
            f"config.json: 'time_step_limit' must satisfy 0 <= low < high, got {[low, high]}"
        )
    return low, high


def _float_text(value: float) -> float | str:
    return value if math.isfinite(value) else repr(value)


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
