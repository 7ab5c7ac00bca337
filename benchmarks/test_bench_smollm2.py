"""SmolLM2-135M on 2 cores: prefill of 1024 tokens, and decode tokens/s in fp32, int8 and int8 with the int8 LM
head, beside the bound that the weight bytes read per token and the all-core read bandwidth set, and as ratios to
fp32 measured in the same run. The read bandwidth (``simulator.calibrate.read_bandwidth_of``, the best of five
reads of a DRAM-sized buffer) is measured in turn with the decode runs, and ``of_bound`` is the median over the
rounds of each run's rate against the read beside it: a VM's memory speed drifts by a third over minutes (read
22.9-37.2 GB/s over six rounds of two consecutive processes on a 2-vCPU AMD EPYC, 28.1-46.1 within one run of
this benchmark), and a bound read once at the start of a run measured another machine than the decode it bounds.

Targets of issue 17: int8 prefill faster than fp32; fp32 decode >= 0.9 of its bound; int8 with the int8 LM head
>= 2.5x fp32's decode tokens/s (``test_int8_head_against_fp32_decode_in_turn``: the two taken in turn). Beside the
bound, ``of_weights_read``: the weight bytes per token at the decode rate over a plain read of the step's own weight
arrays, measured in turn with the decode runs. After a long prompt
(int8 with the int8 LM head), each token also reads the whole KV cache: its bound counts those bytes too, and
``fixed_ms`` is the step without its weight rows at that context (``LlamaDecodeStep.fixed_seconds``: the attention
over the cache, the norms, the hand-offs).
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the model extra is not installed: pip install -e .[model]")

from kernels.cpuinfo import cpu_model  # noqa: E402
from kernels.decode._layout import TASKS_PER_THREAD  # noqa: E402
from kernels.int8 import _api as int8_api  # noqa: E402
from models.configs import kv_cache_bytes  # noqa: E402
from models.smollm2 import SmolLM2, evaluation_text  # noqa: E402
from simulator.calibrate import dram_test_bytes, filled, read_once  # noqa: E402

from helpers import beside_reads, in_turn  # noqa: E402

PREFILL_TOKENS = 1024
DECODE_TOKENS = 64
FP32 = {}  # fp32's prefill and decode tokens/s, for the ratios of the int8 rows of the same run


ROUNDS = 3  # decode runs, each beside a read of the buffer and of the step's weights


@pytest.fixture(scope="module")
def read_buffer():
    """The buffer of the all-core reads (``simulator.calibrate.dram_test_bytes``: twice the largest cache), its
    pages mapped once."""
    return filled(dram_test_bytes() // 4, 1.0, np.float32)


def _weights_read_bytes_per_s(model, passes=5):
    """Bytes/s of plain all-core reads (``simulator.calibrate.read_once``) of the decode step's own weight
    arrays, one after the other as a token reads them; the median of ``passes`` passes over all of them: the rate
    the step would stream at if its products and steps cost nothing."""
    step = model._one_region_step()
    head = step.stacks["head"]
    arrays = [a.reshape(-1).view(np.float32)  # int8: the weights as the step reads them (rows, panels), not scales
              for a in (step.block_weights, step._head8 if isinstance(head, tuple) else head)]

    def one_pass():
        start = time.perf_counter()
        read_once(*arrays)
        return time.perf_counter() - start

    one_pass()  # compile, warm
    return sum(a.nbytes for a in arrays) / float(np.median([one_pass() for _ in range(passes)]))


@pytest.mark.parametrize("linear, quantize_lm_head", [("fp32", False), ("int8", False), ("int8", True)],
                         ids=["fp32", "int8", "int8-head"])
def test_decode_tokens_per_second(benchmark, read_buffer, record, linear, quantize_lm_head):
    model = SmolLM2(linear=linear, quantize_lm_head=quantize_lm_head)
    ids = model.encode(evaluation_text())[:PREFILL_TOKENS]
    prefill_s = []
    for _ in range(2):  # the first also compiles what the cache lacks
        start = time.perf_counter()
        model.forward(ids, model.new_cache(PREFILL_TOKENS), 0, logits=False)
        prefill_s.append(time.perf_counter() - start)
    prompt = model.encode("Once upon a time")
    model.generate(prompt, 4)  # warm

    def decode():
        timings = {}
        out = model.generate(prompt, DECODE_TOKENS, timings=timings)
        return len(out) / timings["decode_s"]

    benchmark.pedantic(decode, rounds=3, warmup_rounds=0)
    # decode, the all-core read and a plain read of the same weights, taken in turn (this VM's bandwidth drifts)
    rates, reads, weights_read = beside_reads(decode, read_buffer, ROUNDS, lambda: _weights_read_bytes_per_s(model))
    tokens_per_s, read_gbps = float(np.median(rates)), float(np.median(reads)) / 1e9
    prefill_tokens_per_s = PREFILL_TOKENS / min(prefill_s)
    bytes_per_token = model.weight_bytes_per_token()
    bound = read_gbps * 1e9 / bytes_per_token  # tokens/s if each decode step only streamed its weights once
    of_bound = float(np.median([r * bytes_per_token / b for r, b in zip(rates, reads)]))  # each beside its read
    of_weights_read = float(np.median([r * bytes_per_token / b for r, b in zip(rates, weights_read)]))
    if linear == "fp32":
        FP32.update(prefill=prefill_tokens_per_s, decode=tokens_per_s)
    row = {"bench": "smollm2", "linear": linear + (" + int8 LM head" if quantize_lm_head else ""),
           "prefill_tokens/s": f"{prefill_tokens_per_s:.0f}", "decode_tokens/s": f"{tokens_per_s:.1f}",
           "weight_MB/token": f"{bytes_per_token / 1e6:.0f}", "bound_tokens/s": f"{bound:.1f}",
           "of_bound": f"{of_bound:.2f}", "read_GB/s": _spread(reads),
           "weights_read_GB/s": _spread(weights_read), "of_weights_read": f"{of_weights_read:.2f}",
           "rounds_tokens/s": "/".join(f"{r:.1f}" for r in rates),
           "int8_path": int8_api.product_path() if linear == "int8" else "",
           "cpu": f"{cpu_model()} x{os.cpu_count()}"}
    if linear != "fp32" and FP32:
        row.update({"prefill_vs_fp32": f"{prefill_tokens_per_s / FP32['prefill']:.2f}x",
                    "decode_vs_fp32": f"{tokens_per_s / FP32['decode']:.2f}x"})
    record(row)


IN_TURN_ROUNDS = 7  # pairs of decode runs, fp32 and int8 + int8 LM head back to back
PREFILL_IN_TURN = 3  # of those rounds, the first three also prefill PREFILL_TOKENS tokens with each model


def test_int8_head_against_fp32_decode_in_turn(benchmark, record):
    """Issue 17's ratios (int8 with the int8 LM head >= 2.5x fp32's decode tokens/s; int8 prefill faster than fp32)
    from runs taken in turn, the two models loaded in one process and each round's order swapped, so that both meet
    the same phases of the machine (the prefill does not read the LM head: int8 and int8 + head prefill alike). The
    ``decode_vs_fp32`` column of ``test_decode_tokens_per_second`` compares runs a minute apart: on a 2-vCPU AMD
    EPYC its fp32 rounds once ran at 74/71/52 tokens/s beside reads of 32-50 GB/s and, a minute later in the same
    run, the int8 + head rounds at 155/157/165 beside reads of 32-34 GB/s."""
    models = {"fp32": SmolLM2(linear="fp32"), "int8-head": SmolLM2(linear="int8", quantize_lm_head=True)}
    prompt = models["fp32"].encode("Once upon a time")

    def decode(name):
        timings = {}
        out = models[name].generate(prompt, DECODE_TOKENS, timings=timings)
        return len(out) / timings["decode_s"]

    ids = models["fp32"].encode(evaluation_text())[:PREFILL_TOKENS]

    def prefill(name):
        start = time.perf_counter()
        models[name].forward(ids, models[name].new_cache(PREFILL_TOKENS), 0, logits=False)
        return PREFILL_TOKENS / (time.perf_counter() - start)

    for name in models:
        decode(name), prefill(name)  # compile, warm
    rates = {name: [] for name in models}
    prefills = {name: [] for name in models}

    def rounds():
        for r in range(IN_TURN_ROUNDS):
            for name in in_turn(("fp32", "int8-head"), r):
                rates[name].append(decode(name))
                if r < PREFILL_IN_TURN:
                    prefills[name].append(prefill(name))

    benchmark.pedantic(rounds, rounds=1, warmup_rounds=0)
    ratios = [i / f for f, i in zip(rates["fp32"], rates["int8-head"])]
    prefill_ratios = [i / f for f, i in zip(prefills["fp32"], prefills["int8-head"])]
    record({"bench": "smollm2-in-turn", "rounds": IN_TURN_ROUNDS,
            "fp32_tokens/s": f"{np.median(rates['fp32']):.1f} ({min(rates['fp32']):.1f}-{max(rates['fp32']):.1f})",
            "int8_head_tokens/s": f"{np.median(rates['int8-head']):.1f} ({min(rates['int8-head']):.1f}-"
                                  f"{max(rates['int8-head']):.1f})",
            "int8_head_vs_fp32": f"{np.median(ratios):.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}x)",
            "of_medians": f"{np.median(rates['int8-head']) / np.median(rates['fp32']):.2f}x",
            "prefill_int8_vs_fp32": f"{np.median(prefill_ratios):.2f}x (rounds {min(prefill_ratios):.2f}-"
                                    f"{max(prefill_ratios):.2f}x, {PREFILL_TOKENS} tokens)",
            "int8_path": int8_api.product_path(), "cpu": f"{cpu_model()} x{os.cpu_count()}"})


TASK_COUNTS = (TASKS_PER_THREAD, *sorted({4, 2, 1} - {TASKS_PER_THREAD}, reverse=True))  # tasks per thread of a
# linear step (``LlamaDecodeStep.tasks_per_thread``): the default first, then the others of four, two and one
TASK_ROUNDS = 40  # rounds of decode runs, one per count in each, the order reversed every other round


@pytest.mark.parametrize("linear, quantize_lm_head", [("int8", True), ("fp32", False)], ids=["int8-head", "fp32"])
def test_tasks_per_thread_in_turn(benchmark, record, linear, quantize_lm_head):
    """The decode step's tasks per thread (``kernels/decode/_step.py``, v16): each count's plan in turn in one
    process, the same compiled step, so that every round meets one phase of the machine; each round's rate over
    the default's in that round (``paired``), their median and how many rounds were faster. On a 2-vCPU AMD EPYC
    (Zen 3) one task per thread ran the int8 + int8 head step 1.04-1.08x as fast as four in five runs (faster in 27
    to 39 rounds of 40), fp32 1.01-1.02x. The model's step chooses its count by a shorter timing of the same kind
    when it is built (v17, ``LlamaDecodeStep.tune_tasks_per_thread``); this is the longer comparison to check that
    choice against."""
    model = SmolLM2(linear=linear, quantize_lm_head=quantize_lm_head)
    prompt = model.encode("Once upon a time")
    step = model._one_region_step()
    tuned = step.tasks_per_thread  # the count its tuning kept when the model built it
    rates = {count: [] for count in TASK_COUNTS}

    def decode(count):
        step.tasks_per_thread = count
        timings = {}
        out = model.generate(prompt, DECODE_TOKENS, timings=timings)
        return len(out) / timings["decode_s"]

    def rounds():
        for r in range(TASK_ROUNDS):
            for count in in_turn(TASK_COUNTS, r):
                rates[count].append(decode(count))

    try:
        for count in TASK_COUNTS:
            decode(count)  # compile, warm
        benchmark.pedantic(rounds, rounds=1, warmup_rounds=0)
    finally:
        step.tasks_per_thread = tuned
    base = rates[TASK_COUNTS[0]]
    for count in TASK_COUNTS:
        row = {"bench": "smollm2-tasks-per-thread", "linear": linear, "int8_head": quantize_lm_head,
               "tasks_per_thread": count, "tuned_count": tuned, "rounds": TASK_ROUNDS,
               "tokens/s": f"{np.median(rates[count]):.1f} ({min(rates[count]):.1f}-{max(rates[count]):.1f})"}
        if count != TASK_COUNTS[0]:  # each round's rate over the default's in that round
            paired = [r / b for b, r in zip(base, rates[count])]
            row.update({f"paired_vs_{TASK_COUNTS[0]}": f"{np.median(paired):.3f}",
                        "faster_rounds": f"{sum(p > 1 for p in paired)}/{TASK_ROUNDS}"})
        record({**row, "cpu": f"{cpu_model()} x{os.cpu_count()}"})


@pytest.mark.parametrize("prompt_tokens", [1024, 4096])
def test_decode_tokens_per_second_after_a_long_prompt(benchmark, read_buffer, record, prompt_tokens):
    model = SmolLM2(linear="int8", quantize_lm_head=True)
    ids = model.encode(evaluation_text())[:prompt_tokens]
    assert len(ids) == prompt_tokens, f"the evaluation text holds {len(ids)} tokens"
    model.generate(ids, 2)  # compile, warm

    def decode():
        timings = {}
        out = model.generate(ids, DECODE_TOKENS // 2, timings=timings)
        return len(out) / timings["decode_s"]

    benchmark.pedantic(decode, rounds=1, warmup_rounds=0)
    rates, reads, _ = beside_reads(decode, read_buffer, ROUNDS)
    tokens_per_s, read_gbps = float(np.median(rates)), float(np.median(reads)) / 1e9
    context = prompt_tokens + DECODE_TOKENS // 4  # the mean cache length over the decoded tokens
    kv_bytes = kv_cache_bytes(model.config, context, elem_bytes=4)  # float32 K and V of every layer, read per token
    bytes_per_token = model.weight_bytes_per_token() + kv_bytes
    bound = read_gbps * 1e9 / bytes_per_token
    of_bound = float(np.median([r * bytes_per_token / b for r, b in zip(rates, reads)]))
    record({"bench": "smollm2-long", "linear": "int8 + int8 LM head", "prompt_tokens": prompt_tokens,
            "decode_tokens/s": f"{tokens_per_s:.1f}", "weight_MB/token": f"{model.weight_bytes_per_token() / 1e6:.0f}",
            "kv_MB/token": f"{kv_bytes / 1e6:.0f}", "bound_tokens/s": f"{bound:.1f}",
            "of_bound": f"{of_bound:.2f}", "read_GB/s": _spread(reads),
            "fixed_ms": f"{model._one_region_step().fixed_seconds(context) * 1e3:.2f}",
            "cpu": f"{cpu_model()} x{os.cpu_count()}"})


def _spread(rates):
    """GB/s of the rounds: "median (lowest-highest)"."""
    return f"{np.median(rates) / 1e9:.1f} ({min(rates) / 1e9:.1f}-{max(rates) / 1e9:.1f})"
