"""BLAS inside Numba's pool: single-threaded while Numba's threads call it, and the matmuls ioaware would otherwise
hand to NumPy's multithreaded BLAS (see kernels/_common/threads.py for the threading design)."""
from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import numpy as np
from numba import njit, prange
from threadpoolctl import ThreadpoolController

from .affinity import steer_workers
from .atomics import COUNTER_STRIDE, claim
from .threads import in_parts, planned_threads, pool_threads


@functools.lru_cache(maxsize=1)
def _numba_blas():
    """The BLAS that Numba's ``np.dot`` calls: SciPy's (``scipy.linalg.cython_blas``).

    Only that one is limited: NumPy wheels bundle a BLAS of their own, and resizing its thread pool on every call
    wakes its threads, which then spin on the cores that Numba's threads need. Where both packages share one BLAS
    (a conda environment, say), that shared library is the one selected.
    """
    import scipy.linalg.cython_blas  # noqa: F401  (load it, so that the controller sees it)

    controller = ThreadpoolController().select(user_api="blas")
    scipy_libs = [lib for lib in controller.lib_controllers
                  if any(part.startswith("scipy") for part in Path(lib.filepath).parts)]
    if scipy_libs:
        controller.lib_controllers = scipy_libs
    return controller


@contextlib.contextmanager
def single_threaded_blas():
    """Limit Numba's BLAS to one thread inside the block (the Numba kernels call it from each of their threads).

    Through the library controllers' own get/set calls: 3.5 us per block, against 15 us for threadpoolctl's
    general ``limit`` (which a 90 us decode step over a pruned cache notices).
    """
    steer_workers()  # the block runs a parallel region next
    libs = _numba_blas().lib_controllers
    previous = [lib.get_num_threads() for lib in libs]
    for lib, n in zip(libs, previous):
        if n != 1:
            lib.set_num_threads(1)
    try:
        yield
    finally:
        for lib, n in zip(libs, previous):
            if n != 1:
                lib.set_num_threads(n)


# -- matmuls on Numba's pool ---------------------------------------------------------------------------------------
# The products that NumPy would hand to its own multithreaded BLAS (the standard algorithm's S = QKᵀ and PV, a
# prefill's linear layers) run here instead: split over Numba's threads, each block through BLAS on the calling
# thread. NumPy's BLAS pool then never wakes inside an ioaware call, and never spins after one (OpenBLAS's idle
# threads poll for 2^28 cycles, ~0.1 s, before they sleep: THREAD_TIMEOUT in its Makefile.rule).
#
# Versions (2-vCPU AMD EPYC, Zen 4, KVM; v1 and v2 called in turn in one process, 2 ms apart, 8 s per shape):
#   v1: each matrix in 2·threads row blocks, handed out statically (OpenMP's static schedule, which Numba's omp
#       layer uses whatever its chunk size). Each row block's GEMM packs all of b, and a thread that starts late
#       holds up the call.
#   v2: blocks of the side whose blocks repack the smaller operand (columns of a · bᵀ when M < N: each block then
#       packs a, not b), 4·threads of them, claimed one at a time (``atomics.claim``: a thread's own blocks first,
#       then those of a thread still busy). Medians v1 -> v2, a prefill's linears: (256, 576) · (576, 1536)
#       3.04 -> 2.82 ms, (64, 576) · (576, 576) 0.94 -> 0.67, (256, 1536) · (1536, 576) 3.53 -> 3.21; the standard
#       algorithm's S = QKᵀ and PV over 8 heads at N = 512: 2.04 / 2.06 ms both.
TASKS_PER_THREAD = 4  # blocks per thread: enough that the other threads can take over a late thread's share
COLUMN_ALIGN = 16  # a column block's width rounds up to 16 columns, a 64-byte line of float32: where out's rows
# start on a line, two threads' float32 blocks write no line in common


@njit(cache=True)
def _block(task, extent, n_blocks, align):
    """(g, lo, hi): the matrix and the range of its split side that ``task`` covers (hi <= lo when empty)."""
    g, blk = task // n_blocks, task % n_blocks
    width = (extent + n_blocks - 1) // n_blocks
    width = (width + align - 1) // align * align
    return g, blk * width, min(extent, blk * width + width)


