"""Part 1, correctness at real sizes: both GPU tiers against the float64 oracles, each case its own row.

Attention: float32 by the tolerance table, float16/bfloat16 by flash-attn's rule (``kernels.attn.within_tolerance``,
the table the tests use), on awkward shapes (N not a multiple of the 64-row tiles, GQA, Nq != Nk, rows that see
no key, decode against a long cache: the split-KV path, and more than 65535 batch × heads: the grid's x axis). int8:
the GPU tiers against the CPU tier (integer parts exact, so y agrees to float32 rounding) and the int32 GEMM
exactly, M above 65535 included. SnapKV: the kept positions exactly against the oracle.

bfloat16 attention and the int32 product of the GEMM have no public entry point (``kernels.attention`` takes NumPy
dtypes; ``int8_matmul`` returns the dequantized y), so those two cases call the CUDA C launchers directly.
"""
from __future__ import annotations

import math

import numpy as np

from ._rows import Case
from .plan import attention_case_s, int8_case_s, numba_limit_s, snapkv_case_s

COLUMNS = ["tier", "kernel", "dtype", "size", "max_abs_error", "bound"]
SEED = 1


def _attention(tier, algorithm, dtype, B, Hq, Hkv, Nq, Nk, d, causal, n_splits=None):
    """A case of attention; ``n_splits`` forces the CUDA C kernel's key splits (1: the unsplit path), which the
    launcher otherwise picks from the device's size."""

    def run():
        import cupy

        import kernels
        from kernels.attn import plain_attention, reference, round_to, within_tolerance

        rng = np.random.default_rng([SEED, B, Hq, Nq, Nk, d])
        host = np.float32 if dtype == "bfloat16" else np.dtype(dtype)
        q = rng.standard_normal((B, Hq, Nq, d)).astype(host)  # (B, Hq, Nq, d)
        k = rng.standard_normal((B, Hkv, Nk, d)).astype(host)  # (B, Hkv, Nk, d)
        v = rng.standard_normal((B, Hkv, Nk, d)).astype(host)  # (B, Hkv, Nk, d)
        if dtype == "bfloat16":  # the oracle sees the same rounded inputs; no public bfloat16 entry point
            from kernels.attn import _cupy as tier2

            q, k, v = (round_to(x, "bfloat16") for x in (q, k, v))
            bits = [tier2.to_bfloat16_bits(cupy.asarray(x)) for x in (q, k, v)]
            o_bits, _ = tier2.flash_forward(*bits, 1 / math.sqrt(d), causal, dtype="bfloat16", n_splits=n_splits)
            out = cupy.asnumpy(tier2.from_bfloat16_bits(o_bits))
        elif n_splits is not None:  # the split count has no public entry point
            from kernels.attn import _cupy as tier2

            o, _ = tier2.flash_forward(*(cupy.asarray(x) for x in (q, k, v)), 1 / math.sqrt(d), causal,
                                       n_splits=n_splits)
            out = cupy.asnumpy(o)
        else:
            out = cupy.asnumpy(cupy.asarray(kernels.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v),
                                                              causal=causal, algorithm=algorithm, backend=tier)))
        ref = reference(q, k, v, causal=causal)
        plain = plain_attention(q, k, v, causal, dtype) if dtype in ("float16", "bfloat16") else None
        err, bound, ok = within_tolerance(out, ref, dtype, plain)
        return {"max_abs_error": f"{err:.3g}", "bound": f"{bound:.3g}", "status": "passed" if ok else "failed"}

    size = f"B={B} Hq={Hq} Hkv={Hkv} Nq={Nq} Nk={Nk} d={d} causal={causal}" + (
        f" n_splits={n_splits}" if n_splits is not None else "")
    needs = ("cupy", "numba-cuda") if tier == "numba-cuda" else ("cupy",)
    estimate = attention_case_s(B, Hq, Nq, Nk, d, low_precision=dtype != "float32")
    return Case(name=f"attention {algorithm} {tier} {dtype}", size=size, run=run, needs=needs, estimate_s=estimate,
                limit_s=numba_limit_s(estimate) if tier == "numba-cuda" else None,
                columns={"tier": tier, "kernel": f"attention {algorithm}", "dtype": dtype})


