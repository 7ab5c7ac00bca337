"""What the algorithm sub-packages share, so that none of them imports another's private names.

- ``memory``: ``InsufficientMemoryError`` and the check that refuses host work that will not fit.
- ``dtypes``: the float dtypes every kernel accepts and the array checks that name the bad argument.
- ``dispatch``: one backend choice (``"auto"``, ``"cpu"``, ``"numba-cuda"``, ``"cupy"``) for every public function.
- ``numba_cpu``: bit casts between floats and integers and the vectorizable exp of the CPU kernels.
- ``gpu``: finding a device array, moving data, the device-memory and shared-memory checks (no GPU import at
  module import).
- ``numba_cuda``: device functions (block reductions) and the device cast of the Numba-CUDA kernels.
- ``cuda_c``: the CUDA C tier's loader (CuPy's RawModule over the ``.cu`` files).
"""
