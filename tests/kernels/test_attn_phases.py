"""The standard algorithm's phases, timed one by one: the same output as the untimed call, every phase it ran named
once, in order."""
from __future__ import annotations

import numpy as np
import pytest

import kernels
from kernels.attn import STANDARD_PHASES, standard_phase_times


@pytest.mark.parametrize("shape_q, shape_kv", [((1, 4, 37, 16), (1, 2, 53, 16)), ((5, 8), (7, 8)),
                                               ((3, 1, 16), (3, 1, 16))])
@pytest.mark.parametrize("causal", [False, True])
def test_phases_time_the_standard_algorithm_without_changing_it(rng, shape_q, shape_kv, causal):
    q = rng.standard_normal(shape_q).astype(np.float32)
    k, v = (rng.standard_normal(shape_kv).astype(np.float32) for _ in range(2))
    o, seconds = standard_phase_times(q, k, v, causal=causal)
    expected = kernels.attention(q, k, v, causal=causal, algorithm="standard")
    np.testing.assert_array_equal(o, expected)
    ran = [p for p in STANDARD_PHASES if causal or p != "mask"]
    assert list(seconds) == ran  # every phase once, in the order the kernel runs them
    assert all(s >= 0.0 for s in seconds.values())


def test_phases_check_their_input_as_attention_does(rng):
    q = rng.standard_normal((4, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="head dim"):
        standard_phase_times(q, q[:, :4], q[:, :4])
    with pytest.raises(TypeError):
        standard_phase_times(q.tolist(), q, q)
