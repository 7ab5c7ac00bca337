"""Tile geometry shared by the attention formulas: tile sizes from SRAM, and closed-form sums over tile pairs.

All functions accept NumPy integer arrays, so a sweep of 10⁵ configurations is a handful of array operations.
"""
from __future__ import annotations

import numpy as np

STAT_BYTES = 4  # m_i, l_i, lse and the S/P tile and O accumulator are kept in float32 (FlashAttention-2 §3.1)


def cdiv(a, b):
    """ceil(a / b) for non-negative integers (arrays welcome)."""
    return -(-np.asarray(a) // np.asarray(b))


def floor_sum(n, m, a, b):
    """Σ_{i=0}^{n-1} floor((a·i + b) / m) for integers n >= 0, m >= 1, a >= 0, b >= 0, vectorized.

    The Euclid-like reduction of floor sums (Graham, Knuth & Patashnik, Concrete Mathematics §3.5): reduce a and b
    modulo m, then swap the roles of the axes; O(log) rounds, each a few array operations.
    """
    n, m, a, b = (np.array(x, dtype=np.int64) for x in np.broadcast_arrays(n, m, a, b))
    total = np.zeros_like(n)
    active = n > 0
    while np.any(active):
        q, a = np.divmod(a, m)
        total += np.where(active, q * (n - 1) * n // 2, 0)
        q, b = np.divmod(b, m)
        total += np.where(active, q * n, 0)
        y_max = a * n + b
        active &= y_max >= m
        n_new, b_new = np.divmod(np.where(active, y_max, 0), np.where(active, m, 1))
        m_new, a_new = np.where(active, a, 1), np.where(active, m, 0)
        n, m, a, b = n_new, m_new, a_new, b_new
    return total


def flash_tiles(d, elem_bytes, sram_bytes, group=1, keep="cols"):
    """Paper tile sizes for head dim d with an SRAM of ``sram_bytes``.

    FlashAttention (Dao et al. 2022), Algorithm 1 line 1, with M the SRAM size in elements: Bc = ceil(M / 4d),
    Br = min(ceil(M / 4d), d). Where the literature leaves it open: M counts elements of ``elem_bytes``; with GQA
    the Br rows are shared by the ``group`` query heads packed into one tile (Br // group rows each, at least 1);
    and when the working set of ``flash_sram_bytes`` exceeds M (the paper's 4d bound leaves no room for the S tile
    and the accumulator when Br = d is large), one side is halved until it fits: Br when ``keep="cols"`` (for
    FlashAttention-1, whose Q and O re-reads fall with Bc), Bc when ``keep="rows"`` (for FlashAttention-2, whose K
    and V re-reads fall with Br).
    """
    d, elem_bytes, sram_bytes, group = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in
                                                              (d, elem_bytes, sram_bytes, group)))
    m_elems = sram_bytes // elem_bytes
    bc = np.maximum(1, cdiv(m_elems, 4 * d))
    br = np.maximum(1, np.minimum(bc, d) // group)
    if keep not in ("cols", "rows"):
        raise ValueError(f"keep must be 'cols' or 'rows'; got {keep!r}")
    for _ in range(64):
        over = flash_sram_bytes(br, bc, d, elem_bytes, group) > sram_bytes
        if not np.any(over):
            break
        first, second = (br, bc) if keep == "cols" else (bc, br)
        shrink_first = over & (first > 1)
        first = np.where(shrink_first, np.maximum(1, first // 2), first)
        second = np.where(over & ~shrink_first, np.maximum(1, second // 2), second)
        br, bc = (first, second) if keep == "cols" else (second, first)
    return br[()], bc[()]


def flash_sram_bytes(br, bc, d, elem_bytes, group=1):
    """On-chip working set of one flash step: Q_i and K_j, V_j tiles in the input precision, the S/P tile, the
    O_i accumulator and m_i, l_i in float32 (rows = group·Br)."""
    rows = np.asarray(group) * br
    return elem_bytes * (rows * d + 2 * bc * d) + STAT_BYTES * (rows * bc + rows * d + 2 * rows)


def causal_tile_sums(nq, nk, br, bc, causal):
    """Sums over query blocks i of the key tiles block i computes, for bottom-right causal alignment.

    Returns (n_blocks Tr, Σ t_i, Σ keys_i, Σ br_i·keys_i, Σ br_i·t_i), where t_i is the number of Bc-row key
    tiles query block i loads (tiles wholly above its diagonal are skipped), keys_i = min(t_i·Bc, Nk) the key
    rows those tiles hold, and br_i the block's rows (Br, the last one Nq − (Tr−1)·Br).
    """
    nq, nk, br, bc = (np.asarray(x, dtype=np.int64) for x in (nq, nk, br, bc))
    causal = np.asarray(causal, dtype=bool)
    tr = cdiv(nq, br)
    tc = cdiv(nk, bc)
    br_last = nq - (tr - 1) * br
    offset = nk - nq
    # blocks i < Tr−1 end at row (i+1)·Br − 1 and see keys j < x_i = (i+1)·Br + offset (< Nk); the last sees all
    n_inner = np.maximum(tr - 1, 0)
    i0 = np.clip(cdiv(np.maximum(1 - offset, 0), br) - 1, 0, None)  # first block with x_i >= 1
    i0 = np.minimum(i0, n_inner)
    x0 = (i0 + 1) * br + offset
    t_inner = floor_sum(n_inner - i0, bc, br, np.maximum(x0, 0) + bc - 1)  # Σ ceil(x_i / Bc) over i0..Tr−2
    i1 = np.clip(cdiv((tc - 1) * bc + 1 - offset, br) - 1, 0, None)  # first inner block with t_i = Tc
    full_inner = np.maximum(0, n_inner - np.maximum(i1, i0))
    keys_inner = bc * t_inner - (bc * tc - nk) * full_inner
    sum_t = np.where(causal, t_inner + tc, tr * tc)
    sum_keys = np.where(causal, keys_inner + nk, tr * nk)
    sum_rows_keys = np.where(causal, br * keys_inner + br_last * nk, nq * nk)
    sum_rows_t = np.where(causal, br * t_inner + br_last * tc, nq * tc)
    return tr, sum_t, sum_keys, sum_rows_keys, sum_rows_t


def visible_pairs(nq, nk, causal):
    """Query-key pairs the mask lets through: Nq·Nk, or Σ_i max(0, min(Nk, i + Nk − Nq + 1)) with a causal mask."""
    nq, nk = (np.asarray(x, dtype=np.int64) for x in (nq, nk))
    offset = nk - nq
    # rows i with i + offset + 1 in [1, Nk] contribute i + offset + 1; rows before see nothing; none exceed Nk
    first = np.clip(-offset, 0, nq)  # first row that sees a key
    n = nq - first
    lo = first + offset + 1
    causal_pairs = n * lo + n * (n - 1) // 2
    return np.where(np.asarray(causal, dtype=bool), causal_pairs, nq * nk)
