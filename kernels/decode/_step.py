"""A whole decode step of a Llama model — every block's norms, linear layers, rotary attention and SwiGLU, and
the LM head — in one parallel region.

Why: with the pool's threads asleep between regions (``kernels/_common/threads.py``), each region pays a wake-up
of tens of microseconds on a VM; a SmolLM2 token through per-layer kernels launched 121 regions, about a third of
its time. Here the step is a fixed list of dependent steps (``plan``), each split into tasks — a run of a
linear layer's outputs, a piece of one kv head's attention (or the combination of one kv head's pieces), or one
serial task (an RMSNorm, the quantization of a linear's input) — and every thread of the region claims tasks, its
own contiguous block of the step's tasks first, then what is left of the others' (``kernels/_common/atomics.py``:
``claim``), then waits for the step's last task before it moves on, asking meanwhile for its first rows of the next
linear step. Claiming makes a late or preempted thread harmless: the threads that are running take its tasks; the
waits spin only on this call's own threads, which sleep again when it returns.

The pieces are the per-layer path's own code: ``_add_rms_norm``, ``_attend_piece`` with ``_combine`` and SwiGLU's
arithmetic from ``_fused``, ``kernels.dense.gemv_rows``, ``kernels.int8.rows.prepare`` and
``kernels.int8.panels.layout_rows`` (LLM.int8()'s split GEMV over the int8 weights in rows, or packed in panels of 16
rows where the products run on ``vpdpbusd``; bit-identical to ``Int8Linear``) — so the int8 step gives the per-layer
path's outputs bit for bit. The plan of a token's steps, the weights' arena and the region's buffers are made in
``_layout``.

Versions (2-vCPU Intel Xeon, family 6 model 167, KVM):
  v1 (this file): tasks claimed from one counter per step, each task 64 rows: SmolLM2-135M's int8 step (int8 LM
      head) 8.3 ms on two threads, 14 ms on one. Then about 4 tasks per thread per linear step and four weight rows
      read at once: 6.2 ms on two threads, 11 ms on one; fp32 22.8 ms (23.6 GB/s of weights; 42 ms on one).
      ``benchmarks/test_bench_smollm2.py``, 64 tokens, quiet machine: fp32 44.0 tokens/s (per layer before: 30.3),
      int8 96.1, int8 with the int8 LM head 128.0 (per layer before: 55.2), 0.65 and 0.47 of the bound that an
      all-core read of 36.5 GB/s sets; the weights stream at 23-24 GB/s, short of that read.
  v2: the buffers made once per step object, and the int8 rows prefetched two groups ahead
      (``kernels/_common/prefetch.py``): SmolLM2's int8 + int8 head, alternating fresh processes with v1, 140-167
      -> 138-200 tokens/s over four series (read 37-39 GB/s; the machine's noise is as large as the gain: the
      prefetch alone, on and off, 124-137 -> 139-200).
  v3: each step's tasks in one contiguous home block per thread, taken in order before the others' blocks
      (``kernels._common.atomics.claim``), so that a thread streams one run of rows per step: int8 + head 135-151
      -> 141-162 tokens/s in four alternating pairs (within the noise), fp32 45-47 either way.
  v4: the prefetch's flat view of the weight made once per call, not once per four rows (each view counts a
      reference on the stack's shared record, so both threads updated one line atomically per four rows): the
      step alone 5.64 -> 4.72 ms (its linear parts now stream as fast as a plain static split of the same rows);
      in ``generate``, alternating with v3, 147-150 -> 155 tokens/s.
  v5: a thread that waits for a step's last task asks meanwhile (into L2) for its first rows of the next step that
      reads a weight (``_wait_streaming``), so that memory keeps streaming through the serial norms, the attention
      and the uneven ends of steps, which had left it idle for ~0.45 ms of the int8 step's 4.4: the step alone, v4
      and v5 called in turn in one process (60 calls each), int8 + int8 head 5.07 -> 4.64 ms (a plain all-core read
      of the same weight arrays between them: 4.82 ms), fp32 20.2 -> 19.4 ms (read 19.2).
  v6: the blocks' weights in one array in the order a token reads them (``_arena``) instead of one stack per kind
      of linear, so that a thread's runs of rows follow each other in memory: alternating fresh processes with v5,
      fp32 step 19.5-20.1 -> 18.2-18.3 ms over three pairs (``generate`` 48.5-49.5 -> 52.9-53.6 tokens/s), int8 +
      int8 head 4.04-4.22 -> 3.94-4.08 ms over four (within the noise; 188-225 -> 221-233 tokens/s).
  v7: the float32 rows on 512-bit vectors (``kernels.dense``, v3): fp32 ``generate`` alternating fresh processes
      with v6, 46.6-52.3 -> 50.1-54.6 tokens/s over six pairs (this VM's memory was slower than in v6's runs).
  v8 (tried, not kept): eight tasks per thread and linear step instead of four, so that the last task of a step,
      which the other thread waits for, is half as long. Five pairs of fresh processes: fp32 47.2-51.3 -> 48.0-52.9
      tokens/s (faster in each pair), int8 + int8 head 139-200 -> 155-183; later, in a slower phase of the VM,
      int8 + head 104-120 against 115-123 with four (three pairs). Not clearly better for int8, whose tasks hold
      4x fewer bytes per row; a task size in bytes rather than rows is the next thing to measure.
  v9: the attention's tasks are pieces of a kv head's slots (``_fused._attend_piece``, v5 there), piece by piece
      across the kv heads, and a COMBINE step after them where a cache holds more than one piece: SmolLM2's three
      kv heads no longer leave one of two threads idle for a third of a long attention (the step's part beside its
      weights at 4000 cached tokens 13.4 -> 10.4 ms; in ``generate`` after a 4000-token prompt 50-52 -> 60-63
      tokens/s, int8 + int8 head).
  v10: on AMD the int8 rows without their software prefetch (``row_prefetch``, ``kernels.int8.rows.ROW_PREFETCH``;
      the evidence in ``kernels/_common/prefetch.py``). 2-vCPU AMD EPYC (Zen 4, KVM), SmolLM2's ``generate`` of 48
      tokens in one process, the step's ``row_prefetch`` 8 and 0 in turn, five rounds: int8 + int8 head 104-116 ->
      119-128 tokens/s (faster in every round), int8 96-101 -> 100-113. The int8 + int8 head step alone (16 cached
      tokens), eight rounds of 20 calls in turn with the rows' outputs finished per block (``kernels.int8.rows``):
      8.01-9.04 ms with the prefetch, 6.43-7.33 without (a prefetch of each range's first rows only: 6.42-7.53).
      Two, four, eight and sixteen tasks per thread in turn the same way: medians 6.80, 6.50, 6.84, 7.18 ms, the
      fastest one changing from round to round; four kept.
  v11 (tried, not kept): each linear step's input prepared by every thread that takes one of its tasks, into
      buffers of its own (the RMSNorm before QKV, GATE_UP and the head, with the residual stream in two buffers
      in turn; the int8 quantization of each int8 linear's input), instead of in serial steps of one task: SmolLM2's
      int8 step 272 -> 152 steps a token, the same bits. 2-vCPU AMD EPYC (Zen 4, KVM), v10 and v11 called in turn
      in one process: the step without its weight rows (``fixed_seconds(16)``, 12 rounds of 40 calls) 1.26 -> 1.11
      ms, faster in 11 rounds (one thread: 0.72 -> 0.65); yet the whole int8 + int8 head step (20 calls a round,
      40 rounds) 2.3% slower, faster in 13 rounds of 40, and as slow with a software prefetch of 32 or 256 more
      lines of each thread's rows before its preparation (2.6%, 2.1%); fp32 1.1% faster (26 of 40). With the norms
      merged and the quantizations of o and act left serial: int8 -0.05% (20 of 40) in one series, +4.2% (10 of
      40) in the next. The hand-offs are not the cost of a serial step: a step of eight empty tasks hands off in
      0.1 us on two threads.
  v12: the int8 weights in panels of 16 rows (``kernels.int8.panels``: one ``vpdpbusd`` adds 4 k of 16 outputs, the
      input's 4 bytes broadcast; one stream per thread, no horizontal sum per output) instead of rows, four at once,
      one per quarter of a task's range (``kernels.int8.rows``), where the products run on ``vpdpbusd`` (the
      portable loop over panels is ~9x slower than over rows). The panels are the step's own copy; the rows stay
      for the per-layer path (prefill's GEMM, ``Int8Linear``). 2-vCPU AMD EPYC (Zen 4, KVM), SmolLM2's int8 +
      int8 head ``generate`` of 64 tokens, medians of four rounds, v11's tree and v12's in alternating fresh
      processes: 159.6 -> 176.5, 146.7 -> 166.7, 172.6 -> 191.2 tokens/s.
  v13: fewer instructions beside the weights' loads, since a thread streams only as far ahead as its instructions
      reach: each panel's outputs finished on 16 lanes and its outlier weights read a column at a time
      (``kernels.int8.panels``, v2), SwiGLU's product on 16 lanes (``_fused._silu_product``). On one thread the
      step's linear steps alone had streamed at 0.58 of a plain read of the same weights (9.5 against 5.5 ms), on
      two at 0.8. 2-vCPU AMD EPYC (Zen 4, KVM), SmolLM2's int8 + int8 head ``generate`` of 64 tokens, medians of
      five rounds, v12's tree and v13's in alternating fresh processes: 159.2 -> 192.4, 162.3 -> 191.9, 172.0 ->
      213.3 tokens/s without the outliers' column loads; with them 150.0 -> 194.5, 169.8 -> 190.8, 172.9 -> 178.2.
  v14: where the target has AVX2 but not AVX512-VNNI, the int8 rows' products on ``vpmaddubsw`` in four streams
      (``kernels.int8.rows._rows_avx2``) instead of LLVM's loop. 2-vCPU AMD EPYC (Zen 3, family 25 model 1, KVM),
      SmolLM2's int8 + int8 head ``generate`` of 48 tokens, the tree before and after in alternating fresh
      processes, two pairs of three rounds: 111.0-132.5 -> 177.4-196.7 tokens/s, 0.50-0.71 -> 0.76-0.87 of the
      bound that the all-core read after each round sets (weight bytes / read).
  v15: the loop of tokens and the parallel region in one compiled function (``_tokens``, for ``greedy``, a call and
      ``fixed_seconds`` alike) instead of ``_greedy`` calling ``_run``: Numba puts a caller through LLVM with its
      callee's code linked in, so the worker's code went through it once less. 2-vCPU AMD EPYC (Zen 3), an empty
      cache: the step's compile (greedy, a call, ``fixed_seconds``) 33.2 s, against 36.4-43.6 s for ``_greedy``'s
      alone in four runs before. SmolLM2's int8 + int8 head ``generate`` of 48 tokens, medians of three rounds, six
      pairs of fresh processes: 189.0-209.8 -> 172.7-212.5 tokens/s (faster in three; within the noise),
      ``fixed_seconds(16)`` 0.518-0.557 -> 0.520-0.546 ms (one outlier of 0.798).
  v16 (tried, not kept): fewer tasks per thread. 2-vCPU AMD EPYC (Zen 3, KVM), SmolLM2's int8 + int8 head ``generate``
      of 48 tokens in one process, the plans in turn for 40 rounds, each round's rates paired: one task per thread and
      linear step against four 1.051, 1.059 and 1.082 (faster in 36, 33 and 39 of 40 rounds), two 1.044 and 1.024 (35,
      27); fp32 one 1.013 (9 of 16), two 1.030 (11 of 16). Where a token's time goes (a copy of the step that read each
      thread's clock at each step's start, task end and wait end; 6.36 ms): the linear steps 5.80 ms, streaming at 21.1
      GB/s (``wo``, 10 KB per stream of a task) to 24.7 GB/s (``w_down``, 27 KB), the serial and attention steps 0.45
      ms. What a task costs, each part alone against v15 in the same way: one ``done`` add per thread and step instead
      of one per task 1.017 (27 of 40); the rows' kernel without the views it made per call (the flat weight, the
      outlier columns) 1.023, 1.011, 1.003 (30, 26, 22 of 40), with the int32 view of the outputs made once per token as
      well 1.002 (21); without the views, a home block's tasks taking turns along its four streams instead of four
      streams each 1.022 (24 of 40; the views alone 1.003 there). Four kept: on a Zen 4 (v10) four had the best median,
      the fastest changing from round to round, and a count set from one machine's runs is what ``_layout`` avoids; the
      same comparison on other machines decides: the step's ``tasks_per_thread`` sets the count, and
      ``benchmarks/test_bench_smollm2.py::test_tasks_per_thread_in_turn`` compares one, two and four (two more runs
      there: one 1.039 and 1.036, in 31 and 27 of 40 rounds, two 1.016 and 1.041, in 25 and 27; fp32 one 1.017, in 27,
      two 1.013, in 23).
  v17: the count timed on the machine instead (``tune_tasks_per_thread``: one, two and four, each over two calls
      back to back in eight rounds taken in turn, the fastest median kept; ``models.smollm2`` tunes its step when it
      builds it). Where the gain lies, on the Zen 3 above, 40 rounds in one process as in v16 (48 tokens of
      ``generate`` per count and round, int8 + int8 head, 208 tokens/s with four): one task per thread everywhere
      1.070 (faster in 40 of 40), one in the blocks and four in the head 1.058 (38), two and four 1.054 (37), four
      and one 1.009 (23): the blocks' steps, whose tasks at four per thread hold 41-221 KB, not the head's 3.5 MB
      ones. The tuning itself: 0.23 s for int8 + int8 head (4.4-4.5 ms a call at one and two tasks, 4.6-4.7 at four;
      it kept one, one, one and two in four tunings), 0.8 s for fp32 (15.1-16.3 ms, the counts within 6% of each
      other; it kept two, four, one and one).
"""
from __future__ import annotations

