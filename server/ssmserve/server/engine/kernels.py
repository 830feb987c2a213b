"""Fused elementwise parts of the Mamba step, compiled with numba.

Why this module exists. Between its four products a Mamba layer does ~25 small numpy
operations; at batch 1 each costs a few microseconds of call overhead, and at batch 64
the (b, e, n) scan makes five passes over memory (multiply, exp, multiply, add, matmul).
Here each stretch between two products is one compiled loop over rows: the scan reads
and writes the state once. ``bench/bench_engine.py`` times the step against its floor
(the products alone).

Exactness. Every kernel handles each row (session) with the same instructions in the same
order, whatever the other rows are, so batch invariance (``numerics.py``) still holds;
``tests/test_batch_invariance.py`` checks it end to end. ``exp`` and ``log1p`` are our own
(Cephes ``expf`` and ``logf``, within 2 ulp of the true value; exp flushes results below
``2**-126`` to 0) because numba's ``math.exp`` and ``math.log1p`` are scalar libm calls
that do not vectorise (and whose bits depend on the C library); they are written with
float and integer arithmetic only, so they give the same bits wherever they are inlined. The
only ``contract`` fast-math flag is on (fused multiply-add), which changes no order.

Glossary (as in ``mamba.py``): b sessions, d hidden, e inner, n state, k conv width,
r rank of Δ. Activations are ``(rows, ...)`` with rows >= b; rows past b are ignored.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ssmserve.server.engine.products import product_rows

_JIT = {
    "nogil": True,
    "cache": True,
    "boundscheck": False,
    "error_model": "numpy",
    "fastmath": {"contract"},
}

# Cephes expf constants: exp(x) = 2^m * exp(g), g = x - m ln2 split in two for accuracy.
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_P0 = np.float32(1.9875691500e-4)
_P1 = np.float32(1.3981999507e-3)
_P2 = np.float32(8.3334519073e-3)
_P3 = np.float32(4.1665795894e-2)
_P4 = np.float32(1.6666665459e-1)
_P5 = np.float32(5.0000001201e-1)
_EXP_HI = np.float32(88.0)  # clamp: keeps 2^m finite (exp(88) = 1.65e38, near float32's max)
_EXP_LO = np.float32(-87.3365478515625)  # 2^m stays a normal number down to here; below: 0
_ONE = np.float32(1.0)
_HALF = np.float32(0.5)
_ZERO = np.float32(0.0)
# torch.nn.functional.softplus returns x itself above this (HF uses the default).
_SOFTPLUS_THRESHOLD = np.float32(20.0)


@intrinsic
def _f32_from_bits(typingctx: Any, bits: Any) -> tuple[Any, Any]:
    """The float32 whose bits are the int32 ``bits`` (a register move, no memory)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@njit(**_JIT, inline="always")
def _exp(x: np.float32) -> np.float32:
    """exp(x) in float32, within 2 ulp; results below ``2**-126`` flush to 0, x above 88
    gives exp(88). Float multiplies and adds plus one bit cast: LLVM vectorises the loops
    that call it."""
    v = min(max(x, _EXP_LO), _EXP_HI)
    m = np.floor(v * _LOG2E + _HALF)  # nearest integer to x / ln2
    g = v - m * _LN2_HI
    g = g - m * _LN2_LO  # |g| <= ln2 / 2
    p = ((((_P0 * g + _P1) * g + _P2) * g + _P3) * g + _P4) * g + _P5
    # 2^m from its bits, or 0.0 below the normal range (flush rather than denormals).
    scale = _f32_from_bits((np.int32(m) + np.int32(127)) << np.int32(23)) if x >= _EXP_LO else _ZERO
    return (p * (g * g) + g + _ONE) * scale  # exp(g) 2^m


