"""A deterministic random signal Mamba, for demos, tests and benchmarks.

The weights are random but shaped like a trained Mamba's (S4D-real ``A``, Δ biases that
give step sizes in [1e-3, 1e-1], unit-ish norms) and perturbed away from special values
(``D`` = 1, zero conv bias) so tests exercise every parameter. The same arguments always
give the same bytes, hence the same fingerprint.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ssmserve.server.engine.config import Architecture, MambaConfig


@dataclass(frozen=True)
class DemoSpec:
    """Dims of the demo model; defaults run comfortably on a laptop."""

    input_dim: int = 4
    output_dim: int = 4
    hidden: int = 64
    layers: int = 2
    state: int = 16
    expand: int = 2
    conv_kernel: int = 4
    seed: int = 0
    arch: str = "mamba"  # "mamba" (Mamba-1) or "mamba2"
    head_dim: int = 16  # Mamba-2: heads = expand * hidden / head_dim
    groups: int = 2  # Mamba-2: groups of heads sharing B and C


ARCHS = ("mamba", "mamba2")


def demo_config(spec: DemoSpec) -> MambaConfig:
    if spec.arch not in ARCHS:
        raise ValueError(f"unknown demo architecture {spec.arch!r}; one of {', '.join(ARCHS)}")
    if spec.arch == "mamba2":
        inner = spec.expand * spec.hidden
        if inner % spec.head_dim or (inner // spec.head_dim) % spec.groups:
            raise ValueError(
                f"a Mamba-2 needs expand * hidden ({inner}) to be a multiple of head_dim "
                f"({spec.head_dim}) and the heads a multiple of groups ({spec.groups})"
            )
        return MambaConfig(
            architecture=Architecture.MAMBA2_SIGNAL,
            hidden_size=spec.hidden,
            state_size=spec.state,
            num_hidden_layers=spec.layers,
            intermediate_size=inner,
            conv_kernel=spec.conv_kernel,
            time_step_rank=0,
            use_bias=False,
            use_conv_bias=True,
            layer_norm_epsilon=1e-5,
            input_dim=spec.input_dim,
            signal_output_dim=spec.output_dim,
            num_heads=inner // spec.head_dim,
            head_dim=spec.head_dim,
            n_groups=spec.groups,
        )
    return MambaConfig(
        architecture=Architecture.SIGNAL,
        hidden_size=spec.hidden,
        state_size=spec.state,
        num_hidden_layers=spec.layers,
        intermediate_size=spec.expand * spec.hidden,
        conv_kernel=spec.conv_kernel,
        time_step_rank=math.ceil(spec.hidden / 16),
        use_bias=False,
        use_conv_bias=True,
        layer_norm_epsilon=1e-5,
        input_dim=spec.input_dim,
        signal_output_dim=spec.output_dim,
    )


def random_tensors(config: MambaConfig, seed: int) -> dict[str, np.ndarray]:
    """Random weights for any ``config`` (signal or token), reproducible from ``seed``."""
    rng = np.random.default_rng(seed)
    d, e, n, k, r = (
        config.hidden_size,
        config.intermediate_size,
        config.state_size,
        config.conv_kernel,
        config.time_step_rank,
    )

    def linear(out_f: int, in_f: int) -> np.ndarray:
        return (rng.standard_normal((out_f, in_f)) / math.sqrt(in_f)).astype(np.float32)

    def vec(size: int, mean: float, std: float) -> np.ndarray:
        return (mean + std * rng.standard_normal(size)).astype(np.float32)

    t: dict[str, np.ndarray] = {}
    if config.is_token_model:
        t["backbone.embeddings.weight"] = vec(config.vocab_size * d, 0.0, 1.0).reshape(-1, d)
        if not config.tie_word_embeddings:
            t["lm_head.weight"] = linear(config.vocab_size, d)
    else:
        t["input_proj.weight"] = linear(d, config.input_dim)
        t["input_proj.bias"] = vec(d, 0.0, 0.1)
        t["output_head.weight"] = linear(config.output_dim, d)
        t["output_head.bias"] = vec(config.output_dim, 0.0, 0.1)
    for layer in range(config.num_hidden_layers):
        p = f"backbone.layers.{layer}."
        t[p + "norm.weight"] = vec(d, 1.0, 0.1)
        if config.mamba_version == 2:
            t.update(_mamba2_mixer(config, p + "mixer.", rng, linear, vec))
            continue
        t[p + "mixer.in_proj.weight"] = linear(2 * e, d)
        t[p + "mixer.conv1d.weight"] = (rng.standard_normal((e, 1, k)) * 0.4).astype(np.float32)
        t[p + "mixer.x_proj.weight"] = linear(r + 2 * n, e)
        t[p + "mixer.dt_proj.weight"] = (rng.standard_normal((e, r)) * r**-0.5).astype(np.float32)
        # Δ = softplus(bias) log-uniform in [1e-3, 1e-1]: bias = softplus^-1(Δ) = log(expm1(Δ)).
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), e))
        t[p + "mixer.dt_proj.bias"] = np.log(np.expm1(dt)).astype(np.float32)
        a = np.arange(1, n + 1, dtype=np.float64)[None, :] * rng.uniform(0.8, 1.25, (e, n))
        t[p + "mixer.A_log"] = np.log(a).astype(np.float32)  # S4D-real, perturbed
        t[p + "mixer.D"] = vec(e, 1.0, 0.3)
        t[p + "mixer.out_proj.weight"] = linear(d, e)
        if config.use_bias:
            t[p + "mixer.in_proj.bias"] = vec(2 * e, 0.0, 0.1)
            t[p + "mixer.out_proj.bias"] = vec(d, 0.0, 0.1)
        if config.use_conv_bias:
            t[p + "mixer.conv1d.bias"] = vec(e, 0.0, 0.1)
    t["backbone.norm_f.weight"] = vec(d, 1.0, 0.1)
    return t


def _mamba2_mixer(
    config: MambaConfig,
    p: str,
    rng: np.random.Generator,
    linear: Callable[[int, int], np.ndarray],
    vec: Callable[[int, float, float], np.ndarray],
) -> dict[str, np.ndarray]:
    """A Mamba-2 mixer's weights, shaped as mamba_ssm initialises them and perturbed."""
    d, e, h, k, c = (
        config.hidden_size,
        config.intermediate_size,
        config.num_heads,
        config.conv_kernel,
        config.conv_dim,
    )
    t: dict[str, np.ndarray] = {}
    t[p + "in_proj.weight"] = linear(e + c + h, d)
    t[p + "conv1d.weight"] = (rng.standard_normal((c, 1, k)) * 0.4).astype(np.float32)
    # Δ = softplus(dt_bias) log-uniform in [1e-3, 1e-1], per head
    dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), h))
    t[p + "dt_bias"] = np.log(np.expm1(dt)).astype(np.float32)
    t[p + "A_log"] = np.log(rng.uniform(1.0, 16.0, h)).astype(np.float32)  # A in [-16, -1]
    t[p + "D"] = vec(h, 1.0, 0.3)
    t[p + "norm.weight"] = vec(e, 1.0, 0.1)
    t[p + "out_proj.weight"] = linear(d, e)
    if config.use_bias:
        t[p + "in_proj.bias"] = vec(e + c + h, 0.0, 0.1)
        t[p + "out_proj.bias"] = vec(d, 0.0, 0.1)
    if config.use_conv_bias:
        t[p + "conv1d.bias"] = vec(c, 0.0, 0.1)
    return t