import math
import threading
import time

import numba
import numpy as np
from numba import njit, prange

from .._common.affinity import steer_workers
from .._common.atomics import COUNTER_STRIDE, atomic_add, atomic_load, claim, home_block, wait_until
from .._common.dtypes import check_int
from .._common.memory import ensure_fits
from .._common.prefetch import CACHE_LINE_BYTES, prefetch_l2
from ..dense import gemv_rows
from ..int8 import Int8Linear
from ..int8 import panels as panel_layout
from ..int8.panels import layout_rows
from ..int8.rows import ROW_PREFETCH, path_marker, prepare
from ._fused import PIECE_SLOTS, _add_rms_norm, _attend_piece, _combine, _rope_write, _silu_product, piece_width
from ._layout import (ATTEND, COMBINE, DOWN, DOWN_LIN, FLOAT32, GATE_UP, GATE_UP_LIN, HEAD, HEAD_LIN,
                      INT8_PANELS, INT8_ROWS, LINEAR_STEPS, NORM_ATTN, NORM_FFN, NORM_FINAL, O_LIN, O_PROJ,
                      PREP_ACT, PREP_O, QKV, QKV_LIN, TASKS_PER_THREAD, _arena, _check_weights, _lines, _norms,
                      _on_huge_pages, _panels, _plan, _quant_buffers, _shape)

