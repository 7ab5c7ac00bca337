"""kernels.decode (the fused per-token kernels of a Llama block) against float64 oracles."""
from __future__ import annotations

import numpy as np
import pytest

from kernels import attn, decode

from tests.helpers import assert_close


@pytest.mark.parametrize("hidden, with_delta", [(1, True), (7, False), (576, True)])
def test_add_rms_norm_equals_the_oracle(rng, hidden, with_delta):
    x = rng.standard_normal(hidden).astype(np.float32)
    delta = rng.standard_normal(hidden).astype(np.float32) if with_delta else np.empty(0, np.float32)
    weight = rng.standard_normal(hidden).astype(np.float32)
    residual = x.astype(np.float64) + (delta if with_delta else 0.0)
    h = np.empty(hidden, np.float32)
    decode.add_rms_norm(x, delta, weight, 1e-5, h)
    assert_close(x, residual, np.float32)  # the residual stream is updated in place
    assert_close(h, decode.rms_norm_reference(residual, weight, 1e-5), np.float32)


# (Hq, Hkv, d, slot): MHA, GQA groups of 3 and 2, the first token (slot 0), d of 2 (one rotary pair), three pieces
# of slots (``PIECE_SLOTS``: 512) and two, the second of the new token alone
@pytest.mark.parametrize("hq, hkv, d, slot", [(4, 4, 8, 5), (9, 3, 64, 0), (9, 3, 64, 37), (6, 3, 2, 130),
                                              (8, 1, 16, 1), (4, 2, 24, 19), (2, 1, 72, 40), (9, 3, 64, 1100),
                                              (4, 2, 24, 512)])
