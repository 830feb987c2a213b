"""A small batch's whole layer stack in one compiled call per thread, the work shared by
columns, channels and heads, the threads meeting at spin barriers.

Why. At batch 1 a step reads every weight once, and one core reads memory at about half
the machine's bandwidth, so the products must be shared between cores. Handing each
product to a helper through Python costs ~60-90 us a hand-off here (``threads.py``), and a
mamba-130m step has ~50 of them; the parts between the products (conv, scan, norms) then
run on one core while the other waits. Here each thread runs the whole stack, layer after
layer, taking its share of every part, and the threads meet at a barrier between parts
(``spin.barrier``: well under a microsecond when both run): one hand-off a step.

The shares, per layer (t of T threads; "panels" are a product's groups of ``COLUMNS``
output columns, ``products.py``):

=====================  =============================================  ==================
part                   thread t computes                              then
=====================  =============================================  ==================
in_proj                its share of the panels                        barrier
conv + SiLU            its channels (Mamba-1: those of its dt_proj    barrier
                       panels; Mamba-2: its share of the c channels)
x_proj (Mamba-1)       its share of the panels                        barrier
Δ, scan (Mamba-1)      dt_proj's panels of its channels, then the     barrier
                       scan of those channels (no barrier between:
                       a channel's Δ is its own)
SSD (Mamba-2)          its share of the heads                         barrier
gated norm (Mamba-2)   thread 0 (a norm sums over a whole group)      barrier
out_proj               its share of the panels                        barrier
residual + next norm   thread 0 (the norm sums over the row)          barrier
=====================  =============================================  ==================

and the head's panels shared at the end. Exactness: every element is computed by the same
kernel code as in the unshared step, in the same order, and a thread's share only picks
which elements it computes; so the bits are those of one thread, at every thread count
(``tests/test_split_step.py``).

Shared or alone. Threads that meet at barriers gain when each has a core of its own
(mamba-130m-shaped, batch 1, on this 2-vCPU host: 0.71x the step of per-product hand-offs
in float32, 0.60x in Q8_0) and lose when another process takes one (a thread then waits
at every barrier for a partner that is not running). So each model's calls time both
ways as they run and take the faster (:class:`ShareChooser`; the same bits either way):
on that host with one core taken by a busy loop, 0.9-1.0x instead of up to 1.3x.

Starting. The caller submits T - 1 helper tasks to the engine's pool and waits (without the
GIL) for them to join (``spin.open_helpers``), at most :data:`JOIN_SPINS` spins (~1-2 ms);
a helper that comes later finds the call closed and returns, and the call runs with those
that joined (alone, if none did: the same bits). A pool busy with another model's work
therefore delays a step by that bound at most, never deadlocks it.

Glossary as in ``mamba.py`` / ``mamba2.py``: L layers, b rows, d hidden, e inner, n state,
k conv width, r rank of Δ, h heads, p head dim, c conv channels.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numba import njit
from numba.typed import List

from ssmserve.server.engine import kernels
from ssmserve.server.engine.products import COLUMNS, product_panels
from ssmserve.server.engine.spin import barrier, join_as_helper, new_sync, open_helpers
from ssmserve.server.engine.threads import COLUMN_SPLIT_MIN_BYTES, engine_pool

if TYPE_CHECKING:
    from ssmserve.server.engine.recurrent_state import BatchState
    from ssmserve.server.engine.weights import ModelWeights, StepWorkspace

_JIT = {"nogil": True, "cache": True, "boundscheck": False, "error_model": "numpy"}

#: Spins the caller waits for its helpers to join before it runs with fewer (see above).
JOIN_SPINS = 40_000
#: Calls between two tries of the way not chosen (``ShareChooser``), and how much one
#: call moves the running average of a way's time.
PROBE_EVERY = 32
EMA_WEIGHT = 0.25
#: Smallest model (bytes of weights a step reads) whose small batches are shared: below
#: it one hand-off costs more than a second core saves (the products' own threshold).
MIN_MODEL_BYTES = COLUMN_SPLIT_MIN_BYTES


@njit(**_JIT, inline="always")
def _share(count: int, tid: int, parties: int) -> tuple[int, int]:
    """Thread ``tid``'s range of ``count`` items: near-equal contiguous ranges, in order."""
    return count * tid // parties, count * (tid + 1) // parties


