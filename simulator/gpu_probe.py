"""One GPU kernel case per process, for the tools that watch a whole process: Nsight Compute (DRAM bytes) and
compute-sanitizer (memcheck, racecheck). ``python -m simulator.gpu_probe CASE [CASE ...] [--small] [--no-pool]``.

Inputs are drawn with NumPy on the host and copied to the device, so that the only kernels launched are the
case's own (ncu filters them by name with ``KERNEL_REGEX``). The default sizes put every input well above the
H200's 60 MB of L2, so that DRAM bytes are the algorithm's and not the cache's. ``--small`` runs the awkward paths
at sizes the sanitizers can afford (they slow kernels down a hundredfold): attention at N=200 (not a multiple of
the 64-row tiles), causal, Hq=4/Hkv=2, d=64 and d=128, float16 and bfloat16, decode through the split-KV path;
int8 at M=70, K=200, N=100 with the weights in int8 and with their float16 copy; SnapKV's votes by both paths.
``--no-pool`` turns CuPy's memory pool off, so that a small out-of-bounds access lands outside its allocation
instead of inside a pooled neighbour, where memcheck would not see it.

After each case a probe prints a ``COMPLETION`` line; the check requires them, so that a tool that refused the
device ("Device not supported") reads as "not run", never as "0 errors".
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

CASES = ("flash", "flash-decode", "standard", "flash-numba", "int8", "snapkv")
COMPLETION = "gpu_probe: {case} completed"
# the kernels of the cases as ncu sees their names: the CUDA C tier's, Numba's, and cuBLAS's (Ampere xmma/cutlass
# names, Hopper's nvjet and sm90_ kernels) for the matmuls of the standard algorithm
KERNEL_REGEX = ("flash_forward|flash_combine|softmax_rows|gemm|xmma|cutlass|nvjet|sm90_|sm80_|quantize|outlier|"
                "window_votes|topk|gather|pool_rows|group_mean|scores_kernel|pv_kernel|combine")


def sizes(case: str, small: bool) -> dict:
    """The problem of each case: attention (B, Hq, Hkv, Nq, Nk, d), int8 (M, K, N, outliers), SnapKV (Hq, Hkv,
    N, d)."""
    if case in ("flash", "standard", "flash-numba"):
        if small:
            return {"B": 1, "Hq": 4, "Hkv": 2, "Nq": 200, "Nk": 200, "d": 64 if case == "flash-numba" else 128}
        return {"B": 1, "Hq": 16, "Hkv": 16, "Nq": 8192, "Nk": 8192, "d": 128 if case != "flash-numba" else 64}
    if case == "flash-decode":
        return {"B": 1 if small else 8, "Hq": 4 if small else 32, "Hkv": 2 if small else 8, "Nq": 1,
                "Nk": 1000 if small else 32768, "d": 128}
    if case == "int8":
        return {"M": 70 if small else 4096, "K": 200 if small else 4096, "N": 100 if small else 4096,
                "outliers": 3 if small else 40}
    if case == "snapkv":
        return {"Hq": 4 if small else 32, "Hkv": 2 if small else 8, "N": 600 if small else 16384, "d": 64}
    raise ValueError(f"unknown case {case!r}; known: {', '.join(CASES)}")


def _attention(case, s, small, rng):
    import cupy

    import kernels

    def draw(h, n, d, dtype):
        return rng.standard_normal((s["B"], h, n, d)).astype(dtype)  # (B, h, n, d)

    if case == "flash-numba":
        q, k, v = (cupy.asarray(draw(h, s["Nq"] if i == 0 else s["Nk"], s["d"], np.float32))
                   for i, h in enumerate((s["Hq"], s["Hkv"], s["Hkv"])))
        kernels.attention(q, k, v, causal=small, backend="numba-cuda")
        return
    # the small run covers both head dims and (flash) both 16-bit types; decode adds a 16-query chunk
    head_dims = (64, 128) if small else (s["d"],)
    n_queries = (s["Nq"], 16) if case == "flash-decode" and small else (s["Nq"],)
    dtypes = ("float16", "bfloat16") if small and case != "standard" else ("float16",)
    for d in head_dims:
        for nq in n_queries:
            for dtype in dtypes:
                q = draw(s["Hq"], nq, d, np.float32)
                k, v = draw(s["Hkv"], s["Nk"], d, np.float32), draw(s["Hkv"], s["Nk"], d, np.float32)
                if dtype == "bfloat16":  # no public bfloat16 entry point
                    from kernels.attn import _cupy as tier2

                    bits = [tier2.to_bfloat16_bits(cupy.asarray(x)) for x in (q, k, v)]
                    tier2.flash_forward(*bits, 1 / np.sqrt(d), True, dtype="bfloat16")
                else:
                    qq, kk, vv = (cupy.asarray(x.astype(np.float16)) for x in (q, k, v))
                    kernels.attention(qq, kk, vv, causal=small or case == "flash-decode",
                                      algorithm="standard" if case == "standard" else "flash", backend="cupy")
                    if small and case == "flash":  # the launcher splits small problems; the unsplit path too
                        from kernels.attn import _cupy as tier2

                        tier2.flash_forward(qq, kk, vv, 1 / np.sqrt(d), True, n_splits=1)


def run(case: str, small: bool = False, seed: int = 0) -> None:
    import cupy

    from kernels import int8, kvprune

    rng = np.random.default_rng(seed)
    s = sizes(case, small)
    if case in ("flash", "flash-decode", "standard", "flash-numba"):
        _attention(case, s, small, rng)
    elif case == "int8":
        x = rng.standard_normal((s["M"], s["K"])).astype(np.float32)  # (M, K)
        x[:, rng.choice(s["K"], s["outliers"], replace=False)] *= 20.0  # outlier features above the threshold 6
        w = rng.standard_normal((s["N"], s["K"])).astype(np.float32)  # (N, K): (out, in)
        int8.int8_matmul(cupy.asarray(x), int8.Int8Weight.from_float(w), backend="cupy")
        if small:  # the float16 copy's outlier path too, for the sanitizers; at full size ncu counts the one call
            # the cost model predicts (``costs.int8_split``: the weights in int8 only; both calls moved 2.04x that)
            int8.int8_matmul(cupy.asarray(x), int8.Int8Weight.from_float(w, keep_fp16_weights=True),
                             backend="cupy")
    elif case == "snapkv":
        q = cupy.asarray(rng.standard_normal((1, s["Hq"], s["N"], s["d"])).astype(np.float16))
        k, v = (cupy.asarray(rng.standard_normal((1, s["Hkv"], s["N"], s["d"])).astype(np.float16))
                for _ in range(2))
        kvprune.snapkv_compress(q, k, v, capacity=s["N"] // 16 + 32, window=32, backend="cupy")
        if small:  # the votes' other path, S = Q_w Kᵀ by cuBLAS first (no public entry point yet)
            from kernels.kvprune import _cupy as tier2

            tier2.snapkv_scores(q[:, :, -32:], k, 7, "max", "mean", votes_by="gemm")
    cupy.cuda.Device().synchronize()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulator.gpu_probe", description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", choices=CASES, metavar="CASE", help=f"one or more of {', '.join(CASES)}")
    parser.add_argument("--small", action="store_true", help="sanitizer sizes, the awkward paths")
    parser.add_argument("--no-pool", action="store_true", help="CuPy's memory pool off (for memcheck)")
    args = parser.parse_args(argv)
    if args.no_pool:
        import cupy

        cupy.cuda.set_allocator(None)
    for case in args.cases:
        run(case, args.small)
        print(COMPLETION.format(case=case), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