def _nan_contract(nan_in, algorithm, n_splits=None):
    """kernels.attention's NaN contract on the CUDA C tier: a NaN in row j of q (k, v) makes NaN exactly the
    output rows that see it, as in the oracle; the flash kernel unsplit and split (the split path merges rows), and
    the standard algorithm, whose P·V is cuBLAS's."""
    B, Hq, Hkv, N, d = 1, 2, 1, 200, 64

    def run():
        import cupy

        from kernels.attn import _cupy as tier2  # the split count has no public entry point
        from kernels.attn import reference

        rng = np.random.default_rng([SEED, 7])
        q, k, v = (rng.standard_normal((B, h, N, d)).astype(np.float16) for h in (Hq, Hkv, Hkv))
        {"q": q, "k": k, "v": v}[nan_in][0, 0, 130, 5] = np.nan
        arrays = (cupy.asarray(x) for x in (q, k, v))
        if algorithm == "standard":
            o, _ = tier2.standard_forward(*arrays, 1 / math.sqrt(d), True)
        else:
            o, _ = tier2.flash_forward(*arrays, 1 / math.sqrt(d), True, n_splits=n_splits)
        got, ref = np.isnan(cupy.asnumpy(o)).any(axis=-1), np.isnan(reference(q, k, v, causal=True)).any(axis=-1)
        diff = int(np.count_nonzero(got != ref))
        return {"max_abs_error": f"{diff} rows' NaN differ ({int(got.sum())} NaN rows, oracle {int(ref.sum())})",
                "bound": "exact", "status": "passed" if diff == 0 else "failed"}

    return Case(name=f"NaN in {nan_in}, {algorithm}" + (f", n_splits={n_splits}" if n_splits else ""),
                size=f"B={B} Hq={Hq} Hkv={Hkv} N={N} d={d} causal", run=run, needs=("cupy",),
                estimate_s=attention_case_s(B, Hq, N, N, d, low_precision=False),
                columns={"tier": "cupy", "kernel": f"attention {algorithm}, NaN in {nan_in}", "dtype": "float16"})


def _int8_split(tier, M, K, N, n_outliers, keep_fp16):
    def run():
        import cupy

        from kernels import int8

        rng = np.random.default_rng([SEED, M, K, N])
        x = rng.standard_normal((M, K)).astype(np.float32)  # (M, K)
        x[:, rng.choice(K, n_outliers, replace=False)] *= 20.0  # outlier features above the threshold 6
        w = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)  # (N, K): (out, in), as F.linear
        weight = int8.Int8Weight.from_float(w, keep_fp16_weights=keep_fp16)
        cpu = int8.int8_matmul(x, weight, backend="cpu")  # (M, N)
        y = cupy.asnumpy(cupy.asarray(int8.int8_matmul(cupy.asarray(x), weight, backend=tier)))
        err = float(np.abs(y - cpu).max())
        bound = 1e-6 * float(np.abs(cpu).max())  # float32 rounding of the same integer sums and float16 products
        return {"max_abs_error": f"{err:.3g}", "bound": f"{bound:.3g} (CPU tier)",
                "status": "passed" if err <= bound else "failed"}

    needs = ("cupy", "numba-cuda") if tier == "numba-cuda" else ("cupy",)
    fp16 = ", float16 outlier rows kept" if keep_fp16 else ""
    estimate = int8_case_s(M, K, N)
    return Case(name=f"int8 split matmul {tier}", size=f"M={M} K={K} N={N}, {n_outliers} outlier dims{fp16}",
                run=run, needs=needs, estimate_s=estimate,
                limit_s=numba_limit_s(estimate) if tier == "numba-cuda" else None,
                columns={"tier": tier, "kernel": "int8 split matmul", "dtype": "float32 in, int8/int32 inside"})


