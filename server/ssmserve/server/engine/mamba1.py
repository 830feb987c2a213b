"""The Mamba-1 mixer, one recurrent step, batched over sessions, in float32 numpy.

Read alongside:
    [1] Mamba: Linear-Time Sequence Modeling with Selective State Spaces (Gu and Dao, 2023),
        https://arxiv.org/abs/2312.00752 — Section 2 (discretization, Eq. 2 and 4),
        Algorithm 2 (selective SSM), Section 3.4 and Figure 3 (the block).
    [2] Hugging Face ``transformers`` ``MambaMixer.slow_forward`` (cache path), whose
        per-step logits the step matches within 1e-5 (``tests/test_hf_reference.py``).

Glossary of shape letters (as in ``mamba.py``):
    b: sessions stepped together (batch)
    d: hidden size (``hidden_size``)
    e: inner size (``intermediate_size``, d_inner; ``D`` in [1] Algorithm 2)
    n: SSM state size (``state_size``; ``N`` in [1])
    k: conv kernel width (``conv_kernel``)
    r: rank of Δ (``time_step_rank``)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import numpy as np

from ssmserve.server.engine import kernels
from ssmserve.server.engine.numerics import RowStableLinear
from ssmserve.server.engine.threads import column_ranges
from ssmserve.server.engine.weights import StepWorkspace


@dataclass(frozen=True)
class MambaBlockWeights:
    """Weights of one residual block: RMSNorm then the Mamba mixer ([1] Figure 3)."""

    norm: np.ndarray  # (d,)
    in_proj: RowStableLinear  # d -> 2e (x branch, z gate)
    conv_weight: np.ndarray  # (e, k) depthwise causal conv, tap k-1 is the newest input
    conv_bias: np.ndarray | None  # (e,)
    x_proj: RowStableLinear  # e -> r + 2n (Δ low-rank, B, C)
    dt_proj: RowStableLinear  # r -> e, with bias
    A: np.ndarray  # (e, n) = -exp(A_log), precomputed once
    D: np.ndarray  # (e,) skip connection
    out_proj: RowStableLinear  # e -> d
    mixer_rms_eps: float = 0.0  # FalconMamba: norms of Δ low rank, B, C; 0: none

    @cached_property
    def conv_bias_or_zero(self) -> np.ndarray:
        """The conv bias, or zeros (the kernel takes an array either way)."""
        if self.conv_bias is not None:
            return self.conv_bias
        return np.zeros(self.conv_weight.shape[0], np.float32)

    @property
    def linears(self) -> tuple[RowStableLinear, ...]:
        return (self.in_proj, self.x_proj, self.dt_proj, self.out_proj)

    @cached_property
    def has_column_ranges(self) -> bool:
        """Whether a product is big enough to cut by columns on several threads
        (``threads.column_ranges``): then a step not cut by rows calls the products one by
        one (``mix_in_steps``), since the fused kernel runs on one thread."""
        return any(
            len(column_ranges(lin.panels.shape[0], lin.panels[0].nbytes, 2)) > 1
            for lin in self.linears
        )

    def buffers(self, rows: int) -> MixerBuffers:
        e, n = self.A.shape
        r = self.dt_proj.in_features
        return MixerBuffers(
            xz=_zeros(rows, 2 * e),
            xs=_zeros(rows, e),
            x_dbl=_zeros(rows, r + 2 * n),
            dt_raw=_zeros(rows, e),
            scratch=_zeros(3 * e),
            scratch_bits=np.zeros(e, np.int32),
        )

    #: One compiled call per mixer (``kernels.mamba_mixer``); False: the same kernels called
    #: one by one from Python (``mix_in_steps``: the reference the tests compare it with,
    #: and what ``bench_engine`` swaps BLAS products into).
    fused: ClassVar[bool] = True

    def mix(
        self,
        ws: StepWorkspace,
        conv: np.ndarray,
        ssm: np.ndarray,
        conv_next: np.ndarray,
        ssm_next: np.ndarray,
    ) -> None:
        """The Mamba mixer for one time step ([1] Figure 3, Algorithm 2 with L = 1), then
        its out_proj.

        Reads ``ws.xn`` (rows, d), the normalised block input; conv (b, e, k) holds the last
        k conv inputs and ssm (b, e, n) the hidden state h_{t-1}. Writes the new window to
        ``conv_next``, h_t to ``ssm_next``, y (before out_proj) to ``ws.y`` (rows, e) and
        out_proj(y) to ``ws.delta`` (rows, d).
        """
        if (
            not self.fused
            or self.mixer_rms_eps  # FalconMamba: the fused kernel has no mixer norms
            or (ws.column_threads > 1 and self.has_column_ranges)
        ):
            self.mix_in_steps(ws, conv, ssm, conv_next, ssm_next)
            return
        m: MixerBuffers = ws.mixer
        kernels.mamba_mixer(
            ws.xn, conv.shape[0],
            self.in_proj.panels, self.in_proj.scales, *_bias(self.in_proj),
            conv, self.conv_weight, self.conv_bias_or_zero, self.conv_bias is not None,
            conv_next,
            self.x_proj.panels, self.x_proj.scales, *_bias(self.x_proj),
            self.dt_proj.panels, self.dt_proj.scales, self.dt_proj.bias, self.dt_proj.in_features,
            self.A, self.D, ssm, ssm_next,
            self.out_proj.panels, self.out_proj.scales, *_bias(self.out_proj),
            m.xz, m.xs, m.x_dbl, m.dt_raw, ws.y, m.scratch, m.scratch_bits, ws.delta,
        )  # fmt: skip

    def mix_in_steps(
        self,
        ws: StepWorkspace,
        conv: np.ndarray,
        ssm: np.ndarray,
        conv_next: np.ndarray,
        ssm_next: np.ndarray,
    ) -> None:
        """:meth:`mix` as one Python call per product and kernel (the same bits)."""
        m: MixerBuffers = ws.mixer
        b = conv.shape[0]
        threads = ws.column_threads
        self.in_proj.into(ws.xn, m.xz, b, threads)  # (b, d) -> (b, 2e): x branch, gate z
        # Causal depthwise conv over the last k inputs, then SiLU: (b, e).
        kernels.conv_silu(
            conv, m.xz, self.conv_weight, self.conv_bias_or_zero, self.conv_bias is not None,
            conv_next, m.xs, m.scratch,
        )  # fmt: skip
        # Selection: Δ, B, C depend on the input ([1] Algorithm 2, lines 3-5).
        self.x_proj.into(m.xs, m.x_dbl, b, threads)  # (b, e) -> (b, r + 2n)
        r, n = self.dt_proj.in_features, self.A.shape[1]
        if self.mixer_rms_eps:  # FalconMamba: RMS norms of Δ low rank, B and C
            kernels.mixer_rms_norms(m.x_dbl, b, r, n, np.float64(self.mixer_rms_eps))
        dt_low = m.x_dbl[:, :r]  # (rows, r) view, rows contiguous
        self.dt_proj.into(dt_low, m.dt_raw, b, threads)  # (b, r) -> (b, e), with bias
        # Discretize, update h, read out, gate: one pass over the (b, e, n) state.
        kernels.selective_scan(
            m.dt_raw, m.xs, m.x_dbl, m.xz, self.A, self.D, ssm, ssm_next, ws.y,
            m.scratch, m.scratch_bits,
        )  # fmt: skip
        self.out_proj.into(ws.y, ws.delta, b, threads)  # (b, e) -> (b, d)


def _bias(linear: RowStableLinear) -> tuple[np.ndarray, bool]:
    """A product's bias for the kernels, which take an array either way, and whether it has one."""
    return (linear.bias, True) if linear.bias is not None else (_NO_BIAS, False)


_NO_BIAS = np.zeros(1, np.float32)


@dataclass
class MixerBuffers:
    """The Mamba-1 mixer's activations for one padded batch size."""

    xz: np.ndarray  # (rows, 2e) in_proj output: x branch and gate z
    xs: np.ndarray  # (rows, e) conv branch after SiLU
    x_dbl: np.ndarray  # (rows, r + 2n) Δ low rank, B, C
    dt_raw: np.ndarray  # (rows, e) dt_proj output
    scratch: np.ndarray  # (3e,) float32 per-row scratch of the kernels
    scratch_bits: np.ndarray  # (e,) int32


def _zeros(*shape: int) -> np.ndarray:
    return np.zeros(shape, np.float32)
