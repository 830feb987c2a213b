"""A spin barrier for the engine's threads inside one compiled call (``split_step``).

Why. At batch 1 a step's products are cut by columns over the engine's threads. Handing
each product to a helper through Python (``threads.run_ranges``) costs ~60-90 us a
hand-off here, and a mamba-130m step has 49 of them; inside one compiled call the threads
meet at a barrier instead, which costs well under a microsecond when both are running.

How. ``sync`` is an int64 array of :data:`SYNC_SLOTS` shared by the threads of one call:
slot 0 counts arrivals, slot 1 is the generation. The last thread to arrive resets the
count and bumps the generation; the others spin on the generation (the CPU's ``pause``
between reads), and after :data:`SPINS_BEFORE_YIELD` reads yield the core
(``sched_yield``), so a partner descheduled on a busy machine gets it back. Atomic reads
and adds are sequentially consistent (LLVM ``seq_cst``): everything a thread wrote before
the barrier is visible to every thread after it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

#: int64 slots of a barrier's ``sync`` array: arrivals, generation, helpers joined, and
#: the call's thread count once the caller has closed it (``open_helpers``).
SYNC_SLOTS = 4
#: Added to the joined count to close a call: a helper that joins after sees it and leaves.
_CLOSED = 1 << 40
#: Reads of the generation between two yields of the core.
SPINS_BEFORE_YIELD = 4096

_JIT = {"nogil": True, "cache": True, "boundscheck": False, "error_model": "numpy"}


def _slot(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
    arr = context.make_array(sig.args[0])(context, builder, args[0])
    return builder.gep(arr.data, [args[1]])


@intrinsic
def atomic_add(typingctx: Any, arr: Any, index: Any, value: Any) -> tuple[Any, Any]:
    """``arr[index] += value`` atomically (int64 array); returns the value before."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        return builder.atomic_rmw("add", _slot(context, builder, sig, args), args[2], "seq_cst")

    return types.int64(arr, types.intp, types.int64), codegen


@intrinsic
def atomic_load(typingctx: Any, arr: Any, index: Any) -> tuple[Any, Any]:
    """``arr[index]`` read atomically (int64 array)."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        return builder.load_atomic(_slot(context, builder, sig, args), "seq_cst", 8)

    return types.int64(arr, types.intp), codegen


@intrinsic
def atomic_store(typingctx: Any, arr: Any, index: Any, value: Any) -> tuple[Any, Any]:
    """``arr[index] = value`` atomically (int64 array)."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        builder.store_atomic(args[2], _slot(context, builder, sig, args), "seq_cst", 8)
        return context.get_dummy_value()

    return types.void(arr, types.intp, types.int64), codegen


@intrinsic
def atomic_cas(typingctx: Any, arr: Any, index: Any, old: Any, new: Any) -> tuple[Any, Any]:
    """Set ``arr[index]`` to ``new`` if it holds ``old``, atomically; whether it did."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        ptr = _slot(context, builder, sig, args)
        pair = builder.cmpxchg(ptr, args[2], args[3], "seq_cst", "seq_cst")
        return builder.extract_value(pair, 1)

    return types.boolean(arr, types.intp, types.int64, types.int64), codegen


@intrinsic
def cpu_relax(typingctx: Any) -> tuple[Any, Any]:
    """A spin-wait hint (x86 ``pause``; nothing elsewhere)."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        triple = builder.module.triple or ""
        if triple.startswith(("x86_64", "i686", "i386")):
            pause = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause"
            )
            builder.call(pause, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def yield_core(typingctx: Any) -> tuple[Any, Any]:
    """The C library's ``sched_yield()`` (declared here, resolved by the JIT in this
    process: a ctypes pointer would keep the kernel out of numba's on-disk cache)."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield"
        )
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@njit(**_JIT)
def barrier(sync: np.ndarray, parties: int) -> None:
    """Wait until all ``parties`` threads of this call have arrived (see the module)."""
    if parties <= 1:
        return
    generation = atomic_load(sync, 1)
    if atomic_add(sync, 0, 1) == parties - 1:  # the last to arrive opens it
        atomic_store(sync, 0, 0)
        atomic_add(sync, 1, 1)
        return
    spins = 0
    while atomic_load(sync, 1) == generation:
        spins = _spin(spins)


@njit(**_JIT)
def _spin(spins: int) -> int:
    """One spin-wait step: the ``pause`` hint, and the core yielded every
    :data:`SPINS_BEFORE_YIELD` of them; returns the new count."""
    cpu_relax()
    spins += 1
    if spins % SPINS_BEFORE_YIELD == 0:
        yield_core()
    return spins


@njit(**_JIT)
def open_helpers(sync: np.ndarray, helpers: int, max_spins: int) -> int:
    """The caller's side of starting a call: wait (at most ``max_spins`` spins) for the
    ``helpers`` submitted to join, then close the call to any later one; returns the
    call's thread count (1 + those that joined), which every joined helper reads."""
    spins = 0
    while atomic_load(sync, 2) < helpers and spins < max_spins:
        spins = _spin(spins)
    joined = atomic_add(sync, 2, _CLOSED)  # closed: a later helper sees >= _CLOSED
    parties = 1 + min(joined, helpers)
    atomic_store(sync, 3, parties)
    return parties


@njit(**_JIT)
def join_as_helper(sync: np.ndarray) -> tuple[int, int]:
    """A helper's side: join the call (its thread index, from 1) and wait for the
    caller's thread count; (0, 0) where the caller closed the call first (leave)."""
    joined = atomic_add(sync, 2, 1)
    if joined >= _CLOSED:
        return 0, 0
    spins = 0
    while atomic_load(sync, 3) == 0:
        spins = _spin(spins)
    return joined + 1, atomic_load(sync, 3)


def new_sync() -> np.ndarray:
    """A fresh ``sync`` array for one call's threads."""
    return np.zeros(SYNC_SLOTS, np.int64)
