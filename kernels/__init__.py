"""ioaware kernels: the IO-aware algorithms of LLM inference, callable on NumPy arrays.

``kernels.attention`` is exact attention (FlashAttention-2 on the CPU, or the standard algorithm); its float64
oracle is ``kernels.attn.reference``.
"""
from ._common.memory import InsufficientMemoryError
from .attn import attention

__all__ = ["InsufficientMemoryError", "attention"]
