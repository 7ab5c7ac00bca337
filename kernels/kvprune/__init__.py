"""KV-cache pruning: SnapKV (Li et al. 2024) and the StreamingLLM, H2O and uniform random baselines, with a float64
oracle."""
from ._api import (GQA_MODES, POOLINGS, h2o, h2o_scores, snapkv_compress, snapkv_scores, streaming_llm,
                   top_positions, uniform_random)
from ._reference import snapkv_kept_reference, snapkv_scores_reference, top_positions_reference

__all__ = ["GQA_MODES", "POOLINGS", "h2o", "h2o_scores", "snapkv_compress", "snapkv_kept_reference",
           "snapkv_scores", "snapkv_scores_reference", "streaming_llm", "top_positions", "top_positions_reference",
           "uniform_random"]
