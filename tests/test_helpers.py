"""The rounding helpers that no CPU test exercises otherwise (the bfloat16 rounding of the CuPy tests and the GPU
check, ``kernels.attn.round_to``)."""
from __future__ import annotations

import numpy as np

from kernels.attn import round_to


def round_to_bfloat16(x):
    return round_to(x, "bfloat16")


def test_round_to_bfloat16_keeps_8_significant_bits_ties_to_even(rng):
    ulp = 2.0**-7  # bfloat16 spacing in [1, 2): 7 fraction bits
    x = np.array([1.0, 1 + ulp / 2, 1 + 3 * ulp / 2, 1 + ulp / 2 + 2**-20, -3.0, np.inf, -np.inf, 0.0],
                 dtype=np.float32)
    assert round_to_bfloat16(x).tolist() == [1.0, 1.0, 1 + 2 * ulp, 1 + ulp, -3.0, np.inf, -np.inf, 0.0]
    assert np.isnan(round_to_bfloat16(np.array([np.nan], np.float32)))[0]
    v = rng.standard_normal(10**4).astype(np.float32)
    r = round_to_bfloat16(v)
    assert np.all(np.abs(r - v) <= 2.0**-8 * np.abs(v))  # half an ulp, relative
    assert np.all(r.view(np.uint32) & 0xFFFF == 0)  # only the top 16 bits remain
