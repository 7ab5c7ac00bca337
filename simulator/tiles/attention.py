"""Attention schedules on the ``Machine`` (SRAM, an optional LRU shared cache, DRAM): standard (S and P spilled to
HBM), FlashAttention-1 and -2
forward (causal too, bottom-right aligned), and decode against a full or pruned KV cache.

Each returns a ``SimResult`` with the real output, so tests can hold it against the float64 oracle: the counted
schedule is the algorithm. Query heads of a GQA group are packed into one tile, as in the cost model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..costs.sizes import check_sizes
from .machine import Machine

STAT_BYTES = 4  # float32 statistics, scores and accumulators (FlashAttention-2 §3.1)


@dataclass
class SimResult:
    output: np.ndarray
    lse: np.ndarray | None
    machine: Machine


def _shapes(q, k, v, Br, Bc, sram_bytes=1, elem_bytes=1):
    """The schedule's sizes, checked as the cost model checks them: 4-D q, k, v with every dimension >= 1, k and v
    alike, Hkv dividing Hq, and whole tile sizes, SRAM and element sizes >= 1 (a Br < 0 ran no tile before)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, np.ndarray) or x.dtype.kind not in "fiu":
            raise TypeError(f"{name} must be a real numpy.ndarray; got {getattr(x, 'dtype', type(x).__name__)}")
        if np.ndim(x) != 4 or 0 in np.shape(x):
            raise ValueError(f"{name} must be a 4-D array (B, H, N, d) with every dimension >= 1; got shape "
                             f"{np.shape(x)}")
        if not np.isfinite(x).all():  # (the schedules read −inf as "no key seen yet": a NaN row became zeros)
            raise ValueError(f"{name} must be finite: the simulator counts the schedule's bytes on real values "
                             f"(kernels.attention gives NaN and ±inf their documented results)")
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if Hq % Hkv or k.shape != v.shape or k.shape[-1] != d or k.shape[0] != B:
        raise ValueError(f"incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
    Br, Bc, _, _ = (int(x) for x in check_sizes(Br=Br, Bc=Bc, sram_bytes=sram_bytes, elem_bytes=elem_bytes))
    return B, Hq, Hkv, Nq, Nk, d, Hq // Hkv, min(Br, Nq), min(Bc, Nk)


def _scale(scale, d):
    """The softmax scale: 1/sqrt(d) by default, else a finite real number."""
    if scale is None:
        return 1 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)) \
            or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number (or None: 1/sqrt(d)); got {scale!r}")
    return float(scale)


def _machine(sram_bytes, l2_bytes, concurrent, schedule="waves") -> Machine:
    """The machine of a schedule: ``l2_bytes`` a whole number >= 0 (0: no shared cache), ``concurrent`` the units
    in flight, a whole number >= 1 or a {kernel name: whole number >= 1} mapping; ``schedule`` 'waves' (GPU) or
    'chunks' (CPU threads, see ``Machine``)."""
    l2, = check_sizes(minimum=0, l2_bytes=l2_bytes)
    if isinstance(concurrent, dict):
        counts = {str(name): int(check_sizes(concurrent=c)[0]) for name, c in concurrent.items()}
    else:
        counts = int(check_sizes(concurrent=concurrent)[0])
    return Machine(sram_bytes, l2_bytes=int(l2), concurrent=counts, schedule=schedule)


def _visible(r0, br, group, c0, c1, offset, causal):
    """(rows, bc) mask of the keys c0..c1-1 each packed row may see (row r is query r0 + r % br)."""
    rows_q = r0 + np.arange(group * br) % br
    keys = np.arange(c0, c1)
    if not causal:
        return np.ones((group * br, c1 - c0), dtype=bool)
    return keys[None, :] <= rows_q[:, None] + offset


def _n_tiles(r0, br, nk, bc, offset, causal):
    """Key tiles query block r0..r0+br-1 loads: all, or those not wholly above its last row's diagonal."""
    kend = nk if not causal else min(nk, max(0, r0 + br + offset))
    return math.ceil(kend / bc)


