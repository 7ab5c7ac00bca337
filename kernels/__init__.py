"""ioaware kernels: the IO-aware algorithms of LLM inference, on NumPy arrays (CPU) and device arrays (GPU).

``kernels.attention`` is exact attention (FlashAttention-2, or the standard algorithm) on three tiers: Numba on
the CPU, Numba-CUDA, and CUDA C on tensor cores through CuPy; its float64 oracle is ``kernels.attn.reference``.
``kernels.int8`` (LLM.int8()) and ``kernels.kvprune`` (SnapKV and its baselines) have the same tiers and the
same ``backend`` argument. ``kernels.cpuinfo`` tells this machine's caches; ``kernels.tolerances`` how close every
kernel must come to its oracle; ``kernels.pool_info()`` which threads run the CPU kernels (the threading design:
``kernels/_common/threads.py``).
"""
from ._common import numba_cache
from ._common.threads import configure_pool, pool_info

numba_cache.install()  # before any cached kernel is defined: a change to any file of kernels recompiles them all
configure_pool()  # before any kernel runs: Numba's one pool, with threads that sleep when a call returns

from ._common.memory import InsufficientMemoryError  # noqa: E402
from .attn import attention  # noqa: E402

__all__ = ["InsufficientMemoryError", "attention", "pool_info"]
