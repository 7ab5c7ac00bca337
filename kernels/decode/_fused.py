"""The per-token pieces of a Llama decoder block outside its matmuls, fused into a few serial Numba kernels for a
decode step (one new token against a preallocated KV cache): the residual add with RMSNorm, rotary embeddings on
Q and K with the cache write and the attention of the new query against the cache (in pieces of the cached slots,
which a fused step runs as parallel tasks), and the SwiGLU product.

A decode step of a small model spends as much time in NumPy's per-call overhead for these (a dozen small array
operations per block, and an ``np.concatenate`` of the whole cache per layer) as in streaming its weights; here a
block's step is three kernel calls beside its four linear layers, and the cache is written in place.

Sources: RMSNorm (Zhang & Sennrich 2019, eq. 4), rotary embeddings on interleaved pairs (Su et al. 2021,
RoFormer eq. 34, the layout GGUF checkpoints store Q and K in), grouped-query attention (Ainslie et al. 2023: query
head h reads kv head h // (Hq / Hkv)), SwiGLU (Shazeer 2020, eq. 6). Serial kernels: at SmolLM2's sizes (576
hidden, 9 heads, a cache of a few thousand tokens) a parallel launch costs more than the arithmetic.

Versions (2-vCPU Intel Xeon, Sapphire Rapids class, under contention):
  v1 (this file): three kernels per block. SmolLM2-135M decode, 64 tokens: fp32 40.3 tokens/s against 34.4 for
      the NumPy step with ``np.concatenate`` (one A/B run); in ``benchmarks/test_bench_smollm2.py`` fp32 35.1
      tokens/s = 0.89 of the weight-bytes bound (21.4 GB/s read), int8 77.4, int8 with the int8 LM head 106.3
      (3.0x fp32).
  v2: the attention's scores on explicit 16-lane vectors where the target has AVX-512F (``_dots_lanes``, part of
      ``_piece_lanes`` since v4), and its weighted sum of the values on vectors over the features
      (``_weighted_rows``), both in a fixed order of operations, so the per-layer path and the one-region step
      still agree bit for bit. One layer of SmolLM2's shape (9 query heads, 3 kv heads, d = 64) on one thread
      (2-vCPU Xeon, family 6 model 167): 21 cached slots 13.0 -> 4.8 us, 201 106 -> 34, 1001 536 -> 166, 4001 2212 ->
      776. The int8 + int8 head step with this and the int8 rows' epilogue of that session, alternating with both
      before in one process (10 rounds of 10 calls): 0.90x its time at 21 cached tokens, 0.52x at 1001 (22.9 -> 12.0
      ms).
  v3: the softmax's exp on ``kernels._common.numba_cpu.exp_f32`` (exp_row's polynomial, one value at a time) in a
      loop of its own, which vectorizes, instead of ``np.exp`` in the loop that also summed: one layer as in v2,
      1001 slots 201 -> 141 us, 4001 928 -> 703 us (21: 4.9 -> 4.7); the int8 + head step, alternating in one
      process, 0.956x at 1001 cached tokens (9.52 -> 9.13 ms), 0.952x at 21 (within the noise there).
  v4: the group's query heads together (``_piece_lanes``): the key and value rows in blocks of 16 KB that every
      head of the group reads while they are in L1, so that each row comes from memory once per group (it came
      once per head, from L2 while a group's cache fitted there and from memory beyond); the value sum's features
      in registers over a block (it loaded and stored o's slice per row), without a division per row and head;
      the maximum and l in lanes. 30 layers of SmolLM2's attention in turn on one thread (so that each layer's
      cache comes from memory, as in a token), two runs each alternating with v3: 21 slots 3.4-3.5 -> 3.0-3.1 us
      per layer, 201 27.2-28.9 -> 18.5-19.3, 1001 142-152 -> 90-94, 4001 818-843 -> 587-608. The one-region
      step's part beside its weights (``LlamaDecodeStep.fixed_seconds``, two threads): 1000 cached tokens 3.34
      -> 2.30 ms, 4000 18.3 -> 12.1 ms. ``generate`` of 32 tokens, int8 with the int8 LM head, alternating
      fresh processes with v3 (two pairs): after a 1000-token prompt 107-115 -> 122-127 tokens/s, after 4000
      42-45 -> 53-56, after 16 within the noise (230-241, 227-253).
  v5: a kv head's slots in pieces of PIECE_SLOTS (``_attend_piece``), combined in order (``_combine``), so that
      the fused step shares a long context among its threads (three kv heads on two threads had taken two heads'
      time). The step's part beside its weights (``fixed_seconds``, two threads), alternating with v4: 1000 cached
      tokens 2.48 -> 1.99 ms, 4000 13.4 -> 10.4 ms (one thread: 3.2-3.5 and 19.8-20.1 either way). ``generate``
      of 32 tokens, int8 with the int8 LM head, alternating fresh processes with v4 (two pairs, a slower phase of
      the VM than v4's runs): after a 1000-token prompt 108-111 -> 118-120 tokens/s, after 4000 50-52 -> 60-63,
      after 16 within the noise (185-195, 185-189).
  v6: SwiGLU's product on 16 lanes (``_silu_product``: ``exp_f32``, unsigned indices, NumPy's error model), so
      that the fused step's GATE_UP tasks, which compute it for their features between two runs of weight rows, no
      longer stop streaming for it (1536 features 11.3 -> 0.84 us on one core); the per-layer path
      (``swiglu``) computes the same bits. Measured with the panels' v2 (``kernels.int8.panels``): the step's
      docstring, v13.
  v7: ``_piece_lanes`` wherever the 16-lane vectors compile to vector code (``kernels._common.zmm.VECTORS``: AVX2
      with FMA too, two ymm registers per vector), not only with AVX-512F. There the loop's scores were chains of
      64 dependent scalar multiply-adds. 2-vCPU AMD EPYC (Zen 3, family 25 model 1, KVM), one piece of SmolLM2's
      group (3 query heads, d = 64) on one thread: 17 slots 3.07 -> 1.18 us, 200 28.0 -> 6.2, 1000 138 -> 25. The
      int8 + int8 head step's part beside its weights (``fixed_seconds``, two threads), the tree before and after
      in alternating fresh processes, three pairs: 16 cached tokens 0.70-0.89 -> 0.54-0.66 ms, 1000 8.1-8.6 ->
      2.8-3.7 ms. ``generate`` of 32 tokens after a 1000-token prompt, two pairs: 75.3-78.0 -> 119.2-130.9
      tokens/s; of 48 after a 16-token one 164-191 -> 172-203 (within the noise).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .._common.numba_cpu import EXP_MAX_F32, exp_f32
from .._common.prefetch import CACHE_LINE_BYTES
from .._common.zmm import (VECTORS as USE_LANES, LANES, fadd, ffma, fload, fload_first, fmax, fmax_lanes, fsplat,
                           fstore, fstore_first, fsum_halves, fzero)

PIECE_SLOTS = 512  # cached slots per piece of a kv head's attention (``_rope_attend``): 256 KB of keys and values
# at d = 64, against which combining a piece (a pass over group·d values) costs little, and few enough slots that
# a context of a thousand tokens gives each thread of a fused step its share of the pieces (three kv heads on two
# threads took two heads' time: SmolLM2's at 1000 cached tokens ran 0.70x its one-thread time on two)
T_BLOCK_BYTES = 16 * 1024  # the key or value rows that the group's heads read in turn while they are in L1: half
# the smallest L1 data cache of current x86 server cores (32 KiB: AMD Zen 2 to Zen 4, AMD's software optimization
# guides; Intel's from Ice Lake-SP on hold 48 KiB)


def rms_norm_reference(x, weight, eps):
    """float64 x / sqrt(mean(x²) + eps) · weight over the last axis."""
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope_reference(x, cos, sin):
    """float64 rotation of the interleaved pairs (2i, 2i+1) of x (..., d) by the angles whose cos, sin are (d/2,)."""
    x = np.asarray(x, dtype=np.float64)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


@njit(cache=True)
def _add_rms_norm(x, delta, weight, eps, h):
    """x += delta (the residual add, in place; an empty delta skips it), then h = x / sqrt(mean(x²) + eps) · weight;
    x, delta, weight, h (hidden,) float32, the mean of squares summed in float64."""
    n = x.size
    if delta.size:
        for i in range(n):
            x[i] += delta[i]
    ss = 0.0
    for i in range(n):
        ss += np.float64(x[i]) * x[i]
    inv = np.float32(1.0 / math.sqrt(ss / n + eps))
    for i in range(n):
        h[i] = x[i] * inv * weight[i]


@njit(inline="always")
def _rotate(src, s0, dst, d0, cos, sin):
    """dst[d0 : d0 + d] = src[s0 : s0 + d] with its pairs (2i, 2i+1) rotated by (cos[i], sin[i])."""
    for i in range(cos.size):
        even, odd = src[s0 + 2 * i], src[s0 + 2 * i + 1]
        dst[d0 + 2 * i] = even * cos[i] - odd * sin[i]
        dst[d0 + 2 * i + 1] = even * sin[i] + odd * cos[i]


@njit(cache=True)
def _rope_attend(qkv, cos, sin, k_cache, v_cache, n, scale, o):
    """One decode step of attention for the new token at cache slot n.

    qkv (Hq·d + 2·Hkv·d,) float32: the token's projected query, key and value heads, as one linear gives them;
    cos, sin (d/2,): its rotary angles; k_cache, v_cache (Hkv, capacity, d), capacity > n. Rotates the query and
    key heads, writes the key and value into slot n, and o (Hq·d,) = softmax(scale · q·Kᵀ) V over slots 0..n of
    the query head's kv head (the new token attends to itself and everything before it).

    Each kv head's slots are taken PIECE_SLOTS at a time (``_attend_piece``) and the pieces combined
    (``_combine``), in this order whoever runs them: the fused step runs the pieces of all kv heads as parallel
    tasks and gets these outputs bit for bit.
    """
    Hkv, _, d = k_cache.shape
    group = (qkv.size - 2 * Hkv * d) // d // Hkv
    pieces = n // PIECE_SLOTS + 1
    width = piece_width(group, d)
    parts = np.empty(pieces * width, dtype=np.float32)
    for g in range(Hkv):
        _rope_write(qkv, cos, sin, k_cache, v_cache, n, g)
        for c in range(pieces):
            _attend_piece(qkv, cos, sin, k_cache, v_cache, g, c * PIECE_SLOTS, min((c + 1) * PIECE_SLOTS, n + 1),
                          scale, parts[c * width:(c + 1) * width])
        _combine(parts, pieces, group, d, o[g * group * d:(g + 1) * group * d])


@njit(inline="always")
def piece_width(group, d):
    """float32 values of one piece's partial result: the group's unnormalized outputs (group·d), then each head's
    maximum score and sum of weights, padded to whole 64-byte lines (pieces that two threads write side by side
    share no line)."""
    line = CACHE_LINE_BYTES // 4  # float32 values per line
    return -(-(group * d + 2 * group) // line) * line


@njit(cache=True)
def _rope_write(qkv, cos, sin, k_cache, v_cache, n, g):
    """Rotate the new token's key of kv head g and write it and its value into slot n."""
    Hkv, _, d = k_cache.shape
    Hq = (qkv.size - 2 * Hkv * d) // d
    k_new = np.empty(d, dtype=np.float32)  # (d,)
    _rotate(qkv, (Hq + g) * d, k_new, 0, cos, sin)
    for j in range(d):
        k_cache[g, n, j] = k_new[j]
        v_cache[g, n, j] = qkv[(Hq + Hkv + g) * d + j]


