"""ioaware models: model configurations and calculators (parameters, weight memory, KV cache). The small real
LLM on the ioaware kernels is planned."""
from .configs import (PRESETS, ModelConfig, get_config, kv_cache_bytes, kv_cache_bytes_per_token, parameter_count,
                      weight_bytes)

__all__ = ["PRESETS", "ModelConfig", "get_config", "kv_cache_bytes", "kv_cache_bytes_per_token",
           "parameter_count", "weight_bytes"]