@njit(**_JIT, inline="always")
def _conv_owning(
    conv: np.ndarray, x: np.ndarray, weight: np.ndarray, bias: np.ndarray, has_bias: bool,
    conv_next: np.ndarray, spare: np.ndarray, out: np.ndarray, scratch: np.ndarray,
    c0: int, c1: int,
) -> None:  # fmt: skip
    """The conv of every channel into this thread's ``out``; the new window of channels
    ``c0:c1`` (this thread's) into ``conv_next``, the others' into ``spare``."""
    channels = conv.shape[1]
    kernels.conv_silu_channels(conv, x, weight, bias, has_bias, spare, out, scratch, 0, c0)
    kernels.conv_silu_channels(conv, x, weight, bias, has_bias, conv_next, out, scratch, c0, c1)
    kernels.conv_silu_channels(conv, x, weight, bias, has_bias, spare, out, scratch, c1, channels)


@njit(**_JIT)
def mamba1_stack(
    tid: int, parties: int, sync: np.ndarray, b: int,
    h: np.ndarray, xn: np.ndarray, delta: np.ndarray, y: np.ndarray,
    xz: np.ndarray, xs: np.ndarray, x_dbl: np.ndarray, dt_raw: np.ndarray,
    spare: np.ndarray, scratch: np.ndarray, bits: np.ndarray,
    conv: Any, ssm: Any, conv_next: Any, ssm_next: Any,
    norms: Any, in_p: Any, in_s: Any, in_b: Any, conv_w: Any, conv_b: Any,
    x_p: Any, x_s: Any, x_b: Any, dt_p: Any, dt_s: Any, dt_b: Any, A: Any, D: Any,
    out_p: Any, out_s: Any, out_b: Any,
    has_in_b: bool, has_conv_b: bool, has_x_b: bool, has_out_b: bool,
    rank: int, mixer_eps: np.float64, norm_f: np.ndarray, eps: np.float64,
    head_p: np.ndarray, head_s: np.ndarray, head_b: np.ndarray, has_head_b: bool,
    out: np.ndarray,
) -> None:  # fmt: skip
    """Thread ``tid``'s share of a Mamba-1 stack's step for rows ``:b`` (the module
    docstring), from ``xn[tid]`` (the first block's normalised input, in every thread's
    copy; ``h[tid]`` the residual stream) to ``out``.

    ``xz``, ``dt_raw``, ``y`` and ``delta`` are shared (each thread writes its own columns
    or channels); ``h``, ``xn``, ``xs``, ``x_dbl``, ``spare`` (a conv window's room) and
    the scratch are (threads, ...): each thread's own."""
    layers = len(norms)
    e = y.shape[1]
    n = A[0].shape[1]
    my_h, my_xn, my_xs, my_x_dbl = h[tid], xn[tid], xs[tid], x_dbl[tid]
    my_spare, my_scratch, my_bits = spare[tid], scratch[tid], bits[tid]
    for i in range(layers):
        lo, hi = _share(in_p[i].shape[0], tid, parties)
        product_panels(my_xn, in_p[i], in_s[i], in_b[i], has_in_b, 0, b, lo, hi, xz)  # (b, 2e)
        barrier(sync, parties)  # xz whole
        # Every thread convolves every channel (x_proj needs them all; ~e k fmas), and
        # keeps the new window of its own channels: those of its dt_proj panels.
        dt_lo, dt_hi = _share(dt_p[i].shape[0], tid, parties)
        c0, c1 = min(dt_lo * COLUMNS, e), min(dt_hi * COLUMNS, e)
        _conv_owning(
            conv[i],
            xz,
            conv_w[i],
            conv_b[i],
            has_conv_b,
            conv_next[i],
            my_spare,
            my_xs,
            my_scratch,
            c0,
            c1,
        )  # fmt: skip  (b, e)
        # x_proj whole in every thread (r + 2n columns: a few panels)
        product_panels(
            my_xs, x_p[i], x_s[i], x_b[i], has_x_b, 0, b, 0, x_p[i].shape[0], my_x_dbl
        )  # (b, r + 2n)
        if mixer_eps > 0:  # FalconMamba: the norms of Δ low rank, B and C
            kernels.mixer_rms_norms(my_x_dbl, b, rank, n, mixer_eps)
        product_panels(
            my_x_dbl[:, :rank], dt_p[i], dt_s[i], dt_b[i], True, 0, b, dt_lo, dt_hi, dt_raw
        )  # (b, e) channels c0:c1
        kernels.selective_scan_channels(
            dt_raw,
            my_xs,
            my_x_dbl,
            xz,
            A[i],
            D[i],
            ssm[i],
            ssm_next[i],
            y,
            my_scratch,
            my_bits,
            c0,
            c1,
        )  # fmt: skip  (b, e) channels c0:c1
        barrier(sync, parties)  # y whole
        lo, hi = _share(out_p[i].shape[0], tid, parties)
        product_panels(y, out_p[i], out_s[i], out_b[i], has_out_b, 0, b, lo, hi, delta)  # (b, d)
        barrier(sync, parties)  # delta whole
        # The residual and the next block's norm (or the final one), in every thread.
        norm = norms[i + 1] if i + 1 < layers else norm_f
        kernels.residual_rms_norm_rows(my_h, delta, norm, eps, b, my_xn)  # (b, d)
    lo, hi = _share(head_p.shape[0], tid, parties)
    product_panels(my_xn, head_p, head_s, head_b, has_head_b, 0, b, lo, hi, out)  # (b, v | o)


