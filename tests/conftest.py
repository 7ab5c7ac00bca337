"""Shared test helpers: fresh random inputs and the per-dtype tolerance table."""
from __future__ import annotations

import os
import shutil
import zlib

# The Numba-CUDA tier runs under Numba's CUDA simulator where this machine has no NVIDIA GPU (the CI): Numba reads
# the variable when it is first imported, so it is set here, before anything imports Numba. Set
# NUMBA_ENABLE_CUDASIM=0 to force the real device, =1 to force the simulator.
if "NUMBA_ENABLE_CUDASIM" not in os.environ and not (os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi")):
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np
import pytest

from kernels.attn import _reference

# The tolerance table of kernels/attn/_reference.py (one per dtype; float16 by flash-attn's rule, see
# ``assert_close``), keyed by NumPy dtype here.
TOLERANCES = {np.dtype(name): tol for name, tol in _reference.TOLERANCES.items()}
LOW_PRECISION_FACTOR = _reference.LOW_PRECISION_FACTOR
UNIT_ROUNDOFF = {np.dtype(np.float16): _reference.UNIT_ROUNDOFF["float16"]}


@pytest.fixture
def rng(request):
    """A generator seeded from the test's id, so every test draws its own fresh, reproducible inputs."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


def assert_close(actual, reference, dtype, plain=None):
    """Compare with the oracle under the dtype's tolerance; for float16, ``plain`` is the plain-precision result."""
    dtype = np.dtype(dtype)
    actual = np.asarray(actual, dtype=np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    assert actual.shape == reference.shape
    assert np.array_equal(np.isnan(actual), np.isnan(reference)), "NaN pattern differs from the oracle"
    finite = np.isfinite(reference)
    assert np.array_equal(np.isfinite(actual), finite), "inf pattern differs from the oracle"
    assert np.array_equal(actual[~finite & ~np.isnan(reference)], reference[~finite & ~np.isnan(reference)])
    err = np.abs(actual[finite] - reference[finite])
    if dtype in TOLERANCES:
        tol = TOLERANCES[dtype]
        bound = tol["atol"] + tol["rtol"] * np.abs(reference[finite])
        worst = np.argmax(err - bound) if err.size else None
        assert np.all(err <= bound), (f"max error {err.max():.3g} exceeds atol {tol['atol']} + rtol "
                                      f"{tol['rtol']}·|ref| at |ref|={np.abs(reference[finite])[worst]:.3g}")
    else:
        plain_err = np.abs(np.asarray(plain, dtype=np.float64)[finite] - reference[finite]).max(initial=0.0)
        bound = LOW_PRECISION_FACTOR * plain_err + UNIT_ROUNDOFF[dtype] * np.abs(reference).max(initial=0.0)
        assert err.max(initial=0.0) <= bound, f"error {err.max():.3g} > 2 × plain {dtype} error {plain_err:.3g}"
