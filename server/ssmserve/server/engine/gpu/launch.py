"""Python side of the GPU engine's kernels: shapes checked, grids set, one call each.

Every launch passes ``enable_fp_fusion=False`` (``kernels.py`` says why). Tensors are
float32 (the residual stream float64) on the model's device, rows contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton

from ssmserve.server.engine.gpu import kernels as k

_OPTS = {"enable_fp_fusion": False}

#: Products of at most this many rows run k-parallel (``kernels.product_blocks_kernel``
#: then ``sum_blocks_kernel``): a decode step has too few row tiles to fill a GPU
#: otherwise. The same bits either way (``tests/test_gpu_engine.py`` checks it).
SPLIT_ROWS = 64


@dataclass(frozen=True)
class DeviceLinear:
    """``y = x @ w.T + bias`` with ``w`` stored transposed, ``w_t`` (K, N): a k step of a
    tile reads N-contiguous weights."""

    w_t: torch.Tensor  # (K, N) bfloat16, float16 or float32 (:func:`narrowest_exact`)
    bias: torch.Tensor | None  # (N,) float32

    @classmethod
    def of(cls, weight: np.ndarray, bias: np.ndarray | None, device: torch.device) -> DeviceLinear:
        w_t = narrowest_exact(np.ascontiguousarray(np.asarray(weight, np.float32).T))
        b = None if bias is None else torch.from_numpy(np.ascontiguousarray(bias, np.float32))
        return cls(w_t.to(device), None if b is None else b.to(device))

    @property
    def in_features(self) -> int:
        return self.w_t.shape[0]

    @property
    def out_features(self) -> int:
        return self.w_t.shape[1]


def narrowest_exact(w: np.ndarray) -> torch.Tensor:
    """``w`` (float32) as bfloat16 or float16 where every value is exactly one of those
    (a model stored in BF16 or F16: the loader widens it exactly), else float32. The
    kernels widen each weight to float32 as they load it, so the storage changes no bit
    and a 16-bit model reads half the bytes per step."""
    if not (w.view(np.uint32) & np.uint32(0xFFFF)).any():  # bfloat16: float32's high half
        return torch.from_numpy(w).to(torch.bfloat16)
    with np.errstate(over="ignore"):
        half = w.astype(np.float16)
    if np.array_equal(half.astype(np.float32), w):
        return torch.from_numpy(half)
    return torch.from_numpy(w)


def product(x: torch.Tensor, lin: DeviceLinear, split: bool | None = None) -> torch.Tensor:
    """``x`` (M, K) (row stride free, columns contiguous) -> (M, N) float32, each element
    summed in the fixed order of ``kernels.product_kernel``. ``split``: force the k-parallel
    launch (True) or the one-pass launch (False); None picks by :data:`SPLIT_ROWS`."""
    m, kk = x.shape
    n = lin.out_features
    if kk != lin.in_features or x.stride(1) != 1 or x.dtype != torch.float32:
        raise ValueError(f"product of {tuple(x.shape)} {x.dtype} with a ({kk}, {n}) weight")
    out = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0:
        return out
    bias = lin.bias if lin.bias is not None else lin.w_t  # a placeholder pointer
    has_bias = lin.bias is not None
    tiles = (triton.cdiv(m, k.BLOCK_M), triton.cdiv(n, k.BLOCK_N))
    blocks = triton.cdiv(kk, k.K_BLOCK)
    if split is None:
        split = m <= SPLIT_ROWS and blocks > 1
    if not split:
        k.product_kernel[tiles](
            x, x.stride(0), lin.w_t, bias, out, n, m, n, kk,
            HAS_BIAS=has_bias, BM=k.BLOCK_M, BN=k.BLOCK_N, KB=k.K_BLOCK, **_OPTS,
        )  # fmt: skip
        return out
    partial = torch.empty((blocks, m, n), dtype=torch.float32, device=x.device)
    k.product_blocks_kernel[(*tiles, blocks)](
        x, x.stride(0), lin.w_t, partial, m, n, kk,
        BM=k.BLOCK_M, BN=k.BLOCK_N, KB=k.K_BLOCK, **_OPTS,
    )  # fmt: skip
    k.sum_blocks_kernel[tiles](
        partial, bias, out, n, m, n, blocks,
        HAS_BIAS=has_bias, BM=k.BLOCK_M, BN=k.BLOCK_N, **_OPTS,
    )  # fmt: skip
    return out


def rms_norm(
    h: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor, delta: torch.Tensor | None = None
) -> torch.Tensor:
    """``h`` (M, D) float64 (``h += delta`` first, in place, when given) -> RMSNorm (M, D)
    float32, each row computed in float64 and rounded once, as the CPU engine does;
    ``eps`` a one-element float64 tensor."""
    m, d = h.shape
    out = torch.empty((m, d), dtype=torch.float32, device=h.device)
    if m:
        k.residual_rms_norm_kernel[(m,)](
            h, delta if delta is not None else h, weight, out, eps, m, d,
            ADD=delta is not None, BD=triton.next_power_of_2(d), **_OPTS,
        )  # fmt: skip
    return out


def gated_rms_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float
) -> torch.Tensor:
    """Mamba-2's gated norm: ``y`` (M, E), gate ``z`` (M, E) (row stride free) -> (M, E)."""
    m, e = y.shape
    out = torch.empty_like(y)
    size = e // groups
    if m:
        k.gated_rms_norm_kernel[(m, groups)](
            y, z, z.stride(0), weight, out, eps, m, e, size,
            BS=triton.next_power_of_2(size), **_OPTS,
        )  # fmt: skip
    return out