@njit(**_JIT)
def mamba2_stack(
    tid: int, parties: int, sync: np.ndarray, b: int,
    h: np.ndarray, xn: np.ndarray, delta: np.ndarray, y: np.ndarray,
    zxbcdt: np.ndarray, xbc: np.ndarray, y_normed: np.ndarray,
    spare: np.ndarray, scratch: np.ndarray, bits: np.ndarray,
    conv: Any, ssm: Any, conv_next: Any, ssm_next: Any,
    norms: Any, in_p: Any, in_s: Any, in_b: Any, conv_w: Any, conv_b: Any,
    dt_bias: Any, A: Any, D: Any, gated: Any, out_p: Any, out_s: Any, out_b: Any,
    has_in_b: bool, has_conv_b: bool, has_out_b: bool,
    groups: int, gated_eps: np.float32, dt_min: np.float32, dt_max: np.float32,
    norm_f: np.ndarray, eps: np.float64,
    head_p: np.ndarray, head_s: np.ndarray, head_b: np.ndarray, has_head_b: bool,
    out: np.ndarray,
) -> None:  # fmt: skip
    """Thread ``tid``'s share of a Mamba-2 stack's step for rows ``:b`` (the module
    docstring). ``zxbcdt``, ``y`` and ``delta`` are shared; ``h``, ``xn``, ``xbc``,
    ``y_normed``, ``spare`` and the scratch are (threads, ...)."""
    layers = len(norms)
    heads = A[0].shape[0]
    c = xbc.shape[2]
    e = y.shape[1]
    my_h, my_xn, my_xbc, my_y = h[tid], xn[tid], xbc[tid], y_normed[tid]
    my_spare, my_scratch, my_bits = spare[tid], scratch[tid], bits[tid]
    for i in range(layers):
        lo, hi = _share(in_p[i].shape[0], tid, parties)
        product_panels(my_xn, in_p[i], in_s[i], in_b[i], has_in_b, 0, b, lo, hi, zxbcdt)
        barrier(sync, parties)  # zxbcdt whole
        # Every thread convolves every channel (its heads need B and C of their groups);
        # it keeps the new window of the channels of its share.
        c0, c1 = _share(c, tid, parties)
        _conv_owning(
            conv[i],
            zxbcdt[:, e : e + c],
            conv_w[i],
            conv_b[i],
            has_conv_b,
            conv_next[i],
            my_spare,
            my_xbc,
            my_scratch,
            c0,
            c1,
        )  # fmt: skip  (b, c)
        h0, h1 = _share(heads, tid, parties)
        kernels.ssd_step_heads(
            zxbcdt,
            my_xbc,
            dt_bias[i],
            A[i],
            D[i],
            dt_min,
            dt_max,
            ssm[i],
            ssm_next[i],
            y,
            my_scratch,
            my_bits,
            h0,
            h1,
        )  # fmt: skip  (b, e) the channels of heads h0:h1
        barrier(sync, parties)  # y whole
        # The gated norm of every group, in every thread (a group's sum is one order).
        kernels.gated_rms_norm_rows(y, zxbcdt, gated[i], groups, gated_eps, b, my_y, my_scratch)
        lo, hi = _share(out_p[i].shape[0], tid, parties)
        product_panels(my_y, out_p[i], out_s[i], out_b[i], has_out_b, 0, b, lo, hi, delta)
        barrier(sync, parties)  # delta whole
        norm = norms[i + 1] if i + 1 < layers else norm_f
        kernels.residual_rms_norm_rows(my_h, delta, norm, eps, b, my_xn)
    lo, hi = _share(head_p.shape[0], tid, parties)
    product_panels(my_xn, head_p, head_s, head_b, has_head_b, 0, b, lo, hi, out)


