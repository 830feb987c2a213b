"""Prefill: one session's run of T inputs, layer by layer, with the bits of T steps.

Read alongside:
    [1] Mamba: Linear-Time Sequence Modeling with Selective State Spaces (Gu and Dao, 2023),
        https://arxiv.org/abs/2312.00752 — Section 3.3 (the recurrent mode of the
        selective scan), Section 3.4 and Figure 3 (the block: the projections act on each
        position alone, only the conv and the scan carry state along the sequence).
    [2] Transformers are SSMs (Dao and Gu, 2024), https://arxiv.org/abs/2405.21060 —
        Section 3.1 (the linear, recurrent form of an SSM) and Section 7 (the Mamba-2
        block).

Why this module exists. Stepping a prompt token by token (``MambaModel.run``) reads every
weight once per token: at batch 1 each product is a matrix-vector product, bound by memory
(about 40 ms a token at mamba-130m's shapes on 2 threads), and each token computes the
whole head (50,280 rows for a language model) although a prompt needs the last logits at
most. Here each layer's products act on all T positions at once (matrix speed: each weight
panel is read once per chunk of rows), the conv and the scan walk the T positions one by
one, and the head runs only for the positions the caller asks for.

Exactness. The result is bit for bit that of ``T`` calls of ``MambaModel.step`` on one
session, by construction:

* every product goes through the batch-invariant micro-kernel (``products.py``): an
  output element's bits do not depend on how many rows the product has, nor on which
  thread computes which rows or columns;
* the norms are the step's row kernels (``kernels.rms_norm_rows`` and friends), which
  treat each row alike;
* the conv and the scan are the step's own compiled kernels (``kernels.conv_silu``,
  ``kernels.selective_scan``, ``kernels.ssd_step``), called by the small drivers below
  once per position with one-row views of the same types as a step's arguments, the
  layer's state held in a two-slot ping-pong buffer (a step's old and new state).

The parallel scan and Mamba-2's chunked SSD algorithm ([2] Section 6) are faster on
accelerators but sum in another order, so they are not used. ``tests/test_prefill.py``
checks the bits against stepping.

Glossary (as in ``mamba.py`` and ``mamba2.py``): t positions of the prompt in the chunk
being computed (at most :data:`CHUNK_ROWS`), d hidden, e inner, n state, k conv width,
r rank of Δ, c conv channels, h heads, p head dim, v / o outputs.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numba import njit

from ssmserve.server.engine import kernels, products
from ssmserve.server.engine.mamba1 import MambaBlockWeights
from ssmserve.server.engine.mamba2 import Mamba2BlockWeights
from ssmserve.server.engine.numerics import RowStableLinear, padded, widened
from ssmserve.server.engine.recurrent_state import SessionState, state_layout
from ssmserve.server.engine.threads import run_ranges
from ssmserve.server.engine.weights import BlockWeights, ModelWeights, StepWorkspace
from ssmserve.server.errors import ModelInputError

#: Which positions' outputs a prefill returns: every one, the last, none, or a boolean
#: mask ``(T,)`` / strictly increasing int indices into the T positions.
OutputRows = Literal["all", "last", "none"] | np.ndarray | Sequence[int]

#: Positions computed together per layer pass. Memory is bounded by it, not by T: the
#: activations of a chunk of mamba-130m take ~20 MB at 512 rows. Chunking changes no
#: bits (rows are independent, and the state carries from one chunk to the next).
CHUNK_ROWS = 512

#: Fewest positions per runner for a prefill to spread its chunks over the model's
#: threads (``prefill``); fewer, and one runner cuts each product over the threads.
MIN_ROWS_PER_RUNNER = 32

#: Fewest rows per thread when a product is cut by rows: below this the hand-off to a
#: helper thread costs more than the half of the work it takes (and short products of a
#: few rows are cut by columns instead, as a step's are).
MIN_ROWS_PER_THREAD = 16

_JIT = {"nogil": True, "cache": True, "boundscheck": False, "error_model": "numpy"}


def output_rows(outputs: OutputRows, steps: int) -> np.ndarray:
    """The positions ``outputs`` names, as strictly increasing int indices into ``steps``
    positions; raises ``ModelInputError`` naming what is wrong."""
    if isinstance(outputs, str):
        if outputs == "all":
            return np.arange(steps)
        if outputs == "last":
            return np.arange(max(0, steps - 1), steps)
        if outputs == "none":
            return np.arange(0)
        raise ModelInputError(
            f"outputs must be 'all', 'last', 'none', a mask or indices, got {outputs!r}"
        )
    arr = np.asarray(outputs)
    if arr.dtype == np.bool_:
        if arr.shape != (steps,):
            raise ModelInputError(f"an outputs mask has shape ({steps},), got {list(arr.shape)}")
        return np.flatnonzero(arr)
    if arr.size == 0:
        return np.arange(0)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ModelInputError(f"outputs indices must be 1-d ints, got {arr.dtype}{list(arr.shape)}")
    if arr[0] < 0 or arr[-1] >= steps or (arr.size > 1 and np.any(np.diff(arr) <= 0)):
        raise ModelInputError(f"outputs indices must increase strictly within [0, {steps})")
    return arr.astype(np.intp)


@dataclass
class LayerCarry:
    """One layer's state between positions: two slots of a session's (1, ...) state, the
    one ``slot`` names holding the state after the last position computed (a step's old
    and new state, reused)."""

    conv: np.ndarray  # (2, 1, c, k)
    ssm: np.ndarray  # (2, 1, e, n) | (2, 1, h, p, n)
    conv_slot: int = 0
    ssm_slot: int = 0

    @classmethod
    def of(cls, conv: np.ndarray, ssm: np.ndarray) -> LayerCarry:
        """Slot 0 holds ``conv`` (c, k) and ``ssm`` (e, n) | (h, p, n)."""
        carry = cls(
            np.empty((2, 1, *conv.shape), np.float32), np.empty((2, 1, *ssm.shape), np.float32)
        )
        carry.conv[0, 0] = conv
        carry.ssm[0, 0] = ssm
        return carry


class Turns:
    """The order in which chunks advance each layer's state: chunk c's conv (stage 0) and
    scan (stage 1) of a layer run after chunk c - 1's, on whichever runner holds it.
    Counters under one condition, so a prompt of any length needs no more than these."""

    CONV, SCAN = 0, 1

    def __init__(self, layers: int) -> None:
        self._passed = [[0, 0] for _ in range(layers)]  # chunks through each (layer, stage)
        self._changed = threading.Condition()
        self._abandoned = False

    def wait(self, chunk: int, layer: int, stage: int) -> None:
        """Until chunks ``:chunk`` have passed ``stage`` of ``layer`` (or a runner failed:
        then raise, so no runner waits for one that is gone)."""
        with self._changed:
            passed = self._passed[layer]
            while passed[stage] < chunk and not self._abandoned:
                self._changed.wait()
            if self._abandoned:
                raise _Abandoned

    def done(self, layer: int, stage: int) -> None:
        with self._changed:
            self._passed[layer][stage] += 1
            self._changed.notify_all()

    def abandon(self) -> None:
        with self._changed:
            self._abandoned = True
            self._changed.notify_all()


class _Abandoned(Exception):
    """Another runner of the prefill failed (its error is the one raised)."""


def prefill(
    model: ModelWeights,
    inputs: np.ndarray,
    state: SessionState | None = None,
    outputs: OutputRows = "all",
    helpers: Sequence[Executor] | None = None,
) -> tuple[np.ndarray, SessionState]:
    """``MambaModel.prefill``: see there.

    The T positions are cut into chunks (at most :data:`CHUNK_ROWS` each). With several
    threads and at least :data:`MIN_ROWS_PER_RUNNER` positions for each, chunk c runs on
    runner c mod R, each runner a thread of its own computing its chunks' products on
    one core, and the chunks take :class:`Turns` at each layer's conv and scan: while
    one runner walks a layer's scan (one core, position by position) the other computes
    products. Otherwise one runner takes the chunks in turn and cuts each product over
    the threads. The head runs at the end, on the positions asked for, over the threads.
    ``helpers``: single-thread executors that run runners 1, 2, ... (an engine lane's,
    whose arenas the allocator trims); None: a thread started per runner.
    """
    seq = model.check_inputs(inputs)  # (T,) ids or (T, i)
    start = state if state is not None else model.new_state()
    model.check_state(start)
    c = model.config
    steps = seq.shape[0]
    rows = output_rows(outputs, steps)  # (m,)
    carries = [LayerCarry.of(layer.conv, layer.ssm) for layer in start.layers]
    runners = max(1, min(model.threads, steps // MIN_ROWS_PER_RUNNER))
    if helpers is not None:
        runners = min(runners, 1 + len(helpers))
    size = CHUNK_ROWS  # positions per chunk: near T / runners when that is smaller
    if runners > 1:
        per_runner = -(-steps // runners)
        size = min(CHUNK_ROWS, -(-per_runner // products.ROWS) * products.ROWS)
    bounds = [*range(0, steps, size), steps]  # chunk j: positions bounds[j]:bounds[j + 1]
    chunks = len(bounds) - 1
    runners = max(1, min(runners, chunks))
    product_threads = model.threads if runners == 1 else 1
    turns = Turns(len(carries))
    picked = np.empty((rows.shape[0], c.hidden_size), np.float32)  # (m, d) the head's rows

    def run(first: int) -> None:
        """Chunks ``first``, ``first + runners``, ... through every block."""
        ws = StepWorkspace.allocate(c, padded(max(1, size)), model.blocks[0])
        for j in range(first, chunks, runners):
            lo, hi = bounds[j], bounds[j + 1]
            _chunk(model, seq[lo:hi], ws, carries, turns, j, product_threads)
            a, b = np.searchsorted(rows, (lo, hi))  # the outputs asked for in this chunk
            picked[a:b] = ws.xn[rows[a:b] - lo]  # (m', d)

    _run_runners(runners, run, turns, helpers)
    out = np.empty((rows.shape[0], c.output_dim), np.float32)  # (m, o)
    if rows.shape[0]:
        _product(model.head, picked, out, rows.shape[0], model.threads)  # (m, d) -> (m, v | o)
        if model.output_norm is not None:
            model.output_norm.denormalize(out)  # (m, o)
    layout = state_layout(len(carries), c.conv_state_shape, c.ssm_state_shape)
    final = np.empty(layout.size, np.float32)
    for layer, carry in zip(layout.views(final), carries, strict=True):
        layer.conv[...] = carry.conv[carry.conv_slot, 0]
        layer.ssm[...] = carry.ssm[carry.ssm_slot, 0]
    return out, SessionState.of_buffer(final, layout)


def _run_runners(
    runners: int,
    run: Callable[[int], None],
    turns: Turns,
    helpers: Sequence[Executor] | None = None,
) -> None:
    """``run(r)`` for each runner r at once: r = 0 on this thread, the others on
    ``helpers[r - 1]`` or threads started for this prefill (not the engine's helper pool:
    a runner waits for others' turns, and the pool's helpers must never wait). Raises the
    first runner's error."""
    if runners == 1:
        run(0)
        return
    errors: list[BaseException] = []

    def guarded(r: int) -> None:
        try:
            run(r)
        except _Abandoned:
            pass
        except BaseException as exc:  # every runner must learn that one failed
            errors.append(exc)
            turns.abandon()

    if helpers is not None:
        futures = [helpers[r - 1].submit(guarded, r) for r in range(1, runners)]
        guarded(0)
        for future in futures:
            future.result()  # bounded: a runner that fails abandons the turns others wait on
    else:
        threads = [
            threading.Thread(target=guarded, args=(r,), name=f"ssmserve-prefill-{r}", daemon=True)
            for r in range(1, runners)
        ]
        for thread in threads:
            thread.start()
        guarded(0)
        for thread in threads:
            thread.join()  # bounded: a runner that fails abandons the turns others wait on
    if errors:
        raise errors[0]


