"""Bad input to kernels.attention: the same clear exception, naming the argument, from every algorithm."""
from __future__ import annotations

import numpy as np
import pytest

import kernels

ALGORITHMS = ("flash", "standard")


def _ok(rng, hq=4, hkv=2, n=8, d=16, dtype=np.float32):
    q = rng.standard_normal((1, hq, n, d)).astype(dtype)
    k = rng.standard_normal((1, hkv, n, d)).astype(dtype)
    v = rng.standard_normal((1, hkv, n, d)).astype(dtype)
    return q, k, v


def _bad_calls():
    """(id, exception, message pattern, function of (q, k, v) returning (args, kwargs))."""
    return [
        ("head-dim-mismatch", ValueError, "head dims differ",
         lambda q, k, v: ((q[..., :8], k, v), {})),
        ("kv-shape-mismatch", ValueError, "k and v must have the same shape",
         lambda q, k, v: ((q, k, v[:, :, :5]), {})),
        ("heads-not-multiple", ValueError, "multiple of the number of key/value heads",
         lambda q, k, v: ((q[:, :3], k, v), {})),
        ("batch-mismatch", ValueError, "batch sizes differ",
         lambda q, k, v: ((np.concatenate([q, q]), k, v), {})),
        ("ndim-1", ValueError, "q must have 2, 3 or 4 dimensions",
         lambda q, k, v: ((q[0, 0, 0], k, v), {})),
        ("ndim-5", ValueError, "k must have 2, 3 or 4 dimensions",
         lambda q, k, v: ((q, k[None], v[None]), {})),
        ("ndim-differs", ValueError, "same number of dimensions",
         lambda q, k, v: ((q[0], k, v), {})),
        ("int-dtype", TypeError, "q must have a floating dtype",
         lambda q, k, v: ((q.astype(np.int32), k, v), {})),
        ("complex-dtype", TypeError, "v must have a floating dtype",
         lambda q, k, v: ((q, k, v.astype(np.complex64)), {})),
        ("mixed-dtype", TypeError, "must share one dtype",
         lambda q, k, v: ((q, k.astype(np.float64), v), {})),
        ("not-an-array", TypeError, "k must be a numpy.ndarray",
         lambda q, k, v: ((q, k.tolist(), v), {})),
        ("zero-head-dim", ValueError, "head dim",
         lambda q, k, v: ((q[..., :0], k[..., :0], v[..., :0]), {})),
        ("block_q-zero", ValueError, "block_q must be >= 1",
         lambda q, k, v: ((q, k, v), {"block_q": 0})),
        ("block_k-negative", ValueError, "block_k must be >= 1",
         lambda q, k, v: ((q, k, v), {"block_k": -4})),
        ("block_q-float", TypeError, "block_q must be an int",
         lambda q, k, v: ((q, k, v), {"block_q": 16.0})),
        ("scale-zero", ValueError, "scale must be finite and > 0",
         lambda q, k, v: ((q, k, v), {"scale": 0.0})),
        ("scale-negative", ValueError, "scale must be finite and > 0",
         lambda q, k, v: ((q, k, v), {"scale": -0.1})),
        ("scale-nan", ValueError, "scale must be finite and > 0",
         lambda q, k, v: ((q, k, v), {"scale": float("nan")})),
        ("scale-inf", ValueError, "scale must be finite and > 0",
         lambda q, k, v: ((q, k, v), {"scale": float("inf")})),
        ("scale-string", TypeError, "scale must be a real number",
         lambda q, k, v: ((q, k, v), {"scale": "0.1"})),
        ("causal-not-bool", TypeError, "causal must be a bool",
         lambda q, k, v: ((q, k, v), {"causal": "yes"})),
        ("unknown-backend", ValueError, "unknown backend 'gpu'; known: 'auto', 'cpu'",
         lambda q, k, v: ((q, k, v), {"backend": "gpu"})),
    ]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("name, exc, pattern, make", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_same_error_from_every_algorithm(rng, algorithm, name, exc, pattern, make):
    args, kwargs = make(*_ok(rng))
    with pytest.raises(exc, match=pattern):
        kernels.attention(*args, algorithm=algorithm, **kwargs)


def test_unknown_algorithm_lists_the_known(rng):
    with pytest.raises(ValueError, match="unknown algorithm 'tiled'; known: 'flash', 'standard'"):
        kernels.attention(*_ok(rng), algorithm="tiled")


# the oracle has no block sizes or backend; every other bad call must fail there the same way
_ORACLE_CALLS = [c for c in _bad_calls() if not c[0].startswith(("block", "unknown-backend"))]


@pytest.mark.parametrize("name, exc, pattern, make", _ORACLE_CALLS, ids=[c[0] for c in _ORACLE_CALLS])
def test_the_oracle_rejects_the_same_input(rng, name, exc, pattern, make):
    from kernels.attn import reference

    args, kwargs = make(*_ok(rng))
    with pytest.raises(exc, match=pattern):
        reference(*args, **kwargs)
