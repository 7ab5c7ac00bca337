"""ioaware models: model configurations and calculators (parameters, weight memory, KV cache), and
SmolLM2-135M-Instruct on the ioaware kernels (``models.smollm2``, which needs the ``model`` extra)."""
from .configs import (PRESETS, ModelConfig, get_config, kv_cache_bytes, kv_cache_bytes_per_token, parameter_count,
                      weight_bytes)

__all__ = ["PRESETS", "ModelConfig", "get_config", "kv_cache_bytes", "kv_cache_bytes_per_token",
           "parameter_count", "weight_bytes"]
