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


def shared_operand_reads(n_groups, units_per_group, concurrent, group_bytes, other_wave_bytes, l2_bytes, kind):
    """How many times each group's operand (``group_bytes``, e.g. K and V of one head) is read from DRAM in all,
    as a count of whole group reads (an array for a sweep).

    GPU (``kind="gpu"``): once per group if the bytes one wave touches — the operands of the groups it covers plus
    ``other_wave_bytes`` (its units' private tiles, Q_i and O_i) — fit in ``l2_bytes``; else once per wave the
    group spans. CPU: once per group if ``concurrent`` groups' operands plus the private tiles fit, else once per
    unit (every task streams the whole operand again).
    """
    g, u, c = (np.asarray(x, dtype=np.int64) for x in (n_groups, units_per_group, concurrent))
    group_bytes = np.asarray(group_bytes)
    if kind == "cpu":
        live = np.minimum(c, g) * group_bytes + other_wave_bytes
        return np.where(live <= l2_bytes, g, g * u)
    groups_per_wave = np.minimum(g, cdiv(c, u) + 1)
    live = groups_per_wave * group_bytes + other_wave_bytes
    return np.where(live <= l2_bytes, g, waves_spanned(g, u, c))


def resident(nbytes, l2_bytes):
    """Whether a tensor written (or read) by one kernel is still in the shared cache when the next reads it: the
    model keeps it when it and what was touched in between (``nbytes``) fit."""
    return np.asarray(nbytes) <= np.asarray(l2_bytes)
