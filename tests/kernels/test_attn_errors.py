"""Bad input to kernels.attention: the same clear exception, naming the argument, from every algorithm."""
from __future__ import annotations

import numpy as np
import pytest

import kernels
from tests.helpers import attention_inputs, bad_attention_calls

ALGORITHMS = ("flash", "standard")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("name, exc, pattern, make", bad_attention_calls(), ids=[c[0] for c in bad_attention_calls()])
def test_same_error_from_every_algorithm(rng, algorithm, name, exc, pattern, make):
    args, kwargs = make(*attention_inputs(rng))
    with pytest.raises(exc, match=pattern):
        kernels.attention(*args, algorithm=algorithm, **kwargs)


def test_unknown_algorithm_lists_the_known(rng):
    with pytest.raises(ValueError, match="unknown algorithm 'tiled'; known: 'flash', 'standard'"):
        kernels.attention(*attention_inputs(rng), algorithm="tiled")


# the oracle has no block sizes or backend; every other bad call must fail there the same way
_ORACLE_CALLS = [c for c in bad_attention_calls() if not c[0].startswith(("block", "unknown-backend"))]


@pytest.mark.parametrize("name, exc, pattern, make", _ORACLE_CALLS, ids=[c[0] for c in _ORACLE_CALLS])
def test_the_oracle_rejects_the_same_input(rng, name, exc, pattern, make):
    from kernels.attn import reference

    args, kwargs = make(*attention_inputs(rng))
    with pytest.raises(exc, match=pattern):
        reference(*args, **kwargs)


def test_bfloat16_attention_checks_its_input_before_it_needs_a_gpu(rng):
    from kernels.attn import attention_bfloat16

    bits = [rng.integers(0, 2**14, (2, 16, 64)).astype(np.uint16) for _ in range(3)]  # small positive values
    with pytest.raises(TypeError, match="q must be a uint16 array of bfloat16 bit patterns"):
        attention_bfloat16(bits[0].astype(np.float32), *bits[1:])
    with pytest.raises(ValueError, match="takes head dim 64 or 128; got d=32"):
        attention_bfloat16(*(b[..., :32] for b in bits))
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        attention_bfloat16(bits[0], bits[1], bits[2][:, :8])
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        attention_bfloat16(*bits, scale=0.0)


def test_a_float_of_the_other_byte_order_is_named_as_such(rng):
    # '>f4' is float32 big-endian: "must have a floating dtype ... got >f4" read as if it were not a float
    from kernels.dense import matmul_nt
    from kernels.int8 import int8_matmul

    big = rng.standard_normal((1, 2, 8, 4)).astype(">f4")
    x = big[0, 0]
    for call, name in ((lambda: kernels.attention(big, big, big), "q"), (lambda: int8_matmul(x, x), "x"),
                       (lambda: matmul_nt(x, x), "x")):
        with pytest.raises(TypeError, match=rf"{name} must be in this machine's byte order; got >f4"):
            call()


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # (NumPy's, on making a matrix)
def test_a_numpy_matrix_is_refused(rng):
    q = np.asmatrix(rng.standard_normal((8, 4)).astype(np.float32))  # (stays 2-D when indexed)
    with pytest.raises(TypeError, match=r"q must be a numpy.ndarray or a device array \(.*\); got matrix"):
        kernels.attention(q, np.asarray(q), np.asarray(q))