def flash2_forward(q, k, v, *, causal=False, Br, Bc, sram_bytes, elem_bytes=2, scale=None, l2_bytes=0,
                   concurrent=1, schedule="waves") -> SimResult:
    """FlashAttention-2 forward (Dao 2023, Algorithm 1): Q_i stays on chip, K_j and V_j stream past it."""
    B, Hq, Hkv, Nq, Nk, d, group, Br, Bc = _shapes(q, k, v, Br, Bc, sram_bytes, elem_bytes)
    scale = _scale(scale, d)
    e, offset = elem_bytes, Nk - Nq
    mach = _machine(sram_bytes, l2_bytes, concurrent, schedule)
    mach.kernel("flash2_fwd")
    o = np.zeros(q.shape)
    lse = np.full(q.shape[:-1], -np.inf)
    for b in range(B):
        for hk in range(Hkv):
            heads = slice(hk * group, (hk + 1) * group)
            for r0 in range(0, Nq, Br):
                mach.unit((b, hk, r0))  # one CTA per query block, launched query block fastest (as flash-attn)
                br = min(Br, Nq - r0)
                rows = group * br
                q_i = mach.load("Q", q[b, heads, r0:r0 + br], e, slot="Q_i", rows=(r0, r0 + br)).reshape(rows, d)
                mach.alloc("O_i", STAT_BYTES * rows * d)
                mach.alloc("m_i, l_i", STAT_BYTES * 2 * rows)
                mach.alloc("S_ij", STAT_BYTES * rows * Bc)
                acc, m_i, l_i = np.zeros((rows, d)), np.full(rows, -np.inf), np.zeros(rows)
                for j in range(_n_tiles(r0, br, Nk, Bc, offset, causal)):
                    mach.step()
                    c0, c1 = j * Bc, min((j + 1) * Bc, Nk)
                    k_j = mach.load("K", k[b, hk, c0:c1], e, slot="K_j", rows=(c0, c1))
                    v_j = mach.load("V", v[b, hk, c0:c1], e, slot="V_j", rows=(c0, c1))
                    s = np.where(_visible(r0, br, group, c0, c1, offset, causal), scale * (q_i @ k_j.T), -np.inf)
                    mach.compute("S = Q Kᵀ", 2 * rows * (c1 - c0) * d)
                    # online softmax: m_new = max(m_i, rowmax S), rescale the state by exp(m_i − m_new)
                    m_new = np.maximum(m_i, s.max(axis=1))
                    seen = np.isfinite(m_new)
                    p = np.where(seen[:, None], np.exp(s - np.where(seen, m_new, 0)[:, None]), 0.0)
                    alpha = np.where(seen, np.exp(m_i - np.where(seen, m_new, 0)), 0.0)
                    l_i = alpha * l_i + p.sum(axis=1)
                    acc = alpha[:, None] * acc + p @ v_j
                    mach.compute("O += P V", 2 * rows * (c1 - c0) * d)
                    m_i = m_new
                mach.step()
                out = np.where(l_i[:, None] > 0, acc / np.where(l_i > 0, l_i, 1)[:, None], 0.0)
                with np.errstate(divide="ignore"):
                    row_lse = np.where(l_i > 0, m_i + np.log(np.where(l_i > 0, l_i, 1)), -np.inf)
                mach.store("O", o[b, heads, r0:r0 + br], out.reshape(group, br, d), e, rows=(r0, r0 + br))
                mach.store("lse", lse[b, heads, r0:r0 + br], row_lse.reshape(group, br), STAT_BYTES,
                           rows=(r0, r0 + br))
    return SimResult(o, lse, mach)


