"""The ``cpu`` spec: this machine, calibrated at run time and cached in the user's cache directory.

Cache sizes come from the OS; DRAM bandwidth from a STREAM-style triad (McCalpin 1995) run on all cores, counting
the bytes a triad really moves; peak FLOP/s from a large sgemm; the cache bandwidth from the same triad on arrays
that fit in the cores' L2, swept many times in one parallel region; the launch overhead from an empty parallel
region. ``phase_rates`` measures what the per-phase model (``simulator.costs.phases``) needs: one core's NumPy
passes (row reductions, in-place updates, passes into new arrays, masked stores, in-place exp) from the cache and
from DRAM, where the cache ends for one core, the all-core read rate, page faults, the kernels' matmuls per shape
class (the standard algorithm's QKᵀ and PV, the flash kernel's block products, NumPy's GEMV), the flash kernel's
exp and bookkeeping per thread, and the fixed cost of a call; ``cpu_phase_rates`` caches them beside the spec.
Both take a few seconds together (``PhaseRates.calibration_s`` records the phase part).
"""
from __future__ import annotations

import datetime as _dt
import math
import os
import time

import numpy as np
from numba import njit, prange

from kernels.cpuinfo import cache_sizes, cpu_model, user_cache_dir

from .hardware.spec import HardwareSpec, from_toml
from .measure import SETTLE_S, time_call

CACHE_FILE = "cpu-spec.toml"
MIN_DRAM_BYTES = 256 * 2**20  # per array of a DRAM measurement, at least
SGEMM_N = 2048


