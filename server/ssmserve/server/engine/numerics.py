"""Numerics that make steps exact: a batch-invariant product and pinned BLAS threads.

Why this module exists. ssmserve promises that a session's outputs are bit-identical
whether it steps alone or inside any batch (so replay after a restore reproduces history
exactly). The numba kernels (``kernels.py``) treat every row alike, and the products go
through :class:`RowStableLinear`, whose micro-kernel (``products.py``) sums each output
element in one fixed order with one fused multiply-add per term: a row's bits cannot
depend on the batch's size or the row's position, by construction.

BLAS is not on the step's path, because it is not batch-invariant: on this machine (AMD
EPYC, OpenBLAS 0.3.31, Haswell kernels) ``x @ w`` for one row differs from the same row in
a matrix product, rows of one product can differ by position from 16 rows up, and only
``w (o, i) @ x_tile.T (i, 16)`` on exactly 16 rows is stable, at 16x the work of a
matrix-vector product for a lone session. :func:`pin_blas_threads` fixes the BLAS thread
count (1 and 2 threads give different bits) for the numpy code around the engine.

``tests/test_batch_invariance.py`` guards all of it.
"""

from __future__ import annotations

import hashlib
import platform
import threading

import llvmlite
import llvmlite.binding as llvm
import numba
import numpy as np
from numba.core import config as numba_config
from threadpoolctl import threadpool_info, threadpool_limits

from ssmserve.server.engine import products
from ssmserve.server.engine.compile_cache import engine_source_digest
from ssmserve.server.engine.environment import env_int
from ssmserve.server.engine.quantize import Q8Weight
from ssmserve.server.engine.threads import column_ranges, run_ranges

#: BLAS threads used unless ``SSMSERVE_BLAS_THREADS`` says otherwise.
DEFAULT_BLAS_THREADS = 2

_pin_lock = threading.Lock()
_pinned: int | None = None


def pin_blas_threads(threads: int | None = None) -> int:
    """Fix the BLAS thread count for this process (idempotent); returns the count in force.

    ``threads`` defaults to ``$SSMSERVE_BLAS_THREADS`` or :data:`DEFAULT_BLAS_THREADS`.
    """
    global _pinned
    if threads is None:
        threads = env_int("SSMSERVE_BLAS_THREADS", DEFAULT_BLAS_THREADS, 1, 256)
    if threads < 1:
        raise ValueError(f"BLAS threads must be >= 1, got {threads}")
    with _pin_lock:
        if _pinned != threads:
            threadpool_limits(limits=threads, user_api="blas")  # stays in force
            _pinned = threads
    return threads


def blas_signature() -> str:
    """One line naming the BLAS build, kernel family and threads: what exactness depends on."""
    parts = []
    for pool in threadpool_info():
        if pool.get("user_api") == "blas":
            parts.append(
                f"{pool.get('internal_api')} {pool.get('version')} "
                f"{pool.get('architecture')} threads={pool.get('num_threads')}"
            )
    return "; ".join(parts) or "no BLAS found"


def widened(arr: np.ndarray | Q8Weight) -> np.ndarray:
    """float32 values of a weight: ``arr`` itself, or, where it holds bfloat16 bits
    (uint16, how a BF16 weight stays 16-bit in memory), those bits as the high half of
    float32s, or, where it holds float16 bits (int16, how an F16 weight stays 16-bit),
    their values, or a Q8_0 weight's ``scale * q``: the exact value, a new array."""
    if isinstance(arr, Q8Weight):
        return arr.dequantized()
    if arr.dtype == np.int16:
        return arr.view(np.float16).astype(np.float32)
    if arr.dtype != np.uint16:
        return arr
    return (arr.astype(np.uint32) << np.uint32(16)).view(np.float32)


