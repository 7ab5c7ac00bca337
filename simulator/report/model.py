"""The SmolLM2 section: the real model on these kernels — perplexity per linear precision, where the outlier
features are, and decode tokens/s against the weight-bytes bound. Skipped, with the reason, when the model extra
is not installed or the GGUF cannot be fetched."""
from __future__ import annotations

from ..calibrate import read_bandwidth_of
from .charts import figure, save
from .core import RunContext, Section, planned, read_csv, write_csv
from .measured import dram_buffer, error_pct, fresh_rates

VARIANTS = (("fp32", {"linear": "fp32"}), ("int8 (fp16 outlier rows)", {"linear": "int8", "keep_fp16_weights": True}),
            ("int8 (int8 weights only)", {"linear": "int8"}), ("naive int8", {"linear": "naive-int8"}))


def _unavailable(reason: str) -> Section:
    return Section("SmolLM2-135M on these kernels", f"Skipped: {reason}.\n")


TOKENS = {True: 256, False: 1024}  # perplexity tokens, keyed by quick


def _variants(quick):
    return VARIANTS[:2] if quick else VARIANTS


@planned(lambda quick: len(_variants(quick)) + 1)  # one per variant, then int8's decode (quick) or the int8 LM head
def model_section(ctx: RunContext) -> Section:
    try:
        from models.smollm2 import SmolLM2, evaluation_text, fetch_gguf, require_model_extra

        require_model_extra()  # before the 98 MB download, which would be wasted without gguf and tokenizers
        path = fetch_gguf()
    except ImportError:
        return _unavailable("the model extra is not installed (`pip install -e .[model]`)")
    except RuntimeError as err:
        return _unavailable(f"the GGUF could not be fetched ({err})")
    n_tokens = TOKENS[ctx.quick]
    variants = _variants(ctx.quick)
    rows, outliers, speed = [], None, []
    rates = fresh_rates(ctx)
    rates_when = "at the run's start" if ctx.quick else "just before it"
    for label, options in variants:
        ctx.step(f"SmolLM2 {label}")
        model = SmolLM2(path, **options)
        ids = model.encode(evaluation_text())[:n_tokens]
        rows.append({"variant": label, "tokens": n_tokens, "perplexity": f"{model.perplexity(ids):.4g}"})
        if outliers is None:
            outliers = model.outlier_statistics(ids)
        if label in ("fp32", "int8 (int8 weights only)"):
            speed.append(_decode_speed(model, label, rates, dram_buffer(ctx)))
    if ctx.quick:  # int8's decode as the full report times it: int8 weights only, in one region
        ctx.step("SmolLM2 int8 (int8 weights only) decode")
        speed.append(_decode_speed(SmolLM2(path, linear="int8"), "int8 (int8 weights only)", rates, dram_buffer(ctx)))
    if not ctx.quick:
        ctx.step("SmolLM2 int8 with an int8 LM head")
        model = SmolLM2(path, linear="int8", quantize_lm_head=True)
        rows.append({"variant": "int8 (int8 weights only) + int8 LM head", "tokens": n_tokens,
                     "perplexity": f"{model.perplexity(ids):.4g}"})
        speed.append(_decode_speed(model, "int8 + int8 LM head", rates, dram_buffer(ctx)))
    write_csv(ctx.directory / "smollm2_perplexity.csv", rows)
    write_csv(ctx.directory / "smollm2_outliers.csv", outliers)
    write_csv(ctx.directory / "smollm2_decode.csv", speed)
    plot_outliers(ctx.directory)
    table = "\n".join(f"| {r['variant']} | {r['perplexity']} |" for r in rows)
    fp32 = float(rows[0]["perplexity"])
    down = sum(r["outlier_dims"] for r in outliers if r["linear"] == "w_down")
    other = sum(r["outlier_dims"] for r in outliers if r["linear"] != "w_down")
    speed_text = "; ".join(f"{s['variant']} {float(s['decode_tokens_per_s']):.1f} tokens/s (bound "
                           f"{float(s['bound_tokens_per_s']):.0f})" for s in speed)
    speed_table = "\n".join(
        f"| {s['variant']} | {float(s['measured_ms_per_token']):.2f} | {float(s['predicted_ms_per_token']):.2f} | "
        f"{float(s['predicted_streaming_ms']):.2f} | {float(s['predicted_outliers_ms']):.2f} | "
        f"{float(s['predicted_fixed_ms']):.2f} | {float(s['error_pct']):+.0f}% | {float(s['bound_tokens_per_s']):.0f} |"
        for s in speed)
    body = (f"SmolLM2-135M-Instruct (the PyPI GGUF, dequantized to float32) running on `kernels.attention` and "
            f"`kernels.int8`. Perplexity over the first {n_tokens} tokens of Python's help topics "
            f"(`pydoc_data.topics`, sorted keys, joined by blank lines):\n\n| linear layers | perplexity |\n|---|---|\n"
            f"{table}\n\nfp32 scores {fp32:.2f}. Inputs reaching |x| ≥ 6 (the LLM.int8() threshold) are counted per "
            f"layer and linear below: {down} dimension-hits in the down projections' inputs (the SwiGLU "
            f"products) against {other} in all other linears together, so that is where the float16 path "
            f"works.\n\n![outlier dimensions per layer](smollm2_outliers.png)\n\n"
            f"Decode (one token at a time, {DECODE_TOKENS} tokens): {speed_text}; the bound is the weight bytes read "
            f"per token over this machine's all-core read bandwidth, the best it showed around each decode "
            f"({_read_range(speed)} GB/s; a shared host's memory moves within seconds): the read among the rates this "
            f"section uses (measured {rates_when}), {BESIDE_READS} timed passes of a plain all-core read over a "
            f"DRAM-sized buffer right after the decode, and the rate at which the step's row kernels streamed a "
            f"working set of the model's weights (below). "
            f"The tied LM head stays float32 unless quantized too; the int8 rows keep int8 weights only (the float16 "
            f"copy of the outlier rows runs one call per linear, not timed here). Each of these models decodes a "
            f"token in one parallel region (`kernels.decode.LlamaDecodeStep`), its linear steps split into the tasks "
            f"per thread that timing the step on this machine chose when it was built (`tune_tasks_per_thread`: "
            f"{_tasks_per_thread(speed)}; what each count took, in the CSV): *predicted* times every weight's "
            f"bytes at the rate the step's row kernels stream a working set of the model's weight bytes per token, "
            f"read again and again as a decode reads it (measured in this run for each variant, one long run of rows "
            f"per thread: a host's cache can hold part of a small model's weights between tokens; the rates are in "
            f"the CSV), plus the float16 products of the outlier features the "
            f"int8 linears met ({rates.step_outlier_s * 1e9:.2f} ns per output and feature on a thread), plus the "
            f"step's fixed part, timed by running it with no weight rows: its launch, the norms, the quantization of "
            f"the int8 inputs, the attention over the cache and the threads' hand-offs between steps.\n\n"
            f"| variant | measured ms/token | predicted ms/token | of which streaming | outliers | fixed | error | "
            f"bound tokens/s |\n|---|---|---|---|---|---|---|---|\n"
            f"{speed_table}\n\n"
            f"Data: [smollm2_perplexity.csv](smollm2_perplexity.csv), [smollm2_outliers.csv](smollm2_outliers.csv), "
            f"[smollm2_decode.csv](smollm2_decode.csv)\n")
    return Section("SmolLM2-135M on these kernels", body, ("smollm2_perplexity.csv", "smollm2_outliers.csv",
                                                           "smollm2_outliers.png", "smollm2_decode.csv"))


