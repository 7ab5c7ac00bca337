"""What the GPU tiers share: finding a device array, moving data, the shared-memory and memory checks.

Nothing here imports a GPU package at module import: Numba's CUDA target and CuPy load on first use, so the
package imports and the tests collect on machines without either. Under ``NUMBA_ENABLE_CUDASIM=1`` Numba's CUDA
simulator stands in for a device (the CI runs the Numba-CUDA kernels that way, at tiny sizes).
"""
from __future__ import annotations

import functools
import os

import numpy as np

from .memory import InsufficientMemoryError

# Static shared memory per block on every CUDA GPU since compute capability 2.0; more needs an explicit opt-in
# (CUDA C++ Programming Guide, "Compute Capabilities", table "Technical Specifications per Compute Capability":
# maximum shared memory per block 48 KB without opt-in).
STATIC_SHARED_LIMIT = 48 * 1024


def simulated() -> bool:
    """True under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def restore_numpy_aliases() -> None:
    """NumPy's ``row_stack`` (an alias of ``vstack``) back where NumPy no longer has it. numba-cuda 0.30 registers an
    overload for it when its CUDA typing first loads (``numba/cuda/np/arrayobj.py``), so without it no Numba-CUDA
    kernel compiles: the first GPU check (NumPy 2.5.2, numba-cuda 0.30.4, an H200) failed every Numba-CUDA row with
    "module 'numpy' has no attribute 'row_stack'". Only the missing name is added, naming the function it named."""
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack


@functools.lru_cache(maxsize=1)
def numba_cuda():
    """Numba's CUDA module (from the numba-cuda package when installed), or None when no device can run it."""
    restore_numpy_aliases()  # before Numba's CUDA typing loads
    try:
        from numba import cuda
    except ImportError:
        return None
    try:
        return cuda if cuda.is_available() else None
    except Exception:  # a driver that fails to initialize is "no device" here, not an error at import time
        return None


def cupy_module():
    """CuPy if it imports and sees a device, else None."""
    try:
        import cupy
    except ImportError:
        return None
    try:
        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:
        return None


def is_device_array(x) -> bool:
    """An array in GPU memory: anything exposing ``__cuda_array_interface__`` (CuPy, Numba, PyTorch), or a Numba
    simulator array under ``NUMBA_ENABLE_CUDASIM=1``."""
    if hasattr(x, "__cuda_array_interface__"):
        return True
    return simulated() and type(x).__name__ == "FakeCUDAArray"


def require_numba_cuda():
    cuda = numba_cuda()
    if cuda is None:
        raise RuntimeError("backend 'numba-cuda' needs a CUDA device and the numba-cuda package "
                           "(pip install -e .[gpu]); or set NUMBA_ENABLE_CUDASIM=1 for Numba's simulator")
    return cuda


def to_numba(x):
    """A Numba device array viewing device memory ``x`` (no copy), or a copy of the NumPy array ``x`` on the
    device."""
    cuda = require_numba_cuda()
    if isinstance(x, np.ndarray):
        return cuda.to_device(np.ascontiguousarray(x))
    if simulated() and type(x).__name__ == "FakeCUDAArray":
        return x
    return cuda.as_cuda_array(x)


def contiguous(x):
    """Device array ``x`` in C order: itself when it already is, else a copy (CuPy makes it)."""
    flags = getattr(x, "flags", None)
    if flags is not None and (flags["C_CONTIGUOUS"] if hasattr(flags, "__getitem__") else flags.c_contiguous):
        return x
    if hasattr(x, "is_c_contiguous") and x.is_c_contiguous():
        return x
    cupy = cupy_module()
    if cupy is None:
        raise ValueError("device arrays must be C-contiguous (install CuPy to have them copied)")
    return cupy.ascontiguousarray(cupy.asarray(x))


def to_host_array(x) -> np.ndarray:
    """A NumPy copy of a device array (or the array itself when it already is NumPy)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    if hasattr(x, "get"):  # CuPy
        return x.get()
    return to_numba(x).copy_to_host()


def like_input(result, inputs_on_host: bool):
    """Hand a Numba device array back the way the caller passed the inputs: NumPy for NumPy inputs; a CuPy array
    (zero copy) for device inputs when CuPy is installed, else the Numba device array."""
    if inputs_on_host:
        return result.copy_to_host()
    if simulated():
        return result
    cupy = cupy_module()
    return cupy.asarray(result) if cupy is not None else result


def shared_memory_limit() -> int:
    """Bytes of shared memory one block may use without an opt-in on the current device."""
    cuda = require_numba_cuda()
    limit = getattr(cuda.get_current_device(), "MAX_SHARED_MEMORY_PER_BLOCK", None)
    return min(int(limit), STATIC_SHARED_LIMIT) if limit else STATIC_SHARED_LIMIT


def check_static_shared_memory(nbytes: int, what: str) -> None:
    """Refuse a launch whose tiles need more static shared memory than a block may have without an opt-in (the
    Numba-CUDA kernels), naming the tiles' bytes."""
    limit = shared_memory_limit()
    if nbytes > limit:
        raise ValueError(f"{what} needs {nbytes} bytes of shared memory per block, above the device's {limit}; "
                         f"choose smaller tiles")


def free_device_bytes(tier: str) -> float:
    """Bytes that can be allocated on the device now: what the driver reports free, and for CuPy also what its
    memory pool holds but no array uses."""
    if tier == "cupy":
        cupy = cupy_module()
        free, _ = cupy.cuda.runtime.memGetInfo()
        return free + cupy.get_default_memory_pool().free_bytes()
    free, _ = require_numba_cuda().current_context().get_memory_info()
    return free


def ensure_device_fits(nbytes: int, what: str, tier: str = "numba-cuda") -> None:
    """Refuse, before allocating, work whose device memory exceeds what is free on the device."""
    free = free_device_bytes(tier)
    if nbytes > free:
        raise InsufficientMemoryError(f"{what} would allocate {nbytes / 2**30:.2f} GiB on the GPU, but only "
                                      f"{free / 2**30:.2f} GiB is free")


def blocks(n: int, threads: int) -> int:
    """Blocks of ``threads`` threads that cover ``n`` items (at least one)."""
    return max(1, -(-n // threads))


def launch_1d(n: int, threads: int) -> tuple[int, int]:
    """A Numba launch configuration (blocks, threads) with one thread per item."""
    return blocks(n, threads), threads
