"""Property test: over random shapes, block sizes and masks, both algorithms agree with the oracle."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels.attn import reference
from tests.helpers import assert_close


@st.composite
def attention_problems(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    Nq = draw(st.integers(1, 70))
    Nk = draw(st.integers(1, 70))
    d = draw(st.integers(1, 24))
    causal = draw(st.booleans())
    block_q = draw(st.one_of(st.none(), st.integers(1, 80)))
    block_k = draw(st.one_of(st.none(), st.integers(1, 80)))
    dtype = draw(st.sampled_from(["float32", "float64"]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hkv * group, Nq, d)).astype(dtype)
    k = rng.standard_normal((B, Hkv, Nk, d)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Nk, d)).astype(dtype)
    return q, k, v, causal, block_q, block_k


@settings(max_examples=150, deadline=None)
@given(attention_problems(), st.sampled_from(["flash", "standard"]))
def test_any_shape_matches_the_oracle(problem, algorithm):
    q, k, v, causal, block_q, block_k = problem
    o, lse = kernels.attention(q, k, v, causal=causal, algorithm=algorithm, block_q=block_q, block_k=block_k,
                               return_lse=True)
    ref_o, ref_lse = reference(q, k, v, causal=causal, return_lse=True)
    assert_close(o, ref_o, q.dtype)
    assert_close(lse, ref_lse, q.dtype)
    assert not np.isnan(o).any()
