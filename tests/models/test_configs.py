"""Model presets and calculators against the parameter counts the models publish."""
from __future__ import annotations

import pytest

from models import get_config, kv_cache_bytes, kv_cache_bytes_per_token, parameter_count, weight_bytes

# parameter counts as published (model cards / papers), and as computed by hand from each config
PUBLISHED = {"gpt2": 124_439_808, "smollm2-135m": 134_515_008, "llama-2-7b": 6_738_415_616,
             "llama-3.1-8b": 8_030_261_248, "mistral-7b": 7_241_732_096, "llama-3.1-70b": 70_553_706_496}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_counts(name):
    assert parameter_count(get_config(name)) == PUBLISHED[name]


def test_weight_memory_per_precision():
    cfg = get_config("llama-2-7b")
    assert weight_bytes(cfg, "fp32") == 4 * PUBLISHED["llama-2-7b"]
    assert weight_bytes(cfg, "fp16") == 2 * PUBLISHED["llama-2-7b"]
    int8 = weight_bytes(cfg, "int8")
    # 32 blocks of 202,375,168 matrix weights at 1 B, plus float32 scales, plus 262 M embedding/head in fp16
    assert int8 == 32 * (202_375_168 + 4 * (4 * 4096 + 2 * 11008 + 4096)) + 2 * (2 * 32000 * 4096 + 65 * 4096)
    assert weight_bytes(cfg, "int4") < int8 < weight_bytes(cfg, "fp16")
    with pytest.raises(ValueError, match="unknown precision 'fp8'; known: fp32, fp16, int8, int4"):
        weight_bytes(cfg, "fp8")


def test_kv_cache_is_gqa_aware():
    assert kv_cache_bytes_per_token(get_config("smollm2-135m")) == 2 * 30 * 3 * 64 * 2  # 23,040 B
    assert kv_cache_bytes_per_token(get_config("llama-3.1-8b")) == 2 * 32 * 8 * 128 * 2  # 131,072 B
    assert kv_cache_bytes(get_config("llama-2-7b"), 4096, batch=2) == 2 * 4096 * 2 * 32 * 32 * 128 * 2


def test_unknown_model_lists_the_known():
    with pytest.raises(ValueError, match="unknown model 'llama-4'; known: gpt2, smollm2-135m"):
        get_config("llama-4")


@pytest.mark.parametrize("kwargs, pattern", [
    ({"tokens": -5}, "tokens must be a whole number >= 0"),  # −2621440 bytes before
    ({"tokens": 2.5}, "tokens must be a whole number >= 0"),  # a float before
    ({"tokens": 8, "batch": -1}, "batch must be a whole number >= 1"),
    ({"tokens": 8, "elem_bytes": -2}, "elem_bytes must be a finite number > 0"),
])
def test_the_calculators_refuse_counts_that_are_not_counts(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        kv_cache_bytes(get_config("smollm2-135m"), **kwargs)
    assert kv_cache_bytes(get_config("llama-2-7b"), 4096) == 2 * 32 * 32 * 128 * 2 * 4096  # 2 GiB at fp16
    assert kv_cache_bytes(get_config("llama-2-7b"), 4096, elem_bytes=0.5) == 2 * 32 * 32 * 128 * 4096 // 2  # int4


@pytest.mark.parametrize("field, value", [("n_layers", 2.5), ("hidden", "576"), ("n_heads", True),
                                          ("max_positions", -5), ("rope_base", float("nan")),
                                          ("tied_embeddings", 1)])
def test_a_config_refuses_fields_that_are_not_counts(field, value):
    import dataclasses

    with pytest.raises(ValueError, match=field):
        dataclasses.replace(get_config("smollm2-135m"), **{field: value})
