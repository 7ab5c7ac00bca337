"""Float64 oracle for attention: softmax(scale · Q Kᵀ + mask) V, written to be obviously right, not fast.

Every backend of ``kernels.attention`` is tested against this function. It materializes the scores of one query
row at a time and sums only over the keys that row may see, so a NaN in k or v reaches exactly the query rows that
attend to it (see ``kernels.attention``, Notes). How close a backend must come to it: ``kernels.tolerances``.
"""
from __future__ import annotations

import numpy as np

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
