"""What the look at held cores costs (``kernels._common.threads._cores_held``, before every call that is not small).

Two reads (Linux): the machine's count of runnable threads in /proc/loadavg (``affinity.runnable_threads``), and,
only where that count leaves enough of them, each thread's state under /proc/self/task (``affinity.cores_held``),
whose cost grows with the process's threads. Timed here with 0, 16 and 128 more threads in the process, each asleep
on an event as an idle pool's thread is: per look and per thread of the process.

    python -m pytest benchmarks/test_bench_threads.py --benchmark-only
"""
from __future__ import annotations

import os
import sys
import threading

import pytest

from kernels._common import affinity
from kernels.cpuinfo import cpu_model

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not affinity.SUPPORTED,
                                reason="the look reads Linux's /proc; elsewhere it answers at once (unknown)")


@pytest.fixture
def sleeping_threads(request):
    """``request.param`` more threads in this process, asleep until the test ends."""
    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait, daemon=True) for _ in range(request.param)]
    for thread in threads:
        thread.start()
    yield request.param
    stop.set()
    for thread in threads:
        thread.join()


@pytest.mark.parametrize("sleeping_threads", [0, 16, 128], indirect=True)
def test_the_look_at_each_thread(benchmark, record, sleeping_threads):
    if affinity.cores_held() is None:
        pytest.skip("Numba's pool has fewer than 2 threads here, or its workers' ids are unknown: no look is made")
    benchmark(affinity.cores_held)
    threads = len(os.listdir("/proc/self/task"))
    median_us = benchmark.stats.stats.median * 1e6
    record({"bench": "look-each-thread", "threads_in_process": threads, "median_us": f"{median_us:.1f}",
            "us_per_thread": f"{median_us / threads:.2f}", "cpu": f"{cpu_model()} x{os.cpu_count()}"})


def test_the_machine_count_of_runnable_threads(benchmark, record):
    if affinity.runnable_threads() is None:
        pytest.skip("/proc/loadavg cannot be read here")
    benchmark(affinity.runnable_threads)
    record({"bench": "look-loadavg", "median_us": f"{benchmark.stats.stats.median * 1e6:.1f}",
            "cpu": f"{cpu_model()} x{os.cpu_count()}"})
