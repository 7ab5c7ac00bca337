"""A non-finite value in v under a causal mask, for the attention kernels whose P·V multiplies every weight of a
key tile by every value row, masked ones included (NumPy's matmul in ``_standard``, the tensor-core mma and
cuBLAS in ``_cupy``): 0 · NaN = NaN, so a NaN or ±inf in value row j reached rows that do not see key j (first GPU
check, H200: 144 NaN rows against the oracle's 140 at N = 200). Those kernels run on v with its non-finite values
zeroed and ``restore_nonfinite_v`` puts them back where the oracle has them.
"""
from __future__ import annotations

import numpy as np


def restore_nonfinite_v(xp, o, v, causal: bool):
    """o (B, Hq, Nq, d), computed from v (B, Hkv, Nk, d) with its non-finite elements zeroed; returns o as the
    oracle has it for v itself (``kernels.attention``'s NaN contract), in o's dtype. ``xp`` is the array module
    (NumPy for ``_standard``, CuPy for ``_cupy``).

    Run on the zeroed v instead, each output element needs only which non-finite values its row sees: a weight
    p > 0 times NaN is NaN and times ±inf is ±inf, which no finite sum undoes; +inf and −inf together give NaN. A
    weight of exactly 0 on a visible key (a score more than ~745 below the row's maximum, where float64 underflows)
    would give the oracle NaN against ±inf here. An element already NaN (a NaN in q or k) stays NaN."""
    B, Hkv, Nk, d = v.shape
    Hq, Nq = o.shape[1], o.shape[2]
    bad = xp.flatnonzero(~xp.isfinite(v).all(axis=(0, 1, 3)))  # (J,) keys with a non-finite value in any head
    if bad.size == 0:
        return o
    v_bad = v[:, :, bad, :]  # (B, Hkv, J, d)
    rows = xp.arange(Nq)[:, None]  # (Nq, 1)
    sees = (bad[None, :] <= rows + (Nk - Nq)) if causal else xp.ones((Nq, bad.size), dtype=bool)  # (Nq, J)
    sees = sees.astype(xp.float32)

    def reached(mask):  # (B, Hq, Nq, d): the row sees at least one key whose value there is ``mask``
        hits = xp.matmul(sees, mask.astype(xp.float32)) > 0  # (B, Hkv, Nq, d)
        return xp.repeat(hits, Hq // Hkv, axis=1)  # each kv head's rows for its group of query heads

    nan = reached(xp.isnan(v_bad))
    pos, neg = reached(xp.isinf(v_bad) & (v_bad > 0)), reached(xp.isinf(v_bad) & (v_bad < 0))
    out = xp.where(pos, np.inf, o)  # Python floats: o's dtype stays
    out = xp.where(neg, -np.inf, out)
    return xp.where(nan | (pos & neg) | xp.isnan(o), np.nan, out)
