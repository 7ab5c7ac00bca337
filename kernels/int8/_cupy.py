"""LLM.int8() on tensor cores, the CUDA C tier (``int8_matmul.cu``, loaded with CuPy's RawModule).

The split matmul as in the Numba-CUDA tier, with the int8 GEMM on mma.sync m16n8k32 (s8 · s8 -> s32, sm_80 and
later; a __dp4a kernel on sm_61 .. sm_75) and the dequantize epilogue fused into its store. The int8 operands
and the int32 product equal the CPU tier's bit for bit.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .._common import cuda_c as _cupy, gpu as _gpu

SOURCE = Path(__file__).with_name("int8_matmul.cu")
ROW_THREADS = 256  # threads per row of the quantizer (a power of two: tree reduction)
FLAT_THREADS = 256
BM, BN, BK = 64, 64, 64  # outputs per block (M × N) and bytes of K per shared stage
K_ALIGN = 16  # K is padded with zeros to a multiple of 16 (16-byte cp.async rows)
NAMES = (f"ioaware::quantize_rows<{ROW_THREADS}>", f"ioaware::gemm_i8_mma<{BM}, {BN}, {BK}>",
         "ioaware::outlier_columns", "ioaware::gemm_i8_dp4a", "ioaware::outlier_gemm")


def _kernel(name):
    return _cupy.kernel(SOURCE, name, NAMES)


def padded(K: int) -> int:
    return -(-K // K_ALIGN) * K_ALIGN


def quantize_weight(w):
    """W (N, K) = (out, in) float32 CuPy -> (w_i8_t (N, K_padded) int8, absmax (N,) float32): one absmax per
    output feature, by the row quantizer with no column skipped."""
    cupy = _cupy.require_cupy()
    N, K = w.shape
    w_i8_t = cupy.empty((N, padded(K)), dtype=cupy.int8)
    absmax = cupy.empty(N, dtype=cupy.float32)
    if N:
        _kernel(f"ioaware::quantize_rows<{ROW_THREADS}>")((N,), (ROW_THREADS,),
                                                          (w, cupy.zeros(K, dtype=cupy.uint8), np.int32(K),
                                                           np.int32(padded(K)), w_i8_t, absmax))
    return w_i8_t, absmax


def gemm(x_i8, w_i8_t, absmax_x, absmax_w, want_int32=False):
    """y = dequantize(X_i8 W_tᵀ) (M, N) float32, and the exact int32 product when ``want_int32``; K padded."""
    cupy = _cupy.require_cupy()
    M, K = x_i8.shape
    N = w_i8_t.shape[0]
    y = cupy.empty((M, N), dtype=cupy.float32)
    c = cupy.empty((M, N), dtype=cupy.int32) if want_int32 else None
    if M * N == 0:
        return y, c
    null = np.uint64(0)  # a null pointer: no int32 product wanted
    args = (x_i8, w_i8_t, np.int32(M), np.int32(N), np.int32(K), absmax_x, absmax_w, y, c if c is not None else null)
    if _cupy.compute_capability() >= 80:  # int8 mma.sync needs sm_80 (PTX ISA, mma: .m16n8k32 .s8 targets)
        blockspergrid = (math.ceil(N / BN), math.ceil(M / BM))
        _kernel(f"ioaware::gemm_i8_mma<{BM}, {BN}, {BK}>")(blockspergrid, (128,), args)
    else:
        _kernel("ioaware::gemm_i8_dp4a")((_gpu.blocks(N, FLAT_THREADS), M), (FLAT_THREADS,), args)
    return y, c


def split_matmul(x, w_i8_t, absmax_w, threshold, w_fp16=None, want_int32=False):
    """The decomposition on CuPy arrays: x (M, K) float32, the quantized weight (K padded); returns
    (y (M, N) float32, outlier column indices (NumPy), the int32 product or None)."""
    cupy = _cupy.require_cupy()
    M, K = x.shape
    N, Kp = w_i8_t.shape
    flags = cupy.zeros(K, dtype=cupy.uint8)
    if threshold > 0 and M:
        _kernel("ioaware::outlier_columns")((_gpu.blocks(K, FLAT_THREADS),), (FLAT_THREADS,),
                                            (x, np.int32(M), np.int32(K), np.float32(threshold), flags))
    x_i8 = cupy.empty((M, Kp), dtype=cupy.int8)
    absmax_x = cupy.empty(M, dtype=cupy.float32)
    if M:
        _kernel(f"ioaware::quantize_rows<{ROW_THREADS}>")((M,), (ROW_THREADS,),
                                                          (x, flags, np.int32(K), np.int32(Kp), x_i8, absmax_x))
    y, c = gemm(x_i8, w_i8_t, absmax_x, absmax_w, want_int32)
    outliers = cupy.flatnonzero(flags).astype(cupy.int32)
    J = int(outliers.size)
    if J and M * N:
        _kernel("ioaware::outlier_gemm")((_gpu.blocks(N, FLAT_THREADS), M), (FLAT_THREADS,),
                                         (x, outliers, np.int32(J), np.int32(K), w_i8_t, np.int32(Kp), absmax_w,
                                          w_fp16 if w_fp16 is not None else np.uint64(0), np.int32(M), np.int32(N), y))
    return y, cupy.asnumpy(outliers), c
