"""LLM.int8()'s decode GEMV in pieces that a fused step can schedule itself: ``prepare`` quantizes one activation
vector into buffers the caller owns, and ``int8_rows`` computes any range of outputs from them (where the products
run on ``vpdpbusd``, the fused decode step reads its weights in panels instead, ``kernels.int8.panels``, from the
same prepared buffers). Run one after the other they give what ``Int8Linear`` gives for one row of x (weights kept
in int8 only), bit for bit: the outlier scan, the rounding and the float epilogue are ``split_gemv``'s own code
(``_numba_cpu``; on the ``vpdpbusd`` and ``vpmaddubsw`` paths the outlier products run 16 outputs at a time,
``_vnni.plus_outliers16``, with the same operations in each lane), and the int32 products are exact on every path.

The int32 products take the offset form of ``_vnni`` on both paths: Σ_k x·w = Σ_k (x + 128)·w − 128·Σ_k w, from
the unsigned activations and the weight's row sums, so one prepared buffer serves both (where the target has AVX2 the
portable path runs on ``vpmaddubsw``, ``_rows_avx2``, from the same buffer flipped back). The path is chosen by the
type of ``path``: ``path_marker(True)`` (an empty uint8 array) selects ``vpdpbusd``, ``path_marker(False)`` (an
empty int8 array) the portable loop; only the selected path is compiled, so the ``vpdpbusd`` code is never built
for a CPU without AVX512-VNNI.

Buffers of ``prepare`` for an input of K features: ``flags`` (K,) bool, ``cols`` (K,) int64, ``x_o`` (1, K)
float32, ``x_u8`` (1, ``padded_k(K)``) uint8, ``absmax_x`` (1,) float32; it returns J, the number of outlier
features (their indices are cols[:J], their float16 values x_o[0, :J]).
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from .._common.prefetch import prefetch_rows, row_prefetch_rows
from ..cpuinfo import cpu_vendor
from . import _avx2
from ._numba_cpu import F16C, _dequantized, _gemv_output, _outlier_columns, _quantize_row, round_to_float16
from ._vnni import (LANES, OFFSET, VECTOR_BYTES, _corrected, _dot_row, _offset_row, plus_outliers16, vdpbusd, vload,
                    vload_first, vsum, vzero)


@njit(cache=True)
def padded_k(K: int) -> int:
    """Bytes of ``x_u8``'s row for K features: K rounded up to a 64-byte vector (``_vnni._dot_row`` reads whole
    vectors of it)."""
    return (K + VECTOR_BYTES - 1) // VECTOR_BYTES * VECTOR_BYTES


def path_marker(use_vnni: bool | None = None) -> np.ndarray:
    """The ``path`` argument of ``int8_rows``: its dtype selects the product's path at compile time. By default
    the path ``Int8Linear`` takes now (``vpdpbusd`` where the CPU has it; tests force either)."""
    if use_vnni is None:
        from . import _api

        use_vnni = _api.USE_VNNI
    return np.empty(0, dtype=np.uint8 if use_vnni else np.int8)


@njit(cache=True)
def prepare(x, threshold, flags, cols, x_o, x_u8, absmax_x):
    """Steps 1-2 of ``split_gemv`` for x (1, K) float32: the outlier features (|x| >= threshold; none for a
    threshold of 0) with their float16 values, and the regular features quantized (vector-wise absmax) and offset
    by +128 into x_u8. Returns J."""
    J = _outlier_columns(x, threshold, flags, cols)
    for j in range(J):
        x_o[0, j] = round_to_float16(x[0, cols[j]])
    _quantize_row(x, 0, flags, x_u8, absmax_x)  # the two's complement bytes of the int8 values
    _offset_row(x_u8, 0, x.shape[1])
    return J


ROWS_AT_ONCE = 4  # weight rows a product step reads together, one per quarter of its range: four streams, and
# each load of x serves four rows
ROW_PREFETCH = row_prefetch_rows(cpu_vendor())  # the ``ahead`` that this CPU's callers pass (0 on AMD: see there)
BLOCK_BYTES = 64 * 1024  # weight bytes of a block of rows whose outputs are finished together after their products:
# their rows are still in L2 for the outlier products (a quarter of the smallest L2 per core of current x86
# server cores, 256 KiB and up)


@njit(cache=True)
def _rows_vnni(x_u8, J, cols, x_o, absmax_x, w_i8, absmax_w, w_row_sums, y, n0, n1, ahead):
    outlier_x, outlier_cols = x_o[:, :J], cols[:J]  # views made once: each view counts a reference to its array,
    # an atomic update of a line that every thread's view of it shares
    K, flat = w_i8.shape[1], w_i8.reshape(-1)  # the flat view made once (see prefetch_rows)
    sums = y.view(np.int32)  # a block's int32 sums, then its outputs in their place
    full = K - K % VECTOR_BYTES
    # four rows at once, one from each quarter of the range: each stream runs through consecutive rows (as in
    # kernels.dense, v4). 2-vCPU Xeon with a 105 MiB L3, 135 MiB of int8 rows on two threads, in turn with four
    # adjacent rows, 7 rounds: K = 576 14.6-16.4 -> 17.0-19.7 GB/s, K = 1536 11.4-16.9 -> 19.0-21.0; SmolLM2's
    # int8 + int8 head ``generate``, alternating fresh processes: 83.3-88.3 -> 83.0-96.6 tokens/s over four pairs
    q = (n1 - n0) // ROWS_AT_ONCE  # rows per quarter
    for r in range(ROWS_AT_ONCE if ahead else 0):
        prefetch_rows(flat, K, n0 + r * q, n0 + (r + 1) * q, ahead)
    # Written out in the loop, not through inlined helpers: a helper that takes arrays and has a loop or a branch
    # counts a reference on each array per call (NRT_incref/decref, atomic updates of a line that both threads
    # share), which Numba's refcount pruning keeps. Per group of four rows the dot products' helper made two of
    # each, the dequantization's (with its loop over outlier features) three and two per output; the latter
    # streamed 256 MiB at K = 576 on two threads at 24.1-25.4 against 28.5-30.4 GB/s (2-vCPU Xeon, side by side),
    # and SmolLM2's int8 + int8 head step took 0.905-0.986 (median 0.965) of its time without it, alternating in
    # one process (10 rounds of 10 calls).
    # The outputs of a block of rows are finished after the block's products, a quarter at a time: the product
    # loop then reads the four weight streams and writes four sums, nothing else. Dequantized per group of four
    # rows instead, the scales, row sums and outputs of four quarters made twelve more streams of a few bytes per
    # row. 300 MB of rows from DRAM on two threads, no prefetch, that way and this one in turn in one process, 5
    # rounds (2-vCPU AMD EPYC, Zen 4): K = 576 23.1-25.4 -> 28.5-30.5 GB/s in four rounds (22.7 in one), with two
    # outlier features 18.7-35.7 -> 23.6-29.7 (the VM's speed moved); K = 1536 23.9-25.9 -> 23.6-28.4, with
    # two outliers 22.5-24.2 -> 22.4-27.7. Bit for bit the same outputs.
    block = max(1, BLOCK_BYTES // (ROWS_AT_ONCE * K))  # rows per quarter
    for b0 in range(n0, n0 + q, block):
        b1 = min(b0 + block, n0 + q)
        for n in range(b0, b1):
            for r in range(ROWS_AT_ONCE if ahead else 0):  # each quarter's row ``ahead`` rows on (_common.prefetch)
                prefetch_rows(flat, K, n + r * q + ahead, n0 + (r + 1) * q, 1)
            # four rows at once, one from each quarter: four streams, and each load of x serves four rows (wrapped
            # int32 sums of (x + 128)·w)
            a0, a1, a2, a3 = vzero(), vzero(), vzero(), vzero()
            p0 = n * K
            p1, p2, p3 = p0 + q * K, p0 + 2 * q * K, p0 + 3 * q * K
            for k in range(0, full, VECTOR_BYTES):
                xv = vload(x_u8, k)
                a0 = vdpbusd(a0, xv, vload(flat, p0 + k))
                a1 = vdpbusd(a1, xv, vload(flat, p1 + k))
                a2 = vdpbusd(a2, xv, vload(flat, p2 + k))
                a3 = vdpbusd(a3, xv, vload(flat, p3 + k))
            if full < K:
                xv, tail = vload(x_u8, full), K - full
                a0 = vdpbusd(a0, xv, vload_first(flat, p0 + full, tail))
                a1 = vdpbusd(a1, xv, vload_first(flat, p1 + full, tail))
                a2 = vdpbusd(a2, xv, vload_first(flat, p2 + full, tail))
                a3 = vdpbusd(a3, xv, vload_first(flat, p3 + full, tail))
            sums[n], sums[n + q], sums[n + 2 * q], sums[n + 3 * q] = vsum(a0), vsum(a1), vsum(a2), vsum(a3)
        # _gemv_output's two halves taken apart: the block's outputs dequantized, then the outlier products only
        # where there is an outlier feature (most of a token's linears meet none), their weights still in L2
        for r in range(ROWS_AT_ONCE):
            for m in range(b0 + r * q, b1 + r * q):
                y[m] = _dequantized(_corrected(sums[m], w_row_sums[m]), 0, m, absmax_x, absmax_w)
            if J:  # 16 outputs at a time, bit for bit the scalar ``_plus_outliers``. SmolLM2's int8 head (49152 ×
                # 576) with 7 outlier features on one thread (``gemv``), alternating in one process, 8 rounds of
                # 15 calls (2-vCPU AMD EPYC, Zen 4): scalar 2.53-2.80 ms, this 1.97-2.30, faster in every round
                for m in range(b0 + r * q, b1 + r * q, LANES):
                    plus_outliers16(y, m, min(LANES, b1 + r * q - m), absmax_w, x_o, cols, J, flat, m * K, K, 4)
    for m in range(n0 + ROWS_AT_ONCE * q, n1):  # the last n1 − n0 mod 4 rows (at most three a call)
        c = _corrected(_dot_row(x_u8, 0, w_i8, m), w_row_sums[m])
        y[m] = _gemv_output(c, 0, m, absmax_x, absmax_w, outlier_x, outlier_cols, w_i8)


@njit(cache=True)
def _rows_avx2(x_u8, J, cols, x_o, absmax_x, w_i8, absmax_w, w_row_sums, y, n0, n1, ahead):
    """``_rows_vnni``'s schedule (four rows at once, one from each quarter of the range; a block's outputs finished
    after its products) with the products on ``vpmaddubsw`` (``_avx2``): the sums are Σ x·w themselves (the offset
    bytes flipped back), the last K mod 32 bytes of each row summed one by one, the outlier products 16 outputs at
    a time as there (``_vnni.plus_outliers16``: LLVM's generic vectors, two ymm registers per 16 lanes here).

    Four streams against one row at a time (``_avx2.dot`` per row), 2-vCPU AMD EPYC (Zen 3, KVM), 256 MiB of int8
    rows from DRAM, the products alone, best of 3, four rounds in turn with a plain all-core read
    (``simulator.calibrate.read_once``): K = 576 on two threads 20.1-27.9 -> 28.5-32.4 GB/s (read 28.6-30.3), on
    one 16.7-17.3 -> 23.2-24.4 (read 20.9-21.5); K = 1536 on two 22.5-28.7 -> 28.0-30.6 (read 28.2-30.8). The
    outlier products on 16 lanes against the scalar ``_plus_outliers``: SmolLM2's int8 head (49152 × 576) on one
    thread, fresh processes in turn, three rounds of 30 calls, their time beyond the call without outliers: seven
    outlier features 0.47-0.59 -> 0.35-0.39 ms, three 0.26-0.32 -> 0.20-0.27 (the whole decode step: within its
    noise)."""
    outlier_x, outlier_cols = x_o[:, :J], cols[:J]  # views made once (see _rows_vnni)
    K, flat = w_i8.shape[1], w_i8.reshape(-1)
    sums = y.view(np.int32)  # a block's int32 sums, then its outputs in their place
    full = K - K % _avx2.VECTOR_BYTES
    q = (n1 - n0) // ROWS_AT_ONCE  # rows per quarter
    for r in range(ROWS_AT_ONCE if ahead else 0):
        prefetch_rows(flat, K, n0 + r * q, n0 + (r + 1) * q, ahead)
    block = max(1, BLOCK_BYTES // (ROWS_AT_ONCE * K))  # rows per quarter
    for b0 in range(n0, n0 + q, block):
        b1 = min(b0 + block, n0 + q)
        for n in range(b0, b1):
            for r in range(ROWS_AT_ONCE if ahead else 0):
                prefetch_rows(flat, K, n + r * q + ahead, n0 + (r + 1) * q, 1)
            # four rows at once, one from each quarter; each load of x (flipped back to int8) serves four rows
            a0, a1, a2, a3 = _avx2.yzero(), _avx2.yzero(), _avx2.yzero(), _avx2.yzero()
            p0 = n * K
            p1, p2, p3 = p0 + q * K, p0 + 2 * q * K, p0 + 3 * q * K
            for k in range(0, full, _avx2.VECTOR_BYTES):
                xv = _avx2.yflip(_avx2.yload(x_u8, k))
                a0 = _avx2.ydot(a0, xv, _avx2.yload(flat, p0 + k))
                a1 = _avx2.ydot(a1, xv, _avx2.yload(flat, p1 + k))
                a2 = _avx2.ydot(a2, xv, _avx2.yload(flat, p2 + k))
                a3 = _avx2.ydot(a3, xv, _avx2.yload(flat, p3 + k))
            t0 = t1 = t2 = t3 = 0  # the last K mod 32 products, in int64, wrapped with the rest
            for k in range(full, K):
                xk = np.int64(x_u8[0, k]) - OFFSET
                t0 += xk * flat[p0 + k]
                t1 += xk * flat[p1 + k]
                t2 += xk * flat[p2 + k]
                t3 += xk * flat[p3 + k]
            sums[n] = np.int32(_avx2.ysum(a0) + t0)
            sums[n + q] = np.int32(_avx2.ysum(a1) + t1)
            sums[n + 2 * q] = np.int32(_avx2.ysum(a2) + t2)
            sums[n + 3 * q] = np.int32(_avx2.ysum(a3) + t3)
        for r in range(ROWS_AT_ONCE):  # the block's outputs, their weights still in L2 for the outlier products
            for m in range(b0 + r * q, b1 + r * q):
                y[m] = _dequantized(sums[m], 0, m, absmax_x, absmax_w)
            if J:
                for m in range(b0 + r * q, b1 + r * q, LANES):
                    plus_outliers16(y, m, min(LANES, b1 + r * q - m), absmax_w, x_o, cols, J, flat, m * K, K, 4)
    for m in range(n0 + ROWS_AT_ONCE * q, n1):  # the last n1 − n0 mod 4 rows (at most three a call)
        c = _avx2.dot(x_u8, 0, flat, m * K, K, OFFSET)
        y[m] = _gemv_output(c, 0, m, absmax_x, absmax_w, outlier_x, outlier_cols, w_i8)


@njit(cache=True)
def _rows_loop(x_u8, J, cols, x_o, absmax_x, w_i8, absmax_w, w_row_sums, y, n0, n1, ahead):
    K = w_i8.shape[1]
    outlier_x, outlier_cols = x_o[:, :J], cols[:J]  # once (see _rows_vnni)
    for n in range(n0, n1):
        acc = 0  # Σ (x + 128)·w, exact in int64; LLVM sums it in vector lanes
        for k in range(K):
            acc += np.int32(x_u8[0, k]) * np.int32(w_i8[n, k])
        c = _corrected(np.int32(acc), w_row_sums[n])
        y[n] = _gemv_output(c, 0, n, absmax_x, absmax_w, outlier_x, outlier_cols, w_i8)


def int8_rows(path, x_u8, J, cols, x_o, absmax_x, w_i8, absmax_w, w_row_sums, y, n0, n1, ahead):
    """y[n0:n1] = the split product of the prepared vector with rows n0..n1-1 of the int8 weight (N, K), its
    absmax (N,) and row sums (N,) int32; y float32. ``ahead``: how many rows ahead the ``vpdpbusd`` path asks for
    the rows of each of its four streams (0: not at all; callers pass ``ROW_PREFETCH``); it changes no value.
    Numba code only (an ``overload`` on ``path``'s dtype)."""
    raise NotImplementedError("int8_rows is called from Numba code")


@overload(int8_rows)
def _int8_rows_overload(path, x_u8, J, cols, x_o, absmax_x, w_i8, absmax_w, w_row_sums, y, n0, n1, ahead):
    if not isinstance(path, types.Array):
        return None
    if path.dtype == types.uint8:
        rows = _rows_vnni
    else:  # the portable path: on vpmaddubsw where the target has AVX2 (and F16C, for plus_outliers16's rounding:
        # without it LLVM calls a conversion routine that Numba's JIT does not resolve, ``round_half``)
        rows = _rows_avx2 if _avx2.AVAILABLE and F16C else _rows_loop

    def impl(path, x_u8, J, cols, x_o, absmax_x, w_i8, absmax_w, w_row_sums, y, n0, n1, ahead):
        rows(x_u8, J, cols, x_o, absmax_x, w_i8, absmax_w, w_row_sums, y, n0, n1, ahead)

    return impl


@njit(cache=True)
def gemv(path, x, threshold, w_i8, absmax_w, w_row_sums, y, flags, ahead):
    """``Int8Linear`` on one vector x (1, K) float32 with the weight kept in int8 only, on the calling thread, where
    the rows' prefetch is on (``ROW_PREFETCH``; elsewhere ``Int8Linear`` runs ``split_gemv`` there: ``_api``):
    ``prepare``, then ``int8_rows`` over all N outputs (``ahead`` as there); y (N,) float32, flags (K,) bool (the
    outlier features). Bit for bit ``split_gemv``'s result (the same scan, rounding and epilogue; exact int32
    products), with the row kernel's four streams: 2-vCPU AMD EPYC (Zen 4, 32 MiB L3), K = N = 2048, each call on
    another of 512 weights (from DRAM, as decode meets its layers), alternating three rounds of 21 calls: the
    ``split_gemv`` of then (four adjacent rows at once, ``_vnni`` v2) 0.51-0.53 ms median (7.9-8.3 GB/s of int8
    weights; NumPy's float32 GEMV of the same weights streamed: 0.45 ms), this 0.39-0.40 ms (10.5-10.8 GB/s) with
    the rows' prefetch; without it (``ahead`` = 0), alternating five rounds of 128 weights with it: 0.27-0.30 ms
    against 0.31-0.36 (one round 0.16)."""
    K = x.shape[1]
    cols = np.empty(K, dtype=np.int64)  # (K,) outlier feature indices, the first J used
    x_o = np.empty((1, K), dtype=np.float32)  # (1, K) their float16 values
    x_u8 = np.empty((1, padded_k(K)), dtype=np.uint8)  # (1, K rounded up to 64) offset int8 activations
    absmax_x = np.empty(1, dtype=np.float32)  # (1,)
    J = prepare(x, threshold, flags, cols, x_o, x_u8, absmax_x)
    # (n0 an int64, as the fused decode step passes it: a bare 0 would compile the row kernel once more)
    int8_rows(path, x_u8, J, cols, x_o, absmax_x, w_i8, absmax_w, w_row_sums, y, np.int64(0), w_i8.shape[0], ahead)
