"""One recurrent step of a Mamba stack, batched over sessions, in float32 numpy.

Read alongside:
    [1] Mamba: Linear-Time Sequence Modeling with Selective State Spaces (Gu and Dao, 2023),
        https://arxiv.org/abs/2312.00752 — Section 2 (discretization, Eq. 2 and 4),
        Algorithm 2 (selective SSM), Section 3.4 and Figure 3 (the block).
    [2] Hugging Face ``transformers`` ``MambaMixer.slow_forward`` (cache path), whose
        per-step logits this module matches within 1e-5 (``tests/test_hf_reference.py``).

Glossary of shape letters:
    b: sessions stepped together (batch)
    d: hidden size (``hidden_size``)
    e: inner size (``intermediate_size``, d_inner; ``D`` in [1] Algorithm 2)
    n: SSM state size (``state_size``; ``N`` in [1])
    k: conv kernel width (``conv_kernel``)
    r: rank of Δ (``time_step_rank``)
    v: vocabulary size (token models);  i / o: signal input / output width

Every product goes through :class:`~ssmserve.server.engine.numerics.RowStableLinear`, so a row's
result does not depend on the other rows; everything else is a numba kernel that treats
each row alike (``kernels.py``). Hence batch invariance (see ``numerics.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from ssmserve.server.engine import kernels
from ssmserve.server.engine.config import MambaConfig
from ssmserve.server.engine.numerics import RowStableLinear, padded, widened
from ssmserve.server.engine.recurrent_state import BatchState, SessionState, state_layout
from ssmserve.server.engine.split_step import step_shared, worth_sharing
from ssmserve.server.engine.threads import (
    column_ranges,
    engine_threads,
    row_ranges,
    run_ranges,
)
from ssmserve.server.errors import ModelInputError

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from ssmserve.server.engine.prefill import OutputRows


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


class BlockWeights(Protocol):
    """One residual block's weights: its pre-norm and a mixer (Mamba-1: ``MambaBlockWeights``
    here; Mamba-2: ``mamba2.Mamba2BlockWeights``)."""

    norm: np.ndarray  # (d,)
    out_proj: RowStableLinear  # e -> d

    @property
    def linears(self) -> tuple[RowStableLinear, ...]: ...

    def buffers(self, rows: int) -> Any: ...

    def mix(
        self,
        ws: StepWorkspace,
        conv: np.ndarray,
        ssm: np.ndarray,
        conv_next: np.ndarray,
        ssm_next: np.ndarray,
    ) -> None:
        """Reads ``ws.xn``; writes the new states and ``ws.delta`` = out_proj(mixer)."""


@dataclass
class StepWorkspace:
    """Preallocated activations for one padded batch size: a step allocates only its results.

    Every array has ``rows`` rows (the batch rounded up, see ``numerics.padded``); rows
    past the batch are never computed and never read.
    """

    rows: int
    signal: np.ndarray  # (rows, i) signal inputs
    h: np.ndarray  # (rows, d) residual stream, float64 (``kernels.rms_norm_rows`` says why)
    xn: np.ndarray  # (rows, d) normalised block input
    y: np.ndarray  # (rows, e) mixer output
    delta: np.ndarray  # (rows, d) out_proj output
    mixer: Any  # the mixer's own buffers (``BlockWeights.buffers``)
    #: Threads this step's products may cut their columns over: the model's threads when
    #: the step is not cut by rows, else 1 (``MambaModel.step``).
    column_threads: int = 1

    @classmethod
    def allocate(cls, c: MambaConfig, rows: int, block: BlockWeights) -> StepWorkspace:
        d, e = c.hidden_size, c.intermediate_size
        return cls(
            rows=rows,
            signal=_zeros(rows, max(c.input_dim, 1)),
            h=np.zeros((rows, d), np.float64),
            xn=_zeros(rows, d),
            y=_zeros(rows, e),
            delta=_zeros(rows, d),
            mixer=block.buffers(rows),
        )


@dataclass(frozen=True)
class ChannelScaling:
    """A signal model's per-channel normalisation: ``(x - mean) / std`` of the inputs
    before the input projection, ``y * std + mean`` of the outputs after the head, each
    two float32 operations per element, each rounded, in the order a PyTorch module
    computes them (``ssmserve.server.export.SignalMamba``)."""

    mean: np.ndarray  # (i,) | (o,)
    std: np.ndarray  # (i,) | (o,), every value > 0

    def normalize_into(self, x: np.ndarray, out: np.ndarray) -> None:
        """``out = (x - mean) / std``: (b, i) -> (b, i)."""
        np.subtract(x, self.mean, out=out)
        np.divide(out, self.std, out=out)

    def denormalize(self, y: np.ndarray) -> None:
        """``y = y * std + mean`` in place: (b, o)."""
        np.multiply(y, self.std, out=y)
        np.add(y, self.mean, out=y)


def _zeros(*shape: int) -> np.ndarray:
    return np.zeros(shape, np.float32)


class MambaModel:
    """Read-only weights plus the pure, batched :meth:`step`.

    Token models (``mamba-lm``) take int token ids ``(b,)`` and return logits ``(b, v)``;
    signal models take float32 ``(b, i)`` and return ``(b, o)``. A token model whose head
    is tied to its embeddings passes no ``embeddings``: rows are read from the head.
    """

    def __init__(
        self,
        config: MambaConfig,
        blocks: Sequence[BlockWeights],
        norm_f: np.ndarray,
        head: RowStableLinear,
        *,
        embeddings: np.ndarray | None = None,
        input_proj: RowStableLinear | None = None,
        input_norm: ChannelScaling | None = None,
        output_norm: ChannelScaling | None = None,
        fingerprint: str = "",
        name: str = "",
    ) -> None:
        if config.is_token_model and embeddings is None and not config.tie_word_embeddings:
            raise ValueError("a token model with an untied head needs embeddings")
        if not config.is_token_model and input_proj is None:
            raise ValueError("a signal model needs an input projection")
        self.config = config
        self.blocks = tuple(blocks)
        self.norm_f = norm_f  # (d,)
        self.head = head  # d -> v | o
        self.embeddings = embeddings  # (v, d), or None: tied to the head
        self.input_proj = input_proj  # i -> d
        self.input_norm = input_norm  # signal inputs, before input_proj
        self.output_norm = output_norm  # signal outputs, after the head
        self.fingerprint = fingerprint
        self.name = name
        #: Threads one step may use (row ranges; see :meth:`step`). Changes no bits.
        self.threads = engine_threads()
        self._flops_per_row = self.flops_per_step
        self._buffers = threading.local()  # StepWorkspace per thread and padded batch size
        # The zeros every new session starts from: one read-only buffer for all of them.
        layout = state_layout(
            config.num_hidden_layers, config.conv_state_shape, config.ssm_state_shape
        )
        zeros = np.zeros(layout.size, np.float32)
        zeros.flags.writeable = False
        self._zero_state = (zeros, layout)

    @property
    def linears(self) -> list[RowStableLinear]:
        """Every product of a step: the blocks', the head, the signal input projection."""
        out = [lin for b in self.blocks for lin in b.linears]
        out.append(self.head)
        if self.input_proj is not None:
            out.append(self.input_proj)
        return out

    @cached_property
    def weight_bytes(self) -> int:
        """Bytes of the products' packed weights (BF16 ones at 2 a value, Q8_0 at 1.125)
        and the embedding table: what a step reads, and nearly all the model holds."""
        held = sum(lin.nbytes for lin in self.linears)
        return held + (self.embeddings.nbytes if self.embeddings is not None else 0)

    @cached_property
    def flops_per_step(self) -> int:
        """FLOPs of the products for one session-step (the elementwise work is extra).
        Cached: weights never change, and every engine call reads it (``EngineLane``)."""
        return sum(2 * lin.in_features * lin.out_features for lin in self.linears)

    # ------------------------------------------------------------------ state and inputs

    def new_state(self) -> SessionState:
        """The state of a session that has seen no input (step 0): all zeros.

        Every new state shares one read-only buffer. Why: a worker creates sessions by the
        thousand, each state would be its own zeros until its first step replaces it, and
        states are values (nothing writes into one; a write into the shared zeros would
        raise)."""
        zeros, layout = self._zero_state
        return SessionState.of_buffer(zeros, layout)

    def check_state(self, state: SessionState) -> None:
        """Raise ``ModelInputError`` unless ``state`` has this model's layers, dtypes, shapes."""
        c = self.config
        if len(state.layers) != c.num_hidden_layers:
            raise ModelInputError(
                f"state has {len(state.layers)} layers, model has {c.num_hidden_layers}"
            )
        want_conv, want_ssm = c.conv_state_shape, c.ssm_state_shape
        for i, layer in enumerate(state.layers):
            for what, arr, want in (("conv", layer.conv, want_conv), ("ssm", layer.ssm, want_ssm)):
                if arr.dtype != np.float32 or arr.shape != want:
                    raise ModelInputError(
                        f"layer {i} {what} state is {arr.dtype}{list(arr.shape)}, "
                        f"model needs float32{list(want)}"
                    )

    def check_inputs(self, inputs: np.ndarray, batch: int | None = None) -> np.ndarray:
        """Validate one step's inputs for ``batch`` sessions; return them in engine dtype.

        Token models: integer ids ``(b,)`` in ``[0, vocab)``. Signal models: finite floats
        ``(b, input_dim)``. Anything else raises :class:`ModelInputError` naming the problem.
        """
        c = self.config
        arr = np.asarray(inputs)
        if c.is_token_model:
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise ModelInputError(
                    f"token model expects integer token ids of shape (batch,), "
                    f"got {arr.dtype}{list(arr.shape)}"
                )
            if arr.size and (arr.min() < 0 or arr.max() >= c.vocab_size):
                bad = arr[(arr < 0) | (arr >= c.vocab_size)][0]
                raise ModelInputError(f"token id {int(bad)} is outside [0, {c.vocab_size})")
            arr = arr.astype(np.int64, copy=False)
        else:
            if arr.ndim != 2 or arr.shape[1] != c.input_dim:
                raise ModelInputError(
                    f"signal model expects float inputs of shape (batch, {c.input_dim}), "
                    f"got {arr.dtype}{list(arr.shape)}"
                )
            if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
                raise ModelInputError(f"signal inputs must be numbers, got {arr.dtype}")
            arr = np.ascontiguousarray(arr, dtype=np.float32)
            if not np.isfinite(arr).all():
                raise ModelInputError("signal inputs contain NaN or Inf")
        if batch is not None and arr.shape[0] != batch:
            raise ModelInputError(f"got inputs for {arr.shape[0]} sessions, state has {batch}")
        return arr

    # ------------------------------------------------------------------ the step

    def step(self, state: BatchState, inputs: np.ndarray) -> tuple[BatchState, np.ndarray]:
        """Advance ``b`` sessions by one input each; returns (new state, outputs).

        ``state`` is not modified. Outputs are logits ``(b, v)`` or signal ``(b, o)``.
        Inputs must already satisfy :meth:`check_inputs` (the hot path does not re-check).
        Safe to call from several threads at once (each thread has its own buffers).

        A batch big enough to pay for the hand-off (``row_ranges``: at least
        :data:`MIN_FLOP_PER_THREAD` of products and :data:`MIN_ROWS_PER_THREAD` rows per
        range) is cut into up to :attr:`threads` row ranges stepped at once (every kernel
        releases the GIL). Rows are independent, so this changes no bits.
        """
        b = state.batch_size
        new_conv = tuple(np.empty_like(conv) for conv in state.conv)  # (b, e, k) per layer
        new_ssm = tuple(np.empty_like(ssm) for ssm in state.ssm)  # (b, e, n) | (b, h, p, n)
        out = np.empty((b, self.head.out_features), np.float32)  # the caller keeps it
        parts = row_ranges(b, self.threads, self._flops_per_row)
        # A step not cut by rows may cut its big products by columns instead (helpers
        # never run a row range and a column range of one step at once, so none waits).
        columns = self.threads if len(parts) == 1 else 1
        run_ranges(
            parts,
            lambda lo, hi: self._step_rows(state, inputs, new_conv, new_ssm, out, lo, hi, columns),
        )
        return BatchState(new_conv, new_ssm), out

    def _step_rows(
        self,
        state: BatchState,
        inputs: np.ndarray,
        new_conv: tuple[np.ndarray, ...],
        new_ssm: tuple[np.ndarray, ...],
        out: np.ndarray,
        lo: int,
        hi: int,
        column_threads: int,
    ) -> None:
        """The step for rows ``lo:hi`` of the batch, written into those rows of
        ``new_conv``, ``new_ssm`` and ``out`` (views: the other rows are not touched);
        its products may cut their columns over ``column_threads`` threads."""
        c = self.config
        b = hi - lo
        ws = self._workspace(b)
        ws.column_threads = column_threads
        eps = np.float64(c.layer_norm_epsilon)
        x = inputs[lo:hi]
        if self.embeddings is not None:
            ws.h[:b] = widened(self.embeddings[x])  # (b, d)
        elif self.input_proj is None:
            ws.h[:b] = self.head.weight_rows(x)  # (b, d): the tied head's rows
        else:
            if self.input_norm is None:
                ws.signal[:b] = x  # (b, i)
            else:
                self.input_norm.normalize_into(x, ws.signal[:b])  # (b, i)
            self.input_proj.into(ws.signal, ws.delta, b, column_threads)  # (b, i) -> (b, d)
            ws.h[:b] = ws.delta[:b]  # (b, d) float32 -> the float64 stream
        blocks = self.blocks
        kernels.rms_norm_rows(ws.h, blocks[0].norm, eps, b, ws.xn)  # (b, d)
        if (
            column_threads > 1
            and MambaBlockWeights.fused
            and b == state.batch_size
            and worth_sharing(self, column_threads)
            and step_shared(self, ws, state, new_conv, new_ssm, out, b, column_threads)
        ):  # the stack and head in one call per thread (``split_step``): the same bits
            if self.output_norm is not None:
                self.output_norm.denormalize(out[lo:hi])  # (b, o)
            return
        for i, block in enumerate(blocks):
            # States are values, never updated: the new ones go to new arrays.
            # -> ws.delta (b, d), the block's output before the residual
            block.mix(
                ws,
                state.conv[i][lo:hi],
                state.ssm[i][lo:hi],
                new_conv[i][lo:hi],
                new_ssm[i][lo:hi],
            )  # fmt: skip
            # Residual around the block, then the next block's norm (or the final norm).
            norm = blocks[i + 1].norm if i + 1 < len(blocks) else self.norm_f
            kernels.residual_rms_norm_rows(ws.h, ws.delta, norm, eps, b, ws.xn)  # (b, d)
        self.head.into(ws.xn, out[lo:hi], b, column_threads)  # (b, d) -> (b, v | o)
        if self.output_norm is not None:
            self.output_norm.denormalize(out[lo:hi])  # (b, o)

    def _workspace(self, batch: int) -> StepWorkspace:
        """This thread's buffers for ``batch`` sessions (rows rounded up, ``padded``)."""
        cache: dict[int, StepWorkspace] | None = getattr(self._buffers, "by_rows", None)
        if cache is None:
            cache = self._buffers.by_rows = {}
        rows = padded(batch)
        ws = cache.get(rows)
        if ws is None:
            ws = cache[rows] = StepWorkspace.allocate(self.config, rows, self.blocks[0])
        return ws

    # ------------------------------------------------------------------ prefill

    def prefill(
        self,
        inputs: np.ndarray,
        state: SessionState | None = None,
        outputs: OutputRows = "all",
        helpers: Sequence[Executor] | None = None,
    ) -> tuple[np.ndarray, SessionState]:
        """One session through a whole sequence at matrix speed, with the bits of
        :meth:`run` (``prefill.py``: each layer's products over all positions at once,
        the conv and the scan position by position, the head only where asked).

        ``inputs``: token ids ``(T,)`` or signal ``(T, input_dim)``, checked as
        :meth:`check_inputs` does. ``outputs``: ``"all"``, ``"last"``, ``"none"``, a
        boolean mask ``(T,)`` or strictly increasing indices. Returns the outputs of those
        positions ``(m, output_dim)`` float32, in order, and the state after the last
        input (``state``, or a fresh one, is not modified). ``helpers``: single-thread
        executors for its runners beyond the first (an engine lane's); None: threads of
        its own.
        """
        from ssmserve.server.engine.prefill import prefill  # imports this module

        return prefill(self, inputs, state, outputs, helpers)

    # ------------------------------------------------------------------ conveniences

    def run(
        self, inputs: np.ndarray, state: SessionState | None = None
    ) -> tuple[np.ndarray, SessionState]:
        """Step one session through a whole sequence, one input at a time.

        ``inputs``: token ids ``(T,)`` or signal ``(T, input_dim)``. Returns outputs
        ``(T, output_dim)`` float32 and the final state. Starts from a fresh state unless
        ``state`` is given.
        """
        seq = self.check_inputs(inputs)  # (T,) ids or (T, i): the sequence is a "batch" of T
        batch = BatchState.stack([state if state is not None else self.new_state()])
        outputs = np.empty((seq.shape[0], self.config.output_dim), np.float32)  # (T, o)
        for t in range(seq.shape[0]):
            batch, out = self.step(batch, seq[t : t + 1])
            outputs[t] = out[0]
        return outputs, batch.session(0)