@njit(parallel=True, cache=True)
def _batched_nt(a, b, out, n_blocks, by_columns, first, last, counters):
    """out[g] = a[g] · b[g]ᵀ for a (G, M, K), b (G, N, K), out (G, M, N): each matrix in n_blocks blocks of rows
    of out, or of its columns with ``by_columns`` (each written through a block of its own, since BLAS here takes
    only contiguous outputs), numbered matrix by matrix; the tasks [first, last) of them, claimed by the threads
    (``counters``: zeros, COUNTER_STRIDE per thread)."""
    M, N = a.shape[1], b.shape[1]
    n_workers = counters.size // COUNTER_STRIDE
    n_tasks = last - first
    for worker in prange(n_workers):
        # (int64 arguments, as the decode step passes them: a bare 0 is typed Literal[int](0), and the loop's index
        # uint64 in the function Numba makes of its body; each other type compiles ``claim`` and ``_block`` again)
        task = claim(counters, np.int64(0), np.int64(worker), n_workers, n_tasks)
        while task >= 0:
            task += first
            if by_columns:
                g, c0, c1 = _block(task, N, n_blocks, np.int64(COLUMN_ALIGN))
                if c1 - c0 == N:  # the whole matrix: straight into out
                    np.dot(a[g], b[g].T, out[g])
                elif c0 < c1:
                    part = np.empty((M, c1 - c0), dtype=out.dtype)  # (M, c1 - c0)
                    np.dot(a[g], b[g, c0:c1].T, part)
                    out[g, :, c0:c1] = part
            else:
                g, r0, r1 = _block(task, M, n_blocks, np.int64(1))
                if r0 < r1:
                    np.dot(a[g, r0:r1], b[g].T, out[g, r0:r1])
            task = claim(counters, np.int64(0), np.int64(worker), n_workers, n_tasks)


@njit(parallel=True, cache=True)
def _batched_nn(a, b, out, n_blocks, first, last, counters):
    """out[g] = a[g] · b[g] for a (G, M, K), b (G, K, N), out (G, M, N); each matrix in n_blocks row blocks, the
    tasks [first, last) of them claimed as in ``_batched_nt`` (a column block of b would be a strided array, which
    BLAS here does not take)."""
    n_workers = counters.size // COUNTER_STRIDE
    n_tasks = last - first
    for worker in prange(n_workers):
        task = claim(counters, np.int64(0), np.int64(worker), n_workers, n_tasks)
        while task >= 0:
            task += first
            g, r0, r1 = _block(task, a.shape[1], n_blocks, np.int64(1))
            if r0 < r1:
                np.dot(a[g, r0:r1], b[g], out[g, r0:r1])
            task = claim(counters, np.int64(0), np.int64(worker), n_workers, n_tasks)


def batched_matmul(a, b, *, transpose_b=False, out=None, parts=False):
    """a[g] · b[g] (or · b[g]ᵀ) for C-contiguous float32/float64 a (G, M, K) and b (G, K, N) (or (G, N, K)), on
    Numba's threads with one BLAS thread each; returns (G, M, N) in a's dtype, written into ``out`` (a C-contiguous
    array of that shape and dtype) when given.

    Where it runs: where the caller's context says; with ``parts``, where ``threads.in_parts`` says (the caller sets
    no context): on the calling thread when small, and beside held cores a few of its blocks at a time on the
    calling thread, looking again before each part. Its blocks are those of the call on the pool either way, and
    so are its bits."""
    G, M = a.shape[0], a.shape[1]
    N = b.shape[1] if transpose_b else b.shape[2]
    if out is None:
        out = np.empty((G, M, N), dtype=a.dtype)  # (G, M, N)
    elif out.shape != (G, M, N) or out.dtype != a.dtype or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous {a.dtype} array of shape {(G, M, N)}; got {out.dtype} "
                         f"{out.shape}")
    if out.size == 0:
        return out
    if a.shape[2] == 0:
        out[...] = 0
        return out
    multiply_adds = G * M * N * a.shape[2]
    # the pool's count (one for a small call in parts), also in a call alone beside held cores: the same blocks, the
    # same bits
    threads = planned_threads(multiply_adds) if parts else pool_threads()
    wanted = -(-TASKS_PER_THREAD * threads // G)  # blocks per matrix for TASKS_PER_THREAD·threads tasks in all
    column_blocks = -(-N // COLUMN_ALIGN)  # the most column blocks of whole 16-column widths
    # split the side whose blocks repack the smaller operand, where its blocks are at least as many as rows would be
    by_columns = transpose_b and M < N and column_blocks >= min(wanted, M)
    n_blocks = max(1, min(column_blocks if by_columns else M, wanted))  # blocks per matrix: G·n_blocks tasks
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    n_tasks = G * n_blocks

    def run(first, last):
        counters = np.zeros(threads * COUNTER_STRIDE, dtype=np.int64)  # (threads·COUNTER_STRIDE,) claims per block
        # int64 bounds, as the kernels are compiled for
        first, last = np.int64(first), np.int64(last)
        with single_threaded_blas():
            if transpose_b:
                _batched_nt(a, b, out, n_blocks, by_columns, first, last, counters)
            else:
                _batched_nn(a, b, out, n_blocks, first, last, counters)

    if parts:
        in_parts(n_tasks, multiply_adds / n_tasks, run)
    else:
        run(0, n_tasks)
    return out