@njit(cache=True)
def _attend_piece(qkv, cos, sin, k_cache, v_cache, g, t0, t1, scale, part):
    """The attention of kv head g's query heads (GQA) over slots t0 .. t1 − 1 alone: part (``piece_width``) gets,
    per head, Σ_t p_t v_t with p_t = exp(s_t − m), the maximum score m of the piece and l = Σ_t p_t."""
    Hkv, _, d = k_cache.shape
    Hq = (qkv.size - 2 * Hkv * d) // d
    group = Hq // Hkv
    q = np.empty(group * d, dtype=np.float32)  # the group's rotated query heads, one after the other
    for i in range(group):
        _rotate(qkv, (g * group + i) * d, q, i * d, cos, sin)
    s = np.empty(group * (t1 - t0), dtype=np.float32)  # their scores, then their softmax weights, head by head
    _piece(q, k_cache[g], v_cache[g], t0, t1, scale, s, part)


@njit(cache=True)
def _combine(parts, pieces, group, d, out):
    """out (group·d,) = the softmax-weighted values over all pieces from their partial results (``pieces`` of
    them, ``piece_width`` values each): with M the largest of the pieces' maxima, piece c's outputs weighted by
    exp(m_c − M) / Σ_c exp(m_c − M) · l_c (the rescaling of the online softmax: Milakov & Gimelshein 2018,
    eq. 4), summed over the pieces in order."""
    width = piece_width(group, d)
    for i in range(group):
        big = np.float32(-np.inf)
        for c in range(pieces):
            big = max(big, parts[c * width + group * d + i])
        total = np.float32(0.0)
        for c in range(pieces):
            total += exp_f32(parts[c * width + group * d + i] - big) * parts[c * width + group * d + group + i]
        for j in range(d):
            out[i * d + j] = 0.0
        for c in range(pieces):
            w = exp_f32(parts[c * width + group * d + i] - big) / total
            for j in range(d):
                out[i * d + j] += w * parts[c * width + i * d + j]


