"""SmolLM2-135M on 2 cores: prefill of 1024 tokens, and decode tokens/s in fp32 and int8 beside the bound that
the weight bytes read per token and the copy bandwidth (measured in the same run) set."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("gguf", reason="the model extra is not installed: pip install -e .[model]")

from models.smollm2 import SmolLM2, evaluation_text  # noqa: E402


@pytest.mark.parametrize("linear, quantize_lm_head", [("fp32", False), ("int8", False), ("int8", True)],
                         ids=["fp32", "int8", "int8-head"])
def test_decode_tokens_per_second(benchmark, machine_peaks, record, linear, quantize_lm_head):
    model = SmolLM2(linear=linear, quantize_lm_head=quantize_lm_head)
    ids = model.encode(evaluation_text())[:1024]
    start = time.perf_counter()
    model.forward(ids, model.new_cache(), 0, logits=False)
    prefill_s = time.perf_counter() - start
    prompt = model.encode("Once upon a time")
    model.generate(prompt, 4)  # warm

    def decode_64():
        timings = {}
        out = model.generate(prompt, 64, timings=timings)
        return len(out) / timings["decode_s"]

    benchmark.pedantic(decode_64, rounds=3, warmup_rounds=0)
    tokens_per_s = decode_64()
    bytes_per_token = model.weight_bytes_per_token()
    bound = machine_peaks["copy_gbps"] * 1e9 / bytes_per_token
    record({"bench": "smollm2", "linear": linear + (" + int8 LM head" if quantize_lm_head else ""),
            "prefill_1024_s": f"{prefill_s:.2f}",
            "decode_tokens/s": f"{tokens_per_s:.1f}", "weight_MB/token": f"{bytes_per_token / 1e6:.0f}",
            "bound_tokens/s": f"{bound:.1f}", "of_bound": f"{tokens_per_s / bound:.2f}",
            "copy_GB/s": f"{machine_peaks['copy_gbps']:.1f}"})
