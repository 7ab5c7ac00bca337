"""The decode step of a Llama decoder on the CPU: one new token against a preallocated KV cache.

Two ways to run it, with the same outputs:
- per layer (``_fused``): the pieces outside the matmuls fused into serial Numba kernels — the residual add with
  RMSNorm (``add_rms_norm``), rotary embeddings with the cache write and the attention of the new query
  (``rope_attend``), the SwiGLU product (``swiglu``) — between the model's four linear layers per block;
- in one parallel region for the whole token (``LlamaDecodeStep``, ``_step``), where every launch of the pool costs
  a wake-up of its sleeping threads.

``huge_page_empty`` makes the arrays that a step streams from DRAM token after token (its weights, a KV cache) on
huge pages.
"""
from .._common.memory import huge_page_empty
from ._fused import add_rms_norm, rms_norm_reference, rope_attend, rope_reference, swiglu
from ._step import LlamaDecodeStep

__all__ = ["LlamaDecodeStep", "add_rms_norm", "huge_page_empty", "rms_norm_reference", "rope_attend",
           "rope_reference", "swiglu"]
