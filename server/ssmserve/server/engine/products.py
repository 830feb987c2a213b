"""Batch-invariant matrix products: one register-blocked micro-kernel, emitted as LLVM IR.

Why this module exists. A session's outputs must have the same bits alone or inside any
batch (``numerics.py``). BLAS does not promise that: the order in which it sums a row's
products depends on the batch's shape. Forcing one shape on BLAS (a 16-row tile per call)
costs 16x the work of a matrix-vector product for a lone session. Here the order is fixed
by construction, and the kernel runs at matrix-vector speed at batch 1 and near sgemm
speed from a few rows up (``bench/bench_engine.py`` measures both).

The exact arithmetic. For ``out = x @ w.T + bias`` with ``x`` (b, i) and ``w`` (o, i)::

    for each block [k0, k0 + K_BLOCK) of 0 .. i-1, in order:
        acc = 0.0
        for k in the block:  acc = fma(x[r, k], w[j, k], acc)   # one rounding per k
        total = acc if k0 == 0 else total + acc                  # one rounding per block
    out[r, j] = total + bias[j]

Every element of every batch goes through exactly these operations in this order, whatever
tile computes it, however many rows the batch has and wherever the row sits in it. The fma
is LLVM's ``llvm.fma`` intrinsic, correctly rounded by definition (hardware FMA where the
CPU has it, a correctly rounded library routine where it does not), so the bits do not
depend on the CPU's vector width either.

Speed. The micro-kernel (:func:`_tile_kernel`) keeps a ``ROWS`` x ``COLUMNS`` block of
``out`` (4 x 24, or 4 x 48 where the CPU has AVX-512) in twelve vector registers of 8
(16) floats while it walks a block of k, then adds them to ``out`` (in L1): per k it
loads three vectors of a packed weight panel, broadcasts four inputs and issues twelve
fmas, so the fma units, not memory, set its pace (the classic GotoBLAS / BLIS register
block). Weights are packed once at load into panels of ``COLUMNS`` output columns, ``(o /
COLUMNS, i, COLUMNS)``, so each k reads 3 contiguous vectors. A batch that is not a
multiple of 4 rows ends with a 1..3-row tile: same per-element arithmetic, so the same
bits. The vector width changes which elements share an instruction, never an element's
arithmetic, so it changes no bits either (``test_the_vector_width_changes_no_bits``); it
is part of the numerics signature through the CPU features anyway.

numba compiles the driver; the micro-kernel is written with llvmlite's IR builder inside a
numba ``intrinsic`` because numba's own loops do not keep an accumulator block in
registers (its auto-vectorised version ran at ~25 GFLOP/s here against ~85 for this one).
Glossary: b rows (sessions), i input features (k runs over them), o output features.
"""

from __future__ import annotations

from typing import Any

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core import config as numba_config
from numba.extending import intrinsic

from ssmserve.server.engine.quantize import Q8_BLOCK, Q8Weight


def _vector_lanes() -> int:
    """Floats per vector of the micro-kernel: 16 when the CPU numba compiles for has
    AVX-512 (its fma units take 512-bit operands: 1.3-1.6x the GFLOP/s of 8 lanes on an
    Emerald Rapids core, ``bench/bench_engine.py``), else 8 (on AVX2, 16 lanes would need
    24 of its 16 registers). The CPU numba targets is part of its cache key, so a cached
    kernel always matches the panels this choice packs."""
    features = numba_config.CPU_FEATURES  # as numba's codegen picks them: set, else the host's
    if features is None:
        features = llvm.get_host_cpu_features().flatten()
    return 16 if "+avx512f" in features.split(",") else 8


#: Rows of ``out`` one micro-kernel call computes (a batch's last tile may have fewer).
ROWS = 4
#: Terms of k per fma chain: each element sums k in blocks of this many, each block a chain
#: from 0.0, the block sums added in order. A constant of the numerics (never of the batch
#: or the CPU). Why 64: a single chain over k = 768..1,536 carried 80-83% of the logit
#: error's variance against float64; blocks of 64 bring it below transformers float32's
#: at a cost of 12 loads, adds and stores per 64 x 12 fmas (``bench/tools/accuracy_diagnosis.py``,
#: ``bench/bench_accuracy.py``, ``bench/bench_engine.py``).
K_BLOCK = 64
_LANES = _vector_lanes()  # floats per vector register (narrower machines split it, same bits)
#: Output columns per packed weight panel and micro-kernel call: 3 vectors.
COLUMNS = 3 * _LANES

_JIT = {"nogil": True, "cache": True, "boundscheck": False, "error_model": "numpy"}


