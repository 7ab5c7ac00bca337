"""KV-cache pruning's public functions: SnapKV and its baselines (StreamingLLM, H2O, uniform random), one call
shape for all, ``fn(q, k, v, *, capacity, ..., backend) -> (k_c, v_c, kept)``, on NumPy or device arrays."""
from __future__ import annotations

import math

import numba
import numpy as np

from .._common import gpu as _gpu
from .._common.dispatch import choose_backend
from .._common.dtypes import check_finite, check_float_dtype, check_int
from .._common.memory import copy_bytes, ensure_fits
from .._common.blas import single_threaded_blas
from .._common.threads import by_kv_heads, serial_if_small
from . import _numba_cpu


def _gather_refuses(k):
    """Why the CUDA C gather cannot move k and v, or None: it copies 2- or 4-byte elements."""
    if np.dtype(k.dtype).itemsize not in (2, 4):
        return f"float16 or float32 k and v (its gather moves 2- or 4-byte elements); got {np.dtype(k.dtype).name}"
    return None


def _gather_on_device(k, v, kept, backend):
    """K and V rows at the host positions ``kept`` (B, H, C) (kv heads repeated when H is Hq) on the GPU tier
    ``backend``, for the baselines, whose choice needs no scores: (k_c, v_c, kept), device arrays for device
    inputs, NumPy for NumPy inputs (copied to the device and back, as every GPU backend does)."""
    on_host = isinstance(k, np.ndarray)
    if backend == "cupy":
        from .._common import cuda_c as _cupy

        cupy = _cupy.require_cupy()
        group = kept.shape[1] // k.shape[1]
        kk, vv = (cupy.repeat(_cupy.as_cupy(x), group, axis=1) for x in (k, v))  # (B, H, N, d)
        index = cupy.asarray(kept)[..., None]  # (B, H, C, 1)
        out = (cupy.take_along_axis(kk, index, axis=2), cupy.take_along_axis(vv, index, axis=2), index[..., 0])
        return tuple(cupy.asnumpy(x) for x in out) if on_host else out
    from . import _numba_cuda

    kept_device = _gpu.to_numba(np.ascontiguousarray(kept))
    k_c, v_c = _numba_cuda.gather_kept(*_device_inputs(on_host, np.dtype(k.dtype), k, v), kept_device)
    return tuple(_gpu.like_input(x, on_host) for x in (k_c, v_c, kept_device))


def _device_inputs(on_host, dtype, *arrays):
    """Numba device views (or copies, for NumPy input) of ``arrays`` in the compute dtype."""
    from .._common.numba_cuda import cast

    return [cast(_gpu.to_numba(np.ascontiguousarray(x) if on_host else _gpu.contiguous(x)), dtype)
            for x in arrays]

POOLINGS = ("max", "avg")
GQA_MODES = ("mean", "per-query-head")


_NO_V = object()  # (h2o_scores and snapkv_scores take no v; everywhere else v=None is an error)


def _check_inputs(q, k, v=_NO_V, *, device_ok=False, same_length=True, scored=False, q_name="q"):
    """The arrays' types, dtypes and shapes, before any kernel indexes them: 4-D, B, H and d >= 1, k and v alike,
    q and k sharing B and d, Hq a multiple of Hkv, (``same_length``) q and k the prompt's N queries and keys, and
    (``scored``: the policy ranks positions by attention) no NaN or ±inf in q and k, which no ranking survives."""
    arrays = ((q_name, q), ("k", k)) + ((("v", v),) if v is not _NO_V else ())
    for name, x in arrays:
        if not isinstance(x, np.ndarray) and not (device_ok and _gpu.is_device_array(x)):
            expected = "a numpy.ndarray or a device array" if device_ok else "a numpy.ndarray"
            raise TypeError(f"{name} must be {expected}; got {type(x).__name__}")
        check_float_dtype(name, x)
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D (B, H, N, d); got shape {x.shape}")
    for name, x in arrays:
        for axis, dim in (("B", 0), ("H", 1), ("d", 3)):
            if x.shape[dim] < 1:
                raise ValueError(f"{name} must have {axis} >= 1 (shape (B, H, N, d)); got shape {x.shape}")
    if v is not _NO_V and k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k {k.shape}, v {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {q.shape} and k {k.shape} must share the batch size and head dim")
    if same_length and q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must be the prompt's queries and keys, of one length N; got q {q.shape}, "
                         f"k {k.shape}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"the number of query heads must be a multiple of the number of key/value heads (GQA); "
                         f"got Hq={q.shape[1]}, Hkv={k.shape[1]}")
    on_device = [_gpu.is_device_array(x) for _, x in arrays]
    if any(on_device) and not all(on_device):
        raise TypeError("q, k and v must all be NumPy arrays or all device arrays")
    if scored:
        for name, x in arrays[:2]:
            check_finite(name, x, "so its attention scores cannot rank the positions to keep")


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; known: {', '.join(repr(c) for c in choices)}")


