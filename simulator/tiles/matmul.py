"""The LLM.int8() split matmul on the two-level ``Machine`` (Dettmers et al. 2022, §3.2): outlier detection,
vector-wise quantization, an int8 GEMM with int32 accumulation and a dequantizing epilogue, and the fp16 GEMM of
the outlier columns, tile by tile with the cost model's 128 × 128 × 32 tiles."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..costs.sizes import check_sizes
from .machine import Machine

STAT_BYTES = 4
GEMM_TILE = (128, 128, 32)  # Bm × Bn output tile, Bk-deep panels (as simulator.costs.matmul)


@dataclass
class Int8Weight:
    """W (n, k) = (out, in), as ``kernels.int8.Int8Weight``, quantized once, offline, with one absmax per output
    feature (a row of W)."""

    w_i8: np.ndarray  # (n, k) int8
    absmax: np.ndarray  # (n,) absmax of each output feature (the tensor the ledger calls scale_w)


def quantize_weight(w) -> Int8Weight:
    """Row-wise absmax int8 of w (n, k): w_i8 = round(127 · w / absmax_row), ties to even (LLM.int8() §3.1)."""
    w = np.asarray(w, dtype=np.float64)
    absmax = np.abs(w).max(axis=1)
    safe = np.where(absmax > 0, absmax, 1.0)
    return Int8Weight(np.rint(127.0 * w / safe[:, None]).astype(np.int8), absmax)


@dataclass
class SplitResult:
    output: np.ndarray
    outlier_cols: np.ndarray
    machine: Machine


def int8_split(x, weights: Int8Weight, *, threshold=6.0, sram_bytes, elem_bytes=2, out_bytes=None,
               tile=GEMM_TILE) -> SplitResult:
    """Y = X·Wᵀ with outlier columns (any |x| >= threshold) in fp16 and the rest in int8; the counted schedule."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or 0 in x.shape:
        raise ValueError(f"x must be a 2-D array (m, k) with m, k >= 1; got shape {x.shape}")
    m, k = x.shape
    n = weights.w_i8.shape[0]
    if weights.w_i8.ndim != 2 or weights.w_i8.shape[1] != k or weights.absmax.shape != (n,):
        raise ValueError(f"weights must be (n, k) int8 with one absmax per row for x (m, k) = {x.shape}; got "
                         f"w_i8 {weights.w_i8.shape}, absmax {weights.absmax.shape}")
    if not np.isfinite(threshold) or threshold < 0:
        raise ValueError(f"threshold must be a finite number >= 0; got {threshold!r}")
    elem_bytes, sram_bytes = (int(s) for s in check_sizes(elem_bytes=elem_bytes, sram_bytes=sram_bytes))
    check_sizes(tile=tile)
    out_bytes = elem_bytes if out_bytes is None else int(check_sizes(out_bytes=out_bytes)[0])
    e = elem_bytes
    mach = Machine(sram_bytes)
    flags = np.zeros(k, dtype=bool)
    x_i8, scale_x = None, np.empty(m)
    y = np.zeros((m, n))

    mach.kernel("outlier_detect")
    for r in range(m):
        row = mach.load("X", x[r], e, slot="row")
        flags |= np.abs(row) >= threshold
    flags_hbm = np.empty(k, dtype=bool)
    mach.store("outlier_cols", flags_hbm, flags, 1)
    outliers = np.flatnonzero(flags_hbm)
    regular = np.flatnonzero(~flags_hbm)
    n_out = outliers.size

    mach.kernel("quantize")
    cols = mach.load("outlier_cols", flags_hbm, 1, slot="flags")
    x_i8 = np.empty((m, regular.size), dtype=np.int8)
    x_o = np.empty((m, n_out))
    for r in range(m):
        row = mach.load("X", x[r], e, slot="row")
        kept = row[~cols]
        absmax = np.abs(kept).max(initial=0.0)
        mach.store("X_i8", x_i8[r], np.rint(127.0 * kept / (absmax if absmax > 0 else 1.0)), 1)
        mach.store("scale_x", scale_x[r:r + 1], absmax, STAT_BYTES)
        mach.store("X_o", x_o[r], row[cols], e)

    bm_t, bn_t, bk_t = tile
    w_regular, w_outlier = weights.w_i8[:, regular].T, weights.w_i8[:, outliers].T  # (k_in, n), (n_out, n) int8

    mach.kernel("int8_gemm")
    k_in = regular.size
    bk = min(bk_t, max(k_in, 1))
    for i0 in range(0, m, min(bm_t, m)):
        i1 = min(i0 + min(bm_t, m), m)
        for j0 in range(0, n, min(bn_t, n)):
            j1 = min(j0 + min(bn_t, n), n)
            mach.alloc("C_ij", STAT_BYTES * (i1 - i0) * (j1 - j0))
            c = np.zeros((i1 - i0, j1 - j0), dtype=np.int64)  # int32 on the device; exact either way here
            for p0 in range(0, k_in, bk):
                p1 = min(p0 + bk, k_in)
                a = mach.load("X_i8", x_i8[i0:i1, p0:p1], 1, slot="A").astype(np.int64)
                bt = mach.load("W_i8", w_regular[p0:p1, j0:j1], 1, slot="B").astype(np.int64)
                c += a @ bt
                mach.compute("int8 mma", 2 * (i1 - i0) * (j1 - j0) * (p1 - p0))
            sx = mach.load("scale_x", scale_x[i0:i1], STAT_BYTES, slot="sx")
            sw = mach.load("scale_w", weights.absmax[j0:j1], STAT_BYTES, slot="sw")
            mach.store("Y", y[i0:i1, j0:j1], c * np.outer(sx, sw) / 127.0**2, out_bytes)

    if n_out:
        mach.kernel("outlier_gemm")
        bk = min(bk_t, n_out)
        for i0 in range(0, m, min(bm_t, m)):
            i1 = min(i0 + min(bm_t, m), m)
            for j0 in range(0, n, min(bn_t, n)):
                j1 = min(j0 + min(bn_t, n), n)
                mach.alloc("C_ij", STAT_BYTES * (i1 - i0) * (j1 - j0))
                sw = mach.load("scale_w", weights.absmax[j0:j1], STAT_BYTES, slot="sw")
                acc = np.zeros((i1 - i0, j1 - j0))
                for p0 in range(0, n_out, bk):
                    p1 = min(p0 + bk, n_out)
                    a = mach.load("X_o", x_o[i0:i1, p0:p1], e, slot="A")
                    b_i8 = mach.load("W_i8", w_outlier[p0:p1, j0:j1], 1, slot="B")
                    acc += a @ (b_i8 * sw / 127.0)  # dequantized on the fly
                    mach.compute("fp16 mma", 2 * (i1 - i0) * (j1 - j0) * (p1 - p0))
                y_ij = mach.load("Y", y[i0:i1, j0:j1], out_bytes, slot="Y_ij")
                mach.store("Y", y[i0:i1, j0:j1], y_ij + acc, out_bytes)
    return SplitResult(y, outliers, mach)
