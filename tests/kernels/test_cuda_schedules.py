"""The CUDA C kernels' schedules, emulated in NumPy and plain Python (no GPU here): the cp.async pipelines of the
int8 GEMM and the flash kernel (a stage is read only after its copy group landed, and refilled only after every warp
read it), Flash-Decoding's split of the key tiles (each tile in exactly one split) with flash_combine's merge
(equal to attention over all keys, rows that see no key included), and the launcher's split count.

The schedules are copied from ``int8_matmul.cu`` and ``flash_attention.cu`` (a change there must be made here
too); a GPU run (``python -m simulator gpu-check``) checks the kernels themselves.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from kernels.attn import _cupy as attn_tier2
from kernels.attn import reference


class Pipeline:
    """cp.async groups per thread: ``load`` adds a slice to the open group, ``commit`` closes it, ``wait(n)``
    completes all but the newest n groups (PTX ISA, cp.async.wait_group)."""

    def __init__(self, stages):
        self.stages = stages
        self.groups = [[]]  # the open group last
        self.landed = {}  # stage -> the slice now complete in it
        self.pending = {}  # stage -> the slice still being copied into it

    def load(self, slice_, stage):
        assert stage not in self.pending, f"stage {stage} refilled while a copy into it is in flight"
        self.pending[stage] = slice_
        self.landed.pop(stage, None)
        self.groups[-1].append(stage)

    def commit(self):
        self.groups.append([])

    def wait(self, newest_pending):
        closed = self.groups[:-1]
        for group in closed[:max(0, len(closed) - newest_pending)]:
            for stage in group:
                self.landed[stage] = self.pending.pop(stage)
            group.clear()


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("n_steps", [1, 2, 3, 7])
def test_the_int8_gemm_pipeline_reads_only_landed_stages(stages, n_steps):
    pipe = Pipeline(stages)
    for st in range(stages - 1):  # the prologue of gemm_i8_mma
        if st < n_steps:
            pipe.load(st, st)
        pipe.commit()
    read_by_previous_iteration = None
    for step in range(n_steps):
        pipe.wait(stages - 2)
        # __syncthreads: every warp finished the previous iteration's reads, so that stage may be refilled
        nxt = step + stages - 1
        if nxt < n_steps:
            assert nxt % stages == read_by_previous_iteration or step == 0
            pipe.load(nxt, nxt % stages)
        pipe.commit()
        assert pipe.landed.get(step % stages) == step, f"step {step} reads a stage that has not landed"
        read_by_previous_iteration = step % stages


@pytest.mark.parametrize("j_begin, j_end", [(0, 1), (0, 5), (3, 4), (5, 12), (7, 7)])
def test_the_flash_pipeline_reads_only_landed_stages(j_begin, j_end):
    pipe = Pipeline(2)
    pipe.load("Q", "Q")
    pipe.commit()
    if j_begin < j_end:
        pipe.load(j_begin, j_begin & 1)
    pipe.commit()
    pipe.wait(1)
    assert pipe.landed.get("Q") == "Q"
    for j in range(j_begin, j_end):
        if j + 1 < j_end:
            pipe.load(j + 1, (j + 1) & 1)
        pipe.commit()
        pipe.wait(1)
        assert pipe.landed.get(j & 1) == j
        # __syncthreads at the end of the iteration: stage j & 1 may be refilled by the next prefetch


@pytest.mark.parametrize("Tc", [0, 1, 2, 7, 64, 129])
@pytest.mark.parametrize("n_splits", [1, 2, 3, 7, 17, 64])
def test_each_key_tile_falls_in_exactly_one_split(Tc, n_splits):
    per_split = -(-Tc // n_splits)  # flash_forward: (Tc + n_splits − 1) / n_splits
    covered = []
    for split in range(n_splits):
        j_begin = min(Tc, split * per_split)
        j_end = min(Tc, j_begin + per_split)
        covered += range(j_begin, j_end)
    assert covered == list(range(Tc))


def _partial(q, k, v, causal, key_lo, key_hi):
    """One split's normalized rows and lse over keys [key_lo, key_hi) (the kernel writes these in float32)."""
    Nq, Nk = q.shape[2], k.shape[2]
    s = q.astype(np.float64) @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])  # (B, H, Nq, Nk)
    keys = np.arange(Nk)
    visible = (keys >= key_lo) & (keys < key_hi)
    visible = visible & (keys[None, :] <= np.arange(Nq)[:, None] + Nk - Nq) if causal else visible[None, :]
    s = np.where(visible, s, -np.inf)
    m = np.nanmax(np.where(np.isnan(s), -np.inf, s), axis=-1, keepdims=True)  # fmaxf: a NaN never wins the max
    with np.errstate(invalid="ignore"):
        p = np.exp(s - np.where(np.isfinite(m), m, 0))  # NaN where s is
        l = p.sum(axis=-1, keepdims=True)  # (B, H, Nq, 1), NaN for a row a NaN reached
        # Σ over the visible keys only, as the oracle sums. (The kernel's mma also multiplies a masked key's p = 0
        # by its v row, and 0 · NaN = NaN: a NaN in v reaches every row of the query tiles that load its key tile,
        # seen or not; that predates the split and is left to a GPU run to confirm.)
        pv = np.where(visible[..., None], p[..., None] * v[:, :, None], 0).sum(axis=-2)  # (B, H, Nq, d)
        o = np.where(l > 0, pv / np.where(l > 0, l, 1), 0)
        o = np.where(np.isnan(l), np.nan, o)  # acc · (1/l): the kernel's inv is 0 there, and NaN · 0 = NaN
        lse = np.where(l[..., 0] > 0, m[..., 0] + np.log(np.where(l[..., 0] > 0, l[..., 0], 1)),
                       np.where(l[..., 0] == 0, -np.inf, l[..., 0]))  # −inf for no key, NaN for a NaN
    return o.astype(np.float32), lse.astype(np.float32)


