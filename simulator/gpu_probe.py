"""One GPU kernel case per process, for the tools that watch a whole process: Nsight Compute (DRAM bytes) and
compute-sanitizer (memcheck, racecheck). ``python -m simulator.gpu_probe CASE [--small]``.

Inputs are drawn with NumPy on the host and copied to the device, so that the only kernels launched are the
case's own (ncu filters them by name with ``KERNEL_REGEX``). The default sizes put every input well above the
H200's 60 MB of L2, so that DRAM bytes are the algorithm's and not the cache's; ``--small`` is for the
sanitizers, which slow kernels down a hundredfold.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

# the kernels of the cases, as ncu sees their names (the CUDA C tier's, Numba's, and cuBLAS's for the matmuls)
KERNEL_REGEX = ("flash_forward|softmax_rows|gemm|xmma|cutlass|quantize|outlier|window_votes|topk|gather|pool_rows|"
                "group_mean|scores_kernel|pv_kernel|combine")


def sizes(case: str, small: bool) -> dict:
    """The problem of each case: attention (B, H, N, d), int8 (M, K, N, outliers), SnapKV (Hq, Hkv, N, d)."""
    if case in ("flash", "standard", "flash-numba"):
        return {"B": 1, "H": 2 if small else 16, "N": 256 if small else 8192, "d": 128 if case != "flash-numba" else 64}
    if case == "int8":
        return {"M": 64 if small else 4096, "K": 256 if small else 4096, "N": 128 if small else 4096,
                "outliers": 2 if small else 40}
    if case == "snapkv":
        return {"Hq": 4 if small else 32, "Hkv": 2 if small else 8, "N": 512 if small else 16384, "d": 64}
    raise ValueError(f"unknown case {case!r}; known: flash, standard, flash-numba, int8, snapkv")


def run(case: str, small: bool = False, seed: int = 0) -> None:
    import cupy

    import kernels
    from kernels import int8, kvprune

    rng = np.random.default_rng(seed)
    s = sizes(case, small)
    if case in ("flash", "standard", "flash-numba"):
        shape = (s["B"], s["H"], s["N"], s["d"])
        dtype = np.float32 if case == "flash-numba" else np.float16
        q, k, v = (cupy.asarray(rng.standard_normal(shape).astype(dtype)) for _ in range(3))
        backend = "numba-cuda" if case == "flash-numba" else "cupy"
        kernels.attention(q, k, v, algorithm="standard" if case == "standard" else "flash", backend=backend)
    elif case == "int8":
        x = rng.standard_normal((s["M"], s["K"])).astype(np.float32)
        x[:, rng.choice(s["K"], s["outliers"], replace=False)] *= 20.0  # outlier features above the threshold 6
        weight = int8.Int8Weight.from_float(rng.standard_normal((s["K"], s["N"])).astype(np.float32))
        int8.int8_matmul(cupy.asarray(x), weight, backend="cupy")
    elif case == "snapkv":
        q = cupy.asarray(rng.standard_normal((1, s["Hq"], s["N"], s["d"])).astype(np.float16))
        k, v = (cupy.asarray(rng.standard_normal((1, s["Hkv"], s["N"], s["d"])).astype(np.float16))
                for _ in range(2))
        kvprune.snapkv_compress(q, k, v, capacity=s["N"] // 16, window=32, backend="cupy")
    cupy.cuda.Device().synchronize()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulator.gpu_probe", description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=("flash", "standard", "flash-numba", "int8", "snapkv"))
    parser.add_argument("--small", action="store_true", help="sanitizer sizes")
    args = parser.parse_args(argv)
    run(args.case, args.small)
    return 0


if __name__ == "__main__":
    sys.exit(main())
