"""Attention on the GPU in Numba-CUDA: the readable tier, to be read line by line beside the papers.

- ``flash_forward``: FlashAttention-2's forward (Dao 2023, Algorithm 1). One block per (batch · query head,
  query tile); thread t of the block owns query row r0 + t. The query tile and the current K and V tiles sit in
  shared memory; every thread keeps its row's running max m, running sum l and unnormalized output in registers
  (local memory for the output row), and rescales them when a key tile raises the max. With a causal mask a block
  stops at the last key its last row can see (tile skipping). GQA: query head h reads kv head h // (Hq / Hkv).
- Split-KV (Flash-Decoding, Dao et al. 2023): with few query tiles (decode), the keys are split over
  ``blockIdx.y``; each split writes its normalized partial output and log-sum-exp, and ``combine_splits`` merges
  them: o = Σ_s e^{lse_s − M} o_s / Σ_s e^{lse_s − M}, lse = M + log Σ_s e^{lse_s − M}.
- ``standard_forward``: the algorithm FlashAttention replaces, as three kernels with S and P in global memory:
  S = scale · Q Kᵀ (masked), P = softmax(S) row by row in place, O = P V. The measured baseline.

Tile sizes are arguments with defaults (``default_tiles``), never literals inside a kernel: each kernel is
compiled once per (head dim, tile sizes, dtype). The shared memory each launch needs is computed from the tiles
next to the launch and checked against the device's per-block limit.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda  # a module global, which Numba's simulator swaps for its own (this file is imported lazily)

from .._common import gpu as _gpu
from .._common.numba_cuda import block_max, block_sum, fill

# Launch shapes of the standard algorithm and the split combine. Under Numba's simulator every thread is a Python
# thread, so there the blocks shrink (the kernels take any power-of-two size; the tests run both).
MATMUL_TILE = 4 if _gpu.simulated() else 16  # T × T threads per block in the two matmul kernels
SOFTMAX_THREADS = 4 if _gpu.simulated() else 128  # threads per row in the softmax (a power of two: tree sums;
# simulated, each level of the tree is a barrier that costs the simulator milliseconds: a standard attention of
# (2, 3, 5, 4) took 7.2 s with 8 threads per row, 4.8 s with 4, on the 2-vCPU Xeon; 4 still leaves a thread idle
# where a row has fewer than 4 keys)
COMBINE_THREADS = 128


def default_tiles(d: int, elem_bytes: int) -> tuple[int, int]:
    """(Br, Bc): Br query rows (one thread each) and the largest power-of-two Bc whose Q, K and V tiles,
    (Br + 2·Bc)·d elements, fit the 48 KiB a block gets without opt-in."""
    Br = 64 if d <= 64 else 32 if d <= 128 else 16
    Bc = 128
    while Bc > 1 and flash_shared_bytes(Br, Bc, d, elem_bytes) > _gpu.STATIC_SHARED_LIMIT:
        Bc //= 2
    return Br, Bc


def flash_shared_bytes(Br: int, Bc: int, d: int, elem_bytes: int) -> int:
    """Shared memory of one flash block: the Q tile (Br × d) and the K and V tiles (Bc × d each)."""
    return (Br + 2 * Bc) * d * elem_bytes


def _numba_dtype(dtype):
    from numba import float32, float64

    return float64 if np.dtype(dtype) == np.float64 else float32


@functools.lru_cache(maxsize=None)
def _flash_kernel(D: int, BR: int, BC: int, dtype: str):
    ftype = _numba_dtype(dtype)
    fl = np.dtype(dtype).type  # constants in the kernel's float type, so float32 math stays float32

    @cuda.jit
    def flash_forward_kernel(q, k, v, o_part, lse_part, scale, causal, n_q_tiles, keys_per_split):
        """Grid (B · Hq · n_q_tiles, n_splits), BR threads per block; writes split blockIdx.y's normalized
        output and log-sum-exp (the only split when n_splits = 1)."""
        Hq, Nq = q.shape[1], q.shape[2]
        Hkv, Nk = k.shape[1], k.shape[2]
        t = cuda.threadIdx.x
        split = cuda.blockIdx.y
        q_tile = cuda.blockIdx.x % n_q_tiles
        bh = cuda.blockIdx.x // n_q_tiles
        b = bh // Hq
        h = bh % Hq
        hk = h // (Hq // Hkv)  # GQA: the kv head this query head reads
        r0 = q_tile * BR
        row = r0 + t  # this thread's query row
        offset = Nk - Nq  # causal mask aligned bottom-right: row i sees keys j <= i + offset

        q_s = cuda.shared.array((BR, D), ftype)
        k_s = cuda.shared.array((BC, D), ftype)
        v_s = cuda.shared.array((BC, D), ftype)
        acc = cuda.local.array(D, ftype)  # this row's unnormalized output, Σ_j e^{s_j − m} v_j
        p = cuda.local.array(BC, ftype)  # this row's scores, then probabilities, for the current key tile

        for e in range(t, BR * D, BR):  # the block loads the Q tile together, BR elements per step
            i = e // D
            c = e % D
            q_s[i, c] = q[b, h, r0 + i, c] if r0 + i < Nq else fl(0.0)
        for c in range(D):
            acc[c] = fl(0.0)
        m = fl(-math.inf)  # running max of this row's scores (unscaled)
        l = fl(0.0)  # running Σ e^{scale·(s_j − m)}
        nan = False  # a NaN score poisons the row (the device's max drops NaN, so it is tracked here)

        # the keys this block works on: its split of [0, k_end), where k_end stops at the last key the tile's
        # last row can see under the causal mask (tiles beyond it are skipped, not loaded)
        k_end = Nk
        if causal:
            k_end = min(Nk, max(0, min(r0 + BR, Nq) + offset))
        k_begin = split * keys_per_split
        k_stop = min(k_end, k_begin + keys_per_split)
        cuda.syncthreads()

        for j0 in range(k_begin, k_stop, BC):  # the same trip count in every thread of the block
            for e in range(t, BC * D, BR):
                j = e // D
                c = e % D
                inside = j0 + j < Nk
                k_s[j, c] = k[b, hk, j0 + j, c] if inside else fl(0.0)
                v_s[j, c] = v[b, hk, j0 + j, c] if inside else fl(0.0)
            cuda.syncthreads()

            m_tile = fl(-math.inf)
            for j in range(BC):
                key = j0 + j
                s = fl(-math.inf)
                if row < Nq and key < k_stop and (not causal or key <= row + offset):
                    dot = fl(0.0)
                    for c in range(D):
                        dot += q_s[t, c] * k_s[j, c]
                    s = dot  # unscaled: the max is subtracted before scaling, so no scale overflows a row
                p[j] = s
                if s != s:
                    nan = True
                elif s > m_tile:
                    m_tile = s
            m_new = max(m, m_tile)
            # the keys of this tile that this row sees: masked ones stay out of P·V, so that a NaN in a masked
            # v row does not reach it (0 · NaN = NaN)
            j_end = min(BC, k_stop - j0)
            if causal:
                j_end = max(0, min(j_end, row + offset - j0 + 1))
            if m_new > -math.inf:  # this row sees a finite score in this tile, or saw one before
                alpha = math.exp((m - m_new) * scale)  # rescales what was summed under the old max (0 before)
                l_tile = fl(0.0)
                for j in range(j_end):
                    p[j] = math.exp((p[j] - m_new) * scale)  # a score of +inf gives inf − inf = NaN, as the oracle
                    l_tile += p[j]
                l = l * alpha + l_tile
                for c in range(D):
                    a = acc[c] * alpha
                    for j in range(j_end):
                        a += p[j] * v_s[j, c]
                    acc[c] = a
                m = m_new
            cuda.syncthreads()  # everyone is done with this K/V tile before the next one overwrites it

        if row < Nq:
            if nan:
                for c in range(D):
                    o_part[split, b, h, row, c] = fl(math.nan)
                lse_part[split, b, h, row] = fl(math.nan)
            elif l == 0.0:  # no visible key, or only scores of −inf (in this split): zeros and lse = −inf
                for c in range(D):
                    o_part[split, b, h, row, c] = fl(0.0)
                lse_part[split, b, h, row] = -math.inf
            else:  # l > 0, or NaN (a score of +inf), which propagates
                inv = fl(1.0) / l
                for c in range(D):
                    o_part[split, b, h, row, c] = acc[c] * inv
                lse_part[split, b, h, row] = m * scale + math.log(l)

    return flash_forward_kernel


@functools.lru_cache(maxsize=None)
def _combine_kernel():

    @cuda.jit
    def combine_splits(o_part, lse_part, o, lse):
        """One thread per query row: merge the splits' outputs weighted by e^{lse_s − M}."""
        S, B, H, N, D = o_part.shape
        idx = cuda.grid(1)
        if idx >= B * H * N:
            return
        b = idx // (H * N)
        h = (idx // N) % H
        i = idx % N
        top = -math.inf
        nan = False
        for s in range(S):
            x = lse_part[s, b, h, i]
            if x != x:
                nan = True
            elif x > top:
                top = x
        if nan:  # a split whose keys gave NaN: the row is NaN whatever the others saw
            for c in range(D):
                o[b, h, i, c] = math.nan
            lse[b, h, i] = math.nan
            return
        if top == -math.inf:
            for c in range(D):
                o[b, h, i, c] = 0.0
            lse[b, h, i] = -math.inf
            return
        total = 0.0
        for s in range(S):
            total += math.exp(lse_part[s, b, h, i] - top)
        for c in range(D):
            a = 0.0
            for s in range(S):
                a += math.exp(lse_part[s, b, h, i] - top) * o_part[s, b, h, i, c]
            o[b, h, i, c] = a / total
        lse[b, h, i] = top + math.log(total)

    return combine_splits


def split_count(tasks: int, n_key_tiles: int, multiprocessors: int) -> int:
    """Split-KV factor: enough key splits that the grid has two blocks per multiprocessor, at most one split per
    key tile (Flash-Decoding's rule of thumb: fill the machine when batch · heads · query tiles cannot)."""
    if tasks >= 2 * multiprocessors or n_key_tiles <= 1:
        return 1
    return max(1, min(n_key_tiles, math.ceil(2 * multiprocessors / tasks)))


def flash_forward(q, k, v, scale, causal, block_q=None, block_k=None, n_splits=None):
    """FlashAttention-2 on Numba device arrays q (B, Hq, Nq, d), k, v (B, Hkv, Nk, d) of one float dtype;
    returns device arrays (o, lse). ``n_splits``: key splits (default: ``split_count``)."""
    _gpu.require_numba_cuda()
    B, Hq, Nq, d = q.shape
    Nk = k.shape[2]
    elem_bytes = np.dtype(q.dtype).itemsize
    Br, Bc = default_tiles(d, elem_bytes)
    Br, Bc = block_q or Br, block_k or Bc
    _gpu.check_static_shared_memory(flash_shared_bytes(Br, Bc, d, elem_bytes),
                             f"flash attention tiles Br={Br}, Bc={Bc}, d={d} ({np.dtype(q.dtype).name})")
    n_q_tiles = max(1, math.ceil(Nq / Br))
    n_key_tiles = max(1, math.ceil(Nk / Bc))
    if n_splits is None:
        n_splits = split_count(B * Hq * n_q_tiles, n_key_tiles, _multiprocessors())
    n_splits = max(1, min(n_splits, n_key_tiles))
    keys_per_split = math.ceil(n_key_tiles / n_splits) * Bc
    o_part = cuda.device_array((n_splits, B, Hq, Nq, d), dtype=q.dtype)
    lse_part = cuda.device_array((n_splits, B, Hq, Nq), dtype=q.dtype)
    if B * Hq * Nq:
        kernel = _flash_kernel(d, Br, Bc, np.dtype(q.dtype).name)
        kernel[(B * Hq * n_q_tiles, n_splits), Br](q, k, v, o_part, lse_part, np.dtype(q.dtype).type(scale),
                                                    causal, n_q_tiles, keys_per_split)
    if n_splits == 1:
        return o_part[0], lse_part[0]
    o = cuda.device_array((B, Hq, Nq, d), dtype=q.dtype)
    lse = cuda.device_array((B, Hq, Nq), dtype=q.dtype)
    rows = B * Hq * Nq
    _combine_kernel()[_gpu.launch_1d(rows, COMBINE_THREADS)](o_part, lse_part, o, lse)
    return o, lse


def _multiprocessors() -> int:
    return int(getattr(cuda.get_current_device(), "MULTIPROCESSOR_COUNT", 1) or 1)


# -- the standard algorithm: S and P in global memory ---------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _standard_kernels(T: int, THREADS: int, dtype: str):
    ftype = _numba_dtype(dtype)
    fl = np.dtype(dtype).type

    @cuda.jit
    def scores_kernel(q, k, s, causal):
        """S[b, h, i, j] = q_i · k_j (unscaled), or −inf where the causal mask hides j. Grid (⌈Nk/T⌉, ⌈Nq/T⌉,
        B · Hq), T × T threads; T × T tiles of Q and K in shared memory, stepping over d."""
        Hq, Nq, d = q.shape[1], q.shape[2], q.shape[3]
        Hkv, Nk = k.shape[1], k.shape[2]
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        b = cuda.blockIdx.z // Hq
        h = cuda.blockIdx.z % Hq
        hk = h // (Hq // Hkv)
        i = cuda.blockIdx.y * T + ty
        j = cuda.blockIdx.x * T + tx
        j_load = cuda.blockIdx.x * T + ty  # the key row this thread loads into the K tile
        q_s = cuda.shared.array((T, T), ftype)
        k_s = cuda.shared.array((T, T), ftype)
        acc = fl(0.0)
        for c0 in range(0, d, T):
            q_s[ty, tx] = q[b, h, i, c0 + tx] if i < Nq and c0 + tx < d else fl(0.0)
            k_s[ty, tx] = k[b, hk, j_load, c0 + tx] if j_load < Nk and c0 + tx < d else fl(0.0)
            cuda.syncthreads()
            for c in range(T):
                acc += q_s[ty, c] * k_s[tx, c]
            cuda.syncthreads()
        if i < Nq and j < Nk:
            s[b, h, i, j] = acc if not causal or j <= i + Nk - Nq else fl(-math.inf)

    @cuda.jit
    def softmax_kernel(s, lse, scale):
        """P = softmax(scale · S) in place, one block of THREADS threads per row of s (rows, Nk), the max subtracted
        before scaling; a row with no visible key, or only scores of −inf, becomes zeros (lse −inf); a NaN score
        makes the row NaN (counted apart: the device's max drops NaN)."""
        row = cuda.blockIdx.x
        t = cuda.threadIdx.x
        n = s.shape[1]
        red = cuda.shared.array(THREADS, ftype)
        m = fl(-math.inf)
        nans = fl(0.0)
        for j in range(t, n, THREADS):
            x = s[row, j]
            if x != x:
                nans += fl(1.0)
            elif x > m:
                m = x
        m = block_max(red, m)
        nans = block_sum(red, nans)
        total = fl(0.0)
        if m > -math.inf:
            for j in range(t, n, THREADS):
                e = math.exp((s[row, j] - m) * scale)
                s[row, j] = e
                total += e
        total = block_sum(red, total)
        for j in range(t, n, THREADS):
            if nans > 0.0:
                s[row, j] = fl(math.nan)
            else:
                s[row, j] = s[row, j] / total if total != 0.0 else fl(0.0)
        if t == 0:
            if nans > 0.0:
                lse[row] = math.nan
            else:
                lse[row] = m * scale + math.log(total) if total != 0.0 else -math.inf

    @cuda.jit
    def pv_kernel(p, v, o, lse, causal):
        """O[b, h, i, c] = Σ_j P[b, h, i, j] · v[b, kv(h), j, c] over the keys row i sees (a masked key's P is 0,
        but a NaN in its v row must not reach the row: 0 · NaN = NaN); 0 for a row with no weight anywhere
        (lse −inf). Grid (⌈d/T⌉, ⌈Nq/T⌉, B · Hq), T × T threads."""
        Hq, Nq, Nk = p.shape[1], p.shape[2], p.shape[3]
        Hkv, d = v.shape[1], v.shape[3]
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        b = cuda.blockIdx.z // Hq
        h = cuda.blockIdx.z % Hq
        hk = h // (Hq // Hkv)
        i = cuda.blockIdx.y * T + ty
        c = cuda.blockIdx.x * T + tx
        p_s = cuda.shared.array((T, T), ftype)
        v_s = cuda.shared.array((T, T), ftype)
        acc = fl(0.0)
        for j0 in range(0, Nk, T):
            p_s[ty, tx] = p[b, h, i, j0 + tx] if i < Nq and j0 + tx < Nk else fl(0.0)
            v_s[ty, tx] = v[b, hk, j0 + ty, c] if j0 + ty < Nk and c < d else fl(0.0)
            cuda.syncthreads()
            for j in range(T):
                if not causal or j0 + j <= i + Nk - Nq:
                    acc += p_s[ty, j] * v_s[j, tx]
            cuda.syncthreads()
        if i < Nq and c < d:
            o[b, h, i, c] = acc if lse[b, h, i] > -math.inf or lse[b, h, i] != lse[b, h, i] else fl(0.0)

    return scores_kernel, softmax_kernel, pv_kernel


def standard_forward(q, k, v, scale, causal, tile=None, threads=None):
    """The three-kernel standard attention on Numba device arrays; returns (o, lse). S (overwritten by P in
    place: the same bytes move as with two buffers) is B·Hq·Nq·Nk elements of global memory, refused before
    allocation when the device has less free. ``tile``: T of the T × T matmul blocks; ``threads``: threads per
    softmax row."""
    _gpu.require_numba_cuda()
    B, Hq, Nq, d = q.shape
    Nk = k.shape[2]
    elem_bytes = np.dtype(q.dtype).itemsize
    _gpu.ensure_device_fits(B * Hq * Nq * Nk * elem_bytes,
                            f"attention(algorithm='standard') for S of shape ({B}, {Hq}, {Nq}, {Nk})")
    T, threads = tile or MATMUL_TILE, threads or SOFTMAX_THREADS
    if threads & (threads - 1):
        raise ValueError(f"threads must be a power of two (tree reductions); got {threads}")
    _gpu.check_static_shared_memory((2 * T * T) * elem_bytes, f"standard attention matmul tiles {T}x{T}")
    scores, softmax, pv = _standard_kernels(T, threads, np.dtype(q.dtype).name)
    s = cuda.device_array((B, Hq, Nq, Nk), dtype=q.dtype)
    o = cuda.device_array((B, Hq, Nq, d), dtype=q.dtype)
    lse = cuda.device_array((B, Hq, Nq), dtype=q.dtype)
    if B * Hq * Nq == 0:
        return o, lse
    if Nk == 0:  # no keys at all: zeros and lse = −inf
        fill(o, 0.0)
        fill(lse, -math.inf)
        return o, lse
    scores[(math.ceil(Nk / T), math.ceil(Nq / T), B * Hq), (T, T)](q, k, s, causal)
    softmax[B * Hq * Nq, threads](s.reshape(B * Hq * Nq, Nk), lse.reshape(B * Hq * Nq),
                                  np.dtype(q.dtype).type(scale))
    pv[(math.ceil(d / T), math.ceil(Nq / T), B * Hq), (T, T)](s, v, o, lse, causal)
    return o, lse