@njit(**_JIT, inline="always")
def _exp_into(x: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = exp(x[i])`` for 1-d float32 arrays (out may be x)."""
    for i in range(x.shape[0]):
        out[i] = _exp(x[i])


# Cephes logf constants: log(m 2^k) = k ln2 + log(m), m in [sqrt(1/2), sqrt(2)).
_SQRT2_BITS = np.int32(0x3FB504F3)  # the bits of float32 sqrt(2)
_MANTISSA = np.int32(0x007FFFFF)
_ONE_BITS = np.int32(0x3F800000)
_EXP_STEP = np.int32(0x00800000)  # one in the exponent field: halves or doubles a float
_L0 = np.float32(7.0376836292e-2)
_L1 = np.float32(-1.1514610310e-1)
_L2 = np.float32(1.1676998740e-1)
_L3 = np.float32(-1.2420140846e-1)
_L4 = np.float32(1.4249322787e-1)
_L5 = np.float32(-1.6668057665e-1)
_L6 = np.float32(2.0000714765e-1)
_L7 = np.float32(-2.4999993993e-1)
_L8 = np.float32(3.3333331174e-1)


@njit(**_JIT, inline="always")
def _log1p_into(y: np.ndarray, out: np.ndarray, bits: np.ndarray, expo: np.ndarray) -> None:
    """``out[i] = log1p(y[i])`` for finite ``y >= 0`` (float32, 1-d; out may be y).

    Cephes ``logf`` of u = 1 + y (within ~1 ulp), plus the rounding error of 1 + y as a
    first-order correction, (y - (u - 1)) / u: so tiny y give y, not 0. Written with
    float and integer arithmetic only, in three loops LLVM vectorises (numba's
    ``math.log1p`` is a scalar libm call, ~20 ns each). ``bits`` int32 and ``expo``
    float32 are scratch of y's length.
    """
    n = y.shape[0]
    u = bits.view(np.float32)
    for i in range(n):
        v = y[i]
        ui = _ONE + v
        u[i] = ui
        out[i] = (v - (ui - _ONE)) / ui  # what 1 + y lost to rounding, relative to u
    for i in range(n):  # u = m 2^k, m in [sqrt(1/2), sqrt(2)): through the bits (u >= 1)
        b = bits[i]
        k = (b >> np.int32(23)) - np.int32(127)
        m = (b & _MANTISSA) | _ONE_BITS  # m in [1, 2)
        big = m >= _SQRT2_BITS
        bits[i] = m - _EXP_STEP if big else m  # m / 2 when m >= sqrt(2)
        expo[i] = np.float32(k + np.int32(1) if big else k)
    for i in range(n):
        x = u[i] - _ONE  # m - 1, in [-0.29, 0.41]
        z = x * x
        p = ((((((((_L0 * x + _L1) * x + _L2) * x + _L3) * x + _L4) * x + _L5) * x + _L6) * x
              + _L7) * x + _L8) * x * z  # fmt: skip
        k = expo[i]
        p = p + k * _LN2_LO
        p = p - _HALF * z
        out[i] = ((x + p) + k * _LN2_HI) + out[i]


@njit(**_JIT, inline="always")
def _softplus_into(raw: np.ndarray, out: np.ndarray, scratch: np.ndarray, bits: np.ndarray) -> None:
    """``out = softplus(raw) = log1p(exp(raw))``, and ``raw`` itself above 20, as torch's
    default threshold (HF uses it). ``scratch`` float32 (2 len,), ``bits`` int32 (len,)."""
    n = raw.shape[0]
    ex = scratch[:n]
    expo = scratch[n : 2 * n]
    for i in range(n):
        out[i] = min(raw[i], _SOFTPLUS_THRESHOLD)
    _exp_into(out, ex)
    _log1p_into(ex, out, bits, expo)
    for i in range(n):
        out[i] = raw[i] if raw[i] > _SOFTPLUS_THRESHOLD else out[i]


@njit(**_JIT)
def log1p_f32(y: np.ndarray) -> np.ndarray:
    """The kernels' log1p on a 1-d float32 array of values >= 0 (for tests)."""
    out = np.empty_like(y)
    _log1p_into(y, out, np.empty(y.shape[0], np.int32), np.empty_like(y))
    return out


_V4 = ir.VectorType(ir.FloatType(), 4)


def _is_f32_vector(ty: Any) -> bool:
    """A 1-d contiguous float32 array type (writable or not)."""
    return (
        isinstance(ty, types.Array)
        and ty.dtype == types.float32
        and ty.ndim == 1
        and ty.layout == "C"
    )


@intrinsic
def _partial_sums4(typingctx: Any, h: Any, base: Any, c: Any, count: Any) -> tuple[Any, Any]:
    """``(a0, a1, a2, a3)`` with ``a_j = sum_{q < count} h[base + 4q + j] * c[4q + j]``,
    each a chain of fused multiply-adds in increasing q starting from 0.0.

    Why an intrinsic: the four chains are the four lanes of one 4-float vector, but LLVM
    does not find that in the scalar loop (it stays one scalar fma per element: the
    readout was 40% of the scan at batch 256). Written as vector IR it is one vector fma
    per four elements, with each lane's operations exactly those of the scalar loop (fma
    rounds once, as the scalar code's contracted multiply-add does): the same bits.
    Both arrays must be float32, 1-d and contiguous (typing rejects others); the caller
    keeps ``base + 4 count <= len(h)`` and ``4 count <= len(c)``.
    """
    if not (_is_f32_vector(h) and _is_f32_vector(c)):
        return None
    result = types.UniTuple(types.float32, 4)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        h_data = context.make_array(signature.args[0])(context, builder, args[0]).data
        c_data = context.make_array(signature.args[2])(context, builder, args[2]).data
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_V4, [_V4, _V4, _V4]), "llvm.fma.v4f32"
        )
        h_first = builder.gep(h_data, [args[1]])
        acc = cgutils.alloca_once_value(builder, ir.Constant(_V4, [0.0] * 4))

        def load4(first: Any, offset: Any) -> Any:  # 4 floats from first[offset]
            address = builder.bitcast(builder.gep(first, [offset]), _V4.as_pointer())
            return builder.load(address, align=4)

        with cgutils.for_range(builder, args[3]) as loop:
            offset = builder.mul(loop.index, ir.Constant(loop.index.type, 4))
            h4, c4 = load4(h_first, offset), load4(c_data, offset)
            builder.store(builder.call(fma, [h4, c4, builder.load(acc)]), acc)
        sums = builder.load(acc)
        lanes = [builder.extract_element(sums, ir.Constant(ir.IntType(32), j)) for j in range(4)]
        return context.make_tuple(builder, result, lanes)

    return result(h, base, c, count), codegen


