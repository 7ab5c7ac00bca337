"""Part 2, benchmarks: both GPU tiers beside torch's scaled_dot_product_attention (FlashAttention-2 backend), cuBLAS
fp16 and bitsandbytes' LLM.int8() when installed, each case its own row.

Timing: CUDA events around ``calls`` back-to-back calls (no host synchronization between them, so host overhead
does not count as kernel time), ``calls`` chosen from a warm-up so one timing spans about TARGET_TIMING_S; the
median of REPEATS such timings, divided by ``calls``. Inputs rotate through enough copies to exceed the L2 several
times, so no timed call reads its inputs from the cache.
"""
from __future__ import annotations

import math

import numpy as np

from ._rows import Case
from .plan import benchmark_case_s, numba_limit_s

COLUMNS = ["benchmark", "tier", "size", "median_s", "tflop_s", "gb_s", "calls_per_timing"]
L2_ROTATIONS = 4  # inputs rotate past 4 × the device's L2 (its l2CacheSize, read at run time)
TARGET_TIMING_S = 0.05  # one timing spans ~50 ms: far above the events' ~0.5 µs resolution (CUDA runtime docs)
REPEATS = 7
MAX_CALLS = 200


def time_calls(fn, sets, repeats=REPEATS):
    """(median seconds per call, calls per timing) of ``fn(*sets[i % len(sets)])`` over CUDA events."""
    import cupy

    fn(*sets[0])  # first call: compile, plan, allocate
    cupy.cuda.Device().synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for s in sets:
        fn(*s)
    stop.record()
    stop.synchronize()
    one = cupy.cuda.get_elapsed_time(start, stop) / 1e3 / len(sets)
    calls = int(min(MAX_CALLS, max(len(sets), math.ceil(TARGET_TIMING_S / max(one, 1e-7)))))
    times = []
    for _ in range(repeats):
        start.record()
        for i in range(calls):
            fn(*sets[i % len(sets)])
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3 / calls)
    return float(np.median(times)), calls


def _rotating(make, set_bytes):
    """Enough input sets (at least two) that together they exceed L2_ROTATIONS × the device's L2."""
    import cupy

    l2 = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["l2CacheSize"]
    return [make(i) for i in range(max(2, math.ceil(L2_ROTATIONS * l2 / max(set_bytes, 1))))]


def _result(seconds, calls, flops=None, nbytes=None):
    return {"median_s": f"{seconds:.6g}", "calls_per_timing": calls,
            "tflop_s": f"{flops / seconds / 1e12:.4g}" if flops else "",
            "gb_s": f"{nbytes / seconds / 1e9:.4g}" if nbytes else ""}


def _attention_sets(B, Hq, Hkv, Nq, Nk, d, dtype="float16"):
    import cupy

    nbytes = (B * Hq * Nq + 2 * B * Hkv * Nk) * d * np.dtype(dtype).itemsize
    rs = cupy.random.RandomState(0)
    draw = lambda h, n: rs.standard_normal((B, h, n, d), dtype=cupy.float32).astype(dtype)  # noqa: E731
    return _rotating(lambda i: (draw(Hq, Nq), draw(Hkv, Nk), draw(Hkv, Nk)), nbytes)


def attention_flops(B, Hq, Nq, Nk, d, causal):
    """4·Nq·Nk·d per head (FlashAttention-2 §4.1), the visible pairs only with the causal mask (bottom-right)."""
    # bottom-right causal mask: query row i sees i + Nk − Nq + 1 keys, clipped to [0, Nk]
    pairs = int(np.clip(np.arange(Nq) + Nk - Nq + 1, 0, Nk).sum()) if causal else Nq * Nk
    return 4 * B * Hq * pairs * d