def test_rope_attend_equals_the_oracle(rng, hq, hkv, d, slot):
    qkv = rng.standard_normal((hq + 2 * hkv) * d).astype(np.float32)
    angles = rng.uniform(0, 2 * np.pi, d // 2)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    capacity = slot + 3
    k_cache = rng.standard_normal((hkv, capacity, d)).astype(np.float32)
    v_cache = rng.standard_normal((hkv, capacity, d)).astype(np.float32)
    earlier_k, earlier_v = k_cache[:, :slot].copy(), v_cache[:, :slot].copy()
    after = k_cache[:, slot + 1:].copy()
    o = np.empty(hq * d, np.float32)
    decode.rope_attend(qkv, cos, sin, k_cache, v_cache, slot, np.float32(d**-0.5), o)
    q = decode.rope_reference(qkv[:hq * d].reshape(hq, 1, d), cos, sin)  # (Hq, 1, d)
    k_new = decode.rope_reference(qkv[hq * d:(hq + hkv) * d].reshape(hkv, 1, d), cos, sin)  # (Hkv, 1, d)
    v_new = qkv[(hq + hkv) * d:].reshape(hkv, 1, d)
    assert_close(k_cache[:, slot:slot + 1], k_new, np.float32)  # the rotated key written into its slot
    assert np.array_equal(v_cache[:, slot:slot + 1], v_new)
    assert np.array_equal(k_cache[:, :slot], earlier_k) and np.array_equal(v_cache[:, :slot], earlier_v)
    assert np.array_equal(k_cache[:, slot + 1:], after)  # nothing past the slot is touched
    k = np.concatenate([earlier_k, k_new], axis=1)
    v = np.concatenate([earlier_v, v_new], axis=1).astype(np.float64)
    assert_close(o.reshape(hq, 1, d), attn.reference(q, k, v, causal=True), np.float32)


@pytest.mark.parametrize("d", [1, 2, 15, 16, 17, 31, 32, 33, 64, 72])
def test_the_portable_attention_scores_equal_the_float64_dot_products(rng, d):
    from kernels.decode import _fused

    n, capacity = 11, 11
    q = rng.standard_normal(d).astype(np.float32)
    keys = rng.standard_normal((capacity, d)).astype(np.float32)
    s = np.full(n + 2, 7.0, np.float32)
    _fused._dots_loop(q, keys, n, s)
    assert_close(s[:n], keys.astype(np.float64) @ q, np.float32)
    assert np.all(s[n:] == 7.0)  # nothing past the n scores is written


# d: below one vector, its tails, four vectors (SmolLM2's 64) and past them with a tail; n: below one vector of
# scores, its edges, and past one block of rows (``T_BLOCK_BYTES``: 64 rows at d = 64, 2048 at d = 2); the slots
# in one piece, in two and in three uneven ones (the last of a single slot)
@pytest.mark.parametrize("group, d, n", [(1, 1, 1), (3, 2, 2100), (3, 15, 16), (4, 16, 17), (2, 17, 15),
                                         (3, 64, 300), (1, 72, 33), (2, 130, 70)])
@pytest.mark.parametrize("cuts", [(), (0.5,), (0.3, 1.0)])
@pytest.mark.parametrize("path", ["lanes", "loop"])
def test_the_pieces_of_a_group_attention_combine_to_the_oracle(rng, group, d, n, cuts, path):
    from kernels.decode import _fused
    from kernels._common import zmm

    if path == "lanes" and not zmm.VECTORS:
        pytest.skip("the 16-lane path compiles to vector code only for a target with AVX-512F, or AVX2 with FMA")
    piece = _fused._piece_lanes if path == "lanes" else _fused._piece_loop
    bounds = sorted({0, n, *(min(n - 1, max(1, int(c * n))) for c in cuts if n > 1)})
    q = rng.standard_normal(group * d).astype(np.float32)
    keys = rng.standard_normal((n, d)).astype(np.float32)  # the last rows end where the arrays end (the masked
    values = rng.standard_normal((n, d)).astype(np.float32)  # tails read nothing past them)
    scale = np.float32(d**-0.5)
    width = _fused.piece_width(group, d)
    parts = np.full(len(bounds) * width, 7.0, np.float32)
    for c, (t0, t1) in enumerate(zip(bounds[:-1], bounds[1:])):
        scratch = np.full(group * (t1 - t0) + 5, 7.0, np.float32)
        piece(q, keys, values, t0, t1, scale, scratch[:-5], parts[c * width:])
        assert np.all(scratch[-5:] == 7.0)  # its scores stay within their scratch
    assert np.all(parts[(len(bounds) - 1) * width:] == 7.0)  # nothing past the pieces' results is written
    out = np.full(group * d + 3, 7.0, np.float32)
    _fused._combine(parts, len(bounds) - 1, group, d, out[:group * d])
    q64, k64, v64 = (a.astype(np.float64) for a in (q.reshape(group, 1, d), keys[None], values[None]))
    assert_close(out[:group * d].reshape(group, 1, d), attn.reference(q64, k64, v64, scale=float(scale)),
                 np.float32)
    assert np.all(out[group * d:] == 7.0)  # nothing past the group's outputs is written


def test_the_attention_takes_the_16_lane_pieces_wherever_they_compile_to_vectors():
    from kernels.decode import _fused
    from kernels._common import zmm

    assert zmm.VECTORS == (zmm.AVAILABLE or {"avx2", "fma"} <= zmm.target_features())
    assert _fused._piece is (_fused._piece_lanes if zmm.VECTORS else _fused._piece_loop)


@pytest.mark.parametrize("n", [1, 5, 1536])
def test_swiglu_equals_the_oracle(rng, n):
    gate_up = (rng.standard_normal(2 * n) * 4).astype(np.float32)
    out = np.empty(n, np.float32)
    decode.swiglu(gate_up, out)
    g, u = gate_up[:n].astype(np.float64), gate_up[n:].astype(np.float64)
    assert_close(out, g / (1 + np.exp(-g)) * u, np.float32)


def test_swiglu_far_below_zero_and_not_finite_gates_give_what_np_exp_gives(rng):
    # past g = -88 the polynomial's clamped argument would give g·e^-88 (-1.8 at g = -3e38): silu(g) is g·0 there
    g = np.array([-3e38, -1e30, -100.0, -89.0, -np.inf, np.inf, np.nan], np.float32)
    u = (rng.standard_normal(g.size) + 2).astype(np.float32)
    out = np.empty(g.size, np.float32)
    decode.swiglu(np.concatenate([g, u]), out)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = g / (np.float32(1) + np.exp(-g)) * u  # float32 throughout: e^-g overflows to inf
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(out), nan)
    assert np.array_equal(out[~nan].view(np.uint32), expected[~nan].view(np.uint32))  # -0 where np.exp gave -0