def _chunk(
    model: ModelWeights,
    x: np.ndarray,
    ws: StepWorkspace,
    carries: list[LayerCarry],
    turns: Turns,
    chunk: int,
    threads: int,
) -> None:
    """Positions ``x`` (t,) ids or (t, i), chunk number ``chunk``, through every block:
    the final norm's output in ``ws.xn[:t]`` (t, d), each layer's state advanced by t
    positions in ``carries`` (in its turn); products on ``threads`` threads."""
    t = x.shape[0]
    eps = np.float64(model.config.layer_norm_epsilon)
    if model.embeddings is not None:
        ws.h[:t] = widened(model.embeddings[x])  # (t, d)
    elif model.input_proj is None:
        ws.h[:t] = model.head.weight_rows(x)  # (t, d): the tied head's rows
    else:
        if model.input_norm is None:
            ws.signal[:t] = x  # (t, i)
        else:
            model.input_norm.normalize_into(x, ws.signal[:t])  # (t, i)
        _product(model.input_proj, ws.signal, ws.delta, t, threads)  # (t, i) -> (t, d)
        ws.h[:t] = ws.delta[:t]  # (t, d) float32 -> the float64 stream
    blocks = model.blocks
    kernels.rms_norm_rows(ws.h, blocks[0].norm, eps, t, ws.xn)  # (t, d)
    for i, block in enumerate(blocks):
        turn = _Turn(turns, chunk, i)
        _mix(block, ws, carries[i], t, threads, turn)  # -> ws.delta (t, d)
        # Residual around the block, then the next block's norm (or the final norm).
        norm = blocks[i + 1].norm if i + 1 < len(blocks) else model.norm_f
        kernels.residual_rms_norm_rows(ws.h, ws.delta, norm, eps, t, ws.xn)  # (t, d)


