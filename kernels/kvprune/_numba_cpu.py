"""SnapKV scoring on the CPU with Numba: window attention, the sum over window queries and the pooling, fused per
(batch, head) in O(window · N) memory (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before
Generation").

v1: one task per (batch, query head): S = Q_w Kᵀ through BLAS, softmax row by row with the causal mask inside
the window, probabilities of the prefix summed into the head's scores, then pooled.
v2 (this file): each row's max and exp on the vectorized helpers of ``kernels._common.numba_cpu`` (``row_max``,
``exp_row``) instead of a scalar compare loop and ``math.exp``: ``snapkv_compress`` on (1, 9, N, 64) queries
and (1, 3, N, 64) keys, capacity N/4, alternating fresh processes with v1 (3 pairs, 2-vCPU Xeon): N = 16384
32.0-33.2 -> 28.3-28.8 ms, N = 512 1.22-1.29 -> 1.13-1.22 ms.
v3: the two scoring kernels compiled with FASTMATH, as the flash kernel is. The helpers compile with their
caller's flags, so v2's exp had stayed scalar here (an asm audit: no packed operation in it); now it vectorizes.
Alternating with v2 in one process, same shapes, two rounds each: ``snapkv_compress`` N = 512 1.10-1.15 ->
0.98-1.01 ms, N = 4096 7.2-7.7 -> 6.1-6.4 ms, N = 16384 33.1-33.9 -> 28.8-28.9 ms (the kept caches identical);
``h2o_scores`` N = 4096 311-330 -> 249-250 ms.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .._common.numba_cpu import FASTMATH, exp_row, row_max


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def window_scores(q_window, k, scale, out):
    """out[b, h, j] = Σ_i softmax_j(scale · q_i · k_j, causal)_j over the window queries i, for prefix j < N − w.

    q_window (B, Hq, w, d) are the queries at positions N − w .. N − 1; k (B, Hkv, N, d); out (B, Hq, N − w).
    """
    B, Hq, w, d = q_window.shape
    Hkv, N = k.shape[1], k.shape[2]
    group = Hq // Hkv
    prefix = N - w
    for task in prange(B * Hq):
        b = task // Hq
        h = task % Hq
        s = np.dot(q_window[b, h], k[b, h // group].T)  # (w, N)
        out[b, h, :] = 0.0
        for i in range(w):
            n_vis = prefix + i + 1  # query at position N − w + i sees keys 0 .. N − w + i
            row = s[i]  # (N,)
            m = row_max(row, n_vis, -np.inf)
            inv = 1.0 / exp_row(row, row, n_vis, m, scale)  # row[j] ← exp((s − m)·scale); 1 / their sum
            for j in range(prefix):
                out[b, h, j] += row[j] * inv


@njit(parallel=True, cache=True)
def pool(x, kernel_size, use_max, out):
    """Pooling along the last axis of x (R, P): stride 1, padding kernel_size // 2; zeros counted for avg, the
    padding ignored for max (PyTorch's avg_pool1d / max_pool1d with that padding)."""
    R, P = x.shape
    pad = kernel_size // 2
    for r in prange(R):
        for j in range(P):
            lo = max(0, j - pad)
            hi = min(P, j + pad + 1)
            if use_max:
                best = -np.inf
                for t in range(lo, hi):
                    if x[r, t] > best:
                        best = x[r, t]
                out[r, j] = best
            else:
                acc = 0.0
                for t in range(lo, hi):
                    acc += x[r, t]
                out[r, j] = acc / kernel_size


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def accumulated_attention(q, k, scale, block, out):
    """out[b, h, j] = Σ_i softmax_j(scale · q_i · k_j, causal) over every query i (H2O's heavy-hitter score).

    q (B, Hq, N, d), k (B, Hkv, N, d), out (B, Hq, N). One task per (batch, query head); query rows in blocks of
    ``block``, each block's scores S = Q_b K[:r1]ᵀ through BLAS against only the keys it can see (causal), so the
    work is half of the full N × N and the memory O(block · N).
    """
    B, Hq, N, d = q.shape
    group = Hq // k.shape[1]
    for task in prange(B * Hq):
        b = task // Hq
        h = task % Hq
        out[b, h, :] = 0.0
        for r0 in range(0, N, block):
            r1 = min(r0 + block, N)
            s = np.dot(q[b, h, r0:r1], k[b, h // group, :r1].T)  # (rows, r1)
            for i in range(r1 - r0):
                n_vis = r0 + i + 1
                row = s[i]
                m = -np.inf
                for j in range(n_vis):
                    m = max(m, row[j])
                inv = 1.0 / exp_row(row, row, n_vis, m, scale)  # the flash kernel's vectorized exp
                for j in range(n_vis):
                    out[b, h, j] += row[j] * inv
