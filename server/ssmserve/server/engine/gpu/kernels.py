"""The GPU engine's Triton kernels: every output element in one fixed order.

Why this module exists. cuBLAS and ``tl.dot`` pick their summation order (tile shape,
split-k, tensor-core fragments) by the problem's shape, so a row's bits change with the
number of rows around it. Here each kernel's arithmetic for one element is written out
and does not depend on the grid, the batch size or the row's position:

* **product** ``out = x @ w.T + bias``: k in blocks of ``K_BLOCK`` (64), each block an fma
  chain from 0.0 in increasing k, the block sums added in increasing block order, then
  the bias: exactly the CPU engine's micro-kernel (``engine/products.py``), so a product
  has the CPU engine's bits wherever fma is correctly rounded (both engines' fma is).
  Two launch shapes compute it: one program per (rows, columns) tile walking every block
  (:func:`product_kernel`), or one program per (tile, block) writing the block's chain
  to a scratch and a second pass adding them in order (:func:`product_blocks_kernel`,
  :func:`sum_blocks_kernel`: k-parallel, for few rows). The same operations in the same
  order either way, so the choice changes no bits.
* **row kernels** (norms, gated norm): one program per row; a sum over a row is
  ``tl.sum`` over a block whose shape depends only on the model's dims, so every row of
  every batch goes through the same compiled reduction.
* **conv**: one program per (rows, channels) tile, each element's k taps an fma chain; a
  position's window is read from the inputs where it lies in this call and from the
  carried conv state where it lies before, so a step (T = 1) and a prefill (T positions)
  compute each position alike.
* **scans**: one program per (session, channel block) walking its T positions in order,
  the state in registers: a step is this kernel with T = 1, a prefill the same kernel
  with T = the prompt's length. The readout ``C h`` is ``tl.sum`` over the state block
  (a fixed tree for a fixed block shape).

Every mul-add that matters is an explicit ``tl.fma`` and the kernels are launched with
``enable_fp_fusion=False``, so the compiler contracts nothing on its own; sizes that vary
with the call (rows, positions) are ``do_not_specialize``, so a batch of one or a prompt
of one position compiles to the same code as any other. Under ``TRITON_INTERPRET=1``
(CPU, numpy) the same kernels run with the same per-element operations (the interpreter's
``tl.fma`` rounds once), which is how CI tests them; ``exp``/``log`` there are numpy's and
on a GPU the device's, so the interpreter's bits are not the device's bits (the numerics
signature names the device).

Glossary: M rows (sessions x positions), N output columns, K input features, S sessions,
T positions per session, E channels (inner size), NP the state size padded to a power of
two, H heads, P head dim, G groups, KW conv width.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Terms per fma chain of a product: the CPU engine's ``products.K_BLOCK``.
K_BLOCK = 64
#: Rows and columns of one product tile: a fixed shape, never chosen by the problem.
BLOCK_M = 16
BLOCK_N = 128
#: Rows and channels per program of the conv; channels per program of the scans (their
#: tiles' shapes, hence their readout's reduction tree, are constants: never chosen by
#: the batch).
BLOCK_R = 16
BLOCK_C = 64
BLOCK_E = 64
#: torch.nn.functional.softplus's default: x itself above it. A global a kernel reads must be
#: a ``tl.constexpr`` (the compiler refuses others; the interpreter does not).
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)

_ROWS = ["M", "T"]


@triton.jit
def _log1p(y):  # noqa: ANN001, ANN202 (Triton types its arguments)
    """log1p(y) for y >= 0: log(1 + y) plus what 1 + y lost to rounding, relative to it."""
    u = 1.0 + y
    return tl.log(u) + (y - (u - 1.0)) / u


@triton.jit
def _softplus(raw):  # noqa: ANN001, ANN202
    """torch's softplus: log1p(exp(x)), x itself above 20."""
    soft = _log1p(tl.exp(tl.minimum(raw, SOFTPLUS_THRESHOLD)))
    return tl.where(raw > SOFTPLUS_THRESHOLD, raw, soft)


