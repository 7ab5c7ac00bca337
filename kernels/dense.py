"""Dense float32 layers stored as (out, in), the way checkpoints store them: ``matmul_nt(x, w) = x · wᵀ``.

Many rows (a prefill) go to BLAS on Numba's threads (``kernels._common.blas.batched_matmul``), which reads wᵀ in
place. A few rows (a decode step) go to a Numba GEMV: every output is a dot product of two contiguous rows, split over
Numba's threads (on the calling thread alone when it is small: ``kernels._common.threads``). Either way NumPy's BLAS
threads never wake: on 2 cores the two pools spun against each other
after every call (SmolLM2 decode, 2-core Zen 4: 28 tokens/s with BLAS on one thread,
the products here on two instead of BLAS: see ``benchmarks/test_bench_smollm2.py``).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._common.blas import batched_matmul
from ._common.dtypes import check_float_dtype
from ._common.threads import serial_if_small

GEMV_ROWS = 16  # rows of x up to which the Numba GEMV is used
BLOCK_N = 64  # output features per task


@njit(parallel=True, fastmath=True, cache=True)
def _gemv_nt(x, w, out):
    """out[m, n] = Σ_k x[m, k] · w[n, k] for float32 x (M, K), w (N, K); fastmath lets the sums vectorize. Each
    row of x through ``gemv_rows`` (four weight rows at a time), block by block of BLOCK_N outputs: SmolLM2's
    float32 block weights streamed from DRAM on two threads at 26.3 GB/s one weight row at a time, 31.2 four at
    a time (2-vCPU Xeon, side by side in one process). ``matmul_nt`` of 4096 → 4096 on 8 layers called in turn,
    alternating fresh processes with one row at a time (3 pairs): 2.91-2.94 -> 2.08-2.17 ms for one row of x,
    6.94-7.24 -> 5.52-5.63 ms for eight."""
    M = x.shape[0]
    N = w.shape[0]
    for block in prange((N + BLOCK_N - 1) // BLOCK_N):
        n0 = block * BLOCK_N
        for m in range(M):
            gemv_rows(x[m], w, out[m], n0, min(n0 + BLOCK_N, N))


def matmul_nt(x, w):
    """x (M, K) · wᵀ for a float32 weight w (N, K) stored (out, in); returns float32 (M, N).

    Parameters
    ----------
    x : ndarray (M, K), float16/32/64 (computed in float32)
    w : ndarray (N, K), float16/32/64; float32 C-contiguous is used in place, anything else is converted (a copy
        per call: keep model weights in float32)

    Returns
    -------
    ndarray (M, N), float32

    Raises
    ------
    TypeError, ValueError
        Non-arrays, non-float dtypes, arrays that are not 2-D, a K that differs, an empty K.
    """
    for name, a in (("x", x), ("w", w)):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray; got {type(a).__name__}")
        check_float_dtype(name, a)
        if a.ndim != 2:
            raise ValueError(f"{name} must be 2-D; got shape {a.shape}")
    if x.shape[1] != w.shape[1] or x.shape[1] == 0:
        raise ValueError(f"x (M, K) and w (N, K) must share a K >= 1; got x {x.shape}, w {w.shape}")
    w = np.ascontiguousarray(w, dtype=np.float32)
    if x.shape[0] > GEMV_ROWS:
        x32 = np.ascontiguousarray(x, dtype=np.float32)
        return batched_matmul(x32[None], np.ascontiguousarray(w)[None], transpose_b=True)[0]
    out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    with serial_if_small(multiply_adds=out.size * w.shape[1]):  # M·N·K: a small product on the calling thread
        _gemv_nt(np.ascontiguousarray(x, dtype=np.float32), w, out)
    return out


@njit(fastmath=True, cache=True)
def gemv_rows(x, w, y, n0, n1):
    """y[n] = Σ_k x[k] · w[n, k] for n in [n0, n1): float32 x (K,), w (N, K), y (N,) — a range of a GEMV's outputs
    for a fused step that schedules the ranges itself (``kernels.decode``); four rows at a time (four streams of
    weights, each load of x used four times); fastmath lets the sums vectorize."""
    K = x.size
    n = n0
    while n + 4 <= n1:
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for k in range(K):
            xk = x[k]
            a0 += xk * w[n, k]
            a1 += xk * w[n + 1, k]
            a2 += xk * w[n + 2, k]
            a3 += xk * w[n + 3, k]
        y[n], y[n + 1], y[n + 2], y[n + 3] = a0, a1, a2, a3
        n += 4
    for m in range(n, n1):
        acc = np.float32(0.0)
        for k in range(K):
            acc += x[k] * w[m, k]
        y[m] = acc