def pack_panels(weight: np.ndarray | Q8Weight) -> np.ndarray:
    """``weight`` (o, i) -> panels (ceil(o / C), i, C), C = ``COLUMNS``, columns
    zero-padded: panel p, row k holds ``weight[C p : C p + C, k]``.

    float32 panels; uint16 panels of bfloat16 bits where ``weight`` is uint16 (a BF16
    weight kept at its stored width: the micro-kernel widens each value as it loads it,
    ``bits << 16``, which is exact, so the products keep the bits of the widened weight);
    int16 panels of float16 bits where ``weight`` is int16 (an F16 weight kept: widened
    by the CPU's half-to-float conversion, also exact);
    int8 panels of a :class:`~ssmserve.server.engine.quantize.Q8Weight`'s quants (their
    scales: :func:`pack_scales`; the kernel widens ``scale * q``, also exact)."""
    if isinstance(weight, Q8Weight):
        weight = weight.quants
    dtype = weight.dtype if weight.dtype in (np.uint16, np.int16, np.int8) else np.dtype(np.float32)
    return _panels(weight, dtype)


def pack_scales(weight: Q8Weight) -> np.ndarray:
    """A Q8_0 weight's scales (o, nb) -> (ceil(o / C), nb, C) float32 (widened: exact),
    laid out as its quants' panels: panel p, row k // 32 holds the scales of columns
    ``C p : C p + C`` for k."""
    return _panels(weight.scales.astype(np.float32), np.dtype(np.float32))


