"""The per-phase rates of this CPU (``simulator.costs.phases.PhaseRates``), measured the way the kernels run:
NumPy's elementwise passes on one core, from the last-level cache and from DRAM; the standard algorithm's batched
matmuls and the flash kernel's block products, exp, rescale and bookkeeping on all of Numba's threads; NumPy's
GEMV; page faults; the fixed cost of a call. ``phase_rates`` measures them (a few seconds), ``cpu_phase_rates``
caches them beside the ``cpu`` spec.

The micro-kernels below run the kernels' own pieces: ``exp_row`` and the fast-math flags from
``kernels._common.numba_cpu``, the batched matmuls of ``kernels._common.blas``, a deliberate edge of the layout
(tests/test_layout.py, ``KNOWN``), as the GPU check's probes drive a tier's launchers.
"""
from __future__ import annotations

import contextlib
import math
import time

import numpy as np
from numba import njit, prange

from kernels._common.numba_cpu import FASTMATH, exp_row, row_max
from kernels.cpuinfo import cache_sizes, user_cache_dir
from kernels.dense import gemv_rows
from kernels.int8 import panels as panel_layout
from kernels.int8.panels import GROUP, PANEL_ROWS, layout_rows
from kernels.int8.rows import ROW_PREFETCH, padded_k, path_marker, prepare

from .calibrate import (CACHE_FILE, cache_stamp, cached_spec, calibrate, dram_test_bytes, fill_parallel, filled,
                        launch_overhead, machine_id, read_bandwidth_of, save_to_cache, triad_bandwidth_of)
from .hardware.spec import HardwareSpec
from .measure import settle, time_call, views


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
def max_rows(s, iterations):
    """Thread t: ``iterations`` times the row max of every row r of its (Br, Bc) tile, as the flash kernel takes
    it over a row's first block."""
    total = 0.0
    for t in prange(s.shape[0]):
        acc = 0.0
        for _ in range(iterations):
            for r in range(s.shape[1]):
                acc += row_max(s[t, r], s.shape[2], -np.inf)
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


PHASE_CACHE_FILE = "cpu-phase-rates.toml"
PHASE_TARGET_S = 0.01  # seconds one repeat of a micro-benchmark in the caches aims at: far above a wake-up
SCORE_RANGE = (-9.0, 0.0)  # scale·(S − max) of attention scores: ≤ 0, a few units wide (a standard normal's max)


@njit(fastmath=True, cache=True)
def _sum_one_core(x):
    """Σ x on the calling thread: one core's read rate."""
    acc = np.float32(0.0)
    for i in range(x.size):
        acc += x[i]
    return acc


@njit(parallel=True, fastmath=True, cache=True)
def _read_sweeps(x, n_threads, sweeps):
    """Σ x with each of ``n_threads`` tasks reading its contiguous share ``sweeps`` times, in one parallel region
    (the all-core read rate at a footprint, without a region's launch per pass)."""
    per = (x.size + n_threads - 1) // n_threads
    total = 0.0
    for t in prange(n_threads):
        acc = np.float32(0.0)
        for _ in range(sweeps):
            for i in range(t * per, min(x.size, (t + 1) * per)):
                acc += x[i]
        total += acc
    return total


def _best(fn, repeats=3, warmup=1):
    return time_call(fn, repeats=repeats, warmup=warmup, settle_s=0.0).min_s


def llc_curve(buffer, l2_bytes: int) -> tuple[float, tuple, tuple]:
    """One core's read rate over slices of ``buffer`` of 2·L2, 4·L2, ... bytes up to the whole buffer, as
    (effective LLC bytes, sizes, fractions by ``curve_fractions``): every size up to the fastest counts as cache
    (on the 2-vCPU Xeon VM one core read 4 MiB more slowly than 16 and 32 MiB, while the standard algorithm's
    passes over 8 MiB ran at its cache rates). The effective LLC is the last size at or above one half. The OS's
    figure for a VM's last-level cache is the host's (480 MiB here, where one core's rate falls between 32 and 64
    MiB)."""
    sizes, rates = [], []
    n = 2 * l2_bytes // 4
    while n <= buffer.size:
        part = buffer[:n]
        sizes.append(float(part.nbytes))
        rates.append(part.nbytes / _best(lambda part=part: _sum_one_core(part), repeats=2))
        n *= 2
    if len(rates) < 2:  # a buffer too small for a curve: all of it counts as cache
        sizes = sizes or [float(l2_bytes)]
        return sizes[-1], tuple(sizes), (1.0,) * len(sizes)
    fractions = curve_fractions(rates)
    llc = max(size for size, f in zip(sizes, fractions) if f >= 0.5)
    return llc, tuple(sizes), fractions