def flash1_forward(q, k, v, *, causal=False, Br, Bc, sram_bytes, elem_bytes=2, scale=None, l2_bytes=0,
                   concurrent=1, schedule="waves") -> SimResult:
    """FlashAttention-1 forward (Dao et al. 2022, Algorithm 1): K_j, V_j stay on chip while every query block
    that sees them is loaded with its O_i, l_i, m_i from HBM, updated, and written back."""
    B, Hq, Hkv, Nq, Nk, d, group, Br, Bc = _shapes(q, k, v, Br, Bc, sram_bytes, elem_bytes)
    scale = _scale(scale, d)
    e, offset = elem_bytes, Nk - Nq
    mach = _machine(sram_bytes, l2_bytes, concurrent, schedule)
    mach.kernel("flash1_fwd")
    o, l_hbm, m_hbm = np.empty(q.shape), np.empty(q.shape[:-1]), np.empty(q.shape[:-1])
    # line 2: initialize O = 0, l = 0, m = −inf in HBM
    mach.store("O", o, 0.0, e, rows=(0, Nq))
    mach.store("l", l_hbm, 0.0, STAT_BYTES, rows=(0, Nq))
    mach.store("m", m_hbm, -np.inf, STAT_BYTES, rows=(0, Nq))
    tiles_of_block = [_n_tiles(r0, min(Br, Nq - r0), Nk, Bc, offset, causal) for r0 in range(0, Nq, Br)]
    for b in range(B):
        for hk in range(Hkv):
            heads = slice(hk * group, (hk + 1) * group)
            mach.unit((b, hk))  # one CTA per (batch, kv head): FlashAttention-1 parallelizes over batch and heads
            for j in range(math.ceil(Nk / Bc)):
                mach.step()
                c0, c1 = j * Bc, min((j + 1) * Bc, Nk)
                k_j = mach.load("K", k[b, hk, c0:c1], e, slot="K_j", rows=(c0, c1))
                v_j = mach.load("V", v[b, hk, c0:c1], e, slot="V_j", rows=(c0, c1))
                mach.alloc("S_ij", STAT_BYTES * group * Br * Bc)
                for i, r0 in enumerate(range(0, Nq, Br)):
                    if j >= tiles_of_block[i]:
                        continue  # the tile lies wholly above this block's diagonal
                    mach.step()
                    br = min(Br, Nq - r0)
                    rows = group * br
                    at = (r0, r0 + br)
                    q_i = mach.load("Q", q[b, heads, r0:r0 + br], e, slot="Q_i", rows=at).reshape(rows, d)
                    o_i = mach.load("O", o[b, heads, r0:r0 + br], e, slot="O_i", rows=at).reshape(rows, d)
                    l_i = mach.load("l", l_hbm[b, heads, r0:r0 + br], STAT_BYTES, slot="l_i", rows=at).reshape(rows)
                    m_i = mach.load("m", m_hbm[b, heads, r0:r0 + br], STAT_BYTES, slot="m_i", rows=at).reshape(rows)
                    s = np.where(_visible(r0, br, group, c0, c1, offset, causal), scale * (q_i @ k_j.T), -np.inf)
                    mach.compute("S = Q Kᵀ", 2 * rows * (c1 - c0) * d)
                    # lines 10-12: tile statistics, new running statistics, rescaled output
                    m_tile = s.max(axis=1)
                    has = np.isfinite(m_tile)
                    p = np.where(has[:, None], np.exp(s - np.where(has, m_tile, 0)[:, None]), 0.0)
                    l_tile = p.sum(axis=1)
                    m_new = np.maximum(m_i, m_tile)
                    seen = np.isfinite(m_new)
                    safe = np.where(seen, m_new, 0)
                    w_old = np.where(np.isfinite(m_i), np.exp(m_i - safe), 0.0)
                    w_tile = np.where(has, np.exp(m_tile - safe), 0.0)
                    l_new = w_old * l_i + w_tile * l_tile
                    pv = p @ v_j
                    mach.compute("P V", 2 * rows * (c1 - c0) * d)
                    num = (l_i * w_old)[:, None] * o_i + w_tile[:, None] * pv
                    o_new = np.where(l_new[:, None] > 0, num / np.where(l_new > 0, l_new, 1)[:, None], 0.0)
                    mach.store("O", o[b, heads, r0:r0 + br], o_new.reshape(group, br, d), e, rows=at)
                    mach.store("l", l_hbm[b, heads, r0:r0 + br], l_new.reshape(group, br), STAT_BYTES, rows=at)
                    mach.store("m", m_hbm[b, heads, r0:r0 + br], m_new.reshape(group, br), STAT_BYTES, rows=at)
    with np.errstate(divide="ignore"):
        lse = np.where(l_hbm > 0, m_hbm + np.log(np.where(l_hbm > 0, l_hbm, 1)), -np.inf)
    return SimResult(o, lse, mach)


