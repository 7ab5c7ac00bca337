"""Dense float32 layers stored as (out, in), the way checkpoints store them: ``matmul_nt(x, w) = x · wᵀ``.

Many rows (a prefill) go to BLAS on Numba's threads (``kernels._common.blas.batched_matmul``), which reads wᵀ in
place. A few rows (a decode step) go to a Numba GEMV: every output is a dot product of two contiguous rows, split over
Numba's threads. A small product, either way, runs on the calling thread alone (``kernels._common.threads``:
``serial_if_small`` for the GEMV, ``in_parts`` for the prefill, which beside held cores runs a few BLAS blocks at a
time). NumPy's BLAS threads never wake: on 2 cores the two pools spun against each other after every call (SmolLM2
decode, 2-core Zen 4: 28 tokens/s with BLAS on one thread, the products here on two instead of BLAS: see
``benchmarks/test_bench_smollm2.py``).

Versions of the GEMV's row kernel (``gemv_rows``; 2-vCPU Intel Xeon, family 6 model 167, KVM):
  v1: one weight row at a time, a plain loop that LLVM vectorizes.
  v2: four rows at a time (four streams of weights, each load of x serves four rows; ``_rows_loop``): SmolLM2's
      float32 block weights from DRAM on two threads 26.3 -> 31.2 GB/s (see ``_gemv_nt``).
  v3: the same four rows on explicit 512-bit vectors where the target has AVX-512F (``_rows_zmm``; LLVM gives the
      loop 256-bit FMAs there, ``kernels._common.zmm``). 256 MiB of (N, K) weights on two threads, the two paths
      and a plain read (``simulator.calibrate.read_once``) taken in turn, 7 rounds, medians: K = 576 loop
      30.2-30.8 GB/s, zmm 32.5-32.7, read 34.1-35.3 (two runs); K = 1536 loop 29.8, zmm 30.8, read 28.3 (a slow
      phase of this VM's memory; best runs 33.6, 34.8, 33.8). SmolLM2 fp32 ``generate`` of 64 tokens,
      alternating fresh processes with v2: 46.6-52.3 -> 50.1-54.6 tokens/s over six pairs.
  v4: the four rows taken one from each quarter of the range, so that each of the four streams runs through
      consecutive rows instead of the four sharing a few pages (the likely cause: the L2 streamer keeps one
      forward and one backward stream per 4 KiB page, Intel 64 and IA-32 Architectures Optimization Reference
      Manual, "Data Prefetching"). A 2-vCPU Xeon with a 105 MiB L3 (family 6 model 167), 540 MB of (N, K) weights
      on two threads, the paths in turn, 5 rounds, medians: K = 576 21.6 -> 25.7 GB/s and 20.2 -> 23.3, K = 1536
      25.4 -> 27.3 and 23.0 -> 26.1, K = 1024 29.6 -> 25.8 and 27.8 -> 27.8 (a 4 KiB row is a page of its own
      either way). SmolLM2 fp32 ``generate`` of 48 tokens, best of three, alternating fresh processes with v3:
      35.5, 33.3, 36.7, 38.8 -> 39.1, 40.7, 41.5, 39.8 tokens/s over four pairs (read 18-22 GB/s). The outputs are
      bit for bit v3's: each row's sum runs in the same order.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._common.blas import batched_matmul
from ._common.numba_cpu import FASTMATH
from ._common.zmm import AVAILABLE as ZMM_AVAILABLE, LANES, ffma, fload, fload_first, fsum, fzero
from ._common.dtypes import check_float_dtype
from ._common.memory import copy_bytes, ensure_fits
from ._common.threads import serial_if_small

GEMV_ROWS = 16  # rows of x up to which the Numba GEMV is used
BLOCK_N = 64  # output features per task
ROWS_AT_ONCE = 4  # weight rows a GEMV step reads together, one per quarter of its range: four sequential
# streams, each load of x serves four rows


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
    kernels.InsufficientMemoryError
        A result (and float32 copies of the inputs) that would not fit the machine's memory, before anything runs.
    """
    for name, a in (("x", x), ("w", w)):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray; got {type(a).__name__}")
        check_float_dtype(name, a)
        if a.ndim != 2:
            raise ValueError(f"{name} must be 2-D; got shape {a.shape}")
    if x.shape[1] != w.shape[1] or x.shape[1] == 0:
        raise ValueError(f"x (M, K) and w (N, K) must share a K >= 1; got x {x.shape}, w {w.shape}")
    M, N = x.shape[0], w.shape[0]
    copies = copy_bytes((x, w), np.float32)
    ensure_fits(4 * M * N + copies, f"matmul_nt's ({M}, {N}) float32 result and float32 copies of x, w")
    w = np.ascontiguousarray(w, dtype=np.float32)
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    if M > GEMV_ROWS:  # on the calling thread when small; beside held cores in parts (``batched_matmul``)
        return batched_matmul(x32[None], w[None], transpose_b=True, parts=True)[0]
    out = np.empty((M, N), dtype=np.float32)
    with serial_if_small(multiply_adds=M * N * x.shape[1]):  # a small product on the calling thread
        _gemv_nt(x32, w, out)
    return out


