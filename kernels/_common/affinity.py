"""Numba's worker threads kept off the core of the thread that launches a parallel region (Linux).

Why: a worker that sleeps between calls (the pool's passive wait, ``threads.py``) is woken by the calling thread
at the next region. After a pause of the calling program, the guest kernel of a VM woke it on the caller's own
vCPU (seen with ``sched_getcpu()`` in each iteration), where it started when the caller's time slice ended or the
load balancer moved it, milliseconds later: the region ran on one core. The likely reason: Linux wakes a task on
an idle CPU where it finds one (``select_idle_sibling``, kernel/sched/fair.c), and does not count as idle a vCPU
that the host reports preempted (``available_idle_cpu`` asks ``vcpu_is_preempted``).

Measured on a 2-vCPU AMD EPYC (Zen 4, KVM). A parallel loop of two 1.1 ms iterations after 100 ms sleeps
(medians of 20): the worker started 1.15 ms late, on the caller's vCPU, and the loop took 2.26 ms; with the caller
and the worker pinned to one vCPU each, 0.12 ms late and 1.26 ms. With ``steer_workers`` (each call 50 ms after the
last, medians of 25, off -> on): flash attention N = 1024 causal 17.0 -> 11.3 ms, a prefill's linear
(256, 576) · (576, 1536) 6.4 -> 3.8, ``int8_matmul`` 128 × 1024² 4.4 -> 3.5 (back to back: 11.4, 3.4, 2.7 ms).

How: the workers' thread ids are read once per calling thread and pool size, by a parallel region whose every
iteration asks ``gettid()`` (GNU OpenMP keeps one pool of workers per thread that launches regions). Before a
region, ``steer_workers`` compares the caller's CPU (``sched_getcpu()``) with the one it saw last; when it moved,
each worker's affinity becomes the caller's allowed CPUs less that one (``sched_setaffinity``, one system call per
worker). Where the workers outnumber the other CPUs (more threads than cores), nothing is set: the scheduler
shares the cores better than a fixed set would. ``IOAWARE_STEER_WORKERS=0`` turns it off; outside Linux, or
where the C library has no ``gettid`` (glibc before 2.30), it is off.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading

from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

ENV_SWITCH = "IOAWARE_STEER_WORKERS"
DISCOVERY_TRIES = 20  # regions run to see every worker at least once (each takes one iteration of a static split)


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()
SUPPORTED = (sys.platform.startswith("linux") and hasattr(os, "sched_setaffinity") and _LIBC is not None
             and hasattr(_LIBC, "gettid") and hasattr(_LIBC, "sched_getcpu"))
if SUPPORTED:
    _sched_getcpu = _LIBC.sched_getcpu
    _sched_getcpu.restype, _sched_getcpu.argtypes = ctypes.c_int, []


@intrinsic
def _gettid(typingctx):
    """The calling thread's id (``gettid()``, glibc >= 2.30)."""
    sig = types.int64()

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "gettid")
        return builder.sext(builder.call(fn, []), ir.IntType(64))

    return sig, codegen


@njit(parallel=True, cache=True)
def _thread_ids(out):
    """out[i] = the id of the thread that runs iteration i (one iteration per thread: the static split)."""
    for i in prange(out.size):
        out[i] = _gettid()


def enabled() -> bool:
    """Whether ``steer_workers`` sets affinities in this process."""
    return SUPPORTED and os.environ.get(ENV_SWITCH, "1") != "0"


class _Workers(threading.local):
    pid = 0  # the process the ids were read in: a forked child has none of its parent's workers, and setting
    # the affinity of a thread id outside the process would move another process's thread
    threads = 0  # the pool size the ids were read for
    ids: tuple = ()  # the workers' thread ids; empty when they could not all be told apart
    cpu = -1  # the caller's CPU when the affinities were last set


_workers = _Workers()


def _read_ids(threads):
    import numpy as np

    own = threading.get_native_id()
    seen: set[int] = set()
    for _ in range(DISCOVERY_TRIES):
        out = np.zeros(threads, dtype=np.int64)  # (threads,)
        _thread_ids(out)
        seen.update(int(t) for t in out if t != own)
        if len(seen) >= threads - 1:
            break
    return tuple(sorted(seen)) if len(seen) == threads - 1 else ()


def worker_mask(allowed: set, cpu: int, n_workers: int) -> set:
    """The CPUs the workers may run on while the caller runs on ``cpu``: ``allowed`` less ``cpu``, or all of
    ``allowed`` where the others are fewer than the workers."""
    others = set(allowed) - {cpu}
    return others if len(others) >= n_workers else set(allowed)


def steer_workers() -> None:
    """Keep Numba's workers off this thread's CPU for the region about to run (see the module docstring); a few
    hundred nanoseconds when this thread has not moved since the last call."""
    if not enabled():
        return
    import numba

    threads = numba.get_num_threads()
    if threads < 2:
        return
    state = _workers
    if state.threads != threads or state.pid != os.getpid():
        state.pid, state.threads, state.ids, state.cpu = os.getpid(), threads, _read_ids(threads), -1
    cpu = _sched_getcpu()
    if not state.ids or cpu == state.cpu or cpu < 0:
        return
    mask = worker_mask(os.sched_getaffinity(0), cpu, len(state.ids))  # from this thread's CPUs
    try:
        for tid in state.ids:
            os.sched_setaffinity(tid, mask)
    except OSError:  # a worker gone (its pool was resized) or not ours to set: read the ids again next time
        state.threads = 0
        return
    state.cpu = cpu
