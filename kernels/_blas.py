"""Keep BLAS single-threaded while Numba's threads call it, so that the two thread pools do not oversubscribe."""
from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from threadpoolctl import ThreadpoolController


@functools.lru_cache(maxsize=1)
def _numba_blas():
    """The BLAS that Numba's ``np.dot`` calls: SciPy's (``scipy.linalg.cython_blas``).

    Only that one is limited: NumPy wheels bundle a BLAS of their own, and resizing its thread pool on every call
    wakes its threads, which then spin on the cores that Numba's threads need. Where both packages share one BLAS
    (a conda environment, say), that shared library is the one selected.
    """
    import scipy.linalg.cython_blas  # noqa: F401  (load it, so that the controller sees it)

    controller = ThreadpoolController().select(user_api="blas")
    scipy_libs = [lib for lib in controller.lib_controllers
                  if any(part.startswith("scipy") for part in Path(lib.filepath).parts)]
    if scipy_libs:
        controller.lib_controllers = scipy_libs
    return controller


@contextlib.contextmanager
def single_threaded_blas():
    """Limit Numba's BLAS to one thread inside the block (the Numba kernels call it from each of their threads).

    Through the library controllers' own get/set calls: 3.5 us per block, against 15 us for threadpoolctl's
    general ``limit`` (which a 90 us decode step over a pruned cache notices).
    """
    libs = _numba_blas().lib_controllers
    previous = [lib.get_num_threads() for lib in libs]
    for lib, n in zip(libs, previous):
        if n != 1:
            lib.set_num_threads(1)
    try:
        yield
    finally:
        for lib, n in zip(libs, previous):
            if n != 1:
                lib.set_num_threads(n)