def _combine(o_part, lse_part):
    """flash_combine's arithmetic: m = max lse_s, total = Σ e^(lse_s − m), o = Σ e^(lse_s − m) o_s / total; a NaN
    in any split's lse makes the row NaN."""
    nan = np.isnan(lse_part).any(axis=0)
    m = np.where(np.isnan(lse_part), -np.inf, lse_part).max(axis=0)
    seen = np.isfinite(m)
    with np.errstate(invalid="ignore"):
        w = np.exp(lse_part - np.where(seen, m, 0)[None])  # e^(−inf) = 0 for a split that saw no key of the row
        w = np.where(seen[None], w, 0)
        total = w.sum(axis=0)
        o = np.where(total[..., None] > 0, (w[..., None] * o_part).sum(axis=0) / np.where(total > 0, total, 1)[
            ..., None], 0)
        lse = np.where(total > 0, m + np.log(np.where(total > 0, total, 1)), -np.inf)
    return np.where(nan[..., None], np.nan, o), np.where(nan, np.nan, lse)


@pytest.mark.parametrize("nan_in", [None, "q", "k", "v"])
@pytest.mark.parametrize("Nq, Nk, causal, n_splits", [(1, 1000, True, 7), (16, 300, False, 3), (90, 40, True, 2),
                                                     (5, 64, True, 4)])
def test_the_combine_of_the_splits_is_attention_over_all_keys(rng, Nq, Nk, causal, n_splits, nan_in):
    q = rng.standard_normal((1, 2, Nq, 16))
    k, v = rng.standard_normal((1, 2, Nk, 16)), rng.standard_normal((1, 2, Nk, 16))
    if nan_in is not None:  # the NaN contract: exactly the rows that see the NaN become NaN (kernels.attention)
        {"q": q, "k": k, "v": v}[nan_in][0, 1, {"q": Nq, "k": Nk, "v": Nk}[nan_in] // 2, 3] = np.nan
    BC = attn_tier2.BC
    Tc = math.ceil(Nk / BC)
    per_split = -(-Tc // n_splits)
    parts = [_partial(q, k, v, causal, min(Tc, s * per_split) * BC, min(Tc, s * per_split + per_split) * BC)
             for s in range(n_splits)]
    o, lse = _combine(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]))
    ref, ref_lse = reference(q, k, v, causal=causal, return_lse=True)
    np.testing.assert_allclose(o, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)  # −inf where a row sees no key, in both


@pytest.mark.parametrize("blocks, key_tiles, sms, expected", [(4096, 128, 132, 1), (16, 513, 132, 17),
                                                               (16, 8, 132, 4), (1, 10000, 132, 64), (8, 1, 132, 1)])
def test_the_split_count_fills_the_device_within_its_bounds(blocks, key_tiles, sms, expected):
    assert attn_tier2.split_count(blocks, key_tiles, sms) == expected
