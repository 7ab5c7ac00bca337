"""Attention on the CPU: flash vs standard, flash vs torch SDPA (fresh processes, alternating), memory at long N,
and decode bandwidth.

GFLOP/s = 4·N²·d·H / t (half with a causal mask; FlashAttention-2 §4.1), reported with its fraction of this
machine's sgemm GFLOP/s measured in the same run. Decode GB/s = bytes of K and V / t, beside the read bandwidth.
"""
from __future__ import annotations

import itertools
import math
import tracemalloc

import numpy as np
import pytest

import kernels
from kernels.cpuinfo import cache_sizes
from kernels.attn import reference
from simulator.report import attention_flops

from helpers import alternate_in_fresh_processes, p90

SIZES = (512, 1024, 2048, 4096, 8192)
HEADS, D = 8, 64
CHECK_ROWS = 16  # the oracle checks the last rows only (with bottom-right alignment they see the most keys)


def _impl(name):
    if name == "flash":
        return lambda q, k, v, causal: kernels.attention(q, k, v, causal=causal)
    return lambda q, k, v, causal: kernels.attention(q, k, v, causal=causal, algorithm="standard")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("impl", ["flash", "standard"])
def test_attention_throughput(benchmark, machine_peaks, record, impl, n, causal):
    fn = _impl(impl)
    rng = np.random.default_rng(n)
    q, k, v = (rng.standard_normal((1, HEADS, n, D), dtype=np.float32) for _ in range(3))
    # correctness first: the last rows against the float64 oracle
    out = fn(q, k, v, causal)
    ref = reference(q[:, :, -CHECK_ROWS:], k, v, causal=causal)
    np.testing.assert_allclose(out[:, :, -CHECK_ROWS:], ref, atol=1e-5, rtol=1e-4)
    rounds = 5 if n >= 4096 else 9
    benchmark.pedantic(fn, args=(q, k, v, causal), rounds=rounds, warmup_rounds=1)
    t = benchmark.stats.stats.median
    gflops = attention_flops(n, D, HEADS, causal) / t / 1e9
    benchmark.extra_info.update(gflops=gflops, fraction_of_sgemm=gflops / machine_peaks["sgemm_gflops"])
    record({"bench": "attention", "impl": impl, "N": n, "causal": causal, "median_s": f"{t:.4g}",
            "GFLOP/s": f"{gflops:.1f}", "of_sgemm": f"{gflops / machine_peaks['sgemm_gflops']:.2f}",
            "sgemm_GFLOP/s": f"{machine_peaks['sgemm_gflops']:.1f}"})


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n", SIZES)
def test_flash_against_torch_sdpa(benchmark, machine_peaks, record, n, causal):
    pytest.importorskip("torch", reason="torch is not importable: install a CPU build (here "
                        "`pip install torch==2.13.0`) to compare")
    args = ["--shape", f"1,{HEADS},{n},{D}"] + (["--causal"] if causal else [])
    timings = benchmark.pedantic(alternate_in_fresh_processes, args=(
        {"flash": ["flash", *args], "torch-sdpa": ["torch-sdpa", *args]},), rounds=1, iterations=1)
    row = {"bench": "attention-vs-sdpa", "N": n, "causal": causal}
    for name, (median, samples, max_error) in timings.items():
        assert max_error < 1e-4, f"{name} disagrees with the float64 oracle by {max_error:.3g}"
        gflops = attention_flops(n, D, HEADS, causal) / median / 1e9
        row.update({f"{name}_median_s": f"{median:.4g}", f"{name}_p90_s": f"{p90(samples):.4g}",
                    f"{name}_GFLOP/s": f"{gflops:.1f}"})
    row["flash_speedup"] = f"{timings['torch-sdpa'][0] / timings['flash'][0]:.2f}"
    record(row)


def test_flash_memory_at_long_n(benchmark, record):
    # N = 32768, H = 1, d = 64: standard would need S of N² float32 = 4 GiB (and as much again for P)
    n, d = 32768, 64
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 1, n, d), dtype=np.float32) for _ in range(3))
    kernels.attention(q, k, v, causal=True)  # compile and warm outside the trace
    tracemalloc.start()
    out = kernels.attention(q, k, v, causal=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    extra = peak - out.nbytes  # beyond the inputs (allocated before) and the output
    ref = reference(q[:, :, -CHECK_ROWS:], k, v, causal=True)
    np.testing.assert_allclose(out[:, :, -CHECK_ROWS:], ref, atol=1e-5, rtol=1e-4)
    benchmark.pedantic(kernels.attention, args=(q, k, v), kwargs={"causal": True}, rounds=3, warmup_rounds=0)
    benchmark.extra_info.update(peak_bytes=peak, extra_bytes=extra)
    s_bytes = n * n * 4
    record({"bench": "flash-memory", "N": n, "H": 1, "d": d, "peak_MiB": f"{peak / 2**20:.2f}",
            "output_MiB": f"{out.nbytes / 2**20:.2f}", "extra_MiB": f"{extra / 2**20:.2f}",
            "inputs_MiB": f"{3 * q.nbytes / 2**20:.1f}", "standard_S_MiB": f"{s_bytes / 2**20:.0f}",
            "median_s": f"{benchmark.stats.stats.median:.3f}"})
    assert extra < 2 * out.nbytes, "flash's extra memory grew beyond O(N·d)"


@pytest.mark.parametrize("cache_state", ["hot", "cold"])
def test_decode_bandwidth(benchmark, machine_peaks, record, cache_state):
    # one new token against a 16k cache: Hq = 9 query heads over Hkv = 3 kv heads (SmolLM2's layout). "hot" reads
    # the same K/V every call (25 MB, may stay in the last-level cache); "cold" cycles through enough caches to
    # exceed the last-level cache 4 times, so K and V come from DRAM
    nk, hq, hkv, d = 16384, 9, 3, 64
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, hq, 1, d), dtype=np.float32)
    kv_bytes = 2 * hkv * nk * d * 4
    n_caches = 1 if cache_state == "hot" else max(2, math.ceil(4 * cache_sizes().get("L3", 32 * 2**20) / kv_bytes))
    caches = [tuple(rng.standard_normal((1, hkv, nk, d), dtype=np.float32) for _ in range(2))
              for _ in range(n_caches)]
    k, v = caches[0]
    np.testing.assert_allclose(kernels.attention(q, k, v, causal=True), reference(q, k, v, causal=True),
                               atol=1e-5, rtol=1e-4)
    turn = itertools.cycle(caches)

    def step():
        k, v = next(turn)
        return kernels.attention(q, k, v, causal=True)

    benchmark.pedantic(step, rounds=60, warmup_rounds=n_caches + 2)
    t = benchmark.stats.stats.median
    gbps = kv_bytes / t / 1e9
    benchmark.extra_info.update(kv_gbps=gbps, read_gbps=machine_peaks["read_gbps"])
    record({"bench": f"decode-{cache_state}", "Nk": nk, "Hq": hq, "Hkv": hkv, "d": d, "caches": n_caches,
            "median_us": f"{t * 1e6:.1f}", "KV_MB": f"{kv_bytes / 1e6:.1f}", "KV_GB/s": f"{gbps:.1f}",
            "read_GB/s": f"{machine_peaks['read_gbps']:.1f}", "ratio": f"{gbps / machine_peaks['read_gbps']:.2f}"})