@njit(**_JIT, inline="always")
def _dot_in_order(h: np.ndarray, base: int, c: np.ndarray) -> np.float32:
    """``sum_s h[base + s] * c[s]`` over ``c``'s length, as four partial sums (s mod 4)
    added in a fixed order: one order whatever the batch, four times the parallelism of
    one chain (the readout of both scans). The s left over past a multiple of 4 go to
    the first sum, after its vector part."""
    n = c.shape[0]
    quads = n // 4
    a0, a1, a2, a3 = _partial_sums4(h, base, c, quads)
    for s in range(4 * quads, n):
        a0 += h[base + s] * c[s]
    return (a0 + a1) + (a2 + a3)


@njit(**_JIT)
def dot_in_order_f32(h: np.ndarray, c: np.ndarray) -> np.ndarray:
    """The kernels' readout: row i of ``h`` (rows, n) dotted with ``c`` (n,) (for tests)."""
    rows, n = h.shape
    flat = h.reshape(rows * n)
    out = np.empty(rows, np.float32)
    for i in range(rows):
        out[i] = _dot_in_order(flat, i * n, c)
    return out


@njit(**_JIT)
def exp_f32(x: np.ndarray) -> np.ndarray:
    """The kernels' exp on a 1-d float32 array (for tests and the accuracy check)."""
    out = np.empty_like(x)
    _exp_into(x, out)
    return out


@njit(**_JIT, inline="always")
def _scale_row(
    hr: np.ndarray, ss: np.float64, weight: np.ndarray, eps: np.float64, o: np.ndarray
) -> None:
    """``o = float32(w * hr / sqrt(ss / d + eps))`` computed in float64, ``ss`` being the
    row's float64 sum of squares: the norm's output is rounded once."""
    inv = 1.0 / np.sqrt(ss / np.float64(hr.shape[0]) + eps)
    for j in range(hr.shape[0]):
        o[j] = np.float32(np.float64(hr[j]) * inv * np.float64(weight[j]))