def predicted_seconds_per_token(model, rates, context) -> float:
    """One decode token's predicted time: the sum of ``decode_token_parts``."""
    return sum(decode_token_parts(model, rates, context).values())


def decode_token_parts(model, rates, context) -> dict:
    """One decode token's predicted seconds in parts, for a model that decodes in one parallel region
    (``kernels.decode.LlamaDecodeStep``: float32 layers, or int8 ones with int8 weights only), at ``context`` cached
    tokens: every weight's bytes at the rate the step's kernels stream them from DRAM (``rates.step_fp32_dram``,
    ``rates.step_int8_dram``); the float16 products of the int8 linears' outlier features, as many per token as the
    step has met so far (``LlamaDecodeStep.outlier_products``: they depend on the text), at ``rates.step_outlier_s``
    on each thread; and the step's fixed part, timed now: the same region with no weight rows to read, that is its
    launch, its serial tasks (the norms, the int8 inputs' quantization, the attention over the cache) and the
    threads' hand-offs between its steps (``LlamaDecodeStep.fixed_seconds``). Keys: streaming_s, outliers_s,
    fixed_s."""
    import numba

    from ..calibrate_phases import threads_at_once

    threads = threads_at_once(numba.get_num_threads())
    step = model._one_region_step()
    if step is None:
        raise ValueError("only a model that decodes in one parallel region (float32, or int8 weights only) is "
                         "predicted here")
    int8_blocks = model.linear != "fp32"
    int8_head = int8_blocks and model.quantize_lm_head
    head_bytes = model.embedding.size * (1 if int8_head else 4)
    block_bytes = model.weight_bytes_per_token() - head_bytes

    def stream(nbytes, int8):
        return nbytes / (rates.step_int8_dram if int8 else rates.step_fp32_dram)

    return {"streaming_s": stream(block_bytes, int8_blocks) + stream(head_bytes, int8_head),
            "outliers_s": step.outlier_products * rates.step_outlier_s / threads,
            "fixed_s": step.fixed_seconds(context)}