@njit(cache=True)
def _piece_loop(q, keys, values, t0, t1, scale, s, part):
    """``_attend_piece``'s arithmetic for the query heads q (group·d,) over rows t0 .. t1 − 1 of keys and values
    (capacity, d), s (group·(t1 − t0),) scratch: head by head, the portable path of ``_piece``."""
    d = keys.shape[1]
    group = q.size // d
    n = t1 - t0
    for i in range(group):
        si = s[i * n:(i + 1) * n]
        # scores s_t = scale · q·k_t and their maximum (the softmax is shifted by it, exactly as the oracle's)
        _dots_loop(q[i * d:(i + 1) * d], keys[t0:t1], n, si)
        m = np.float32(-np.inf)  # (a float64 -inf would make the exp loop's arithmetic float64)
        for t in range(n):
            si[t] *= scale
            m = max(m, si[t])
        # p_t = exp(s_t − m) (a loop without a sum, which vectorizes), l = Σ p_t, Σ p_t v_t
        for t in range(n):
            si[t] = exp_f32(si[t] - m)
        l = np.float32(0.0)
        for t in range(n):
            l += si[t]
        _weighted_rows(si, values[t0:t1], n, part[i * d:(i + 1) * d])
        part[group * d + i] = m
        part[group * d + group + i] = l