@dataclass(frozen=True)
class _Turn:
    """One chunk's turns at one layer's carry."""

    turns: Turns
    chunk: int
    layer: int

    def wait(self, stage: int) -> None:
        self.turns.wait(self.chunk, self.layer, stage)

    def done(self, stage: int) -> None:
        self.turns.done(self.layer, stage)


def _mix(
    block: BlockWeights, ws: StepWorkspace, carry: LayerCarry, t: int, threads: int, turn: _Turn
) -> None:
    if isinstance(block, MambaBlockWeights):
        _mamba_mix(block, ws, carry, t, threads, turn)
    elif isinstance(block, Mamba2BlockWeights):
        _mamba2_mix(block, ws, carry, t, threads, turn)
    else:
        raise TypeError(f"no prefill for {type(block).__name__}")


def _mamba_mix(
    block: MambaBlockWeights,
    ws: StepWorkspace,
    carry: LayerCarry,
    t: int,
    threads: int,
    turn: _Turn,
) -> None:
    """The Mamba-1 mixer over t positions ([1] Figure 3): ``MambaBlockWeights.mix_in_steps``
    with the products over all t rows and the conv and the scan walking them."""
    m = ws.mixer
    rows = ws.rows
    e = block.A.shape[0]
    r = block.dt_proj.in_features
    _product(block.in_proj, ws.xn, m.xz, t, threads)  # (t, d) -> (t, 2e): x branch, gate z
    # Causal depthwise conv then SiLU, position by position: (t, e).
    turn.wait(Turns.CONV)
    carry.conv_slot = conv_silu_positions(
        carry.conv, carry.conv_slot, t, m.xz.reshape(rows, 1, 2 * e), block.conv_weight,
        block.conv_bias_or_zero, block.conv_bias is not None, m.xs.reshape(rows, 1, e),
        m.scratch,
    )  # fmt: skip
    turn.done(Turns.CONV)
    # Selection: Δ, B, C of every position ([1] Algorithm 2, lines 3-5).
    _product(block.x_proj, m.xs, m.x_dbl, t, threads)  # (t, e) -> (t, r + 2n)
    if block.mixer_rms_eps:  # FalconMamba: RMS norms of Δ low rank, B and C
        kernels.mixer_rms_norms(m.x_dbl, t, r, block.A.shape[1], np.float64(block.mixer_rms_eps))
    _product(block.dt_proj, m.x_dbl[:, :r], m.dt_raw, t, threads)  # (t, r) -> (t, e)
    # The recurrence h_t = Ā h_{t-1} + B̄ x_t and the gated readout, position by position.
    width = m.x_dbl.shape[1]
    turn.wait(Turns.SCAN)
    carry.ssm_slot = selective_scan_positions(
        m.dt_raw.reshape(rows, 1, e), m.xs.reshape(rows, 1, e), m.x_dbl.reshape(rows, 1, width),
        m.xz.reshape(rows, 1, 2 * e), block.A, block.D, carry.ssm, carry.ssm_slot, t,
        ws.y.reshape(rows, 1, e), m.scratch, m.scratch_bits,
    )  # fmt: skip
    turn.done(Turns.SCAN)
    _product(block.out_proj, ws.y, ws.delta, t, threads)  # (t, e) -> (t, d)


