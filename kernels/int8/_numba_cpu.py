"""LLM.int8() kernels on the CPU with Numba: outlier detection, vector-wise quantization, and an int8 GEMM/GEMV
with exact int32 accumulation (Dettmers et al. 2022, "LLM.int8(): 8-bit Matrix Multiplication for Transformers
at Scale").

The weights are (N, K) = (out, in) int8, as torch stores a Linear's weight, so that every output is a dot product
of two contiguous int8 rows: the same loop serves the GEMM (rows of X against rows of W, tiled so a block of W
stays in L2 while rows of X pass) and the decode GEMV (one row of X against the whole of W, streamed once at
memory bandwidth).

Versions (2-core AMD EPYC (Zen 4) development machine):
  v1 (this file): int8 · int8 widened to int32 and summed in int32 (LLVM vectorizes it), the dequantizing
      epilogue as a separate pass, the outlier product in Numba too (a NumPy matmul there woke OpenBLAS's
      threads, which then spun beside Numba's: +50 ms per GEMM). Int8Linear GEMV 1 x 8192 x 8192 (4 outlier
      dims): 1.99 ms against 7.95 ms for NumPy's float32 GEMV (4.0x; 33.8 GB/s of int8 weights). GEMM
      512 x 4096 x 4096: 117 ms against 86 ms for NumPy's sgemm (0.74x: 146 GOP/s; LLVM emits no VNNI dot
      products from this loop, so an int8 MAC costs about what an fp32 FMA does).
  v2: ``split_gemv``, the whole split matmul for up to 16 rows in one launch (decode: 5 launches and a dozen
      NumPy calls per linear cost more than SmolLM2's small products), its int32 sum kept in an int64 variable
      that is truncated once (an int32 variable made Numba widen every step to int64: 16 int32 lanes became
      8 int64 ones, with a slow 64-bit multiply). Int8Linear GEMV 1 x 8192 x 8192: 1.49 ms against 8.03 ms for
      NumPy's float32 GEMV (5.4x; 45 GB/s of int8 weights; torch's dynamic int8 Linear 1.80 ms).
  v3: the portable fallback: where Numba's target CPU has AVX512-VNNI, ``_vnni`` runs the GEMM and the GEMV on
      ``vpdpbusd`` instead (steps 1-2 and the float epilogue of ``split_gemv`` are shared with it, below).
  v4: elsewhere, where it has AVX2, ``split_gemv``'s row products run on ``vpmaddubsw`` (``_avx2``), and so does the
      GEMM where no activation is −128, which that instruction's sign trick cannot take (``_api._int32_product``
      checks; ``int8_gemm``'s callers may pass it, the quantizer never makes it): this loop runs there.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .._common.numba_cpu import as_float, as_int, round_half, target_features
from . import _avx2

QMAX = 127  # symmetric int8 range (LLM.int8() §3.1)
# An int32 sum of K products of int8 values is exact while K <= floor((2^31 - 1) / 128²): each product is at most
# 128² in magnitude, (−128)·(−128). The quantizer's values stop at ±127, but ``int8_gemm`` and ``Int8Weight`` take
# any int8, and with 127² the bound let K = 133144 products of −128 wrap to a negative sum.
MAX_EXACT_K = (2**31 - 1) // (128 * 128)
COL_BLOCK = 256  # columns per task of the outlier scan: one cache-friendly strip of each row


@njit(parallel=True, cache=True)
def outlier_flags(x, threshold, flags):
    """flags[k] = any_m |x[m, k]| >= threshold, for float32 x (M, K); parallel over strips of columns."""
    M, K = x.shape
    n_strips = (K + COL_BLOCK - 1) // COL_BLOCK
    for strip in prange(n_strips):
        k0 = strip * COL_BLOCK
        k1 = min(k0 + COL_BLOCK, K)
        for k in range(k0, k1):
            flags[k] = False
        for m in range(M):
            for k in range(k0, k1):
                if abs(x[m, k]) >= threshold:
                    flags[k] = True


@njit(parallel=True, cache=True)
def quantize_rows(x, skip, x_i8, absmax):
    """Row-wise absmax quantization of float32 x (M, K) into x_i8 (M, K), leaving out the columns where ``skip``.

    The skipped (outlier) columns get 0 in x_i8, so they add nothing to the int8 product and the weights need no
    gathering. One pass over memory: each row is read once, its absmax taken and its values quantized while it
    is in cache. scale = 127 / absmax (float32), q = round-half-even(x · scale); an all-zero row gives zeros.
    """
    for m in prange(x.shape[0]):
        _quantize_row(x, m, skip, x_i8, absmax)


SIGN_OFF = np.int32(0x7FFFFFFF)  # a float32's bits without its sign: |x|'s bits (IEEE 754 binary32)


@njit(inline="always")
def _quantize_row(x, m, skip, x_i8, absmax):
    """Row m of ``quantize_rows``: absmax over the unskipped columns, then the rounding.

    Without branches, so that both loops vectorize: the absmax is the largest of the magnitudes' bits taken as
    integers (for floats of one sign the bits order as the values do, IEEE 754 §3.4), a skipped column's masked to
    0; its rounded value is masked to 0 the same way. The same values as comparing floats, at half the time (one
    row of SmolLM2's 576 or 1536 features, one thread: 0.43 -> 0.21 us, 1.00 -> 0.52 us; 2-vCPU AMD EPYC, Zen 3).
    A NaN or ±inf in an unskipped column makes the absmax NaN or inf (the largest bits), where the float compare
    passed over a NaN: callers that do not check their input first see it in the scale."""
    top = np.int32(0)
    for k in range(x.shape[1]):  # skip[k] − 1: 0 for a skipped column, all ones for the others
        top = max(top, as_int(x[m, k]) & SIGN_OFF & (np.int32(skip[k]) - np.int32(1)))
    amax = as_float(np.int32(top))
    absmax[m] = amax
    scale = np.float32(QMAX) / amax if amax > 0 else np.float32(0.0)
    for k in range(x.shape[1]):
        x_i8[m, k] = np.int8(np.rint(x[m, k] * scale)) & (np.int8(skip[k]) - np.int8(1))


@njit(parallel=True, fastmath=True, cache=True)
def gemm_i8(x_i8, w_i8_t, out, BM, BN):
    """out[m, n] = Σ_k x_i8[m, k] · w_i8_t[n, k] in int32 (exact for K <= MAX_EXACT_K).

    Tiles of BM rows of X by BN rows of Wᵀ: a tile's BN weight rows stay in L2 while its BM rows of X pass by.
    With M = 1 the loop is the GEMV: each task streams BN weight rows once.
    """
    M, K = x_i8.shape
    N = w_i8_t.shape[0]
    tiles_n = (N + BN - 1) // BN
    tiles_m = (M + BM - 1) // BM
    for tile in prange(tiles_m * tiles_n):
        m0 = (tile // tiles_n) * BM
        n0 = (tile % tiles_n) * BN
        for m in range(m0, min(m0 + BM, M)):
            for n in range(n0, min(n0 + BN, N)):
                acc = np.int32(0)
                for k in range(K):
                    acc += np.int32(x_i8[m, k]) * np.int32(w_i8_t[n, k])
                out[m, n] = acc



@njit(parallel=True, cache=True)
def dequantize(c, absmax_x, absmax_w, out):
    """out[m, n] = C[m, n] · absmax_x[m] · absmax_w[n] / 127² in float32 (the epilogue of the int8 GEMM).

    A pass of its own: fused into ``gemm_i8`` the int32 reduction stopped vectorizing (measured 3.6x slower)."""
    M, N = c.shape
    inv = np.float32(1.0 / (QMAX * QMAX))
    for m in prange(M):
        row_scale = absmax_x[m] * inv
        for n in range(N):
            out[m, n] = np.float32(c[m, n]) * (row_scale * absmax_w[n])


@njit(parallel=True, fastmath=True, cache=True)
def add_outlier_product(x_o, w_o, y):
    """y += x_o · w_o in float32 for the few outlier dimensions (x_o (M, J), w_o (J, N), float16 values held in
    float32). In Numba rather than NumPy so that no BLAS thread pool wakes and spins beside Numba's threads."""
    M, J = x_o.shape
    N = w_o.shape[1]
    for m in prange(M):
        for j in range(J):
            a = x_o[m, j]
            for n in range(N):
                y[m, n] += a * w_o[j, n]


SMALL_M = 16  # rows of X up to which the split matmul runs as one launch (decode steps)
GEMV_BN = 64  # rows of Wᵀ per task of that launch
FLOAT16_MAX_ROUNDABLE = 65520.0  # binary16's largest finite value is 65504; from 65520 on, rounding gives inf
FLOAT16_MIN_NORMAL = 2.0**-14  # below it binary16 is subnormal, in steps of 2^-24 (IEEE 754-2008, binary16)


F16C = "f16c" in target_features()  # the CPU converts float32 to float16 itself (every x86 CPU with AVX2 does)


@njit(inline="always")
def round_to_float16(v):
    """v (float32) rounded to the nearest binary16 value, ties to even, returned as float32: what
    ``np.float32(np.float16(v))`` gives, for Numba, which has no float16 scalars on the CPU. Where the target has
    F16C the CPU's conversion (``round_half``); elsewhere ``round_to_float16_in_software``, the same values (tests
    hold both to NumPy's). The hardware's is ~1.7x faster in the outlier epilogue of the int8 GEMV (7 outliers
    per row, from the cache: 7.1 against 12.0 ns per row on the 2-vCPU Xeon)."""
    if F16C:
        return round_half(v)
    return round_to_float16_in_software(v)


@njit(inline="always")
def round_to_float16_in_software(v):
    """``round_to_float16`` in integer arithmetic. A normal binary16 keeps 10 of float32's 23 fraction bits: add
    half of the dropped 13 bits' range (minus one, plus the lowest kept bit, for ties to even) and clear them; a
    carry moves into the exponent as it should. Subnormal binary16 values are multiples of 2^-24:
    rint(v · 2^24) · 2^-24, exact because the scalings are powers of two."""
    a = abs(v)
    if a != a:
        return v  # NaN stays NaN (rounded as a number, a NaN whose payload is in the 13 dropped bits became inf)
    if a >= np.float32(FLOAT16_MAX_ROUNDABLE):
        return v * np.float32(np.inf)  # ±inf
    if a < np.float32(FLOAT16_MIN_NORMAL):
        return np.rint(v * np.float32(2.0**24)) * np.float32(2.0**-24)
    bits = np.int64(as_int(v))  # (Numba widens int32 arithmetic to int64: do it explicitly, narrow at the end)
    bits = (bits + 0x0FFF + ((bits >> 13) & 1)) & ~np.int64(0x1FFF)  # round, then clear the 13 dropped bits
    return as_float(np.int32(bits))


@njit(inline="always")
def _count_at_least(x, threshold):
    """How many values of x (M, K) have |x| >= threshold."""
    hits = 0
    for m in range(x.shape[0]):
        for k in range(x.shape[1]):
            hits += abs(x[m, k]) >= threshold
    return hits


@njit(inline="always")
def _outlier_columns(x, threshold, flags, cols):
    """Step 1 of ``split_gemv``: flags[k] = any_m |x[m, k]| >= threshold (none for a threshold of 0), their
    indices in cols[:J]; returns J."""
    M, K = x.shape
    # a count first, without branches (LLVM vectorizes it), since most decode inputs have no outlier. One row, 2-vCPU
    # AMD EPYC (Zen 4), in fresh processes: without outliers K = 576 0.80-1.23 -> 0.07 us, K = 1536 2.2-2.6 ->
    # 0.13 us (the scan below alone, a branch per value, took longer than the rest of the quantization); with two or
    # seven, 0.81-0.93 -> 0.81-1.13 us and 2.2-3.4 -> 2.2-2.9 us (the count, then the same scan)
    for k in range(K):
        flags[k] = False
    if not threshold > 0 or _count_at_least(x, threshold) == 0:
        return 0
    # then the flags without branches (this vectorizes too), and their indices in order, eight flags at a time as
    # one uint64, most of which are 0. One row with seven outliers, 2-vCPU AMD EPYC (Zen 3): K = 576 1.29 -> 0.15 us,
    # K = 1536 3.32 -> 0.33 us against a branch per value (a branch per flag after the vectorized flags: 0.63, 0.86)
    for m in range(M):
        for k in range(K):
            flags[k] |= abs(x[m, k]) >= threshold
    whole = K - K % 8
    words = flags[:whole].view(np.uint64)
    J = 0
    for i in range(words.size):
        if words[i]:
            for k in range(8 * i, 8 * i + 8):
                if flags[k]:
                    cols[J] = k
                    J += 1
    for k in range(whole, K):
        if flags[k]:
            cols[J] = k
            J += 1
    return J


@njit(inline="always")
def _gemv_prologue(x, threshold, flags):
    """Steps 1-2 of ``split_gemv``, serial (M·K values): the outlier dimensions (flags, and their indices cols
    (J,)), their float16 values x_o (M, J), and the rows quantized over the others, x_i8 (M, K), absmax_x (M,)."""
    M, K = x.shape
    all_cols = np.empty(K, dtype=np.int64)  # (K,)
    cols = all_cols[:_outlier_columns(x, threshold, flags, all_cols)]  # (J,) the outlier dimensions
    J = cols.size
    x_o = np.empty((M, J), dtype=np.float32)  # (M, J) float16 values
    x_i8 = np.empty((M, K), dtype=np.int8)  # (M, K)
    absmax_x = np.empty(M, dtype=np.float32)  # (M,)
    for m in range(M):
        for j in range(J):
            x_o[m, j] = round_to_float16(x[m, cols[j]])
        _quantize_row(x, m, flags, x_i8, absmax_x)
    return cols, x_o, x_i8, absmax_x


@njit(inline="always")
def _dequantized(c, m, n, absmax_x, absmax_w):
    """The first half of step 3 of ``split_gemv`` for one output: the int32 sum c of row m and output n in float."""
    return np.float32(c) * ((absmax_x[m] * np.float32(1.0 / (QMAX * QMAX))) * absmax_w[n])


@njit(inline="always")
def _plus_outliers(value, m, n, absmax_w, x_o, cols, w_i8_t):
    """The second half: value plus the float16 products of the outlier features cols (J,) of row m, x_o (M, J),
    with output n's weights rounded to float16, in the order of cols."""
    step = absmax_w[n] / np.float32(QMAX)
    for j in range(cols.size):
        value += x_o[m, j] * round_to_float16(np.float32(w_i8_t[n, cols[j]]) * step)
    return value


@njit(inline="always")
def _gemv_output(c, m, n, absmax_x, absmax_w, x_o, cols, w_i8_t):
    """Step 3 of ``split_gemv`` for one output: the int32 sum c dequantized, plus the float16 outlier product.
    Kernels that read several weight rows at once take its two halves apart (``rows._rows_vnni``)."""
    return _plus_outliers(_dequantized(c, m, n, absmax_x, absmax_w), m, n, absmax_w, x_o, cols, w_i8_t)


@njit(inline="always")
def _row_product_loop(x_i8, m, w_i8_t, n):
    """Σ_k x_i8[m, k] · w_i8_t[n, k], exact in int32 (K <= MAX_EXACT_K)."""
    acc = 0  # Numba types it int64; truncated once below, so LLVM sums in int32 lanes
    for k in range(x_i8.shape[1]):
        acc += np.int32(x_i8[m, k]) * np.int32(w_i8_t[n, k])
    return np.int32(acc)


@njit(inline="always")
def _row_product_avx2(x_i8, m, w_i8_t, n):
    """The same sum on ``vpmaddubsw`` (``_avx2.dot``; x_i8 from ``_quantize_row``, so no byte is −128)."""
    K = x_i8.shape[1]
    return _avx2.dot(x_i8, m * K, w_i8_t, n * K, K, 0)


# v4: the product on AVX2 where the target has it (figures in ``_avx2``, v1)
_row_product = _row_product_avx2 if _avx2.AVAILABLE else _row_product_loop


@njit(parallel=True, cache=True)
def split_gemv(x, threshold, w_i8_t, absmax_w, y, flags):
    """The whole split matmul for a few rows of float32 x (M, K) in one launch (decode, where five launches and a
    dozen NumPy calls per linear cost more than the product), for weights stored in int8 only:

    1. outlier dimensions: flags[k] = any_m |x[m, k]| >= threshold (as ``outlier_flags``);
    2. vector-wise quantization of the rows over the regular dimensions (as ``quantize_rows``);
    3. per block of outputs: the exact int32 dot products, the dequantization (as ``dequantize``), and the
       float16 outlier product, x and the int8 weight rows rounded to float16 (the weight dequantized as
       ``Int8Weight.outlier_weights_fp16`` does), added in the order ``add_outlier_product`` adds them.
    Steps 1-2 are serial (M·K values); no fastmath, so that every rounding is the CPU tier's (an approximate
    reciprocal would change the int8 values), and LLVM vectorizes the int32 sum without it."""
    M, K = x.shape
    N = w_i8_t.shape[0]
    cols, x_o, x_i8, absmax_x = _gemv_prologue(x, threshold, flags)
    for block in prange((N + GEMV_BN - 1) // GEMV_BN):
        for n in range(block * GEMV_BN, min(block * GEMV_BN + GEMV_BN, N)):
            for m in range(M):
                y[m, n] = _gemv_output(_row_product(x_i8, m, w_i8_t, n), m, n, absmax_x, absmax_w, x_o, cols, w_i8_t)
