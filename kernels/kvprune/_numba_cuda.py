"""SnapKV on the GPU in Numba-CUDA, the readable tier (Li et al. 2024, §4.2: observation-window voting, pooling,
per-head selection, gather).

1. ``window_row_stats``: one block per window query row: the row's max score and Σ e^{s − max} over the keys it
   sees (causal inside the window), by shared-memory tree reductions.
2. ``window_votes``: one thread per (head, prefix key j): Σ_i e^{s_ij − m_i} / l_i over the window queries i,
   recomputing each score (w · d multiply-adds per key) instead of storing the w × N probabilities.
3. ``pool``: one thread per (head, position): max or average over a centred window (stride 1, padding
   kernel_size // 2, as the CPU tier).
4. ``group_mean``: with ``gqa="mean"``, each kv head's score is the mean of its query heads'.
5. Selection, ``rank_positions`` then ``compact_kept``: the rank of position j is the number of positions that beat
   it (a larger score, or an equal score at a lower position); j is kept when its rank < n_keep, then one thread
   per head writes the kept positions in ascending order. Chosen for this tier because it is exact with the CPU
   tier's tie rule, needs no sort and no shared memory, and reads in two lines; its cost is O(N²) comparisons
   per head (16.8 M at N = 4096: well under a millisecond on a datacenter GPU, but quadratic — the CUDA C tier
   uses a radix select instead).
6. ``gather``: one thread per (head, kept slot, element) copies the kept K and V rows.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda  # a module global, which Numba's simulator swaps for its own (this file is imported lazily)

from .._common import gpu as _gpu
from .._common.numba_cuda import block_max, block_sum

ROW_THREADS = 4 if _gpu.simulated() else 128  # threads per window row (a power of two: tree reductions; simulated,
# fewer barrier levels, as the attention's SOFTMAX_THREADS)
FLAT_THREADS = 32 if _gpu.simulated() else 256


@functools.lru_cache(maxsize=None)
def _kernels(THREADS: int, dtype: str):
    fl = np.dtype(dtype).type
    ftype = np.dtype(dtype)

    @cuda.jit
    def window_row_stats(qw, k, scale, row_max, row_sum):
        """Block (b·Hq + h)·w + i: query i of the window (position N − w + i) against keys 0 .. N − w + i."""
        Hq, w, d = qw.shape[1], qw.shape[2], qw.shape[3]
        Hkv, N = k.shape[1], k.shape[2]
        t = cuda.threadIdx.x
        i = cuda.blockIdx.x % w
        bh = cuda.blockIdx.x // w
        b = bh // Hq
        h = bh % Hq
        hk = h // (Hq // Hkv)
        n_vis = N - w + i + 1
        red = cuda.shared.array(THREADS, ftype)
        m = fl(-math.inf)
        for j in range(t, n_vis, THREADS):
            s = fl(0.0)
            for c in range(d):
                s += qw[b, h, i, c] * k[b, hk, j, c]
            m = max(m, s * scale)
        m = block_max(red, m)
        total = fl(0.0)
        for j in range(t, n_vis, THREADS):
            s = fl(0.0)
            for c in range(d):
                s += qw[b, h, i, c] * k[b, hk, j, c]
            total += math.exp(s * scale - m)
        total = block_sum(red, total)
        if t == 0:
            row_max[b, h, i] = m
            row_sum[b, h, i] = total

    @cuda.jit
    def window_votes(qw, k, scale, row_max, row_sum, out):
        """out[b, h, j] = Σ_i softmax_j(window query i) for prefix keys j < N − w; one thread per (b, h, j)."""
        Hq, w, d = qw.shape[1], qw.shape[2], qw.shape[3]
        Hkv, N = k.shape[1], k.shape[2]
        P = N - w
        idx = cuda.grid(1)
        if idx >= out.shape[0] * Hq * P:
            return
        j = idx % P
        bh = idx // P
        b = bh // Hq
        h = bh % Hq
        hk = h // (Hq // Hkv)
        vote = fl(0.0)
        for i in range(w):  # every window query sees every prefix key
            s = fl(0.0)
            for c in range(d):
                s += qw[b, h, i, c] * k[b, hk, j, c]
            vote += math.exp(s * scale - row_max[b, h, i]) / row_sum[b, h, i]
        out[b, h, j] = vote

    @cuda.jit
    def pool(x, kernel_size, use_max, out):
        """Pooling along the last axis of x (R, P), one thread per element; the padding is ignored by max and
        counted as zeros by avg."""
        idx = cuda.grid(1)
        R, P = x.shape
        if idx >= R * P:
            return
        r = idx // P
        j = idx % P
        pad = kernel_size // 2
        lo = max(0, j - pad)
        hi = min(P, j + pad + 1)
        if use_max:
            best = fl(-math.inf)
            for t in range(lo, hi):
                best = max(best, x[r, t])
            out[r, j] = best
        else:
            acc = fl(0.0)
            for t in range(lo, hi):
                acc += x[r, t]
            out[r, j] = acc / kernel_size

    @cuda.jit
    def group_mean(x, group, out):
        """out[b, g, j] = mean over the group's query heads of x[b, g·group + u, j]; x (B, Hq, P)."""
        idx = cuda.grid(1)
        B, G, P = out.shape
        if idx >= B * G * P:
            return
        j = idx % P
        g = (idx // P) % G
        b = idx // (G * P)
        acc = fl(0.0)
        for u in range(group):
            acc += x[b, g * group + u, j]
        out[b, g, j] = acc / group

    @cuda.jit
    def rank_positions(scores, ranks):
        """ranks[r, j] = #{i : s_i > s_j, or s_i == s_j and i < j} for scores (R, P); one thread per (r, j)."""
        idx = cuda.grid(1)
        R, P = scores.shape
        if idx >= R * P:
            return
        r = idx // P
        j = idx % P
        s = scores[r, j]
        beaten_by = 0
        for i in range(P):
            if scores[r, i] > s or (scores[r, i] == s and i < j):
                beaten_by += 1
        ranks[r, j] = beaten_by

    @cuda.jit
    def compact_kept(ranks, n_keep, tail_start, kept):
        """kept[r, :n_keep] = the positions with rank < n_keep, ascending; then kept[r, n_keep:] = tail_start ..
        (the observation window). One thread per row."""
        r = cuda.grid(1)
        R, P = ranks.shape
        if r >= R:
            return
        slot = 0
        for j in range(P):
            if ranks[r, j] < n_keep:
                kept[r, slot] = j
                slot += 1
        for u in range(kept.shape[1] - n_keep):
            kept[r, n_keep + u] = tail_start + u

    @cuda.jit
    def gather(k, v, kept, k_c, v_c):
        """k_c[b, h, s, :] = k[b, kv(h), kept[b, h, s], :] (and v); kv(h) = h // (H / Hkv)."""
        idx = cuda.grid(1)
        B, H, C, d = k_c.shape
        if idx >= B * H * C * d:
            return
        c = idx % d
        s = (idx // d) % C
        h = (idx // (d * C)) % H
        b = idx // (d * C * H)
        hk = h // (H // k.shape[1])
        pos = kept[b, h, s]
        k_c[b, h, s, c] = k[b, hk, pos, c]
        v_c[b, h, s, c] = v[b, hk, pos, c]

    return window_row_stats, window_votes, pool, group_mean, rank_positions, compact_kept, gather



def snapkv_scores(qw, k, kernel_size, pooling, gqa):
    """Pooled window votes on device arrays qw (B, Hq, w, d), k (B, Hkv, N, d); (B, Hkv or Hq, N − w)."""
    row_stats, votes, pool, group_mean, *_ = _kernels(ROW_THREADS, np.dtype(qw.dtype).name)
    B, Hq, w, d = qw.shape
    Hkv, N = k.shape[1], k.shape[2]
    P = N - w
    _gpu.check_static_shared_memory(ROW_THREADS * np.dtype(qw.dtype).itemsize, "SnapKV window-row reductions")
    scale = np.dtype(qw.dtype).type(1.0 / math.sqrt(d))
    row_max = cuda.device_array((B, Hq, w), dtype=qw.dtype)
    row_sum = cuda.device_array((B, Hq, w), dtype=qw.dtype)
    summed = cuda.device_array((B, Hq, P), dtype=qw.dtype)
    pooled = cuda.device_array((B, Hq, P), dtype=qw.dtype)
    row_stats[B * Hq * w, ROW_THREADS](qw, k, scale, row_max, row_sum)
    votes[_gpu.launch_1d(B * Hq * P, FLAT_THREADS)](qw, k, scale, row_max, row_sum, summed)
    pool[_gpu.launch_1d(B * Hq * P, FLAT_THREADS)](summed.reshape(B * Hq, P), kernel_size, pooling == "max",
                                                   pooled.reshape(B * Hq, P))
    if gqa == "per-query-head":
        return pooled
    mean = cuda.device_array((B, Hkv, P), dtype=qw.dtype)
    group_mean[_gpu.launch_1d(B * Hkv * P, FLAT_THREADS)](pooled, Hq // Hkv, mean)
    return mean


def select_and_gather(scores, k, v, n_keep, window):
    """Keep the top ``n_keep`` prefix positions per head (ties to the lower position) and the window; gather K
    and V for them. scores (B, H, N − w) on the device; returns device arrays (k_c, v_c, kept)."""
    *_, rank_positions, compact_kept, _ = _kernels(ROW_THREADS, np.dtype(k.dtype).name)
    B, H, P = scores.shape
    N = k.shape[2]
    ranks = cuda.device_array((B * H, P), dtype=np.int64)
    kept = cuda.device_array((B, H, n_keep + window), dtype=np.int64)
    rank_positions[_gpu.launch_1d(B * H * P, FLAT_THREADS)](scores.reshape(B * H, P), ranks)
    compact_kept[_gpu.launch_1d(B * H, FLAT_THREADS)](ranks, n_keep, N - window,
                                                      kept.reshape(B * H, n_keep + window))
    return (*gather_kept(k, v, kept), kept)


def gather_kept(k, v, kept):
    """K and V rows at the device array ``kept`` (B, H, C) (kv heads repeated when H is Hq): (k_c, v_c)."""
    gather = _kernels(ROW_THREADS, np.dtype(k.dtype).name)[-1]
    B, H, C = kept.shape
    k_c = cuda.device_array((B, H, C, k.shape[3]), dtype=k.dtype)
    v_c = cuda.device_array((B, H, C, k.shape[3]), dtype=k.dtype)
    gather[_gpu.launch_1d(k_c.size, FLAT_THREADS)](k, v, kept, k_c, v_c)
    return k_c, v_c