def curve_fractions(rates, first: int = 0) -> tuple:
    """Read rates over growing sizes as cache fractions: 1 up to the fastest of ``rates[first:]`` (the cache),
    then each rate placed between that one and the last (DRAM) on a log scale, clipped to 0..1 and never rising
    with the size (a larger slice is not served more by the cache: a rate above a smaller slice's is noise)."""
    top = max(range(first, len(rates)), key=lambda i: rates[i])
    span = math.log(rates[top] / rates[-1]) or 1.0
    fractions, f = [], 1.0
    for i, r in enumerate(rates):
        f = 1.0 if i <= top else min(f, max(0.0, math.log(r / rates[-1]) / span))
        fractions.append(f)
    return tuple(fractions)


def llc_curve_all(buffer, sizes, threads: int, l2_bytes: int) -> tuple:
    """The all-core counterpart of ``llc_curve``'s fractions at its ``sizes``: the read rate of all threads over
    each slice (``_read_sweeps``, about 256 MiB read per timing), placed on a log scale between the fastest beyond
    the threads' L2s (2·L2 per thread, as ``llc_curve`` starts beyond one core's: the shared cache; smaller sizes
    count as cache too) and the last (DRAM). All cores keep more of a slice in the shared cache than one core does
    (on the 2-vCPU Xeon VM 64 MiB read at 46 GB/s on both cores, 37 from DRAM, while one core's rate there was
    half-way down)."""
    rates = []
    for size in sizes:
        part = buffer[:int(size) // 4]
        sweeps = max(1, 2**28 // part.nbytes)
        rates.append(sweeps * part.nbytes / _best(lambda part=part, sweeps=sweeps: _read_sweeps(part, threads,
                                                                                                 sweeps), repeats=2))
    shared = [i for i, size in enumerate(sizes) if size >= 2 * l2_bytes * threads]
    if len(shared) < 2:
        return (1.0,) * len(rates)
    return curve_fractions(rates, first=shared[0])


def _numpy_pass_rates(x, y, level: str) -> dict:
    """One core's rates of the standard algorithm's NumPy passes over float32 arrays x, y of equal size (bytes
    read + written per second; exp in elements per second), keyed as ``PhaseRates``' fields of ``level``."""
    rows = x.reshape(-1, 1024)  # (rows, 1024): row reductions over the last axis, as over scores
    y_rows = y.reshape(-1, 1024)
    # from DRAM a pass takes tens of milliseconds: two repeats, no warm-up (the pages are mapped already)
    repeats, warmup = (3, 1) if level == "llc" else (2, 0)

    def best(fn):
        return _best(fn, repeats=repeats, warmup=warmup)

    ones = np.ones((rows.shape[0], 1), dtype=np.float32)  # (rows, 1), as the row max and the row sum
    rates = {
        f"reduce_{level}": x.nbytes / best(lambda: rows.max(axis=-1, keepdims=True)),
        f"update_{level}": 2 * y.nbytes / best(lambda: np.multiply(y, np.float32(1.0), out=y)),
        f"into_{level}": 2 * y.nbytes / best(lambda: np.subtract(rows, ones, out=y_rows)),
        f"divide_{level}": 2 * y.nbytes / best(lambda: np.divide(y_rows, ones, out=y_rows)),
    }
    mask = np.tri(1024, dtype=bool)  # (1024, 1024) broadcast over the leading axis, as the causal mask over heads
    y3 = y.reshape(-1, 1024, 1024)
    rates[f"masked_{level}"] = 2 * y.nbytes / best(lambda: np.copyto(y3, np.float32(-1.0), where=mask))

    def exp_in_place():  # the scores restored first (untimed), so every repeat sees the same values
        np.copyto(y, x)
        start = time.perf_counter()
        np.exp(y, out=y)
        return time.perf_counter() - start

    if level == "llc":
        exp_in_place()
    rates[f"exp_{level}"] = y.size / min(exp_in_place() for _ in range(2))
    if level == "dram":
        m = np.zeros((y_rows.shape[0], 1), dtype=np.float32)  # (rows, 1), as the row max
        rates["fresh_dram"] = 2 * y.nbytes / _best(lambda: np.subtract(y_rows, m), repeats=2, warmup=0)
    return rates


def _flash_block_rates(d: int, threads: int) -> dict:
    """Per-thread rates of the flash kernel's work with every thread busy, at its default tiles: its vectorized
    exp (``exp_row``) and the multiply-add of its rescale alone, and the block products as they run in a whole
    block step (``block_steps``: between the exps, which evict their tiles), i.e. the step's time less the exps'
    and the rescale's."""
    from kernels.attn import default_blocks
    from kernels._common.blas import single_threaded_blas


    br, bc = default_blocks(d, 4)
    rng = np.random.default_rng(0)
    q_i = rng.standard_normal((threads, br, d), dtype=np.float32)  # (threads, Br, d)
    k_j, v_j = (rng.standard_normal((threads, bc, d), dtype=np.float32) for _ in range(2))  # (threads, Bc, d)
    s = np.empty((threads, br, bc), dtype=np.float32)  # (threads, Br, Bc)
    p = np.empty((threads, br, bc), dtype=np.float32)  # (threads, Br, Bc)
    pv = np.empty((threads, br, d), dtype=np.float32)  # (threads, Br, d)
    o_acc = np.zeros((threads, br, d), dtype=np.float32)  # (threads, Br, d)
    alpha = np.full((threads, br), 0.5, dtype=np.float32)  # (threads, Br)
    scores = rng.uniform(*SCORE_RANGE, (threads, br, bc)).astype(np.float32)  # (threads, Br, Bc)
    with single_threaded_blas():
        block_steps(q_i, k_j, v_j, s, p, pv, o_acc, alpha, 1)
        iterations = max(1, int(PHASE_TARGET_S / _best(lambda: block_steps(q_i, k_j, v_j, s, p, pv, o_acc, alpha,
                                                                             1))))
        step = _best(lambda: block_steps(q_i, k_j, v_j, s, p, pv, o_acc, alpha, iterations)) / iterations
        exp_rows(scores, p, 1)
        exp = _best(lambda: exp_rows(scores, p, iterations)) / iterations
        max_rows(scores, 1)
        row_max_s = _best(lambda: max_rows(scores, iterations)) / iterations
        rescale_rows(o_acc, pv, alpha, 1)
        rescale = _best(lambda: rescale_rows(o_acc, pv, alpha, iterations)) / iterations
    products = max(step - exp - rescale, 0.5 * step)  # (a floor, should noise make the parts exceed the step)
    return {"gemm_block": 4 * br * bc * d / products, "exp_block": br * bc / exp, "max_block": br * bc / row_max_s,
            "fma_block": br * d / rescale, "block_br": br, "block_bc": bc}


def _standard_gemm_rates(d: int) -> dict:
    """The standard algorithm's matmuls (``kernels._common.blas``): S = QKᵀ (K = d) and PV (K = N) over 8 heads of
    N = 1024, into outputs allocated once (their page faults are counted apart, in ``first_touch_all``)."""
    from kernels._common.blas import batched_matmul

    G, n = 8, 1024
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((G, n, d), dtype=np.float32) for _ in range(3))  # (G, N, d)
    s = np.empty((G, n, n), dtype=np.float32)  # (G, N, N)
    o = np.empty((G, n, d), dtype=np.float32)  # (G, N, d)
    flops = 2 * G * n * n * d
    qk = flops / _best(lambda: batched_matmul(q, k, transpose_b=True, out=s))
    pv = flops / _best(lambda: batched_matmul(s, v, out=o))
    return {"gemm_qk": qk, "gemm_pv": pv, "gemm_d": d}


def first_touch_rate(n_bytes: int) -> float:
    """Bytes/s at which all threads fault in new pages: a parallel fill of a new array of ``n_bytes``, less the
    same fill of a mapped one (the write itself)."""
    x = filled(max(1, n_bytes // 4), 0.0, np.float32)
    mapped = _best(lambda: fill_parallel(x, 1.0), repeats=2)
    x = None  # (its pages returned before the fresh array is made)
    fresh = _best(lambda: fill_parallel(np.empty(max(1, n_bytes // 4), dtype=np.float32), 1.0), repeats=2, warmup=0)
    return n_bytes / max(fresh - mapped, 1e-9)


def attention_call_seconds() -> float:
    """Seconds of one ``kernels.attention`` call on a tiny decode input (one query, 16 keys, d = 64): the fixed
    cost of a call, validation and allocation; a call this small runs on the calling thread and launches no
    parallel region (``kernels._common.threads.serial_if_small``), which the model adds per launch of a larger one."""
    import kernels

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 1, 64), dtype=np.float32)
    k, v = (rng.standard_normal((1, 1, 16, 64), dtype=np.float32) for _ in range(2))
    return time_call(lambda: kernels.attention(q, k, v, causal=True), repeats=200, warmup=5, settle_s=0.0).median_s


def int8_call_seconds() -> float:
    """Seconds of one ``Int8Linear`` call on a 64-vector against a 64 × 64 weight: the fixed cost of the int8 path
    (outlier scan, quantization, its kernel launches)."""
    from kernels.int8 import Int8Linear

    rng = np.random.default_rng(0)
    layer = Int8Linear.from_float(rng.standard_normal((64, 64), dtype=np.float32))
    x = rng.standard_normal((1, 64), dtype=np.float32)
    return time_call(lambda: layer(x), repeats=200, warmup=5, settle_s=0.0).median_s


DECODE_ROWS = 4  # query heads per kv head of the calibration's decode call: a GQA group of 4 (Llama-3-8B's)


DECODE_ONE_TOKENS = 2048  # cached tokens per kv head of the calling thread's calibration call: 4 kv heads of them
# and DECODE_ROWS query heads each make 4.2 M multiply-adds, well below SERIAL_MULTIPLY_ADDS (kernels._common.threads)


def decode_stream_rates(buffer, d: int, threads: int, call_s: float) -> dict:
    """K/V bytes/s of a decode call of ``kernels.attention`` (one new query per head against a cache) streaming its
    cache from DRAM: ``decode_stream`` on all threads, ``decode_stream_one`` on the calling thread.

    All threads: ``DECODE_ROWS`` query heads per kv head, 4·``threads`` kv heads (as many tasks as the kernel wants
    without splitting the keys), K and V views of a quarter of ``buffer`` each; the call's fixed cost is left in (a
    few hundredths of a millisecond against milliseconds of streaming). The calling thread: the calls that run
    there are small by definition (``kernels._common.threads``), short caches met cold, so it is timed on such
    calls: 4 kv heads of ``DECODE_ONE_TOKENS`` tokens, on consecutive views of half of ``buffer`` called in turn
    (each from DRAM, as a model's layers meet their caches), less each call's fixed cost ``call_s``.

    The calls themselves, not stand-ins: the flash kernel with Br = 1 streams its blocks through skinny products, an
    exp and a rescale per block, below the rate of the products alone. BLAS's skinny products alone, which this
    rate once was, streamed 22.5 GB/s on a 2-vCPU AMD EPYC (Zen 4) where a decode call of SmolLM2's layout (9 query
    and 3 kv heads, 16384 cached tokens) streamed 12-16, and the pruned cache's decode speedup was predicted 6.6x
    against 9.7-12.9x measured. There the one long call on the calling thread (8 kv heads of 32768 tokens) streamed
    12-17 GB/s, while a call on 1024 tokens met cold streamed 5-11 GB/s: a short stream per task pays the memory's
    latency before the prefetchers run ahead."""
    import kernels

    hkv = 4 * threads
    n = (buffer.size // 4) // (hkv * d)
    k, v = views(buffer, (1, hkv, n, d), count=2)  # (1, Hkv, n, d) each, a quarter of the buffer
    q = np.ones((1, DECODE_ROWS * hkv, 1, d), dtype=np.float32)  # (1, Hq, 1, d)
    kernels.attention(q, k[:, :, :64], v[:, :, :64], causal=True)  # compiled, the pool awake
    rates = {"decode_stream": (k.nbytes + v.nbytes) / _best(lambda: kernels.attention(q, k, v, causal=True),
                                                            repeats=2, warmup=0)}
    shape = (1, 4, DECODE_ONE_TOKENS, d)  # (1, Hkv, n, d)
    caches = views(buffer[:buffer.size // 2], shape)  # K and V in turn: half the buffer, past the largest cache
    q_one = np.ones((1, DECODE_ROWS * 4, 1, d), dtype=np.float32)  # (1, Hq, 1, d)
    calls = [lambda kk=kk, vv=vv: kernels.attention(q_one, kk, vv, causal=True)
             for kk, vv in zip(caches[0::2], caches[1::2])]
    rates["decode_stream_one"] = 2 * caches[0].nbytes * len(calls) / _in_turn_less_fixed(calls, call_s)
    return rates


@contextlib.contextmanager
def one_thread():
    """Numba's parallel loops on the calling thread alone for the block (the count restored after it)."""
    import numba

    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(before)


def threads_at_once(threads: int) -> int:
    """Of ``threads``, how many run at once: no more than the CPUs the pool may use (``kernels.pool_info``). The
    decode step claims its tasks as threads come free, so with more threads than CPUs it streams at the CPUs' rate,
    and its outliers' products share the CPUs; timed with one contiguous run per thread, a CPU would get two runs
    (NUMBA_NUM_THREADS=3 on a 2-vCPU Xeon: the int8 rows at 32 GB/s against 36-40 on two threads, and a SmolLM2
    token predicted 30% longer than it took)."""
    import kernels

    return min(int(threads), kernels.pool_info()["cpus"])


STEP_K = 1024  # input features of the weight the step's row kernels are timed on (SmolLM2's are 576 and 1536)


@njit(parallel=True, cache=True)
def _rows_fp32(x, w, y, threads):
    per = (w.shape[0] + threads - 1) // threads
    for t in prange(threads):
        gemv_rows(x, w, y, t * per, min(w.shape[0], (t + 1) * per))


@njit(parallel=True, cache=True)
def _step_int8(path, in_panels, x_u8, cols, x_o, absmax_x, w, absmax_w, row_sums, y, threads, ahead):
    per = -(-w.shape[0] // (threads * PANEL_ROWS)) * PANEL_ROWS  # whole panels per thread
    for t in prange(threads):
        layout_rows(path, in_panels, x_u8, 0, cols, x_o, absmax_x, w, absmax_w, row_sums, y, t * per,
                    min(w.shape[0], (t + 1) * per), 0, ahead)


@njit(cache=True)
def _step_int8_again(path, in_panels, x_u8, J, cols, x_o, absmax_x, w, absmax_w, row_sums, y, times, ahead):
    for _ in range(times):  # on the calling thread
        layout_rows(path, in_panels, x_u8, J, cols, x_o, absmax_x, w, absmax_w, row_sums, y, 0, w.shape[0], 0, ahead)


def decode_step_rates(buffer, threads: int, working_bytes: int | None = None, *, outliers: bool = True,
                      k: int = STEP_K) -> dict:
    """Weight bytes/s of the decode step's row kernels from DRAM: ``kernels.dense.gemv_rows`` over an (N, K)
    float32 view of a quarter of the mapped ``buffer`` (K = ``k``), and the step's int8 products
    (``kernels.int8.panels.layout_rows``: panels where ``PANELS``, else rows; on the path ``Int8Linear`` takes, no
    outlier feature) over the same bytes as int8, each split into one contiguous run of whole panels per thread in
    one parallel region; the region's launch is included, as the step pays one too. And ``step_outlier_s``, a
    thread's seconds per output and outlier feature in those products: the same rows with
    OUTLIER_FEATURES outliers against none, on the calling thread, over a weight of half its L2 read 20 times in one
    call (so that the difference is the float16 products, not DRAM's or a region's launch's noise).

    ``working_bytes``: stream the first that many bytes of ``buffer`` instead of a quarter of it, again and again
    (the best of three passes): the working set of a model whose decode reads that many weight bytes per token.
    A VM's host may keep much of a working set of 100-200 MiB in its own last-level cache, whatever the OS reports:
    on the 2-vCPU Xeon the int8 rows streamed 64-160 MiB read again and again at 42-54 GB/s, 256 MiB at 31-32 and
    512 MiB at 28-29, and SmolLM2's int8 + int8 head step (134 MB per token) took 4.2 ms against the 5.6 that a
    quarter of the buffer's rate predicted. A working set larger than ``buffer`` gets a mapped buffer of its own.
    ``outliers=False`` leaves ``step_outlier_s`` out (it does not depend on the working set). ``k``: the weights'
    input features (a row's length), STEP_K unless given: the rate can depend on it (``simulator.report.model.
    step_rates`` measures each row length of a model's linears)."""
    K = int(k)
    threads = threads_at_once(threads)  # one contiguous run per thread, as here, on no more threads than CPUs
    if working_bytes is None:
        size = buffer.size // 4
    else:
        size = max(PANEL_ROWS * K, int(working_bytes) // 4)  # 16 float32 rows at least: whole int8 panels
        if size > buffer.size:
            buffer = filled(size, 1.0, np.float32)
    streamed = buffer[:size // K * K]
    w32 = streamed.reshape(-1, K)  # (N, K)
    in_panels = panel_layout.PANELS  # the layout the decode step keeps its int8 weights in
    Kw = -(-K // GROUP) * GROUP if in_panels else K  # its int8 row: in panels K rounded up to 4 (``panel_shape``)
    as_bytes = streamed.view(np.int8)
    w8 = as_bytes[:as_bytes.size // Kw * Kw].reshape(-1, Kw)  # (rows, Kw): the same bytes as int8 weights
    w8 = w8[:w8.shape[0] // PANEL_ROWS * PANEL_ROWS]  # whole panels (their values do not matter)
    x = np.ones(K, dtype=np.float32)
    y32, y8 = np.empty(w32.shape[0], np.float32), np.empty(w8.shape[0], np.float32)
    flags, cols, x_o, x_u8, absmax_x = (np.empty(K, np.bool_), np.empty(K, np.int64), np.empty((1, K), np.float32),
                                        np.empty((1, padded_k(K)), np.uint8), np.empty(1, np.float32))
    # threshold 0: no outlier feature (a float32, as the library passes it: a float would compile ``prepare`` again)
    prepare(x[None], np.float32(0.0), flags, cols, x_o, x_u8, absmax_x)
    absmax_w, row_sums = np.ones(w8.shape[0], np.float32), np.zeros(w8.shape[0], np.int32)
    path = path_marker()

    def int8(w):  # no outlier feature
        return _step_int8(path, in_panels, x_u8, cols, x_o, absmax_x, w, absmax_w, row_sums, y8, threads,
                          ROW_PREFETCH)

    _rows_fp32(x, w32[:8], y32, threads)  # compile and warm
    int8(w8[:PANEL_ROWS])
    rates = {"step_fp32_dram": w32.nbytes / _best(lambda: _rows_fp32(x, w32, y32, threads), repeats=3, warmup=0),
             "step_int8_dram": w8.nbytes / _best(lambda: int8(w8), repeats=3, warmup=0)}
    if not outliers:
        return rates
    x_outliers = np.ones((1, K), dtype=np.float32)
    x_outliers[0, ::max(1, K // OUTLIER_FEATURES)] = 40.0  # OUTLIER_FEATURES evenly spread outlier features
    J = prepare(x_outliers, np.float32(6.0), flags, cols, x_o, x_u8, absmax_x)
    resident, times = w8[:max(PANEL_ROWS, cache_sizes().get("L2", 2**20) // 2 // Kw // PANEL_ROWS * PANEL_ROWS)], 20

    def again(J):
        return _best(lambda: _step_int8_again(path, in_panels, x_u8, J, cols, x_o, absmax_x, resident, absmax_w,
                                              row_sums, y8, times, ROW_PREFETCH), repeats=5, warmup=1)

    rates["step_outlier_s"] = _per_product(again(J) - again(0), times * resident.shape[0] * J)
    return rates


def _per_product(difference_s, products):
    """Seconds per product from a difference of two timings that differ by ``products`` products, with a floor of
    a picosecond each where the noise hides the difference (a rate file holds no zero or negative time)."""
    return max(difference_s, 1e-12 * products) / products


def _in_turn_seconds(calls, passes=3):
    """The best of ``passes`` seconds for running every one of ``calls`` once, one after another (after one pass
    untimed): a decode step's way of meeting its layers, each read once per token."""
    def one_pass():
        for call in calls:
            call()

    return _best(one_pass, repeats=passes, warmup=1)


def _in_turn_less_fixed(calls, fixed_s):
    """``_in_turn_seconds`` of ``calls`` less each call's fixed cost ``fixed_s`` (the model adds it once per call),
    never below half the time measured (a fixed cost measured in a slower moment than the calls)."""
    t = _in_turn_seconds(calls)
    return max(t - len(calls) * fixed_s, 0.5 * t)


def _dram_views(buffer, dtype, view_bytes, K):
    """(view_bytes // K // itemsize, K) views of the first half of ``buffer``, in order: distinct weights, each
    read from DRAM when they are called in turn (half the buffer is the largest cache the OS reports)."""
    n = max(1, view_bytes // np.dtype(dtype).itemsize // K)
    return views(buffer, (n, K), dtype, count=buffer.nbytes // 2 // (n * K * np.dtype(dtype).itemsize))


def gemv_rates(buffer, llc_bytes: float) -> dict:
    """NumPy's float32 GEMV x · Wᵀ (its own BLAS, all cores) in weight bytes/s: from DRAM, as decode meets its
    layers (64 MiB (N, K) views of half the mapped ``buffer``, called in turn), at K = ``GEMV_K`` and
    ``GEMV_WIDE_K``; from the cache at K = ``GEMV_K`` (W of a quarter of the effective LLC, called again and
    again)."""
    from .costs.phases import GEMV_K, GEMV_WIDE_K

    def dram(K):
        x = np.ones((1, K), dtype=np.float32)
        views = _dram_views(buffer, np.float32, 64 * 2**20, K)
        return sum(w.nbytes for w in views) / _in_turn_seconds([lambda w=w: x @ w.T for w in views])

    x = np.ones((1, GEMV_K), dtype=np.float32)
    w_llc = np.ones((max(1, int(llc_bytes) // 4 // 4 // GEMV_K), GEMV_K), dtype=np.float32)  # (N, K)
    return {"gemv_fp32_dram": dram(GEMV_K), "gemv_fp32_dram_wide": dram(GEMV_WIDE_K),
            "gemv_fp32_llc": w_llc.nbytes / _best(lambda: x @ w_llc.T, repeats=20, warmup=3)}


def int8_gemv_rates(buffer, llc_bytes: float, launch_s: float, call_s: float) -> dict:
    """``Int8Linear`` on one vector, in int8 weight bytes/s, K = 4096: from DRAM as decode meets its layers (views
    of half the mapped ``buffer`` called in turn: 16 MiB on all threads, 4 MiB on the calling thread, the sizes
    each runs at: ``kernels._common.threads``) and from the cache (W of a quarter of the effective LLC, called
    again and again); and ``int8_outlier_s``, a thread's seconds per output and outlier feature (the float16 path
    of each output: its dequantized outlier weights, rounded), from the public call on the calling thread over a
    weight of half its L2, with OUTLIER_FEATURES outliers against none, the best of many calls each: the difference
    of two DRAM-bound passes, which it once was, lies within DRAM's noise and came out negative on a 2-vCPU Xeon
    with a 105 MiB L3. The public call, less its fixed cost (``call_s``,
    the whole call on a tiny vector) and, on all threads, the region's launch (``launch_s``), both of which the
    model adds once per call: the kernel's dot products, scales and outlier scan make it stream slower than a read
    of the same bytes, and each call restarts the prefetchers on a new stream (2-vCPU Xeon, one thread: 4 MiB
    weights in turn 12.8 GB/s, one 480 MiB weight 15.4)."""
    from kernels.int8 import Int8Linear, Int8Weight

    K = 4096
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, K), dtype=np.float32)
    x[0, np.abs(x[0]) >= 6.0] = 0.0  # (1, K): no outlier feature
    x_outliers = x.copy()
    x_outliers[0, rng.choice(K, OUTLIER_FEATURES, replace=False)] = 40.0

    def layers(views):
        return [Int8Linear(Int8Weight(w, np.ones(w.shape[0], np.float32), None, np.zeros(w.shape[0], np.int32)))
                for w in views]

    def dram(view_bytes, fixed_s):
        views = _dram_views(buffer, np.int8, view_bytes, K)
        in_turn = layers(views)
        return sum(w.nbytes for w in views) / _in_turn_less_fixed([lambda layer=layer: layer(x) for layer in in_turn],
                                                                  fixed_s)

    def outlier_seconds():
        resident = np.ones((max(1, cache_sizes().get("L2", 2**20) // 2 // K), K), dtype=np.int8)  # (N, K)
        layer = layers([resident])[0]
        layer(x), layer(x_outliers)  # warm: compiled, resident
        differences = sorted(_best(lambda: layer(x_outliers), repeats=10, warmup=0)
                             - _best(lambda: layer(x), repeats=10, warmup=0) for _ in range(7))  # in turn: no drift
        return _per_product(differences[len(differences) // 2], resident.shape[0] * OUTLIER_FEATURES)  # the median

    w_llc = np.ones((max(1, int(llc_bytes) // 4 // K), K), dtype=np.int8)  # (N, K)

    def cache_rate(fixed_s):
        layer = layers([w_llc])[0]
        t = _best(lambda: layer(x), repeats=20, warmup=3)
        return w_llc.nbytes / max(t - fixed_s, 0.5 * t)

    rates = {}
    rates["int8_gemv_dram"] = dram(16 * 2**20, launch_s + call_s)
    rates["int8_gemv_llc"] = cache_rate(launch_s + call_s)
    with one_thread():
        rates["int8_gemv_one_llc"] = cache_rate(call_s)
        rates["int8_gemv_one_dram"] = dram(4 * 2**20, call_s)
        rates["int8_outlier_s"] = outlier_seconds()
    return rates


OUTLIER_FEATURES = 16  # outlier features of the calibration's second input (LLM.int8() §4: a handful per layer)


def phase_rates(d: int = 64, *, spec: HardwareSpec | None = None, write_all: float | None = None,
                launch_s: float | None = None, buffer=None):
    """Measure this machine's ``PhaseRates`` now (a few seconds). The all-core write rate is the triad's and the
    launch cost an empty parallel region's: ``write_all`` and ``launch_s`` when given, else ``spec``'s (its
    calibration), else measured here. ``buffer``: a float32 array of at least ``dram_test_bytes()`` whose pages
    are mapped (allocated when not given)."""
    import numba

    from .costs.phases import PhaseRates

    start = time.perf_counter()
    threads = numba.get_num_threads()
    l2 = cache_sizes().get("L2", 2**20)
    if buffer is None:
        buffer = filled(dram_test_bytes() // 4, 1.0, np.float32)
    values = {"threads": threads}
    values["read_all"] = read_bandwidth_of(buffer, repeats=3)
    values["llc_bytes"], values["llc_curve_bytes"], values["llc_curve_fraction"] = llc_curve(buffer, l2)
    values["llc_curve_all_fraction"] = llc_curve_all(buffer, values["llc_curve_bytes"], threads, l2)
    # NumPy's BLAS first, then an idle pause: its threads spin for ~0.1 s after a call (OpenBLAS's THREAD_TIMEOUT)
    # and would take the cores from every measurement after it, this calibration's and the caller's
    values.update(gemv_rates(buffer, values["llc_bytes"]))
    settle()
    # one core's NumPy passes from the cache (arrays of 2·L2, past one core's L2) and from DRAM (two quarters of
    # the buffer: a pass over both covers the largest cache the OS reports, where one core's read rate measured
    # above has long reached DRAM's)
    half = (buffer.size // 4) // 2**20 * 2**20  # whole (1024, 1024) planes for the masked store
    rng = np.random.default_rng(0)
    scores = rng.uniform(*SCORE_RANGE, 2**20).astype(np.float32)  # (2^20,) repeated over the first half
    buffer[:half].reshape(-1, 2**20)[:] = scores  # (in place: a new array of this size would fault in slowly)
    small = max(2**20, (2 * l2 // 4) // 2**20 * 2**20)
    x_small = buffer[:small].copy()
    y_small = x_small.copy()
    values.update(_numpy_pass_rates(x_small, y_small, "llc"))
    values.update(_numpy_pass_rates(buffer[:half], buffer[half:2 * half], "dram"))
    values.update(_standard_gemm_rates(d))
    values.update(_flash_block_rates(d, threads))
    values["first_touch_all"] = first_touch_rate(buffer.nbytes // 4)
    values["attention_call_s"] = attention_call_seconds()
    values.update(decode_stream_rates(buffer, d, threads, values["attention_call_s"]))
    values.update(decode_step_rates(buffer, threads))
    if write_all is None:
        write_all = spec.hbm_bandwidth if spec is not None else triad_bandwidth_of(buffer, repeats=3)
    if launch_s is None:
        launch_s = spec.launch_overhead_s if spec is not None else launch_overhead()
    values["write_all"], values["launch_s"] = write_all, launch_s
    values["int8_call_s"] = int8_call_seconds()
    values.update(int8_gemv_rates(buffer, values["llc_bytes"], values["launch_s"], values["int8_call_s"]))
    llc_part = buffer[:max(2**18, int(values["llc_bytes"]) // 2 // 4)]  # half the effective LLC
    values["read_all_llc"] = read_bandwidth_of(llc_part, repeats=20)
    with one_thread():  # one core's read, as a call that runs on the calling thread streams (_common.threads)
        values["read_one_llc"] = read_bandwidth_of(llc_part, repeats=20)
        values["read_one_dram"] = read_bandwidth_of(buffer[:buffer.size // 4], repeats=3)
    values["row_step_s"] = 0.0
    values["row_step_s"] = flash_row_step_seconds(PhaseRates(**values), d)
    values["calibration_s"] = time.perf_counter() - start
    return PhaseRates.from_toml(PhaseRates(**values).to_toml())  # what the cache file will hold, to the last bit


ROW_STEP_SAMPLES = 5  # excesses of the whole flash kernel over the model that set row_step_s (their median)


def flash_row_step_seconds(rates, d: int) -> float:
    """Seconds per query row and key block that ``kernels.attention(algorithm="flash")`` takes beyond the parts
    ``rates`` times (block products, exps, rescale, call): the whole kernel measured at N = 4·Br with two heads
    per thread (4 key blocks per row, the first with its row max), less the per-phase prediction without this
    term, over the row-blocks its slowest thread runs."""
    import kernels

    from .costs.phases import flash_phases, total_seconds

    br, bc = rates.block_br, rates.block_bc
    heads, n = 2 * rates.threads, 4 * br
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, heads, n, d), dtype=np.float32) for _ in range(3))
    predicted = total_seconds(flash_phases(rates, 1, heads, heads, n, n, d, Br=br, Bc=bc))
    per_thread_rows = heads * (n // br) * (n // bc) * br / rates.threads
    # the median of ROW_STEP_SAMPLES excesses, each the best of 5 calls, so that one burst during the calls does
    # not set it. The excess is a small difference of two larger times: on a 2-vCPU AMD EPYC it took 0 to 650 ns
    # per row over four calibrations of the block rates (each excess the same within 10% for one calibration), and
    # a validation run whose calibration gave 0 predicted flash at N = 512 25% short
    excess = sorted(_best(lambda: kernels.attention(q, k, v), repeats=5) - predicted for _ in range(ROW_STEP_SAMPLES))
    return max(0.0, excess[len(excess) // 2]) / per_thread_rows


def cpu_phase_rates(force: bool = False):
    """This machine's ``PhaseRates``: from the cache file when it is there, from this machine (and these
    threads) and measured by this code (``simulator.calibrate.code_stamp``), else measured with ``cpu_spec()`` and
    saved. ``force=True`` measures again."""
    import numba

    from .costs.phases import PhaseRates

    path = user_cache_dir() / PHASE_CACHE_FILE
    stamp = f"{cache_stamp()}# {machine_id()} threads={numba.get_num_threads()}\n"
    if not force and path.is_file():
        text = path.read_text()
        if text.startswith(stamp):
            try:
                return PhaseRates.from_toml(text, origin=str(path))
            except ValueError:
                pass
    spec = cached_spec()
    if spec is None:  # both at once, over one buffer
        spec, rates = calibrate(with_phase_rates=True)
        save_to_cache(user_cache_dir() / CACHE_FILE, cache_stamp() + spec.to_toml())
    else:
        rates = phase_rates(spec=spec)
    save_to_cache(path, stamp + rates.to_toml())
    return PhaseRates.from_toml(stamp + rates.to_toml())
