"""softmax-tiles: why tiling breaks softmax, and how online softmax (FlashAttention's running max and sum) mends it.

Every probability comes out of ``kernels.attention``: softmax(s) is attention with one query e₀, keys whose first
coordinate is the score s_j, V = I and scale 1, so the output row is exactly the probability vector.
"""
from __future__ import annotations

import math

import numpy as np

import kernels
from kernels.attn import reference

from ._lesson import num, vector

TITLE = "softmax-tiles: tiling breaks softmax; online softmax mends it"
SUMMARY = "the 200% attention of a per-tile softmax, then online softmax step by step, on [2, 5, 1, 8] and a real row"
OPTIONS = ("seed", "n", "tile")
SCORES = (2.0, 5.0, 1.0, 8.0)  # the example of issue 18: two tiles of two scores
TILE = 2


def softmax_by_attention(scores):
    """(softmax(scores), log Σ exp(scores)) from ``kernels.attention``: q = e₀, k[:, 0] = scores, V = I, scale 1."""
    s = np.asarray(scores, dtype=np.float64)
    n = s.size
    q = np.eye(1, n)  # (1, n): e₀
    k = np.zeros((n, n))  # (n, n): key j is s_j · e₀, so q · k_j = s_j
    k[:, 0] = s
    o, lse = kernels.attention(q, k, np.eye(n), scale=1.0, return_lse=True)  # (1, n), (1,)
    return o[0], float(lse[0])


def online_softmax(scores, v, tile):
    """FlashAttention-2's online softmax over tiles of ``tile`` scores (Dao 2023, Algorithm 1, lines 8-10).

    Returns (o, steps): o = softmax(scores) · v, and per tile the running max m, the running sum l, the correction
    exp(m_old − m_new) applied to the earlier partial sum and output, and the running output o / l.
    """
    s = np.asarray(scores, dtype=np.float64)
    m, l, acc = -math.inf, 0.0, np.zeros(v.shape[1])  # running max, running sum, unnormalized output (d,)
    steps = []
    for t0 in range(0, s.size, tile):
        s_t = s[t0:t0 + tile]  # (tile,)
        m_new = max(m, float(s_t.max()))
        correction = math.exp(m - m_new)  # rescales what the earlier tiles summed: exp(m_old − m_new)
        p_t = np.exp(s_t - m_new)  # (tile,)
        l_new = correction * l + float(p_t.sum())
        acc = correction * acc + p_t @ v[t0:t0 + tile]  # (d,)
        steps.append({"tile": (t0, t0 + s_t.size), "m_old": m, "m_new": m_new, "correction": correction,
                      "l_old": l, "l_new": l_new, "o": acc / l_new})
        m, l = m_new, l_new
    return acc / l, steps


def _toy(lesson):
    s = np.array(SCORES)
    full, lse = softmax_by_attention(s)
    lesson.heading("Softmax over all four scores")
    lesson.say(f"The scores s = {vector(s)}. `kernels.attention` with one query e₀, keys s_j·e₀, V = I and "
               f"scale 1 returns softmax(s) = {vector(full)}; they sum to {full.sum():.3f}.")
    tiles = [s[t0:t0 + TILE] for t0 in range(0, s.size, TILE)]
    per_tile = [softmax_by_attention(t)[0] for t in tiles]
    naive = np.concatenate(per_tile)
    lesson.heading("Softmax per tile of two, concatenated")
    lesson.say(" ".join(f"softmax({vector(t)}) = {vector(p)}." for t, p in zip(tiles, per_tile))
               + f" Concatenated: {vector(naive)}, which sums to **{naive.sum():.3f}**: "
               f"{100 * naive.sum():.0f}% attention. Each tile normalized by its own sum; the first tile never "
               f"saw the 8 that dwarfs its scores.")
    o, steps = online_softmax(s, np.eye(s.size), TILE)
    lesson.heading("Online softmax over the same tiles")
    lesson.say("Keep a running max m and a running sum l. When a tile raises the max, multiply what was summed so "
               "far (l and the output) by the correction exp(m_old − m_new), then add the tile's exp(s − m_new).")
    lesson.table(["tile", "scores", "m_old", "m_new", "exp(m_old − m_new)", "l_old", "l_new", "running o / l"],
                 [[f"{st['tile'][0]}–{st['tile'][1] - 1}", vector(s[slice(*st["tile"])]), num(st["m_old"]),
                   num(st["m_new"]), num(st["correction"], 4), num(st["l_old"], 5), num(st["l_new"], 5),
                   vector(st["o"])] for st in steps])
    lesson.say(f"After the last tile o = {vector(o)}; the full softmax is {vector(full)}: largest difference "
               f"{num(np.abs(o - full).max(), 2)}. And m + log l = "
               f"{num(steps[-1]['m_new'] + math.log(steps[-1]['l_new']), 8)} is the log-sum-exp "
               f"`kernels.attention` returns, {num(lse, 8)}.")
    return s, full, naive, steps


