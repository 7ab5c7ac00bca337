"""One backend dispatch for attention, LLM.int8() and SnapKV (kernels/_common/dispatch.py): the same call gives the
same result shape and dtype, or the same error, on every tier, over dtypes; and the choice of tier for device
arrays, checked without a GPU on stand-in device arrays (the CUDA C tier itself is tested in test_cupy.py)."""
from __future__ import annotations

import numpy as np
import pytest

import kernels
from kernels import int8, kvprune
from kernels._common import dispatch, gpu
from kernels.attn._api import _cupy_refuses as attention_cupy_refuses
from kernels.kvprune._api import _gather_refuses

TIERS = ["cpu"] + (["numba-cuda"] if gpu.numba_cuda() is not None else [])
DTYPES = ["float16", "float32", "float64", "int32"]


def _calls(rng, dtype):
    """Each operation on small valid shapes (Nq != Nk, GQA, N not a multiple of any tile), by name."""
    def draw(*shape):
        return (rng.standard_normal(shape) * 2).astype(dtype)

    q, k, v = draw(1, 4, 9, 8), draw(1, 2, 9, 8), draw(1, 2, 9, 8)
    x, w = draw(3, 10), draw(5, 10)  # w (out, in)
    return {
        "attention": lambda backend: kernels.attention(q[:, :, -3:], k, v, causal=True, backend=backend),
        "int8_matmul": lambda backend: int8.int8_matmul(x, w, backend=backend),
        "snapkv_scores": lambda backend: kvprune.snapkv_scores(q[:, :, -2:], k, kernel_size=3, backend=backend),
        "snapkv_compress": lambda backend: kvprune.snapkv_compress(q, k, v, capacity=6, window=2, kernel_size=3,
                                                                   backend=backend),
        "streaming_llm": lambda backend: kvprune.streaming_llm(q, k, v, capacity=5, n_sink=2, backend=backend),
        "uniform_random": lambda backend: kvprune.uniform_random(q, k, v, capacity=5, seed=1, backend=backend),
    }


def _outcome(call, backend):
    try:
        result = call(backend)
    except (TypeError, ValueError) as err:
        return type(err), str(err)
    results = result if isinstance(result, tuple) else (result,)
    return tuple((r.shape, np.dtype(r.dtype)) for r in (gpu.to_host_array(r) for r in results))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("operation", list(_calls(np.random.default_rng(0), "float32")))
def test_every_tier_gives_the_same_outcome(rng, operation, dtype):
    call = _calls(rng, dtype)[operation]
    outcomes = {backend: _outcome(call, backend) for backend in TIERS}
    assert len(set(outcomes.values())) == 1, outcomes
    if dtype == "int32":
        assert outcomes["cpu"][0] is TypeError and "must have a floating dtype" in outcomes["cpu"][1]
    else:
        assert isinstance(outcomes["cpu"][0], tuple)  # a result, not an error


class _DeviceArray:
    """Stands in for a device array: what the dispatch reads (``__cuda_array_interface__``, dtype, shape)."""

    __cuda_array_interface__ = {}

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, np.dtype(dtype)


@pytest.fixture
def with_cupy(monkeypatch):
    monkeypatch.setattr(gpu, "cupy_module", lambda: object())  # "CuPy sees a device"


@pytest.mark.parametrize("dtype, d, block_q, expected", [
    ("float16", 64, None, "cupy"), ("float16", 128, None, "cupy"), ("float16", 80, None, "numba-cuda"),
    ("float32", 64, None, "numba-cuda"), ("float64", 64, None, "numba-cuda"), ("float16", 64, 32, "numba-cuda"),
])
def test_auto_puts_attention_on_tensor_cores_only_where_they_can_run_it(with_cupy, dtype, d, block_q, expected):
    q = _DeviceArray((1, 2, 16, d), dtype)
    refuses = lambda: attention_cupy_refuses(q, "flash", block_q, None)  # noqa: E731
    assert dispatch.choose_backend("attention", "auto", {"q": q}, cupy_refuses=refuses) == expected
    if expected == "numba-cuda":
        with pytest.raises(ValueError, match="backend='cupy' takes .*backend='numba-cuda' takes any"):
            dispatch.choose_backend("attention", "cupy", {"q": q}, cupy_refuses=refuses)


