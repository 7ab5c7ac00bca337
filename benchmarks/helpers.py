"""Helpers the benchmarks share: percentiles, rates held to a read taken beside them, and timing peers in fresh
processes."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PEER_PROBE = Path(__file__).with_name("peer_probe.py")


def in_turn(items, round_index):
    """``items`` in their order in even rounds and reversed in odd ones: peers measured in turn meet the machine's
    phases alike, none always first."""
    return tuple(items) if round_index % 2 == 0 else tuple(items)[::-1]


def p90(samples):
    """The nearest-rank 90th percentile (of 30 samples: the 27th smallest)."""
    ordered = sorted(samples)
    return ordered[int(0.9 * (len(ordered) - 1))]


def beside_reads(run, read_buffer, rounds, also=None):
    """``rounds`` of ``run()`` (a rate), each followed by the all-core read bandwidth (bytes/s) of ``read_buffer``
    (``simulator.calibrate.read_bandwidth_of``) and, with ``also``, by ``also()``: the three lists. A VM's memory
    speed moves within minutes, so each rate is held to the read of its own moment."""
    from simulator.calibrate import read_bandwidth_of

    rates, reads, others = [], [], []
    for _ in range(rounds):
        rates.append(run())
        reads.append(read_bandwidth_of(read_buffer))
        if also is not None:
            others.append(also())
    return rates, reads, others


def sustained_read(read_buffer, n_bytes):
    """Bytes/s of reading ``read_buffer`` on all cores pass after pass until about ``n_bytes`` are read
    (``simulator.calibrate.read_once``): the read over a window as long as the workload it is set against. The
    best of five single passes (``read_bandwidth_of``, ~10 ms each) catches a shared host's bursts: on the 2-vCPU
    AMD EPYC (KVM), beside 20 SmolLM2 decode rounds of ~250 ms, the best single pass ranged 24-38 GB/s and the
    ~250 ms read 23-34."""
    from simulator.calibrate import read_once

    passes = max(1, round(n_bytes / read_buffer.nbytes))
    start = time.perf_counter()
    for _ in range(passes):
        read_once(read_buffer)
    return passes * read_buffer.nbytes / (time.perf_counter() - start)


BESIDE_NUMPY = 0.5  # a call ran beside NumPy's spinning BLAS workers where they used at least this share of one core
# over its wall time (OpenBLAS's workers poll for 2^28 cycles, ~0.1 s, after each of NumPy's multithreaded calls:
# THREAD_TIMEOUT, its Makefile.rule; read from OPENBLAS_THREAD_TIMEOUT when NumPy loads)


def split_by_numpy_pool(samples, pool_cpu_s):
    """({call: samples beside NumPy's BLAS workers}, {call: the others}) for {call: [seconds]} and the CPU seconds
    those workers used during each sample, {call: [seconds]} (``stall_probe.NUMPY_POOL``)."""
    beside, apart = {}, {}
    for name, xs in samples.items():
        beside[name] = [x for x, cpu in zip(xs, pool_cpu_s[name], strict=True) if cpu >= BESIDE_NUMPY * x]
        apart[name] = [x for x, cpu in zip(xs, pool_cpu_s[name], strict=True) if cpu < BESIDE_NUMPY * x]
    return beside, apart


def slow_call_causes(calls, slow_over_median):
    """The slow calls of a traced prefill (``prefill_trace.py``: longer than ``slow_over_median`` × the median) by where
    they lost the time: ``one_cpu`` (two of its threads started on the same CPU: one waited for the other),
    ``late_start`` (on CPUs of their own, a thread started more than a quarter of the median call after the launch:
    its CPU was not running it), ``all_slower`` (every thread started on time on its own CPU, and the blocks took
    longer). Returns (median seconds, {cause: count}, the median block time of the ``all_slower`` calls over that
    of the calls that were not slow: how much slower each block ran)."""
    median = statistics.median(c["s"] for c in calls)
    causes = {"one_cpu": 0, "late_start": 0, "all_slower": 0}

    def block_time(call):  # seconds per block, over the threads that took one
        return statistics.median((end - start) / blocks for start, end, _, blocks in call["threads"] if blocks)

    slower = []
    for call in (c for c in calls if c["s"] > slow_over_median * median):
        cpus = [cpu for _, _, cpu, _ in call["threads"]]
        if len(set(cpus)) < len(cpus):
            causes["one_cpu"] += 1
        elif max(start for start, *_ in call["threads"]) > median / 4:
            causes["late_start"] += 1
        else:
            causes["all_slower"] += 1
            slower.append(call)
    usual = statistics.median(block_time(c) for c in calls if c["s"] <= slow_over_median * median)
    ratio = statistics.median(block_time(c) for c in slower) / usual if slower else float("nan")
    return median, causes, ratio


def alternate_in_fresh_processes(workloads, *, pairs=3, repeats=5):
    """Median seconds of each workload, each timed in ``pairs`` fresh processes taken in turn (A B A B ...), so
    that no thread pool of one peer taxes the other and slow drifts of the machine hit both alike.

    ``workloads``: name -> argument list of ``peer_probe.py``. Returns name -> (median_s, all samples, check).
    """
    samples = {name: [] for name in workloads}
    checks = {}
    # this checkout's packages first (a script's own folder heads its path; an installed copy may be another's)
    root = str(PEER_PROBE.parent.parent)
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for _ in range(pairs):
        for name, args in workloads.items():
            done = subprocess.run([sys.executable, str(PEER_PROBE), *args, "--repeats", str(repeats)],
                                  check=True, capture_output=True, text=True, timeout=600, env=env,
                                  cwd=PEER_PROBE.parent.parent)
            result = json.loads(done.stdout)
            samples[name] += result["samples_s"]
            checks[name] = result["check"]
    return {name: (statistics.median(xs), xs, checks[name]) for name, xs in samples.items()}