class RowStableLinear:
    """``y = x @ weight.T + bias`` whose every row is independent of the other rows.

    ``weight`` is ``(o, i)``, the layout PyTorch/HF store for ``nn.Linear``; it is kept
    only as packed panels (``products.pack_panels``), so a model holds its weights once.
    """

    __slots__ = ("bias", "in_features", "out_features", "panels", "scales")

    def __init__(self, weight: np.ndarray | Q8Weight, bias: np.ndarray | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.scales = products.NO_SCALES
        if isinstance(weight, Q8Weight):  # 8-bit: int8 panels, their scales beside
            self.scales = products.pack_scales(weight)  # (o/C, i/32, C) float32
        elif weight.dtype not in (np.uint16, np.int16):  # BF16 | F16 bits, kept (``widened``)
            weight = np.asarray(weight, dtype=np.float32)
        self.panels = products.pack_panels(weight)  # (o/C, i, C) float32 | 16-bit | int8
        self.bias = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32)

    @property
    def format(self) -> str:
        """How the weight is held: ``f32``, ``bf16`` / ``f16`` (kept 16-bit) or ``q8_0``."""
        return {
            np.dtype(np.uint16): "bf16",
            np.dtype(np.int16): "f16",
            np.dtype(np.int8): "q8_0",
        }.get(self.panels.dtype, "f32")

    @property
    def nbytes(self) -> int:
        """Bytes the packed weight holds (panels, and a Q8_0 weight's scales)."""
        return self.panels.nbytes + (
            self.scales.nbytes if self.scales is not products.NO_SCALES else 0
        )

    @property
    def weight(self) -> np.ndarray:
        """The ``(o, i)`` weight, rebuilt from the panels (a copy: for tests and tools)."""
        return self.weight_rows(np.arange(self.out_features))

    def weight_rows(self, rows: np.ndarray) -> np.ndarray:
        """``weight[rows]`` (len(rows), i), read from the panels: a tied head's matrix
        doubles as the embedding table without a second copy."""
        rows = np.asarray(rows)
        panel, column = rows // products.COLUMNS, rows % products.COLUMNS
        if self.panels.dtype == np.int8:  # Q8_0: quants times their block's scale
            quants = self.panels[panel, :, column]  # (len, i) int8
            scales = self.scales[panel, :, column]  # (len, i/32) float32
            return Q8Weight(quants, scales).dequantized()
        return widened(self.panels[panel, :, column])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """``x``: (b, i) float32 -> (b, o) float32, freshly allocated."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        return self.into(x, np.empty((x.shape[0], self.out_features), np.float32))

    def into(
        self, x: np.ndarray, out: np.ndarray, rows: int | None = None, threads: int = 1
    ) -> np.ndarray:
        """``out[:rows] = x[:rows] @ weight.T + bias``; ``rows`` defaults to all of ``x``.

        ``x`` (>= rows, i) and ``out`` (>= rows, o) float32 with contiguous rows (views
        such as ``a[:, :i]`` are fine); rows past ``rows`` are left as they are. With
        ``threads`` > 1 a big enough weight is cut into column ranges computed on the
        engine's helper threads at once (``threads.column_ranges``; the same bits).
        """
        n = x.shape[0] if rows is None else rows
        if x.strides[1] != 4 or out.strides[1] != 4 or x.shape[0] < n or out.shape[0] < n:
            raise ValueError(f"product needs row-contiguous float32 with >= {n} rows")
        bias = self.bias if self.bias is not None else _NO_BIAS
        has_bias = self.bias is not None
        panels, scales = self.panels, self.scales
        run_ranges(
            column_ranges(panels.shape[0], panels[0].nbytes, threads),
            lambda lo, hi: products.product_panels(
                x, panels, scales, bias, has_bias, 0, n, lo, hi, out
            ),
        )
        return out


_NO_BIAS = np.zeros(1, np.float32)


#: Workspace allocation granularity in rows (the products compute only the rows asked for).
WORKSPACE_ROWS = 16


def padded(rows: int) -> int:
    """The row count a workspace for ``rows`` sessions is allocated with: whole groups of
    :data:`WORKSPACE_ROWS`, so a few workspaces serve every batch size."""
    return max(1, -(-rows // WORKSPACE_ROWS)) * WORKSPACE_ROWS


def numerics_description() -> str:
    """Everything a step's bits depend on besides weights and inputs, one line.

    The CPU the numba kernels were compiled for (its name and instruction-set features),
    the numpy / numba / llvmlite versions, and a hash of the engine's own source. (Not the
    BLAS build or its threads: no BLAS call decides a step's bits any more, see
    ``products.py``.) Two workers with the same description give the
    same bits for the same weights and inputs; with different ones, replay of a session's
    history may not reproduce what was answered.
    """
    cpu = numba_config.CPU_NAME or llvm.get_host_cpu_name()
    features = numba_config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()
    enabled = ",".join(sorted(f[1:] for f in features.split(",") if f.startswith("+")))
    return (
        f"{platform.machine()} cpu={cpu} features={_short(enabled)}"
        f" | numpy {np.__version__} numba {numba.__version__}"
        f" llvmlite {llvmlite.__version__} | engine {engine_source_digest()[:12]}"
    )


def numerics_signature(description: str | None = None) -> str:
    """A short hash of :func:`numerics_description`: equal signatures, equal bits."""
    text = numerics_description() if description is None else description
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _short(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]