@dataclass
class StackWeights:
    """A model's per-layer weights as numba typed lists (built once: a typed list passes
    into a compiled call whole, without unboxing each array) and the flags the kernels
    take; ``kernel`` is :func:`mamba1_stack` or :func:`mamba2_stack`."""

    kernel: Any
    lists: tuple[Any, ...]
    flags: tuple[Any, ...]
    head: tuple[Any, ...]
    chooser: ShareChooser = field(default_factory=lambda: ShareChooser())


def _typed(arrays: list[np.ndarray]) -> Any:
    out = List()
    for arr in arrays:
        out.append(arr)
    return out


_NO_BIAS = np.zeros(1, np.float32)


def _bias(lin: Any) -> np.ndarray:
    return lin.bias if lin.bias is not None else _NO_BIAS


def stack_weights(model: ModelWeights) -> StackWeights:
    """The model's :class:`StackWeights` (cached on it)."""
    cached = getattr(model, "_stack_weights", None)
    if cached is not None:
        return cached
    blocks = model.blocks
    first = blocks[0]
    head = model.head
    head_args = (head.panels, head.scales, _bias(head), head.bias is not None)
    if model.config.mamba_version == 2:
        getters: tuple[Callable[[Any], np.ndarray], ...] = (
            lambda blk: blk.dt_bias,
            lambda blk: blk.A,
            lambda blk: blk.D,
            lambda blk: blk.gated_norm,
        )
        dt_min, dt_max = first.dt_bounds
        flags: tuple[Any, ...] = (
            first.in_proj.bias is not None,
            first.conv_bias is not None,
            first.out_proj.bias is not None,
            first.groups,
            np.float32(first.eps),
            dt_min,
            dt_max,
        )
        kernel = mamba2_stack
    else:
        getters = (
            lambda blk: blk.x_proj.panels,
            lambda blk: blk.x_proj.scales,
            lambda blk: _bias(blk.x_proj),
            lambda blk: blk.dt_proj.panels,
            lambda blk: blk.dt_proj.scales,
            lambda blk: blk.dt_proj.bias,
            lambda blk: blk.A,
            lambda blk: blk.D,
        )
        flags = (
            first.in_proj.bias is not None,
            first.conv_bias is not None,
            first.x_proj.bias is not None,
            first.out_proj.bias is not None,
            first.dt_proj.in_features,
            np.float64(first.mixer_rms_eps),
        )
        kernel = mamba1_stack
    # The kernels' order: norm, in_proj, conv, the architecture's own, out_proj.
    getters = (
        lambda blk: blk.norm,
        lambda blk: blk.in_proj.panels,
        lambda blk: blk.in_proj.scales,
        lambda blk: _bias(blk.in_proj),
        lambda blk: blk.conv_weight,
        lambda blk: blk.conv_bias_or_zero,
        *getters,
        lambda blk: blk.out_proj.panels,
        lambda blk: blk.out_proj.scales,
        lambda blk: _bias(blk.out_proj),
    )
    lists = tuple(_typed([get(blk) for blk in blocks]) for get in getters)
    weights = StackWeights(kernel, lists, flags, head_args)
    model._stack_weights = weights  # type: ignore[attr-defined]
    return weights


