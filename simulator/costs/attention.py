"""Traffic at both levels, FLOPs and SRAM of attention: standard, FlashAttention-1 and -2, forward, backward and
decode.

Every function counts the tile traffic between SRAM and the shared level (``reads``/``writes``); given ``hw`` (a
``HardwareSpec``) it also counts what reaches DRAM through the shared cache (``dram_reads``/``dram_writes``), from
the launch order and the units in flight (``reuse.py``), and takes its SRAM from the spec. Without ``hw`` there is
no shared cache and DRAM sees every tile transfer (the two-level model of the FlashAttention paper). ``tiles``
picks the tile shapes: ``"paper"`` (FlashAttention's Br <= d rule, the default), ``"flash-attn"`` or ``"ioaware"``
(the kernels' own, ``tile_shapes.py``); explicit Br and Bc override all three.

Sizes are plain integers or NumPy arrays. ``elem_bytes`` is the precision of Q, K, V, S, P, O (2 for fp16/bf16);
statistics (m, l, lse, D) and accumulators are float32. ``flop_kind`` is the rate the products run at on ``hw``
(``HardwareSpec.peak``: "fp16", the default, "bf16", "fp32"; a float32 attention on a GPU runs at its "fp32" rate,
not its tensor cores' fp16 one). GQA: Hq query heads share Hkv key/value heads, and the
query heads of a group are packed into one tile, so each K/V tile is loaded once per query block for the whole
group (as the ioaware kernels do); batch multiplies everything.
"""
from __future__ import annotations

import numpy as np

from ..hardware import HardwareSpec
from .ledger import Cost, kernel
from .reuse import (causal_chain_rows, pass_hit_fraction, resident, revisit_miss_fraction,
                    shared_operand_reads, thread_rounds_groups)
from .sizes import check_gqa, check_product, check_sizes
from .tile_shapes import TILE_RULES, implemented_tiles
from .tiling import STAT_BYTES, causal_tile_sums, cdiv, flash_sram_bytes, flash_tiles, visible_pairs


def _attention_sizes(B, Hq, Hkv, Nq, Nk, d, elem_bytes):
    """The sizes checked (whole numbers >= 1, Hkv dividing Hq, every count within 64 bits) as int64 arrays."""
    B, Hq, Hkv, Nq, Nk, d, e = check_sizes(B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, d=d, elem_bytes=elem_bytes)
    check_gqa(Hq, Hkv)
    # the largest count: 10·d FLOPs per query-key pair of the backward, or float32 bytes of N² tensors
    check_product("B·Hq·Nq·Nk·d·16", B, Hq, Nq, Nk, np.maximum(d, e), 16)
    return B, Hq, Hkv, Nq, Nk, d, e


def _sram(hw, sram_bytes):
    """The SRAM per SM: given, else the spec's (``hw`` checked: None or a HardwareSpec)."""
    if hw is not None and not isinstance(hw, HardwareSpec):
        raise TypeError(f"hw must be a simulator.hardware.HardwareSpec (or None: no shared cache); got {hw!r}")
    if sram_bytes is None and hw is not None:
        return hw.sram_per_sm_bytes
    return sram_bytes


def _in_flight(hw, cta_bytes, threads=None):
    return hw.ctas_in_flight(cta_bytes, threads)