def _panels(weight: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``weight`` (o, i) as ``dtype`` panels (ceil(o / C), i, C), columns zero-padded."""
    o, i = weight.shape
    padded_o = -(-o // COLUMNS) * COLUMNS
    w = np.zeros((padded_o, i), dtype)  # (o', i); a zero's bits are zero in every dtype
    w[:o] = weight
    # (o', i) -> (o' / C, C, i) -> (o' / C, i, C)
    return np.ascontiguousarray(w.reshape(padded_o // COLUMNS, COLUMNS, i).transpose(0, 2, 1))


#: The scales argument of a product whose panels are not Q8_0 (never read).
NO_SCALES = np.zeros((1, 1, 1), np.float32)


def _tile_kernel(rows: int) -> Any:
    """The micro-kernel for a ``rows`` x ``COLUMNS`` block (``rows`` <= 4), as a numba intrinsic:

    ``tile(x, x_row, panels, scales, p, out, out_row, out_col)`` sets
    ``out[out_row + r, out_col + j] = sum_k x[x_row + r, k] * w[p, k, j]`` (fma chain
    over k in order) for r < rows, j < COLUMNS, where ``w`` is ``panels`` widened to
    float32 (times ``scales[p, k // 32, j]`` for int8 panels). Rows of ``x`` and ``out``
    must be contiguous.
    """

    def typer(
        typingctx: Any, x: Any, x_row: Any, panels: Any, scales: Any, p: Any, out: Any,
        out_row: Any, out_col: Any,
    ) -> tuple[Any, Any]:  # fmt: skip
        sig = types.void(x, types.intp, panels, scales, types.intp, out, types.intp, types.intp)
        return sig, lambda context, builder, signature, args: _emit_tile(
            rows, context, builder, signature, args
        )

    return intrinsic(typer)


def _emit_tile(rows: int, context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
    """LLVM IR of one micro-kernel call (see :func:`_tile_kernel`)."""
    vectors = COLUMNS // _LANES
    x_arr = context.make_array(signature.args[0])(context, builder, args[0])
    p_arr = context.make_array(signature.args[2])(context, builder, args[2])
    s_arr = context.make_array(signature.args[3])(context, builder, args[3])
    o_arr = context.make_array(signature.args[5])(context, builder, args[5])
    x_row, panel, out_row, out_col = args[1], args[4], args[6], args[7]
    intp = context.get_value_type(types.intp)

    def const(v: int) -> ir.Constant:
        return ir.Constant(intp, v)

    # Row pitches in floats (strides are bytes).
    x_pitch = builder.sdiv(cgutils.unpack_tuple(builder, x_arr.strides)[0], const(4))
    o_pitch = builder.sdiv(cgutils.unpack_tuple(builder, o_arr.strides)[0], const(4))
    depth = cgutils.unpack_tuple(builder, p_arr.shape)[1]  # i
    vec = ir.VectorType(ir.FloatType(), _LANES)
    bf16 = signature.args[2].dtype == types.uint16  # panels of bfloat16 bits
    f16 = signature.args[2].dtype == types.int16  # panels of float16 bits
    half_vec = ir.VectorType(ir.HalfType(), _LANES)
    q8 = signature.args[2].dtype == types.int8  # panels of Q8_0 quants, scales beside
    quant_vec = ir.VectorType(ir.IntType(8), _LANES)
    bits_vec = ir.VectorType(ir.IntType(16), _LANES)
    int_vec = ir.VectorType(ir.IntType(32), _LANES)
    sixteen = ir.Constant(int_vec, [16] * _LANES)

    def load_weights(ptr: Any, scale: Any) -> Any:
        """One vector of a panel row as floats: float32 as it is; bfloat16 bits widened
        exactly (each zero-extended to 32 bits and shifted into a float32's high half:
        1.06x faster decode than an interleaving shuffle, bench/bench_bf16.py); float16
        converted (exact); int8
        quants converted (exact) and times their scales (exact: ``quantize.py``)."""
        if q8:
            quants = builder.load(builder.bitcast(ptr, quant_vec.as_pointer()), align=1)
            return builder.fmul(builder.sitofp(quants, vec), scale)
        if f16:  # float16 -> float32 is exact (vcvtph2ps where the CPU has F16C)
            return builder.fpext(
                builder.load(builder.bitcast(ptr, half_vec.as_pointer()), align=2), vec
            )
        if not bf16:
            return builder.load(builder.bitcast(ptr, vec.as_pointer()), align=4)
        bits = builder.load(builder.bitcast(ptr, bits_vec.as_pointer()), align=2)
        wide = builder.shl(builder.zext(bits, int_vec), sixteen)  # bits << 16, per lane
        return builder.bitcast(wide, vec)

    fma = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vec, [vec, vec, vec]), f"llvm.fma.v{_LANES}f32"
    )
    undef = ir.Constant(vec, ir.Undefined)
    lane0 = ir.Constant(ir.IntType(32), 0)
    broadcast = ir.Constant(ir.VectorType(ir.IntType(32), _LANES), [0] * _LANES)
    # The accumulator block, rows x vectors of 8 floats: allocas in the entry block that
    # LLVM's mem2reg turns into registers.
    zero = ir.Constant(vec, [0.0] * _LANES)
    acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(vectors)] for _ in range(rows)]
    x_rows = [
        builder.gep(x_arr.data, [builder.mul(builder.add(x_row, const(r)), x_pitch)])
        for r in range(rows)
    ]
    panel_base = builder.gep(p_arr.data, [builder.mul(panel, builder.mul(depth, const(COLUMNS)))])
    # Q8_0: the panel's scales, (depth / 32, COLUMNS) floats (unused otherwise).
    scale_base = builder.gep(
        s_arr.data,
        [builder.mul(panel, builder.mul(builder.sdiv(depth, const(Q8_BLOCK)), const(COLUMNS)))],
    )
    out_rows = [
        builder.gep(
            o_arr.data,
            [builder.add(builder.mul(builder.add(out_row, const(r)), o_pitch), out_col)],
        )
        for r in range(rows)
    ]

    def out_vector(r: int, v: int) -> Any:
        return builder.bitcast(builder.gep(out_rows[r], [const(v * _LANES)]), vec.as_pointer())

    blocks = builder.sdiv(builder.add(depth, const(K_BLOCK - 1)), const(K_BLOCK))
    with cgutils.for_range(builder, blocks) as block_loop:
        k0 = builder.mul(block_loop.index, const(K_BLOCK))
        k_stop = builder.add(k0, const(K_BLOCK))
        k_stop = builder.select(builder.icmp_signed("<", k_stop, depth), k_stop, depth)
        for r in range(rows):  # each block's chain starts from 0.0
            for v in range(vectors):
                builder.store(zero, acc[r][v])

        def k_steps(start: Any, stop: Any, scales: list[Any] | None) -> None:
            """The fmas of k in [start, stop): one panel row per k (``scales``: its Q8_0
            block's scale vectors, loaded once for the block's 32 k)."""
            with cgutils.for_range_slice(builder, start, stop, const(1)) as (k, _count):
                w_row = builder.gep(panel_base, [builder.mul(k, const(COLUMNS))])  # row k
                w = [
                    load_weights(builder.gep(w_row, [const(v * _LANES)]), scales and scales[v])
                    for v in range(vectors)
                ]
                for r in range(rows):
                    xk = builder.load(builder.gep(x_rows[r], [k]))  # x[x_row + r, k]
                    xk = builder.shuffle_vector(
                        builder.insert_element(undef, xk, lane0), undef, broadcast
                    )
                    for v in range(vectors):
                        total = builder.call(fma, [xk, w[v], builder.load(acc[r][v])])
                        builder.store(total, acc[r][v])

        if not q8:
            k_steps(k0, k_stop, None)
        else:  # the block's k in runs of 32 (Q8_0 rows are whole 32-blocks): one scale each
            runs = builder.sdiv(builder.sub(k_stop, k0), const(Q8_BLOCK))
            with cgutils.for_range(builder, runs) as run:
                start = builder.add(k0, builder.mul(run.index, const(Q8_BLOCK)))
                s_row = builder.gep(  # scales row start // 32: (COLUMNS,) floats
                    scale_base,
                    [builder.mul(builder.sdiv(start, const(Q8_BLOCK)), const(COLUMNS))],
                )
                scales = [
                    builder.load(
                        builder.bitcast(builder.gep(s_row, [const(v * _LANES)]), vec.as_pointer()),
                        align=4,
                    )
                    for v in range(vectors)
                ]
                k_steps(start, builder.add(start, const(Q8_BLOCK)), scales)
        # The block's sums into out: the first block stores, each later one adds in order.
        first = builder.icmp_signed("==", block_loop.index, const(0))
        with builder.if_else(first) as (then, otherwise):
            with then:
                for r in range(rows):
                    for v in range(vectors):
                        builder.store(builder.load(acc[r][v]), out_vector(r, v), align=4)
            with otherwise:
                for r in range(rows):
                    for v in range(vectors):
                        dst = out_vector(r, v)
                        running = builder.load(dst, align=4)
                        builder.store(builder.fadd(running, builder.load(acc[r][v])), dst, align=4)
    return context.get_dummy_value()


_tile4 = _tile_kernel(4)
_tile3 = _tile_kernel(3)
_tile2 = _tile_kernel(2)
_tile1 = _tile_kernel(1)


@njit(**_JIT)
def _tile(
    x: np.ndarray,
    x_row: int,
    panels: np.ndarray,
    scales: np.ndarray,
    p: int,
    out: np.ndarray,
    out_row: int,
    out_col: int,
    rows: int,
) -> None:
    """One micro-kernel call for ``rows`` (1..4) rows."""
    if rows == 4:
        _tile4(x, x_row, panels, scales, p, out, out_row, out_col)
    elif rows == 3:
        _tile3(x, x_row, panels, scales, p, out, out_row, out_col)
    elif rows == 2:
        _tile2(x, x_row, panels, scales, p, out, out_row, out_col)
    else:
        _tile1(x, x_row, panels, scales, p, out, out_row, out_col)


@njit(**_JIT)
def product_rows(
    x: np.ndarray,
    panels: np.ndarray,
    scales: np.ndarray,
    bias: np.ndarray,
    has_bias: bool,
    first: int,
    stop: int,
    out: np.ndarray,
) -> None:
    """``out[first:stop] = x[first:stop] @ w.T (+ bias)``, w packed by :func:`pack_panels`
    (``scales``: :func:`pack_scales` for int8 panels, else :data:`NO_SCALES`).

    x (>= stop, i) and out (>= stop, o): rows contiguous. Rows outside ``first:stop`` are
    neither read nor written.
    """
    product_panels(x, panels, scales, bias, has_bias, first, stop, 0, panels.shape[0], out)


@njit(**_JIT)
def product_panels(
    x: np.ndarray,
    panels: np.ndarray,
    scales: np.ndarray,
    bias: np.ndarray,
    has_bias: bool,
    first: int,
    stop: int,
    panel_first: int,
    panel_stop: int,
    out: np.ndarray,
) -> None:
    """:func:`product_rows` for the output columns of panels ``panel_first:panel_stop``
    only (columns ``COLUMNS * panel_first`` up to ``COLUMNS * panel_stop`` or o): other columns are
    neither read nor written, so threads can fill one ``out`` by column ranges. Each
    element is computed exactly as in a whole product (same bits)."""
    o = out.shape[1]
    edge = np.empty((ROWS, COLUMNS), np.float32)  # the last panel's block when o % COLUMNS != 0
    for p in range(panel_first, panel_stop):  # a panel stays in cache over all rows
        col = p * COLUMNS
        whole = col + COLUMNS <= o
        r = first
        while r < stop:
            rows = min(ROWS, stop - r)
            if whole:
                _tile(x, r, panels, scales, p, out, r, col, rows)
            else:  # the last, partial panel: through ``edge``, then the valid columns
                _tile(x, r, panels, scales, p, edge, 0, 0, rows)
                for rr in range(rows):
                    for j in range(o - col):
                        out[r + rr, col + j] = edge[rr, j]
            r += rows
    if has_bias:
        for r in range(first, stop):
            for j in range(panel_first * COLUMNS, min(panel_stop * COLUMNS, o)):
                out[r, j] += bias[j]