@pytest.mark.parametrize("i0, i1", [(0, 0), (3, 3), (0, 17), (5, 40), (33, 100), (99, 100), (7, 5)])
def test_swiglu_on_a_run_of_features_is_the_whole_products_bits_and_writes_nothing_else(rng, i0, i1):
    # the fused step's GATE_UP tasks compute SwiGLU for their own features only (_silu_product)
    from kernels.decode._fused import _silu_product

    n = 100
    gate_up = (rng.standard_normal(2 * n) * 6).astype(np.float32)
    whole = np.empty(n, np.float32)
    decode.swiglu(gate_up, whole)
    out = rng.standard_normal(n).astype(np.float32)
    before = out.copy()
    _silu_product(gate_up, n, out, i0, i1)
    inside = np.zeros(n, bool)
    inside[i0:i1] = True
    assert np.array_equal(out[inside].view(np.uint32), whole[inside].view(np.uint32))
    assert np.array_equal(out[~inside].view(np.uint32), before[~inside].view(np.uint32))


def _one_step_arrays(hkv=2, cap=8, d=4, hq=4):
    """rope_attend's arrays for one token: qkv, cos, sin, k_cache, v_cache, o (a cache of ``cap`` slots)."""
    qkv = np.ones(hq * d + 2 * hkv * d, np.float32)
    cos = sin = np.ones(d // 2, np.float32)
    k_cache, v_cache = (np.zeros((hkv, cap, d), np.float32) for _ in range(2))
    return qkv, cos, sin, k_cache, v_cache, np.empty(hq * d, np.float32)


def test_the_fused_steps_refuse_what_would_index_out_of_bounds():
    # the Numba kernels index by the sizes they are given: a slot past the cache wrote out of bounds
    from kernels import decode

    cap = 8
    qkv, cos, sin, k_cache, v_cache, o = _one_step_arrays(cap=cap)
    with pytest.raises(ValueError, match=r"n must be a slot of the cache, an int in \[0, 8\)"):
        decode.rope_attend(qkv, cos, sin, k_cache, v_cache, cap, 0.5, o)
    with pytest.raises(ValueError, match="qkv must be"):
        decode.rope_attend(qkv[:-1], cos, sin, k_cache, v_cache, 0, 0.5, o)
    with pytest.raises(TypeError, match="C-contiguous float32"):
        decode.rope_attend(qkv.astype(np.float64), cos, sin, k_cache, v_cache, 0, 0.5, o)
    with pytest.raises(ValueError, match="gate_up must be"):
        decode.swiglu(np.ones(7, np.float32), np.empty(4, np.float32))
    with pytest.raises(ValueError, match="x, weight, h must be"):
        decode.add_rms_norm(np.ones(4, np.float32), np.ones(3, np.float32), np.ones(4, np.float32), 1e-5,
                            np.empty(4, np.float32))


def test_the_fused_steps_refuse_scales_aliases_and_arrays_they_cannot_write():
    # rope_attend took any scale (NaN gave NaN silently, a string a Numba TypingError) and caches that alias (the
    # value written over the key); a read-only output was a TypingError, a strided x "got float32"
    from kernels import decode

    qkv, cos, sin, k_cache, v_cache, o = _one_step_arrays()
    for scale in (np.nan, np.inf, 0.0, -1.0, "0.5", None):
        with pytest.raises(ValueError, match="scale must be a finite number > 0"):
            decode.rope_attend(qkv, cos, sin, k_cache, v_cache, 0, scale, o)
    with pytest.raises(ValueError, match="must not share memory"):
        decode.rope_attend(qkv, cos, sin, k_cache, k_cache, 0, 0.5, o)
    read_only = o.copy()
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="o must be writeable"):
        decode.rope_attend(qkv, cos, sin, k_cache, v_cache, 0, 0.5, read_only)
    x = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="x must be C-contiguous"):
        decode.add_rms_norm(x[::2], np.ones(0, np.float32), np.ones(4, np.float32), 1e-5, np.empty(4, np.float32))
    with pytest.raises(ValueError, match="h must be writeable"):
        decode.add_rms_norm(x[:4], np.ones(0, np.float32), np.ones(4, np.float32), 1e-5, read_only[:4])
    with pytest.raises(ValueError, match="out must be writeable"):
        decode.swiglu(np.ones(8, np.float32), read_only[:4])
    decode.rope_attend(qkv, cos, sin, k_cache, v_cache, 0, np.float32(0.5), o)  # a NumPy scalar scale is one
