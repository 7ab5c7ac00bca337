"""outliers: why one absmax scale fails when a feature is 100× the others, and what LLM.int8() does instead
(Dettmers et al. 2022): vector-wise scales, and the outlier dimensions split off into float16. Every quantized
value and product comes from ``kernels.int8``; then SmolLM2's own outlier dimensions, layer by layer."""
from __future__ import annotations

import numpy as np

from kernels.int8 import QMAX, Int8Linear, int8_matmul, naive_absmax_matmul, quantize_vectorwise

from ._lesson import num, vector
from ._model import load_smollm2

TITLE = "outliers: one absmax scale, vector-wise int8 and the LLM.int8() split"
SUMMARY = "[0.12, 0.56, 0.91, 0.33, 100] through one absmax scale, vector-wise int8 and the split; SmolLM2's outliers"
OPTIONS = ("seed", "context", "model")
X = (0.12, 0.56, 0.91, 0.33, 100.0)  # the example of issue 18: four ordinary features and one outlier
THRESHOLD = 6.0  # LLM.int8() §3.2: a hidden dimension with any |x| >= 6 goes through float16
N_OUT = 4  # output features of the example's weight


def int8_weight(w_in_out):
    """The weight as ``kernels.int8`` takes it, (out, in) = (N, K) as torch's F.linear, from the (in, out) = (K, N)
    that the lesson's products x · W are written with (the one place this lesson shapes an int8 weight)."""
    return np.ascontiguousarray(np.asarray(w_in_out, dtype=np.float32).T)  # (N, K)


def quantize_table(x):
    """Rows (x, x · 127 / absmax, int8, dequantized, error) of one absmax vector through ``quantize_vectorwise``."""
    x = np.asarray(x, dtype=np.float32)[None]  # (1, K): one vector
    x_i8, absmax = quantize_vectorwise(x, axis=-1)  # (1, K) int8, (1,) float32
    step = float(absmax[0]) / QMAX
    back = x_i8[0].astype(np.float64) * step  # (K,)
    return step, [(float(a), float(a) / step, int(q), float(b), float(b) - float(a))
                  for a, q, b in zip(x[0], x_i8[0], back)]


def _fp16(a):
    return np.asarray(a).astype(np.float16).astype(np.float32)


def split_products(x, w, threshold=THRESHOLD):
    """The products of the lesson, (1, N) each: exact float64, naive (one scale per tensor), vector-wise int8 with
    the outlier inside its row's scale (threshold 0), LLM.int8(), and its two parts (regular dims through int8,
    outlier dims through float16 with the kept float16 weight rows); and the outlier dims."""
    x = np.asarray(x, dtype=np.float32)[None]  # (1, K)
    outliers = np.flatnonzero((np.abs(x) >= threshold).any(axis=0))
    layer = Int8Linear.from_float(int8_weight(w), threshold=threshold, keep_fp16_weights=True)
    return {
        "exact": x.astype(np.float64) @ w.astype(np.float64),
        "naive": naive_absmax_matmul(x, int8_weight(w)),
        "vector-wise": int8_matmul(x, int8_weight(w), threshold=0.0),
        "LLM.int8()": layer(x),
        # the outlier dims set to 0: the row scale is the regular dims' absmax and W keeps its column scales, so
        # this is exactly the split's int8 product
        "int8 part": int8_matmul(np.where(np.isin(np.arange(x.shape[1]), outliers), 0, x), int8_weight(w),
                                 threshold=0.0),
        # float16 inputs, float32 accumulation (as the kernels and a GPU's fp16 matmul accumulate)
        "float16 part": _fp16(x[:, outliers]) @ _fp16(w[outliers]),
    }, outliers


