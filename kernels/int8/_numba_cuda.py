"""LLM.int8() on the GPU in Numba-CUDA, the readable tier (Dettmers et al. 2022, §3.2, eq. 7).

The split matmul X Wᵀ, X (M, K) float32 and W (N, K) = (out, in), as five small kernels whose names say their step:

1. ``outlier_columns``: one thread per hidden dimension k flags it when some |x[m, k]| >= threshold (neighbouring
   threads read neighbouring columns of a row: coalesced).
2. ``quantize_rows``: the fused vector-wise quantizer, one block per row of X: the block reduces the row's absmax
   over the regular (unflagged) columns in shared memory, then rounds x · 127 / absmax to int8 in the same kernel
   while the row is hot in L1/L2; flagged columns become 0, so the int8 GEMM needs no gather of W.
   (Detection cannot join this kernel: a column is an outlier if *any* row has a large value, which needs every
   row to be read first — a grid-wide barrier.)
3. ``gemm_i8``: C = X_i8 · W_i8ᵀ with int32 accumulation over T × T shared-memory tiles (W (N, K) = (out, in)
   like the CPU tier, so both tiles load along K).
4. ``dequantize``: the epilogue y = C · absmax_x[m] · absmax_w[n] / 127², the CPU tier's float32 formula.
5. ``outlier_gemm``: y += X[:, O] · W[:, O]ᵀ for the outlier dimensions O in float16 values with float32 sums
   (the few columns are gathered into float16 arrays first by ``gather_outliers``).

Integer results (the int8 operands and the int32 product) equal the CPU tier's bit for bit; quantization uses
round-half-to-even like ``np.rint``.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda  # a module global, which Numba's simulator swaps for its own (this file is imported lazily)

from .._common import gpu as _gpu
from .._common.numba_cuda import block_max, cast
from ._numba_cpu import QMAX

# Under the simulator every thread is a Python thread: smaller blocks there (any power of two works).
MATMUL_TILE = 4 if _gpu.simulated() else 16  # T × T threads per GEMM block
ROW_THREADS = 8 if _gpu.simulated() else 256  # threads per row in quantize_rows (a power of two: tree reduction)
FLAT_THREADS = 32 if _gpu.simulated() else 256  # threads per block of the one-thread-per-element kernels


@functools.lru_cache(maxsize=None)
def _kernels(T: int, THREADS: int):
    f32 = np.float32

    @cuda.jit
    def outlier_columns(x, threshold, flags):
        """flags[k] = any_m |x[m, k]| >= threshold; one thread per column."""
        col = cuda.grid(1)
        if col >= x.shape[1]:
            return
        found = False
        for m in range(x.shape[0]):
            if abs(x[m, col]) >= threshold:
                found = True
        flags[col] = found

    @cuda.jit
    def quantize_rows(x, skip, x_i8, absmax):
        """One block per row: absmax over the unskipped columns (a shared-memory tree reduction), then
        x_i8 = round-half-even(x · 127 / absmax), 0 in the skipped columns; an all-zero row gives zeros."""
        row = cuda.blockIdx.x
        t = cuda.threadIdx.x
        K = x.shape[1]
        red = cuda.shared.array(THREADS, np.float32)
        amax = f32(0.0)
        for col in range(t, K, THREADS):
            a = abs(x[row, col])
            if a > amax and not skip[col]:
                amax = a
        amax = block_max(red, amax)
        scale = f32(QMAX) / amax if amax > 0 else f32(0.0)
        for col in range(t, K, THREADS):
            x_i8[row, col] = 0 if skip[col] else round(x[row, col] * scale)
        if t == 0:
            absmax[row] = amax

    @cuda.jit
    def gemm_i8(x_i8, w_i8, c):
        """c[m, n] = Σ_k x_i8[m, k] · w_i8[n, k] in int32. Grid (⌈N/T⌉, ⌈M/T⌉), T × T threads; T × T tiles of
        both operands in shared memory, stepping over K."""
        M, K = x_i8.shape
        N = w_i8.shape[0]
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        m = cuda.blockIdx.y * T + ty
        n = cuda.blockIdx.x * T + tx
        n_load = cuda.blockIdx.x * T + ty  # the weight row this thread loads into the W tile
        x_s = cuda.shared.array((T, T), np.int32)
        w_s = cuda.shared.array((T, T), np.int32)
        acc = np.int32(0)
        for k0 in range(0, K, T):
            x_s[ty, tx] = x_i8[m, k0 + tx] if m < M and k0 + tx < K else 0
            w_s[ty, tx] = w_i8[n_load, k0 + tx] if n_load < N and k0 + tx < K else 0
            cuda.syncthreads()
            for kk in range(T):
                acc += x_s[ty, kk] * w_s[tx, kk]
            cuda.syncthreads()
        if m < M and n < N:
            c[m, n] = acc

    @cuda.jit
    def dequantize(c, absmax_x, absmax_w, y):
        """y[m, n] = float32(c[m, n]) · (absmax_x[m] / 127² · absmax_w[n]); one thread per element."""
        i = cuda.grid(1)
        N = c.shape[1]
        if i >= c.size:
            return
        m = i // N
        n = i % N
        row_scale = absmax_x[m] * f32(1.0 / (QMAX * QMAX))
        y[m, n] = f32(c[m, n]) * (row_scale * absmax_w[n])

    @cuda.jit
    def gather_outliers(x, w_i8, absmax_w, cols, x_out, w_out):
        """x_out[m, j] = float16(x[m, cols[j]]); w_out[j, n] = float16(w_i8[n, cols[j]] · absmax_w[n] / 127)
        (W's columns of the outlier dimensions dequantized from int8, as ``Int8Weight.outlier_weights_fp16`` does
        without a kept float16 copy). One thread per element of the larger of the two."""
        i = cuda.grid(1)
        M, J = x_out.shape
        N = w_out.shape[1]
        if i < M * J:
            x_out[i // J, i % J] = x[i // J, cols[i % J]]
        if i < J * N:
            j = i // N
            n = i % N
            w_out[j, n] = f32(w_i8[n, cols[j]]) * (absmax_w[n] / f32(QMAX))

    @cuda.jit
    def outlier_gemm(x_out, w_out, y):
        """y[m, n] += Σ_j x_out[m, j] · w_out[j, n]: float16 inputs, float32 sums; one thread per element of y."""
        i = cuda.grid(1)
        N = y.shape[1]
        if i >= y.size:
            return
        m = i // N
        n = i % N
        acc = y[m, n]  # summed in the CPU tier's order: y + x_0 w_0 + x_1 w_1 + ...
        for j in range(x_out.shape[1]):
            acc += f32(x_out[m, j]) * f32(w_out[j, n])
        y[m, n] = acc

    return outlier_columns, quantize_rows, gemm_i8, dequantize, gather_outliers, outlier_gemm



def quantize_weight(w):
    """W (N, K) = (out, in) float32 on the device, one absmax per output feature (the row quantizer, no column
    skipped): (w_i8 (N, K) int8, absmax (N,) float32)."""
    N, K = w.shape
    w_i8 = cuda.device_array((N, K), dtype=np.int8)
    absmax = cuda.device_array(N, dtype=np.float32)
    _gpu.check_static_shared_memory(ROW_THREADS * 4, f"quantize_rows reduction over {ROW_THREADS} threads")
    if N:
        _kernels(MATMUL_TILE, ROW_THREADS)[1][N, ROW_THREADS](w, cuda.to_device(np.zeros(K, dtype=np.bool_)), w_i8,
                                                             absmax)
    return w_i8, absmax


def gemm(x_i8, w_i8):
    """Exact int32 product x_i8 · w_i8ᵀ of device int8 x (M, K) and the weight (N, K)."""
    T = MATMUL_TILE
    _gpu.check_static_shared_memory(2 * T * T * 4, f"int8 GEMM tiles {T}x{T} (int32 in shared memory)")
    M, N = x_i8.shape[0], w_i8.shape[0]
    c = cuda.device_array((M, N), dtype=np.int32)
    if M and N:
        _kernels(T, ROW_THREADS)[2][(math.ceil(N / T), math.ceil(M / T)), (T, T)](x_i8, w_i8, c)
    return c


def split_matmul(x, w_i8, absmax_w, threshold):
    """The decomposition on the device: x (M, K) float32, the quantized weight; returns (y (M, N) float32,
    outlier column indices as a NumPy array)."""
    outlier_columns, quantize_rows, _, dequantize, gather_outliers, outlier_gemm = _kernels(MATMUL_TILE,
                                                                                              ROW_THREADS)
    M, K = x.shape
    N = w_i8.shape[0]
    flags = cuda.device_array(K, dtype=np.bool_)
    if threshold > 0 and M:
        outlier_columns[_gpu.launch_1d(K, FLAT_THREADS)](x, np.float32(threshold), flags)
        outliers = np.flatnonzero(flags.copy_to_host())  # a few indices, compacted on the host
    else:
        flags = cuda.to_device(np.zeros(K, dtype=np.bool_))
        outliers = np.zeros(0, dtype=np.int64)
    x_i8 = cuda.device_array((M, K), dtype=np.int8)
    absmax_x = cuda.device_array(M, dtype=np.float32)
    _gpu.check_static_shared_memory(ROW_THREADS * 4, f"quantize_rows reduction over {ROW_THREADS} threads")
    if M:
        quantize_rows[M, ROW_THREADS](x, flags, x_i8, absmax_x)
    c = gemm(x_i8, w_i8)
    y = cuda.device_array((M, N), dtype=np.float32)
    if M * N:
        dequantize[_gpu.launch_1d(M * N, FLAT_THREADS)](c, absmax_x, absmax_w, y)
    J = outliers.size
    if J and M * N:
        x_out = cuda.device_array((M, J), dtype=np.float16)
        w_out = cuda.device_array((J, N), dtype=np.float16)
        cols = cuda.to_device(outliers)
        gather_outliers[_gpu.launch_1d(max(M * J, J * N), FLAT_THREADS)](x, w_i8, absmax_w, cols, x_out, w_out)
        outlier_gemm[_gpu.launch_1d(M * N, FLAT_THREADS)](x_out, w_out, y)
    return y, outliers


def cast_f32(x):
    """A contiguous float32 device copy of the device array x (x itself when it already is float32)."""
    return cast(x, np.float32)
