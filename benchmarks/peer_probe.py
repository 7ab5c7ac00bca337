"""Time one workload in a fresh process, for peer comparisons that must not share thread pools (torch's OpenMP,
NumPy's OpenBLAS and Numba's pool each spin or sleep in their own way; in one process the one that ran last taxes
the next). Prints JSON: {"samples_s": [...], "check": max abs error against float64}.

    python benchmarks/peer_probe.py WORKLOAD --shape 1,8,4096,64 [--causal] [--repeats 7]

Workloads: flash, standard, torch-sdpa (attention on (B, H, N, d)); int8-linear, numpy-linear,
torch-int8-dynamic (x (M, K) · W (K, N) on --shape M,K,N).
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from simulator.measure import time_call


def _attention(name, shape, causal, rng):
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    if name == "torch-sdpa":
        import torch

        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))

        def fn():
            with torch.no_grad():
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal).numpy()
    else:
        import kernels

        def fn():
            return kernels.attention(q, k, v, causal=causal, algorithm=name)
    from kernels.attn import reference

    rows = slice(-16, None)  # the last rows see the most keys (bottom-right alignment)
    check = float(np.abs(fn()[:, :, rows] - reference(q[:, :, rows], k, v, causal=causal)).max())
    return fn, check


def _linear(name, shape, rng):
    m, k, n = shape
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, rng.choice(k, 4, replace=False)] *= 25  # a few outlier features, as in real activations
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)  # (N, K) = (out, in): x · Wᵀ, as F.linear
    if name == "int8-linear":
        from kernels.int8 import Int8Linear

        fn = Int8Linear.from_float(w).__call__
        call = lambda: fn(x)  # noqa: E731
    elif name == "numpy-linear":
        call = lambda: x @ w.T  # noqa: E731
    else:
        import torch

        linear = torch.nn.Linear(k, n, bias=False)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(w))
        quantized = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear},
                                                           dtype=torch.qint8)
        tx = torch.from_numpy(x)

        def call():
            with torch.no_grad():
                return quantized(tx).numpy()
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    check = float(np.abs(call() - exact).mean() / np.abs(exact).mean())  # mean relative error
    return call, check


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload")
    parser.add_argument("--shape", required=True, type=lambda s: tuple(int(x) for x in s.split(",")))
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(sum(args.shape))
    if args.workload in ("flash", "standard", "torch-sdpa"):
        fn, check = _attention(args.workload, args.shape, args.causal, rng)
    else:
        fn, check = _linear(args.workload, args.shape, rng)
    # as every measurement of the project (simulator.measure.time_call): the setup's own NumPy products above (the
    # exact result, the quantization) leave NumPy's OpenBLAS workers spinning for ~0.1 s, which the timed calls
    # would share the cores with (on a 2-vCPU Intel Xeon, Int8Linear's GEMV at 8192² took a median of 2.5 ms here
    # against 1.5 ms in the benchmark's own process); so a pause until they sleep, a warm-up, then the calls
    samples = time_call(fn, repeats=args.repeats, warmup=1).samples_s
    json.dump({"samples_s": list(samples), "check": check}, sys.stdout)


if __name__ == "__main__":
    main()
