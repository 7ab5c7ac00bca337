"""The program cachegrind runs (``test_cachegrind.py``): the CPU flash kernel on random inputs, the last-level
cache flushed before each of two repeats (a scratch array twice its size is summed), the kernel called in the
first ``calls`` of them.

    python -m tests.simulator.cachegrind_probe N d H Br Bc calls ll_bytes

A run with calls = 2 and one with calls = 0 do the same work but the two kernel calls, so the difference of their
last-level misses is the kernel's, from a cold cache.
"""
from __future__ import annotations

import sys

import numpy as np

import kernels


def main(argv) -> None:
    n, d, h, br, bc, calls, ll = (int(x) for x in argv)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, h, n, d)).astype(np.float32) for _ in range(3))  # (B, H, N, d)
    # a small call first loads the compiled kernel (from Numba's cache) in both runs
    out = kernels.attention(q[:, :, :16], k[:, :, :16], v[:, :, :16], algorithm="flash", block_q=br, block_k=bc)
    scratch = np.ones(2 * ll // 8)  # twice the last-level cache, float64
    for repeat in range(2):
        scratch.sum()  # every line of the cache now holds scratch
        if repeat < calls:
            out = kernels.attention(q, k, v, algorithm="flash", block_q=br, block_k=bc)
    # nothing reads the output afterwards: a read of it here would add misses to one run only
    print("shape", np.shape(out))


if __name__ == "__main__":
    main(sys.argv[1:])
