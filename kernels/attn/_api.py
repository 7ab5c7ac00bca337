"""The public attention function: validates, picks a backend and block sizes, calls the kernel."""
from __future__ import annotations

import math

import numpy as np

from . import _numba_cpu
from .._common import gpu as _gpu
from .._common.dispatch import BACKENDS, choose_backend
from .._common.blas import single_threaded_blas
from .._common.threads import SERIAL_MULTIPLY_ADDS, by_kv_heads, serial_if_small
from ._blocks import default_blocks
from .._common.memory import copy_bytes, ensure_fits
from ._standard import standard_bytes, standard_forward
from ._validate import COMPUTE_DTYPE, as_compute_4d, check_block, validate

ALGORITHMS = ("flash", "standard")


def _check_choice(name, value, choices):
    if value not in choices:
        known = ", ".join(repr(c) for c in choices)
        raise ValueError(f"unknown {name} {value!r}; known: {known}")


def multiply_adds(q_shape, k_shape, causal):
    """Multiply-adds of attention's two products, S = QKᵀ and O = PV, over the (query, key) pairs a query sees:
    2 · B · Hq · d · pairs; with ``causal``, query i of Nq sees keys j <= i + Nk − Nq."""
    B, Hq, Nq, d = q_shape
    Nk = k_shape[2]
    n = min(Nq, Nk)  # causal: the last n rows see Nk − n + 1, ..., Nk keys (the others none)
    pairs = Nq * Nk if not causal else n * (2 * Nk - n + 1) // 2
    return 2 * B * Hq * d * pairs


def _split_count(tasks, n_key_blocks, threads):
    """Split-KV factor (Flash-Decoding): with few query blocks (decode), split the keys so that every thread gets
    several tasks and all threads the same number (3 kv heads on 2 threads: 4 splits, 12 tasks)."""
    if tasks >= 4 * threads or n_key_blocks <= 1:
        return 1
    n_splits = math.ceil(4 * threads / tasks)
    while (tasks * n_splits) % threads and n_splits < n_key_blocks:
        n_splits += 1
    return min(n_splits, n_key_blocks)


def call_threads(q_shape, k_shape, causal) -> int:
    """Threads a CPU ``attention`` call of these shapes is planned for: one when it is small (``serial_if_small``),
    else the pool's count, also where the call runs alone beside held cores (``threads.pool_threads``: the same
    tiles and key splits, hence the same bits, either way)."""
    small = multiply_adds(q_shape, k_shape, causal) < SERIAL_MULTIPLY_ADDS
    return 1 if small else _numba_cpu.num_threads()