def _int8_gemm_exact(M, K, N):
    def run():
        import cupy

        from kernels import int8
        from kernels.int8 import _cupy as tier2  # the int32 product has no public entry point

        rng = np.random.default_rng([SEED, M, K, N, 8])
        x_i8 = rng.integers(-127, 128, (M, K), dtype=np.int8)  # (M, K)
        w_i8_t = rng.integers(-127, 128, (N, K), dtype=np.int8)  # (N, K)
        exact = int8.int8_gemm(x_i8, w_i8_t)  # (M, N) int32, the CPU tier
        x_p = cupy.zeros((M, tier2.padded(K)), dtype=cupy.int8)  # (M, K padded)
        x_p[:, :K] = cupy.asarray(x_i8)
        w_p = cupy.zeros((N, tier2.padded(K)), dtype=cupy.int8)  # (N, K padded)
        w_p[:, :K] = cupy.asarray(w_i8_t)
        ones = cupy.ones(max(M, N), dtype=cupy.float32)
        _, c = tier2.gemm(x_p, w_p, ones[:M], ones[:N], want_int32=True)
        diff = int(np.count_nonzero(cupy.asnumpy(c) != exact))
        return {"max_abs_error": f"{diff} entries differ", "bound": "exact",
                "status": "passed" if diff == 0 else "failed"}

    return Case(name="int8 GEMM exact", size=f"M={M} K={K} N={N}", run=run, needs=("cupy",),
                estimate_s=int8_case_s(M, K, N),
                columns={"tier": "cupy", "kernel": "int8 GEMM (mma.sync s8)", "dtype": "int32"})


def _snapkv(tier, Hq, Hkv, N, d, capacity, window):
    def run():
        from kernels import kvprune

        rng = np.random.default_rng([SEED, Hq, N, capacity])
        q = rng.standard_normal((1, Hq, N, d)).astype(np.float32)  # (1, Hq, N, d)
        k = rng.standard_normal((1, Hkv, N, d)).astype(np.float32)  # (1, Hkv, N, d)
        v = rng.standard_normal((1, Hkv, N, d)).astype(np.float32)  # (1, Hkv, N, d)
        expected = kvprune.snapkv_kept_reference(q, k, capacity=capacity, window=window)
        _, _, kept = kvprune.snapkv_compress(q, k, v, capacity=capacity, window=window, backend=tier)
        diff = int(np.count_nonzero(np.asarray(kept) != expected))
        return {"max_abs_error": f"{diff} positions differ", "bound": "exact",
                "status": "passed" if diff == 0 else "failed"}

    needs = ("cupy", "numba-cuda") if tier == "numba-cuda" else ("cupy",)
    estimate = snapkv_case_s(Hq, N, d, window)
    return Case(name=f"SnapKV kept positions {tier}", size=f"Hq={Hq} Hkv={Hkv} N={N} d={d} capacity={capacity}",
                run=run, needs=needs, estimate_s=estimate,
                limit_s=numba_limit_s(estimate) if tier == "numba-cuda" else None,
                columns={"tier": tier, "kernel": "SnapKV kept positions", "dtype": "float32"})


def _snapkv_votes(votes_by, Hq, Hkv, N, d, window):
    def run():
        import cupy

        from kernels import kvprune
        from kernels.tolerances import TOLERANCES
        from kernels.kvprune import _cupy as tier2  # the choice of votes has no public entry point yet

        rng = np.random.default_rng([SEED, Hq, N, window, 2])
        qw = rng.standard_normal((1, Hq, window, d)).astype(np.float32)  # (1, Hq, w, d)
        k = rng.standard_normal((1, Hkv, N, d)).astype(np.float32)  # (1, Hkv, N, d)
        ref = kvprune.snapkv_scores_reference(qw, k)  # (1, Hkv, N − w) float64
        got = cupy.asnumpy(tier2.snapkv_scores(cupy.asarray(qw), cupy.asarray(k), 7, "max", "mean",
                                               votes_by=votes_by))
        err = float(np.abs(got - ref).max())
        tol = TOLERANCES["float32"]
        bound = tol["atol"] + tol["rtol"] * float(np.abs(ref).max())
        return {"max_abs_error": f"{err:.3g}", "bound": f"{bound:.3g}",
                "status": "passed" if err <= bound else "failed"}

    return Case(name=f"SnapKV window scores, votes by {votes_by}",
                size=f"Hq={Hq} Hkv={Hkv} N={N} d={d} w={window}", run=run, needs=("cupy",), estimate_s=snapkv_case_s(Hq, N, d, window),
                columns={"tier": "cupy", "kernel": f"SnapKV scores (votes by {votes_by})", "dtype": "float32"})