@njit(**_JIT)
def rms_norm_rows(
    h: np.ndarray, weight: np.ndarray, eps: np.float64, b: int, out: np.ndarray
) -> None:
    """RMSNorm of rows ``h[:b]`` (b, d) float64 into ``out[:b]`` float32:
    ``w * h / sqrt(mean(h^2) + eps)``, in float64 and rounded once.

    Why float64: the residual stream ``h`` and its norm carry 11-12% of a float32 stream's
    logit error variance against a float64 reference, and with the k-blocked products the
    largest logit errors; a float64 stream costs d doubles per row and nothing measurable
    per step (``bench/tools/accuracy_diagnosis.py``, ``bench/bench_accuracy.py``)."""
    d = h.shape[1]
    for row in range(b):
        hr = h[row]
        ss = 0.0
        for j in range(d):
            v = np.float64(hr[j])
            ss += v * v
        _scale_row(hr, ss, weight, eps, out[row])


@njit(**_JIT)
def mixer_rms_norms(x_dbl: np.ndarray, b: int, r: int, n: int, eps: np.float64) -> None:
    """FalconMamba's weightless RMS norms inside the mixer, in place on rows ``x_dbl[:b]``
    (b, r + 2n): each of Δ's low rank ``[:r]``, B ``[r:r+n]`` and C ``[r+n:]`` becomes
    ``v / sqrt(mean(v^2) + eps)``, in float64 and rounded once (transformers'
    ``FalconMambaWeightlessRMSNorm``, which computes in float32)."""
    for row in range(b):
        v = x_dbl[row]
        for lo, hi in ((0, r), (r, r + n), (r + n, r + 2 * n)):
            ss = 0.0
            for j in range(lo, hi):
                ss += np.float64(v[j]) * np.float64(v[j])
            inv = 1.0 / np.sqrt(ss / np.float64(hi - lo) + eps)
            for j in range(lo, hi):
                v[j] = np.float32(np.float64(v[j]) * inv)


@njit(**_JIT)
def residual_rms_norm_rows(
    h: np.ndarray,
    delta: np.ndarray,
    weight: np.ndarray,
    eps: np.float64,
    b: int,
    out: np.ndarray,
) -> None:
    """``h[:b] += delta[:b]`` (the residual around a block; h float64, delta float32), then
    RMSNorm into ``out`` (:func:`rms_norm_rows`)."""
    d = h.shape[1]
    for row in range(b):
        hr = h[row]
        dr = delta[row]
        ss = 0.0
        for j in range(d):
            v = hr[j] + np.float64(dr[j])
            hr[j] = v
            ss += v * v
        _scale_row(hr, ss, weight, eps, out[row])


@njit(**_JIT)
def conv_silu(
    conv: np.ndarray,
    xz: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray,
    has_bias: bool,
    conv_out: np.ndarray,
    xs_out: np.ndarray,
    scratch: np.ndarray,
) -> None:
    """Causal depthwise conv of one new input, then SiLU ([1] Figure 3, the conv branch).

    conv (b, e, k) last k inputs -> conv_out (b, e, k) shifted window with ``xz[:, :e]``
    appended; xs_out[:b] (b, e) = silu(sum_k window * weight + bias).
    """
    conv_silu_channels(
        conv, xz, weight, bias, has_bias, conv_out, xs_out, scratch, 0, conv.shape[1]
    )


@njit(**_JIT)
def conv_silu_channels(
    conv: np.ndarray,
    xz: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray,
    has_bias: bool,
    conv_out: np.ndarray,
    xs_out: np.ndarray,
    scratch: np.ndarray,
    c0: int,
    c1: int,
) -> None:
    """:func:`conv_silu` for channels ``c0:c1`` only (the others neither read nor
    written; ``scratch``: 2 (c1 - c0) floats): threads can share one conv by channels,
    each channel computed exactly as in the whole (``split_step``)."""
    b, _, k = conv.shape
    m = c1 - c0
    for row in range(b):
        for c in range(c0, c1):
            s = _ZERO
            for t in range(k - 1):
                v = conv[row, c, t + 1]
                conv_out[row, c, t] = v
                s += v * weight[c, t]
            v = xz[row, c]
            conv_out[row, c, k - 1] = v
            s += v * weight[c, k - 1]
            if has_bias:
                s += bias[c]
            xs_out[row, c] = s
            scratch[c - c0] = -s
        _exp_into(scratch[:m], scratch[m : 2 * m])
        for c in range(c0, c1):
            xs_out[row, c] = xs_out[row, c] / (_ONE + scratch[m + c - c0])  # x * sigmoid(x)


