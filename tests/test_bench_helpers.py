"""The benchmarks' own logic that a benchmark run could not show wrong: the percentile and the causes of the
traced prefill's slow calls (``benchmarks/helpers.py``), on made-up samples and traces."""
from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_helpers", Path(__file__).resolve().parents[1] / "benchmarks" / "helpers.py")
bench_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_helpers)


def test_p90_is_the_nearest_rank_of_the_sorted_samples(rng):
    samples = rng.permutation(30).tolist()  # 0 .. 29 in some order
    assert bench_helpers.p90(samples) == 26  # the 27th smallest: index int(0.9 · 29)


def _call(seconds, *threads):
    """A traced call: its seconds and, per thread, (start s, end s, CPU, blocks)."""
    return {"s": seconds, "caller_cpu": threads[0][2], "threads": [list(t) for t in threads]}


def test_slow_calls_are_told_apart_by_where_their_threads_ran():
    usual = [_call(0.003, (20e-6, 0.003, 0, 4), (40e-6, 0.003, 1, 4)) for _ in range(20)]  # 0.75 ms a block
    one_cpu = _call(0.006, (20e-6, 0.006, 1, 6), (3e-3, 0.006, 1, 2))  # both on CPU 1: one waited
    late = _call(0.005, (20e-6, 0.005, 0, 6), (2e-3, 0.005, 1, 2))  # CPU 1 ran its thread 2 ms late
    slower = _call(0.005, (20e-6, 0.005, 0, 4), (40e-6, 0.005, 1, 4))  # on time, 1.25 ms a block
    idle_thread = _call(0.006, (20e-6, 0.006, 0, 8), (5.9e-3, 0.006, 1, 0))  # late, and took no block
    median, causes, ratio = bench_helpers.slow_call_causes(usual + [one_cpu, late, slower, idle_thread], 1.5)
    assert median == 0.003
    assert causes == {"one_cpu": 1, "late_start": 2, "all_slower": 1}
    # the "all slower" call's block time (the median over its threads of (end − start) / blocks) over the usual
    assert ratio == pytest.approx(median_of((0.005 - 20e-6) / 4, (0.005 - 40e-6) / 4)
                                  / median_of((0.003 - 20e-6) / 4, (0.003 - 40e-6) / 4))


def median_of(*xs):
    return statistics.median(xs)


def test_no_slow_call_gives_no_ratio():
    calls = [_call(0.003, (20e-6, 0.003, 0, 4), (40e-6, 0.003, 1, 4)) for _ in range(10)]
    median, causes, ratio = bench_helpers.slow_call_causes(calls, 1.5)
    assert sum(causes.values()) == 0 and ratio != ratio  # NaN: nothing to compare


def test_a_sample_is_beside_numpys_workers_where_they_used_half_a_core_of_it():
    samples = {"call": [0.010, 0.010, 0.004, 0.002]}
    pool_cpu_s = {"call": [0.010, 0.0049, 0.002, 0.0]}  # spinning throughout; just under half; exactly half; idle
    beside, apart = bench_helpers.split_by_numpy_pool(samples, pool_cpu_s)
    assert beside == {"call": [0.010, 0.004]} and apart == {"call": [0.010, 0.002]}


def test_samples_and_cpu_times_must_pair_up():
    with pytest.raises(ValueError):
        bench_helpers.split_by_numpy_pool({"call": [0.01, 0.01]}, {"call": [0.0]})
