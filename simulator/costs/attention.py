"""HBM traffic, FLOPs and SRAM of attention: standard, FlashAttention-1 and -2, forward, backward and decode.

Sizes are plain integers or NumPy arrays. ``elem_bytes`` is the precision of Q, K, V, S, P, O (2 for fp16/bf16);
statistics (m, l, lse, D) and accumulators are float32. GQA: Hq query heads share Hkv key/value heads, and the
query heads of a group are packed into one tile, so each K/V tile is loaded once per query block for the whole
group (as the ioaware kernels do); batch multiplies everything.
"""
from __future__ import annotations

import numpy as np

from .ledger import Cost, kernel
from .sizes import check_gqa, check_product, check_sizes
from .tiling import STAT_BYTES, causal_tile_sums, cdiv, flash_sram_bytes, flash_tiles, visible_pairs


def _attention_sizes(B, Hq, Hkv, Nq, Nk, d, elem_bytes):
    """The sizes checked (whole numbers >= 1, Hkv dividing Hq, every count within 64 bits) as int64 arrays."""
    B, Hq, Hkv, Nq, Nk, d, e = check_sizes(B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, d=d, elem_bytes=elem_bytes)
    check_gqa(Hq, Hkv)
    # the largest count: 10·d FLOPs per query-key pair of the backward, or float32 bytes of N² tensors
    check_product("B·Hq·Nq·Nk·d·16", B, Hq, Nq, Nk, np.maximum(d, e), 16)
    return B, Hq, Hkv, Nq, Nk, d, e


def _setup(B, Hq, Hkv, Nq, Nk, d, elem_bytes, sram_bytes, Br, Bc, keep="cols"):
    B, Hq, Hkv, Nq, Nk, d, e = _attention_sizes(B, Hq, Hkv, Nq, Nk, d, elem_bytes)
    group = Hq // Hkv
    if Br is None or Bc is None:
        if sram_bytes is None:
            raise ValueError("give sram_bytes (the SRAM per SM of a HardwareSpec) or both Br and Bc")
        sram_bytes, = check_sizes(sram_bytes=sram_bytes)
        br_rule, bc_rule = flash_tiles(d, e, sram_bytes, group, keep=keep)
        Br = br_rule if Br is None else Br
        Bc = bc_rule if Bc is None else Bc
    Br, Bc = check_sizes(Br=Br, Bc=Bc)
    Br = np.minimum(Br, Nq)
    Bc = np.minimum(Bc, Nk)
    return B, Hq, Hkv, Nq, Nk, d, e, group, Br, Bc


def standard_sram_bytes(br, bc, d, elem_bytes, group=1):
    """Larger of the two matmul kernels' working sets: Q_i, K_j, S_ij tiles (qk); P_ij, V_j and the float32 O_i
    accumulator (pv)."""
    rows = np.asarray(group) * br
    qk = elem_bytes * (rows * d + bc * d + rows * bc)
    pv = elem_bytes * (rows * bc + bc * d) + STAT_BYTES * rows * d
    return np.maximum(qk, pv)