@triton.jit
def _silu(v):  # noqa: ANN001, ANN202
    return v / (1.0 + tl.exp(-v))


# ------------------------------------------------------------------------------ products


@triton.jit
def _block_chain(  # noqa: ANN202
    x, sx, w_t, rows, cols, M, N, k0, k_stop,  # noqa: ANN001
    BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """sum_{k0 <= k < k_stop} x[rows, k] * w[cols, k] as one fma chain from 0.0 per
    element, k increasing (a (BM, BN) tile)."""
    acc = tl.zeros((BM, BN), tl.float32)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x + rows * sx
    w_cols = w_t + cols
    for k in range(k0, k_stop):
        xk = tl.load(x_rows + k, mask=row_ok, other=0.0)  # (BM,)
        wk = tl.load(w_cols + k * N, mask=col_ok, other=0.0).to(tl.float32)  # (BN,) exact
        acc = tl.fma(xk[:, None], wk[None, :], acc)
    return acc


@triton.jit(do_not_specialize=_ROWS)
def product_kernel(  # noqa: ANN201
    x, sx, w_t, bias, out, so, M, N, K,  # noqa: ANN001
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, KB: tl.constexpr,
):  # fmt: skip
    """``out[m, n] = sum_k x[m, k] w_t[k, n] (+ bias[n])`` for one (BM, BN) tile, k in
    blocks of KB: each block a chain from 0.0, the block sums added in order."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    total = _block_chain(x, sx, w_t, rows, cols, M, N, 0, tl.minimum(KB, K), BM, BN)
    for k0 in range(KB, K, KB):
        total = total + _block_chain(
            x, sx, w_t, rows, cols, M, N, k0, tl.minimum(k0 + KB, K), BM, BN
        )
    if HAS_BIAS:
        total = total + tl.load(bias + cols, mask=cols < N, other=0.0)[None, :]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(out + rows[:, None] * so + cols[None, :], total, mask=mask)


@triton.jit(do_not_specialize=_ROWS)
def product_blocks_kernel(  # noqa: ANN201
    x, sx, w_t, partial, M, N, K,  # noqa: ANN001
    BM: tl.constexpr, BN: tl.constexpr, KB: tl.constexpr,
):  # fmt: skip
    """``partial[b, m, n]`` = block b's chain (k in [b KB, (b + 1) KB)) for one tile."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    k0 = tl.program_id(2) * KB
    acc = _block_chain(x, sx, w_t, rows, cols, M, N, k0, tl.minimum(k0 + KB, K), BM, BN)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(partial + (k0 // KB) * M * N + rows[:, None] * N + cols[None, :], acc, mask=mask)


@triton.jit(do_not_specialize=_ROWS)
def sum_blocks_kernel(  # noqa: ANN201
    partial, bias, out, so, M, N, BLOCKS,  # noqa: ANN001
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """``out`` = the block sums of ``partial`` added in block order (+ bias)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    at = rows[:, None] * N + cols[None, :]
    total = tl.load(partial + at, mask=mask, other=0.0)
    for b in range(1, BLOCKS):
        total = total + tl.load(partial + b * M * N + at, mask=mask, other=0.0)
    if HAS_BIAS:
        total = total + tl.load(bias + cols, mask=cols < N, other=0.0)[None, :]
    tl.store(out + rows[:, None] * so + cols[None, :], total, mask=mask)


# ------------------------------------------------------------------------------ norms


@triton.jit(do_not_specialize=["M"])
def residual_rms_norm_kernel(  # noqa: ANN201
    h, delta, weight, out, eps, M, D,  # noqa: ANN001
    ADD: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """Row ``m``: ``h += delta`` (float64 stream, float32 delta) when ADD, then
    ``out = float32(w h / sqrt(mean(h^2) + eps))`` computed in float64 (rounded once);
    ``eps`` points to one float64 (a scalar argument would be float32)."""
    m = tl.program_id(0)
    cols = tl.arange(0, BD)
    ok = cols < D
    hr = tl.load(h + m * D + cols, mask=ok, other=0.0)
    if ADD:
        hr = hr + tl.load(delta + m * D + cols, mask=ok, other=0.0).to(tl.float64)
        tl.store(h + m * D + cols, hr, mask=ok)
    ss = tl.sum(hr * hr, axis=0)
    inv = 1.0 / tl.sqrt(ss / D + tl.load(eps))
    w = tl.load(weight + cols, mask=ok, other=0.0).to(tl.float64)
    tl.store(out + m * D + cols, (hr * inv * w).to(tl.float32), mask=ok)


@triton.jit(do_not_specialize=["M"])
def gated_rms_norm_kernel(  # noqa: ANN201
    y, z, sz, weight, out, eps, M, E, SIZE,  # noqa: ANN001
    BS: tl.constexpr,
):  # fmt: skip
    """Mamba-2's gated norm, row ``m``, group ``g``: ``v = y silu(z)``, scaled by
    ``1 / sqrt(mean(v^2) + eps)`` over the group's SIZE columns and by ``weight``."""
    m = tl.program_id(0)
    cols = tl.program_id(1) * SIZE + tl.arange(0, BS)
    ok = tl.arange(0, BS) < SIZE
    zr = tl.load(z + m * sz + cols, mask=ok, other=0.0)
    v = tl.load(y + m * E + cols, mask=ok, other=0.0) * _silu(zr)
    ss = tl.sum(v * v, axis=0)
    inv = 1.0 / tl.sqrt(ss / SIZE + eps)
    w = tl.load(weight + cols, mask=ok, other=0.0)
    tl.store(out + m * E + cols, w * (v * inv), mask=ok)


# ------------------------------------------------------------------------------ conv


@triton.jit(do_not_specialize=["M", "T"])
def conv_silu_kernel(  # noqa: ANN201
    xin, sx, state, weight, bias, out, new_state, M, T, C,  # noqa: ANN001
    KW: tl.constexpr, HAS_BIAS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """Rows ``r = s T + t`` (position t of session s; M = S T rows) of one block, channels
    of one block: ``out = silu(sum_j window[j] w[:, j] + bias)``, the taps an fma chain
    j = 0..KW-1, ``window[j]`` the input KW-1-j positions back: from ``xin`` (M, .) at row
    stride ``sx``, or, before this call's first position, from ``state`` (S, C, KW), newest
    at KW-1. Each session's last position writes its window to ``new_state``."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    s = r // T
    t = r % T
    ok = (r < M)[:, None] & (ch < C)[None, :]
    at = (s * C)[:, None] * KW + ch[None, :] * KW  # (BR, BC): each window's first tap
    last = ok & (t == T - 1)[:, None]
    acc = tl.zeros((BR, BC), tl.float32)
    for j in tl.static_range(KW):
        back = (t - (KW - 1) + j)[:, None]  # the position this tap reads; < 0: the state's
        fresh = tl.load(xin + (s[:, None] * T + back) * sx + ch[None, :], mask=ok & (back >= 0))
        old = tl.load(state + at + (KW + back), mask=ok & (back < 0))
        v = tl.where(back >= 0, fresh, old)
        acc = tl.fma(v, tl.load(weight + ch * KW + j, mask=ch < C, other=0.0)[None, :], acc)
        tl.store(new_state + at + j, v, mask=last)
    if HAS_BIAS:
        acc = acc + tl.load(bias + ch, mask=ch < C, other=0.0)[None, :]
    tl.store(out + r[:, None] * C + ch[None, :], _silu(acc), mask=ok)


# ------------------------------------------------------------------------------ scans


@triton.jit(do_not_specialize=["T"])
def selective_scan_kernel(  # noqa: ANN201
    dt_raw, xs, x_dbl, sd, xz, sz, A, D, ssm, new_ssm, y, T, E, N, R,  # noqa: ANN001
    NP: tl.constexpr, BE: tl.constexpr,
):  # fmt: skip
    """Mamba-1's selective SSM for session ``s``, channels of one block, positions
    0..T-1 in order: ``dt = softplus(dt_raw)``, ``h = exp(dt A) h + (dt x) B``,
    ``y = (C h + D x) silu(z)``. Rows ``s T + t`` of dt_raw (., E), xs (., E),
    x_dbl (., sd: B at column R, C at R + N) and xz (., sz: z at column E); ssm / new_ssm
    (S, E, N)."""
    s = tl.program_id(0)
    ch = tl.program_id(1) * BE + tl.arange(0, BE)
    st = tl.arange(0, NP)
    ok = ch < E
    sok = st < N
    both = ok[:, None] & sok[None, :]
    at = (s * E + ch)[:, None] * N + st[None, :]
    h = tl.load(ssm + at, mask=both, other=0.0)  # (BE, NP)
    a = tl.load(A + ch[:, None] * N + st[None, :], mask=both, other=0.0)
    d = tl.load(D + ch, mask=ok, other=0.0)
    for t in range(T):
        row = s * T + t
        dt = _softplus(tl.load(dt_raw + row * E + ch, mask=ok, other=0.0))
        x = tl.load(xs + row * E + ch, mask=ok, other=0.0)
        z = tl.load(xz + row * sz + E + ch, mask=ok, other=0.0)
        b = tl.load(x_dbl + row * sd + R + st, mask=sok, other=0.0)
        c = tl.load(x_dbl + row * sd + R + N + st, mask=sok, other=0.0)
        h = tl.fma(tl.exp(dt[:, None] * a), h, (dt * x)[:, None] * b[None, :])
        acc = tl.sum(h * c[None, :], axis=1)
        tl.store(y + row * E + ch, tl.fma(d, x, acc) * _silu(z), mask=ok)
    tl.store(new_ssm + at, h, mask=both)


@triton.jit(do_not_specialize=["T"])
def ssd_scan_kernel(  # noqa: ANN201
    zxbcdt, sz, xbc, sc, dt_bias, A, D, ssm, new_ssm, y, dt_min, dt_max,  # noqa: ANN001
    T, H, P, N, G, E, W,  # noqa: ANN001
    NP: tl.constexpr, BE: tl.constexpr,
):  # fmt: skip
    """Mamba-2's SSM for session ``s``, channels ``q = head P + p`` of one block, positions
    in order: per head ``dt = clamp(softplus(raw + dt_bias))``, then per channel
    ``h = exp(dt A) h + (dt B) x`` and ``y = C h + D x``, B and C of the head's group.
    Rows ``s T + t`` of zxbcdt (., sz; raw dt at columns W - H .. W - 1, W the in_proj's
    width) and xbc (., sc: x, then B of each group, then C of each group); ssm / new_ssm
    (S, H, P, N), i.e. (S, E, N); y (., E)."""
    s = tl.program_id(0)
    q = tl.program_id(1) * BE + tl.arange(0, BE)
    st = tl.arange(0, NP)
    ok = q < E
    sok = st < N
    both = ok[:, None] & sok[None, :]
    head = q // P
    g = head // (H // G)
    at = (s * E + q)[:, None] * N + st[None, :]
    h = tl.load(ssm + at, mask=both, other=0.0)  # (BE, NP)
    a_h = tl.load(A + head, mask=ok, other=0.0)
    d_h = tl.load(D + head, mask=ok, other=0.0)
    bias = tl.load(dt_bias + head, mask=ok, other=0.0)
    b_at = E + g[:, None] * N + st[None, :]  # this channel's group's B; C is G N further
    for t in range(T):
        row = s * T + t
        raw = tl.load(zxbcdt + row * sz + W - H + head, mask=ok, other=0.0)
        dt = tl.minimum(tl.maximum(_softplus(raw + bias), dt_min), dt_max)
        decay = tl.exp(dt * a_h)
        x = tl.load(xbc + row * sc + q, mask=ok, other=0.0)
        b = tl.load(xbc + row * sc + b_at, mask=both, other=0.0)
        c = tl.load(xbc + row * sc + b_at + G * N, mask=both, other=0.0)
        h = tl.fma(h, decay[:, None], (dt[:, None] * b) * x[:, None])
        acc = tl.sum(h * c, axis=1)
        tl.store(y + row * E + q, tl.fma(x, d_h, acc), mask=ok)
    tl.store(new_ssm + at, h, mask=both)