def _real_row(lesson, seed, n, tile):
    rng = np.random.default_rng(seed)
    d = 16
    q, k, v = (rng.standard_normal((1, n, d)) for _ in range(3))  # (H=1, N, d) each, float64
    row = n - 1
    o_kernel, lse = kernels.attention(q, k, v, block_k=tile, return_lse=True)  # (1, N, d), (1, N)
    o_ref = reference(q, k, v)  # (1, N, d)
    s = q[0, row] @ k[0].T / math.sqrt(d)  # (N,): the row's scaled scores
    tc = math.ceil(n / tile)
    per_tile_sum = sum(float(softmax_by_attention(s[t0:t0 + tile])[0].sum()) for t0 in range(0, n, tile))
    o_online, steps = online_softmax(s, v[0], tile)
    lesson.heading(f"A real row: query {row} of attention with N = {n}, d = {d}, key tiles of {tile}")
    lesson.say(f"Random Q, K, V (seed {seed}), float64. Softmax per key tile, concatenated, sums to "
               f"{per_tile_sum:.3f} over its {tc} tiles. Online softmax over the same tiles:")
    lesson.table(["keys", "m_new", "exp(m_old − m_new)", "l_new"],
                 [[f"{st['tile'][0]}–{st['tile'][1] - 1}", num(st["m_new"], 5), num(st["correction"], 5),
                   num(st["l_new"], 6)] for st in steps])
    lesson.say(f"Online output row against `kernels.attention(q, k, v, block_k={tile})` (FlashAttention-2 on the "
               f"CPU, the same tiles): largest difference {num(np.abs(o_online - o_kernel[0, row]).max(), 2)}; "
               f"against the float64 oracle `kernels.attn.reference`: "
               f"{num(np.abs(o_online - o_ref[0, row]).max(), 2)}. m + log l = "
               f"{num(steps[-1]['m_new'] + math.log(steps[-1]['l_new']), 10)}, the kernel's lse "
               f"{num(lse[0, row], 10)}.")
    return per_tile_sum, o_online, o_kernel[0, row]


def _draw(path, s, full, naive, steps):
    from ..report.charts import figure, save

    fig, axes = figure(ncols=3, width=3.2, height=2.8)
    x = np.arange(s.size)
    axes[0, 0].bar(x, full, color="tab:blue")
    axes[0, 0].set_title(f"softmax of all: sum {full.sum():.2f}", fontsize=9)
    axes[0, 1].bar(x, naive, color="tab:red")
    axes[0, 1].set_title(f"per tile, concatenated: sum {naive.sum():.2f}", fontsize=9)
    for i, st in enumerate(steps):
        axes[0, 2].bar(x + (i - 0.5) * 0.4, st["o"], width=0.4, label=f"after tile {i + 1}")
    axes[0, 2].set_title("online: running o / l", fontsize=9)
    axes[0, 2].legend(fontsize=7, loc="upper left")
    for ax in axes[0]:
        ax.set_xticks(x, [f"s={v:g}" for v in s], fontsize=8)
        ax.set_ylim(0, 1.05)
    save(fig, path)


def run(lesson, *, seed=0, n=64, tile=16):
    s, full, naive, steps = _toy(lesson)
    lesson.chart("softmax_tiles.png", lambda p: _draw(p, s, full, naive, steps),
                 "full softmax, per-tile softmax (sum 2), online softmax after each tile")
    _real_row(lesson, seed, n, tile)
