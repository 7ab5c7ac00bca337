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
