"""The ``cpu`` spec: this machine, calibrated at run time and cached in the user's cache directory.

Cache sizes come from the OS; DRAM bandwidth from a STREAM-style triad (McCalpin 1995) run on all cores, counting
the bytes a triad really moves; peak FLOP/s from a large sgemm; the cache bandwidth from the same triad on arrays
that fit in the cores' L2, swept many times in one parallel region; the launch overhead from an empty parallel
region. The per-phase rates of ``simulator.costs.phases`` are measured by ``simulator.calibrate_phases`` (over
the same DRAM buffer when ``calibrate(with_phase_rates=True)`` measures both).
"""
from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import os
import warnings
from pathlib import Path

import numpy as np
from numba import njit, prange

from kernels.cpuinfo import cache_sizes, cpu_model, user_cache_dir

from .hardware.spec import HardwareSpec, from_toml, safe_name
from .measure import time_call

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
        # the chunk's own views: indexed from 0 to their size, the loop vectorizes. Indexed from t·chunk into the
        # whole arrays it stayed scalar on a 2-vCPU AMD EPYC (Zen 4): 31-34 against 200-255 GB/s over 64 KiB to
        # 1 MiB arrays, below that machine's DRAM triad (52 GB/s)
        lo = t * chunk
        hi = min(a.size, lo + chunk)
        a_t, b_t, c_t = a[lo:hi], b[lo:hi], c[lo:hi]
        for sweep in range(sweeps):
            f = s + sweep
            for i in range(a_t.size):
                a_t[i] = b_t[i] + f * c_t[i]


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
def fill_parallel(x, value):
    for i in prange(x.size):
        x[i] = value


def filled(n, value, dtype):
    """An array of n elements set to ``value``, its pages faulted in by all threads (np.full faults them in on
    one core: seconds for the arrays of a DRAM measurement)."""
    x = np.empty(n, dtype=dtype)
    fill_parallel(x, value)
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
    a, b, c = (filled(n, value, np.float64) for value in (0.0, 1.0, 2.0))
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
    return read_bandwidth_of(filled(max(1, n_bytes // 4), 1.0, np.float32), repeats)


def read_once(*arrays) -> None:
    """Read each float32 array once on all cores, one after the other (the read of ``read_bandwidth``)."""
    n_chunks = 64 * (os.cpu_count() or 1)  # many more chunks than threads, so a slow core does not hold the rest
    for x in arrays:
        _read_sum(x, n_chunks)


def read_bandwidth_of(x, repeats: int = 5) -> float:
    """Bytes/s of reading the float32 array ``x`` once on all cores (``read_bandwidth``, over an array the caller
    holds)."""
    timing = time_call(lambda: read_once(x), repeats=repeats, warmup=2, settle_s=0.0)
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


def machine_id() -> str:
    """The CPU's model and logical cores, as the ``cpu`` spec's name holds them (``safe_name``)."""
    return f"{safe_name(cpu_model())} x{os.cpu_count()}"


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
    buffer = filled(dram_test_bytes() // 4, 1.0, np.float32)
    # Numba's parallel regions first, NumPy's BLAS last: OpenBLAS's threads spin for a while after an sgemm, and
    # a triad of a few microseconds run beside them measured 8 ms per call (seen after the model tests)
    cache_bw = cache_triad_bandwidth(l2 // 4)  # three arrays that fit in one L2 together, split over the cores
    dram_bw = triad_bandwidth_of(buffer)  # the three arrays together: twice the largest cache the OS reports
    launch_s = launch_overhead()
    rates = None
    if with_phase_rates:
        from .calibrate_phases import phase_rates

        rates = phase_rates(write_all=dram_bw, launch_s=launch_s, buffer=buffer)
    del buffer
    fp32 = sgemm_flops()
    spec = HardwareSpec(
        name=f"cpu ({machine_id()})", kind="cpu",
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


@functools.lru_cache(maxsize=None)
def code_stamp() -> str:
    """A digest of the code whose speed the cache files hold (the kernels, the calibration and the timing
    helpers): a cache file written by another version of that code is measured again, since a change to a kernel
    changes the rates measured on it (the cache triad's rewrite once moved this machine's cache bandwidth 6x)."""
    root = Path(__file__).resolve().parent.parent  # holds the packages kernels and simulator
    files = [*(root / "kernels").rglob("*.py"), *(root / "simulator").glob("calibrate*.py"),
             root / "simulator" / "measure.py"]
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def cache_stamp() -> str:
    """The first line of a cache file of this module's measurements: a comment naming the code that measured
    them (``code_stamp``)."""
    return f"# measured by code {code_stamp()}\n"


def cached_spec() -> HardwareSpec | None:
    """The spec in the cache file, if it is there, readable, from this machine and measured by this code."""
    path = user_cache_dir() / CACHE_FILE
    if not path.is_file():
        return None
    text = path.read_text()
    if not text.startswith(cache_stamp()):
        return None
    try:
        spec = from_toml(text, origin=str(path))
    except ValueError:
        return None
    return spec if spec.name == f"cpu ({machine_id()})" else None


def cpu_spec(force: bool = False) -> HardwareSpec:
    """This machine's spec: from the cache file when it is there, from this machine and measured by this code
    (``code_stamp``), else calibrated and saved.

    ``force=True`` measures again.
    """
    spec = None if force else cached_spec()
    if spec is not None:
        return spec
    spec = calibrate()
    save_to_cache(user_cache_dir() / CACHE_FILE, cache_stamp() + spec.to_toml())
    return spec


def save_atomically(path, text):
    """Write ``text`` to ``path`` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_to_cache(path, text):
    """``save_atomically`` for a cache file: where it cannot be written (a read-only cache directory, or an
    IOAWARE_CACHE_DIR that names a file) a ``RuntimeWarning`` says so and the caller goes on with what it measured;
    the next run measures again."""
    try:
        save_atomically(path, text)
    except OSError as err:
        warnings.warn(f"could not write the cache file {path} ({err}); this machine is measured again next time",
                      RuntimeWarning, stacklevel=2)
