"""BLAS inside Numba's pool: single-threaded while Numba's threads call it, and the matmuls ioaware would otherwise
hand to NumPy's multithreaded BLAS (see kernels/_common/threads.py for the threading design)."""
from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange
from threadpoolctl import ThreadpoolController


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
TASKS_PER_THREAD = 2  # row blocks per thread: enough to even out unequal blocks, few enough to keep them tall


@njit(parallel=True, cache=True)
def _batched_nt(a, b, out, n_blocks):
    """out[g] = a[g] · b[g]ᵀ for a (G, M, K), b (G, N, K), out (G, M, N); each matrix in n_blocks row blocks."""
    G, M = a.shape[0], a.shape[1]
    rows = (M + n_blocks - 1) // n_blocks
    for task in prange(G * n_blocks):
        g, blk = task // n_blocks, task % n_blocks
        r0, r1 = blk * rows, min(M, blk * rows + rows)
        if r0 < r1:
            np.dot(a[g, r0:r1], b[g].T, out[g, r0:r1])


@njit(parallel=True, cache=True)
def _batched_nn(a, b, out, n_blocks):
    """out[g] = a[g] · b[g] for a (G, M, K), b (G, K, N), out (G, M, N); each matrix in n_blocks row blocks."""
    G, M = a.shape[0], a.shape[1]
    rows = (M + n_blocks - 1) // n_blocks
    for task in prange(G * n_blocks):
        g, blk = task // n_blocks, task % n_blocks
        r0, r1 = blk * rows, min(M, blk * rows + rows)
        if r0 < r1:
            np.dot(a[g, r0:r1], b[g], out[g, r0:r1])


def batched_matmul(a, b, *, transpose_b=False, out=None):
    """a[g] · b[g] (or · b[g]ᵀ) for C-contiguous float32/float64 a (G, M, K) and b (G, K, N) (or (G, N, K)), on
    Numba's threads with one BLAS thread each; returns (G, M, N) in a's dtype, written into ``out`` (a C-contiguous
    array of that shape and dtype) when given."""
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
    threads = numba.get_num_threads()
    n_blocks = max(1, min(M, -(-TASKS_PER_THREAD * threads // G)))  # row blocks per matrix: G·n_blocks tasks
    kernel = _batched_nt if transpose_b else _batched_nn
    with single_threaded_blas():
        kernel(np.ascontiguousarray(a), np.ascontiguousarray(b), out, n_blocks)
    return out