@njit(cache=True)
def _piece_lanes(q, keys, values, t0, t1, scale, s, part):
    """``_piece_loop`` on ``kernels._common.zmm``'s 16-lane vectors (AVX-512F, or AVX2 with FMA: two ymm registers
    each), the group's heads together: the key and value rows are taken T_BLOCK_BYTES at a time and every head
    reads them while they are in L1, so each row comes from memory once per group, not once per head. A score is a
    fused multiply-add per 16 features (the last d mod 16 by a masked load) and its lanes summed in a fixed tree;
    the maximum in lanes (exact in any order); l summed in 16 lanes, then the same tree; Σ_t p_t v_t in t order, a
    fused multiply-add per 16 features, four vectors of features held in registers over a block of rows.

    Explicit vector operations, so the order of every sum is the code's, whatever function LLVM inlines this into
    (with loops that fast-math let LLVM reassociate, the fused step and the per-layer path differed in the last
    bit). Every loop written out here: an inlined helper taking the arrays counted a reference on each per score
    (atomic updates of lines that all threads share), 28 us for 1001 scores of d = 64 against 5."""
    kflat, vflat = keys.reshape(-1), values.reshape(-1)  # one view each (a view counts a reference: see
    # kernels/decode/_step.py, v4)
    d = keys.shape[1]
    group = q.size // d
    n = t1 - t0
    full = d - d % LANES  # features in whole vectors
    quads = d - d % (4 * LANES)  # features in groups of four vectors
    block = max(1, T_BLOCK_BYTES // (4 * d))  # rows of keys (or values) per block
    for b0 in range(0, n, block):
        b1 = min(b0 + block, n)
        for i in range(group):
            for t in range(b0, b1):
                p = (t0 + t) * d
                acc = fzero()
                for j in range(0, full, LANES):
                    acc = ffma(fload(q, i * d + j), fload(kflat, p + j), acc)
                if full < d:
                    acc = ffma(fload_first(q, i * d + full, d - full), fload_first(kflat, p + full, d - full), acc)
                s[i * n + t] = fsum_halves(acc) * scale
    whole = n - n % LANES  # scores in whole vectors
    for i in range(group):
        base = i * n
        m = np.float32(-np.inf)  # (a float64 -inf would make the exp loop's arithmetic float64)
        if whole:
            vm = fload(s, base)
            for t in range(LANES, whole, LANES):
                vm = fmax(vm, fload(s, base + t))
            m = fmax_lanes(vm)
        for t in range(whole, n):
            m = max(m, s[base + t])
        for t in range(n):
            s[base + t] = exp_f32(s[base + t] - m)
        acc = fzero()
        for t in range(0, whole, LANES):
            acc = fadd(acc, fload(s, base + t))
        if whole < n:
            acc = fadd(acc, fload_first(s, base + whole, n - whole))
        part[group * d + i] = m
        part[group * d + group + i] = fsum_halves(acc)
    for j in range(group * d):
        part[j] = 0.0
    for b0 in range(0, n, block):
        b1 = min(b0 + block, n)
        for i in range(group):
            base, o0 = i * n, i * d
            for f in range(0, quads, 4 * LANES):
                a0, a1 = fload(part, o0 + f), fload(part, o0 + f + LANES)
                a2, a3 = fload(part, o0 + f + 2 * LANES), fload(part, o0 + f + 3 * LANES)
                for t in range(b0, b1):
                    w, p = fsplat(s[base + t]), (t0 + t) * d + f
                    a0 = ffma(w, fload(vflat, p), a0)
                    a1 = ffma(w, fload(vflat, p + LANES), a1)
                    a2 = ffma(w, fload(vflat, p + 2 * LANES), a2)
                    a3 = ffma(w, fload(vflat, p + 3 * LANES), a3)
                fstore(part, o0 + f, a0)
                fstore(part, o0 + f + LANES, a1)
                fstore(part, o0 + f + 2 * LANES, a2)
                fstore(part, o0 + f + 3 * LANES, a3)
            for f in range(quads, full, LANES):
                a0 = fload(part, o0 + f)
                for t in range(b0, b1):
                    a0 = ffma(fsplat(s[base + t]), fload(vflat, (t0 + t) * d + f), a0)
                fstore(part, o0 + f, a0)
            if full < d:
                tail = d - full
                a0 = fload_first(part, o0 + full, tail)
                for t in range(b0, b1):
                    a0 = ffma(fsplat(s[base + t]), fload_first(vflat, (t0 + t) * d + full, tail), a0)
                fstore_first(part, o0 + full, tail, a0)


@njit(cache=True)
def _dots_loop(q, keys, n, s):
    """s[t] = q·keys[t] for t < n (q (d,), keys (capacity, d)), summed in feature order: the portable path's scores
    (LLVM vectorizes no float sum that it may not reassociate)."""
    for t in range(n):
        acc = np.float32(0.0)
        for j in range(q.size):
            acc += q[j] * keys[t, j]
        s[t] = acc


@njit(cache=True)
def _weighted_rows(p, values, n, out):
    """out = Σ_{t < n} p[t] · values[t]: values (capacity, d), out (d,), summed over t in order. Each lane of a
    vector is one output feature, so LLVM vectorizes it without reordering any sum (out[j] += ... on a head's own
    slice: an index into the whole o left it scalar, 7x slower at n = 1001)."""
    for j in range(out.size):
        out[j] = 0.0
    for t in range(n):
        for j in range(out.size):
            out[j] += p[t] * values[t, j]


_piece = _piece_lanes if USE_LANES else _piece_loop


@njit(cache=True, error_model="numpy")
def _silu_product(gate_up, n, out, i0, i1):
    """out[i] = silu(g) · u = g / (1 + e^-g) · u, g = gate_up[i] and u = gate_up[n + i], for the features
    i0 .. i1 − 1 (0 <= i0, i1 <= n) of a fused gate/up linear's output [gate (n,), up (n,)]: SwiGLU's product (Shazeer
    2020, eq. 6), any run of it the same bits (each feature alone, no sum).

    On 16 lanes (v6): the exp is ``exp_f32`` (a polynomial LLVM vectorizes; ``np.exp`` is a call per value), the
    indices unsigned (a signed index may be negative, and its wrap-around made LLVM gather and scatter the lanes),
    and NumPy's error model (Python's checks each division for a zero divisor, which kept the loop scalar). 1536
    features (SmolLM2's intermediate size) on one core: 11.3 -> 0.84 us. Against ``np.exp``'s values, over 10^7
    normally distributed gates (standard deviations 0.1 to 200) and ups: at most 6 ulp apart for g >= -87 (5 for
    silu(g) alone); below, both are under 1.5e-36·|u| in magnitude. For g < -88 (-EXP_MAX_F32, where exp_f32 clamps
    its argument) silu(g) is g·0: -0, as np.exp's overflow to inf gave past -88.72, and NaN for g = -inf."""
    first, last, up = np.uint64(i0), np.uint64(i1), np.uint64(n)
    for i in range(first, last):
        g = gate_up[i]
        silu = g / (np.float32(1.0) + exp_f32(-g)) if g >= np.float32(-EXP_MAX_F32) else g * np.float32(0.0)
        out[i] = silu * gate_up[up + i]


@njit(cache=True)
def _swiglu(gate_up, out):
    """out = silu(gate) · up for gate_up (2·I,) = [gate, up] (the fused gate/up linear's output), out (I,)."""
    _silu_product(gate_up, out.size, out, 0, out.size)


# -- the public functions: shapes checked before a kernel indexes memory (the kernels index by the sizes given) -----
def _vectors(written=(), **arrays):
    """Each array float32 and C-contiguous, and those named in ``written`` writeable (the kernels write them in
    place: a read-only one was a Numba TypingError)."""
    for name, a in arrays.items():
        if not isinstance(a, np.ndarray) or a.dtype != np.float32:
            raise TypeError(f"{name} must be a C-contiguous float32 numpy.ndarray; got "
                            f"{getattr(a, 'dtype', type(a).__name__)}")
        if not a.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous (the kernels index its memory); got a strided view of "
                             f"shape {a.shape} and strides {a.strides}")
        if name in written and not a.flags.writeable:
            raise ValueError(f"{name} must be writeable: it is written in place")