@njit(**_JIT)
def selective_scan(
    dt_raw: np.ndarray,
    xs: np.ndarray,
    x_dbl: np.ndarray,
    xz: np.ndarray,
    A: np.ndarray,
    D: np.ndarray,
    ssm: np.ndarray,
    ssm_out: np.ndarray,
    y_out: np.ndarray,
    scratch: np.ndarray,
    scratch_bits: np.ndarray,
) -> None:
    """One step of the selective SSM with gate ([1] Algorithm 2 with L = 1, Eq. 2 and 4).

    dt_raw (rows, e) = dt_proj(Δ low rank) + bias; xs (rows, e) conv branch output;
    x_dbl (rows, r + 2n) = [Δ low rank, B, C]; xz (rows, 2e) with the gate z in ``[:, e:]``;
    A (e, n) = -exp(A_log); ssm (b, e, n) = h_{t-1}. Writes ssm_out (b, e, n) = h_t and
    y_out[:b] (b, e) = (C h_t + D x) * silu(z).
    """
    selective_scan_channels(
        dt_raw, xs, x_dbl, xz, A, D, ssm, ssm_out, y_out, scratch, scratch_bits, 0, ssm.shape[1]
    )


@njit(**_JIT)
def selective_scan_channels(
    dt_raw: np.ndarray,
    xs: np.ndarray,
    x_dbl: np.ndarray,
    xz: np.ndarray,
    A: np.ndarray,
    D: np.ndarray,
    ssm: np.ndarray,
    ssm_out: np.ndarray,
    y_out: np.ndarray,
    scratch: np.ndarray,
    scratch_bits: np.ndarray,
    c0: int,
    c1: int,
) -> None:
    """:func:`selective_scan` for channels ``c0:c1`` only (``scratch``: 3 (c1 - c0)
    floats, ``scratch_bits`` c1 - c0): each channel's state, output and gate are its own,
    so threads can share a scan by channels with the bits of the whole (``split_step``)."""
    b, e, n = ssm.shape
    r = x_dbl.shape[1] - 2 * n
    m = c1 - c0
    dt = scratch[:m]
    ex = scratch[m : 2 * m]
    soft = scratch[m : 3 * m]  # the softplus's scratch (ex's and dA's room; n >= 1)
    A_flat = A.reshape(e * n)
    for row in range(b):
        B = x_dbl[row, r : r + n]  # (n,)
        C = x_dbl[row, r + n : r + 2 * n]  # (n,)
        h_prev = ssm[row].reshape(e * n)  # (e n,) contiguous
        h_next = ssm_out[row].reshape(e * n)
        raw = dt_raw[row, c0:c1]
        x = xs[row, c0:c1]
        z = xz[row, e + c0 : e + c1]
        y = y_out[row, c0:c1]
        # Δ = softplus(dt_raw) (m,): log1p(exp(x)), linear above 20 like torch.
        _softplus_into(raw, dt, soft, scratch_bits[:m])
        # Zero-order hold ([1] Eq. 4), Ā = exp(Δ A), and the recurrence ([1] Eq. 2a),
        # h_t = Ā h_{t-1} + B̄ x_t with B̄ x = Δ B x: one pass over the (m, n) state.
        for c in range(m):
            dtc = dt[c]
            dx = dtc * x[c]
            base = (c0 + c) * n
            for s in range(n):
                i = base + s
                h_next[i] = _exp(dtc * A_flat[i]) * h_prev[i] + dx * B[s]
        # silu(z) needs exp(-z)  (m,)
        for c in range(m):
            ex[c] = -z[c]
        _exp_into(ex, ex)
        # Readout ([1] Eq. 2b) and gate: y = (C h_t + D x) * silu(z)  (m,).
        for c in range(m):
            acc = _dot_in_order(h_next, (c0 + c) * n, C)
            y[c] = (acc + D[c0 + c] * x[c]) * (z[c] / (_ONE + ex[c]))


