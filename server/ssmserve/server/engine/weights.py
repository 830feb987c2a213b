"""What a Mamba stack is made of, below the math that steps it: a block's weights (the
:class:`BlockWeights` each mixer implements), a step's preallocated activations
(:class:`StepWorkspace`), a signal model's channel scaling, and :class:`ModelWeights`, a
whole model's read-only weights with the checks of its inputs and states.

The step (``mamba.MambaModel``), the shared small-batch step (``split_step``) and prefill
(``prefill``) all read a model through these types, and the mixers (``mamba1``,
``mamba2``) write into a workspace; so they live here, below all of them, and the
imports run one way: weights -> mixers -> step and prefill -> model -> loader.

Glossary of shape letters (as in ``mamba.py``):
    b: sessions stepped together (batch)
    d: hidden size (``hidden_size``)
    e: inner size (``intermediate_size``)
    n: SSM state size (``state_size``)
    k: conv kernel width (``conv_kernel``)
    v: vocabulary size (token models);  i / o: signal input / output width
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import numpy as np

from ssmserve.server.engine.config import MambaConfig
from ssmserve.server.engine.numerics import RowStableLinear, padded
from ssmserve.server.engine.recurrent_state import SessionState, state_layout
from ssmserve.server.engine.threads import engine_threads
from ssmserve.server.errors import ModelInputError


class BlockWeights(Protocol):
    """One residual block's weights: its pre-norm and a mixer (Mamba-1:
    ``mamba1.MambaBlockWeights``; Mamba-2: ``mamba2.Mamba2BlockWeights``)."""

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


class ModelWeights:
    """A Mamba stack's read-only weights, the checks of its inputs and states, and each
    thread's step workspace: what the step, the shared step and prefill read of a model.
    :class:`~ssmserve.server.engine.mamba.MambaModel` adds the step itself.

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
