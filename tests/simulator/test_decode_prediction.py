"""The report's prediction of a SmolLM2 decode token (``simulator.report.model.predicted_seconds_per_token``: the
weight bytes at the one-region step's calibrated streaming rates, the outlier features' float16 products, the
step's fixed part timed without its weights) against the decode measured on this machine, within issue 16's 25%; a
burst from other processes gets up to two more calibrations and measurements."""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the model extra (gguf, tokenizers) is not installed: pip install -e .[model]")
pytest.importorskip("tokenizers", reason="the model extra (gguf, tokenizers) is not installed: pip install -e .[model]")

from kernels._common.numba_cpu import target_features  # noqa: E402
from models.smollm2 import SmolLM2  # noqa: E402
from simulator.calibrate import dram_test_bytes, filled  # noqa: E402
from simulator.report.model import (DECODE_TOKENS, PROMPT, decode_token_parts,  # noqa: E402
                                    predicted_seconds_per_token, step_rates)

TOLERANCE = 0.25  # issue 16: predicted within 25% of measured on the CPU


def _rates(model):
    """The step's calibrated rates for ``model``, as the report predicts with them
    (``simulator.report.model.step_rates``), and the outliers' rate."""
    buffer = filled(dram_test_bytes() // 4, 1.0, np.float32)
    return SimpleNamespace(**step_rates(model, buffer, outliers=True))


def _seconds_per_token(model):
    """The best of three decodes' seconds per token, and the mean context its tokens attended to: the streaming
    rates are their calibration's best of three too (as in test_phases, best against best: a median against
    best-case rates would be off by the load from other processes, not by the model)."""
    prompt = model.encode(PROMPT)
    times = []
    for _ in range(3):
        timings = {}
        out = model.generate(prompt, DECODE_TOKENS, timings=timings)
        times.append(timings["decode_s"] / len(out))
    return min(times), len(prompt) + (len(out) - 1) // 2


@pytest.mark.alone  # it times the machine: under pytest-xdist, no other test meanwhile
@pytest.mark.parametrize("linear, quantize_lm_head", [("fp32", False), ("int8", True)], ids=["fp32", "int8-head"])
def test_the_predicted_decode_token_is_within_a_quarter_of_the_measured(gguf_path, linear, quantize_lm_head):
    if linear == "fp32" and not {"avx2", "fma"} <= target_features():
        pytest.skip("without AVX2 and FMA the float32 step takes longer than its weights' streaming rate predicts "
                    "(29% with NUMBA_CPU_FEATURES of x86-64-v2), not yet explained: the prediction is for AVX2 targets")
    model = SmolLM2(gguf_path, linear=linear, quantize_lm_head=quantize_lm_head)
    model.generate(model.encode(PROMPT), 2)  # compile, warm, build the step
    for attempt in range(3):  # this shared machine's bandwidth drifts between a calibration and a measurement
        measured, context = _seconds_per_token(model)
        parts = decode_token_parts(model, _rates(model), context)
        predicted = sum(parts.values())
        if abs(predicted / measured - 1) <= TOLERANCE:
            break
        time.sleep(1.0)
    assert abs(predicted / measured - 1) <= TOLERANCE, (measured, parts)


def test_the_prediction_counts_the_outliers_and_the_fixed_part(gguf_path):
    model = SmolLM2(gguf_path, linear="int8", quantize_lm_head=True)
    model.generate(model.encode(PROMPT), 4)
    rates = SimpleNamespace(step_fp32_dram=1e10, step_int8_dram=1e10, step_outlier_s=1e-9)
    parts = decode_token_parts(model, rates, 8)
    assert parts["streaming_s"] == pytest.approx(model.weight_bytes_per_token() / 1e10)
    assert parts["outliers_s"] > 0  # SmolLM2's hidden states have features past the threshold of 6
    assert 0 < parts["fixed_s"] < parts["streaming_s"]
    # the fixed part holds the attention: over 1000 cached tokens it reads 30 x 2 x 3 x 1000 x 64 floats more
    assert decode_token_parts(model, rates, 1000)["fixed_s"] > parts["fixed_s"] + 0.2e-3


def test_the_outliers_are_shared_by_no_more_threads_than_cpus(gguf_path, monkeypatch):
    """With more threads than CPUs (NUMBA_NUM_THREADS=3 on two), the outliers' products run on the CPUs there are."""
    import numba

    from kernels._common import affinity

    if numba.get_num_threads() < 2:
        pytest.skip("needs a pool of 2 threads or more (on one, the CPUs and the threads are as many)")
    model = SmolLM2(gguf_path, linear="int8", quantize_lm_head=True)
    model.generate(model.encode(PROMPT), 4)
    rates = SimpleNamespace(step_fp32_dram=1e10, step_int8_dram=1e10, step_outlier_s=1e-9)
    monkeypatch.setattr(affinity, "pool_cpu_count", lambda: 1)
    products = model._one_region_step().outlier_products
    assert decode_token_parts(model, rates, 8)["outliers_s"] == pytest.approx(products * 1e-9)


def test_a_model_that_decodes_layer_by_layer_is_not_predicted(gguf_path):
    model = SmolLM2(gguf_path, linear="int8", keep_fp16_weights=True)
    with pytest.raises(ValueError, match="one parallel region"):
        predicted_seconds_per_token(model, SimpleNamespace(step_fp32_dram=1e10, step_int8_dram=1e10,
                                                           step_outlier_s=1e-9), 8)
