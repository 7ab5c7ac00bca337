"""Atomic counters for Numba CPU code, and a wait that gives its core away: what one parallel region needs to run a
sequence of dependent steps (``kernels.decode``'s token step) without a launch per step.

Numba has no CPU atomics, so these are LLVM instructions emitted through ``numba.extending.intrinsic``:
``atomicrmw add`` and an acquiring ``load atomic`` on an element of an int64 array (LLVM Language Reference,
"atomicrmw Instruction", "load Instruction"; sequentially consistent, so every plain store a thread made before
its increment is visible to a thread that reads the count after it), x86's ``PAUSE`` in a spin (Intel SDM vol. 2B,
"PAUSE": it tells the core a spin-wait is running) and the C library's ``sched_yield`` (POSIX), which a long
wait calls so that a thread whose turn it is waiting for, preempted on the same core, can run.

A counter is the first int64 of its own 64-byte line (``COUNTER_STRIDE`` elements apart): two counters sharing a
cache line would make the threads that update them move the line between their cores on every increment.
"""
from __future__ import annotations

import platform

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

COUNTER_STRIDE = 8  # int64 elements per 64-byte cache line: one counter per line
SPINS_BEFORE_YIELD = 2000  # PAUSE rounds before a wait starts yielding: ~30-110 us at 2.6 GHz (PAUSE takes about
# 140 cycles from Skylake on, ~40 before: Intel 64 and IA-32 Architectures Optimization Reference Manual, "Pause
# latency in Skylake microarchitecture"), far above one task of a step and well below a scheduler time slice
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def _element_pointer(context, builder, array_type, array, index):
    ary = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer(context, builder, array_type, ary, [index], wraparound=False)


@intrinsic
def atomic_add(typingctx, array, index, value):
    """array[index] += value atomically (int64 array); returns the value before the add."""
    if not (isinstance(array, types.Array) and array.dtype == types.int64 and array.ndim == 1):
        return None
    sig = types.int64(array, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        array_value, index_value, add = args
        index_value = context.cast(builder, index_value, signature.args[1], types.intp)
        add = context.cast(builder, add, signature.args[2], types.int64)
        pointer = _element_pointer(context, builder, signature.args[0], array_value, index_value)
        return builder.atomic_rmw("add", pointer, add, "seq_cst")

    return sig, codegen


@intrinsic
def atomic_load(typingctx, array, index):
    """array[index] read atomically with acquire ordering (int64 array)."""
    if not (isinstance(array, types.Array) and array.dtype == types.int64 and array.ndim == 1):
        return None
    sig = types.int64(array, types.intp)

    def codegen(context, builder, signature, args):
        array_value, index_value = args
        index_value = context.cast(builder, index_value, signature.args[1], types.intp)
        pointer = _element_pointer(context, builder, signature.args[0], array_value, index_value)
        return builder.load_atomic(pointer, "acquire", 8)

    return sig, codegen


@intrinsic
def spin_pause(typingctx):
    """One PAUSE on x86 (``llvm.x86.sse2.pause``); nothing elsewhere."""
    sig = types.none()

    def codegen(context, builder, signature, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def yield_core(typingctx):
    """``sched_yield()``: let another runnable thread have this core."""
    sig = types.none()

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True)
def wait_until(counters, index, target):
    """Spin until counters[index] >= target, pausing each round and yielding the core after SPINS_BEFORE_YIELD."""
    spins = 0
    while atomic_load(counters, index) < target:
        if spins < SPINS_BEFORE_YIELD:
            spin_pause()
            spins += 1
        else:
            yield_core()


@njit(cache=True)
def home_block(worker, n_workers, n_tasks):
    """The tasks lo .. hi − 1 of ``worker``'s home block in ``claim`` (empty when lo >= hi)."""
    per_block = (n_tasks + n_workers - 1) // n_workers
    lo = worker * per_block
    return lo, min(n_tasks, lo + per_block)


@njit(cache=True)
def claim(counters, base, worker, n_workers, n_tasks):
    """A task of a step of ``n_tasks``, or -1 when none is left: the tasks are ``n_workers`` contiguous home blocks,
    block b's claims counted at counters[base + b·COUNTER_STRIDE]. A worker takes its own block's tasks in order
    first, so that each thread streams one contiguous run of the step's data, then the other blocks' (a late or
    preempted thread's tasks are taken by the others). Every task is returned exactly once."""
    for b in range(n_workers):
        block = (worker + b) % n_workers
        lo, hi = home_block(block, n_workers, n_tasks)
        index = base + block * COUNTER_STRIDE
        if lo >= hi or lo + atomic_load(counters, index) >= hi:  # empty or taken: no write to its line
            continue
        t = lo + atomic_add(counters, index, 1)
        if t < hi:
            return t
    return -1
