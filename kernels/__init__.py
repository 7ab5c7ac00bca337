"""ioaware kernels: the IO-aware algorithms of LLM inference, callable on NumPy arrays.

``kernels.attention`` is exact attention (FlashAttention-2 on the CPU, or the standard algorithm); its float64
oracle is ``kernels.attn.reference``. ``kernels.pool_info()`` tells which threads run the kernels (see
``kernels/_threads.py`` for the threading design).
"""
from ._threads import configure_pool, pool_info

configure_pool()  # before any kernel runs: Numba's one pool, with threads that sleep when a call returns

from .attn import InsufficientMemoryError, attention  # noqa: E402

__all__ = ["InsufficientMemoryError", "attention", "pool_info"]
