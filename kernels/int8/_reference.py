"""Oracles for LLM.int8() (Dettmers et al. 2022), written to be obviously right: NumPy, int64 integer products.

Quantization is defined in float32 arithmetic (scale = 127 / absmax in float32, x · scale in float32, rounded half
to even), the same operations the kernels perform, so that their int8 values can be compared exactly.
"""
from __future__ import annotations

import numpy as np

QMAX = 127  # symmetric int8 range [-127, 127] (LLM.int8() §3.1: -128 is not used)


def quantize_reference(x, axis):
    """Absmax quantization along ``axis``: returns (int8 values, float32 absmax with ``axis`` removed)."""
    x = np.asarray(x, dtype=np.float32)
    absmax = np.abs(x).max(axis=axis, initial=np.float32(0))
    scale = np.where(absmax > 0, np.float32(QMAX) / np.where(absmax > 0, absmax, 1), 0).astype(np.float32)
    q = np.rint(x * np.expand_dims(scale, axis)).astype(np.int8)
    return q, absmax.astype(np.float32)


def outlier_columns_reference(x2d, threshold):
    """Hidden dimensions (columns of x) where any |x| >= threshold; none when threshold == 0 (decomposition off)."""
    if threshold == 0:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero((np.abs(x2d) >= threshold).any(axis=0))


def int8_matmul_reference(x, w, *, threshold=6.0, keep_fp16_weights=False):
    """LLM.int8() matmul x · wᵀ for w (N, K) = (out, in), float64 wherever the algorithm does not prescribe lower
    precision.

    Regular columns: row-wise absmax of x (outlier columns excluded) and of w (one per output feature), int8
    products summed exactly in int64, dequantized by absmax_x ⊗ absmax_w / 127². Outlier columns: x and the
    matching columns of w (dequantized from int8, or the float16 copy with ``keep_fp16_weights``) rounded to
    float16, their product summed in float64. Returns float64 of shape (..., N).
    """
    x = np.asarray(x)
    w = np.asarray(w, dtype=np.float32)
    x2d = x.reshape(-1, x.shape[-1]).astype(np.float32)
    out = outlier_columns_reference(x2d, threshold)
    regular = np.setdiff1d(np.arange(x2d.shape[1]), out)
    w_i8, absmax_w = quantize_reference(w, axis=1)  # (N, K), (N,)
    x_i8, absmax_x = quantize_reference(x2d[:, regular], axis=1)  # (M, K_reg), (M,)
    c = x_i8.astype(np.int64) @ w_i8[:, regular].T.astype(np.int64)  # (M, N), exact
    y = c * (absmax_x.astype(np.float64)[:, None] * absmax_w.astype(np.float64)[None, :]) / QMAX**2
    if out.size:
        if keep_fp16_weights:
            w_out = w[:, out].T.astype(np.float16)  # (J, N)
        else:
            w_out = (w_i8[:, out].T.astype(np.float32) * (absmax_w / np.float32(QMAX))).astype(np.float16)  # (J, N)
        y = y + x2d[:, out].astype(np.float16).astype(np.float64) @ w_out.astype(np.float64)
    return y.reshape(x.shape[:-1] + (w.shape[0],))


def naive_absmax_reference(x, w):
    """x · wᵀ (w (N, K)) with one absmax per tensor for x and for w (the baseline outliers break), int64
    products, float64 result."""
    x = np.asarray(x)
    x2d = x.reshape(-1, x.shape[-1])
    x_i8, ax = quantize_reference(x2d.reshape(1, -1), axis=1)
    w_i8, aw = quantize_reference(np.asarray(w).reshape(1, -1), axis=1)
    c = x_i8.reshape(x2d.shape).astype(np.int64) @ w_i8.reshape(np.shape(w)).T.astype(np.int64)  # (M, N)
    y = c * (float(ax[0]) * float(aw[0]) / QMAX**2)
    return y.reshape(x.shape[:-1] + (np.shape(w)[0],))