def _check_scoring(kernel_size, pooling, gqa):
    kernel_size = check_int("kernel_size", kernel_size, 1)
    if kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be odd (a centred window); got {kernel_size}")
    _check_choice("pooling", pooling, POOLINGS)
    _check_choice("gqa", gqa, GQA_MODES)
    return kernel_size


def _compute_dtype(x):
    return np.float64 if np.dtype(x.dtype) == np.float64 else np.float32


def _check_scores(scores, dtype):
    """Scores of finite q and k that are not finite: their products overflowed ``dtype`` (|q|, |k| ~ 1e19 in
    float32), and the ranking would follow the NaN and ±inf (max pooling skips NaN; every score of −inf kept
    positions 0, 1, 2 ...)."""
    if not np.isfinite(scores).all():
        raise ValueError(f"q and k give attention scores that are not finite: their dot products overflow "
                         f"{np.dtype(dtype).name}, so they cannot rank the positions to keep (scale them down)")
    return scores


def _ensure_scoring_fits(name, inputs, dtype, held, later, tasks, rows, N):
    """Refuse a CPU scoring call (``snapkv_scores``, ``h2o_scores``) before its copies and scores are made when its
    peak would not fit the machine's memory: the copies of the inputs (those not C-contiguous in the compute
    ``dtype``) and the ``held`` scores throughout, and on top of them either each running task's block of S, ``rows``
    × N (one task per thread at a time, ``tasks`` in all), or afterwards the ``later`` scores (pooled, averaged)."""
    dt = np.dtype(dtype)
    running = min(numba.get_num_threads(), tasks)
    ensure_fits(copy_bytes(inputs, dt) + (held + max(running * rows * N, later)) * dt.itemsize,
                f"{name} on the CPU (its inputs in {dt.name}, C-contiguous; {held} scores, then {running} blocks of "
                f"scores S of ({rows}, {N}) at once or {later} more scores)")


