"""Device functions the Numba-CUDA kernels share: block-wide reductions through shared memory (imported lazily,
with the kernels; Numba's simulator swaps this module's ``cuda`` for its own, as it does the kernels')."""
from __future__ import annotations

from numba import cuda


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