def gemm_square_tiles(d, elem_bytes, sram_bytes, group=1):
    """(Br, Bc) of the standard matmuls: T × T tiles (T·1/group query rows per head of a packed GQA group) for
    the largest power of two T (up to 1024) whose working sets fit in SRAM."""
    d, elem_bytes, sram_bytes, group = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in
                                                              (d, elem_bytes, sram_bytes, group)))
    tile = np.ones_like(d)
    for t in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        rows = np.maximum(1, t // group)
        tile = np.where(standard_sram_bytes(rows, t, d, elem_bytes, group) <= sram_bytes, t, tile)
    return np.maximum(1, tile // group)[()], tile[()]


def _useful(B, Hq, Nq, Nk, d, causal, per_pair_flops=4):
    """FLOPs the products need: 4·d per visible query-key pair (2·d for QKᵀ, 2·d for PV; FlashAttention-2 §4.1)."""
    return per_pair_flops * d * B * Hq * visible_pairs(Nq, Nk, causal)


def standard_forward(B, Hq, Hkv, Nq, Nk, d, *, causal=False, elem_bytes=2, sram_bytes=None, Br=None, Bc=None,
                     separate_mask=False, dropout=False) -> Cost:
    """Standard attention (FlashAttention, Algorithm 0): S = QKᵀ written, softmax reads S and writes P, PV reads P.

    The two matmuls are tiled GEMMs: a query block of Br rows stays on chip while the K or V tiles stream past,
    so K and V are read once per query block (Tr times). Their default tiles are square, Br = Bc = the largest
    power of two whose tiles fit in SRAM (a GEMM is not bound by FlashAttention's Br <= d rule). The mask and
    dropout can be separate elementwise passes, as unfused frameworks run them (each reads and writes S or P
    once). The softmax reads S
    once when a row of float32 scores fits in SRAM, else twice (an online max/sum pass, then the normalizing
    pass). Causal masking saves nothing here: the full S is computed.
    """
    _attention_sizes(B, Hq, Hkv, Nq, Nk, d, elem_bytes)  # before the tile rule divides by them
    if Br is None or Bc is None:
        if sram_bytes is None:
            raise ValueError("give sram_bytes (the SRAM per SM of a HardwareSpec) or both Br and Bc")
        sram_bytes, = check_sizes(sram_bytes=sram_bytes)
        br_gemm, bc_gemm = gemm_square_tiles(d, elem_bytes, sram_bytes, np.asarray(Hq) // np.asarray(Hkv))
        Br = br_gemm if Br is None else Br
        Bc = bc_gemm if Bc is None else Bc
    B, Hq, Hkv, Nq, Nk, d, e, group, Br, Bc = _setup(B, Hq, Hkv, Nq, Nk, d, elem_bytes, sram_bytes, Br, Bc)
    tr = cdiv(Nq, Br)
    s_bytes = B * Hq * Nq * Nk * e
    kernels = [
        kernel("qk", reads={"Q": B * Hq * Nq * d * e, "K": B * Hkv * tr * Nk * d * e}, writes={"S": s_bytes},
               flops=2 * B * Hq * Nq * Nk * d, sram_peak_bytes=standard_sram_bytes(Br, Bc, d, e, group)),
    ]
    if separate_mask and np.any(causal):
        kernels.append(kernel("mask", reads={"S": np.where(causal, s_bytes, 0)},
                              writes={"S": np.where(causal, s_bytes, 0)}, flops=0, sram_peak_bytes=e * Nk))
    row_fits = STAT_BYTES * Nk <= (sram_bytes if sram_bytes is not None else np.inf)
    kernels.append(kernel("softmax", reads={"S": np.where(row_fits, 1, 2) * s_bytes}, writes={"P": s_bytes},
                          flops=0, sram_peak_bytes=np.where(row_fits, STAT_BYTES * Nk, STAT_BYTES * Bc)))
    if dropout:
        kernels.append(kernel("dropout", reads={"P": s_bytes}, writes={"P": s_bytes}, flops=0,
                              sram_peak_bytes=e * Nk))
    kernels.append(kernel("pv", reads={"P": s_bytes, "V": B * Hkv * tr * Nk * d * e},
                          writes={"O": B * Hq * Nq * d * e}, flops=2 * B * Hq * Nq * Nk * d,
                          sram_peak_bytes=standard_sram_bytes(Br, Bc, d, e, group)))
    return Cost("standard", tuple(kernels), _useful(B, Hq, Nq, Nk, d, causal),
                {"Br": Br, "Bc": Bc})


def flash2_forward(B, Hq, Hkv, Nq, Nk, d, *, causal=False, elem_bytes=2, sram_bytes=None, Br=None,
                   Bc=None) -> Cost:
    """FlashAttention-2 forward (Dao 2023, Algorithm 1): outer loop over query blocks, inner over K/V tiles.

    Q is read once and O and lse written once; K and V are read once per query block (Tr times, fewer with a
    causal mask, whose tiles above the diagonal are skipped). FlashAttention's Theorem 2 bound,
    Θ(N²d²M⁻¹), is this re-read term: Tr = N/Br with Br ∝ M/d. Tiles that do not fit shrink Bc first.
    """
    B, Hq, Hkv, Nq, Nk, d, e, group, Br, Bc = _setup(B, Hq, Hkv, Nq, Nk, d, elem_bytes, sram_bytes, Br, Bc,
                                                     keep="rows")
    tr, _, sum_keys, sum_rows_keys, _ = causal_tile_sums(Nq, Nk, Br, Bc, causal)
    k = kernel("flash2_fwd",
               reads={"Q": B * Hq * Nq * d * e, "K": B * Hkv * sum_keys * d * e, "V": B * Hkv * sum_keys * d * e},
               writes={"O": B * Hq * Nq * d * e, "lse": B * Hq * Nq * STAT_BYTES},
               flops=4 * d * B * Hq * sum_rows_keys, sram_peak_bytes=flash_sram_bytes(Br, Bc, d, e, group))
    return Cost("flash2", (k,), _useful(B, Hq, Nq, Nk, d, causal), {"Br": Br, "Bc": Bc, "Tr": tr})


def flash1_forward(B, Hq, Hkv, Nq, Nk, d, *, causal=False, elem_bytes=2, sram_bytes=None, Br=None,
                   Bc=None) -> Cost:
    """FlashAttention-1 forward (Dao et al. 2022, Algorithm 1): outer loop over K/V tiles, inner over query blocks.

    K and V are read once; O, l and m are initialized in HBM (line 2), and for every (query block, K/V tile) pair
    Q_i, O_i, l_i, m_i are read (line 8) and O_i, l_i, m_i written back (lines 12-13): Q and O move Tc times.
    """
    B, Hq, Hkv, Nq, Nk, d, e, group, Br, Bc = _setup(B, Hq, Hkv, Nq, Nk, d, elem_bytes, sram_bytes, Br, Bc)
    tr, _, _, sum_rows_keys, sum_rows_t = causal_tile_sums(Nq, Nk, Br, Bc, causal)
    row_visits = B * Hq * sum_rows_t  # query rows loaded, over all (block, tile) pairs and heads
    k = kernel("flash1_fwd",
               reads={"Q": row_visits * d * e, "K": B * Hkv * Nk * d * e, "V": B * Hkv * Nk * d * e,
                      "O": row_visits * d * e, "l": row_visits * STAT_BYTES, "m": row_visits * STAT_BYTES},
               writes={"O": (row_visits + B * Hq * Nq) * d * e, "l": (row_visits + B * Hq * Nq) * STAT_BYTES,
                       "m": (row_visits + B * Hq * Nq) * STAT_BYTES},
               flops=4 * d * B * Hq * sum_rows_keys, sram_peak_bytes=flash_sram_bytes(Br, Bc, d, e, group))
    return Cost("flash1", (k,), _useful(B, Hq, Nq, Nk, d, causal), {"Br": Br, "Bc": Bc, "Tr": tr})


def standard_backward(B, Hq, Hkv, Nq, Nk, d, *, causal=False, elem_bytes=2) -> Cost:
    """Standard attention backward from the stored P (FlashAttention, Algorithm 3 / Theorem 5 context).

    dV = Pᵀ dO; dP = dO Vᵀ; dS = P ∘ (dP − D) with D = rowsum(dO ∘ O); dQ = dS K; dK = dSᵀ Q. Each operand is
    counted once per kernel (an ideal GEMM); the N² tensors P, dP and dS dominate.
    """
    B, Hq, Hkv, Nq, Nk, d, e = _attention_sizes(B, Hq, Hkv, Nq, Nk, d, elem_bytes)
    nn = B * Hq * Nq * Nk * e
    q_like = B * Hq * Nq * d * e
    kv_like = B * Hkv * Nk * d * e
    mm = 2 * B * Hq * Nq * Nk * d
    kernels = (
        kernel("dv", reads={"P": nn, "dO": q_like}, writes={"dV": kv_like}, flops=mm),
        kernel("dp", reads={"dO": q_like, "V": kv_like}, writes={"dP": nn}, flops=mm),
        kernel("ds", reads={"P": nn, "dP": nn, "O": q_like, "dO": q_like}, writes={"dS": nn}, flops=0),
        kernel("dq", reads={"dS": nn, "K": kv_like}, writes={"dQ": q_like}, flops=mm),
        kernel("dk", reads={"dS": nn, "Q": q_like}, writes={"dK": kv_like}, flops=mm),
    )
    return Cost("standard_bwd", kernels, _useful(B, Hq, Nq, Nk, d, causal, per_pair_flops=8))


def flash2_backward(B, Hq, Hkv, Nq, Nk, d, *, causal=False, elem_bytes=2, sram_bytes=None, Br=None,
                    Bc=None) -> Cost:
    """FlashAttention-2 backward (Dao 2023, Algorithm 2): recomputes P from Q, K and lse instead of storing it.

    A preprocessing kernel computes D = rowsum(dO ∘ O). The main kernel loops over K/V tiles (outer: K_j, V_j read
    once, dK_j, dV_j written once) and the query blocks that see them (inner: Q_i, dO_i, lse_i, D_i read, and the
    float32 dQ_i accumulator read and written). A last kernel converts dQ to the input precision. Five matmuls
    per tile pair: S, dV, dP, dQ, dK (10·d FLOPs per pair element).
    """
    B, Hq, Hkv, Nq, Nk, d, e, group, Br, Bc = _setup(B, Hq, Hkv, Nq, Nk, d, elem_bytes, sram_bytes, Br, Bc,
                                                     keep="rows")
    _, _, _, sum_rows_keys, sum_rows_t = causal_tile_sums(Nq, Nk, Br, Bc, causal)
    visits = B * Hq * sum_rows_t
    q_like = B * Hq * Nq * d * e
    kernels = (
        kernel("bwd_preprocess", reads={"dO": q_like, "O": q_like}, writes={"D": B * Hq * Nq * STAT_BYTES}),
        kernel("flash2_bwd",
               reads={"K": B * Hkv * Nk * d * e, "V": B * Hkv * Nk * d * e, "Q": visits * d * e,
                      "dO": visits * d * e, "lse": visits * STAT_BYTES, "D": visits * STAT_BYTES,
                      "dQ_acc": visits * d * STAT_BYTES},
               writes={"dK": B * Hkv * Nk * d * e, "dV": B * Hkv * Nk * d * e, "dQ_acc": visits * d * STAT_BYTES},
               flops=10 * d * B * Hq * sum_rows_keys,
               sram_peak_bytes=flash_sram_bytes(Br, Bc, d, e, group) + (e + STAT_BYTES) * 2 * Bc * d),
        kernel("dq_convert", reads={"dQ_acc": B * Hq * Nq * d * STAT_BYTES}, writes={"dQ": q_like}),
    )
    return Cost("flash2_bwd", kernels, _useful(B, Hq, Nq, Nk, d, causal, per_pair_flops=8))


def decode(B, Hq, Hkv, n_cached, d, *, elem_bytes=2, capacity=None, sram_bytes=None, Bc=None) -> Cost:
    """One decode step of one layer: a single new query per sequence against a KV cache of ``n_cached`` tokens,
    pruned to ``capacity`` tokens when given (SnapKV, StreamingLLM, H2O keep that many). The kernel is the
    flash forward with Nq = 1: K and V of the kept tokens are read once, per kv head."""
    n_cached, = check_sizes(n_cached=n_cached)
    n_kept = n_cached if capacity is None else np.minimum(n_cached, check_sizes(capacity=capacity)[0])
    cost = flash2_forward(B, Hq, Hkv, 1, n_kept, d, causal=True, elem_bytes=elem_bytes, sram_bytes=sram_bytes,
                          Br=1, Bc=Bc)
    return Cost("decode" if capacity is None else "decode_pruned", cost.kernels, cost.useful_flops,
                {**cost.params, "kept_tokens": n_kept})
