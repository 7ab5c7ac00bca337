"""Reuse in the shared cache (GPU L2, CPU last-level cache), from the schedule: which tiles are live at once.

A kernel's grid is a sequence of work units (CTAs; CPU tasks) in launch order. On a GPU ``C`` of them run at once
— SMs × the CTAs one SM holds (``HardwareSpec.ctas_in_flight``) — and the model runs them in waves of ``C``
consecutive units that advance in lockstep, one tile step at a time. flash-attn launches its forward grid as
(query block, batch, head) with the query block fastest (``flash_fwd_launch_template.h``, ``run_flash_fwd``), so
the units that share an operand — the query blocks of one head, which all stream the same K and V — are
neighbours: in a wave they load K_j together, the first load brings it from DRAM and the others hit it in L2.
An operand shared by a *group* of consecutive units is therefore read from DRAM once per wave its group spans;
a group cut by a wave boundary is read again in the next wave unless what the previous wave touched still fits in
the shared cache (an LRU cache keeps a line while fewer distinct bytes than its capacity were touched since).

On the CPU the kernel's prange hands each of the T threads a contiguous share of the tasks (Numba's static
schedule), so the T tasks running at once belong to T different groups: the group's operand survives from one
task to the next if T groups' operands fit the last-level cache, else each task reads it again.

``simulator.tiles`` replays the same schedules through an LRU cache; ``tests/simulator/test_reuse.py`` holds the
two against each other over a grid.
"""
from __future__ import annotations

import numpy as np

from .tiling import cdiv, floor_sum


def waves_spanned(n_groups, units_per_group, concurrent):
    """Σ over groups g of the number of waves of ``concurrent`` units that group g's units
    [g·u, (g+1)·u) fall in: Σ_g floor(((g+1)u − 1)/C) − floor(g·u/C) + 1 (two floor sums)."""
    g, u, c = (np.asarray(x, dtype=np.int64) for x in (n_groups, units_per_group, concurrent))
    last = floor_sum(g, c, u, u - 1)
    first = floor_sum(g, c, u, 0)
    return last - first + g


def thread_rounds_groups(n_groups, units_per_group, threads):
    """Σ over rounds r of the groups the threads' r-th units fall in, when T threads each take a contiguous share
    of S = ceil(U/T) of the U = G·u units (round r runs units t·S + r together): U when S >= u (every unit its own
    group in its round); else the groups between a round's first and last unit, floor((last)/u) − floor(r/u) + 1,
    summed with floor sums (the last thread's share may be short by some units)."""
    g, u, c = (np.asarray(x, dtype=np.int64) for x in (n_groups, units_per_group, threads))
    total = g * u
    share = cdiv(total, c)
    busy = cdiv(total, share)  # threads with a share at all (fewer than T when U is small)
    full = np.clip(total - (busy - 1) * share, 0, share)  # rounds in which every busy thread has a unit
    first = floor_sum(share, u, 1, 0)
    with_all = floor_sum(full, u, 1, (busy - 1) * share)
    short = floor_sum(share - full, u, 1, np.maximum(busy - 2, 0) * share + full)
    spread = with_all + short - first + share
    return np.where(share >= u, total, spread)


def shared_operand_reads(n_groups, units_per_group, concurrent, group_bytes, other_wave_bytes, l2_bytes, kind):
    """How many times each group's operand (``group_bytes``, e.g. K and V of one head) is read from DRAM in all,
    as a count of whole group reads (an array for a sweep).

    GPU (``kind="gpu"``): once per group if the bytes one wave touches — the operands of the groups it covers (on
    average: the (wave, group) incidences over the waves) plus ``other_wave_bytes`` (its units' private tiles,
    Q_i and O_i) — fit in ``l2_bytes``; else once per wave the group spans. CPU: once per group if the groups a
    round of the threads touches fit, else once per (round, group) (``thread_rounds_groups``: every task streams
    the operand again, threads on the same group sharing it).
    """
    g, u, c = (np.asarray(x, dtype=np.int64) for x in (n_groups, units_per_group, concurrent))
    group_bytes = np.asarray(group_bytes)
    if kind == "cpu":
        rounds = cdiv(g * u, c)  # each thread's contiguous share of the units
        incidences = thread_rounds_groups(g, u, c)
        live = incidences / rounds * group_bytes + other_wave_bytes
        return np.where(live <= l2_bytes, g, incidences)
    spans = waves_spanned(g, u, c)
    groups_per_wave = spans / cdiv(g * u, c)  # (wave, group) incidences per wave: the average a wave touches
    live = groups_per_wave * group_bytes + other_wave_bytes
    return np.where(live <= l2_bytes, g, spans)


