"""The CUDA C tier's loader: each ``.cu`` file beside its Python launcher is compiled by CuPy's ``RawModule``
(NVRTC) on first use, once per (file, template instances, compile options) and device architecture (CuPy adds
the architecture and caches the binary on disk), and its kernels are fetched by their C++ name expressions.

Imported lazily by the launchers; importing the package never imports CuPy.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from . import gpu as _gpu

COMPILE_OPTIONS = ("-std=c++17",)


def require_cupy():
    cupy = _gpu.cupy_module()
    if cupy is None:
        raise RuntimeError("backend 'cupy' needs CuPy and a CUDA device (pip install -e .[gpu]; on CUDA 13 install "
                           "cupy-cuda13x)")
    return cupy


@functools.lru_cache(maxsize=None)
def _module(path: str, name_expressions: tuple[str, ...], options: tuple[str, ...]):
    cupy = require_cupy()
    return cupy.RawModule(code=Path(path).read_text(), options=COMPILE_OPTIONS + options,
                          name_expressions=list(name_expressions))


def kernel(source: Path, name_expression: str, all_names: tuple[str, ...], options: tuple[str, ...] = ()):
    """The kernel ``name_expression`` (e.g. ``"ioaware::flash_forward<__half, 64, 64, 64>"``) of ``source``,
    compiled together with ``all_names`` (every instance the launcher may ask the file for), for the current
    device; fetched once (``RawModule.get_function`` costs tens of µs a call)."""
    return _function(str(source), name_expression, tuple(all_names), tuple(options), require_cupy().cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _function(path: str, name_expression: str, all_names: tuple[str, ...], options: tuple[str, ...], device: int):
    return _module(path, all_names, options).get_function(name_expression)


@functools.lru_cache(maxsize=None)
def _device_facts(device: int) -> dict:
    """What the launchers ask of a device, read once per device (each query is a driver call)."""
    cupy = require_cupy()
    optin = cupy.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin
    return {"compute_capability": int(cupy.cuda.Device(device).compute_capability),
            "shared_memory_optin": int(cupy.cuda.runtime.deviceGetAttribute(optin, device)),
            "multiprocessors": int(cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"])}


def compute_capability() -> int:
    """The current device's compute capability as an int (90 for an H100/H200, 80 for an A100)."""
    return _device_facts(require_cupy().cuda.Device().id)["compute_capability"]


def shared_memory_optin() -> int:
    """The most dynamic shared memory one block may opt into on the current device (227 KiB on sm_90; CUDA C++
    Programming Guide, "Technical Specifications per Compute Capability")."""
    return _device_facts(require_cupy().cuda.Device().id)["shared_memory_optin"]


def multiprocessor_count() -> int:
    """The current device's multiprocessors (132 on an H100 SXM or H200, as the device reports them)."""
    return _device_facts(require_cupy().cuda.Device().id)["multiprocessors"]


def check_launch_array(name: str, x, dtype, shape: tuple, align: int = 16) -> None:
    """Refuse what a bare launcher cannot take: not a CuPy array, another dtype or shape, not C-contiguous, or a
    data pointer off ``align`` bytes (the kernels read rows with 16-byte cp.async copies)."""
    cupy = require_cupy()
    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"{name} must be a CuPy array; got {type(x).__name__}")
    if x.dtype != np.dtype(dtype):
        raise TypeError(f"{name} must be {np.dtype(dtype)}; got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}; got {tuple(x.shape)}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (a view with strides {x.strides} was passed)")
    if x.size and x.data.ptr % align:
        raise ValueError(f"{name}'s data must start on a {align}-byte boundary (its pointer is {x.data.ptr:#x})")


def check_optin_shared_memory(nbytes: int, what: str) -> None:
    """Refuse a launch whose dynamic shared memory exceeds what a block may opt into (the CUDA C kernels)."""
    limit = shared_memory_optin()
    if nbytes > limit:
        raise ValueError(f"{what} needs {nbytes} bytes of shared memory per block, above the device's {limit}")


def as_cupy(x, dtype=None):
    """A C-contiguous CuPy array of ``x`` (NumPy or any device array), in ``dtype`` when given, starting on a
    16-byte boundary (a view into the middle of a buffer is copied: the kernels read rows with 16-byte copies)."""
    cupy = require_cupy()
    x = cupy.asarray(x)
    if dtype is not None and x.dtype != np.dtype(dtype):
        x = x.astype(dtype)
    x = cupy.ascontiguousarray(x)
    return x.copy() if x.size and x.data.ptr % 16 else x

