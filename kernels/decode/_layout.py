"""The fused decode step's layout (``kernels.decode._step``): its kinds of step and of linear layer, the plan of one
token's steps and their tasks, the arena its weights lie in (rows, or int8 panels where the products run on
``vpdpbusd``), its buffers on whole cache lines, and the checks of the weights it is given. Plain Python and NumPy,
run when a step is made or a plan is first needed; the region itself is in ``_step``."""
from __future__ import annotations

import numpy as np

from .._common.memory import huge_page_empty
from .._common.prefetch import CACHE_LINE_BYTES
from ..int8 import MAX_EXACT_K, Int8Linear
from ..int8.panels import PANEL_ROWS, pack
from ..int8.rows import padded_k

TASKS_PER_THREAD = 4  # tasks of a linear step per thread until the step is tuned
# (``LlamaDecodeStep.tune_tasks_per_thread`` times one, two and four on the machine): enough for a thread that starts
# late or is preempted to be covered by the others, few enough that each task streams a long run of weight rows
# (``_step``: v8 tried eight, v16 one and two, v17 the tuning)
MIN_ROWS_PER_TASK = PANEL_ROWS  # outputs: a task is a multiple of 16 rows (9-24 KB of int8 at K = 576-1536), so
# that each starts an int8 panel (``kernels.int8.panels``: a task's outputs are whole panels but for the last)

# the kinds of step, in the order a block runs them (COMBINE after ATTEND where a kv head's slots come in pieces)
NORM_ATTN, QKV, ATTEND, COMBINE, PREP_O, O_PROJ, NORM_FFN, GATE_UP, PREP_ACT, DOWN, NORM_FINAL, HEAD = range(12)
QKV_LIN, O_LIN, GATE_UP_LIN, DOWN_LIN, HEAD_LIN = range(5)  # a block's linear layers; the LM head is linear 4·L
FLOAT32, INT8_ROWS, INT8_PANELS = range(3)  # the kinds of linear layer (``lin_kind``): float32 rows, int8 rows,
# int8 panels (``kernels.int8.panels.PANELS`` chooses the int8 layout)
LINEAR_STEPS = (QKV, O_PROJ, GATE_UP, DOWN, HEAD)  # the steps that read a weight


def _lines(shape, dtype):
    """np.empty(shape, dtype) starting on a cache line and padded to whole lines: a small array that one thread
    writes and the others read must not share a line with another one that is written (each write takes the line
    from the readers' caches). With the counters and these buffers allocated by plain ``np.empty``, SmolLM2's int8
    step took 14 ms on two threads as on one; on whole lines, 8 ms on two."""
    n_bytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(n_bytes + 2 * CACHE_LINE_BYTES, dtype=np.uint8)
    start = -raw.ctypes.data % CACHE_LINE_BYTES
    return raw[start:start + n_bytes].view(dtype).reshape(shape)


def _quant_buffers(K):
    """``kernels.int8.rows.prepare``'s buffers for K input features, and the outlier count."""
    n_outliers = _lines((1,), np.int64)
    n_outliers[0] = 0
    return (_lines((K,), np.bool_), _lines((K,), np.int64), _lines((1, K), np.float32),
            _lines((1, padded_k(K)), np.uint8), _lines((1,), np.float32), n_outliers)