def add_rms_norm(x, delta, weight, eps, h):
    """x += delta (in place; an empty delta skips the add), then h = RMSNorm(x) · weight (Zhang & Sennrich 2019,
    eq. 4); x, weight, h (hidden,) and delta (hidden,) or (0,), all float32."""
    _vectors(("x", "h"), x=x, delta=delta, weight=weight, h=h)
    if not (x.ndim == delta.ndim == weight.ndim == h.ndim == 1) or weight.size != x.size or h.size != x.size \
            or delta.size not in (0, x.size) or x.size == 0:
        raise ValueError(f"x, weight, h must be (hidden,) with hidden >= 1 and delta (hidden,) or (0,); got x "
                         f"{x.shape}, delta {delta.shape}, weight {weight.shape}, h {h.shape}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite number > 0; got {eps!r}")
    _add_rms_norm(x, delta, weight, eps, h)


def rope_attend(qkv, cos, sin, k_cache, v_cache, n, scale, o):
    """One decode step of attention for the new token at cache slot ``n``: qkv (Hq·d + 2·Hkv·d,) the token's
    projected heads, cos, sin (d/2,) its rotary angles, k_cache, v_cache (Hkv, capacity, d) with n < capacity; the
    key and value are written into slot n and o (Hq·d,) gets the attention over slots 0..n. All float32."""
    _vectors(("k_cache", "v_cache", "o"), qkv=qkv, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache, o=o)
    if k_cache.ndim != 3 or v_cache.shape != k_cache.shape or 0 in k_cache.shape:
        raise ValueError(f"k_cache and v_cache must be (Hkv, capacity, d) alike; got {k_cache.shape}, "
                         f"{v_cache.shape}")
    if np.shares_memory(k_cache, v_cache):  # the value written over the key read after it
        raise ValueError("k_cache and v_cache must not share memory")
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)) \
            or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0 (1/sqrt(d) in a Llama); got {scale!r}")
    Hkv, capacity, d = k_cache.shape
    heads, rest = divmod(qkv.size - 2 * Hkv * d, d) if d else (0, 1)
    if qkv.ndim != 1 or rest or heads < 1 or heads % Hkv or o.shape != (heads * d,) or d % 2 \
            or cos.shape != (d // 2,) or sin.shape != (d // 2,):
        raise ValueError(f"qkv must be (Hq·d + 2·Hkv·d,) with Hq a multiple of Hkv, o (Hq·d,), cos and sin (d/2,) "
                         f"for an even d; got qkv {qkv.shape}, o {o.shape}, cos {cos.shape}, sin {sin.shape}, "
                         f"caches {k_cache.shape}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n < capacity:
        raise ValueError(f"n must be a slot of the cache, an int in [0, {capacity}); got {n!r}")
    _rope_attend(qkv, cos, sin, k_cache, v_cache, int(n), scale, o)


def swiglu(gate_up, out):
    """out = silu(gate) · up (Shazeer 2020, eq. 6) for gate_up (2·I,) = [gate, up] and out (I,), float32."""
    _vectors(("out",), gate_up=gate_up, out=out)
    if gate_up.ndim != 1 or out.ndim != 1 or gate_up.size != 2 * out.size:
        raise ValueError(f"gate_up must be (2·I,) and out (I,); got {gate_up.shape}, {out.shape}")
    _swiglu(gate_up, out)
