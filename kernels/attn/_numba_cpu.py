"""FlashAttention-2 forward on the CPU with Numba: exact attention in O(N·d) extra memory.

Computes O = softmax(scale · Q Kᵀ + causal mask) V without materializing the N × N score matrix, as in
FlashAttention-2 (Dao 2023, Algorithm 1): the outer loop runs over query blocks of Br rows, the inner loop over
key/value blocks of Bc rows, each row keeps a running max m_i and running sum l_i (online softmax, Milakov &
Gimelshein 2018), and the output is divided by l_i once at the end. The CPU's per-core L2 cache plays the part of
the GPU's SRAM.

Versions (all measured on the 2-core AMD EPYC (Zen 4) development machine, N=4096, H=8, d=64, float32, non-causal;
its sgemm runs at about 205 GFLOP/s):
  v1: block matmuls through BLAS inside ``prange``, ``math.exp``: 29 GFLOP/s, BLAS threads oversubscribed.
  v2: BLAS pinned to one thread per Numba thread: 82 GFLOP/s.
  v3: a vectorizable exp (exponent bits + a polynomial) instead of the scalar libm call: 122 GFLOP/s.
  v4: scale folded into the exponent, the rescale of O fused with the P·V accumulation, the query heads of one
      GQA group share each K/V tile, split-KV for decode (Flash-Decoding, Dao et al. 2023): 128 GFLOP/s.
  v5: exp in one branch-free float32 pass (2^r by reinterpreting integer bits; no float64 widening), and lazy
      rescaling: exp is taken against the running maximum of the earlier blocks, so the row-max pass runs on a
      row's first block only: 163 GFLOP/s (0.81 of sgemm), 1.06x torch 2.13's scaled_dot_product_attention in
      the same benchmark run (1.16x causal).
  v6 (this file): GQA packing: the query blocks of a group's heads are stacked into one tile, so each K/V tile
      is read once and the matmuls are taller. Decode (Nq=1, Nk=16384, Hq=9, Hkv=3, d=64): 1.16 ms -> 0.82 ms
      with a warm cache.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .._common.numba_cpu import FASTMATH, exp_row, row_max
from .._common.threads import pool_threads

# Lazy rescaling (as FlashAttention-4 does on Blackwell): each block's exp is taken against the running maximum
# m_i of the earlier blocks, and m_i moves only when a row's sum of exps exceeds this bound, i.e. when a new score
# beats the old maximum by more than log(RESCALE_LIMIT) (in units of scaled scores). Every reference value gives
# the same softmax; the bound only keeps the sums finite. This saves the max pass on all but the first block.
RESCALE_LIMIT = 2.0**16


@njit(fastmath=FASTMATH)
def _all_finite(x):
    """True if no element of the 2-D array x is NaN or ±inf."""
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            if not math.isfinite(x[i, j]):
                return False
    return True


@njit(inline="always", fastmath=FASTMATH)
def _has_nan(s, n):
    """True if one of s[0:n] is NaN."""
    for j in range(n):
        if s[j] != s[j]:
            return True
    return False


def task_elements(rows, Bc, d):
    """Elements of one task's tiles in ``flash_forward``: Q_i, O_i and P·V (rows × d), S and P (rows × Bc), and
    m_i, l_i, alpha (rows)."""
    return 3 * rows * d + 2 * rows * Bc + 3 * rows


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def flash_forward(q, k, v, o, lse, o_part, stats_part, scale, causal, Br, Bc, n_splits, work):
    """FlashAttention-2 forward over C-contiguous (B, Hq, Nq, d) q and (B, Hkv, Nk, d) k, v.

    Writes o (B, Hq, Nq, d) and lse (B, Hq, Nq). With n_splits > 1 each task covers one share of the keys and
    writes o_part (n_splits, B, Hq, Nq, d) and stats_part (n_splits, B, Hq, Nq, 2), each row's m_i and l_i;
    ``combine_splits`` merges them. ``work``: the tiles of
    each of its workers (n_workers, ``task_elements(rows, Bc, d)``) in q's dtype, rows = (Hq / Hkv) · Br; the
    tasks are split into n_workers equal contiguous runs, one per worker.
    """
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = Hq // Hkv  # query heads per kv head (GQA); they share every K/V tile loaded below
    Tr = (Nq + Br - 1) // Br
    offset = Nk - Nq  # bottom-right causal alignment: query i sees keys j <= i + offset
    n_tasks = B * Hkv * Tr * n_splits
    n_workers = work.shape[0]
    per = (n_tasks + n_workers - 1) // n_workers  # equal contiguous runs of tasks, as a static schedule
    for worker in prange(n_workers):
        w = work[worker]  # this worker's tiles, reused by each of its tasks (``_flash`` in ``_api.py``)
        for task in range(worker * per, min(n_tasks, (worker + 1) * per)):
            split = task % n_splits
            ib = (task // n_splits) % Tr
            hk = (task // (n_splits * Tr)) % Hkv
            b = task // (n_splits * Tr * Hkv)
            r0 = ib * Br
            br = min(Br, Nq - r0)
            # keys this query block may see: all, or up to the last row's diagonal (causal blocks above it skipped)
            kend = Nk
            if causal:
                kend = max(0, min(Nk, r0 + br + offset))
            # this split's share of [0, kend), in whole blocks of Bc
            Tc = (kend + Bc - 1) // Bc
            per_split = (Tc + n_splits - 1) // n_splits
            k0 = min(kend, split * per_split * Bc)
            k1 = min(kend, (split + 1) * per_split * Bc)

            # GQA packing: the query blocks of the group's heads are stacked as the rows of one tile, so that each
            # K/V tile is read once for all of them and the block matmuls are group times taller (row r is query
            # r0 + r % br of head hk·group + r // br)
            rows = group * br
            q_i = w[:rows * d].reshape((rows, d))  # Q_i, (rows, d)
            for g in range(group):  # (element by element: a slice assignment compiles Numba's shape-mismatch
                # message, ~4 s of a cold compile, for a check these equal shapes never fail)
                for r in range(br):
                    for c in range(d):
                        q_i[g * br + r, c] = q[b, hk * group + g, r0 + r, c]
            o_acc = w[rows * d:2 * rows * d].reshape((rows, d))  # unnormalized output O_i
            o_acc[:] = 0.0
            pv = w[2 * rows * d:3 * rows * d].reshape((rows, d))
            at = 3 * rows * d
            s_buf = w[at:at + rows * Bc]
            p_buf = w[at + rows * Bc:at + 2 * rows * Bc]
            at += 2 * rows * Bc
            m_i = w[at:at + rows]  # running reference maximum of S (unscaled); -inf: none yet
            m_i[:] = -np.inf
            l_i = w[at + rows:at + 2 * rows]  # running sum of exp(scale·(S − m_i))
            l_i[:] = 0.0
            alpha = w[at + 2 * rows:at + 3 * rows]
            for c0 in range(k0, k1, Bc):
                bc = min(Bc, k1 - c0)
                k_j = k[b, hk, c0:c0 + bc]  # (bc, d)
                v_j = v[b, hk, c0:c0 + bc]  # (bc, d)
                on_diagonal = causal and c0 + bc - 1 > r0 + offset  # some row of the block must not see some key
                # masked P entries are 0, and 0·v = 0 unless v is NaN or inf: only then must P·V skip masked keys
                masked_v_nonfinite = on_diagonal and not _all_finite(v_j)
                s = s_buf[:rows * bc].reshape((rows, bc))
                p = p_buf[:rows * bc].reshape((rows, bc))
                np.dot(q_i, k_j.T, s)  # S_ij = Q_i K_jᵀ, (rows, bc), unscaled
                for r in range(rows):
                    n_vis = bc
                    if on_diagonal:
                        n_vis = max(0, min(bc, r0 + r % br + offset - c0 + 1))
                    s_row, p_row = s[r], p[r]
                    if n_vis == 0:
                        p_row[:] = 0.0
                        alpha[r] = 1.0
                        continue
                    # online softmax: P_ij = exp(scale·(S_ij − m)), against the running maximum m of earlier blocks
                    # (m_i is read back after each store, so that exp and alpha see the same rounded value)
                    m_old = m_i[r]
                    if m_old == -np.inf:  # no reference yet (the row's first block with a score above -inf)
                        m_block = row_max(s_row, n_vis, -np.inf)
                        if m_block == -np.inf:
                            # every visible score is -inf (zero weight: as if masked) or NaN: the block adds nothing,
                            # but a NaN poisons the row (sum and output), as in the oracle
                            nan = _has_nan(s_row, n_vis)
                            p_row[:] = np.nan if nan else 0.0
                            if nan:
                                l_i[r] = np.nan
                            alpha[r] = 1.0
                            continue
                        m_i[r] = m_block
                    row_sum = exp_row(s_row, p_row, n_vis, m_i[r], scale)
                    if not row_sum <= RESCALE_LIMIT:  # a new score beats the maximum by far (or inf): move m_i
                        m_i[r] = max(m_i[r], row_max(s_row, n_vis, -np.inf))
                        row_sum = exp_row(s_row, p_row, n_vis, m_i[r], scale)
                    p_row[n_vis:] = 0.0
                    # rescale factor of the old state: exp(scale·(m_old − m_new)); 0 after no reference, 1 if m stays
                    alpha[r] = math.exp((m_old - m_i[r]) * scale)
                    l_i[r] = alpha[r] * l_i[r] + row_sum
                # O_i ← diag(alpha) O_i + P_ij V_j
                if masked_v_nonfinite:
                    # row by row over the visible keys only, so that a NaN in a masked v row stays out
                    for r in range(rows):
                        n_vis = max(0, min(bc, r0 + r % br + offset - c0 + 1))
                        for c in range(d):
                            o_acc[r, c] *= alpha[r]
                        for jj in range(n_vis):
                            pij = p[r, jj]
                            for c in range(d):
                                o_acc[r, c] += pij * v_j[jj, c]
                else:
                    np.dot(p, v_j, pv)  # (rows, d)
                    for r in range(rows):
                        for c in range(d):
                            o_acc[r, c] = alpha[r] * o_acc[r, c] + pv[r, c]

            # epilogue: O = diag(l_i)^-1 O_i, lse = scale·m_i + log l_i; a row that saw no key, or only scores of
            # -inf, gives 0 and -inf. A split keeps m_i and l_i instead of lse (``combine_splits``)
            for r in range(rows):
                h = hk * group + r // br
                row = r0 + r % br
                out = o[b, h, row] if n_splits == 1 else o_part[split, b, h, row]
                if n_splits > 1:
                    stats_part[split, b, h, row, 0] = m_i[r]
                    stats_part[split, b, h, row, 1] = l_i[r]
                if l_i[r] == 0.0:
                    out[:] = 0.0
                    if n_splits == 1:
                        lse[b, h, row] = -np.inf
                else:  # l_i > 0, or NaN, which propagates
                    inv = 1.0 / l_i[r]
                    for c in range(d):
                        out[c] = o_acc[r, c] * inv
                    if n_splits == 1:
                        lse[b, h, row] = m_i[r] * scale + math.log(l_i[r])


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def combine_splits(o_part, stats_part, scale, o, lse):
    """Merge split-KV partial results, each split's normalized output o_s with its unscaled score reference m_s and
    sum l_s = Σ exp(scale·(S − m_s)) (``stats_part[..., 0]``, ``[..., 1]``): with M = max_s m_s and
    w_s = l_s · exp(scale·(m_s − M)), o = Σ_s w_s o_s / Σ_s w_s and lse = scale·M + log Σ_s w_s (Flash-Decoding's
    merge). The weights stay within float range whatever the scale: merged by each split's lse instead,
    scale·m overflowed to ±inf at scale = 1e38 and gave NaN (inf − inf) or zeros (−inf read as "no key")."""
    n_splits, B, Hq, Nq, d = o_part.shape
    for row in prange(B * Hq * Nq):
        i = row % Nq
        h = (row // Nq) % Hq
        b = row // (Nq * Hq)
        m = -np.inf
        nan = False
        for sp in range(n_splits):
            l_s = stats_part[sp, b, h, i, 1]
            nan = nan or l_s != l_s
            if l_s > 0.0:  # a split that saw no key of the row (l = 0) has no reference
                m = max(m, stats_part[sp, b, h, i, 0])
        if nan:  # a split whose keys gave NaN: the row is NaN whatever the other splits saw
            o[b, h, i, :] = np.nan
            lse[b, h, i] = np.nan
            continue
        if m == -np.inf:
            o[b, h, i, :] = 0.0
            lse[b, h, i] = -np.inf
            continue
        total = 0.0
        o[b, h, i, :] = 0.0
        for sp in range(n_splits):
            l_s = stats_part[sp, b, h, i, 1]
            if l_s > 0.0:
                w = l_s * math.exp((stats_part[sp, b, h, i, 0] - m) * scale)
                total += w
                for c in range(d):
                    o[b, h, i, c] += w * o_part[sp, b, h, i, c]
        for c in range(d):
            o[b, h, i, c] /= total
        lse[b, h, i] = m * scale + math.log(total)


def num_threads() -> int:
    """Threads a call that is not small plans its tiles and key splits for: the pool's count, also where the call
    runs alone beside held cores (``threads.pool_threads``)."""
    return pool_threads()
