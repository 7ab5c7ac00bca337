"""Float64 oracle for SnapKV (Li et al. 2024), written to be obviously right: the full window scores, a padded
pooling, a stable sort for the top positions."""
from __future__ import annotations

import numpy as np


def _pool_reference(x, kernel_size, pooling):
    """1-D pooling along the last axis, stride 1, padding kernel_size // 2 (zeros counted for avg, -inf for max)."""
    pad = kernel_size // 2
    fill = -np.inf if pooling == "max" else 0.0
    padded = np.concatenate([np.full(x.shape[:-1] + (pad,), fill), x, np.full(x.shape[:-1] + (pad,), fill)], axis=-1)
    windows = np.stack([padded[..., i:i + x.shape[-1]] for i in range(kernel_size)], axis=-1)
    return windows.max(axis=-1) if pooling == "max" else windows.sum(axis=-1) / kernel_size


def snapkv_scores_reference(q_window, k, *, kernel_size=7, pooling="max", gqa="mean"):
    """Importance of each prefix position: window queries' softmax probabilities summed, then pooled.

    q_window (B, Hq, w, d) are the last w queries of a prompt of N = k.shape[2] tokens; returns (B, Hkv, N − w)
    for gqa="mean", (B, Hq, N − w) for gqa="per-query-head".
    """
    q = np.asarray(q_window, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    B, Hq, w, d = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    group = Hq // Hkv
    k_h = np.repeat(k, group, axis=1)  # (B, Hq, N, d)
    s = np.einsum("bhid,bhjd->bhij", q, k_h) / np.sqrt(d)  # (B, Hq, w, N)
    positions = np.arange(N - w, N)  # the window queries' positions
    s = np.where(np.arange(N)[None, :] <= positions[:, None], s, -np.inf)  # causal inside the window
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    scores = _pool_reference(p[..., : N - w].sum(axis=-2), kernel_size, pooling)  # (B, Hq, N − w)
    if gqa == "mean":
        scores = scores.reshape(B, Hkv, group, N - w).mean(axis=2)
    return scores


def top_positions_reference(scores, n_keep):
    """The n_keep highest scores' positions per row (ties to the lower position), sorted ascending."""
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :n_keep]
    return np.sort(order, axis=-1)


def snapkv_kept_reference(q, k, *, capacity, window=32, kernel_size=7, pooling="max", gqa="mean"):
    """Positions SnapKV keeps per (batch, head): the top (capacity − window) prefix positions plus the window."""
    N = k.shape[2]
    if N <= capacity:
        heads = k.shape[1] if gqa == "mean" else q.shape[1]
        return np.broadcast_to(np.arange(N), (k.shape[0], heads, N)).copy()
    scores = snapkv_scores_reference(q[:, :, N - window:], k, kernel_size=kernel_size, pooling=pooling, gqa=gqa)
    prefix = top_positions_reference(scores, capacity - window)
    tail = np.broadcast_to(np.arange(N - window, N), prefix.shape[:-1] + (window,))
    return np.concatenate([prefix, tail], axis=-1)