AHEAD_BYTES = 256 * 1024  # the most a waiting thread asks for of its next linear step's rows (``_wait_streaming``):
# half the smallest L2 per core of current x86 server cores (512 KiB: AMD Zen 2 to Zen 3, AMD's software
# optimization guides; Intel's from Skylake-SP on hold 1-2 MiB), so that the lines are still there when it reads
# them. A wait is rarely long enough to ask for that much (tens of microseconds at ~15 GB/s per core)


# -- the tasks ----------------------------------------------------------------------------------------------------
# A constant argument of a compiled callee is written np.int64(0), not 0: Numba types a bare 0 as Literal[int](0)
# and compiles the callee once more for it beside the int64 of its other calls (``_linear_rows`` and ``_combine``
# were each compiled twice; by Numba's compile events, 2-vCPU AMD EPYC, Zen 3, empty cache: the decode step's
# compile 40.7 -> 35.2 s, ``_worker``'s part of it 23.0 -> 17.7 s).
# A task takes plain arrays: every array taken out of a tuple or a typed list is a new reference, an atomic update
# of a count that all threads share, and at a few dozen per task those updates cost more than the task (the linear
# steps ran 2.4x slower on two threads than on one). So a worker takes each array out once per step.
@njit(cache=True)
def _linear_rows(kind, path, ahead, v, w32, w8, absmax_w, row_sums, x_u8, J, cols, x_o, absmax_x, y, n0, n1, shift):
    """y[n0:n1] = outputs n0..n1-1 of one linear of ``kind`` (FLOAT32, INT8_ROWS, INT8_PANELS) for the input v
    (already prepared into x_u8 .. absmax_x, with J outliers, when int8: w8 is then the weight in rows, or in panels
    with output n in its row n + shift; ``ahead`` the int8 products' prefetch, ``kernels.int8.panels.layout_rows``)."""
    if kind == FLOAT32:
        gemv_rows(v, w32, y, n0, n1)
    else:
        layout_rows(path, kind == INT8_PANELS, x_u8, J, cols, x_o, absmax_x, w8, absmax_w, row_sums, y, n0, n1, shift,
                    ahead)


@njit(cache=True)
def _prepare(is_int8, threshold, v, quant):
    """Quantize v, the input of an int8 linear, into ``quant`` (nothing for a float32 one)."""
    if is_int8:
        flags, cols, x_o, x_u8, absmax_x, n_outliers = quant
        n_outliers[0] = prepare(v.reshape((1, v.size)), threshold, flags, cols, x_o, x_u8, absmax_x)


@njit(inline="always")
def _block(arena, starts, shapes, j, layer):
    """Linear j of block ``layer`` as an (out, in) view of its kind's arena (a 1-D slice, C-contiguous, reshaped)."""
    n_out, k = shapes[j, 0], shapes[j, 1]
    start = starts[layer, j]
    return arena[start:start + n_out * k].reshape((n_out, k))


@njit(inline="always")
def _linear_of(kind, layer):
    """(j, lin): the linear layer that a step of ``kind`` in block ``layer`` runs or prepares the input of (j =
    HEAD_LIN for the final norm and the head) and its index among all linears (4·layer + j; the head 4·L)."""
    j = HEAD_LIN
    if kind == NORM_ATTN or kind == QKV:
        j = QKV_LIN
    elif kind == PREP_O or kind == O_PROJ:
        j = O_LIN
    elif kind == NORM_FFN or kind == GATE_UP:
        j = GATE_UP_LIN
    elif kind == PREP_ACT or kind == DOWN:
        j = DOWN_LIN
    return j, 4 * layer + j if j != HEAD_LIN else 4 * layer