def _attention(name, tier, B, Hq, Hkv, Nq, Nk, d, causal, algorithm="flash", dtype="float16"):
    flops = attention_flops(B, Hq, Nq, Nk, d, causal)
    kv_bytes = 2 * B * Hkv * Nk * d * np.dtype(dtype).itemsize  # K and V read once: the decode bound

    def run():
        import kernels

        sets = _attention_sets(B, Hq, Hkv, Nq, Nk, d, dtype)
        if tier == "torch SDPA (FlashAttention-2)":
            import torch
            from torch.nn.attention import SDPBackend, sdpa_kernel

            group = Hq // Hkv
            tsets = [tuple(torch.from_dlpack(x) for x in s) for s in sets]
            tsets = [(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)) for q, k, v in tsets]

            # torch's is_causal aligns the mask top-left; with one query row (decode) no mask is the same work as
            # our bottom-right mask, which lets it see every key
            top_left_ok = causal and Nq == Nk

            def call(q, k, v):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=top_left_ok)

            seconds, calls = time_calls(call, tsets)
        else:
            backend = "cupy" if tier.startswith("cupy") else "numba-cuda"
            seconds, calls = time_calls(
                lambda q, k, v: kernels.attention(q, k, v, causal=causal, algorithm=algorithm, backend=backend), sets)
        return _result(seconds, calls, flops, kv_bytes if Nq <= 16 else None)

    needs = {"torch SDPA (FlashAttention-2)": ("cupy", "torch"), "numba-cuda flash": ("cupy", "numba-cuda")}
    estimate = benchmark_case_s(flops, 2 + REPEATS * 20)
    return Case(name=f"{name} [{tier}]", size=f"B={B} Hq={Hq} Hkv={Hkv} Nq={Nq} Nk={Nk} d={d} {dtype}", run=run,
                needs=needs.get(tier, ("cupy",)), estimate_s=estimate,
                limit_s=numba_limit_s(estimate) if tier.startswith("numba") else None,
                columns={"benchmark": name, "tier": tier})


def _cublas_fp16(m):
    def run():
        import cupy

        rs = cupy.random.RandomState(1)
        sets = _rotating(lambda i: (rs.standard_normal((m, m), dtype=cupy.float32).astype(cupy.float16),), 2 * m * m)
        seconds, calls = time_calls(lambda a: cupy.matmul(a, a), sets)
        return _result(seconds, calls, 2 * m**3)

    return Case(name="matmul fp16 [cuBLAS]", size=f"{m}x{m}x{m}", run=run, needs=("cupy",),
                estimate_s=benchmark_case_s(2 * m**3, 2 + REPEATS * 50),
                columns={"benchmark": "matmul fp16", "tier": "cupy matmul (cuBLAS)"})


def _int8_inputs(m, n_outliers):
    rs = np.random.default_rng(2)
    x = rs.standard_normal((m, m)).astype(np.float32)  # (M, K)
    x[:, rs.choice(m, n_outliers, replace=False)] *= 20.0  # outlier features above the threshold 6
    w = (rs.standard_normal((m, m)) / np.sqrt(m)).astype(np.float32)  # (N, K): (out, in), as F.linear
    return x, w


def _int8_split(m, n_outliers, tier):
    def run():
        import cupy

        x, w = _int8_inputs(m, n_outliers)
        if tier.startswith("bitsandbytes"):
            import bitsandbytes as bnb
            import torch

            layer = bnb.nn.Linear8bitLt(m, m, bias=False, has_fp16_weights=False, threshold=6.0)
            layer.weight = bnb.nn.Int8Params(torch.from_numpy(w).half(), requires_grad=False,  # (out, in) as ours
                                             has_fp16_weights=False)
            layer = layer.cuda()
            xt = torch.from_numpy(x).half().cuda()
            seconds, calls = time_calls(lambda xx: layer(xx), [(xt,), (xt.clone(),)])
        else:
            from kernels.int8 import _cupy as tier2  # a device-resident quantized weight has no public entry point

            w_i8, absmax_w = tier2.quantize_weight(cupy.asarray(w))
            x_dev = cupy.asarray(x)
            seconds, calls = time_calls(lambda xx: tier2.split_matmul(xx, w_i8, absmax_w, 6.0),
                                        [(x_dev,), (x_dev.copy(),)])
        return _result(seconds, calls, 2 * m**3)

    return Case(name=f"int8 split matmul [{tier}]", size=f"{m}x{m}x{m}, {n_outliers} outlier dims", run=run,
                needs=("cupy", "torch", "bitsandbytes") if tier.startswith("bitsandbytes") else ("cupy",),
                estimate_s=benchmark_case_s(2 * m**3, 2 + REPEATS * 50),
                columns={"benchmark": "int8 split matmul", "tier": tier})