def snapkv_scores(q_window, k, *, kernel_size=7, pooling="max", gqa="mean", backend="auto"):
    """SnapKV importance of each prefix position (Li et al. 2024, §4.2, "voting" and "clustering").

    Parameters
    ----------
    q_window : ndarray (B, Hq, w, d)
        The last w queries of the prompt (the observation window).
    k : ndarray (B, Hkv, N, d)
        All N keys of the prompt (N > w).
    kernel_size : odd int >= 1
        Width of the 1-D pooling along positions (stride 1, padding kernel_size // 2).
    pooling : {"max", "avg"}
        "avg" counts the padding as zeros; "max" ignores it.
    gqa : {"mean", "per-query-head"}
        "mean" averages the scores of a kv head's query heads: (B, Hkv, N − w). "per-query-head": (B, Hq, N − w).

    backend : {"auto", "cpu", "numba-cuda", "cupy"}
        As for ``snapkv_compress``.

    Returns
    -------
    scores : ndarray, float32 (float64 for float64 input), the pooled sum over the window queries of their
        softmax probabilities (scaled by 1/sqrt(d), causal inside the window) for positions [0, N − w).
    """
    _check_inputs(q_window, k, device_ok=True, same_length=False, scored=True, q_name="q_window")
    kernel_size = _check_scoring(kernel_size, pooling, gqa)
    backend = choose_backend("snapkv_scores", backend, {"q_window": q_window, "k": k})
    B, Hq, w, d = q_window.shape
    Hkv, N = k.shape[1], k.shape[2]
    if w >= N:
        raise ValueError(f"the window ({w} queries) must be shorter than the prompt (N = {N})")
    dt = _compute_dtype(q_window)
    if backend == "cupy":
        from .._common import cuda_c as _cupy
        from . import _cupy as tier2

        scores = tier2.snapkv_scores(q_window, k, kernel_size, pooling, gqa)
        scores = scores.astype(dt, copy=False)
        return _cupy.require_cupy().asnumpy(scores) if isinstance(q_window, np.ndarray) else scores
    if backend == "numba-cuda":
        from . import _numba_cuda

        on_host = isinstance(q_window, np.ndarray)
        qw, kk = _device_inputs(on_host, dt, q_window, k)
        return _gpu.like_input(_numba_cuda.snapkv_scores(qw, kk, kernel_size, pooling, gqa), on_host)
    later = (Hq + (Hkv if gqa == "mean" else 0)) * B * (N - w)  # pooled; its mean over a group
    _ensure_scoring_fits("snapkv_scores", (q_window, k), dt, B * Hq * (N - w), later, B * Hq, w, N)
    qw = np.ascontiguousarray(q_window, dtype=dt)
    kk = np.ascontiguousarray(k, dtype=dt)
    summed = np.empty((B, Hq, N - w), dtype=dt)
    # small: on this thread; beside held cores in parts (threads.in_parts)
    _by_kv_heads(_numba_cpu.window_scores, qw, kk, 1.0 / math.sqrt(d), summed, head_multiply_adds=w * N * d)
    pooled = np.empty_like(summed)
    rows = (B * Hq, N - w)
    with serial_if_small(elements=summed.size * kernel_size):  # an element pass, kernel_size reads per output
        _numba_cpu.pool(summed.reshape(rows), kernel_size, pooling == "max", pooled.reshape(rows))
    if gqa == "mean":
        pooled = pooled.reshape(B, Hkv, Hq // Hkv, N - w).mean(axis=2)
    return _check_scores(pooled, dt)


def _by_kv_heads(kernel, q, k, scale, out, *, head_multiply_adds):
    """``kernel(q, k, scale, out)`` (queries (B, Hq, ., d), keys (B, Hkv, N, d), ``out`` (B, Hq, .) written) as
    ``threads.by_kv_heads`` runs it, a query head's products ``head_multiply_adds``; its BLAS on one thread
    (``single_threaded_blas``, entered after the thread count is set: on one thread it leaves the workers'
    affinities alone)."""
    def whole():
        with single_threaded_blas():
            kernel(q, k, scale, out)

    def part(b, heads, kv):
        with single_threaded_blas():
            kernel(q[b:b + 1, heads], k[b:b + 1, kv], scale, out[b:b + 1, heads])

    by_kv_heads(q.shape[0], q.shape[1], k.shape[1], head_multiply_adds, whole, part)


def top_positions(scores, n_keep):
    """Positions of the n_keep largest scores along the last axis, ties to the lower position, sorted ascending.

    O(N) per row: a partition finds the n_keep-th largest value; everything above it is kept, and of the values
    equal to it the lowest positions fill what is left.
    """
    if not isinstance(scores, np.ndarray):
        raise TypeError(f"scores must be a numpy.ndarray; got {type(scores).__name__}")
    if scores.ndim < 1:
        raise ValueError(f"scores must have at least one axis (positions along the last); got shape {scores.shape}")
    check_float_dtype("scores", scores)
    check_finite("scores", scores, "which ranks no position")
    return _top_positions(scores, check_int("n_keep", n_keep, 0))


def _top_positions(scores, n_keep):
    """``top_positions`` on scores computed from checked inputs."""
    P = scores.shape[-1]
    if n_keep <= 0:
        return np.zeros(scores.shape[:-1] + (0,), dtype=np.int64)
    if n_keep >= P:
        return np.broadcast_to(np.arange(P), scores.shape).copy()
    threshold = np.partition(scores, P - n_keep, axis=-1)[..., P - n_keep, None]  # the n_keep-th largest
    above = scores > threshold
    equal = scores == threshold
    room = n_keep - above.sum(axis=-1, keepdims=True)
    keep = above | (equal & (np.cumsum(equal, axis=-1) <= room))
    return np.nonzero(keep)[-1].reshape(scores.shape[:-1] + (n_keep,))


def _gather(k, v, kept, heads):
    """K and V rows at ``kept`` (B, heads, C); with ``heads`` = Hq (a cache per query head), head h reads kv head
    h // group. The result is refused before it is made when it would not fit the machine's memory (with Hq heads
    it is group times the kv heads' size)."""
    B, Hkv, _, d = k.shape
    C, group = kept.shape[-1], heads // Hkv
    ensure_fits(2 * B * heads * C * d * k.itemsize, f"the kept keys and values, 2 × ({B}, {heads}, {C}, {d}) in "
                f"{k.dtype}")
    if group == 1:
        index = kept[..., None]
        return np.take_along_axis(k, index, axis=2), np.take_along_axis(v, index, axis=2)
    k_c, v_c = np.empty((B, heads, C, d), k.dtype), np.empty((B, heads, C, d), v.dtype)
    for h in range(heads):  # (head by head: the kv heads repeated group times first was group × the whole k and v)
        index = kept[:, h, :, None]  # (B, C, 1)
        k_c[:, h] = np.take_along_axis(k[:, h // group], index, axis=1)
        v_c[:, h] = np.take_along_axis(v[:, h // group], index, axis=1)
    return k_c, v_c


def _unchanged(q, k, v, heads):
    kept = np.broadcast_to(np.arange(k.shape[2]), (k.shape[0], heads, k.shape[2])).copy()
    k_c, v_c = _gather(k, v, kept, heads) if heads != k.shape[1] else (k.copy(), v.copy())
    return k_c, v_c, kept


def snapkv_compress(q, k, v, *, capacity, window=32, kernel_size=7, pooling="max", gqa="mean", backend="auto"):
    """Compress a prompt's KV cache to ``capacity`` tokens per head with SnapKV (Li et al. 2024).

    The last ``window`` queries vote (``snapkv_scores``); per head the top ``capacity − window`` prefix positions
    are kept (ties to the lower position) plus the whole window. A prompt of N <= capacity comes back unchanged.

    Parameters
    ----------
    q : (B, Hq, N, d); k, v : (B, Hkv, N, d), float, Hq a multiple of Hkv.
    capacity : int > window
    window, kernel_size, pooling, gqa
        As for ``snapkv_scores``. The paper's numbers come from its reference code, which repeats the kv heads and
        selects per query head (``gqa="per-query-head"``, a cache of Hq heads); ``"mean"`` (the default) keeps
        Hkv heads, so the cache stays 1/group of that size.
    backend : {"auto", "cpu", "numba-cuda", "cupy"}
        ``"cpu"``: Numba on this machine, for NumPy inputs. ``"numba-cuda"``: the Numba-CUDA kernels
        (``kernels/kvprune/_numba_cuda.py``); ``"cupy"``: the CUDA C kernels (``kernels/kvprune/snapkv.cu``, a
        radix-select top-k). For both GPU backends NumPy inputs are copied to the device and the results back.
        ``"auto"``: device inputs (CuPy, ``__cuda_array_interface__``) on the GPU (CUDA C when CuPy is installed
        and k is float16 or float32, else Numba-CUDA), returning device arrays.

    Returns
    -------
    k_c, v_c : (B, H, min(N, capacity), d) with H = Hkv ("mean") or Hq ("per-query-head")
    kept : int64 (B, H, min(N, capacity)), the original positions, ascending. The keys keep their rotary
        positions (they were rotated before caching), so decoding continues at position N.

    Raises
    ------
    ValueError, TypeError
        capacity <= window, window < 1, an even or non-positive kernel_size, unknown pooling or gqa, bad shapes.
    """
    _check_inputs(q, k, v, device_ok=True, scored=True)
    window = check_int("window", window, 1)
    capacity = check_int("capacity", capacity, 1)
    if capacity <= window:
        raise ValueError(f"capacity must exceed window ({window}); got capacity={capacity}")
    kernel_size = _check_scoring(kernel_size, pooling, gqa)
    backend = choose_backend("snapkv_compress", backend, {"q": q, "k": k, "v": v},
                             cupy_refuses=lambda: _gather_refuses(k))
    heads = k.shape[1] if gqa == "mean" else q.shape[1]
    N = k.shape[2]
    if backend == "numba-cuda":
        return _snapkv_numba_cuda(q, k, v, capacity, window, kernel_size, pooling, gqa)
    if backend == "cupy":
        return _snapkv_cupy(q, k, v, capacity, window, kernel_size, pooling, gqa)
    if N <= capacity:
        return _unchanged(q, k, v, heads)
    scores = snapkv_scores(q[:, :, N - window:], k, kernel_size=kernel_size, pooling=pooling, gqa=gqa)
    prefix = _top_positions(scores, capacity - window)  # (scores of checked q and k)
    tail = np.broadcast_to(np.arange(N - window, N), prefix.shape[:-1] + (window,))
    kept = np.concatenate([prefix, tail], axis=-1)
    k_c, v_c = _gather(k, v, kept, heads)
    return k_c, v_c, kept


def _snapkv_numba_cuda(q, k, v, capacity, window, kernel_size, pooling, gqa):
    from . import _numba_cuda

    on_host = isinstance(q, np.ndarray)
    N = k.shape[2]
    heads = k.shape[1] if gqa == "mean" else q.shape[1]
    if N <= capacity:  # nothing to prune: every position (kv heads repeated for "per-query-head")
        if on_host:
            return _unchanged(q, k, v, heads)
        kept = _gpu.to_numba(np.broadcast_to(np.arange(N), (k.shape[0], heads, N)))
        k_c, v_c = _numba_cuda.gather_kept(*_device_inputs(False, np.dtype(k.dtype), k, v), kept)
        return tuple(_gpu.like_input(x, False) for x in (k_c, v_c, kept))
    dt = _compute_dtype(q)
    qq, kk, vv = _device_inputs(on_host, dt, q, k, v)
    scores = _numba_cuda.snapkv_scores(qq[:, :, N - window:], kk, kernel_size, pooling, gqa)
    k_c, v_c, kept = _numba_cuda.select_and_gather(scores, kk, vv, capacity - window, window)
    if on_host:
        k_c, v_c = k_c.copy_to_host().astype(k.dtype, copy=False), v_c.copy_to_host().astype(k.dtype, copy=False)
        return k_c, v_c, kept.copy_to_host()
    from .._common.numba_cuda import cast

    return (_gpu.like_input(cast(k_c, np.dtype(k.dtype)), False), _gpu.like_input(cast(v_c, np.dtype(k.dtype)), False),
            _gpu.like_input(kept, False))


def _snapkv_cupy(q, k, v, capacity, window, kernel_size, pooling, gqa):
    from .._common import cuda_c as _cupy
    from . import _cupy as tier2

    cupy = _cupy.require_cupy()
    on_host = isinstance(q, np.ndarray)
    N = k.shape[2]
    heads = k.shape[1] if gqa == "mean" else q.shape[1]
    kk, vv = _cupy.as_cupy(k), _cupy.as_cupy(v)
    if N <= capacity:  # nothing to prune: every position (kv heads repeated for "per-query-head")
        kept = cupy.broadcast_to(cupy.arange(N), (k.shape[0], heads, N)).copy()
        k_c = cupy.repeat(kk, heads // k.shape[1], axis=1)
        v_c = cupy.repeat(vv, heads // k.shape[1], axis=1)
    else:
        scores = tier2.snapkv_scores(_cupy.as_cupy(q)[:, :, N - window:], kk, kernel_size, pooling, gqa)
        k_c, v_c, kept = tier2.select_and_gather(scores, kk, vv, capacity - window, window)
    if on_host:
        return cupy.asnumpy(k_c), cupy.asnumpy(v_c), cupy.asnumpy(kept)
    return k_c, v_c, kept


def streaming_llm(q, k, v, *, capacity, n_sink=4, backend="auto"):
    """StreamingLLM (Xiao et al. 2024): the first ``n_sink`` tokens (attention sinks) plus the most recent.
    ``backend`` as for ``snapkv_compress``: the positions need no scores, so only the gather runs on a GPU tier."""
    _check_inputs(q, k, v, device_ok=True)
    capacity = check_int("capacity", capacity, 1)
    n_sink = check_int("n_sink", n_sink, 0)
    if n_sink >= capacity:
        raise ValueError(f"n_sink must be below capacity ({capacity}); got n_sink={n_sink}")
    backend = choose_backend("streaming_llm", backend, {"q": q, "k": k, "v": v},
                             cupy_refuses=lambda: _gather_refuses(k))
    B, Hkv, N = k.shape[:3]
    positions = np.concatenate([np.arange(n_sink), np.arange(N - (capacity - n_sink), N)]) if N > capacity \
        else np.arange(N)
    kept = np.broadcast_to(positions, (B, Hkv, positions.size)).copy()  # (B, Hkv, min(N, capacity))
    return _kept_rows(k, v, kept, backend)


def _kept_rows(k, v, kept, backend):
    """(k_c, v_c, kept) for host positions ``kept``: gathered on the CPU, or on the GPU tier ``backend``."""
    if backend != "cpu":
        return _gather_on_device(k, v, kept, backend)
    k_c, v_c = _gather(k, v, kept, kept.shape[1])
    return k_c, v_c, kept


H2O_BLOCK = 128  # query rows per block of the H2O scores: O(block · N) memory per thread


def h2o_scores(q, k, *, block=H2O_BLOCK, backend="auto"):
    """Attention each key received, summed over all prompt queries (causal), averaged over a kv head's query
    heads: (B, Hkv, N). Query blocks of ``block`` rows keep the memory at O(block · N) per thread. The CPU tier
    only: device arrays are refused with a message, not copied."""
    _check_inputs(q, k, device_ok=True, scored=True)
    choose_backend("h2o_scores", backend, {"q": q, "k": k}, tiers=("cpu",))
    return _accumulated_scores(q, k, check_int("block", block, 1))


def _accumulated_scores(q, k, block):
    """``h2o_scores`` on checked inputs."""
    B, Hq, N, d = q.shape
    block = min(block, max(N, 1))  # a block of more rows than the prompt has is the whole prompt
    dt = _compute_dtype(q)
    _ensure_scoring_fits("h2o_scores", (q, k), dt, B * Hq * N, B * k.shape[1] * N, B * Hq, block, N)  # totals; mean
    totals = np.empty((B, Hq, N), dtype=dt)
    # each block of rows against every key up to its last row's (the kernel's S = Q_b K[:r1]ᵀ); small: on this thread
    pairs = sum((min(r0 + block, N) - r0) * min(r0 + block, N) for r0 in range(0, N, block))
    _by_kv_heads(lambda q, k, scale, out: _numba_cpu.accumulated_attention(q, k, scale, block, out),
                 np.ascontiguousarray(q, dtype=dt), np.ascontiguousarray(k, dtype=dt), 1.0 / math.sqrt(d), totals,
                 head_multiply_adds=pairs * d)
    return _check_scores(totals.reshape(B, k.shape[1], Hq // k.shape[1], N).mean(axis=2), dt)


def h2o(q, k, v, *, capacity, scores=None, backend="auto"):
    """H2O (Zhang et al. 2023): half the budget for the heavy hitters (most accumulated attention from all prompt
    queries), half for the most recent tokens. ``scores``: ``h2o_scores(q, k)`` computed beforehand, to try
    several capacities on one prompt without scoring it again. The CPU tier only, as ``h2o_scores``."""
    _check_inputs(q, k, v, device_ok=True, scored=True)
    choose_backend("h2o", backend, {"q": q, "k": k, "v": v}, tiers=("cpu",))
    capacity = check_int("capacity", capacity, 2)
    B, Hkv, N = k.shape[:3]
    if scores is not None and not isinstance(scores, np.ndarray):
        raise TypeError(f"scores must be a numpy.ndarray (h2o_scores' result); got {type(scores).__name__}")
    if scores is not None and scores.shape != (B, Hkv, N):
        raise ValueError(f"scores must be an ndarray of shape (B, Hkv, N) = {(B, Hkv, N)}, as h2o_scores returns; "
                         f"got {getattr(scores, 'shape', type(scores).__name__)}")
    if N <= capacity:
        return _unchanged(q, k, v, Hkv)
    n_recent = capacity // 2
    if scores is None:  # q and k are checked above: score them without a second pass over them
        heavy = _top_positions(_accumulated_scores(q, k, H2O_BLOCK)[..., : N - n_recent], capacity - n_recent)
    else:
        heavy = top_positions(scores[..., : N - n_recent], capacity - n_recent)  # (scores checked there)
    kept = np.concatenate([heavy, np.broadcast_to(np.arange(N - n_recent, N), heavy.shape[:-1] + (n_recent,))],
                          axis=-1)
    k_c, v_c = _gather(k, v, kept, Hkv)
    return k_c, v_c, kept


def uniform_random(q, k, v, *, capacity, seed=0, backend="auto"):
    """``capacity`` positions drawn uniformly without replacement per (batch, kv head), from ``seed``; ``backend``
    as for ``streaming_llm``."""
    _check_inputs(q, k, v, device_ok=True)
    capacity = check_int("capacity", capacity, 1)
    seed = check_int("seed", seed, 0)  # (NumPy's own errors named no argument)
    backend = choose_backend("uniform_random", backend, {"q": q, "k": k, "v": v},
                             cupy_refuses=lambda: _gather_refuses(k))
    B, Hkv, N = k.shape[:3]
    if N <= capacity:
        kept = np.broadcast_to(np.arange(N), (B, Hkv, N)).copy()
    else:
        rng = np.random.default_rng(seed)
        kept = np.sort(np.argsort(rng.random((B, Hkv, N)), axis=-1)[..., :capacity], axis=-1)  # (B, Hkv, capacity)
    return _kept_rows(k, v, kept, backend)
