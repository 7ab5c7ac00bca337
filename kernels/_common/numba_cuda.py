"""What the Numba-CUDA kernels share: block-wide reductions through shared memory (device functions), and the
fill, dtype cast and finite check of device arrays. Imported lazily, with the kernels; Numba's simulator swaps this module's
``cuda`` for its own, as it does the kernels'."""
from __future__ import annotations

import functools
import math

import numpy as np

from . import gpu

gpu.restore_numpy_aliases()  # before Numba's CUDA typing loads (gpu.py)
from numba import cuda  # noqa: E402

ELEMENTWISE_THREADS = 256  # threads per block of the one-thread-per-element fill and cast


@cuda.jit(device=True)
def block_max(red, value):
    """The maximum of ``value`` over the block's threads, through the shared array ``red`` (one slot per thread;
    a power-of-two count); every thread gets it. A tree of log2(threads) levels with a barrier after each."""
    t = cuda.threadIdx.x
    red[t] = value
    cuda.syncthreads()  # every value written
    width = red.shape[0] // 2
    while width > 0:
        if t < width:
            red[t] = max(red[t], red[t + width])
        cuda.syncthreads()  # this level done before the next reads it
        width //= 2
    result = red[0]
    cuda.syncthreads()  # every thread has read the result before red is written again
    return result


@cuda.jit(device=True)
def block_sum(red, value):
    """The sum of ``value`` over the block's threads, as ``block_max``."""
    t = cuda.threadIdx.x
    red[t] = value
    cuda.syncthreads()  # every value written
    width = red.shape[0] // 2
    while width > 0:
        if t < width:
            red[t] += red[t + width]
        cuda.syncthreads()  # this level done before the next reads it
        width //= 2
    result = red[0]
    cuda.syncthreads()  # every thread has read the result before red is written again
    return result


@functools.lru_cache(maxsize=None)
def _elementwise_kernels():

    @cuda.jit
    def fill_kernel(x, value):
        i = cuda.grid(1)
        if i < x.size:
            x[i] = value

    @cuda.jit
    def cast_kernel(src, dst):
        i = cuda.grid(1)
        if i < src.size:
            dst[i] = src[i]

    @cuda.jit
    def count_nonfinite(x, count):
        """count[0] += the number of NaN or ±inf elements of the flat array x."""
        i = cuda.grid(1)
        if i < x.size and not math.isfinite(x[i]):
            cuda.atomic.add(count, 0, 1)

    return fill_kernel, cast_kernel, count_nonfinite


def fill(x, value):
    """Set every element of the device array ``x`` to ``value`` (one thread per element)."""
    kernel = _elementwise_kernels()[0]
    if x.size:
        kernel[gpu.launch_1d(x.size, ELEMENTWISE_THREADS)](x.reshape(x.size), value)


def cast(x, dtype):
    """A contiguous device copy of device array ``x`` in ``dtype`` (or ``x`` itself when it already is)."""
    if np.dtype(x.dtype) == np.dtype(dtype):
        return x
    out = cuda.device_array(x.shape, dtype=dtype)
    if x.size:
        kernel = _elementwise_kernels()[1]
        kernel[gpu.launch_1d(x.size, ELEMENTWISE_THREADS)](x.reshape(x.size), out.reshape(x.size))
    return out


def all_finite(x) -> bool:
    """Whether the contiguous device array ``x`` holds no NaN or ±inf (one pass, an atomic counter)."""
    if x.size == 0:
        return True
    count = cuda.to_device(np.zeros(1, dtype=np.int32))
    _elementwise_kernels()[2][gpu.launch_1d(x.size, ELEMENTWISE_THREADS)](x.reshape(x.size), count)
    return int(count.copy_to_host()[0]) == 0