def worth_sharing(model: ModelWeights, threads: int) -> bool:
    """Whether a small batch of ``model`` runs shared over ``threads`` threads."""
    return threads > 1 and model.weight_bytes >= MIN_MODEL_BYTES


def _runnable(arrays: tuple[np.ndarray, ...]) -> bool:
    """Arrays of one numba type each (C-contiguous, writable): a tuple the compiled call
    indexes by layer, without a compile for a new type at request time."""
    return all(a.flags.c_contiguous and a.flags.writeable for a in arrays)


def step_shared(
    model: ModelWeights,
    ws: StepWorkspace,
    state: BatchState,
    new_conv: tuple[np.ndarray, ...],
    new_ssm: tuple[np.ndarray, ...],
    out: np.ndarray,
    b: int,
    threads: int,
) -> bool:
    """The stack and head of a step of rows ``:b`` (``ws.xn`` holds the first norm's
    output), shared over up to ``threads`` threads; False (nothing done) where the state's
    arrays are not all of the compiled type (read-only or strided views: the caller then
    steps as before, the same bits)."""
    conv, ssm = tuple(state.conv), tuple(state.ssm)
    if not (_runnable(conv) and _runnable(ssm)):
        return False
    w = stack_weights(model)
    own = _own_buffers(ws, model, threads)
    own.h[:, :b] = ws.h[:b]  # every thread's copy of the stream and the first norm
    own.xn[:, :b] = ws.xn[:b]
    eps = np.float64(model.config.layer_norm_epsilon)
    if model.config.mamba_version == 2:
        activations: tuple[Any, ...] = (ws.mixer.zxbcdt, own.inner, own.extra)
    else:
        activations = (ws.mixer.xz, own.inner, own.extra, ws.mixer.dt_raw)
    args = (
        b, own.h, own.xn, ws.delta, ws.y, *activations, own.spare, own.scratch, own.bits,
        conv, ssm, new_conv, new_ssm, *w.lists, *w.flags, model.norm_f, eps, *w.head, out,
    )  # fmt: skip
    chooser = w.chooser
    shared = chooser.share_next(b)
    sync = new_sync()
    started = time.perf_counter()
    if not shared:
        w.kernel(0, 1, sync, *args)  # alone: no helper, no barrier waits
    else:
        pool = engine_pool()
        helpers = [pool.submit(_helper, w.kernel, sync, args) for _ in range(threads - 1)]
        parties = open_helpers(sync, threads - 1, JOIN_SPINS)
        try:
            w.kernel(0, parties, sync, *args)
        finally:
            for helper in helpers:
                helper.result()
    chooser.record(b, shared, time.perf_counter() - started)
    return True


