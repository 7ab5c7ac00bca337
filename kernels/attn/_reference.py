"""Float64 oracle for attention: softmax(scale · Q Kᵀ + mask) V, written to be obviously right, not fast.

Every backend of ``kernels.attention`` is tested against this function. It materializes the scores of one query
row at a time and sums only over the keys that row may see, so a NaN in k or v reaches exactly the query rows that
attend to it (see ``kernels.attention``, Notes). How close a backend must come to it: ``kernels.tolerances``.
"""
from __future__ import annotations

import numpy as np

from ..tolerances import LOW_PRECISION_FACTOR, TOLERANCES, UNIT_ROUNDOFF
from ._validate import normalize


def reference(q, k, v, *, causal=False, scale=None, return_lse=False):
    """Exact attention in float64 (the oracle).

    Parameters
    ----------
    q, k, v, causal, scale
        As for :func:`kernels.attention`.
    return_lse : bool
        Also return the natural-log log-sum-exp of each query row's scaled scores.

    Returns
    -------
    o : ndarray, float64, the shape of ``q``
    lse : ndarray, float64, ``q.shape[:-1]`` (only when ``return_lse``); -inf for a row that sees no key.
    """
    qn, kn, vn, scale, shape = normalize(q, k, v, causal=causal, scale=scale, block_q=None,
                                                 block_k=None)
    q64, k64, v64 = (x.astype(np.float64) for x in (qn, kn, vn))
    B, Hq, Nq, d = q64.shape
    Hkv, Nk = k64.shape[1], k64.shape[2]
    group = Hq // Hkv
    # query head h reads kv head h // group
    k64 = np.repeat(k64, group, axis=1)  # (B, Hq, Nk, d)
    v64 = np.repeat(v64, group, axis=1)  # (B, Hq, Nk, d)
    o = np.zeros((B, Hq, Nq, d))
    lse = np.full((B, Hq, Nq), -np.inf)
    for i in range(Nq):
        # bottom-right causal alignment (as flash-attn): query i sees keys j <= i + Nk - Nq
        n_visible = min(Nk, i + Nk - Nq + 1) if causal else Nk
        if n_visible <= 0:
            continue  # sees no key: output 0, lse -inf
        s = np.einsum("bhd,bhjd->bhj", q64[:, :, i, :], k64[:, :, :n_visible, :]) * scale  # (B, Hq, n_visible)
        m = s.max(axis=-1, keepdims=True)  # (B, Hq, 1); NaN if a score is NaN
        seen = ~np.isneginf(m[..., 0])  # (B, Hq); every score -inf: zero weight everywhere, as if no key
        m = np.where(np.isneginf(m), 0.0, m)
        with np.errstate(invalid="ignore"):  # inf − inf = NaN for a score of +inf: the documented result
            p = np.exp(s - m)  # (B, Hq, n_visible)
        l = p.sum(axis=-1)  # (B, Hq)
        with np.errstate(invalid="ignore", divide="ignore"):
            o_i = np.einsum("bhj,bhjd->bhd", p, v64[:, :, :n_visible, :]) / l[..., None]  # (B, Hq, d)
            o[:, :, i, :] = np.where(seen[..., None], o_i, 0.0)
            lse[:, :, i] = np.where(seen, m[..., 0] + np.log(l), -np.inf)
    o = o.reshape(shape)
    lse = lse.reshape(shape[:-1])
    return (o, lse) if return_lse else o


def round_to(x, dtype: str):
    """``x`` rounded to ``dtype`` ("float16", or "bfloat16" by round-half-to-even on the 16 bits it drops, IEEE
    754), returned as float32: how low-precision inputs and steps are emulated on the host."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype != "bfloat16":
        raise ValueError(f"dtype must be 'float16' or 'bfloat16'; got {dtype!r}")
    bits = x.view(np.uint32).astype(np.uint64)  # (64-bit: adding half the dropped range must not wrap)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16  # add half the dropped range, even on a tie
    return np.where(np.isnan(x), np.float32(np.nan), rounded.astype(np.uint32).view(np.float32))  # NaN stays


def plain_attention(q, k, v, causal: bool, dtype: str):
    """Attention done plainly with every step rounded to ``dtype`` ("float16" or "bfloat16"), in float32 on the
    host (BLAS-fast, unlike NumPy's float16 arithmetic): the baseline of flash-attn's low-precision rule."""
    rnd = lambda x: round_to(x, dtype)  # noqa: E731
    q, k, v = (np.asarray(x, dtype=np.float32) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # (B, Hq, Nk, d)
    s = rnd(rnd(q @ np.swapaxes(kk, -1, -2)) * rnd(1 / np.sqrt(q.shape[-1])))  # (B, Hq, Nq, Nk)
    nq, nk = s.shape[-2:]
    if causal:
        s = np.where(np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)  # (B, Hq, Nq, 1)
    m = np.where(np.isneginf(m), 0, m)
    p = rnd(np.exp(s - m))  # (B, Hq, Nq, Nk)
    l = rnd(p.sum(axis=-1, keepdims=True))  # (B, Hq, Nq, 1)
    return rnd(rnd(p @ vv) / np.where(l == 0, 1, l))  # (B, Hq, Nq, d)


def within_tolerance(out, ref, dtype: str, plain=None) -> tuple[float, float, bool]:
    """(max |out − ref|, the bound, passed) under ``kernels.tolerances``: its table for float32/float64, and
    flash-attn's rule for float16/bfloat16 (``plain`` is the same attention done plainly in that precision).
    NaN or inf in ``out`` where ``ref`` is finite fails."""
    out, ref = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    err = float(np.abs(out - ref).max(initial=0.0))
    scale = float(np.abs(ref).max(initial=0.0))
    if dtype in UNIT_ROUNDOFF:
        plain_err = float(np.abs(np.asarray(plain, dtype=np.float64) - ref).max(initial=0.0))
        bound = LOW_PRECISION_FACTOR * plain_err + UNIT_ROUNDOFF[dtype] * scale
    else:
        bound = TOLERANCES[dtype]["atol"] + TOLERANCES[dtype]["rtol"] * scale
    finite = bool(np.array_equal(np.isfinite(out), np.isfinite(ref)))
    return err, bound, finite and err <= bound