def standard_forward(q, k, v, *, causal=False, Br, Bc, sram_bytes, elem_bytes=2, scale=None,
                     separate_mask=False, l2_bytes=0, concurrent=1, schedule="waves") -> SimResult:
    """Standard attention: S = QKᵀ tile by tile to HBM; [a separate mask pass]; a softmax over S rows to P
    (one read of a row when its float32 copy fits in SRAM, else an online max/sum pass and a normalizing pass);
    O = P V tile by tile."""
    B, Hq, Hkv, Nq, Nk, d, group, Br, Bc = _shapes(q, k, v, Br, Bc, sram_bytes, elem_bytes)
    scale = _scale(scale, d)
    e, offset = elem_bytes, Nk - Nq
    mach = _machine(sram_bytes, l2_bytes, concurrent, schedule)
    s_hbm = np.empty((B, Hq, Nq, Nk))
    p_hbm = np.empty((B, Hq, Nq, Nk))
    o = np.zeros(q.shape)

    mach.kernel("qk")
    for b in range(B):
        for hk in range(Hkv):
            heads = slice(hk * group, (hk + 1) * group)
            for r0 in range(0, Nq, Br):
                mach.unit((b, hk, r0))
                br = min(Br, Nq - r0)
                q_i = mach.load("Q", q[b, heads, r0:r0 + br], e, slot="Q_i", rows=(r0, r0 + br)).reshape(group * br, d)
                for c0 in range(0, Nk, Bc):
                    mach.step()
                    c1 = min(c0 + Bc, Nk)
                    k_j = mach.load("K", k[b, hk, c0:c1], e, slot="K_j", rows=(c0, c1))
                    mach.alloc("S_ij", e * group * br * (c1 - c0))
                    s = scale * (q_i @ k_j.T)
                    mach.compute("S = Q Kᵀ", 2 * group * br * (c1 - c0) * d)
                    mach.store("S", s_hbm[b, heads, r0:r0 + br, c0:c1], s.reshape(group, br, c1 - c0), e,
                               rows=(r0, r0 + br), cols=(c0, c1))

    visible_rows = np.arange(Nk)[None, :] <= np.arange(Nq)[:, None] + offset if causal else None
    if separate_mask and causal:
        mach.kernel("mask")
        for b in range(B):
            for h in range(Hq):
                for i in range(Nq):
                    mach.unit((b, h, i))
                    row = mach.load("S", s_hbm[b, h, i], e, slot="row", rows=(i, i + 1), cols=(0, Nk))
                    mach.store("S", s_hbm[b, h, i], np.where(visible_rows[i], row, -np.inf), e, rows=(i, i + 1),
                               cols=(0, Nk))

    mach.kernel("softmax")
    row_fits = STAT_BYTES * Nk <= sram_bytes
    for b in range(B):
        for h in range(Hq):
            for i in range(Nq):
                mach.unit((b, h, i))
                vis = visible_rows[i] if causal else np.ones(Nk, dtype=bool)
                if row_fits:
                    row = mach.load("S", s_hbm[b, h, i], e, slot="row", rows=(i, i + 1), cols=(0, Nk))
                    mach.alloc("row", STAT_BYTES * Nk)  # held as float32
                    row = np.where(vis, row, -np.inf)
                    m = row.max()
                    p = np.exp(row - m) if np.isfinite(m) else np.zeros(Nk)
                    l = p.sum()
                    mach.store("P", p_hbm[b, h, i], p / l if l > 0 else p, e, rows=(i, i + 1), cols=(0, Nk))
                    continue
                # two passes over chunks of Bc: running max and sum, then normalize and write P
                m, l = -np.inf, 0.0
                for c0 in range(0, Nk, Bc):
                    mach.step()
                    c1 = min(c0 + Bc, Nk)
                    chunk = np.where(vis[c0:c1], mach.load("S", s_hbm[b, h, i, c0:c1], e, slot="chunk",
                                                           rows=(i, i + 1), cols=(c0, c1)), -np.inf)
                    mach.alloc("chunk", STAT_BYTES * Bc)
                    m_new = max(m, chunk.max())
                    if np.isfinite(m_new):
                        l = l * (math.exp(m - m_new) if np.isfinite(m) else 0.0) + np.exp(chunk - m_new).sum()
                        m = m_new
                for c0 in range(0, Nk, Bc):
                    mach.step()
                    c1 = min(c0 + Bc, Nk)
                    chunk = np.where(vis[c0:c1], mach.load("S", s_hbm[b, h, i, c0:c1], e, slot="chunk",
                                                           rows=(i, i + 1), cols=(c0, c1)), -np.inf)
                    mach.alloc("chunk", STAT_BYTES * Bc)
                    p = np.exp(chunk - m) / l if l > 0 else np.zeros(c1 - c0)
                    mach.store("P", p_hbm[b, h, i, c0:c1], p, e, rows=(i, i + 1), cols=(c0, c1))

    mach.kernel("pv")
    for b in range(B):
        for hk in range(Hkv):
            heads = slice(hk * group, (hk + 1) * group)
            for r0 in range(0, Nq, Br):
                mach.unit((b, hk, r0))
                br = min(Br, Nq - r0)
                mach.alloc("O_i", STAT_BYTES * group * br * d)
                acc = np.zeros((group * br, d))
                for c0 in range(0, Nk, Bc):
                    mach.step()
                    c1 = min(c0 + Bc, Nk)
                    p_ij = mach.load("P", p_hbm[b, heads, r0:r0 + br, c0:c1], e, slot="P_ij", rows=(r0, r0 + br),
                                     cols=(c0, c1))
                    v_j = mach.load("V", v[b, hk, c0:c1], e, slot="V_j", rows=(c0, c1))
                    acc += p_ij.reshape(group * br, c1 - c0) @ v_j
                    mach.compute("O += P V", 2 * group * br * (c1 - c0) * d)
                mach.step()
                mach.store("O", o[b, heads, r0:r0 + br], acc.reshape(group, br, d), e, rows=(r0, r0 + br))
    return SimResult(o, None, mach)


def decode(q, k, v, *, kept=None, Bc, sram_bytes, elem_bytes=2, scale=None, l2_bytes=0, concurrent=1,
           schedule="waves") -> SimResult:
    """One decode step: q (B, Hq, 1, d) against the cache k, v (B, Hkv, N, d), or against the positions ``kept``
    (B, Hkv, C) of a pruned cache, which lives compacted in HBM (pruning happened once, at prefill, uncounted)."""
    if kept is not None:
        kept = np.asarray(kept)
        k = np.take_along_axis(k, kept[..., None], axis=2)
        v = np.take_along_axis(v, kept[..., None], axis=2)
    return flash2_forward(q, k, v, causal=True, Br=1, Bc=Bc, sram_bytes=sram_bytes, elem_bytes=elem_bytes,
                          scale=scale, l2_bytes=l2_bytes, concurrent=concurrent, schedule=schedule)