class ShareChooser:
    """Whether a model's small batches run shared or alone, chosen by what each took
    lately, per batch size: the faster of the two, the other tried again every
    :data:`PROBE_EVERY` calls. Why: threads that meet at barriers gain when each has a
    core (a mamba-130m-shaped step: 0.6-0.7x the time alone), and lose when another
    process takes one (a thread waits at every barrier for a partner that is not
    running: 1.0-1.3x): the machine's load, not the model, decides, and it changes.
    The bits are the same either way, so the choice is free to change at any step."""

    def __init__(self) -> None:
        self._took: dict[tuple[int, bool], float] = {}  # (rows, shared) -> EMA seconds
        self._seen: set[tuple[int, bool]] = set()
        self._calls: dict[int, int] = {}

    def share_next(self, rows: int) -> bool:
        calls = self._calls.get(rows, 0)
        self._calls[rows] = calls + 1
        shared, alone = self._took.get((rows, True)), self._took.get((rows, False))
        if shared is None:  # shared until its time is known, then alone until that is
            return True
        if alone is None:
            return False
        faster = shared <= alone
        return (not faster) if calls % PROBE_EVERY == 0 else faster

    def record(self, rows: int, shared: bool, seconds: float) -> None:
        """A call's time; each way's first is not counted (it may have compiled)."""
        key = (rows, shared)
        if key not in self._seen:
            self._seen.add(key)
            return
        before = self._took.get(key)
        self._took[key] = seconds if before is None else before + EMA_WEIGHT * (seconds - before)


def _helper(kernel: Any, sync: np.ndarray, args: tuple[Any, ...]) -> None:
    tid, parties = join_as_helper(sync)
    if tid:
        kernel(tid, parties, sync, *args)


@dataclass
class OwnBuffers:
    """Each thread's own activations in a shared call, (threads, rows, ...): the stream
    and its norm, the conv output (Mamba-1 xs, Mamba-2 xBC), ``extra`` (Mamba-1 x_dbl,
    Mamba-2 the gated norm's output), a conv window's room, and the kernels' scratch."""

    h: np.ndarray  # (T, rows, d) float64
    xn: np.ndarray  # (T, rows, d)
    inner: np.ndarray  # (T, rows, e | c)
    extra: np.ndarray  # (T, rows, r + 2n | e)
    spare: np.ndarray  # (T, rows, e | c, k)
    scratch: np.ndarray  # (T, floats)
    bits: np.ndarray  # (T, ints)


def _own_buffers(ws: StepWorkspace, model: ModelWeights, threads: int) -> OwnBuffers:
    """The workspace's :class:`OwnBuffers` for ``threads`` threads (made once)."""
    have: OwnBuffers | None = getattr(ws, "shared_buffers", None)
    if have is not None and have.h.shape[0] >= threads:
        return have
    c = model.config
    rows, d, e, k = ws.rows, c.hidden_size, c.intermediate_size, c.conv_kernel
    if c.mamba_version == 2:
        inner, extra, heads = c.conv_dim, e, c.num_heads
    else:
        inner, extra, heads = e, c.time_step_rank + 2 * c.state_size, 0
    floats = max(3 * e, 2 * inner, 4 * heads, 2 * e)
    made = OwnBuffers(
        h=np.zeros((threads, rows, d), np.float64),
        xn=np.zeros((threads, rows, d), np.float32),
        inner=np.zeros((threads, rows, inner), np.float32),
        extra=np.zeros((threads, rows, extra), np.float32),
        spare=np.zeros((threads, rows, inner, k), np.float32),
        scratch=np.zeros((threads, floats), np.float32),
        bits=np.zeros((threads, max(e, heads, 1)), np.int32),
    )
    ws.shared_buffers = made  # type: ignore[attr-defined]
    return made