PROMPT, DECODE_TOKENS = "Once upon a time", 24  # what the decode rows generate


def step_rates(model, buffer, *, outliers=False) -> dict:
    """The decode step's streaming rates for ``model``: ``step_fp32_dram`` and ``step_int8_dram``, each over the
    weight bytes that stream in that precision, measured on the mapped ``buffer`` over a working set of the model's
    weight bytes per token (``calibrate_phases.decode_step_rates``' ``working_bytes``: the bytes a token reads
    again and again, which a host's cache may partly hold) at each row length K of its linears, and combined as
    bytes over Σ bytes_K / rate_K. A row's length can set its rate (a 2-vCPU Xeon with a 105 MiB L3, 540 MB on two
    threads: float32 rows of 576, 1024 and 1536 at 21-25, 35 and 27-28 GB/s before ``kernels.dense`` v4, 21, 20-22
    and 21-23 after it in a slower phase, in which int8 rows, before their own change of the same kind, streamed at
    18, 15-16 and 17), and SmolLM2's rows are 576 long but for the down projection's 1536. ``outliers``: add
    ``step_outlier_s`` (at the hidden size)."""
    import numba

    from ..calibrate_phases import decode_step_rates

    cfg = model.config
    int8_blocks = model.linear != "fp32"
    int8_head = int8_blocks and model.quantize_lm_head
    elements = {}  # (K, int8) -> weight elements in rows of K
    for k, n_out in cfg.linear_shapes():
        elements[k, int8_blocks] = elements.get((k, int8_blocks), 0) + cfg.n_layers * k * n_out
    vocab, hidden = model.embedding.shape
    elements[hidden, int8_head] = elements.get((hidden, int8_head), 0) + vocab * hidden
    working = model.weight_bytes_per_token()
    by_k = {k: decode_step_rates(buffer, numba.get_num_threads(), working_bytes=working,
                                 outliers=outliers and k == hidden, k=k)
            for k in sorted({k for k, _ in elements})}
    rates = {"step_outlier_s": by_k[hidden]["step_outlier_s"]} if outliers else {}
    for int8, name, size in ((False, "step_fp32_dram", 4), (True, "step_int8_dram", 1)):
        nbytes = {k: n * size for (k, is_int8), n in elements.items() if is_int8 == int8}
        rates[name] = (sum(nbytes.values()) / sum(b / by_k[k][name] for k, b in nbytes.items()) if nbytes
                       else by_k[hidden][name])  # no weight in that precision: the rate at the hidden size
    return rates


def rates_for(model, rates, buffer):
    """``rates`` with the decode step's streaming rates measured for ``model`` (``step_rates``)."""
    import dataclasses

    return dataclasses.replace(rates, **step_rates(model, buffer))


BESIDE_READS = 5  # passes of the all-core read after each decode; the bound takes the best (see _decode_speed)


def _read_range(speed) -> str:
    reads = [float(s["read_GBps"]) for s in speed]
    low, high = min(reads), max(reads)
    return f"{low:.1f}" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f}-{high:.1f}"


