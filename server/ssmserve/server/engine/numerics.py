"""Numerics that make steps exact: pinned BLAS threads and a batch-invariant product.

Why this module exists. ssmserve promises that a session's outputs are bit-identical
whether it steps alone or inside any batch (so replay after a restore reproduces history
exactly). Elementwise numpy ufuncs and last-axis reductions already are (measured: each
row of ``exp``, ``log1p``, ``tanh``, ``sum``, ``mean`` equals its solo result for batch
sizes 1..300). BLAS products are not, and on this machine (AMD EPYC, OpenBLAS 0.3.31
with Haswell kernels) the obvious fixes fail too:

* ``x @ w`` for one row (matrix-vector) differs from the same row in a matrix product;
* padding the batch to a multiple of 8 rows does not help: rows differ for batches > 16;
* inside one fixed-shape product, a row's result can depend on its position; for
  ``x_tile @ w`` this happens already at 16 rows.

What holds (checked for every weight shape the engine uses, for 1 and 2 threads): the
product ``w (o, i) @ x_tile.T (i, 16)`` on a tile of exactly ``TILE_ROWS`` = 16 rows gives
each row the same bits whatever its position and neighbours. :class:`RowStableLinear`
therefore pads a batch to a multiple of 16 rows and issues one such product per tile.
Cost (this machine, 2 threads): ~115-140 GFLOP/s at 64+ rows against ~165-230 for one
plain product, and 16x the work of a matrix-vector product for a lone session; see
``BENCHMARKS.md``. ``tests/test_batch_invariance.py`` guards all of it.

The BLAS thread count changes which kernels run (1 thread and 2 threads give different
bits), so :func:`pin_blas_threads` fixes it for the whole process; the same machine kind,
numpy/OpenBLAS build and thread count give the same bits in every process.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm
import numba
import numpy as np
from numba.core import config as numba_config
from threadpoolctl import threadpool_info, threadpool_limits

#: Rows per BLAS call; see the module docstring for why exactly 16.
TILE_ROWS = 16

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
        threads = int(os.environ.get("SSMSERVE_BLAS_THREADS", DEFAULT_BLAS_THREADS))
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


class RowStableLinear:
    """``y = x @ weight.T + bias`` whose every row is independent of the other rows.

    ``weight`` is ``(o, i)``, the layout PyTorch/HF store for ``nn.Linear``.
    """

    __slots__ = ("bias", "in_features", "out_features", "weight")

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None = None) -> None:
        self.weight = np.ascontiguousarray(weight, dtype=np.float32)  # (o, i)
        self.out_features, self.in_features = self.weight.shape
        self.bias = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """``x``: (b, i) float32 -> (b, o) float32 (a view into a fresh padded buffer)."""
        b = x.shape[0]
        padded_rows = padded(b)
        if padded_rows == b and x.flags.c_contiguous:
            xp = x  # (b, i)
        else:
            xp = np.zeros((padded_rows, self.in_features), dtype=np.float32)  # (bp, i)
            xp[:b] = x
        out = np.empty((padded_rows, self.out_features), dtype=np.float32)  # (bp, o)
        return self.into(xp, out)[:b]

    def into(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``x`` (bp, i) -> ``out`` (bp, o), both C-contiguous, bp a multiple of 16 rows."""
        for start in range(0, x.shape[0], TILE_ROWS):
            stop = start + TILE_ROWS
            # (o, i) @ (i, 16) -> (o, 16). Not ``out=out[start:stop].T``: given an
            # F-ordered destination numpy swaps the operands, which is the
            # position-dependent x_tile @ w.T form again.
            out[start:stop] = (self.weight @ x[start:stop].T).T
        if self.bias is not None:
            out += self.bias
        return out


def padded(rows: int) -> int:
    """``rows`` rounded up to whole tiles of :data:`TILE_ROWS` (at least one tile)."""
    return max(1, -(-rows // TILE_ROWS)) * TILE_ROWS


#: Engine sources whose code decides the bits of a step (a change to any of them may
#: change outputs, so workers running different versions must not share a session).
_ENGINE_SOURCES = ("kernels.py", "mamba.py", "mamba2.py", "numerics.py")


def numerics_description() -> str:
    """Everything a step's bits depend on besides weights and inputs, one line.

    The CPU the numba kernels were compiled for (its name and instruction-set features),
    the BLAS build, kernel family and thread count, the numpy / numba / llvmlite versions,
    and a hash of the engine's own source. Two workers with the same description give the
    same bits for the same weights and inputs; with different ones, replay of a session's
    history may not reproduce what was answered.
    """
    cpu = numba_config.CPU_NAME or llvm.get_host_cpu_name()
    features = numba_config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()
    enabled = ",".join(sorted(f[1:] for f in features.split(",") if f.startswith("+")))
    source = hashlib.sha256()
    here = Path(__file__).parent
    for name in _ENGINE_SOURCES:
        source.update((here / name).read_bytes())
    return (
        f"{platform.machine()} cpu={cpu} features={_short(enabled)}"
        f" | {blas_signature()} | numpy {np.__version__} numba {numba.__version__}"
        f" llvmlite {llvmlite.__version__} | engine {source.hexdigest()[:12]}"
    )


def numerics_signature(description: str | None = None) -> str:
    """A short hash of :func:`numerics_description`: equal signatures, equal bits."""
    text = numerics_description() if description is None else description
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _short(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]