def cases(quick: bool) -> list[Case]:
    """The correctness cases, CUDA C tier first (the targets of this check), then the Numba-CUDA tier."""
    n = 512 if quick else 2048
    M, K, N = (128, 512, 256) if quick else (512, 2048, 1024)
    return [
        _attention("cupy", "flash", "float16", 1, 8, 2, n - 1, n - 1, 64, True),
        _attention("cupy", "flash", "bfloat16", 1, 8, 2, n - 1, n - 1, 64, True),
        _attention("cupy", "flash", "float16", 1, 4, 4, n, n, 128, False),
        _attention("cupy", "flash", "bfloat16", 1, 4, 4, n, n, 128, False),
        _attention("cupy", "flash", "float16", 2, 4, 1, 17, n // 2 + 3, 128, True),
        _attention("cupy", "flash", "float16", 1, 2, 2, 100, 40, 64, True),  # rows that see no key
        _attention("cupy", "flash", "float16", 2, 8, 2, 1, 4 * n + 5, 128, True),  # decode: the split-KV path
        _attention("cupy", "flash", "float16", 1, 16, 4, 16, 4 * n - 3, 64, False),  # a 16-query chunk, split-KV
        _attention("cupy", "flash", "float16", 1, 66000, 66000, 16, 16, 64, True),  # B·Hq above 65535
        _attention("cupy", "flash", "float16", 1, 8, 2, n // 2 + 1, n // 2 + 1, 128, True, n_splits=1),  # unsplit
        _attention("cupy", "flash", "bfloat16", 1, 8, 2, n // 2 + 1, n // 2 + 1, 128, True, n_splits=1),
        _attention("cupy", "flash", "float16", 1, 8, 2, n // 2 + 1, n // 2 + 1, 128, True, n_splits=5),  # 5 splits
        # batches, several query tiles (the last one partial) and splits at once: grid.x is tile + Tr·(b·Hq + h)
        _attention("cupy", "flash", "float16", 3, 6, 3, n // 4 + 1, n // 4 + 1, 64, True, n_splits=3),
        _attention("cupy", "standard", "float16", 1, 4, 2, n // 2, n // 2, 64, True),
        *[_nan_contract(where, "flash", splits) for where in ("q", "k", "v") for splits in (1, 3)],
        *[_nan_contract(where, "standard") for where in ("q", "k", "v")],
        _int8_split("cupy", M, K, N, 5, False),
        _int8_split("cupy", 70, 200, 100, 3, True),
        _int8_gemm_exact(M, K, N),
        _int8_gemm_exact(70000, 64, 24),  # M above 65535 (the GEMM's grid.x is the M tiles)
        _snapkv("cupy", 8, 2, 1024 if quick else 4096, 64, 256, 32),
        _snapkv_votes("kernel", 8, 2, 1024 if quick else 4096, 64, 32),
        _snapkv_votes("gemm", 8, 2, 1024 if quick else 4096, 64, 32),
        _attention("numba-cuda", "flash", "float32", 1, 4, 2, n // 2 + 5, n // 2 + 5, 64, True),
        _attention("numba-cuda", "flash", "float16", 1, 4, 4, n // 4, n // 2, 128, False),
        _attention("numba-cuda", "standard", "float32", 1, 2, 1, n // 4, n // 4, 64, True),
        _int8_split("numba-cuda", M, K, N, 5, False),
        _snapkv("numba-cuda", 8, 2, 1024 if quick else 4096, 64, 256, 32),
    ]
