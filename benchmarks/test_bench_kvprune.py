"""SnapKV: a decode step over the full vs the pruned cache (speedup against the predicted bytes ratio), and the
cost of the selection against the prefill attention it follows."""
from __future__ import annotations

import itertools
import math

import numpy as np

import kernels
from kernels.cpuinfo import cache_sizes
from kernels.attn import reference
from kernels.kvprune import snapkv_compress
from simulator import costs
from simulator.measure import time_call

HQ, HKV, D = 9, 3, 64


def _caches(rng, n, count):
    return [tuple(rng.standard_normal((1, HKV, n, D), dtype=np.float32) for _ in range(2)) for _ in range(count)]


def test_decode_full_vs_pruned(benchmark, record):
    # a model's layers each have their own cache, far beyond the last-level cache: both sides cycle through
    # enough caches to exceed it 4 times, so K and V come from DRAM as they would in a real decode step
    n, capacity = 16384, 1024
    llc = cache_sizes().get("L3", 32 * 2**20)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, HQ, n, D), dtype=np.float32)
    k, v = (rng.standard_normal((1, HKV, n, D), dtype=np.float32) for _ in range(2))
    k_c, v_c, kept = snapkv_compress(q, k, v, capacity=capacity)
    q_new = rng.standard_normal((1, HQ, 1, D), dtype=np.float32)
    np.testing.assert_allclose(
        kernels.attention(q_new, k_c, v_c, causal=True),
        reference(q_new, np.take_along_axis(k, kept[..., None], 2), np.take_along_axis(v, kept[..., None], 2),
                  causal=True), atol=1e-5, rtol=1e-4)
    full_caches = [(k, v)] + _caches(rng, n, max(1, math.ceil(4 * llc / (2 * k.nbytes))) - 1)
    pruned_caches = [(k_c, v_c)] + _caches(rng, capacity, math.ceil(4 * llc / (2 * k_c.nbytes)) - 1)
    full_turn, pruned_turn = itertools.cycle(full_caches), itertools.cycle(pruned_caches)

    def full():
        return kernels.attention(q_new, *next(full_turn), causal=True)

    def pruned():
        return kernels.attention(q_new, *next(pruned_turn), causal=True)

    t_full = time_call(full, repeats=60, warmup=len(full_caches)).median_s
    benchmark.pedantic(pruned, rounds=400, warmup_rounds=len(pruned_caches))
    t_pruned = benchmark.stats.stats.median
    predicted = float(costs.decode(1, HQ, HKV, n, D, elem_bytes=4, Bc=256).hbm_bytes
                      / costs.decode(1, HQ, HKV, n, D, elem_bytes=4, capacity=capacity, Bc=256).hbm_bytes)
    measured = t_full / t_pruned
    record({"bench": "snapkv-decode", "N": n, "capacity": capacity, "full_us": f"{t_full * 1e6:.1f}",
            "pruned_us": f"{t_pruned * 1e6:.1f}", "measured_speedup": f"{measured:.2f}",
            "predicted_bytes_ratio": f"{predicted:.2f}", "of_predicted": f"{measured / predicted:.2f}"})


def test_selection_overhead_vs_prefill(benchmark, record):
    n = 8192
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, HQ, n, D), dtype=np.float32)
    k, v = (rng.standard_normal((1, HKV, n, D), dtype=np.float32) for _ in range(2))
    t_prefill = time_call(lambda: kernels.attention(q, k, v, causal=True), repeats=3).median_s
    benchmark.pedantic(snapkv_compress, args=(q, k, v), kwargs={"capacity": 1024}, rounds=10, warmup_rounds=2)
    t_select = benchmark.stats.stats.median
    record({"bench": "snapkv-selection", "N": n, "prefill_attention_s": f"{t_prefill:.3f}",
            "selection_s": f"{t_select:.4f}", "fraction": f"{t_select / t_prefill:.3f}"})