def _plan(n_layers, outputs_of, n_kv_heads, int8_layers, int8_head, logits, n_workers, pieces,
          tasks_per_thread=TASKS_PER_THREAD):
    """The steps of one token for ``n_workers`` threads, with a kv head's slots in at most ``pieces`` pieces and a
    linear step's outputs in about ``tasks_per_thread`` tasks per thread (fewer where a task would have fewer than
    MIN_ROWS_PER_TASK outputs):
    (kinds, layers, tasks, rows per task, ahead) int64 arrays; ahead[s] is the first step after s that reads a
    weight (-1 when none does). An attention step's tasks are the pieces, piece by piece across the kv heads; a
    layer with fewer slots than the longest leaves its last tasks empty, and the threads that run out of real ones
    take the others' (``claim``)."""
    steps = []
    for layer in range(n_layers):
        steps += [(NORM_ATTN, layer), (QKV, layer), (ATTEND, layer)]
        steps += [(COMBINE, layer)] if pieces > 1 else []
        steps += [(PREP_O, layer)] if int8_layers else []
        steps += [(O_PROJ, layer), (NORM_FFN, layer), (GATE_UP, layer)]
        steps += [(PREP_ACT, layer)] if int8_layers else []
        steps += [(DOWN, layer)]
    steps.append((NORM_FINAL, n_layers))
    if logits:
        steps.append((HEAD, n_layers))
    kinds, layers = (np.array(column, dtype=np.int64) for column in zip(*steps))
    tasks, rows = np.ones(kinds.size, dtype=np.int64), np.ones(kinds.size, dtype=np.int64)
    for s, kind in enumerate(kinds):
        if kind == ATTEND:
            tasks[s] = n_kv_heads * pieces
        elif kind == COMBINE:
            tasks[s] = n_kv_heads
        elif kind in outputs_of:
            n = outputs_of[kind]
            per_task = -(-n // (tasks_per_thread * n_workers))
            rows[s] = min(n, -(-max(per_task, MIN_ROWS_PER_TASK) // MIN_ROWS_PER_TASK) * MIN_ROWS_PER_TASK)
            tasks[s] = -(-n // rows[s])
    # each step's next step with a weight to read (-1: none), whose rows a thread that waits asks for
    ahead = np.full(kinds.size, -1, dtype=np.int64)
    for s in range(kinds.size - 2, -1, -1):
        ahead[s] = s + 1 if kinds[s + 1] in LINEAR_STEPS else ahead[s + 1]
    return kinds, layers, tasks, rows, ahead


def _shape(w):
    return w.weight.shape if isinstance(w, Int8Linear) else np.shape(w)


def _check_weights(names, weights, shape):
    """Each of ``weights`` a float32 (out, in) = ``shape`` array, or an ``Int8Linear`` of that shape with int8
    weights only, no bias, and a K whose int32 sums are exact."""
    for name, w in zip(names, weights):
        if isinstance(w, Int8Linear):
            if w.weight.w_fp16 is not None or w.bias is not None:
                raise ValueError(f"{name}: an Int8Linear here keeps int8 weights only, with no bias (a float16 copy "
                                 f"or a bias takes the per-layer path)")
            if shape[1] > MAX_EXACT_K:
                raise ValueError(f"{name}: K = {shape[1]} int8 products can overflow an int32 sum; at most "
                                 f"{MAX_EXACT_K} are exact")
        elif not isinstance(w, np.ndarray) or w.dtype != np.float32:
            raise TypeError(f"{name} must be a float32 numpy.ndarray or an Int8Linear; got "
                            f"{getattr(w, 'dtype', type(w).__name__)}")
        if tuple(_shape(w)) != shape:
            raise ValueError(f"{name} must be (out, in) = {shape}; got {tuple(_shape(w))}")


def _arena(per_kind):
    """The blocks' weights, ``per_kind[j][i]`` the (out, in) weight of linear j of block i, copied into one 1-D array
    block by block in the order a token reads them (block 0's wqkv, wo, w_gate_up, w_down, then block 1's, ...), so
    that each thread streams ascending memory through the token. Returns the arena, the element offset of each
    (block, linear) (L, 4), the per-kind (L, out, in) views of it (of panels' bytes where the weights are int8
    panels) and the per-kind (out, in) shapes (4, 2). A plain read of SmolLM2's int8 weights in one region, in the
    step's order, each linear's weight split in two halves, one per thread (2-vCPU Xeon): 27.4 GB/s from four
    stacks, one per kind, 28.0-29.0 from the arena. The arena lies on huge pages
    (``kernels._common.memory.huge_page_empty``, with the evidence)."""
    L = len(per_kind[0])
    shapes = [weights[0].shape for weights in per_kind]  # (out, in) per kind
    sizes = [o * k for o, k in shapes]
    block = sum(sizes)
    offsets = np.cumsum([0] + sizes[:-1])  # of each linear inside a block
    arena = huge_page_empty(L * block, per_kind[0][0].dtype)
    starts = np.empty((L, len(per_kind)), dtype=np.int64)
    for i in range(L):
        for j, weights in enumerate(per_kind):
            starts[i, j] = i * block + offsets[j]
            arena[starts[i, j]:starts[i, j] + sizes[j]] = weights[i].reshape(-1)
    item = arena.itemsize
    views = [np.ndarray((L, o, k), dtype=arena.dtype, buffer=arena, offset=int(offsets[j]) * item,
                        strides=(block * item, k * item, item)) for j, (o, k) in enumerate(shapes)]
    return arena, starts, views, np.array(shapes, dtype=np.int64)


def _panels(w_i8, pair=False):
    """The (N, K) int8 weight in panels of 16 rows (``kernels.int8.panels.pack``); with ``pair`` (the gate and up
    projections stacked), each half packed on its own and the two one after the other, so that the up rows start
    a panel whatever the size of a half."""
    if not pair:
        return pack(w_i8)  # (N rounded up to 16, K rounded up to 4)
    half = w_i8.shape[0] // 2
    return np.concatenate([pack(w_i8[:half]), pack(w_i8[half:])])  # (2 · (half rounded up to 16), K rounded up to 4)


def _on_huge_pages(a):
    """A copy of the array a on huge pages (``kernels._common.memory.huge_page_empty``), as the arena lies."""
    copy = huge_page_empty(a.size, a.dtype).reshape(a.shape)
    copy[...] = a
    return copy


def _norms(name, norms, shape):
    a = np.asarray(norms)
    if a.dtype != np.float32 or a.shape != shape:
        raise ValueError(f"{name} must be float32 {shape}; got {a.dtype} {a.shape}")
    return np.ascontiguousarray(a)
