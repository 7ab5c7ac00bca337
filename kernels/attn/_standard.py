"""Standard attention on the CPU with NumPy: S = scale · Q Kᵀ and P = softmax(S) are materialized in memory.

This is the algorithm FlashAttention replaces (Dao et al. 2022, Algorithm 0): S is written, the softmax reads S
and writes P, and P V reads P, so it needs 2 · B · Hq · Nq · Nk elements of extra memory. Its matmuls run on
BLAS on all cores (through Numba's pool, ``kernels._common.blas.batched_matmul``), its elementwise passes in
NumPy on one core each, as frameworks' unfused attention does.
"""
from __future__ import annotations

import time

import numpy as np

from .._common.blas import batched_matmul
from .._common.memory import ensure_fits
from ._nonfinite import restore_nonfinite_v


def standard_bytes(B, Hq, Nq, Nk, elem_bytes, causal):
    """Bytes that ``standard_forward`` allocates beyond its inputs and output: S and P, plus the causal mask."""
    score_bytes = B * Hq * Nq * Nk * elem_bytes  # one (B, Hq, Nq, Nk) matrix
    mask_bytes = Nq * Nk if causal else 0  # bool (Nq, Nk)
    return 2 * score_bytes + mask_bytes


# the phases ``standard_forward`` can time, in the order it runs them (``phases`` argument)
PHASES = ("qk", "mask", "max", "subtract", "exp", "sum", "normalize", "pv")


class _Clock:
    """Wall time per phase: ``mark(name)`` ends the phase named and starts the next; no-op when ``into`` is None."""

    def __init__(self, into):
        self.into = into
        self.last = time.perf_counter() if into is not None else 0.0

    def mark(self, name):
        if self.into is not None:
            now = time.perf_counter()
            self.into[name] = self.into.get(name, 0.0) + now - self.last
            self.last = now


def standard_forward(q, k, v, scale, causal, phases=None):
    """Attention over C-contiguous (B, Hq, Nq, d) q and (B, Hkv, Nk, d) k, v; returns (o, lse).

    ``phases``: a dict that receives the wall seconds of each phase of ``PHASES`` that ran (added to what it
    holds), for the cost model's per-phase validation; None (the default) times nothing.
    """
    clock = _Clock(phases)
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    ensure_fits(standard_bytes(B, Hq, Nq, Nk, q.itemsize, causal), "attention(algorithm='standard') for S and P "
                f"of shape ({B}, {Hq}, {Nq}, {Nk}) in {q.dtype}", "use algorithm='flash', which needs O(N·d)")
    # GQA: the query heads of one group are stacked as rows against their shared kv head
    q_g = q.reshape(B * Hkv, group * Nq, d)  # (B·Hkv, group·Nq, d)
    # S and P in one allocation, so that repeated calls find it mapped. glibc's malloc serves the first call's
    # buffer from mmap, and its free raises the mmap threshold to the buffer's size and the trim threshold to twice
    # that (malloc/malloc.c, free: "dynamic threshold"). Later buffers of that size below 32 MiB then come from the
    # heap and stay mapped after free. As two arrays, S and P freed together at the heap's top would exceed the
    # trim threshold that one of them set, and be returned to the kernel and faulted in again on every call
    # (measured with getrusage on a 2-vCPU Xeon: ~1000 minor faults per call at N = 256…768, H = 8, and 6.8 against
    # 9.5–14.5 ms per call at N = 512).
    scores = np.empty((2, B, Hq, Nq, Nk), dtype=q.dtype)  # S, then P
    s = batched_matmul(q_g, k.reshape(B * Hkv, Nk, d), transpose_b=True,
                       out=scores[0].reshape(B * Hkv, group * Nq, Nk)).reshape(B, Hq, Nq, Nk)  # S = Q Kᵀ
    clock.mark("qk")
    if causal:
        # bottom-right alignment: query i sees keys j <= i + Nk - Nq
        visible = np.arange(Nk)[None, :] <= np.arange(Nq)[:, None] + (Nk - Nq)  # (Nq, Nk)
        np.copyto(s, -np.inf, where=~visible)
        clock.mark("mask")
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)  # (B, Hq, Nq, 1); -inf when there are no keys
    # a row that sees no key, or whose every score is -inf, has P = 0 (not exp(-inf + inf)) and gives zeros
    m = np.where(np.isneginf(m), 0.0, m).astype(s.dtype)
    clock.mark("max")
    with np.errstate(invalid="ignore", over="ignore"):  # inf − inf = NaN for a score of +inf: the documented result
        p = np.subtract(s, m, out=scores[1])  # P is a second (B, Hq, Nq, Nk) array, as in the unfused algorithm
        p *= scale  # scale·(S − max S): the max subtracted first, so that no scale overflows a finite row
    clock.mark("subtract")
    np.exp(p, out=p)
    clock.mark("exp")
    l = p.sum(axis=-1, keepdims=True)  # (B, Hq, Nq, 1)
    with np.errstate(divide="ignore", over="ignore"):  # log(0) = -inf for a row that sees no key
        lse = (m.astype(np.float64) * scale + np.log(l)).astype(p.dtype)[..., 0]  # (B, Hq, Nq)
    l_safe = np.where(l == 0.0, 1.0, l).astype(p.dtype)
    clock.mark("sum")
    p /= l_safe
    clock.mark("normalize")
    p_g = p.reshape(B * Hkv, group * Nq, Nk)  # (B·Hkv, group·Nq, Nk)
    # 0 · NaN = NaN: a non-finite v row would leak into the rows that do not see its key (``_nonfinite``)
    finite = np.isfinite(v) if causal else None  # (B, Hkv, Nk, d), one pass for the check and the zeroing
    leaks = causal and not finite.all()
    v_used = np.where(finite, v, v.dtype.type(0)) if leaks else v  # (B, Hkv, Nk, d), v's dtype
    o = batched_matmul(p_g, v_used.reshape(B * Hkv, Nk, d)).reshape(B, Hq, Nq, d)  # O = P V, (B, Hq, Nq, d)
    if leaks:
        o = restore_nonfinite_v(np, o, v, causal)
    dead = l == 0.0  # (B, Hq, Nq, 1) rows with no weight anywhere: zeros, even beside a NaN in v (0 · NaN)
    if dead.any():  # (a pass over o only when some row is dead)
        np.copyto(o, 0.0, where=dead)
    clock.mark("pv")
    return o, lse
