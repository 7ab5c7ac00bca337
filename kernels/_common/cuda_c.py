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
    compiled together with ``all_names`` (every instance the launcher may ask the file for)."""
    return _module(str(source), tuple(all_names), tuple(options)).get_function(name_expression)


def compute_capability() -> int:
    """The current device's compute capability as an int (90 for an H100/H200, 80 for an A100)."""
    cupy = require_cupy()
    return int(cupy.cuda.Device().compute_capability)


def shared_memory_optin() -> int:
    """The most dynamic shared memory one block may opt into on the current device (227 KiB on sm_90; CUDA C++
    Programming Guide, "Technical Specifications per Compute Capability")."""
    cupy = require_cupy()
    attribute = cupy.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin
    return int(cupy.cuda.runtime.deviceGetAttribute(attribute, cupy.cuda.Device().id))


def check_optin_shared_memory(nbytes: int, what: str) -> None:
    """Refuse a launch whose dynamic shared memory exceeds what a block may opt into (the CUDA C kernels)."""
    limit = shared_memory_optin()
    if nbytes > limit:
        raise ValueError(f"{what} needs {nbytes} bytes of shared memory per block, above the device's {limit}")


def as_cupy(x, dtype=None):
    """A C-contiguous CuPy array of ``x`` (NumPy or any device array), in ``dtype`` when given."""
    cupy = require_cupy()
    x = cupy.asarray(x)
    if dtype is not None and x.dtype != np.dtype(dtype):
        x = x.astype(dtype)
    return cupy.ascontiguousarray(x)