@pytest.mark.parametrize("dtype, expected", [("float16", "cupy"), ("float32", "cupy"), ("float64", "numba-cuda")])
def test_auto_sends_float64_snapkv_to_the_numba_cuda_tier(with_cupy, dtype, expected):
    # the CUDA C gather moves 2- and 4-byte elements: float64 reached {2: ..., 4: ...}[itemsize] (KeyError: 8)
    k = _DeviceArray((1, 2, 40, 8), dtype)
    refuses = lambda: _gather_refuses(k)  # noqa: E731
    assert dispatch.choose_backend("snapkv_compress", "auto", {"k": k}, cupy_refuses=refuses) == expected
    if expected == "numba-cuda":
        with pytest.raises(ValueError, match="backend='cupy' takes float16 or float32 k and v.*got float64"):
            dispatch.choose_backend("snapkv_compress", "cupy", {"k": k}, cupy_refuses=refuses)


def test_without_cupy_auto_runs_device_arrays_on_numba_cuda(monkeypatch):
    monkeypatch.setattr(gpu, "cupy_module", lambda: None)
    assert dispatch.choose_backend("int8_matmul", "auto", {"x": _DeviceArray((2, 4), "float32")}) == "numba-cuda"
    assert dispatch.choose_backend("int8_matmul", "auto", {"x": np.zeros((2, 4))}) == "cpu"


@pytest.mark.parametrize("backend, arrays, tiers, exc, message", [
    ("gpu", {}, dispatch.BACKENDS[1:], ValueError, "unknown backend 'gpu'; known: 'auto', 'cpu', 'numba-cuda'"),
    ("cpu", {"q": _DeviceArray((2, 2), "float32")}, dispatch.BACKENDS[1:], TypeError,
     "backend='cpu' takes NumPy arrays; q is a device array"),
    ("cupy", {}, ("cpu",), ValueError, "op has no 'cupy' tier; its backends: 'auto', 'cpu'"),
    ("auto", {"q": _DeviceArray((2, 2), "float32")}, ("cpu",), TypeError, "op runs on the CPU only; q is a device"),
])
def test_refusals_say_what_to_do(backend, arrays, tiers, exc, message):
    with pytest.raises(exc, match=message):
        dispatch.choose_backend("op", backend, arrays, tiers=tiers)


def test_h2o_refuses_device_arrays_and_gpu_tiers(rng):
    q, k, v = (rng.standard_normal((1, 2, 12, 4)).astype(np.float32) for _ in range(3))
    with pytest.raises(ValueError, match="h2o has no 'numba-cuda' tier"):
        kvprune.h2o(q, k, v, capacity=6, backend="numba-cuda")
    if gpu.numba_cuda() is not None:
        with pytest.raises(TypeError, match="h2o_scores runs on the CPU only"):
            kvprune.h2o_scores(gpu.to_numba(q), gpu.to_numba(k))


def test_the_baselines_run_on_device_arrays(rng):
    if gpu.numba_cuda() is None:
        pytest.skip("no CUDA device and NUMBA_ENABLE_CUDASIM is off")
    q, k, v = (rng.standard_normal((1, 2, 12, 4)).astype(np.float32) for _ in range(3))
    for fn in (kvprune.streaming_llm, kvprune.uniform_random):
        on_host = fn(q, k, v, capacity=5)
        on_device = fn(*(gpu.to_numba(x) for x in (q, k, v)), capacity=5)
        copied = fn(q, k, v, capacity=5, backend="numba-cuda")  # NumPy in, NumPy out
        assert gpu.is_device_array(on_device[0]) and all(isinstance(x, np.ndarray) for x in copied)
        for a, b, c in zip(on_host, on_device, copied):
            assert np.array_equal(a, gpu.to_host_array(b)) and np.array_equal(a, c)