def _tasks_per_thread(speed) -> str:
    return ", ".join(f"{s['variant']} {s['tasks_per_thread']}" for s in speed)


def _decode_speed(model, label, rates, buffer):
    """Decode tokens/s (DECODE_TOKENS after a warm-up) beside the bound, weight bytes per token over the all-core
    read rate (the block linears in their precision, the tied LM head float32 unless quantized), and the predicted
    time per token (``predicted_seconds_per_token`` at the decode's mean context, its streaming rates at the model's
    working set: ``rates_for``). The read rate is the best of the section's (``fresh_rates``), BESIDE_READS timed
    passes right after the decode and the step's own streaming rates at the model's working set: in the full report
    at 1357ec1 (2-vCPU AMD EPYC, Zen 3, KVM) the section's read alone, three passes, found 13.8 GB/s in a slow moment
    of the host, and fp32 decoded at 49.5 tokens/s against a "bound" of 25.6 (its step's rows streamed at 26.9 GB/s a
    moment later); at a201d62, with the read after the decode (24.2 GB/s) but not the step's rate (26.0), at 45.5
    against 45."""
    prompt = model.encode(PROMPT)
    model.generate(prompt, 2)
    timings = {}
    out = model.generate(prompt, DECODE_TOKENS, timings=timings)
    beside = read_bandwidth_of(buffer, repeats=BESIDE_READS)  # right after the decode, as the stall benchmark does
    weight_bytes = model.weight_bytes_per_token()
    measured = timings["decode_s"] / len(out)
    at_working_set = rates_for(model, rates, buffer)
    step = model._one_region_step()
    # the best all-core read of DRAM-sized data seen around this decode: a slower sample is the host's moment, not
    # the machine's bandwidth (the step's rows streaming a working set of the model's size are such a read too)
    read_bw = max(rates.read_all, beside, at_working_set.step_fp32_dram, at_working_set.step_int8_dram)
    parts = decode_token_parts(model, at_working_set, len(prompt) + (len(out) - 1) // 2)
    predicted = sum(parts.values())
    return {"variant": label, "decode_tokens_per_s": f"{len(out) / timings['decode_s']:.3g}",
            "weight_bytes_per_token": weight_bytes,
            "read_GBps": f"{read_bw / 1e9:.3g}", "bound_tokens_per_s": f"{read_bw / weight_bytes:.3g}",
            "measured_ms_per_token": f"{measured * 1e3:.4g}", "predicted_ms_per_token": f"{predicted * 1e3:.4g}",
            **{f"predicted_{k[:-2]}_ms": f"{v * 1e3:.3g}" for k, v in parts.items()},
            "error_pct": f"{error_pct(predicted, measured):.1f}",
            "tasks_per_thread": step.tasks_per_thread,
            # what the step's tuning timed: each count's median ms per call (none where it was not tuned)
            "tuning_ms_per_call": " ".join(f"{count}:{seconds * 1e3:.3f}"
                                           for count, seconds in (step.tuned_seconds or {}).items()),
            "stream_fp32_GBps": f"{at_working_set.step_fp32_dram / 1e9:.1f}",
            "stream_int8_GBps": f"{at_working_set.step_int8_dram / 1e9:.1f}"}


def plot_outliers(directory) -> None:
    rows = read_csv(directory / "smollm2_outliers.csv")
    layers = sorted({int(r["layer"]) for r in rows})
    down = [sum(int(r["outlier_dims"]) for r in rows if int(r["layer"]) == i and r["linear"] == "w_down")
            for i in layers]
    other = [sum(int(r["outlier_dims"]) for r in rows if int(r["layer"]) == i and r["linear"] != "w_down")
             for i in layers]
    fig, axes = figure(width=9.0, height=4.0)
    ax = axes[0][0]
    ax.bar(layers, down, color="tab:orange", label="down projection input (1536 dims)")
    ax.bar(layers, other, bottom=down, color="tab:blue", label="attention and gate/up inputs (576 dims)")
    ax.set(xlabel="layer", ylabel="hidden dimensions with some |x| ≥ 6",
           title="Where SmolLM2's outlier features are (one prefill of the evaluation text)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, directory / "smollm2_outliers.png")