def conv_silu(
    xin: torch.Tensor,
    state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    sessions: int,
    positions: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU of ``positions`` new inputs for each of ``sessions``:
    ``xin`` (S T, C) (row stride free), ``state`` (S, C, KW) -> (out (S T, C), new state)."""
    _, c, kw = state.shape
    out = torch.empty((sessions * positions, c), dtype=torch.float32, device=xin.device)
    new_state = torch.empty_like(state)
    rows = sessions * positions
    k.conv_silu_kernel[(triton.cdiv(rows, k.BLOCK_R), triton.cdiv(c, k.BLOCK_C))](
        xin, xin.stride(0), state, weight, bias if bias is not None else weight, out, new_state,
        rows, positions, c, KW=kw, HAS_BIAS=bias is not None, BR=k.BLOCK_R, BC=k.BLOCK_C,
        **_OPTS,
    )  # fmt: skip
    return out, new_state


def selective_scan(
    dt_raw: torch.Tensor,
    xs: torch.Tensor,
    x_dbl: torch.Tensor,
    xz: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    ssm: torch.Tensor,
    rank: int,
    positions: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-1's scan over ``positions`` per session -> (y (S T, E), new ssm (S, E, N))."""
    s, e, n = ssm.shape
    y = torch.empty((s * positions, e), dtype=torch.float32, device=ssm.device)
    new_ssm = torch.empty_like(ssm)
    k.selective_scan_kernel[(s, triton.cdiv(e, k.BLOCK_E))](
        dt_raw, xs, x_dbl, x_dbl.stride(0), xz, xz.stride(0), A, D, ssm, new_ssm, y,
        positions, e, n, rank, NP=triton.next_power_of_2(n), BE=k.BLOCK_E, **_OPTS,
    )  # fmt: skip
    return y, new_ssm


def ssd_scan(
    zxbcdt: torch.Tensor,
    xbc: torch.Tensor,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    ssm: torch.Tensor,
    groups: int,
    dt_bounds: tuple[float, float],
    positions: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's scan over ``positions`` per session -> (y (S T, E), new ssm (S, H, P, N))."""
    s, h, p, n = ssm.shape
    e = h * p
    y = torch.empty((s * positions, e), dtype=torch.float32, device=ssm.device)
    new_ssm = torch.empty_like(ssm)
    k.ssd_scan_kernel[(s, triton.cdiv(e, k.BLOCK_E))](
        zxbcdt, zxbcdt.stride(0), xbc, xbc.stride(0), dt_bias, A, D, ssm, new_ssm, y,
        dt_bounds[0], dt_bounds[1], positions, h, p, n, groups, e, zxbcdt.shape[1],
        NP=triton.next_power_of_2(n), BE=k.BLOCK_E, **_OPTS,
    )  # fmt: skip
    return y, new_ssm