def _mamba2_mix(
    block: Mamba2BlockWeights,
    ws: StepWorkspace,
    carry: LayerCarry,
    t: int,
    threads: int,
    turn: _Turn,
) -> None:
    """The Mamba-2 mixer over t positions ([2] Section 7.1): ``Mamba2BlockWeights.mix``
    with the products and the gated norm over all t rows, the conv and the SSD recurrence
    walking them."""
    m = ws.mixer
    rows = ws.rows
    e = block.gated_norm.shape[0]
    c = block.conv_weight.shape[0]
    width = block.in_proj.out_features
    _product(block.in_proj, ws.xn, m.zxbcdt, t, threads)  # (t, d) -> (t, e + c + h)
    zxbcdt = m.zxbcdt.reshape(rows, 1, width)  # (t, 1, e + c + h)
    xbc = m.xbc.reshape(rows, 1, c)  # (t, 1, c)
    # Causal depthwise conv of x, B and C together, then SiLU, position by position.
    turn.wait(Turns.CONV)
    carry.conv_slot = conv_silu_columns_positions(
        carry.conv, carry.conv_slot, t, zxbcdt, e, e + c, block.conv_weight,
        block.conv_bias_or_zero, block.conv_bias is not None, xbc, m.scratch,
    )  # fmt: skip
    turn.done(Turns.CONV)
    # Discretize, update the (h, p, n) state, read out with C, add D x: (t, e).
    dt_min, dt_max = block.dt_bounds
    turn.wait(Turns.SCAN)
    carry.ssm_slot = ssd_positions(
        zxbcdt, xbc, block.dt_bias, block.A, block.D, dt_min, dt_max, carry.ssm,
        carry.ssm_slot, t, ws.y.reshape(rows, 1, e), m.scratch, m.scratch_bits,
    )  # fmt: skip
    turn.done(Turns.SCAN)
    # Gate with silu(z) and normalise per group: (t, e), in place, all rows at once.
    kernels.gated_rms_norm_rows(
        ws.y, m.zxbcdt, block.gated_norm, block.groups, np.float32(block.eps), t, ws.y,
        m.scratch,
    )  # fmt: skip
    _product(block.out_proj, ws.y, ws.delta, t, threads)  # (t, e) -> (t, d)


