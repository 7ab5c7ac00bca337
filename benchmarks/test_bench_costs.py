"""The cost model over a sweep of 10⁵ configurations (NumPy arrays as sizes) must take about a second or less."""
from __future__ import annotations

import numpy as np

from simulator import costs, hardware

N_CONFIGS = 100_000


def _sweep():
    rng = np.random.default_rng(0)
    n = rng.integers(128, 65536, N_CONFIGS)
    d = rng.choice([64, 128], N_CONFIGS)
    sram = rng.choice([64, 100, 164, 228], N_CONFIGS) * 1024
    causal = rng.integers(0, 2, N_CONFIGS).astype(bool)
    hw = hardware.load("H100-SXM")
    out = {}
    for name, fn in (("standard", costs.standard_forward), ("flash1", costs.flash1_forward),
                     ("flash2", costs.flash2_forward)):
        cost = fn(1, 16, 4, n, n, d, causal=causal, sram_bytes=sram)
        out[name] = (cost.hbm_bytes, cost.time(hw).seconds)
    return out


def test_sweep_of_1e5_configurations(benchmark, record):
    result = benchmark.pedantic(_sweep, rounds=3, warmup_rounds=1)
    assert all(np.all(bytes_ > 0) and np.all(seconds > 0) for bytes_, seconds in result.values())
    t = benchmark.stats.stats.median
    record({"bench": "cost-sweep", "configs": N_CONFIGS, "algorithms": 3, "median_s": f"{t:.3f}",
            "configs_per_s": f"{3 * N_CONFIGS / t:.3g}"})
