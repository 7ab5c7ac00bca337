"""Measuring on this machine: median wall time and peak memory of a call."""
from __future__ import annotations

import statistics
import threading
import time
import tracemalloc
from dataclasses import dataclass

import numpy as np
import psutil


@dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of repeated calls after warm-up."""

    median_s: float
    min_s: float
    repeats: int
    samples_s: tuple = ()  # every timed call, in order


# Idle time before a measurement. NumPy's OpenBLAS worker threads spin for about 2^28 cycles (~0.1 s) after a
# call (THREAD_TIMEOUT in OpenBLAS's driver/others/blas_server.c; OPENBLAS_THREAD_TIMEOUT sets the exponent, see the
# README's Threads) while ioaware's own pool sleeps at once (kernels/_common/threads.py): without a pause, a NumPy
# BLAS call measured just before steals the cores from the next measurement (flash attention at N=512 ran 2x slower
# right after it).
# ``settle`` ends the pause as soon as the process's threads are quiet, which they are at once after ioaware's own
# calls (its pool waits passively); SETTLE_S is the most it waits for a spinning pool.
SETTLE_S = 0.3
QUIET_STEP_S = 0.01  # the pause's steps. Linux adds another thread's CPU time to the process's clock at its
# scheduler ticks and switches (every 4 ms at HZ = 250, 1 ms at 1000), so a step must span a few ticks
QUIET_STEPS = 2  # consecutive quiet steps that end the pause: a spinning worker that another process kept off the
# cores for one whole step is not taken for a sleeping one
QUIET_SHARE = 0.1  # the process's CPU time per second of a step (all its threads) under which it is quiet: a spinning
# worker uses a whole core (1.0); a thread woken by the OS for a tick or two, a few percent

# Warm-up after that pause, in seconds of calls. On a shared VM the data of a call idle for 30 ms or more is cold
# when it comes back: its next reads run at DRAM speed or below, whatever the process did meanwhile (measured on a
# 2-vCPU Xeon VM: one core's read of a 16 MiB array 29 GB/s back to back, 13 GB/s after 30-100 ms of sleep or of
# spinning on other work; flash attention at N=256 2.1 ms against 1.1 ms). It takes on the order of 0.1 s of calls to
# come back: with 0.1-0.2 s of calls the medians of 3 runs were steady (1.09-1.12 ms), with one call they were not.
WARM_S = 0.15


def settle(max_s: float = SETTLE_S) -> float:
    """Idle until the process's threads (``time.process_time``: all of them, this one included) have used under
    QUIET_SHARE of a core in each of QUIET_STEPS steps of QUIET_STEP_S in a row, or ``max_s`` has passed; the
    seconds idled. Another pool's workers that spin after its calls (NumPy's OpenBLAS for ~0.1 s) keep it waiting;
    a pool that sleeps does not."""
    start = time.perf_counter()
    quiet = 0
    while quiet < QUIET_STEPS and (left := max_s - (time.perf_counter() - start)) > 0:
        step = min(QUIET_STEP_S, left)
        cpu = time.process_time()
        time.sleep(step)
        quiet = quiet + 1 if time.process_time() - cpu < QUIET_SHARE * step else 0
    return time.perf_counter() - start


def time_call(fn, *, repeats: int = 5, warmup: int = 1, settle_s: float = SETTLE_S,
              warm_s: float | None = None) -> Timing:
    """Idle until the process's threads are quiet, for at most ``settle_s`` (``settle``), call ``fn`` ``warmup``
    times untimed (compilation, caches) and on until ``warm_s`` has passed (``WARM_S`` after a pause, none without
    one), then ``repeats`` times with ``perf_counter``."""
    if warm_s is None:
        warm_s = WARM_S if settle_s > 0 else 0.0
    settle(settle_s)
    start = time.perf_counter()
    for _ in range(warmup):
        fn()
    while time.perf_counter() - start < warm_s:
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return Timing(statistics.median(samples), min(samples), repeats, tuple(samples))


def in_turn(calls):
    """One callable that runs the next of ``calls`` at each call, round robin: the same work on other data each
    time, as a decode step meets its layers (each layer's weights are read once per token)."""
    turn = [0]

    def call():
        calls[turn[0] % len(calls)]()
        turn[0] += 1

    return call


def views(buffer, shape, dtype=np.float32, count=None) -> list:
    """Consecutive, disjoint C-contiguous arrays of ``shape`` laid over ``buffer`` read as ``dtype``, from its start:
    ``count`` of them, or as many as fit (distinct data for calls taken in turn, without copies)."""
    flat = buffer.reshape(-1).view(dtype)
    size = int(np.prod(shape))
    fit = flat.size // size
    return [flat[i * size:(i + 1) * size].reshape(shape) for i in range(fit if count is None else min(count, fit))]


def streamed_gemv_seconds(buffer, k: int, x, *, repeats: int = 15, rounds: int = 3,
                          threshold: float = 6.0) -> tuple[float, float]:
    """Median seconds of a K = N = ``k`` GEMV of the float32 vector ``x`` (1, k), NumPy's float32 (``x @ Wᵀ``)
    and ``Int8Linear``'s, each as a decode step runs it: one call after another on distinct weights, the copies
    (``k × k`` views of ``buffer``, a float32 array whose pages are mapped, at least twice the largest cache) in
    turn, so that every call reads its weights from DRAM. The two are timed in ``rounds`` alternating rounds of
    ``repeats`` calls each, and each median is over all its rounds' calls: a sub-millisecond call on a shared VM
    moves by tens of percent between seconds (K = 2048 on a 2-vCPU AMD EPYC, one round each, three runs: float32
    0.49-0.76 ms, int8 0.30-0.45 ms), and alternating puts both in the same moments. Returns (float32 s, int8 s).
    The weights' values are the buffer's: the kernels' time does not depend on them (the int8 scales are ones, the
    row sums zeros)."""
    from kernels.int8 import Int8Linear, Int8Weight

    flat = buffer.reshape(-1)
    if flat.dtype != np.float32 or flat.size < 2 * k * k:
        raise ValueError(f"buffer must be float32 with room for two {k} x {k} weights; got {flat.dtype} "
                         f"{flat.size} elements")
    fp32 = views(flat, (k, k))
    ones, zeros = np.ones(k, dtype=np.float32), np.zeros(k, dtype=np.int32)
    int8 = [Int8Linear(Int8Weight(w, ones, None, zeros), threshold=threshold) for w in views(flat, (k, k), np.int8)]
    call_fp32 = in_turn([lambda w=w: x @ w.T for w in fp32])
    call_int8 = in_turn([lambda layer=layer: layer(x) for layer in int8])
    samples_fp32, samples_int8 = [], []
    for r in range(rounds):
        # NumPy's BLAS after ioaware's pool, which sleeps when a call returns: no pause needed but the first's
        samples_fp32 += time_call(call_fp32, repeats=repeats, warmup=len(fp32) if r == 0 else 1,
                                  settle_s=SETTLE_S if r == 0 else 0.0).samples_s
        # int8 after a pause: OpenBLAS's workers spin on after its calls (SETTLE_S)
        samples_int8 += time_call(call_int8, repeats=repeats, warmup=2 if r == 0 else 1).samples_s
    return statistics.median(samples_fp32), statistics.median(samples_int8)


def decode_seconds(buffer, q, k, v, llc_bytes: float, *, repeats: int = 40) -> float:
    """Median seconds of one decode call, ``kernels.attention(q, K, V, causal=True)`` for the new token's query q
    (B, Hq, 1, d), as a model's layers meet their caches: (k, v) first, then consecutive views of ``buffer`` (a
    float32 array whose pages are mapped) of their shape, taken in turn, enough of them to exceed ``llc_bytes``
    twice, so that K and V come from DRAM. The views' values are the buffer's: no kernel branches on them."""
    import itertools
    import math

    import kernels

    extra = max(0, math.ceil(2 * llc_bytes / (2 * k.nbytes)) - 1)
    arrays = views(buffer, k.shape, count=2 * extra)
    caches = [(k, v)] + list(zip(arrays[0::2], arrays[1::2]))
    turn = itertools.cycle(caches)
    return time_call(lambda: kernels.attention(q, *next(turn), causal=True), repeats=repeats,
                     warmup=len(caches)).median_s


@dataclass(frozen=True)
class PeakMemory:
    """Memory a call needs above what the process held before it.

    ``traced_bytes``: peak of the allocations made through Python's and NumPy's allocators (``tracemalloc``),
    which include the arrays Numba-compiled code allocates (checked: the flash kernel's per-thread tiles show up);
    exact and repeatable. ``rss_bytes``: peak growth of the resident set of the whole process, sampled every
    ``interval_s`` by a background thread (sees everything that is touched, but a peak shorter than the interval,
    or memory the allocator reuses, can be missed).
    """

    traced_bytes: int
    rss_bytes: int


def peak_memory(fn, *, interval_s: float = 0.0005) -> PeakMemory:
    """Run ``fn`` once and return its peak memory above the baseline."""
    process = psutil.Process()
    baseline = process.memory_info().rss
    peak_rss = baseline
    stop = threading.Event()

    def sample():
        nonlocal peak_rss
        while not stop.is_set():
            peak_rss = max(peak_rss, process.memory_info().rss)
            stop.wait(interval_s)

    sampler = threading.Thread(target=sample, daemon=True)
    tracemalloc.start()
    sampler.start()
    try:
        fn()
    finally:
        stop.set()
        sampler.join()
        _, traced_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    peak_rss = max(peak_rss, process.memory_info().rss)
    return PeakMemory(traced_bytes=traced_peak, rss_bytes=max(0, peak_rss - baseline))
