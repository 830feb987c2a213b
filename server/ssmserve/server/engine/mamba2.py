"""The Mamba-2 mixer, one recurrent step, batched over sessions, in float32 numpy.

Read alongside:
    [1] Transformers are SSMs: Generalized Models and Efficient Algorithms Through
        Structured State Space Duality (Dao and Gu, 2024), https://arxiv.org/abs/2405.21060
        — Section 7 (the Mamba-2 block: parallel projections, multi-head SSM with a
        scalar decay per head, groups of heads sharing B and C, the gated norm).
    [2] Hugging Face ``transformers`` 5 ``Mamba2Mixer.forward`` and
        ``mamba2_selective_state_update`` (the recurrent path), whose per-step logits
        this module matches within 1e-5 (``tests/test_hf_mamba2.py``).

Glossary of shape letters (as in ``mamba.py``, plus):
    h: heads (``num_heads``)         p: head dim (``head_dim``), e = h p
    g: groups (``n_groups``), each of h / g heads shares one B and one C
    c: conv channels, e + 2 g n (x, B and C are convolved together)

Where ssmserve and its references differ, on purpose:

* **Δ is clamped to ``time_step_limit``** at every step. transformers' and mamba_ssm's
  chunked scans (prefill) clamp, but their one-token update does not, so with a limit
  other than (0, inf) their decode disagrees with their own prefill. ssmserve clamps
  always (the model's definition, as trained). With the default limit nothing differs.
* **The gated norm is per group** (``n_groups`` slices of e / g), as mamba_ssm and
  transformers 5 compute it. transformers before 4.48 normalised over the whole inner
  size, which differs when g > 1; checkpoints are trained with the per-group norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ssmserve.server.engine import kernels
from ssmserve.server.engine.numerics import RowStableLinear
from ssmserve.server.engine.weights import StepWorkspace


@dataclass(frozen=True)
class Mamba2BlockWeights:
    """Weights of one residual block: RMSNorm then the Mamba-2 mixer ([1] Figure 6)."""

    norm: np.ndarray  # (d,)
    in_proj: RowStableLinear  # d -> e + c + h: gate z, conv input [x, B, C], Δ per head
    conv_weight: np.ndarray  # (c, k) depthwise causal conv, tap k-1 is the newest input
    conv_bias: np.ndarray | None  # (c,)
    dt_bias: np.ndarray  # (h,)
    A: np.ndarray  # (h,) = -exp(A_log), precomputed once
    D: np.ndarray  # (h,) skip connection
    gated_norm: np.ndarray  # (e,) weight of the gated RMSNorm
    out_proj: RowStableLinear  # e -> d
    groups: int  # g
    time_step_limit: tuple[float, float]
    eps: float  # of the gated norm (the config's layer_norm_epsilon)

    @cached_property
    def dt_bounds(self) -> tuple[np.float32, np.float32]:
        """``time_step_limit`` in float32 for the kernel (infinity as float32's largest
        value: a clamp that never bites)."""
        low, high = self.time_step_limit
        return np.float32(low), np.float32(min(high, float(np.finfo(np.float32).max)))

    @cached_property
    def conv_bias_or_zero(self) -> np.ndarray:
        """The conv bias, or zeros (the kernel takes an array either way)."""
        if self.conv_bias is not None:
            return self.conv_bias
        return np.zeros(self.conv_weight.shape[0], np.float32)

    @property
    def heads(self) -> int:
        return self.A.shape[0]

    @property
    def linears(self) -> tuple[RowStableLinear, ...]:
        return (self.in_proj, self.out_proj)

    def buffers(self, rows: int) -> Mamba2Buffers:
        c = self.conv_weight.shape[0]
        e = self.gated_norm.shape[0]
        return Mamba2Buffers(
            zxbcdt=np.zeros((rows, self.in_proj.out_features), np.float32),
            xbc=np.zeros((rows, c), np.float32),
            scratch=np.zeros(max(2 * c, 2 * e, 4 * self.heads), np.float32),
            scratch_bits=np.zeros(self.heads, np.int32),
        )

    def mix(
        self,
        ws: StepWorkspace,
        conv: np.ndarray,
        ssm: np.ndarray,
        conv_next: np.ndarray,
        ssm_next: np.ndarray,
    ) -> None:
        """The Mamba-2 mixer for one time step ([1] Section 7.1, [2] recurrent path).

        Reads ``ws.xn`` (rows, d), the normalised block input; conv (b, c, k) holds the
        last k conv inputs and ssm (b, h, p, n) the state h_{t-1}. Writes the new window to
        ``conv_next``, h_t to ``ssm_next``, the gated, normalised y to ``ws.y`` (rows, e)
        and out_proj(y) to ``ws.delta`` (rows, d).
        """
        m: Mamba2Buffers = ws.mixer
        e = self.gated_norm.shape[0]
        c = self.conv_weight.shape[0]
        b = conv.shape[0]
        threads = ws.column_threads  # products cut by columns when the step is not by rows
        self.in_proj.into(ws.xn, m.zxbcdt, b, threads)  # (b, d) -> (b, e + c + h): z, xBC, Δ
        # Causal depthwise conv of x, B and C together, then SiLU: (b, c).
        kernels.conv_silu(
            conv, m.zxbcdt[:, e : e + c], self.conv_weight, self.conv_bias_or_zero,
            self.conv_bias is not None, conv_next, m.xbc, m.scratch,
        )  # fmt: skip
        # Discretize, update the (b, h, p, n) state, read out with C, add D x: (b, e).
        dt_min, dt_max = self.dt_bounds
        kernels.ssd_step(
            m.zxbcdt, m.xbc, self.dt_bias, self.A, self.D, dt_min, dt_max,
            ssm, ssm_next, ws.y, m.scratch, m.scratch_bits,
        )  # fmt: skip
        # Gate with silu(z) and normalise per group: (b, e), in place.
        kernels.gated_rms_norm_rows(
            ws.y, m.zxbcdt, self.gated_norm, self.groups, np.float32(self.eps), b, ws.y,
            m.scratch,
        )  # fmt: skip
        self.out_proj.into(ws.y, ws.delta, b, threads)  # (b, e) -> (b, d)


@dataclass
class Mamba2Buffers:
    """The Mamba-2 mixer's activations for one padded batch size."""

    zxbcdt: np.ndarray  # (rows, e + c + h) in_proj output
    xbc: np.ndarray  # (rows, c) conv output after SiLU: x, B, C
    scratch: np.ndarray  # float32 per-row scratch of the kernels
    scratch_bits: np.ndarray  # int32
