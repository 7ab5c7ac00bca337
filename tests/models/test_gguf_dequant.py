"""models.gguf_dequant: the Q4_1 and Q8_0 blocks dequantized bit for bit as the gguf package does."""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the model extra (gguf) is not installed: pip install -e .[model]")

from models.gguf_dequant import Q4_1, Q4_1_BYTES, Q8_0, Q8_0_BYTES, dequantize  # noqa: E402


def _blocks(rng, shape, size):
    """Random raw blocks whose float16 fields are finite, of every magnitude float16 holds (and its subnormals)."""
    data = rng.integers(0, 256, size=shape[:-1] + (shape[-1] * size,), dtype=np.uint8)
    blocks = data.reshape(-1, size)
    halves = (rng.standard_normal((blocks.shape[0], 2)) * np.exp2(rng.integers(-24, 15, (blocks.shape[0], 2))))
    fields = halves.astype(np.float16).view(np.uint8).reshape(blocks.shape[0], 4)
    blocks[:, :4 if size == Q4_1_BYTES else 2] = fields[:, :4 if size == Q4_1_BYTES else 2]
    return data


@pytest.mark.parametrize("kind, size", [(Q4_1, Q4_1_BYTES), (Q8_0, Q8_0_BYTES)], ids=["Q4_1", "Q8_0"])
@pytest.mark.parametrize("shape", [(1,), (3,), (7, 1), (5, 18), (2, 3, 4)])  # blocks per row last
def test_equals_the_gguf_packages_dequantization_bit_for_bit(rng, kind, size, shape):
    data = _blocks(rng, shape, size)
    ours = dequantize(data, kind)
    ref = gguf.dequantize(data, kind).astype(np.float32)
    assert ours.dtype == np.float32 and ours.shape == ref.shape == shape[:-1] + (shape[-1] * 32,)
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_other_types_go_to_the_gguf_package(rng):
    data = rng.standard_normal((4, 6)).astype(np.float32)
    assert np.array_equal(dequantize(data, 0), data)  # F32
    halves = rng.standard_normal((3, 8)).astype(np.float16)
    np.testing.assert_array_equal(dequantize(halves, 1), halves.astype(np.float32))  # F16