def random_tensor(config: MambaConfig, seed: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """One random tensor of any ``config`` (float32), made on its own: reproducible from
    (``seed``, ``name``) alone, so a model is written one tensor at a time
    (``loader.save_model_streamed``) and never held whole. Drawn as :func:`random_tensors`
    draws each kind (not the same values: those come from one generator in order)."""
    rng = np.random.default_rng([seed, *name.encode()])
    *_, module, leaf = ("", "", *name.split("."))

    def normal(scale: float = 1.0, mean: float = 0.0) -> np.ndarray:
        values = rng.standard_normal(shape, dtype=np.float32)
        values *= np.float32(scale)
        values += np.float32(mean)
        return values

    if leaf == "A_log":
        if config.mamba_version == 2:  # A in [-16, -1] per head
            return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
        n = shape[-1]  # S4D-real, perturbed
        a = np.arange(1, n + 1, dtype=np.float64) * rng.uniform(0.8, 1.25, shape)
        return np.log(a).astype(np.float32)
    if leaf == "dt_bias" or (module == "dt_proj" and leaf == "bias"):
        # Δ = softplus(bias) log-uniform in [1e-3, 1e-1]: bias = log(expm1(Δ))
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), shape))
        return np.log(np.expm1(dt)).astype(np.float32)
    if leaf == "D":
        return normal(0.3, 1.0)
    if module.startswith("norm"):  # the RMSNorms' weights (also Mamba-2's gated norm)
        return normal(0.1, 1.0)
    if module.endswith("_norm"):  # a signal model's normalisation
        return normal() if leaf == "mean" else np.exp(normal(0.3))
    if module == "embeddings":
        return normal()
    if module == "conv1d":
        return normal(0.4) if leaf == "weight" else normal(0.1)
    if leaf == "bias":
        return normal(0.1)
    return normal(shape[-1] ** -0.5)  # a product's weight (o, i): unit-ish outputs
