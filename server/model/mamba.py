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

Every product goes through :class:`~server.model.numerics.RowStableLinear`, so a row's
result does not depend on the other rows; everything else is elementwise or a last-axis
reduction, which numpy computes per row. Hence batch invariance (see ``numerics.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from server.errors import ModelInputError
from server.model.config import MambaConfig
from server.model.numerics import RowStableLinear
from server.state import BatchState, SessionState

# torch.nn.functional.softplus returns x itself above this (HF uses the default).
_SOFTPLUS_THRESHOLD = np.float32(20.0)


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


class MambaModel:
    """Read-only weights plus the pure, batched :meth:`step`.

    Token models (``mamba-lm``) take int token ids ``(b,)`` and return logits ``(b, v)``;
    signal models take float32 ``(b, i)`` and return ``(b, o)``.
    """

    def __init__(
        self,
        config: MambaConfig,
        blocks: Sequence[MambaBlockWeights],
        norm_f: np.ndarray,
        head: RowStableLinear,
        *,
        embeddings: np.ndarray | None = None,
        input_proj: RowStableLinear | None = None,
        fingerprint: str = "",
        name: str = "",
    ) -> None:
        if config.is_token_model and embeddings is None:
            raise ValueError("a token model needs embeddings")
        if not config.is_token_model and input_proj is None:
            raise ValueError("a signal model needs an input projection")
        self.config = config
        self.blocks = tuple(blocks)
        self.norm_f = norm_f  # (d,)
        self.head = head  # d -> v | o
        self.embeddings = embeddings  # (v, d)
        self.input_proj = input_proj  # i -> d
        self.fingerprint = fingerprint
        self.name = name

    # ------------------------------------------------------------------ state and inputs

    def new_state(self) -> SessionState:
        """The state of a session that has seen no input (step 0): all zeros."""
        c = self.config
        return SessionState.zeros(
            c.num_hidden_layers, c.intermediate_size, c.conv_kernel, c.state_size
        )

    def check_state(self, state: SessionState) -> None:
        """Raise ``ModelInputError`` unless ``state`` has this model's layers, dtypes, shapes."""
        c = self.config
        if len(state.layers) != c.num_hidden_layers:
            raise ModelInputError(
                f"state has {len(state.layers)} layers, model has {c.num_hidden_layers}"
            )
        want_conv = (c.intermediate_size, c.conv_kernel)
        want_ssm = (c.intermediate_size, c.state_size)
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
        """
        with np.errstate(over="ignore", under="ignore"):
            if self.embeddings is not None:
                h = self.embeddings[inputs]  # (b, d)
            else:
                assert self.input_proj is not None
                h = self.input_proj(inputs)  # (b, i) -> (b, d)
            new_conv: list[np.ndarray] = []
            new_ssm: list[np.ndarray] = []
            for block, conv, ssm in zip(self.blocks, state.conv, state.ssm, strict=True):
                x = rms_norm(h, block.norm, self.config.layer_norm_epsilon)  # (b, d)
                y, conv_next, ssm_next = self._mixer(block, x, conv, ssm)  # (b, e)
                h = h + block.out_proj(y)  # (b, d) residual around the block
                new_conv.append(conv_next)
                new_ssm.append(ssm_next)
            h = rms_norm(h, self.norm_f, self.config.layer_norm_epsilon)  # (b, d)
            out = self.head(h)  # (b, v | o)
        return BatchState(tuple(new_conv), tuple(new_ssm)), out

    def _mixer(
        self, w: MambaBlockWeights, x: np.ndarray, conv: np.ndarray, ssm: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The Mamba mixer for one time step ([1] Figure 3, Algorithm 2 with L = 1).

        Args:
            x: (b, d) normalised block input
            conv: (b, e, k) last k conv inputs;  ssm: (b, e, n) hidden state h_{t-1}
        Returns:
            y (b, e) before out_proj, the new conv window (b, e, k), h_t (b, e, n)
        """
        e = self.config.intermediate_size
        n = self.config.state_size
        xz = w.in_proj(x)  # (b, 2e)
        xs, z = xz[:, :e], xz[:, e:]  # (b, e), (b, e)

        # Causal depthwise conv over the last k inputs: shift the window left by one.
        conv_next = np.empty_like(conv)  # (b, e, k)
        conv_next[:, :, :-1] = conv[:, :, 1:]
        conv_next[:, :, -1] = xs
        xs = (conv_next * w.conv_weight).sum(axis=-1)  # (b, e, k) -> (b, e)
        if w.conv_bias is not None:
            xs += w.conv_bias
        xs = silu(xs)  # (b, e)

        # Selection: Δ, B, C depend on the input ([1] Algorithm 2, lines 3-5).
        x_dbl = w.x_proj(xs)  # (b, r + 2n)
        r = x_dbl.shape[1] - 2 * n
        dt = softplus(w.dt_proj(x_dbl[:, :r]))  # (b, r) -> (b, e)
        B = x_dbl[:, r : r + n]  # (b, n)
        C = x_dbl[:, r + n :]  # (b, n)

        # The (b, e, n) tensors dominate the step at large batches: one scratch buffer,
        # in-place ops, and the new state is the only other (b, e, n) allocation.
        # Zero-order-hold discretization ([1] Eq. 4): Ā = exp(ΔA), B̄x ≈ ΔBx.
        scratch = np.multiply(dt[:, :, None], w.A)  # (b, e, 1) * (e, n) -> (b, e, n)
        dA = np.exp(scratch, out=scratch)  # (b, e, n)
        # Recurrence ([1] Eq. 2a): h_t = Ā h_{t-1} + B̄ x_t
        ssm_next = np.multiply(dA, ssm)  # (b, e, n)
        dBx = np.multiply((dt * xs)[:, :, None], B[:, None, :], out=scratch)  # (b, e, n)
        ssm_next += dBx
        # Readout ([1] Eq. 2b) plus the D skip: y_t = C h_t + D x_t
        y = np.matmul(ssm_next, C[:, :, None])[:, :, 0]  # (b, e, n) @ (b, n, 1) -> (b, e)
        y += xs * w.D  # (b, e)
        y *= silu(z)  # gate (b, e)
        return y, conv_next, ssm_next

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


def rms_norm(h: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm (Zhang and Sennrich, 2019): ``weight * h / sqrt(mean(h^2) + eps)``. (b, d)."""
    variance = (h * h).mean(axis=-1, keepdims=True)  # (b, 1)
    return (h * (1.0 / np.sqrt(variance + np.float32(eps)))) * weight  # (b, d)


def silu(x: np.ndarray) -> np.ndarray:
    """SiLU / swish: ``x * sigmoid(x)``; exp overflow for very negative x gives -0, fine."""
    return x / (np.float32(1.0) + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    """``log(1 + exp(x))``, linear above 20 like ``torch.nn.functional.softplus``."""
    return np.where(
        x > _SOFTPLUS_THRESHOLD, x, np.log1p(np.exp(np.minimum(x, _SOFTPLUS_THRESHOLD)))
    )