def dram_test_bytes() -> int:
    """Bytes per array of a DRAM measurement: twice the largest cache the OS reports, so that no pass is served
    from it (a 2-vCPU VM here reports the host's 480 MiB L3), at least MIN_DRAM_BYTES, and at most an eighth of
    the memory available now (a triad holds three such arrays)."""
    import psutil

    largest_cache = max(cache_sizes().values(), default=0)
    return int(min(max(MIN_DRAM_BYTES, 2 * largest_cache), psutil.virtual_memory().available // 8))


@njit(parallel=True, cache=True)
def _triad(a, b, c, s):
    for i in prange(a.size):
        a[i] = b[i] + s * c[i]


@njit(parallel=True, cache=True)
def _triad_sweeps(a, b, c, s, sweeps, n_chunks):
    """``sweeps`` triads in one parallel region, each of ``n_chunks`` tasks (one per thread) over its own chunk, so
    that the chunk stays in that core's cache and one wake-up of the pool is spread over all the sweeps; the
    factor changes per sweep, so no sweep repeats another's work."""
    chunk = (a.size + n_chunks - 1) // n_chunks
    for t in prange(n_chunks):
        for sweep in range(sweeps):
            f = s + sweep
            for i in range(t * chunk, min(a.size, (t + 1) * chunk)):
                a[i] = b[i] + f * c[i]


@njit(parallel=True, fastmath=True, cache=True)
def _read_sum(x, n_chunks):
    """Σ x, each of ``n_chunks`` tasks summing one contiguous chunk: every byte read once, nothing written."""
    chunk = (x.size + n_chunks - 1) // n_chunks
    partial = np.zeros(n_chunks, dtype=np.float32)
    for t in prange(n_chunks):
        # the slice's own sum vectorizes over several accumulators; a scalar loop with one accumulator read
        # half as fast on the Xeon (6.5 against 12 GB/s, measured side by side)
        partial[t] = x[t * chunk:min(x.size, (t + 1) * chunk)].sum()
    return partial.sum()


@njit(parallel=True, cache=True)
def _fill(x, value):
    for i in prange(x.size):
        x[i] = value


def _filled(n, value, dtype):
    """An array of n elements set to ``value``, its pages faulted in by all threads (np.full faults them in on
    one core: seconds for the arrays of a DRAM measurement)."""
    x = np.empty(n, dtype=dtype)
    _fill(x, value)
    return x


@njit(parallel=True, cache=True)
def _empty_parallel(x):
    for i in prange(x.size):
        x[i] = i


def triad_bandwidth(n_bytes: int, repeats: int = 5) -> float:
    """Bytes/s of a[i] = b[i] + s·c[i] over float64 arrays of ``n_bytes`` each.

    Bytes moved per element: read b and c (16 B), write a (8 B), and read a first (8 B): a store to a line that is
    not in cache fetches it (write-allocate), as STREAM's documentation notes; 32 B, not STREAM's nominal 24 B.
    """
    n = max(1, n_bytes // 8)
    a, b, c = (_filled(n, value, np.float64) for value in (0.0, 1.0, 2.0))
    timing = time_call(lambda: _triad(a, b, c, 3.0), repeats=repeats, warmup=1, settle_s=0.0)
    return 4 * 8 * n / timing.min_s


CACHE_SWEEP_BYTES = 256 * 2**20  # bytes one cache measurement moves: ~10 ms even at 30 GB/s, far above a wake-up


def cache_triad_bandwidth(n_bytes: int, repeats: int = 5) -> float:
    """Bytes/s of the triad over float64 arrays of ``n_bytes`` each that stay in the cores' caches: repeated sweeps
    inside one parallel region (``_triad_sweeps``), so that the pool's wake-up (tens of microseconds with passive
    waits, more than one sweep over a cache-sized array) does not count; 32 B per element, as ``triad_bandwidth``.
    """
    import numba

    n = max(1, n_bytes // 8)
    a, b, c = np.zeros(n), np.ones(n), np.full(n, 2.0)
    sweeps = max(1, CACHE_SWEEP_BYTES // (4 * 8 * n))
    threads = numba.get_num_threads()
    timing = time_call(lambda: _triad_sweeps(a, b, c, 3.0, sweeps, threads), repeats=repeats, warmup=1,
                       settle_s=0.0)
    return sweeps * 4 * 8 * n / timing.min_s


def read_bandwidth(n_bytes: int | None = None, repeats: int = 5) -> float:
    """Bytes/s of reading ``n_bytes`` of float32 once on all cores (a sum, nothing written back): the rate that
    bounds a decode step, which streams its weights and KV cache and writes almost nothing. The best of
    ``repeats`` (a bound, as STREAM reports its best run).
    """
    n_bytes = dram_test_bytes() if n_bytes is None else n_bytes
    return read_bandwidth_of(_filled(max(1, n_bytes // 4), 1.0, np.float32), repeats)


def read_bandwidth_of(x, repeats: int = 5) -> float:
    """Bytes/s of reading the float32 array ``x`` once on all cores (``read_bandwidth``, over an array the caller
    holds)."""
    n_chunks = 64 * (os.cpu_count() or 1)  # many more chunks than threads, so a slow core does not hold the rest
    timing = time_call(lambda: _read_sum(x, n_chunks), repeats=repeats, warmup=2, settle_s=0.0)
    return x.nbytes / timing.min_s


def sgemm_flops(n: int = SGEMM_N) -> float:
    """FLOP/s of an n³ float32 matmul on NumPy's BLAS (2·n³ FLOPs)."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    timing = time_call(lambda: a @ b, repeats=3, warmup=1, settle_s=0.0)
    return 2 * n**3 / timing.min_s


def launch_overhead() -> float:
    """Seconds of an almost empty Numba parallel region (the CPU's analogue of a kernel launch)."""
    x = np.empty(64)
    return time_call(lambda: _empty_parallel(x), repeats=200, warmup=5, settle_s=0.0).median_s


def _machine_id() -> str:
    return f"{cpu_model()} x{os.cpu_count()}"


def triad_bandwidth_of(buffer, repeats: int = 5) -> float:
    """``triad_bandwidth`` over the three thirds of ``buffer`` (any array whose pages are mapped), viewed as
    float64: the three arrays together are the buffer's size."""
    flat = buffer.reshape(-1).view(np.float64)
    n = flat.size // 3
    a, b, c = flat[:n], flat[n:2 * n], flat[2 * n:3 * n]
    b[:] = 1.0
    c[:] = 2.0
    timing = time_call(lambda: _triad(a, b, c, 3.0), repeats=repeats, warmup=1, settle_s=0.0)
    return 4 * 8 * n / timing.min_s


def calibrate(*, with_phase_rates: bool = False):
    """Measure this machine now (a few seconds): its ``HardwareSpec``, and with ``with_phase_rates=True`` also its
    ``PhaseRates`` (``phase_rates``), returned as (spec, rates). One buffer of ``dram_test_bytes()`` serves every
    DRAM measurement: the triad over its thirds, the reads and the one-core passes over it (faulting its pages in
    once takes longer, on this VM, than all the measurements over it)."""
    import psutil

    caches = cache_sizes()
    l2 = caches.get("L2", 2**20)
    cores = os.cpu_count() or 1
    buffer = _filled(dram_test_bytes() // 4, 1.0, np.float32)
    # Numba's parallel regions first, NumPy's BLAS last: OpenBLAS's threads spin for a while after an sgemm, and
    # a triad of a few microseconds run beside them measured 8 ms per call (seen after the model tests)
    cache_bw = cache_triad_bandwidth(l2 // 4)  # three arrays that fit in one L2 together, split over the cores
    dram_bw = triad_bandwidth_of(buffer)  # the three arrays together: twice the largest cache the OS reports
    launch_s = launch_overhead()
    rates = phase_rates(write_all=dram_bw, launch_s=launch_s, buffer=buffer) if with_phase_rates else None
    del buffer
    fp32 = sgemm_flops()
    spec = HardwareSpec(
        name=f"cpu ({_machine_id()})", kind="cpu",
        hbm_bytes=float(psutil.virtual_memory().total),
        hbm_bandwidth=dram_bw,
        l2_bytes=float(caches.get("L3", l2)),  # the last-level cache plays the GPU L2's part
        sram_per_sm_bytes=float(l2),  # one core's L2 plays the SM's shared memory
        sm_count=cores, clock_hz=0.0,
        fp32_flops=fp32, fp16_flops=fp32, bf16_flops=fp32,  # half precision is computed in float32 on the CPU
        int8_ops=fp32,  # until the int8 kernels are measured, int8 work is predicted at the sgemm rate
        launch_overhead_s=launch_s,
        sram_bandwidth_measured=cache_bw,
        measured_on=_dt.date.today().isoformat(),
    )
    spec = from_toml(spec.to_toml(), origin="calibration")  # what the cache file will hold, to the last bit
    return (spec, rates) if with_phase_rates else spec


def _cached_spec() -> HardwareSpec | None:
    """The spec in the cache file, if it is there, readable and from this machine."""
    path = user_cache_dir() / CACHE_FILE
    if not path.is_file():
        return None
    try:
        spec = from_toml(path.read_text(), origin=str(path))
    except ValueError:
        return None
    return spec if spec.name == f"cpu ({_machine_id()})" else None


def cpu_spec(force: bool = False) -> HardwareSpec:
    """This machine's spec: from the cache file when it is there and from this machine, else calibrated and saved.

    ``force=True`` measures again.
    """
    spec = None if force else _cached_spec()
    if spec is not None:
        return spec
    spec = calibrate()
    _save(user_cache_dir() / CACHE_FILE, spec.to_toml())
    return spec


# -- per-phase rates (simulator.costs.phases) -----------------------------------------------------------------------
# What the CPU kernels run, measured the way they run it: NumPy's elementwise passes on one core, the standard
# algorithm's batched matmuls and the flash kernel's block products, exp and rescale on all of Numba's threads.

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


def _best(fn, repeats=3, warmup=1):
    return time_call(fn, repeats=repeats, warmup=warmup, settle_s=0.0).min_s


def llc_curve(buffer, l2_bytes: int) -> tuple[float, tuple, tuple]:
    """One core's read rate over slices of ``buffer`` of 2·L2, 4·L2, ... bytes up to the whole buffer, as
    (effective LLC bytes, sizes, fractions): each fraction places its rate between the first (cache) and the last
    (DRAM) on a log scale, 1 to 0; the effective LLC is the last size at or above one half. The OS's figure for a
    VM's last-level cache is the host's (480 MiB here, where one core's rate falls between 32 and 64 MiB)."""
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
    span = math.log(rates[0] / rates[-1]) or 1.0
    fractions = tuple(min(1.0, max(0.0, math.log(r / rates[-1]) / span)) for r in rates)
    llc = max(size for size, f in zip(sizes, fractions) if f >= 0.5)
    return llc, tuple(sizes), fractions


def _numpy_pass_rates(x, y, level: str) -> dict:
    """One core's rates of the standard algorithm's NumPy passes over float32 arrays x, y of equal size (bytes
    read + written per second; exp in elements per second), keyed as ``PhaseRates``' fields of ``level``."""
    rows = x.reshape(-1, 1024)  # (rows, 1024): row reductions over the last axis, as over scores
    y_rows = y.reshape(-1, 1024)
    # from DRAM a pass takes tens of milliseconds: two repeats, no warm-up (the pages are mapped already)
    repeats, warmup = (3, 1) if level == "llc" else (2, 0)

    def best(fn):
        return _best(fn, repeats=repeats, warmup=warmup)

    rates = {
        f"reduce_{level}": x.nbytes / best(lambda: rows.max(axis=-1, keepdims=True)),
        f"update_{level}": 2 * y.nbytes / best(lambda: np.multiply(y, np.float32(1.0), out=y)),
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

    from ._phase_kernels import block_steps, exp_rows, rescale_rows, task_buffers

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
        rescale_rows(o_acc, pv, alpha, 1)
        rescale = _best(lambda: rescale_rows(o_acc, pv, alpha, iterations)) / iterations
    products = max(step - exp - rescale, 0.5 * step)  # (a floor, should noise make the parts exceed the step)
    # the tiles every task allocates: their page faults, less the same writes into tiles already mapped
    n_tasks = 8 * threads
    task_bytes = 4 * (2 * br * bc + 3 * br * d)
    task_buffers(n_tasks, br, bc, d, True, threads)
    task_buffers(n_tasks, br, bc, d, False, threads)
    fresh = _best(lambda: task_buffers(n_tasks, br, bc, d, True, threads), repeats=5)
    mapped = _best(lambda: task_buffers(n_tasks, br, bc, d, False, threads), repeats=5)
    faults = n_tasks / threads * task_bytes / max(fresh - mapped, 1e-9)
    return {"gemm_block": 4 * br * bc * d / products, "exp_block": br * bc / exp, "fma_block": br * d / rescale,
            "task_fault": faults, "block_br": br, "block_bc": bc}


def _standard_gemm_rates(d: int, threads: int) -> dict:
    """The standard algorithm's matmuls (``kernels._common.blas``): S = QKᵀ (K = d) and PV (K = N) over 8 heads of
    N = 1024, into outputs allocated once (their page faults are counted apart, in ``first_touch_all``)."""
    from kernels._common.blas import TASKS_PER_THREAD, _batched_nn, _batched_nt, single_threaded_blas

    G, n = 8, 1024
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((G, n, d), dtype=np.float32) for _ in range(3))  # (G, N, d)
    s = np.empty((G, n, n), dtype=np.float32)  # (G, N, N)
    o = np.empty((G, n, d), dtype=np.float32)  # (G, N, d)
    n_blocks = max(1, min(n, -(-TASKS_PER_THREAD * threads // G)))
    flops = 2 * G * n * n * d
    with single_threaded_blas():
        qk = flops / _best(lambda: _batched_nt(q, k, s, n_blocks))
        pv = flops / _best(lambda: _batched_nn(s, v, o, n_blocks))
    return {"gemm_qk": qk, "gemm_pv": pv, "gemm_d": d}


def first_touch_rate(n_bytes: int) -> float:
    """Bytes/s at which all threads fault in new pages: a parallel fill of a new array of ``n_bytes``, less the
    same fill of a mapped one (the write itself)."""
    x = _filled(max(1, n_bytes // 4), 0.0, np.float32)
    mapped = _best(lambda: _fill(x, 1.0), repeats=2)
    del x
    fresh = _best(lambda: _fill(np.empty(max(1, n_bytes // 4), dtype=np.float32), 1.0), repeats=2, warmup=0)
    return n_bytes / max(fresh - mapped, 1e-9)


def attention_call_seconds() -> float:
    """Seconds of one ``kernels.attention`` call on a tiny decode input (one query, 16 keys, d = 64): the fixed
    cost of a call, validation, allocation and one parallel region."""
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


def gemv_rates(buffer, llc_bytes: float) -> dict:
    """NumPy's float32 GEMV x · Wᵀ (its own BLAS, all cores) in weight bytes/s: W a (N, 4096) view of the mapped
    ``buffer`` (DRAM: half the buffer) and of a quarter of the effective LLC (the cache)."""
    K = 4096
    x = np.ones((1, K), dtype=np.float32)
    w_dram = buffer[:buffer.size // 2 // K * K].reshape(-1, K)  # (N, K)
    w_llc = np.ones((max(1, int(llc_bytes) // 4 // 4 // K), K), dtype=np.float32)  # (N, K)
    return {"gemv_fp32_dram": w_dram.nbytes / _best(lambda: x @ w_dram.T, repeats=3),
            "gemv_fp32_llc": w_llc.nbytes / _best(lambda: x @ w_llc.T, repeats=20, warmup=3)}


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
        buffer = _filled(dram_test_bytes() // 4, 1.0, np.float32)
    values = {"threads": threads}
    values["read_all"] = read_bandwidth_of(buffer, repeats=3)
    values["llc_bytes"], values["llc_curve_bytes"], values["llc_curve_fraction"] = llc_curve(buffer, l2)
    # NumPy's BLAS first, then an idle pause: its threads spin for ~0.1 s after a call (OpenBLAS's THREAD_TIMEOUT)
    # and would take the cores from every measurement after it, this calibration's and the caller's
    values.update(gemv_rates(buffer, values["llc_bytes"]))
    time.sleep(SETTLE_S)
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
    values.update(_standard_gemm_rates(d, threads))
    values.update(_flash_block_rates(d, threads))
    values["first_touch_all"] = first_touch_rate(buffer.nbytes // 4)
    if write_all is None:
        write_all = spec.hbm_bandwidth if spec is not None else triad_bandwidth_of(buffer, repeats=3)
    if launch_s is None:
        launch_s = spec.launch_overhead_s if spec is not None else launch_overhead()
    values["write_all"], values["launch_s"] = write_all, launch_s
    values["attention_call_s"] = attention_call_seconds()
    values["int8_call_s"] = int8_call_seconds()
    llc_part = buffer[:max(2**18, int(values["llc_bytes"]) // 2 // 4)]  # half the effective LLC
    values["read_all_llc"] = read_bandwidth_of(llc_part, repeats=20)
    values["row_step_s"] = 0.0
    values["row_step_s"] = flash_row_step_seconds(PhaseRates(**values), d)
    values["calibration_s"] = time.perf_counter() - start
    return PhaseRates.from_toml(PhaseRates(**values).to_toml())  # what the cache file will hold, to the last bit


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
    measured = _best(lambda: kernels.attention(q, k, v), repeats=5)
    predicted = flash_phases(rates, 1, heads, heads, n, n, d, Br=br, Bc=bc)
    row_blocks = next(p for p in predicted if p.name == "bookkeeping")  # 0 s here: its count is what is needed
    per_thread_rows = heads * (n // br) * (n // bc) * br / rates.threads
    del row_blocks
    return max(0.0, measured - total_seconds(predicted)) / per_thread_rows


def cpu_phase_rates(force: bool = False):
    """This machine's ``PhaseRates``: from the cache file when it is there and from this machine (and these
    threads), else measured with ``cpu_spec()`` and saved. ``force=True`` measures again."""
    import numba

    from .costs.phases import PhaseRates

    path = user_cache_dir() / PHASE_CACHE_FILE
    stamp = f"# {_machine_id()} threads={numba.get_num_threads()}\n"
    if not force and path.is_file():
        text = path.read_text()
        if text.startswith(stamp):
            try:
                return PhaseRates.from_toml(text, origin=str(path))
            except ValueError:
                pass
    spec = _cached_spec()
    if spec is None:  # both at once, over one buffer
        spec, rates = calibrate(with_phase_rates=True)
        _save(user_cache_dir() / CACHE_FILE, spec.to_toml())
    else:
        rates = phase_rates(spec=spec)
    _save(path, stamp + rates.to_toml())
    return PhaseRates.from_toml(stamp + rates.to_toml())


def _save(path, text):
    """Write ``text`` to ``path`` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
