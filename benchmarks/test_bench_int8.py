"""LLM.int8() on the CPU: the decode GEMV (memory-bound: 4x fewer bytes) and a prefill-sized GEMM, against NumPy's
float32 BLAS and, when torch is importable, torch's dynamically quantized int8 Linear.

GB/s = weight bytes / t (the weights dominate a GEMV's traffic); GOP/s = 2·M·K·N / t.
"""
from __future__ import annotations

import numpy as np
import pytest

from kernels.int8 import Int8Linear, int8_matmul_reference

GEMV = (1, 8192, 8192)  # 64 MiB of int8 weights, 256 MiB of float32: far above the 32 MiB last-level cache
GEMM = (512, 4096, 4096)


def _inputs(m, k, n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, rng.choice(k, 4, replace=False)] *= 25  # a few outlier features, as in real activations
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)  # (out, in), as torch's Linear.weight
    return x, w


def _torch_int8(w):
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not importable: install a CPU build (here `pip install torch==2.13.0`) to compare")
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(w))
    quantized = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear},
                                                       dtype=torch.qint8)

    def run(x):
        with torch.no_grad():
            return quantized(torch.from_numpy(x)).numpy()

    return run


@pytest.mark.parametrize("shape_name", ["gemv", "gemm"])
@pytest.mark.parametrize("impl", ["int8", "numpy-float32", "torch-int8-dynamic"])
def test_int8_linear(benchmark, machine_peaks, record, impl, shape_name):
    m, k, n = GEMV if shape_name == "gemv" else GEMM
    x, w = _inputs(m, k, n, seed=k + m)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    if impl == "int8":
        layer = Int8Linear.from_float(w)
        fn, weight_bytes = layer, layer.weight.nbytes
        if m == 1:  # correctness first (the oracle is slow at GEMM size; the tests cover it)
            np.testing.assert_allclose(fn(x), int8_matmul_reference(x, w), rtol=1e-4, atol=1e-3)
    elif impl == "numpy-float32":
        fn, weight_bytes = (lambda a: a @ w.T), w.nbytes
    else:
        fn, weight_bytes = _torch_int8(w), k * n  # int8 weights
    rel_err = float(np.abs(fn(x) - exact).mean() / np.abs(exact).mean())
    if impl != "torch-int8-dynamic":  # torch quantizes activations per tensor: outliers cost it accuracy
        assert rel_err < 0.05
    rounds = 30 if m == 1 else 5
    benchmark.pedantic(fn, args=(x,), rounds=rounds, warmup_rounds=3)
    t = benchmark.stats.stats.median
    record({"bench": f"int8-{shape_name}", "impl": impl, "M": m, "K": k, "N": n, "median_ms": f"{t * 1e3:.3f}",
            "weight_MiB": f"{weight_bytes / 2**20:.1f}", "weight_GB/s": f"{weight_bytes / t / 1e9:.1f}",
            "GOP/s": f"{2 * m * k * n / t / 1e9:.1f}", "copy_GB/s": f"{machine_peaks['copy_gbps']:.1f}",
            "mean_rel_err": f"{rel_err:.2e}"})
