"""LLM.int8() on tensor cores, the CUDA C tier (``int8_matmul.cu``, loaded with CuPy's RawModule).

The split matmul as in the Numba-CUDA tier, with the int8 GEMM on mma.sync m16n8k32 (s8 · s8 -> s32, sm_80 and
later: 128 × 128 tiles, three cp.async stages, ldmatrix fragments; a __dp4a kernel on sm_61 .. sm_75) and the
dequantize epilogue fused into its store; W's outlier rows gathered once into a dense (J, N) float16 array before
the outlier product. The int8 operands and the int32 product equal the CPU tier's bit for bit.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np

from .._common import cuda_c as _cupy, gpu as _gpu

SOURCE = Path(__file__).with_name("int8_matmul.cu")
ROW_THREADS = 256  # threads per row of the quantizer (a power of two: tree reduction)
FLAT_THREADS = 256
BM, BN, BK, STAGES = 128, 128, 64, 3  # outputs per block (M × N), bytes of K per shared stage, stages in flight
GEMM_THREADS = 256  # 8 warps, 2 × 4, each 64 × 32 outputs
OUTLIER_ROWS_PER_BLOCK = 64  # rows of x one block of outlier_columns scans (its grid's y axis covers the rest)
K_ALIGN = 16  # K is padded with zeros to a multiple of 16 (16-byte cp.async rows)
NAMES = (f"ioaware::quantize_rows<{ROW_THREADS}>", f"ioaware::gemm_i8_mma<{BM}, {BN}, {BK}, {STAGES}>",
         "ioaware::outlier_columns", "ioaware::gemm_i8_dp4a", "ioaware::gather_outlier_rows",
         "ioaware::outlier_gemm")


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


def gemm_shared_bytes() -> int:
    """Dynamic shared memory of one GEMM block: STAGES stages of the X and W tiles, rows padded by 16 bytes."""
    return STAGES * (BM + BN) * (BK + 16)


@functools.lru_cache(maxsize=None)
def _gemm_kernel(device: int):
    """The tensor-core GEMM, its dynamic shared-memory limit raised once per device (not per call)."""
    shared_bytes = gemm_shared_bytes()
    _cupy.check_optin_shared_memory(shared_bytes, f"the int8 GEMM's {STAGES} stages of {BM}×{BK} and {BN}×{BK} tiles")
    kernel = _kernel(f"ioaware::gemm_i8_mma<{BM}, {BN}, {BK}, {STAGES}>")
    kernel.max_dynamic_shared_size_bytes = shared_bytes
    return kernel, shared_bytes


def gemm(x_i8, w_i8_t, absmax_x, absmax_w, want_int32=False):
    """y = dequantize(X_i8 W_tᵀ) (M, N) float32, and the exact int32 product when ``want_int32``; K padded."""
    cupy = _cupy.require_cupy()
    M, K = x_i8.shape
    N = w_i8_t.shape[0]
    if K % K_ALIGN:
        raise ValueError(f"x_i8 and w_i8_t need K padded to a multiple of {K_ALIGN} bytes; got K = {K}")
    _cupy.check_launch_array("x_i8", x_i8, np.int8, (M, K))
    _cupy.check_launch_array("w_i8_t", w_i8_t, np.int8, (N, K))
    _cupy.check_launch_array("absmax_x", absmax_x, np.float32, (M,), align=4)
    _cupy.check_launch_array("absmax_w", absmax_w, np.float32, (N,), align=4)
    y = cupy.empty((M, N), dtype=cupy.float32)
    c = cupy.empty((M, N), dtype=cupy.int32) if want_int32 else None
    if M * N == 0:
        return y, c
    null = np.uint64(0)  # a null pointer: no int32 product wanted
    args = (x_i8, w_i8_t, np.int32(M), np.int32(N), np.int32(K), absmax_x, absmax_w, y, c if c is not None else null)
    if _cupy.compute_capability() >= 80:  # int8 mma.sync needs sm_80 (PTX ISA, mma: .m16n8k32 .s8 targets)
        kernel, shared_bytes = _gemm_kernel(cupy.cuda.Device().id)
        blockspergrid = (math.ceil(M / BM), math.ceil(N / BN))  # M tiles on x: its limit is 2^31 − 1
        kernel(blockspergrid, (GEMM_THREADS,), args, shared_mem=shared_bytes)
    else:
        _kernel("ioaware::gemm_i8_dp4a")((M, _gpu.blocks(N, FLAT_THREADS)), (FLAT_THREADS,), args)
    return y, c


def split_matmul(x, w_i8_t, absmax_w, threshold, w_fp16=None, want_int32=False):
    """The decomposition on CuPy arrays: x (M, K) float32, the quantized weight (K padded); returns
    (y (M, N) float32, outlier column indices (NumPy), the int32 product or None)."""
    cupy = _cupy.require_cupy()
    M, K = x.shape
    N, Kp = w_i8_t.shape
    _cupy.check_launch_array("x", x, np.float32, (M, K), align=4)
    _cupy.check_launch_array("absmax_w", absmax_w, np.float32, (N,), align=4)
    if w_fp16 is not None:
        _cupy.check_launch_array("w_fp16", w_fp16, np.float16, (K, N), align=2)
    flags = cupy.zeros(K, dtype=cupy.uint8)
    if threshold > 0 and M:
        blockspergrid = (_gpu.blocks(K, FLAT_THREADS), _gpu.blocks(M, OUTLIER_ROWS_PER_BLOCK))
        _kernel("ioaware::outlier_columns")(blockspergrid, (FLAT_THREADS,),
                                            (x, np.int32(M), np.int32(K), np.int32(OUTLIER_ROWS_PER_BLOCK),
                                             np.float32(threshold), flags))
    x_i8 = cupy.empty((M, Kp), dtype=cupy.int8)
    absmax_x = cupy.empty(M, dtype=cupy.float32)
    if M:
        _kernel(f"ioaware::quantize_rows<{ROW_THREADS}>")((M,), (ROW_THREADS,),
                                                          (x, flags, np.int32(K), np.int32(Kp), x_i8, absmax_x))
    y, c = gemm(x_i8, w_i8_t, absmax_x, absmax_w, want_int32)
    outliers = cupy.flatnonzero(flags).astype(cupy.int32)
    J = int(outliers.size)
    if J and M * N:
        w_o = cupy.empty((J, N), dtype=cupy.float16)  # W's outlier rows, gathered once
        _kernel("ioaware::gather_outlier_rows")((_gpu.blocks(J * N, FLAT_THREADS),), (FLAT_THREADS,),
                                                (outliers, np.int32(J), w_i8_t, np.int32(Kp), absmax_w,
                                                 w_fp16 if w_fp16 is not None else np.uint64(0), np.int32(N), w_o))
        _kernel("ioaware::outlier_gemm")((M, _gpu.blocks(N, FLAT_THREADS)), (FLAT_THREADS,),
                                         (x, outliers, np.int32(J), np.int32(K), w_o, np.int32(M), np.int32(N), y))
    return y, cupy.asnumpy(outliers), c