def pass_hit_fraction(l2_bytes, x_bytes, y_bytes, z_bytes):
    """Fraction of a pass's reads of a tensor X that hit the shared cache, when the previous pass touched X and
    Y row by row in lockstep and this pass touches X and Z the same way (standard attention's kernels: qk writes
    S; softmax reads S and writes P; pv reads P). Row x (a fraction 0..1 of the way through) was last touched
    X + (1 − x)·Y + x·Z distinct bytes ago; an LRU cache of ``l2_bytes`` keeps it while that is at most its
    capacity, so the hits are the x in [0, 1] where X + Y + x·(Z − Y) <= l2_bytes."""
    l2, x, y, z = (np.asarray(a, dtype=float) for a in (l2_bytes, x_bytes, y_bytes, z_bytes))
    slope = z - y
    flat = np.where(x + y <= l2, 1.0, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        cut = np.clip((l2 - x - y) / np.where(slope == 0, 1, slope), 0.0, 1.0)
    return np.where(slope == 0, flat, np.where(slope > 0, cut, 1.0 - cut))


def revisit_miss_fraction(live_bytes, l2_bytes, causal):
    """Fraction of the re-visits of a unit's private rows that miss when the units in flight cycle through
    ``live_bytes`` of them between two visits (FlashAttention-1's Q_i, O_i, l_i, m_i, one visit per K/V tile):
    all or none without a mask; with a causal mask the live set at K/V tile j shrinks as (1 − j/Tc) and the
    visits with it, so the visits of the tiles j < Tc·(1 − L2/live) miss: a fraction 1 − (L2/live)²."""
    live, l2 = np.asarray(live_bytes, dtype=float), np.asarray(l2_bytes, dtype=float)
    full = np.where(live <= l2, 0.0, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        shrinking = np.where(live <= l2, 0.0, 1.0 - (l2 / np.where(live > 0, live, 1)) ** 2)
    return np.where(np.asarray(causal, dtype=bool), shrinking, full)


def causal_chain_rows(nq, nk, br, bc, threshold_rows):
    """Key rows one CPU thread reads from DRAM for one head under a causal mask, running its query blocks in
    order: block i sees keys_i = min(Nk, Bc·ceil(((i+1)·Br + Nk − Nq) / Bc)) rows; block i+1 finds block i's keys
    in the shared cache while ``threshold_rows`` rows of them fit, so it reads only its new keys then, and all of
    them after. Total: keys_last + Σ over blocks i < Tr − 1 with keys_i > threshold of keys_i. Vectorized over a
    sweep (a loop over the blocks of the longest configuration)."""
    nq, nk, br, bc = (np.asarray(x, dtype=np.int64) for x in (nq, nk, br, bc))
    threshold = np.asarray(threshold_rows, dtype=float)
    tr = cdiv(nq, br)
    total = np.minimum(nk, np.asarray(nk)).astype(float)  # the last block sees every key
    for i in range(int(np.max(tr)) - 1):
        keys = np.minimum(nk, bc * cdiv(np.maximum(0, (i + 1) * br + nk - nq), bc))
        total = total + np.where((i < tr - 1) & (keys > threshold), keys, 0)
    return total


def resident(nbytes, l2_bytes):
    """Whether a tensor written (or read) by one kernel is still in the shared cache when the next reads it: the
    model keeps it when it and what was touched in between (``nbytes``) fit."""
    return np.asarray(nbytes) <= np.asarray(l2_bytes)
