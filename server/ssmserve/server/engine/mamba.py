"""One recurrent step of a Mamba stack, batched over sessions, in float32 numpy: the
model (:class:`MambaModel`) around its blocks' mixers (``mamba1``, ``mamba2``).

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

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ssmserve.server.engine import kernels
from ssmserve.server.engine.mamba1 import MambaBlockWeights
from ssmserve.server.engine.numerics import widened
from ssmserve.server.engine.prefill import OutputRows, prefill
from ssmserve.server.engine.recurrent_state import BatchState, SessionState
from ssmserve.server.engine.split_step import step_shared, worth_sharing
from ssmserve.server.engine.threads import row_ranges, run_ranges
from ssmserve.server.engine.weights import ModelWeights

if TYPE_CHECKING:
    from concurrent.futures import Executor


class MambaModel(ModelWeights):
    """Read-only weights (:class:`~ssmserve.server.engine.weights.ModelWeights`) plus the
    pure, batched :meth:`step`, and prefill."""

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