def _toy(lesson, seed):
    lesson.heading("One absmax scale for the whole vector")
    step, rows = quantize_table(X)
    lesson.say(f"x = {vector(X)}. Absmax quantization maps the largest |x| to {QMAX}: one step is absmax / {QMAX} "
               f"= **{num(step, 4)}** (`kernels.int8.quantize_vectorwise`).")
    lesson.table(["x", "x / step", "int8", "dequantized", "error"],
                 [[num(a, 3), num(r, 3), q, num(b, 4), num(e, 3)] for a, r, q, b, e in rows])
    crushed = [a for a, _, q, _, _ in rows if abs(q) <= 1]
    lesson.say(f"{len(crushed)} of the {len(rows)} values land on 0 or ±1 step: {vector(crushed)} became "
               f"{vector([b for _, _, q, b, _ in rows if abs(q) <= 1])}. The outlier is kept; the information "
               f"in the others is gone.")
    lesson.heading("Vector-wise int8 without the outlier")
    step4, rows4 = quantize_table(X[:-1])
    lesson.say(f"The same four small values with their own scale: one step is {num(step4, 4)}, and the largest "
               f"error is {num(max(abs(e) for *_, e in rows4), 2)} (it was "
               f"{num(max(abs(e) for *_, e in rows[:-1]), 2)}).")
    lesson.table(["x", "int8", "dequantized", "error"], [[num(a), q, num(b, 4), num(e, 2)] for a, _, q, b, e in rows4])
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((len(X), N_OUT)) / np.sqrt(len(X))).astype(np.float32)  # (K, N), (in, out)
    y, outliers = split_products(X, w)
    lesson.heading("The LLM.int8() split: x · W")
    lesson.say(f"A random weight W ({len(X)} × {N_OUT}, seed {seed}). Dimensions where |x| >= {num(THRESHOLD)}: "
               f"{[int(i) for i in outliers]}. They go through float16; the rest through int8 with one scale per "
               f"row of x and per column of W; the two products are summed.")
    names = ["naive", "vector-wise", "int8 part", "float16 part", "LLM.int8()"]
    lesson.table(["output", "exact (float64)", *names],
                 [[j, num(y["exact"][0, j], 5), *(num(y[k][0, j], 5) for k in names)] for j in range(N_OUT)])
    scale = float(np.abs(y["exact"]).mean())
    errors = {k: float(np.abs(y[k] - y["exact"]).mean()) / scale for k in ("naive", "vector-wise", "LLM.int8()")}
    parts = float(np.abs(y["int8 part"] + y["float16 part"] - y["LLM.int8()"]).max())
    lesson.say(f"Mean error relative to the mean |exact|: naive {num(errors['naive'], 2)}, vector-wise int8 with "
               f"the outlier in its row {num(errors['vector-wise'], 2)}, LLM.int8() {num(errors['LLM.int8()'], 2)}. "
               f"int8 part + float16 part differs from `Int8Linear`'s result by {num(parts, 2)}.")
    return rows, rows4, y, errors


def smollm2_outliers(model, ids, threshold=THRESHOLD):
    """{(layer, linear): outlier dims} of one prefill of ``ids`` (``SmolLM2.outlier_statistics``), and the dims."""
    rows = model.outlier_statistics(ids, threshold=threshold)
    return {(r["layer"], r["linear"]): r["outlier_dims"] for r in rows}, {r["linear"]: r["dims"] for r in rows}


def _real(lesson, model, context):
    from models.smollm2 import evaluation_text

    lesson.heading("The real thing: SmolLM2-135M's outlier dimensions")
    if model is None:
        model, reason = load_smollm2()
        if model is None:
            lesson.skip(reason)
            return None
    ids = model.encode(evaluation_text())[:context] if model.tokenizer is not None else list(range(context))
    counts, dims = smollm2_outliers(model, ids)
    linears = list(dims)
    layers = sorted({layer for layer, _ in counts})
    lesson.say(f"One prefill of {len(ids)} tokens of text; for each layer, the hidden dimensions of each linear's "
               f"input where some token reaches |x| >= {num(THRESHOLD)} (these go through float16).")
    lesson.table(["layer", *(f"{name} (of {dims[name]})" for name in linears)],
                 [[layer, *(counts[(layer, name)] for name in linears)] for layer in layers])
    return counts, linears, layers


def _draw_toy(path, rows, rows4):
    from ..report.charts import figure, save

    fig, axes = figure(ncols=2, width=3.6, height=2.8)
    x = np.arange(len(rows4))
    axes[0, 0].bar(x - 0.2, [a for a, *_ in rows4], 0.4, label="x", color="tab:gray")
    axes[0, 0].bar(x + 0.2, [b for _, _, _, b, _ in rows[:-1]], 0.4, label="one scale (with 100)", color="tab:red")
    axes[0, 0].set_title("dequantized, one absmax of 100", fontsize=9)
    axes[0, 1].bar(x - 0.2, [a for a, *_ in rows4], 0.4, label="x", color="tab:gray")
    axes[0, 1].bar(x + 0.2, [b for _, _, _, b, _ in rows4], 0.4, label="own scale", color="tab:blue")
    axes[0, 1].set_title("dequantized, absmax without the outlier", fontsize=9)
    for ax in axes[0]:
        ax.set_xticks(x, [f"{a:g}" for a, *_ in rows4])
        ax.legend(fontsize=7)
    save(fig, path)


def _draw_real(path, counts, linears, layers):
    from ..report.charts import figure, save

    fig, axes = figure(width=7.0, height=3.0)
    width = 0.8 / len(linears)
    for i, name in enumerate(linears):
        axes[0, 0].bar(np.array(layers) + (i - len(linears) / 2 + 0.5) * width,
                       [counts[(layer, name)] for layer in layers], width, label=name)
    axes[0, 0].set_xlabel("layer")
    axes[0, 0].set_ylabel(f"dims with |x| >= {THRESHOLD:g}")
    axes[0, 0].legend(fontsize=7)
    save(fig, path)


def run(lesson, *, seed=0, context=128, model=None):
    rows, rows4, _, _ = _toy(lesson, seed)
    lesson.chart("outliers_scales.png", lambda p: _draw_toy(p, rows, rows4),
                 "the four small values dequantized with one absmax scale, and with their own")
    real = _real(lesson, model, context)
    if real is not None:
        lesson.chart("outliers_smollm2.png", lambda p: _draw_real(p, *real), "SmolLM2 outlier dimensions per layer")