@njit(cache=True)
def _ahead_rows(first_task, last_task, rows_per_task, n_features, row_bytes, pair):
    """The rows first .. last − 1 that a thread asks for ahead of its home block (tasks first_task .. last_task − 1
    of ``rows_per_task`` features each, of ``n_features``): the block's first rows, at most AHEAD_BYTES of them
    (shared between the gate and the up rows when ``pair``)."""
    first = first_task * rows_per_task
    last = min(last_task * rows_per_task, n_features)
    most = max(1, AHEAD_BYTES // (row_bytes * (2 if pair else 1)))
    return first, max(first, min(last, first + most))


@njit(cache=True)
def _wait_streaming(counters, done, n_tasks, w, first, last, pair):
    """``wait_until(counters, done, n_tasks)``, asking meanwhile for rows first .. last − 1 of the (N, K) weight w
    into L2, eight lines at a time between two looks at the count (with ``pair``, also the same rows of its second
    half: the up rows of the gate rows first .. last − 1). It stops asking when the count is reached."""
    flat, K = w.reshape(-1), w.shape[1]  # one view for the whole wait (a view counts a reference: see prefetch_rows)
    line = max(1, CACHE_LINE_BYTES // flat.itemsize)  # elements
    half = (w.shape[0] // 2) * K if pair else 0
    p, end = first * K, last * K
    p2, end2 = (half + p, half + end) if pair else (0, 0)
    while (p < end or p2 < end2) and atomic_load(counters, done) < n_tasks:
        if p < end:
            for i in range(8):
                prefetch_l2(flat, p + i * line)
            p += 8 * line
        else:
            for i in range(8):
                prefetch_l2(flat, p2 + i * line)
            p2 += 8 * line
    wait_until(counters, done, n_tasks)


@njit(inline="always")
def _wait_ahead(counters, done, n_tasks, w, first_task, last_task, rows_per_task, pair):
    """``_wait_streaming`` over the first rows of the home block (tasks first_task .. last_task − 1) of the next
    step, whose weight is w (N, K)."""
    first, last = _ahead_rows(first_task, last_task, rows_per_task, w.shape[0] // (2 if pair else 1),
                              w.shape[1] * w.itemsize, pair)
    _wait_streaming(counters, done, n_tasks, w, first, last, pair)


@njit(cache=True)
def _worker(worker, n_workers, plan, counters, path, row_prefetch, weights, lin_kind, thresholds, norms, kv, bufs,
            quant_h, quant_i, rot, outliers):
    """Run the plan's steps in order: claim the step's tasks until none is left, then wait for all to finish."""
    kinds, layers, tasks, rows, ahead = plan
    # the blocks' weights in one arena of their kind (``_arena``: layer by layer), their scales blocks_*[j] (L, out)
    arena32, head32, arena8, head8, blocks_a, head_a, blocks_r, head_r, starts, shapes = weights
    attn_norms, ffn_norms, final_norm, eps = norms
    keys, values, slots = kv
    x, h, qkv, o, ya, gate_up, act, delta, logits, empty, parts = bufs
    cos, sin, scale = rot
    n_kv, d = keys.shape[1], keys.shape[3]
    group = o.size // d // n_kv
    width = piece_width(group, d)
    pieces = parts.size // (n_kv * width)  # a kv head's pieces of slots at most (``_plan``)
    for s in range(kinds.size):
        kind, layer, n_tasks = kinds[s], layers[s], tasks[s]
        # this step's arrays, taken once: its linear j of block ``layer`` (the head is linear 4·L), its input v_in,
        # output y, prepared input, norm weight and residual branch
        j, lin = _linear_of(kind, layer)
        v_in, y, w32, w8, absmax_w, row_sums = h, logits, head32, head8, head_a, head_r
        if j == QKV_LIN:
            y = qkv
        elif j == O_LIN:
            v_in, y = o, ya
        elif j == GATE_UP_LIN:
            y = gate_up
        elif j == DOWN_LIN:
            v_in, y = act, delta
        is_int8 = lin_kind[lin] != FLOAT32
        if j != HEAD_LIN and is_int8:
            w8, absmax_w, row_sums = _block(arena8, starts, shapes, j, layer), blocks_a[j][layer], blocks_r[j][layer]
        elif j != HEAD_LIN:
            w32 = _block(arena32, starts, shapes, j, layer)
        threshold = thresholds[lin]
        quant = quant_i if j == DOWN_LIN else quant_h
        flags, cols, x_o, x_u8, absmax_x, n_outliers = quant
        J = n_outliers[0]  # set by the step before (the one that prepared this input)
        norm, residual = final_norm, delta
        if kind == NORM_ATTN:
            norm, residual = attn_norms[layer], delta if layer > 0 else empty
        elif kind == NORM_FFN:
            norm, residual = ffn_norms[layer], ya
        layer_kv = min(layer, keys.shape[0] - 1)  # the head's step has no cache of its own
        k_cache, v_cache = keys[layer_kv], values[layer_kv]
        claims = s * (n_workers + 1) * COUNTER_STRIDE  # the step's home blocks' claim counts, then its done count
        done = claims + n_workers * COUNTER_STRIDE
        while True:
            t = claim(counters, claims, worker, n_workers, n_tasks)
            if t < 0:
                break
            n0 = t * rows[s]
            if kind == NORM_ATTN or kind == NORM_FFN or kind == NORM_FINAL:
                # x += the residual branch (none before the first block), h = RMSNorm(x) · weight, h prepared
                _add_rms_norm(x, residual, norm, eps, h)
                _prepare(is_int8, threshold, h, quant)
                outliers[lin] += n_outliers[0] if is_int8 else 0  # one task: this thread alone writes it
            elif kind == PREP_O or kind == PREP_ACT:
                _prepare(is_int8, threshold, v_in, quant)
                outliers[lin] += n_outliers[0] if is_int8 else 0
            elif kind == ATTEND:  # piece c of kv head g's slots (the slot's own piece: rotate, write it first)
                c, g, n = t // n_kv, t % n_kv, slots[layer]
                if c <= n // PIECE_SLOTS:
                    if c == n // PIECE_SLOTS:
                        _rope_write(qkv, cos, sin, k_cache, v_cache, n, g)
                    part = parts[(g * pieces + c) * width:(g * pieces + c + 1) * width]
                    _attend_piece(qkv, cos, sin, k_cache, v_cache, g, c * PIECE_SLOTS,
                                  min((c + 1) * PIECE_SLOTS, n + 1), scale, part)
                    if pieces == 1:  # no COMBINE step: the one piece is the result
                        _combine(part, np.int64(1), group, d, o[g * group * d:(g + 1) * group * d])
            elif kind == COMBINE:  # kv head t's pieces, in order
                _combine(parts[t * pieces * width:(t + 1) * pieces * width], slots[layer] // PIECE_SLOTS + 1,
                         group, d, o[t * group * d:(t + 1) * group * d])
            elif kind == GATE_UP:  # gate and up rows of the same features, then SwiGLU (Shazeer 2020)
                n_act = act.size
                n1 = min(n0 + rows[s], n_act)
                _linear_rows(lin_kind[lin], path, row_prefetch, h, w32, w8, absmax_w, row_sums, x_u8, J, cols, x_o,
                             absmax_x, gate_up, n0, n1, np.int64(0))
                # the up rows: in panels, the weight's second half of panels (``_panels``)
                _linear_rows(lin_kind[lin], path, row_prefetch, h, w32, w8, absmax_w, row_sums, x_u8, J, cols, x_o,
                             absmax_x, gate_up, n_act + n0, n_act + n1, w8.shape[0] // 2 - n_act)
                _silu_product(gate_up, n_act, act, n0, n1)
            else:  # QKV, O_PROJ, DOWN, HEAD
                _linear_rows(lin_kind[lin], path, row_prefetch, v_in, w32, w8, absmax_w, row_sums, x_u8, J, cols,
                             x_o, absmax_x, y, n0, min(n0 + rows[s], y.size), np.int64(0))
            if s == kinds.size - 1:  # the step that makes the result (the head's rows, or h): count what is not
                # finite while it is in this core's cache, for the caller to refuse (``LlamaDecodeStep.__call__``)
                result, r0, r1 = (h, 0, h.size) if kind == NORM_FINAL else (y, n0, min(n0 + rows[s], y.size))
                not_finite = 0
                for i in range(r0, r1):
                    not_finite += not np.isfinite(result[i])
                if not_finite:
                    atomic_add(counters, kinds.size * (n_workers + 1) * COUNTER_STRIDE, not_finite)
            atomic_add(counters, done, 1)
        # wait for the step's last task; meanwhile ask for this thread's first rows of the next linear step, so
        # that memory keeps streaming through a serial task, an attention or an uneven end of a step
        nxt = ahead[s]
        if nxt < 0:
            wait_until(counters, done, n_tasks)
            continue
        j_next, lin_next = _linear_of(kinds[nxt], layers[nxt])
        first_task, last_task = home_block(worker, n_workers, tasks[nxt])
        pair = kinds[nxt] == GATE_UP  # a task's gate rows and the up rows of the same features
        if lin_kind[lin_next] != FLOAT32:  # (two calls: the int8 and the float32 weight are two types)
            _wait_ahead(counters, done, n_tasks, head8 if j_next == HEAD_LIN else
                        _block(arena8, starts, shapes, j_next, layers[nxt]), first_task, last_task, rows[nxt], pair)
        else:
            _wait_ahead(counters, done, n_tasks, head32 if j_next == HEAD_LIN else
                        _block(arena32, starts, shapes, j_next, layers[nxt]), first_task, last_task, rows[nxt], pair)


PRANGE_ONLY = {"comprehension": False, "reduction": False, "inplace_binop": False, "setitem": False, "numpy": False,
               "stencil": False, "fusion": False, "prange": True}  # Numba's parallel options: the prange loop alone
# runs on the pool; the token loop's copies, zeroing and argmax stay serial code on the calling thread


@njit(cache=True)
def _argmax(values):
    """The index of the first of the largest values (``np.argmax`` of values that are all finite: the step refuses
    a result that is not before it picks a token). A loop of its own: Numba's ``np.argmax``, which handles NaN and
    empty arrays, compiled in 0.28 s against 0.09 s for this loop (one float32 array, 2-vCPU AMD EPYC, Zen 3)."""
    best = 0
    for i in range(1, values.size):
        if values[i] > values[best]:
            best = i
    return best


@njit(parallel=PRANGE_ONLY, cache=True)
def _tokens(first, n_tokens, stop, pick, embedding, cos_rows, sin_rows, tokens, n_workers, plan, counters, path,
            row_prefetch, arena32, head32, arena8, head8, blocks_a, head_a, blocks_r, head_r, starts, shapes, lin_kind,
            thresholds, norms, kv, bufs, quant_h, quant_i, scale, outliers):
    """Up to ``n_tokens`` steps, each one parallel region of ``_worker``s over the plan, at row i of cos_rows,
    sin_rows and at the slots kv[2], which then advance by one (not after a step whose result has values that are
    not finite: it ends the loop). With ``pick`` (greedy decoding, ``LlamaDecodeStep.greedy``): from token ``first``
    on, each token but ``stop`` written to ``tokens`` and its row of ``embedding`` put into x (bufs[0]) before its
    step, the next token the argmax of its logits. Without (``__call__``: one step of the x given; ``stop`` -1),
    x goes through as it is. Returns (steps run, the values that are not finite in the last step's result, the next
    token).

    One compiled function for both (v15): Numba puts a caller through LLVM with its callee's code linked in, and the
    worker's code went through it once more where a loop of tokens called a region of its own."""
    x, logits, slots = bufs[0], bufs[8], kv[2]
    token = first
    for i in range(n_tokens):
        if token == stop:
            return i, 0, token
        tokens[i] = token
        if pick:  # x = embedding[token] (element by element: a slice assignment compiles Numba's shape-mismatch
            # message, ~3 s of a cold compile, for shapes that always match)
            for j in range(x.size):
                x[j] = embedding[token, j]
        for c in range(counters.size):
            counters[c] = 0
        rot = (cos_rows[i], sin_rows[i], scale)
        # (the weights' tuples as arguments of their own: a parallel loop takes no tuple of tuples of arrays)
        for worker in prange(n_workers):  # one worker per thread; a worker that starts late finds its tasks taken
            # (worker as int64: the loop's index is int64 where Numba types the loop, uint64 in the function it
            # makes of the loop's body, and each type would compile _worker once more, ~6 s on the Zen 3)
            _worker(np.int64(worker), n_workers, plan, counters, path, row_prefetch,
                    (arena32, head32, arena8, head8, blocks_a, head_a, blocks_r, head_r, starts, shapes), lin_kind,
                    thresholds, norms, kv, bufs, quant_h, quant_i, rot, outliers)
        not_finite = counters[counters.size - COUNTER_STRIDE]
        if not_finite:  # as ``__call__`` refuses it: its key and value written, its slot not taken
            return i, not_finite, token
        for layer in range(slots.size):
            slots[layer] += 1
        if pick:
            token = _argmax(logits)
    return n_tokens, 0, token


GREEDY_TOKENS = 64  # tokens of one call of ``_tokens`` at most: about 0.5 s of SmolLM2 on two cores; the Python
# between two calls, about 0.5 ms, is 0.1% of that


# -- the public class -----------------------------------------------------------------------------------------------
class LlamaDecodeStep:
    """One token through a Llama decoder (RMSNorm, rotary GQA attention against a KV cache, SwiGLU MLP) and its LM
    head, as one parallel region of the CPU pool.

    Parameters
    ----------
    layers : sequence of (wqkv, wo, w_gate_up, w_down) per block, each float32 (out, in) arrays, or each a
        ``kernels.int8.Int8Linear`` with int8 weights only (no bias, no float16 copy). wqkv stacks the Q, K and V
        projections along its outputs (Hq·d + 2·Hkv·d), w_gate_up the gate and up projections (2·I).
    attn_norms, ffn_norms : (L, hidden) float32, the blocks' RMSNorm weights; final_norm (hidden,).
    head : float32 (vocab, hidden) array or an ``Int8Linear`` of that shape: the LM head.
    n_heads, n_kv_heads, head_dim : the attention's shape (Hq, Hkv, d); eps : RMSNorm's epsilon.

    Notes
    -----
    The blocks' weights are copied into one 1-D array, block by block in the order a token reads them
    (``block_weights``): rows; or, where the int8 products run on ``vpdpbusd`` (``kernels.int8.panels.PANELS``,
    ``int8_panels``), int8 weights in panels of 16 rows, the instruction's operand layout (the int8 LM head gets
    such a copy too). ``stacks`` holds per kind of linear the weights as (L, out, in) rows, with the int8 ones'
    absmax and row sums: views of the array, which a caller may point its own layers at to keep one copy; beside
    int8 panels a stack of the rows (two copies: the per-layer path, prefill's included, reads rows); and the
    head. The region takes each block's weight as a view of the array (taken out of Numba typed lists instead, the
    int8 products ran 3x slower on two threads than on one).
    Calling the step (``__call__``) advances the residual stream x in place, writes each block's key and value at
    its slot and returns the logits (or the final-normed hidden state). One call runs at a time (a lock: the
    region's buffers are the object's own). The outputs are the per-layer path's (``kernels.decode.add_rms_norm``,
    ``rope_attend``, ``swiglu`` between the linear layers), the int8 ones bit for bit. Sources: RMSNorm (Zhang &
    Sennrich 2019), RoFormer (Su et al. 2021), GQA (Ainslie et al. 2023), SwiGLU (Shazeer 2020), LLM.int8()
    (Dettmers et al. 2022).
    """

    NAMES = ("wqkv", "wo", "w_gate_up", "w_down")

    def __init__(self, layers, attn_norms, ffn_norms, final_norm, head, *, n_heads, n_kv_heads, head_dim, eps):
        for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
            check_int(name, value, 1)
        if n_heads % n_kv_heads or head_dim % 2:
            raise ValueError(f"n_heads must be a multiple of n_kv_heads and head_dim even; got {n_heads}, "
                             f"{n_kv_heads}, {head_dim}")
        if not (isinstance(eps, (int, float)) and np.isfinite(eps) and eps > 0):
            raise ValueError(f"eps must be a finite number > 0; got {eps!r}")
        layers = [tuple(block) for block in layers]
        if not layers or any(len(block) != 4 for block in layers):
            raise ValueError("layers must be a non-empty sequence of (wqkv, wo, w_gate_up, w_down)")
        self.n_layers = L = len(layers)
        self.n_heads, self.n_kv_heads, self.head_dim = int(n_heads), int(n_kv_heads), int(head_dim)
        self.eps = float(eps)
        self.hidden = H = n_heads * head_dim
        self.intermediate = I = _shape(layers[0][2])[0] // 2
        self.qkv_size = (n_heads + 2 * n_kv_heads) * head_dim
        expected = ((self.qkv_size, H), (H, H), (2 * I, H), (H, I))
        int8_blocks = {isinstance(w, Int8Linear) for block in layers for w in block}
        if len(int8_blocks) != 1:
            raise ValueError("the blocks' linear layers must be all float32 arrays or all Int8Linear")
        self.int8_layers = int8_blocks == {True}
        self.int8_head = isinstance(head, Int8Linear)
        self.vocab = _shape(head)[0]
        for j, (name, shape) in enumerate(zip(self.NAMES, expected)):
            _check_weights([f"layers[{i}].{name}" for i in range(L)], [b[j] for b in layers], shape)
        _check_weights(["head"], [head], (self.vocab, H))  # used in place (a tied head is the embedding)
        # the blocks' weights in one arena, in the order a token reads them: rows, whose (L, out, in) views per kind
        # the model's layers may share (``stacks``; int8 with the stacked absmax and row sums); or, where the int8
        # products run on vpdpbusd (``kernels.int8.panels.PANELS``), int8 panels of 16 rows, the instruction's operand
        # layout (1.15-1.3x the rows' streaming rate there), and the rows stacked per kind beside them for the
        # per-layer path
        self.int8_panels = panel_layout.PANELS and (self.int8_layers or self.int8_head)
        in_panels = self.int8_panels and self.int8_layers
        self.block_weights, starts, views, arena_shapes = _arena(
            [[(_panels(b[j].weight.w_i8, pair=j == GATE_UP_LIN) if in_panels else b[j].weight.w_i8)
              if self.int8_layers else b[j] for b in layers] for j in range(len(self.NAMES))])
        self.stacks = {}
        for j, (name, view) in enumerate(zip(self.NAMES, views)):
            rows = np.stack([b[j].weight.w_i8 for b in layers]) if in_panels else view  # (L, out, in)
            self.stacks[name] = ((rows, np.stack([b[j].weight.absmax for b in layers]).astype(np.float32),
                                  np.stack([b[j].weight.w_row_sums for b in layers]).astype(np.int32))
                                 if self.int8_layers else view)
        self.stacks["head"] = ((np.ascontiguousarray(head.weight.w_i8), np.ascontiguousarray(head.weight.absmax),
                                np.ascontiguousarray(head.weight.w_row_sums)) if self.int8_head
                               else np.ascontiguousarray(head))
        # the int8 head as the products read it: panels on huge pages as the arena, or its rows in place
        self._head8 = (_on_huge_pages(_panels(head.weight.w_i8)) if self.int8_panels else self.stacks["head"][0]) \
            if self.int8_head else None  # (vocab rounded up to 16, hidden rounded up to 4) or (vocab, hidden)
        int8 = [(4 * i + j, b[j]) for i, b in enumerate(layers) for j in range(4) if self.int8_layers]
        int8 += [(4 * L, head)] if self.int8_head else []
        self._int8_linears = [layer for _, layer in int8]  # their thresholds are read at each call
        self._int8_index = np.array([lin for lin, _ in int8], dtype=np.int64)
        int8_kind = INT8_PANELS if self.int8_panels else INT8_ROWS
        self._lin_kind = np.array([int8_kind if self.int8_layers else FLOAT32] * 4 * L
                                  + [int8_kind if self.int8_head else FLOAT32], dtype=np.int8)
        self._thresholds = np.zeros(4 * L + 1, dtype=np.float32)  # of the int8 linears, read at each call
        self._outliers = _lines((4 * L + 1,), np.int64)  # the outlier features each int8 linear met, all calls
        self._outliers[:] = 0
        self._calls = 0
        self._outputs = np.array([s[0] for s in expected] * L + [self.vocab], dtype=np.int64)  # of each linear
        self._norms = (_norms("attn_norms", attn_norms, (L, H)), _norms("ffn_norms", ffn_norms, (L, H)),
                       _norms("final_norm", final_norm, (H,)), self.eps)
        # the kernel's weights: the blocks' arena of their kind, their scales and row sums as four stacks (one tuple
        # type, indexed by the linear at run time), the head's; empty placeholders for the kind a model does not have
        blocks, head_w = [self.stacks[name] for name in self.NAMES], self.stacks["head"]
        no_scales = (np.empty((0, 0), np.float32), np.empty((0, 0), np.int32))
        scales = [b[1:] if self.int8_layers else no_scales for b in blocks]
        no_head = (np.empty((0, 0), np.int8), np.empty(0, np.float32), np.empty(0, np.int32))
        head8 = (self._head8, *head_w[1:]) if self.int8_head else no_head
        empty32, empty8 = np.empty(0, np.float32), np.empty(0, np.int8)
        self._weights = (empty32 if self.int8_layers else self.block_weights,
                         np.empty((0, 0), np.float32) if self.int8_head else head_w,
                         self.block_weights if self.int8_layers else empty8, head8[0],
                         tuple(b[0] for b in scales), head8[1], tuple(b[1] for b in scales), head8[2],
                         starts, arena_shapes)
        # the outputs a linear step divides among its tasks (GATE_UP: features of the SwiGLU product)
        self._outputs_of = {QKV: self.qkv_size, O_PROJ: H, GATE_UP: I, DOWN: H, HEAD: self.vocab}
        self._plans = {}  # by (logits, threads, pieces, tasks per thread)
        self._parts = {}  # the attention pieces' partial results, by pieces per kv head (``_pieces``)
        # the region's buffers and counters, made once (the logits' 196 KB came from fresh pages at each call):
        # SmolLM2's int8 step alone 6.2 -> 5.4 ms on the 2-vCPU Xeon; in ``generate``, alternating fresh
        # processes, 152-173 -> 160-168 tokens/s, within that machine's noise
        f32 = np.float32
        self._h, self._logits = _lines((H,), f32), _lines((self.vocab,), f32)  # the next linear's normed input
        self._x = _lines((H,), f32)  # the residual stream of ``greedy``'s tokens
        self._work = (_lines((self.qkv_size,), f32), _lines((H,), f32), _lines((H,), f32),  # qkv, o, wo's output
                      _lines((2 * I,), f32), _lines((I,), f32), _lines((H,), f32))  # gate_up, SwiGLU, w_down's
        self._quant = (_quant_buffers(H), _quant_buffers(I))  # the prepared inputs of the int8 linears
        self._empty = np.empty(0, dtype=f32)  # the first block's residual branch: none
        n_steps = 10 * L + 2  # at most: ten per block, the final norm and the head (``_plan``)
        # per step: each home block's claims, then the step's done count; after the last step, the result's count
        # of values that are not finite
        self._counters = _lines((((numba.config.NUMBA_NUM_THREADS + 1) * n_steps + 1) * COUNTER_STRIDE,), np.int64)
        self._scale = np.float32(1.0 / np.sqrt(self.head_dim))  # as the per-layer path computes the scale
        # ``_tokens``' arguments for a step that picks no token (``_region``): no embedding, one token's slot
        self._no_embedding = np.empty((0, self.hidden), np.float32)
        self._one_token = np.empty(1, np.int64)
        self.row_prefetch = ROW_PREFETCH  # how far ahead the int8 products ask for their weight (``int8_rows``,
        # ``int8_panel_rows``); no value depends on it
        self.tasks_per_thread = TASKS_PER_THREAD  # a linear step's tasks per thread (``_layout._plan``; v16 compared
        # one, two and four, v17 times them: ``tune_tasks_per_thread`` sets it); no value depends on it (a task's
        # outputs are a multiple of 16 but the last, so the rows that a row kernel sums on their own are a linear's
        # last n mod 4 whatever the count)
        self.tuned_seconds = None  # {count: median seconds of a call} of the last tuning, None before one
        self._lock = threading.Lock()

    def _check_caches(self, keys, values, slots):
        for name, a in (("keys", keys), ("values", values)):
            if not isinstance(a, np.ndarray) or a.dtype != np.float32 or not a.flags.c_contiguous \
                    or not a.flags.writeable or a.ndim != 4 \
                    or a.shape[:2] != (self.n_layers, self.n_kv_heads) or a.shape[3] != self.head_dim:
                raise ValueError(f"{name} must be a writeable C-contiguous float32 array (L, Hkv, capacity, d) = "
                                 f"({self.n_layers}, {self.n_kv_heads}, capacity, {self.head_dim}); got "
                                 f"{getattr(a, 'dtype', type(a).__name__)} {np.shape(a)}")
        if values.shape != keys.shape:
            raise ValueError(f"keys and values must have one shape; got {keys.shape}, {values.shape}")
        slots = np.asarray(slots)
        if slots.shape != (self.n_layers,) or slots.dtype.kind not in "iu" or np.any(slots < 0) \
                or np.any(slots >= keys.shape[2]):
            raise ValueError(f"slots must be ({self.n_layers},) integers, each a free slot of the cache "
                             f"(0 <= slot < capacity {keys.shape[2]}); got {slots!r}")
        return slots.astype(np.int64)

    def __call__(self, x, cos, sin, keys, values, slots, *, logits=True):
        """One token: x (hidden,) float32, its embedding, is advanced in place through the blocks; cos, sin (d/2,)
        float32 its rotary angles; block i writes its key and value at slot ``slots[i]`` of keys[i], values[i]
        ((L, Hkv, capacity, d) float32 each) and attends to slots 0..slots[i]. Returns the logits (vocab,) float32,
        or with ``logits=False`` the final-normed hidden state (hidden,).

        Raises ``ValueError`` for shapes that do not fit and when the step produced a value that is not finite (a
        hidden state past float32's range: the per-layer path's linear layers refuse those inputs)."""
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.shape != (self.hidden,) \
                or not x.flags.c_contiguous or not x.flags.writeable:
            raise ValueError(f"x must be a writeable C-contiguous float32 array ({self.hidden},); got "
                             f"{getattr(x, 'dtype', type(x).__name__)} {np.shape(x)}")
        half = self.head_dim // 2
        for name, a in (("cos", cos), ("sin", sin)):
            if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != (half,):
                raise ValueError(f"{name} must be a float32 array ({half},); got {np.shape(a)}")
        slots = self._check_caches(keys, values, slots)  # a copy (astype), which the region advances
        n_workers = numba.get_num_threads()
        pieces, parts = self._pieces(int(slots.max()) // PIECE_SLOTS + 1)  # as many as the longest layer needs
        plan = self._plan_for(bool(logits), n_workers, pieces)
        rot = (np.ascontiguousarray(cos), np.ascontiguousarray(sin), self._scale)
        h, out = self._h, self._logits
        with self._lock:  # one call at a time: the buffers are the step's own
            not_finite = self._region(n_workers, plan, x, (keys, values, slots), rot, self._outliers, parts)
            self._calls += 1
            result = (out if logits else h).copy()
        if not_finite:
            raise ValueError(f"the decode step produced {not_finite} values that are not finite (a hidden state past "
                             f"float32's range)")
        return result

    def greedy(self, token, n_tokens, embedding, cos, sin, keys, values, slots, *, stop=-1):
        """Greedy decoding in compiled loops of steps: from ``token`` on, up to ``n_tokens`` tokens, stopping before
        the first that equals ``stop``. Each token goes through the step as ``__call__`` would take it: x its row of
        ``embedding`` ((vocab, hidden) float32), cos[i], sin[i] ((n_tokens, d/2) float32) the rotary angles of the
        i-th token's position, its key and value written at ``slots`` ((L,) int64, advanced in place by one per
        token); the next token is the argmax of its logits (the first of equal maxima, as ``np.argmax``). Returns
        the tokens that went through the step, in order: bit for bit what calling the step token by token and
        taking the argmax gives, with the same cache. The int8 linears' thresholds are read once, when it starts.
        Raises ``ValueError`` as ``__call__`` does for a token whose step produced a value that is not finite: the
        slots then stand after the tokens before it.

        Why: between two calls, the Python of a token (its embedding row, angles, checks, the argmax) took 0.5 ms
        beside a 7 ms int8 step, 8x what the same lines take in a warm loop, the token's weights having just
        streamed through the caches (2-vCPU AMD EPYC). Here the tokens follow each other in one compiled loop, one
        call of it up to each multiple of 512 slots of the longest layer (``PIECE_SLOTS``: the attention's plan
        changes there) and of GREEDY_TOKENS tokens at most (it holds the GIL, as ``__call__`` does: between two calls
        other Python threads run and Ctrl-C is seen)."""
        for name, value in (("token", token), ("n_tokens", n_tokens), ("stop", stop)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name} must be an int; got {value!r}")
        if not 0 <= token < self.vocab or n_tokens < 0:
            raise ValueError(f"token must be in [0, {self.vocab}) and n_tokens >= 0; got {token}, {n_tokens}")
        half = self.head_dim // 2
        for name, a, shape in (("embedding", embedding, (self.vocab, self.hidden)), ("cos", cos, (n_tokens, half)),
                               ("sin", sin, (n_tokens, half))):
            if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != shape \
                    or not a.flags.c_contiguous:
                raise ValueError(f"{name} must be a C-contiguous float32 array {shape}; got "
                                 f"{getattr(a, 'dtype', type(a).__name__)} {np.shape(a)}")
        self._check_caches(keys, values, slots)
        if not isinstance(slots, np.ndarray) or slots.dtype != np.int64 or not slots.flags.writeable:
            raise TypeError(f"slots must be a writeable int64 numpy.ndarray (advanced in place); got "
                            f"{getattr(slots, 'dtype', type(slots).__name__)}")
        if int(slots.max()) + n_tokens > keys.shape[2]:
            raise ValueError(f"the caches hold {keys.shape[2]} slots: no room for {n_tokens} tokens after slot "
                             f"{int(slots.max())}")
        tokens = np.empty(n_tokens, dtype=np.int64)
        token, n_tokens = int(token), int(n_tokens)  # one compiled type (an np.uint64 would not unify with int64)
        stop = int(stop) if 0 <= stop < self.vocab else -1  # a stop past the vocabulary is never met
        n_workers = numba.get_num_threads()
        done = 0
        with self._lock:  # the step's own buffers
            self._set_thresholds()
            while done < n_tokens:
                longest = int(slots.max())
                # the same pieces throughout (``__call__``'s from the longest layer), GREEDY_TOKENS at most
                chunk = min(n_tokens - done, PIECE_SLOTS - longest % PIECE_SLOTS, GREEDY_TOKENS)
                pieces, parts = self._pieces(longest // PIECE_SLOTS + 1)
                plan = self._plan_for(True, n_workers, pieces)
                steer_workers()
                n, not_finite, token = _tokens(
                    token, chunk, stop, True, embedding, cos[done:done + chunk], sin[done:done + chunk],
                    tokens[done:done + chunk], n_workers, plan, self._counters_for(plan, n_workers),  # zeroed there
                    path_marker(), self.row_prefetch, *self._weights, self._lin_kind, self._thresholds, self._norms,
                    (keys, values, slots), self._bufs(self._x, parts),
                    *self._quant, self._scale, self._outliers)
                self._calls += n + bool(not_finite)  # as ``__call__`` counts a refused call
                done += n
                if not_finite:
                    raise ValueError(f"the decode step produced {not_finite} values that are not finite (a hidden "
                                     f"state past float32's range)")
                if n < chunk:  # stopped
                    break
        return [int(t) for t in tokens[:done]]

    def _plan_for(self, logits, n_workers, pieces, tasks_per_thread=None):
        """The plan (``_layout._plan``) at ``tasks_per_thread`` (default: the attribute), made once per key."""
        value = self.tasks_per_thread if tasks_per_thread is None else tasks_per_thread
        check_int("tasks_per_thread", value, 1)
        key = (logits, n_workers, pieces, int(value))
        if key not in self._plans:
            self._plans[key] = _plan(self.n_layers, self._outputs_of, self.n_kv_heads, self.int8_layers,
                                     self.int8_head, logits, n_workers, pieces, int(value))
        return self._plans[key]

    def _set_thresholds(self):
        """The int8 linears' thresholds as they are now, for the next calls of the region."""
        # one assignment from a list (a Python loop of item assignments took ~35 us for SmolLM2's 121 linears)
        self._thresholds[self._int8_index] = [layer.threshold for layer in self._int8_linears]

    def _counters_for(self, plan, n_workers):
        """The region's counters for ``plan`` (``_worker``: each step's counts, then the result's values that are
        not finite)."""
        return self._counters[:plan[0].size * (n_workers + 1) * COUNTER_STRIDE + COUNTER_STRIDE]

    def _bufs(self, x, parts):
        """The region's buffers (``_worker``): the residual stream x, then the step's own, the attention's pieces
        in ``parts``."""
        return (x, self._h, *self._work, self._logits, self._empty, parts)

    def _pieces(self, pieces):
        """(pieces, parts): the buffer of the partial results of ``pieces`` pieces per kv head (made once per
        count)."""
        if pieces not in self._parts:
            group = self.n_heads // self.n_kv_heads
            self._parts[pieces] = _lines((self.n_kv_heads * pieces * piece_width(group, self.head_dim),), np.float32)
        return pieces, self._parts[pieces]

    def _region(self, n_workers, plan, x, kv, rot, outliers, parts):
        """Run ``plan`` once on x and the step's own buffers (the caller holds the lock), the attention's pieces in
        ``parts`` (``_pieces``): one step of ``_tokens`` that picks no token, at the slots kv[2], which it advances
        (the callers' own copies); the count of the result's values that are not finite."""
        self._set_thresholds()
        cos, sin, scale = rot
        steer_workers()
        _, not_finite, _ = _tokens(0, 1, -1, False, self._no_embedding, cos[None], sin[None], self._one_token,
                                   n_workers, plan, self._counters_for(plan, n_workers), path_marker(),
                                   self.row_prefetch, *self._weights, self._lin_kind, self._thresholds, self._norms,
                                   kv, self._bufs(x, parts), *self._quant, scale, outliers)
        return not_finite

    @property
    def outlier_products(self) -> float:
        """The int8 linears' outputs times the outlier features of their inputs, per call so far (0 before the
        first): the products of LLM.int8()'s float16 path in a token, which depend on the data (the hidden states'
        features of magnitude >= the threshold), not on the shapes."""
        return float(self._outputs @ self._outliers) / self._calls if self._calls else 0.0

    def fixed_seconds(self, context, *, calls=15, seed=0):
        """The median seconds of one token's step without its weights: the same region, steps and tasks at
        ``context`` cached tokens per block, every task claimed and waited for, the serial ones (the norms, the
        quantization of the int8 linears' inputs, the attention over context + 1 tokens) done as in a call, the linear
        tasks given no rows (they read no weight and ask for none ahead). What a token costs beside streaming its
        weights: the launch, the serial work and the threads' hand-offs between steps (``simulator.report.model``
        adds it to the weights' streaming time). Its caches and input are its own, and a call's outputs and the
        outlier counts stay as they were."""
        check_int("calls", calls, 1)
        rng, keys, values, slots, rot, x = self._own_inputs(context, seed)
        n_workers = numba.get_num_threads()
        pieces, parts = self._pieces(int(context) // PIECE_SLOTS + 1)
        kinds, layers, tasks, rows, ahead = self._plan_for(True, n_workers, pieces)
        rows = np.where(np.isin(kinds, LINEAR_STEPS), 0, rows)  # a linear task of no rows: n0 = n1 = 0
        plan = (kinds, layers, tasks, rows, ahead)
        outliers = np.zeros_like(self._outliers)  # not the caller's counts
        seconds = []
        with self._lock:  # the step's own buffers, which every call writes before it reads them
            for a in self._work:  # what the linears would have written: finite values of a hidden state's size
                a[:] = rng.standard_normal(a.size, dtype=np.float32)
            for _ in range(calls + 1):  # the first call compiles nothing new but warms the buffers: not counted
                x0, slots0 = x.copy(), slots.copy()  # (the region advances the slots it is given)
                start = time.perf_counter()
                self._region(n_workers, plan, x0, (keys, values, slots0), rot, outliers, parts)
                seconds.append(time.perf_counter() - start)
        return float(np.median(seconds[1:]))

    def tune_tasks_per_thread(self, counts=(1, 2, 4), *, rounds=8, calls=2, context=16, seed=0):
        """Time the whole step at each of ``counts`` tasks per thread of a linear step, keep the fastest as
        ``tasks_per_thread`` and return {count: the median seconds of a call} (kept as ``tuned_seconds``).

        Why: fewer tasks mean fewer claims and hand-offs and longer runs of weight rows per task, more tasks cover
        a thread that starts late or is preempted; which wins depends on the machine (v16, v17), and no value of
        the outputs depends on it. In each of ``rounds`` rounds every count runs ``calls`` calls back to back, the
        counts in turn, their order reversed every other round, so that each round meets one phase of the machine;
        a count's time is the median over the rounds (the first in ``counts`` of equal medians wins). The calls
        are the region's own, on caches of ``context`` tokens per block and an input of its own (random, from
        ``seed``), as ``fixed_seconds`` takes them, weights included: the caller's caches, inputs, outlier counts
        and calls are left as they were. The count is timed at the current thread count and used at any;
        ``tasks_per_thread`` may be set by hand instead."""
        expected = f"counts must be a non-empty sequence of ints >= 1; got {counts!r}"
        try:
            counts = None if isinstance(counts, (str, bytes)) else list(counts)
        except TypeError:  # not iterable: an int, a 0-d array
            counts = None
        if counts is None:
            raise TypeError(expected)
        if not counts:
            raise ValueError(expected)
        try:  # each count as check_int takes one (a TypeError where not an int, a ValueError under 1)
            counts = list(dict.fromkeys(check_int("counts", c, 1) for c in counts))  # each once, in the order given
        except (TypeError, ValueError) as err:
            raise type(err)(expected) from None
        check_int("rounds", rounds, 1)
        check_int("calls", calls, 1)
        _, keys, values, slots, rot, x = self._own_inputs(context, seed)
        n_workers = numba.get_num_threads()
        pieces, parts = self._pieces(int(context) // PIECE_SLOTS + 1)
        plans = {count: self._plan_for(True, n_workers, pieces, count) for count in counts}
        outliers = np.zeros_like(self._outliers)  # not the caller's counts
        seconds = {count: [] for count in counts}

        def run(count):
            x0, slots0 = x.copy(), slots.copy()  # (the region advances the slots it is given)
            self._region(n_workers, plans[count], x0, (keys, values, slots0), rot, outliers, parts)

        with self._lock:  # the step's own buffers
            for count in counts:  # warm each plan's buffers and counters: not timed
                run(count)
            for r in range(rounds):
                for count in counts if r % 2 == 0 else counts[::-1]:
                    start = time.perf_counter()
                    for _ in range(calls):
                        run(count)
                    seconds[count].append((time.perf_counter() - start) / calls)
            medians = {count: float(np.median(times)) for count, times in seconds.items()}
            self.tasks_per_thread = min(medians, key=medians.get)  # the first in ``counts`` of equal medians
            self.tuned_seconds = dict(medians)
        return medians

    def _own_inputs(self, context, seed):
        """(rng, keys, values, slots, rot, x): caches of ``context`` tokens per block at slot ``context``, rotary
        angles and an input x of the step's own, random from ``seed`` (``fixed_seconds``,
        ``tune_tasks_per_thread``); the caches' memory is checked first."""
        check_int("context", context, 0)
        shape = (self.n_layers, self.n_kv_heads, int(context) + 1, self.head_dim)
        caches = 2  # keys and values
        ensure_fits(caches * math.prod(shape) * np.dtype(np.float32).itemsize,
                    f"caches of {int(context)} tokens per block, {caches} x {shape} float32")
        rng = np.random.default_rng(seed)
        keys, values = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
        slots = np.full(self.n_layers, int(context), dtype=np.int64)
        angles = rng.uniform(0.0, 2 * np.pi, self.head_dim // 2)
        rot = (np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32), self._scale)
        x = rng.standard_normal(self.hidden, dtype=np.float32)
        return rng, keys, values, slots, rot, x