def _setup(B, Hq, Hkv, Nq, Nk, d, elem_bytes, sram_bytes, Br, Bc, keep="cols", tiles="paper", hw=None,
           causal=False):
    """Checked sizes and the tiles; with ``tiles`` other than 'paper' (and no explicit Br, Bc) the implemented
    ones. Returns the sizes, group, Br, Bc and the CTA's shared memory (None: the schedule's working set)."""
    if tiles not in TILE_RULES:
        raise ValueError(f"unknown tiles {tiles!r}; known: {', '.join(TILE_RULES)}")
    B, Hq, Hkv, Nq, Nk, d, e = _attention_sizes(B, Hq, Hkv, Nq, Nk, d, elem_bytes)
    group = Hq // Hkv
    sram_bytes = _sram(hw, sram_bytes)
    cta_bytes = None
    if tiles != "paper" and (Br is None or Bc is None):
        br_impl, bc_impl, cta_bytes, _ = implemented_tiles(tiles, d, e, group, hw, causal)
        Br = br_impl if Br is None else Br
        Bc = bc_impl if Bc is None else Bc
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
    return B, Hq, Hkv, Nq, Nk, d, e, group, Br, Bc, cta_bytes


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
                     separate_mask=False, dropout=False, hw=None, flop_kind="fp16") -> Cost:
    """Standard attention (FlashAttention, Algorithm 0): S = QKᵀ written, softmax reads S and writes P, PV reads P.

    The two matmuls are tiled GEMMs: a query block of Br rows stays on chip while the K or V tiles stream past,
    so K and V are loaded once per query block (Tr times). Their default tiles are square, Br = Bc = the largest
    power of two whose tiles fit in SRAM (a GEMM is not bound by FlashAttention's Br <= d rule). The mask and
    dropout can be separate elementwise passes, as unfused frameworks run them (each reads and writes S or P
    once). The softmax reads S once when a row of float32 scores fits in SRAM, else twice (an online max/sum
    pass, then the normalizing pass). Causal masking saves nothing here: the full S is computed.

    With ``hw``: the K (V) re-reads of the query blocks of one head in a wave come from L2 (``reuse.py``); S and
    P are written back to DRAM once, and each pass reads from DRAM the rows the shared cache no longer holds
    (``reuse.pass_hit_fraction``: all of them once S and P are much larger than the cache).
    """
    _attention_sizes(B, Hq, Hkv, Nq, Nk, d, elem_bytes)  # before the tile rule divides by them
    sram_bytes = _sram(hw, sram_bytes)
    if Br is None or Bc is None:
        if sram_bytes is None:
            raise ValueError("give sram_bytes (the SRAM per SM of a HardwareSpec), hw, or both Br and Bc")
        sram_bytes, = check_sizes(sram_bytes=sram_bytes)
        br_gemm, bc_gemm = gemm_square_tiles(d, elem_bytes, sram_bytes, np.asarray(Hq) // np.asarray(Hkv))
        Br = br_gemm if Br is None else Br
        Bc = bc_gemm if Bc is None else Bc
    B, Hq, Hkv, Nq, Nk, d, e, group, Br, Bc, _ = _setup(B, Hq, Hkv, Nq, Nk, d, elem_bytes, sram_bytes, Br, Bc)
    tr = cdiv(Nq, Br)
    s_bytes = B * Hq * Nq * Nk * e
    kv_tiled = B * Hkv * tr * Nk * d * e  # K (V) loaded once per query block
    gemm_sram = standard_sram_bytes(Br, Bc, d, e, group)
    q_bytes, o_bytes = B * Hq * Nq * d * e, B * Hq * Nq * d * e
    masked = bool(separate_mask and np.any(causal))
    row_fits = STAT_BYTES * Nk <= (sram_bytes if sram_bytes is not None else np.inf)
    s_reads = np.where(row_fits, 1, 2) * s_bytes
    p_bytes = s_bytes
    if hw is None:
        kv_dram = kv_tiled
        miss = {name: 1.0 for name in ("mask", "softmax", "dropout", "pv")}
    else:
        c = _in_flight(hw, gemm_sram)
        times = shared_operand_reads(B * Hkv, tr, c, Nk * d * e, c * group * Br * d * e, hw.l2_bytes, hw.kind)
        kv_dram = np.minimum(kv_tiled, times * Nk * d * e)
        l2 = hw.l2_bytes
        # each pass reads what the one before wrote, row by row (reuse.pass_hit_fraction): in-place passes touch
        # one tensor, softmax reads S and writes P
        miss = {"mask": 1 - pass_hit_fraction(l2, s_bytes, 0, 0),
                "softmax": 1 - pass_hit_fraction(l2, s_bytes, 0, p_bytes),
                "dropout": 1 - pass_hit_fraction(l2, p_bytes, s_bytes, 0),
                "pv": 1 - (pass_hit_fraction(l2, p_bytes, 0, 0) if dropout
                           else pass_hit_fraction(l2, p_bytes, s_bytes, 0))}
    # a pass that misses reads from DRAM; an in-place pass's writes reach DRAM again for the lines it missed
    # (the others were still dirty in the cache and go back once); the second softmax pass re-reads a row it
    # just read (a hit)
    kernels = [
        kernel("qk", reads={"Q": q_bytes, "K": kv_tiled}, writes={"S": s_bytes},
               flops=2 * B * Hq * Nq * Nk * d, flop_kind=flop_kind, sram_peak_bytes=gemm_sram,
               dram_reads={"Q": q_bytes, "K": kv_dram}, dram_writes={"S": s_bytes}),
    ]
    if masked:
        s_mask = np.where(causal, s_bytes, 0)
        kernels.append(kernel("mask", reads={"S": s_mask}, writes={"S": s_mask}, flops=0, sram_peak_bytes=e * Nk,
                              dram_reads={"S": miss["mask"] * s_mask}, dram_writes={"S": miss["mask"] * s_mask}))
    kernels.append(kernel("softmax", reads={"S": s_reads}, writes={"P": p_bytes}, flops=0,
                          sram_peak_bytes=np.where(row_fits, STAT_BYTES * Nk, STAT_BYTES * Bc),
                          dram_reads={"S": miss["softmax"] * (s_bytes if hw is not None else s_reads)},
                          dram_writes={"P": p_bytes}))
    if dropout:
        kernels.append(kernel("dropout", reads={"P": p_bytes}, writes={"P": p_bytes}, flops=0,
                              sram_peak_bytes=e * Nk, dram_reads={"P": miss["dropout"] * p_bytes},
                              dram_writes={"P": miss["dropout"] * p_bytes}))
    kernels.append(kernel("pv", reads={"P": p_bytes, "V": kv_tiled}, writes={"O": o_bytes},
                          flops=2 * B * Hq * Nq * Nk * d, flop_kind=flop_kind, sram_peak_bytes=gemm_sram,
                          dram_reads={"P": miss["pv"] * p_bytes, "V": kv_dram}, dram_writes={"O": o_bytes}))
    return Cost("standard", tuple(kernels), _useful(B, Hq, Nq, Nk, d, causal),
                {"Br": Br, "Bc": Bc})


def flash2_forward(B, Hq, Hkv, Nq, Nk, d, *, causal=False, elem_bytes=2, sram_bytes=None, Br=None,
                   Bc=None, hw=None, tiles="paper", flop_kind="fp16") -> Cost:
    """FlashAttention-2 forward (Dao 2023, Algorithm 1): outer loop over query blocks, inner over K/V tiles.

    Q is read once and O and lse written once; K and V are loaded once per query block (Tr times, fewer with a
    causal mask, whose tiles above the diagonal are skipped). FlashAttention's Theorem 2 bound,
    Θ(N²d²M⁻¹), is this re-read term: Tr = N/Br with Br ∝ M/d. Tiles that do not fit shrink Bc first.

    With ``hw`` the re-reads are served by the shared cache: the query blocks of one (batch, kv head) are
    neighbours in the launch order and run in the same wave, so K and V reach DRAM once per wave their head's
    blocks span, or once in all when a wave's live set fits (``reuse.shared_operand_reads``).
    """
    B, Hq, Hkv, Nq, Nk, d, e, group, Br, Bc, cta = _setup(B, Hq, Hkv, Nq, Nk, d, elem_bytes, sram_bytes, Br, Bc,
                                                          keep="rows", tiles=tiles, hw=hw, causal=causal)
    tr, _, sum_keys, sum_rows_keys, _ = causal_tile_sums(Nq, Nk, Br, Bc, causal)
    sram_peak = flash_sram_bytes(Br, Bc, d, e, group)
    kv_tiled = B * Hkv * sum_keys * d * e
    reads = {"Q": B * Hq * Nq * d * e, "K": kv_tiled, "V": kv_tiled}
    writes = {"O": B * Hq * Nq * d * e, "lse": B * Hq * Nq * STAT_BYTES}
    dram_reads = None
    if hw is not None:
        c = _in_flight(hw, sram_peak if cta is None else cta)
        private = c * group * Br * (2 * d * e + STAT_BYTES)  # Q_i, O_i and lse_i of the units in a wave
        # a causal block sees only the keys up to its diagonal: a wave's blocks touch sum_keys / Tr keys each on
        # average (all Nk without a mask)
        # (a CPU thread runs a head's blocks one after another: the reuse chain reaches the last block's keys, Nk)
        keys_live = sum_keys / tr if hw.kind == "gpu" else Nk
        times = shared_operand_reads(B * Hkv, tr, c, 2 * d * e * keys_live, private, hw.l2_bytes, hw.kind)
        # each read brings the keys its span of blocks sees: all Nk, or with a causal mask up to the span's last
        # block's diagonal — over s spans of a head, Nk·(s + 1)/2 rows
        reads_of_nk = np.where(causal, (times + B * Hkv) / 2, times)
        kv_dram = np.minimum(kv_tiled, reads_of_nk * Nk * d * e)
        if hw.kind == "cpu" and np.any(causal):
            # a thread's blocks of a head re-use the keys below the diagonal while those of the heads in flight
            # fit (reuse.causal_chain_rows)
            per_round = thread_rounds_groups(B * Hkv, tr, c) / cdiv(B * Hkv * tr, c)
            threshold = (hw.l2_bytes - private) / (per_round * 2 * d * e)
            chain = B * Hkv * causal_chain_rows(Nq, Nk, Br, Bc, threshold) * d * e
            kv_dram = np.where(causal, np.minimum(kv_tiled, chain), kv_dram)
        dram_reads = {"Q": reads["Q"], "K": kv_dram, "V": kv_dram}
    k = kernel("flash2_fwd", reads=reads, writes=writes, flops=4 * d * B * Hq * sum_rows_keys, flop_kind=flop_kind,
               sram_peak_bytes=sram_peak, dram_reads=dram_reads)
    return Cost("flash2", (k,), _useful(B, Hq, Nq, Nk, d, causal), {"Br": Br, "Bc": Bc, "Tr": tr, "tiles": tiles})


def flash1_forward(B, Hq, Hkv, Nq, Nk, d, *, causal=False, elem_bytes=2, sram_bytes=None, Br=None,
                   Bc=None, hw=None, flop_kind="fp16") -> Cost:
    """FlashAttention-1 forward (Dao et al. 2022, Algorithm 1): outer loop over K/V tiles, inner over query blocks.

    K and V are read once; O, l and m are initialized in HBM (line 2), and for every (query block, K/V tile) pair
    Q_i, O_i, l_i, m_i are read (line 8) and O_i, l_i, m_i written back (lines 12-13): Q and O move Tc times.

    With ``hw``: one unit per (batch, kv head), as FlashAttention-1 parallelizes over batch and heads. The Q, O,
    l, m of the heads in flight are re-read Tc times; they come from the shared cache when those heads' rows fit
    it (then Q is read from DRAM once, and O, l, m are written back once — after the initialization too, when all
    of O, l, m fit and the first reads find it there), else every visit reaches DRAM; a causal mask shrinks the
    live rows tile by tile (``reuse.revisit_miss_fraction``).
    """
    B, Hq, Hkv, Nq, Nk, d, e, group, Br, Bc, _ = _setup(B, Hq, Hkv, Nq, Nk, d, elem_bytes, sram_bytes, Br, Bc,
                                                         hw=hw)
    tr, _, _, sum_rows_keys, sum_rows_t = causal_tile_sums(Nq, Nk, Br, Bc, causal)
    row_visits = B * Hq * sum_rows_t  # query rows loaded, over all (block, tile) pairs and heads
    rows = B * Hq * Nq
    row_bytes = {"Q": d * e, "O": d * e, "l": STAT_BYTES, "m": STAT_BYTES}
    reads = {"Q": row_visits * d * e, "K": B * Hkv * Nk * d * e, "V": B * Hkv * Nk * d * e,
             "O": row_visits * d * e, "l": row_visits * STAT_BYTES, "m": row_visits * STAT_BYTES}
    writes = {t: (row_visits + rows) * row_bytes[t] for t in ("O", "l", "m")}
    sram_peak = flash_sram_bytes(Br, Bc, d, e, group)
    dram_reads = dram_writes = None
    if hw is not None:
        c = _in_flight(hw, sram_peak)
        head_rows = group * Nq * (2 * d * e + 2 * STAT_BYTES)  # one unit's Q, O, l, m
        live = np.minimum(c, B * Hkv) * (head_rows + 2 * Bc * d * e)
        f = revisit_miss_fraction(live, hw.l2_bytes, causal)  # re-visits that miss
        init_kept = resident(rows * (d * e + 2 * STAT_BYTES), hw.l2_bytes)
        dram_reads, dram_writes = {"K": reads["K"], "V": reads["V"]}, {}
        dram_reads["Q"] = rows * d * e + f * (reads["Q"] - rows * d * e)
        for t in ("O", "l", "m"):
            kept_reads = np.where(init_kept, 0, rows * row_bytes[t])
            kept_writes = np.where(init_kept, 1, 2) * rows * row_bytes[t]
            dram_reads[t] = kept_reads + f * (reads[t] - kept_reads)
            dram_writes[t] = kept_writes + f * (writes[t] - kept_writes)
    k = kernel("flash1_fwd", reads=reads, writes=writes, flops=4 * d * B * Hq * sum_rows_keys, flop_kind=flop_kind,
               sram_peak_bytes=sram_peak, dram_reads=dram_reads, dram_writes=dram_writes)
    return Cost("flash1", (k,), _useful(B, Hq, Nq, Nk, d, causal), {"Br": Br, "Bc": Bc, "Tr": tr})


def standard_backward(B, Hq, Hkv, Nq, Nk, d, *, causal=False, elem_bytes=2, flop_kind="fp16") -> Cost:
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
        kernel("dv", reads={"P": nn, "dO": q_like}, writes={"dV": kv_like}, flops=mm, flop_kind=flop_kind),
        kernel("dp", reads={"dO": q_like, "V": kv_like}, writes={"dP": nn}, flops=mm, flop_kind=flop_kind),
        kernel("ds", reads={"P": nn, "dP": nn, "O": q_like, "dO": q_like}, writes={"dS": nn}, flops=0),
        kernel("dq", reads={"dS": nn, "K": kv_like}, writes={"dQ": q_like}, flops=mm, flop_kind=flop_kind),
        kernel("dk", reads={"dS": nn, "Q": q_like}, writes={"dK": kv_like}, flops=mm, flop_kind=flop_kind),
    )
    return Cost("standard_bwd", kernels, _useful(B, Hq, Nq, Nk, d, causal, per_pair_flops=8))


