"""Keep BLAS single-threaded while Numba's threads call it, so that the two thread pools do not oversubscribe."""
from __future__ import annotations

import contextlib
import functools

from threadpoolctl import ThreadpoolController


@functools.lru_cache(maxsize=1)
def _controller() -> ThreadpoolController:
    # Numba's np.dot calls SciPy's BLAS; load it first so that the controller sees (and limits) it.
    import scipy.linalg.cython_blas  # noqa: F401

    return ThreadpoolController()


@contextlib.contextmanager
def single_threaded_blas():
    """Limit every loaded BLAS to one thread inside the block (the Numba kernels call BLAS from each thread)."""
    with _controller().limit(limits=1, user_api="blas"):
        yield