def _snapkv_selection(Hq, Hkv, N, d, capacity, window=32):
    def run():
        import cupy

        from kernels import kvprune

        rs = cupy.random.RandomState(3)
        draw = lambda h: rs.standard_normal((1, h, N, d), dtype=cupy.float32).astype(cupy.float16)  # noqa: E731
        q, k, v = draw(Hq), draw(Hkv), draw(Hkv)
        seconds, calls = time_calls(
            lambda: kvprune.snapkv_compress(q, k, v, capacity=capacity, window=window, backend="cupy"), [()])
        return _result(seconds, calls)

    return Case(name="SnapKV selection [cupy]", size=f"Hq={Hq} Hkv={Hkv} N={N} d={d} capacity={capacity} fp16",
                run=run, needs=("cupy",), estimate_s=benchmark_case_s(4 * Hq * window * N * d, 2 + REPEATS * 20),
                columns={"benchmark": "SnapKV selection (compare: prefill attention, same heads)",
                         "tier": "cupy"})


def _snapkv_votes(Hq, Hkv, N, d, votes_by, window=32):
    def run():
        import cupy

        from kernels.kvprune import _cupy as tier2  # the choice of votes has no public entry point yet

        rs = cupy.random.RandomState(4)
        qw = rs.standard_normal((1, Hq, window, d), dtype=cupy.float32)  # (1, Hq, w, d)
        k = rs.standard_normal((1, Hkv, N, d), dtype=cupy.float32)  # (1, Hkv, N, d)
        seconds, calls = time_calls(lambda: tier2.snapkv_scores(qw, k, 7, "max", "mean", votes_by=votes_by), [()])
        return _result(seconds, calls, 2 * Hq * window * N * d)  # S = Q_w Kᵀ once (the fused kernel: 3 times)

    return Case(name=f"SnapKV window scores [votes by {votes_by}]", size=f"Hq={Hq} Hkv={Hkv} N={N} d={d} fp32",
                run=run, needs=("cupy",), estimate_s=benchmark_case_s(6 * Hq * window * N * d, 2 + REPEATS * 20),
                columns={"benchmark": "SnapKV window scores", "tier": f"cupy, votes by {votes_by}"})


def cases(quick: bool) -> list[Case]:
    B, H, N, d = (1, 8, 2048, 128) if quick else (4, 16, 8192, 128)
    n_long = 8192 if quick else 32768
    m = 1024 if quick else 4096
    flash, sdpa = "cupy flash (tensor cores)", "torch SDPA (FlashAttention-2)"
    out = []
    for causal in (False, True):
        name = f"attention{' causal' if causal else ''}"
        out += [_attention(name, flash, B, H, H, N, N, d, causal), _attention(name, sdpa, B, H, H, N, N, d, causal)]
    out += [_attention("decode (1 query, GQA)", flash, 8, 32, 8, 1, n_long, d, True),
            _attention("decode (1 query, GQA)", sdpa, 8, 32, 8, 1, n_long, d, True),
            _attention("standard vs flash", "cupy standard (cuBLAS + softmax kernel)", 1, max(1, H // 4),
                       max(1, H // 4), N, N, d, False, algorithm="standard"),
            _attention("standard vs flash", flash, 1, max(1, H // 4), max(1, H // 4), N, N, d, False),
            _attention("Numba-CUDA tier size", "numba-cuda flash", 1, 8, 8, N // 8, N // 8, d, False,
                       dtype="float32"),
            _attention("Numba-CUDA tier size", flash, 1, 8, 8, N // 8, N // 8, d, False),
            _cublas_fp16(m),
            _int8_split(m, m // 100, "cupy (mma.sync s8 + fp16 outliers)"),
            _int8_split(m, m // 100, "bitsandbytes Linear8bitLt"),
            _snapkv_selection(32, 8, n_long, d, n_long // 8),
            _snapkv_votes(32, 8, n_long, d, "kernel"),
            _snapkv_votes(32, 8, n_long, d, "gemm"),
            _attention("prefill attention (SnapKV's comparison)", flash, 1, 32, 8, n_long, n_long, d, True)]
    return out
