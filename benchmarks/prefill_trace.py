"""Where the dense prefill's slow calls lose their time (run by ``test_bench_stalls.py::test_slow_prefill_calls``).

The stall benchmark's rounds (``stall_probe._calls``: ioaware's calls interleaved with NumPy's and torch's), with a
traced copy of the prefill's product right after the prefill: each thread of its parallel region records the CPU it
started on (``sched_getcpu``), when it started and ended (``CLOCK_MONOTONIC``, from the moment the calling thread
launched the region) and how many blocks it took. The copy multiplies arrays of its own, of the prefill's shapes,
right after the prefill has read its weight, always on the pool (the prefill itself runs on the calling thread
while NumPy's workers poll: ``kernels/_common/threads.py``). The stall benchmark's controls
(``stall_probe._controls``) run in the same rounds. Writes JSON: {"calls": [{"s": seconds, "threads": [[start_s,
end_s, cpu, blocks], ...]}, ...], "controls_s": {name: [seconds, ...]}, "pool": ...}.

    python benchmarks/prefill_trace.py --rounds 60 --out trace.json
"""
from __future__ import annotations

import argparse
import ctypes
import json

import numpy as np
from numba import njit, prange

from kernels._common.atomics import COUNTER_STRIDE, claim  # kernels before torch (kernels/_common/threads.py)
from kernels._common.blas import COLUMN_ALIGN, _block

_LIBC = ctypes.CDLL(None)
_clock_gettime = _LIBC.clock_gettime
_clock_gettime.argtypes, _clock_gettime.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_int
_sched_getcpu = _LIBC.sched_getcpu
_sched_getcpu.argtypes, _sched_getcpu.restype = [], ctypes.c_int
CLOCK_MONOTONIC = 1  # <linux/time.h>


@njit  # no cache: Numba caches no function that calls through ctypes pointers
def _now_ns(timespec):
    _clock_gettime(CLOCK_MONOTONIC, timespec.ctypes.data)
    return timespec[0] * 1_000_000_000 + timespec[1]


@njit(parallel=True)
def _traced_nt(a, b, out, n_blocks, counters, record):
    """``kernels._common.blas._batched_nt``'s column split for one matrix (out = a · bᵀ in n_blocks column blocks,
    claimed), with each thread's [start ns, end ns, CPU, blocks] in ``record``."""
    M, N = a.shape[0], b.shape[0]
    n_workers = counters.size // COUNTER_STRIDE
    for worker in prange(n_workers):
        timespec = np.empty(2, np.int64)
        record[worker, 0], record[worker, 2] = _now_ns(timespec), _sched_getcpu()
        blocks = 0
        task = claim(counters, 0, worker, n_workers, n_blocks)
        while task >= 0:
            _, c0, c1 = _block(task, N, n_blocks, COLUMN_ALIGN)
            if c0 < c1:
                part = np.empty((M, c1 - c0), dtype=out.dtype)
                np.dot(a, b[c0:c1].T, part)
                out[:, c0:c1] = part
            blocks += 1
            task = claim(counters, 0, worker, n_workers, n_blocks)
        record[worker, 1], record[worker, 3] = _now_ns(timespec), blocks


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import kernels
    from kernels._common import blas

    from stall_probe import _calls, _controls, _timed

    try:  # the benchmark's rounds have torch's calls where torch imports
        import torch  # noqa: F401
        use_torch = True
    except ImportError:
        use_torch = False

    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 576), dtype=np.float32)  # the stall benchmark's prefill: (256, 576) · (576, 1536)
    w = rng.standard_normal((1536, 576), dtype=np.float32)
    out = np.empty((256, 1536), dtype=np.float32)
    threads = kernels.pool_info()["threads"]
    n_blocks = blas.TASKS_PER_THREAD * threads  # as batched_matmul splits it (up to 96 column blocks of 16)
    timespec = np.empty(2, np.int64)
    traced = []

    def prefill_traced():
        counters = np.zeros(threads * COUNTER_STRIDE, dtype=np.int64)
        record = np.zeros((threads, 4), dtype=np.int64)
        with blas.single_threaded_blas():
            start = _now_ns(timespec)
            _traced_nt(x, w, out, n_blocks, counters, record)
            end = _now_ns(timespec)
        traced.append({"s": (end - start) / 1e9,
                       "threads": [[(r[0] - start) / 1e9, (r[1] - start) / 1e9, int(r[2]), int(r[3])]
                                   for r in record]})

    calls = {}
    for name, fn in _calls(rng, use_torch).items():
        calls[name] = fn
        if name.startswith("dense prefill"):
            calls["traced prefill"] = prefill_traced
    for fn in calls.values():  # compile and warm
        fn()
        fn()
    # the stall benchmark's controls, in the same rounds
    controls = _controls(calls["dense prefill 256×576→1536"], threads)
    calls.update(controls)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    if np.abs(out - ref).max() > 1e-4 * np.abs(ref).max():  # float32 sums of 576 products: ~1e-6 of the largest
        raise AssertionError("the traced product is wrong")
    traced.clear()
    samples = {name: [] for name in controls}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            took = _timed(fn)
            if name in samples:
                samples[name].append(took)
    with open(args.out, "w") as f:
        json.dump({"calls": traced, "controls_s": samples, "pool": kernels.pool_info()}, f)


if __name__ == "__main__":
    main()