# ---------------------------------------------------------------------- Mamba-2


@njit(**_JIT)
def ssd_step(
    zxbcdt: np.ndarray,
    xbc: np.ndarray,
    dt_bias: np.ndarray,
    A: np.ndarray,
    D: np.ndarray,
    dt_min: np.float32,
    dt_max: np.float32,
    ssm: np.ndarray,
    ssm_out: np.ndarray,
    y_out: np.ndarray,
    scratch: np.ndarray,
    scratch_bits: np.ndarray,
) -> None:
    """One step of the Mamba-2 SSM (the recurrent form of SSD, Dao and Gu 2024,
    arXiv:2405.21060, Section 7: each head decays by one scalar, groups of heads share
    B and C).

    zxbcdt (rows, e + c + h) in_proj output with the raw Δ of each head in its last h
    columns; xbc (rows, c) the conv output after SiLU, [x (e = h p), B (g n), C (g n)];
    dt_bias, A = -exp(A_log), D: (h,); ssm (b, h, p, n) = h_{t-1}. Writes ssm_out = h_t and
    y_out[:b] (b, e) = C h_t + D x (the gated norm comes after).
    """
    ssd_step_heads(
        zxbcdt, xbc, dt_bias, A, D, dt_min, dt_max, ssm, ssm_out, y_out, scratch, scratch_bits,
        0, ssm.shape[1],
    )  # fmt: skip


@njit(**_JIT)
def ssd_step_heads(
    zxbcdt: np.ndarray,
    xbc: np.ndarray,
    dt_bias: np.ndarray,
    A: np.ndarray,
    D: np.ndarray,
    dt_min: np.float32,
    dt_max: np.float32,
    ssm: np.ndarray,
    ssm_out: np.ndarray,
    y_out: np.ndarray,
    scratch: np.ndarray,
    scratch_bits: np.ndarray,
    h0: int,
    h1: int,
) -> None:
    """:func:`ssd_step` for heads ``h0:h1`` only (``scratch``: 4 (h1 - h0) floats,
    ``scratch_bits`` h1 - h0): each head's state and outputs are its own, so threads can
    share the step by heads with the bits of the whole (``split_step``)."""
    b, H, P, N = ssm.shape
    e = H * P
    groups = (xbc.shape[1] - e) // (2 * N)
    per_group = H // groups
    width = zxbcdt.shape[1]
    m = h1 - h0
    dt = scratch[:m]
    ex = scratch[m : 2 * m]
    soft = scratch[2 * m : 4 * m]
    for row in range(b):
        raw = zxbcdt[row, width - H + h0 : width - H + h1]
        x = xbc[row, :e]
        y = y_out[row]
        # Δ = clamp(softplus(raw + dt_bias), time_step_limit) (m,); softplus as in torch.
        for j in range(m):
            ex[j] = raw[j] + dt_bias[h0 + j]
        _softplus_into(ex, dt, soft, scratch_bits[:m])
        for j in range(m):
            dt[j] = min(max(dt[j], dt_min), dt_max)
        # Zero-order hold: Ā = exp(Δ A), one scalar per head (m,)
        for j in range(m):
            ex[j] = dt[j] * A[h0 + j]
        _exp_into(ex, ex)
        for j in range(m):
            hh = h0 + j
            g = hh // per_group
            B = xbc[row, e + g * N : e + (g + 1) * N]  # (n,)
            C = xbc[row, e + (groups + g) * N : e + (groups + g + 1) * N]  # (n,)
            a = ex[j]
            d = dt[j]
            for pp in range(P):
                xv = x[hh * P + pp]
                h_prev = ssm[row, hh, pp]  # (n,)
                h_next = ssm_out[row, hh, pp]
                # h_t = Ā h_{t-1} + (Δ B) x  (n,)
                for s in range(N):
                    h_next[s] = h_prev[s] * a + (d * B[s]) * xv
                # y = C h_t + D x
                y[hh * P + pp] = _dot_in_order(h_next, 0, C) + xv * D[hh]


