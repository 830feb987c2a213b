"""One residual block's weights on the device and its mixer over S sessions x T positions.

The same mixer serves a decode step (S sessions, T = 1) and a prefill (S = 1, T
positions): products over all S T rows at once (a row's bits do not depend on how many),
the conv per position, the scan walking each session's positions in order. So a prefill
of T positions and T steps run the same kernels on the same values, element by element.

Rows are session-major: row ``s T + t`` is position ``t`` of session ``s``. Shape letters
as in ``engine/mamba.py`` and ``engine/mamba2.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ssmserve.server.engine.config import MambaConfig
from ssmserve.server.engine.gpu import launch
from ssmserve.server.engine.gpu.launch import DeviceLinear


def _dev(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).to(device)


@dataclass(frozen=True)
class Mamba1Layer:
    """A Mamba-1 block: RMSNorm weight, then the selective-scan mixer."""

    norm: torch.Tensor  # (d,)
    in_proj: DeviceLinear  # d -> 2e
    conv_weight: torch.Tensor  # (e, k)
    conv_bias: torch.Tensor | None  # (e,)
    x_proj: DeviceLinear  # e -> r + 2n
    dt_proj: DeviceLinear  # r -> e, with bias
    A: torch.Tensor  # (e, n) = -exp(A_log), computed in numpy as the CPU engine does
    D: torch.Tensor  # (e,)
    out_proj: DeviceLinear  # e -> d

    @classmethod
    def of(cls, t: dict[str, np.ndarray], layer: int, device: torch.device) -> Mamba1Layer:
        p = f"backbone.layers.{layer}.mixer."
        conv_bias = t.get(p + "conv1d.bias")
        return cls(
            norm=_dev(t[f"backbone.layers.{layer}.norm.weight"], device),
            in_proj=DeviceLinear.of(t[p + "in_proj.weight"], t.get(p + "in_proj.bias"), device),
            conv_weight=_dev(t[p + "conv1d.weight"][:, 0, :], device),
            conv_bias=None if conv_bias is None else _dev(conv_bias, device),
            x_proj=DeviceLinear.of(t[p + "x_proj.weight"], None, device),
            dt_proj=DeviceLinear.of(t[p + "dt_proj.weight"], t[p + "dt_proj.bias"], device),
            A=_dev(-np.exp(t[p + "A_log"]), device),
            D=_dev(t[p + "D"], device),
            out_proj=DeviceLinear.of(t[p + "out_proj.weight"], t.get(p + "out_proj.bias"), device),
        )

    @property
    def linears(self) -> tuple[DeviceLinear, ...]:
        return (self.in_proj, self.x_proj, self.dt_proj, self.out_proj)

    def mix(
        self, xn: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, positions: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """xn (S T, d) -> (out_proj(y) (S T, d), new conv (S, e, k), new ssm (S, e, n))."""
        e = self.D.shape[0]
        rank = self.dt_proj.in_features
        sessions = conv.shape[0]
        xz = launch.product(xn, self.in_proj)  # (S T, 2e): x branch, gate z
        xs, new_conv = launch.conv_silu(
            xz[:, :e], conv, self.conv_weight, self.conv_bias, sessions, positions
        )  # (S T, e)
        x_dbl = launch.product(xs, self.x_proj)  # (S T, r + 2n): Δ low rank, B, C
        dt_raw = launch.product(x_dbl[:, :rank], self.dt_proj)  # (S T, e)
        y, new_ssm = launch.selective_scan(
            dt_raw, xs, x_dbl, xz, self.A, self.D, ssm, rank, positions
        )  # (S T, e)
        return launch.product(y, self.out_proj), new_conv, new_ssm


@dataclass(frozen=True)
class Mamba2Layer:
    """A Mamba-2 block: RMSNorm weight, then the multi-head SSD mixer and gated norm."""

    norm: torch.Tensor  # (d,)
    in_proj: DeviceLinear  # d -> e + c + h
    conv_weight: torch.Tensor  # (c, k)
    conv_bias: torch.Tensor | None  # (c,)
    dt_bias: torch.Tensor  # (h,)
    A: torch.Tensor  # (h,)
    D: torch.Tensor  # (h,)
    gated_norm: torch.Tensor  # (e,)
    out_proj: DeviceLinear  # e -> d
    groups: int
    dt_bounds: tuple[float, float]  # time_step_limit in float32 (inf: float32's max)
    eps: float  # of the gated norm (float32, as the CPU engine uses it)

    @classmethod
    def of(
        cls, c: MambaConfig, t: dict[str, np.ndarray], layer: int, device: torch.device
    ) -> Mamba2Layer:
        p = f"backbone.layers.{layer}.mixer."
        conv_bias = t.get(p + "conv1d.bias")
        low, high = c.time_step_limit
        top = float(np.float32(min(high, float(np.finfo(np.float32).max))))
        return cls(
            norm=_dev(t[f"backbone.layers.{layer}.norm.weight"], device),
            in_proj=DeviceLinear.of(t[p + "in_proj.weight"], t.get(p + "in_proj.bias"), device),
            conv_weight=_dev(t[p + "conv1d.weight"][:, 0, :], device),
            conv_bias=None if conv_bias is None else _dev(conv_bias, device),
            dt_bias=_dev(t[p + "dt_bias"], device),
            A=_dev(-np.exp(t[p + "A_log"]), device),
            D=_dev(t[p + "D"], device),
            gated_norm=_dev(t[p + "norm.weight"], device),
            out_proj=DeviceLinear.of(t[p + "out_proj.weight"], t.get(p + "out_proj.bias"), device),
            groups=c.n_groups,
            dt_bounds=(float(np.float32(low)), top),
            eps=float(np.float32(c.layer_norm_epsilon)),
        )

    @property
    def linears(self) -> tuple[DeviceLinear, ...]:
        return (self.in_proj, self.out_proj)

    def mix(
        self, xn: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, positions: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """xn (S T, d) -> (out_proj(y) (S T, d), new conv (S, c, k), new ssm (S, h, p, n))."""
        e = self.gated_norm.shape[0]
        c = self.conv_weight.shape[0]
        sessions = conv.shape[0]
        zxbcdt = launch.product(xn, self.in_proj)  # (S T, e + c + h): z, xBC, Δ
        xbc, new_conv = launch.conv_silu(
            zxbcdt[:, e : e + c], conv, self.conv_weight, self.conv_bias, sessions, positions
        )  # (S T, c)
        y, new_ssm = launch.ssd_scan(
            zxbcdt, xbc, self.dt_bias, self.A, self.D, ssm, self.groups, self.dt_bounds,
            positions,
        )  # fmt: skip
        y = launch.gated_rms_norm(y, zxbcdt[:, :e], self.gated_norm, self.groups, self.eps)
        return launch.product(y, self.out_proj), new_conv, new_ssm


Layer = Mamba1Layer | Mamba2Layer