def _product(
    linear: RowStableLinear, x: np.ndarray, out: np.ndarray, rows: int, threads: int
) -> None:
    """``out[:rows] = x[:rows] @ w.T + bias`` on up to ``threads`` threads: cut into row
    ranges (each a multiple of the micro-kernel's rows but the last) when every thread
    gets :data:`MIN_ROWS_PER_THREAD`, else as a step does (columns of a big weight).
    The same bits either way (``products.py``)."""
    parts = min(threads, rows // MIN_ROWS_PER_THREAD)
    if parts <= 1:
        linear.into(x, out, rows, threads)
        return
    tile = products.ROWS
    bounds = [rows * k // parts // tile * tile for k in range(parts)] + [rows]
    panels, scales = linear.panels, linear.scales
    bias = linear.bias if linear.bias is not None else _NO_BIAS
    has_bias = linear.bias is not None
    run_ranges(
        list(itertools.pairwise(bounds)),
        lambda lo, hi: products.product_panels(
            x, panels, scales, bias, has_bias, lo, hi, 0, panels.shape[0], out
        ),
    )


_NO_BIAS = np.zeros(1, np.float32)


# ---------------------------------------------------------------------- the drivers
#
# Each calls a step kernel once per position with one-row views: ``a[s]`` of a C-ordered
# (rows, 1, width) array is a C-ordered (1, width) array, the type of a step's (rows,
# width) activations, and ``pp[slot]`` of a (2, 1, ...) ping-pong buffer is a (1, ...)
# state, the type of a step's state. A driver returns the slot holding the last state.


@njit(**_JIT)
def conv_silu_positions(
    conv: np.ndarray,
    slot: int,
    t: int,
    xz: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray,
    has_bias: bool,
    xs: np.ndarray,
    scratch: np.ndarray,
) -> int:
    """``kernels.conv_silu`` for positions ``:t`` of xz (rows, 1, 2e) into xs (rows, 1, e),
    conv (2, 1, e, k) the window's two slots."""
    for s in range(t):
        kernels.conv_silu(conv[slot], xz[s], weight, bias, has_bias, conv[1 - slot], xs[s], scratch)
        slot = 1 - slot
    return slot


@njit(**_JIT)
def conv_silu_columns_positions(
    conv: np.ndarray,
    slot: int,
    t: int,
    zxbcdt: np.ndarray,
    first: int,
    stop: int,
    weight: np.ndarray,
    bias: np.ndarray,
    has_bias: bool,
    xbc: np.ndarray,
    scratch: np.ndarray,
) -> int:
    """``kernels.conv_silu`` of columns ``first:stop`` of zxbcdt (rows, 1, e + c + h) for
    positions ``:t``, into xbc (rows, 1, c); conv (2, 1, c, k) the window's two slots."""
    for s in range(t):
        kernels.conv_silu(
            conv[slot], zxbcdt[s][:, first:stop], weight, bias, has_bias, conv[1 - slot],
            xbc[s], scratch,
        )  # fmt: skip
        slot = 1 - slot
    return slot


@njit(**_JIT)
def selective_scan_positions(
    dt_raw: np.ndarray,
    xs: np.ndarray,
    x_dbl: np.ndarray,
    xz: np.ndarray,
    A: np.ndarray,
    D: np.ndarray,
    ssm: np.ndarray,
    slot: int,
    t: int,
    y: np.ndarray,
    scratch: np.ndarray,
    scratch_bits: np.ndarray,
) -> int:
    """``kernels.selective_scan`` for positions ``:t`` (activations (rows, 1, width)),
    ssm (2, 1, e, n) the state's two slots."""
    for s in range(t):
        kernels.selective_scan(
            dt_raw[s], xs[s], x_dbl[s], xz[s], A, D, ssm[slot], ssm[1 - slot], y[s],
            scratch, scratch_bits,
        )  # fmt: skip
        slot = 1 - slot
    return slot


@njit(**_JIT)
def ssd_positions(
    zxbcdt: np.ndarray,
    xbc: np.ndarray,
    dt_bias: np.ndarray,
    A: np.ndarray,
    D: np.ndarray,
    dt_min: np.float32,
    dt_max: np.float32,
    ssm: np.ndarray,
    slot: int,
    t: int,
    y: np.ndarray,
    scratch: np.ndarray,
    scratch_bits: np.ndarray,
) -> int:
    """``kernels.ssd_step`` for positions ``:t`` (activations (rows, 1, width)), ssm
    (2, 1, h, p, n) the state's two slots."""
    for s in range(t):
        kernels.ssd_step(
            zxbcdt[s], xbc[s], dt_bias, A, D, dt_min, dt_max, ssm[slot], ssm[1 - slot], y[s],
            scratch, scratch_bits,
        )  # fmt: skip
        slot = 1 - slot
    return slot