@njit(fastmath=True, cache=True)
def _rows_loop(x, w, y, n0, n1):
    """y[n] = Σ_k x[k] · w[n, k] for n in [n0, n1): four rows at a time, one from each quarter of the range (four
    streams of weights, each a sequential run through its quarter; each load of x used four times); fastmath lets
    the sums vectorize. The portable path of ``gemv_rows``."""
    K = x.size
    q = (n1 - n0) // ROWS_AT_ONCE  # rows per quarter
    for n in range(n0, n0 + q):
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for k in range(K):
            xk = x[k]
            a0 += xk * w[n, k]
            a1 += xk * w[n + q, k]
            a2 += xk * w[n + 2 * q, k]
            a3 += xk * w[n + 3 * q, k]
        y[n], y[n + q], y[n + 2 * q], y[n + 3 * q] = a0, a1, a2, a3
    for m in range(n0 + ROWS_AT_ONCE * q, n1):
        acc = np.float32(0.0)
        for k in range(K):
            acc += x[k] * w[m, k]
        y[m] = acc


@njit(fastmath=FASTMATH, inline="always")
def _dot_zmm(x, flat, p, K):
    """Σ_k x[k] · flat[p + k] over K floats, 16 lanes at a time, the tail by a masked load."""
    acc = fzero()
    k = 0
    while k + LANES <= K:
        acc = ffma(fload(x, k), fload(flat, p + k), acc)
        k += LANES
    if k < K:
        acc = ffma(fload_first(x, k, K - k), fload_first(flat, p + k, K - k), acc)
    return fsum(acc)


@njit(fastmath=FASTMATH, cache=True)
def _rows_zmm(x, w, y, n0, n1):
    """``_rows_loop`` on explicit 512-bit vectors (``kernels._common.zmm``): per 16 floats of x, one load of x and
    four fused multiply-adds with the vectors of four rows, one from each quarter of the range, into four partial
    sums; a row's last K mod 16 floats by a masked load, which reads nothing past them. AVX-512F targets only."""
    K = x.size
    flat = w.reshape(-1)  # one view (each view counts a reference: see kernels/decode/_step.py, v4)
    q = (n1 - n0) // ROWS_AT_ONCE  # rows per quarter
    for n in range(n0, n0 + q):
        a0, a1, a2, a3 = fzero(), fzero(), fzero(), fzero()
        p0 = n * K
        p1, p2, p3 = p0 + q * K, p0 + 2 * q * K, p0 + 3 * q * K
        k = 0
        while k + LANES <= K:
            xv = fload(x, k)
            a0 = ffma(xv, fload(flat, p0 + k), a0)
            a1 = ffma(xv, fload(flat, p1 + k), a1)
            a2 = ffma(xv, fload(flat, p2 + k), a2)
            a3 = ffma(xv, fload(flat, p3 + k), a3)
            k += LANES
        if k < K:
            tail = K - k
            xv = fload_first(x, k, tail)
            a0 = ffma(xv, fload_first(flat, p0 + k, tail), a0)
            a1 = ffma(xv, fload_first(flat, p1 + k, tail), a1)
            a2 = ffma(xv, fload_first(flat, p2 + k, tail), a2)
            a3 = ffma(xv, fload_first(flat, p3 + k, tail), a3)
        y[n], y[n + q], y[n + 2 * q], y[n + 3 * q] = fsum(a0), fsum(a1), fsum(a2), fsum(a3)
    for m in range(n0 + ROWS_AT_ONCE * q, n1):
        y[m] = _dot_zmm(x, flat, m * K, K)


# gemv_rows(x, w, y, n0, n1): y[n] = Σ_k x[k] · w[n, k] for n in [n0, n1), float32 x (K,), w (N, K) C-contiguous,
# y (N,): a range of a GEMV's outputs, for a fused step that schedules the ranges itself (kernels.decode). The path
# is fixed at import from the target's features (the tests call both directly)
USE_ZMM = ZMM_AVAILABLE
gemv_rows = _rows_zmm if USE_ZMM else _rows_loop