@njit(**_JIT)
def gated_rms_norm_rows(
    y: np.ndarray,
    zxbcdt: np.ndarray,
    weight: np.ndarray,
    groups: int,
    eps: np.float32,
    b: int,
    out: np.ndarray,
    scratch: np.ndarray,
) -> None:
    """Mamba-2's gated RMSNorm of rows ``y[:b]`` (b, e), gate z = ``zxbcdt[:, :e]``:
    ``v = y * silu(z)``, then each of ``groups`` equal slices of ``v`` is scaled by
    ``1 / sqrt(mean(v^2) + eps)`` and by ``weight`` (e,), as transformers 5's
    ``MambaRMSNormGated`` and mamba_ssm's ``RMSNormGated(group_size=e / g)`` compute it."""
    e = y.shape[1]
    size = e // groups
    neg = scratch[:e]
    v = scratch[e : 2 * e]
    for row in range(b):
        for c in range(e):
            neg[c] = -zxbcdt[row, c]
        _exp_into(neg, neg)
        for c in range(e):
            v[c] = y[row, c] * (zxbcdt[row, c] / (_ONE + neg[c]))  # y * z * sigmoid(z)
        for grp in range(groups):
            ss = _ZERO
            for j in range(grp * size, (grp + 1) * size):
                ss += v[j] * v[j]
            inv = _ONE / np.sqrt(ss / np.float32(size) + eps)
            for j in range(grp * size, (grp + 1) * size):
                out[row, j] = weight[j] * (v[j] * inv)


# ---------------------------------------------------------------------- a whole mixer


@njit(**_JIT)
def mamba_mixer(
    xn: np.ndarray,
    b: int,
    in_panels: np.ndarray,
    in_scales: np.ndarray,
    in_bias: np.ndarray,
    in_has_bias: bool,
    conv: np.ndarray,
    conv_weight: np.ndarray,
    conv_bias: np.ndarray,
    conv_has_bias: bool,
    conv_next: np.ndarray,
    x_panels: np.ndarray,
    x_scales: np.ndarray,
    x_bias: np.ndarray,
    x_has_bias: bool,
    dt_panels: np.ndarray,
    dt_scales: np.ndarray,
    dt_bias: np.ndarray,
    rank: int,
    A: np.ndarray,
    D: np.ndarray,
    ssm: np.ndarray,
    ssm_next: np.ndarray,
    out_panels: np.ndarray,
    out_scales: np.ndarray,
    out_bias: np.ndarray,
    out_has_bias: bool,
    xz: np.ndarray,
    xs: np.ndarray,
    x_dbl: np.ndarray,
    dt_raw: np.ndarray,
    y: np.ndarray,
    scratch: np.ndarray,
    scratch_bits: np.ndarray,
    delta: np.ndarray,
) -> None:
    """One Mamba-1 mixer and its out_proj for rows ``:b``, in one compiled call: the same
    products and kernels, in the same order, as ``MambaBlockWeights.mix_in_steps`` calls
    them one by one from Python (same bits; ``tests/test_kernels.py`` compares them).

    Why: a lone session's step is ~40 small calls, and each call from Python into numba
    costs ~1-2 us of argument checking; one call per layer leaves one of those per layer.
    Reads ``xn`` (rows, d); writes ``delta[:b]`` (b, d) = out_proj(y), the new conv window
    and h_t (``conv_next``, ``ssm_next``), and the activations in between.
    """
    product_rows(xn, in_panels, in_scales, in_bias, in_has_bias, 0, b, xz)  # (b, d) -> (b, 2e)
    conv_silu(conv, xz, conv_weight, conv_bias, conv_has_bias, conv_next, xs, scratch)  # (b, e)
    product_rows(xs, x_panels, x_scales, x_bias, x_has_bias, 0, b, x_dbl)  # (b, e) -> (b, r + 2n)
    product_rows(
        x_dbl[:, :rank], dt_panels, dt_scales, dt_bias, True, 0, b, dt_raw
    )  # (b, r) -> (b, e)
    selective_scan(dt_raw, xs, x_dbl, xz, A, D, ssm, ssm_next, y, scratch, scratch_bits)
    product_rows(y, out_panels, out_scales, out_bias, out_has_bias, 0, b, delta)  # (b, e) -> (b, d)