def flash2_backward(B, Hq, Hkv, Nq, Nk, d, *, causal=False, elem_bytes=2, sram_bytes=None, Br=None,
                    Bc=None, hw=None, flop_kind="fp16") -> Cost:
    """FlashAttention-2 backward (Dao 2023, Algorithm 2): recomputes P from Q, K and lse instead of storing it.

    A preprocessing kernel computes D = rowsum(dO ∘ O). The main kernel loops over K/V tiles (outer: K_j, V_j read
    once, dK_j, dV_j written once) and the query blocks that see them (inner: Q_i, dO_i, lse_i, D_i read, and the
    float32 dQ_i accumulator read and written). A last kernel converts dQ to the input precision. Five matmuls
    per tile pair: S, dV, dP, dQ, dK (10·d FLOPs per pair element).

    With ``hw``: one unit per (batch, kv head, K/V tile), the K/V tiles of a head neighbours in the launch order;
    the units of a head in a wave stream the same Q_i, dO_i, lse_i, D_i and add into the same dQ_i (atomics
    resolve in L2), so those come from DRAM, and dQ_acc goes back to it, once per wave the head spans or once in
    all when a wave's live set fits (``reuse.shared_operand_reads``); the conversion reads dQ_acc from the
    shared cache when all of it fits.
    """
    B, Hq, Hkv, Nq, Nk, d, e, group, Br, Bc, _ = _setup(B, Hq, Hkv, Nq, Nk, d, elem_bytes, sram_bytes, Br, Bc,
                                                         keep="rows", hw=hw)
    _, _, _, sum_rows_keys, sum_rows_t = causal_tile_sums(Nq, Nk, Br, Bc, causal)
    visits = B * Hq * sum_rows_t
    q_like = B * Hq * Nq * d * e
    row_bytes = {"Q": d * e, "dO": d * e, "lse": STAT_BYTES, "D": STAT_BYTES, "dQ_acc": d * STAT_BYTES}
    main_reads = {"K": B * Hkv * Nk * d * e, "V": B * Hkv * Nk * d * e,
                  **{t: visits * row_bytes[t] for t in row_bytes}}
    main_writes = {"dK": B * Hkv * Nk * d * e, "dV": B * Hkv * Nk * d * e, "dQ_acc": visits * d * STAT_BYTES}
    sram_peak = flash_sram_bytes(Br, Bc, d, e, group) + (e + STAT_BYTES) * 2 * Bc * d
    dq_bytes = B * Hq * Nq * d * STAT_BYTES
    main_dram_reads = main_dram_writes = convert_dram = None
    if hw is not None:
        c = _in_flight(hw, sram_peak)
        tc = cdiv(Nk, Bc)
        # one head's Q, dO, lse, D and dQ_acc rows (a causal K/V tile sees the rows below its diagonal: on average
        # sum_rows_t / Tc of them)
        head = group * sum_rows_t / tc * sum(row_bytes.values())
        times = shared_operand_reads(B * Hkv, tc, c, head, c * 4 * Bc * d * e, hw.l2_bytes, hw.kind)
        rows_read = times * group * Nq  # query rows of one head, times the head is read, summed
        main_dram_reads = {"K": main_reads["K"], "V": main_reads["V"],
                           **{t: np.minimum(main_reads[t], rows_read * row_bytes[t]) for t in row_bytes}}
        main_dram_writes = {"dK": main_writes["dK"], "dV": main_writes["dV"],
                            "dQ_acc": np.minimum(main_writes["dQ_acc"], rows_read * row_bytes["dQ_acc"])}
        convert_dram = {"dQ_acc": np.where(resident(dq_bytes, hw.l2_bytes), 0, dq_bytes)}
    kernels = (
        kernel("bwd_preprocess", reads={"dO": q_like, "O": q_like}, writes={"D": B * Hq * Nq * STAT_BYTES}),
        kernel("flash2_bwd", reads=main_reads, writes=main_writes, flops=10 * d * B * Hq * sum_rows_keys,
               flop_kind=flop_kind,
               sram_peak_bytes=sram_peak, dram_reads=main_dram_reads, dram_writes=main_dram_writes),
        kernel("dq_convert", reads={"dQ_acc": dq_bytes}, writes={"dQ": q_like}, dram_reads=convert_dram),
    )
    return Cost("flash2_bwd", kernels, _useful(B, Hq, Nq, Nk, d, causal, per_pair_flops=8))


def decode(B, Hq, Hkv, n_cached, d, *, elem_bytes=2, capacity=None, sram_bytes=None, Bc=None, hw=None,
           flop_kind="fp16") -> Cost:
    """One decode step of one layer: a single new query per sequence against a KV cache of ``n_cached`` tokens,
    pruned to ``capacity`` tokens when given (SnapKV, StreamingLLM, H2O keep that many). The kernel is the
    flash forward with Nq = 1: K and V of the kept tokens are read once, per kv head."""
    n_cached, = check_sizes(n_cached=n_cached)
    n_kept = n_cached if capacity is None else np.minimum(n_cached, check_sizes(capacity=capacity)[0])
    cost = flash2_forward(B, Hq, Hkv, 1, n_kept, d, causal=True, elem_bytes=elem_bytes, sram_bytes=sram_bytes,
                          Br=1, Bc=Bc, hw=hw, flop_kind=flop_kind)
    return Cost("decode" if capacity is None else "decode_pruned", cost.kernels, cost.useful_flops,
                {**cost.params, "kept_tokens": n_kept})
