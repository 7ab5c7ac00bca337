"""Numba micro-kernels of the calibration (``simulator.calibrate.phase_rates``): the flash kernel's own exp and
rescale, run by every thread at once, so that their per-thread rates are measured as the kernel runs them.

They import ``exp_row`` and the fast-math flags from ``kernels._common.numba_cpu``: a deliberate edge of the
layout (tests/test_layout.py, ``KNOWN``), as the GPU check's probes drive a tier's launchers.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels._common.numba_cpu import FASTMATH, exp_row


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def exp_rows(s, p, iterations):
    """Thread t: ``iterations`` times p[t, r] = exp(s[t, r] − 0) for every row r of its (Br, Bc) tile."""
    total = 0.0
    for t in prange(s.shape[0]):
        acc = 0.0
        for _ in range(iterations):
            for r in range(s.shape[1]):
                acc += exp_row(s[t, r], p[t, r], s.shape[2], 0.0, 1.0)
        total += acc
    return total


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def rescale_rows(o_acc, pv, alpha, iterations):
    """Thread t: ``iterations`` times O_i ← diag(alpha) O_i + PV over its (Br, d) tile (the flash kernel's loop)."""
    for t in prange(o_acc.shape[0]):
        for _ in range(iterations):
            for r in range(o_acc.shape[1]):
                for c in range(o_acc.shape[2]):
                    o_acc[t, r, c] = alpha[t, r] * o_acc[t, r, c] + pv[t, r, c]


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def block_steps(q_i, k_j, v_j, s, p, pv, o_acc, alpha, iterations):
    """Thread t: ``iterations`` times one block step of the flash kernel on its own tiles: S = Q_i K_jᵀ, P = exp
    row by row, PV, and O_i ← diag(alpha) O_i + PV (its online-softmax bookkeeping left out)."""
    for t in prange(s.shape[0]):
        for _ in range(iterations):
            np.dot(q_i[t], k_j[t].T, s[t])
            for r in range(s.shape[1]):
                exp_row(s[t, r], p[t, r], s.shape[2], 30.0, 0.125)
            np.dot(p[t], v_j[t], pv[t])
            for r in range(o_acc.shape[1]):
                for c in range(o_acc.shape[2]):
                    o_acc[t, r, c] = alpha[t, r] * o_acc[t, r, c] + pv[t, r, c]


@njit(inline="always")
def _touch(buffers_s, buffers_p, q_i, pv):
    for i in range(buffers_s.size):
        buffers_s[i] = 1.0
        buffers_p[i] = 1.0
    for r in range(q_i.shape[0]):
        for c in range(q_i.shape[1]):
            q_i[r, c] = 1.0
            pv[r, c] = 1.0


@njit(parallel=True, cache=True)
def task_buffers(n_tasks, rows, bc, d, fresh, threads):
    """``n_tasks`` tasks over all threads, each writing the flash kernel's per-task tiles once (S and P of
    rows × bc, Q_i, O_i and PV of rows × d): allocated by every task, as the kernel does (``fresh``), or once per
    thread and reused (the writes alone)."""
    per = (n_tasks + threads - 1) // threads
    total = 0.0
    for t in prange(threads):
        s_keep = np.empty(rows * bc, dtype=np.float32)
        p_keep = np.empty(rows * bc, dtype=np.float32)
        q_keep = np.empty((rows, d), dtype=np.float32)
        pv_keep = np.empty((rows, d), dtype=np.float32)
        for task in range(t * per, min(n_tasks, (t + 1) * per)):
            if fresh:
                s_buf = np.empty(rows * bc, dtype=np.float32)
                p_buf = np.empty(rows * bc, dtype=np.float32)
                q_i = np.empty((rows, d), dtype=np.float32)
                o_acc = np.zeros((rows, d), dtype=np.float32)
                pv = np.empty((rows, d), dtype=np.float32)
                _touch(s_buf, p_buf, q_i, pv)
                total += s_buf[task % s_buf.size] + o_acc[0, 0]
            else:
                _touch(s_keep, p_keep, q_keep, pv_keep)
                total += s_keep[task % s_keep.size]
    return total