def _flash_plan(B, Hq, Hkv, Nq, Nk, d, elem_bytes, block_q, block_k, threads):
    """(Br, Bc, n_splits, tasks) of the CPU flash kernel for these sizes on ``threads`` threads."""
    Br, Bc = default_blocks(d, elem_bytes, Hq // Hkv)
    Br = min(block_q or Br, max(Nq, 1))
    Bc = min(block_k or Bc, max(Nk, 1))
    Tr = math.ceil(Nq / Br)
    n_splits = _split_count(B * Hkv * Tr, math.ceil(Nk / Bc), threads)
    return Br, Bc, n_splits, B * Hkv * Tr * n_splits


def flash_memory_bytes(q_shape, k_shape, elem_bytes, *, block_q=None, block_k=None, causal=False) -> int:
    """Bytes the CPU flash kernel allocates for (B, Hq, Nq, d) queries and (B, Hkv, Nk, d) keys in a dtype of
    ``elem_bytes`` bytes, output included: o and lse, the split-KV partial results, and each worker's tiles.

    A task holds Q_i, O_i and the P·V product (rows × d each), S and P (rows × Bc each) and m_i, l_i, alpha
    (rows each), rows = (Hq / Hkv) · Br (``flash_forward`` in ``_numba_cpu.py``); one set per worker, one worker
    per thread that has a task. This is the O(N·d) of FlashAttention, against the O(N²) of the standard algorithm's
    S and P.
    ``causal`` as the call's: a small call runs on one thread (``call_threads``), with one task's tiles.
    """
    B, Hq, Nq, d = q_shape
    Hkv, Nk = k_shape[1], k_shape[2]
    threads = call_threads(q_shape, k_shape, causal)
    Br, Bc, n_splits, tasks = _flash_plan(B, Hq, Hkv, Nq, Nk, d, elem_bytes, block_q, block_k, threads)
    return _flash_bytes(q_shape, n_splits, _workers(threads, tasks), (Hq // Hkv) * Br, Bc, elem_bytes)


def _flash_bytes(q_shape, n_splits, workers, rows, Bc, elem_bytes, output=True):
    """``flash_memory_bytes`` of a plan: o and lse (unless ``output`` is False: given by the caller), each split's
    o, m and l where the keys are split, and ``workers`` sets of tiles of ``rows`` query rows by Bc keys."""
    B, Hq, Nq, d = q_shape
    out_elems = B * Hq * Nq * (d + 1) if output else 0  # o and lse
    split_elems = n_splits * B * Hq * Nq * (d + 2) if n_splits > 1 else 0  # each split's o, m and l
    return (out_elems + split_elems + workers * _numba_cpu.task_elements(rows, Bc, d)) * elem_bytes


def _flash_in_parts(q, k, v, scale, causal, block_q, block_k):
    """(o, lse) of the flash kernel over the (batch, kv head) units of q, k, v as ``threads.by_kv_heads`` runs them:
    in one call (on this thread when small: ``call_threads``), or beside held cores in parts of a few kv heads each,
    written into one o and lse (the memory of a whole call at most: ``flash_memory_bytes``)."""
    out = []

    def whole():
        out.extend(_flash(q, k, v, scale, causal, block_q, block_k))

    def part(b, heads, kv):
        if not out:  # the whole call's bytes, which bound the parts' (its output, at most its splits and tiles)
            ensure_fits(flash_memory_bytes(q.shape, k.shape, q.itemsize, block_q=block_q, block_k=block_k,
                                           causal=causal), "attention(algorithm='flash') in parts",
                        "choose smaller block_q and block_k (the default tiles fit the cache)")
            out.extend((np.empty_like(q), np.empty(q.shape[:3], q.dtype)))
        _flash(q[b:b + 1, heads], k[b:b + 1, kv], v[b:b + 1, kv], scale, causal, block_q, block_k,
               out[0][b:b + 1, heads], out[1][b:b + 1, heads], whole=(q.shape, k.shape))

    per_head = multiply_adds(q.shape, k.shape, causal) / max(q.shape[0] * q.shape[1], 1)
    by_kv_heads(q.shape[0], q.shape[1], k.shape[1], per_head, whole, part)
    return out[0], out[1]


def _workers(threads, tasks):
    """Workers of a flash call, one per thread it can keep busy: each holds one set of tiles (``flash_forward``)."""
    return max(1, min(threads, tasks))


def _flash(q, k, v, scale, causal, block_q, block_k, o=None, lse=None, whole=None):
    """(o, lse) of the CPU flash kernel, written into ``o`` and ``lse`` where given (C-contiguous, q's shape and
    dtype, and its first three axes'); ``whole``: the (q, k) shapes of the call that this one is a part of, whose
    plan (tiles and key splits) it follows."""
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    q_shape, k_shape = whole or (q.shape, k.shape)
    threads = call_threads(q_shape, k_shape, causal)
    Br, Bc, n_splits, _ = _flash_plan(q_shape[0], q_shape[1], k_shape[1], Nq, Nk, d, q.itemsize, block_q, block_k,
                                      threads)
    tasks = B * Hkv * math.ceil(Nq / Br) * n_splits
    # everything it allocates, output, split results and each worker's tiles, before any of it (huge block sizes
    # made the kernel's own allocation fail inside the parallel loop: a SystemError around a MemoryError)
    ensure_fits(_flash_bytes(q.shape, n_splits, _workers(threads, tasks), (Hq // Hkv) * Br, Bc, q.itemsize,
                             output=o is None),
                f"attention(algorithm='flash') with tiles Br={Br}, Bc={Bc} ({n_splits} key splits)",
                "choose smaller block_q and block_k (the default tiles fit the cache)")
    o = np.empty_like(q) if o is None else o
    lse = np.empty((B, Hq, Nq), dtype=q.dtype) if lse is None else lse
    if n_splits > 1:
        o_part = np.empty((n_splits,) + o.shape, dtype=q.dtype)
        stats_part = np.empty((n_splits,) + lse.shape + (2,), dtype=q.dtype)  # each row's m_i, l_i
    else:
        o_part = np.empty((1, 1, 1, 1, 1), dtype=q.dtype)  # unused by the kernel when n_splits == 1
        stats_part = np.empty((1, 1, 1, 1, 2), dtype=q.dtype)
    # the workers' tiles in one allocation per call, not one per task: glibc returns a freed block of a few MiB
    # to the kernel when the heap's free top exceeds its trim threshold (2 × the mmap threshold, 128 KiB at first;
    # malloc/malloc.c, "M_TRIM_THRESHOLD"), so tiles allocated in the loop were faulted in again by every task of
    # a fresh process (measured with getrusage on a 2-vCPU Xeon, H = 8, N = 512: 4100 minor faults and 5.9 ms per
    # call, against none and 3.9 ms once an earlier free had raised the thresholds). One block below 32 MiB
    # comes back from the heap mapped from the second call on (``standard_forward`` says why).
    work = np.empty((_workers(threads, tasks), _numba_cpu.task_elements((Hq // Hkv) * Br, Bc, d)), dtype=q.dtype)
    with single_threaded_blas():
        _numba_cpu.flash_forward(q, k, v, o, lse, o_part, stats_part, scale, causal, Br, Bc, n_splits, work)
    if n_splits > 1:
        _numba_cpu.combine_splits(o_part, stats_part, scale, o, lse)
    return o, lse


def _ensure_copies_fit(q, k, v, algorithm, causal, block_q, block_k):
    """Where q, k or v is not C-contiguous in the compute dtype (``as_compute_4d`` copies it), refuse the call
    before the copies when they and the algorithm's own allocation (``flash_memory_bytes``, ``standard_bytes`` and
    the output) would not fit: the copies came first, unchecked, and a broadcast view of 64 GiB ended in NumPy's
    MemoryError."""
    compute = np.dtype(COMPUTE_DTYPE[q.dtype])
    copies = copy_bytes((q, k, v), compute)
    if not copies:
        return
    q4 = (1,) * (4 - q.ndim) + tuple(q.shape)  # (B, Hq, Nq, d)
    k4 = (1,) * (4 - k.ndim) + tuple(k.shape)  # (B, Hkv, Nk, d)
    if algorithm == "flash":
        work = flash_memory_bytes(q4, k4, compute.itemsize, block_q=block_q, block_k=block_k, causal=causal)
    else:
        work = standard_bytes(q4[0], q4[1], q4[2], k4[2], compute.itemsize, causal) + q.size * compute.itemsize
    ensure_fits(copies + work, f"attention(algorithm={algorithm!r}) with its inputs copied C-contiguous in "
                f"{compute.name}", "pass C-contiguous float32 arrays, or smaller ones")


def _cupy_refuses(q, algorithm, block_q, block_k):
    """Why the tensor-core tier cannot run this call, or None: it is built for float16 with head dims 64 and 128,
    on fixed tiles."""
    from . import _cupy as tier2

    dtype, d = np.dtype(q.dtype).name, tuple(q.shape)[-1]
    if not tier2.supported(dtype, d):
        return f"float16 inputs with head dim {' or '.join(map(str, tier2.HEAD_DIMS))}; got {dtype}, d={d}"
    if algorithm == "flash" and (block_q is not None or block_k is not None):
        return (f"no block_q/block_k (its tiles are fixed at Br = {tier2.BR}, Bc = {tier2.BC}); got block_q="
                f"{block_q}, block_k={block_k}")
    return None


def _on_numba_cuda(q, k, v, scale, causal, algorithm, block_q, block_k):
    """Run on the Numba-CUDA tier; NumPy in, NumPy out; device arrays in, device arrays out."""
    from .._common.numba_cuda import cast
    from . import _numba_cuda

    on_host = isinstance(q, np.ndarray)
    compute = COMPUTE_DTYPE[np.dtype(q.dtype)]
    shape = tuple(q.shape)

    def device_4d(x):
        x = _gpu.to_numba(np.ascontiguousarray(x, dtype=compute) if on_host else _gpu.contiguous(x))
        return cast(x.reshape((1,) * (4 - x.ndim) + tuple(x.shape)), compute)

    q4, k4, v4 = device_4d(q), device_4d(k), device_4d(v)
    if algorithm == "standard":
        o, lse = _numba_cuda.standard_forward(q4, k4, v4, scale, causal)
    else:
        o, lse = _numba_cuda.flash_forward(q4, k4, v4, scale, causal, block_q, block_k)
    o = cast(o, np.dtype(q.dtype)).reshape(shape)
    return _gpu.like_input(o, on_host), _gpu.like_input(lse.reshape(shape[:-1]), on_host)


def _on_cupy(q, k, v, scale, causal, algorithm):
    """Run on the CUDA C tier (tensor cores): float16, head dims 64 and 128."""
    from .._common import cuda_c as _cupy
    from . import _cupy as tier2

    shape = tuple(q.shape)
    on_host = isinstance(q, np.ndarray)

    def device_4d(x):
        x = _cupy.as_cupy(x)
        return x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))

    forward = tier2.standard_forward if algorithm == "standard" else tier2.flash_forward
    o, lse = forward(device_4d(q), device_4d(k), device_4d(v), scale, causal)
    o, lse = o.reshape(shape), lse.reshape(shape[:-1])
    if on_host:
        return _cupy.require_cupy().asnumpy(o), _cupy.require_cupy().asnumpy(lse)
    return o, lse


def attention(q, k, v, *, causal=False, scale=None, algorithm="flash", block_q=None, block_k=None,
              return_lse=False, backend="auto"):
    """Exact scaled dot-product attention, O = softmax(scale · Q Kᵀ + mask) V.

    Parameters
    ----------
    q : ndarray, (B, Hq, Nq, d), (Hq, Nq, d) or (Nq, d)
        Queries. float16, float32 or float64.
    k, v : ndarray, (B, Hkv, Nk, d), (Hkv, Nk, d) or (Nk, d)
        Keys and values, the same shape and dtype as each other and the dtype of ``q``. ``Hq`` must be a multiple
        of ``Hkv`` (grouped-query attention; ``Hkv = 1`` is multi-query): query head h reads kv head
        ``h // (Hq // Hkv)``. ``Nk`` may differ from ``Nq`` (cross-attention, decode against a cache).
    causal : bool
        Mask keys after each query. With ``Nq != Nk`` the mask is aligned bottom-right, as in flash-attn: query i
        sees keys ``j <= i + Nk - Nq``. A query that sees no key returns zeros (and lse = -inf), never NaN.
    scale : float, optional
        Multiplies the scores; finite and > 0. Default ``1 / sqrt(d)``.
    algorithm : {"flash", "standard"}
        ``"flash"``: FlashAttention-2's forward (tiled, online softmax, O(N·d) extra memory; Numba, parallel over
        batch × kv heads × query blocks). ``"standard"``: materializes S = QKᵀ and P = softmax(S)
        (2·B·Hq·Nq·Nk elements; refused before it starts when they exceed the available memory).
    block_q, block_k : int, optional
        The flash tile sizes Br (query rows) and Bc (key rows); default from this machine's L2 cache size
        (FlashAttention Algorithm 1, line 1). Any size >= 1 works; they need not divide N. Ignored by
        ``"standard"``. The tensor-core tier has fixed tiles: ``backend="cupy"`` refuses them, and ``"auto"``
        runs device inputs with block sizes on the Numba-CUDA tier.
    return_lse : bool
        Also return the log-sum-exp of each query row's scaled scores (natural log), shape ``q.shape[:-1]``.
    backend : {"auto", "cpu", "numba-cuda", "cupy"}
        Where to run. ``"cpu"``: Numba (flash) or NumPy (standard) on this machine's cores, for NumPy inputs.
        ``"numba-cuda"``: the Numba-CUDA kernels (``kernels/attn/_numba_cuda.py``), any float dtype and head dim.
        ``"cupy"``: the CUDA C kernels on tensor cores (``kernels/attn/flash_attention.cu``), float16 with head
        dim 64 or 128 (bfloat16: ``kernels.attn.attention_bfloat16``, on uint16 bit patterns). For both GPU
        backends NumPy inputs are copied to the device and the result back. ``"auto"``: device arrays (CuPy, or
        anything with ``__cuda_array_interface__``) run on the GPU — on tensor cores where the dtype, head dim and
        block sizes allow, else on the Numba-CUDA tier — and come back as CuPy arrays; NumPy arrays run on the CPU.

    Returns
    -------
    o : ndarray (a device array for device inputs), the shape and dtype of ``q``
    lse : ndarray, ``q.shape[:-1]``, in the compute dtype (only with ``return_lse=True``)

    Raises
    ------
    TypeError
        Non-array inputs, non-float or mixed dtypes, a non-integer block size or non-numeric scale.
    ValueError
        Wrong ndim, mismatched shapes or head dims, ``Hq`` not a multiple of ``Hkv``, block sizes < 1, scale <= 0
        or non-finite, an unknown algorithm or backend.
    kernels.InsufficientMemoryError
        (a ``MemoryError``) when the predicted allocation exceeds the available memory; nothing is allocated.

    Notes
    -----
    float32 and float64 compute in their own precision; float16 is computed in float32 and returned as float16.

    NaN, ±inf and extreme scales follow one contract, the oracle's (``kernels.attn.reference``), on every
    algorithm, backend, tile size and split-KV count:

    - NaN propagates to exactly the rows it touches: a NaN in row i of ``q`` makes output row i (and its lse)
      NaN; a NaN in key or value row j makes NaN every query row that sees key j (all rows without ``causal``),
      and no other row: a key that the causal mask hides never reaches a row, whatever its values.
    - An inf in ``q`` or ``k`` gives scores of ±inf: a score of +inf makes its row NaN (inf − inf in the softmax);
      a score of −inf gives its key zero weight. A row whose every visible score is −inf is a fully masked row:
      zeros and lse −inf, like a row that sees no key (never NaN).
    - Any finite ``scale`` > 0: the row maximum is subtracted before scaling, so a scaled score far beyond the
      dtype's exp range (``scale=1e9`` in float32) still gives the exact softmax (a one-hot row); only lse, a
      value of the scaled scores, overflows to ±inf where it exceeds the dtype.

    References: Dao et al., "FlashAttention", NeurIPS 2022; Dao, "FlashAttention-2", 2023 (Algorithm 1).
    """
    _check_choice("algorithm", algorithm, ALGORITHMS)
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool; got {type(return_lse).__name__}")
    scale = validate(q, k, v, causal=causal, scale=scale, block_q=block_q, block_k=block_k)
    block_q, block_k = check_block("block_q", block_q), check_block("block_k", block_k)  # plain ints (an np.int8
    # block size overflowed the tile arithmetic: OverflowError, or a workspace too small and a SystemError)
    backend = choose_backend("attention", backend, {"q": q, "k": k, "v": v},
                             cupy_refuses=lambda: _cupy_refuses(q, algorithm, block_q, block_k))
    if backend == "cupy":
        o, lse = _on_cupy(q, k, v, scale, bool(causal), algorithm)
        return (o, lse) if return_lse else o
    if backend == "numba-cuda":
        o, lse = _on_numba_cuda(q, k, v, scale, bool(causal), algorithm, block_q, block_k)
        return (o, lse) if return_lse else o
    _ensure_copies_fit(q, k, v, algorithm, bool(causal), block_q, block_k)
    q4, k4, v4 = as_compute_4d(q, k, v)
    shape = q.shape
    if algorithm == "standard":  # in one call: its N x N scores are what it shows (small: on this thread)
        with serial_if_small(multiply_adds(q4.shape, k4.shape, bool(causal))):
            o, lse = standard_forward(q4, k4, v4, scale, bool(causal))
    else:
        o, lse = _flash_in_parts(q4, k4, v4, scale, bool(causal), block_q, block_k)  # small: on this thread
    o = o.reshape(shape).astype(q.dtype, copy=False)
    if return_lse:
        return o, lse.reshape(shape[:-1])
    return o


def attention_bfloat16(q, k, v, *, causal=False, scale=None, return_lse=False):
    """Exact attention on bfloat16 inputs, on tensor cores (the CUDA C tier; CuPy and a GPU of sm_80 or later).

    NumPy and CuPy have no bfloat16 dtype: q, k and v hold bfloat16 bit patterns in uint16 arrays
    (``to_bfloat16_bits`` makes them from float32 CuPy arrays, ``from_bfloat16_bits`` reads them back).

    Parameters
    ----------
    q, k, v : uint16 ndarray or CuPy array of bfloat16 bits, shapes as for :func:`attention`
        Head dim 64 or 128.
    causal, scale, return_lse
        As for :func:`attention`.

    Returns
    -------
    o : uint16 bfloat16 bits, the shape of ``q`` (CuPy for device inputs, NumPy for NumPy inputs)
    lse : float32, ``q.shape[:-1]`` (only with ``return_lse=True``)

    Raises
    ------
    TypeError
        Inputs that are not uint16 arrays, or a mix of NumPy and device arrays.
    ValueError
        Mismatched shapes, a head dim other than 64 or 128, a bad scale.
    RuntimeError
        Without CuPy and a device.
    """
    from . import _cupy as tier2

    for name, x in (("q", q), ("k", k), ("v", v)):
        if not (isinstance(x, np.ndarray) or _gpu.is_device_array(x)) or np.dtype(x.dtype) != np.uint16:
            raise TypeError(f"{name} must be a uint16 array of bfloat16 bit patterns (to_bfloat16_bits makes one); "
                            f"got {type(x).__name__} of dtype {getattr(x, 'dtype', None)}")
    # the shape and argument checks of every other call, on float16 views of the same bits
    scale = validate(*(x.view(np.float16) for x in (q, k, v)), causal=causal, scale=scale, block_q=None,
                     block_k=None)
    d = tuple(q.shape)[-1]
    if d not in tier2.HEAD_DIMS:
        raise ValueError(f"attention_bfloat16 takes head dim {' or '.join(map(str, tier2.HEAD_DIMS))}; got d={d}")
    from .._common import cuda_c as _cupy

    cupy = _cupy.require_cupy()
    shape = tuple(q.shape)
    q4, k4, v4 = (_cupy.as_cupy(x).reshape((1,) * (4 - x.ndim) + tuple(x.shape)) for x in (q, k, v))
    o, lse = tier2.flash_forward(q4, k4, v4, scale, bool(causal), dtype="bfloat16")
    o, lse = o.reshape(shape), lse.reshape(shape[:-1])
    if isinstance(q, np.ndarray):
        o, lse = cupy.asnumpy(o), cupy.asnumpy(lse)
    return (o, lse) if return_lse else o


def standard_phase_times(q, k, v, *, causal=False, scale=None):
    """Run ``attention(q, k, v, algorithm="standard", backend="cpu")`` once and time its phases.

    Returns ``(o, seconds)``: the output, and a dict of wall seconds per phase, in the order they ran
    (``kernels.attn.STANDARD_PHASES``): ``qk`` (S = QKᵀ on Numba's pool), ``mask`` (causal only: the mask built
    and applied), ``max`` (row max of S), ``subtract`` (P = scale·(S − max), a new array), ``exp``, ``sum`` (row sums),
    ``normalize`` (P /= l) and ``pv`` (O = PV). The elementwise phases run in NumPy on one core. For the cost
    model's per-phase validation (``simulator.costs.phases``); inputs as for ``attention`` (NumPy arrays).
    """
    scale = validate(q, k, v, causal=causal, scale=scale, block_q=None, block_k=None)
    choose_backend("standard_phase_times", "cpu", {"q": q, "k": k, "v": v})  # NumPy inputs only
    q4, k4, v4 = as_compute_4d(q, k, v)
    seconds: dict[str, float] = {}
    with serial_if_small(multiply_adds(q4.shape, k4.shape, bool(causal))):  # as ``attention`` runs it
        o, _ = standard_forward(q4, k4, v4, scale, bool(causal), phases=seconds)
    return o.reshape(q.shape).astype(q.dtype, copy=False), seconds
