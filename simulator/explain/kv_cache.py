"""kv-cache: the KV cache's bytes per token and at long contexts for the model presets (MHA vs GQA vs MQA), what a
SnapKV budget saves, and one decode step's bytes and roofline time on a hardware preset beside the weights'.

Cache sizes come from ``models.configs``; bytes and times of a decode step from the cost model (``costs.decode``
per layer for attention, ``costs.dense`` per linear layer for the weights) and ``Cost.time`` on the preset."""
from __future__ import annotations

import dataclasses

import numpy as np

from models import PRESETS, get_config, kv_cache_bytes, kv_cache_bytes_per_token, weight_bytes

from .. import costs
from ..hardware import load
from ._lesson import num

TITLE = "kv-cache: the bytes a decode step reads"
SUMMARY = "KV-cache bytes per token for the presets (MHA/GQA/MQA), what a SnapKV budget saves, decode vs weights"
OPTIONS = ("preset", "context", "capacity", "hardware")
CONTEXTS = (1024, 4096, 16384, 32768, 131072)
ELEM_BYTES = 2  # fp16 cache and weights


def attention_kind(cfg) -> str:
    if cfg.n_kv_heads == cfg.n_heads:
        return "MHA"
    return "MQA" if cfg.n_kv_heads == 1 else f"GQA ({cfg.n_heads // cfg.n_kv_heads} query heads per kv head)"


def decode_step(cfg, hw, context, capacity=None):
    """One decode step of the whole model, batch 1: {"weights", "kv"}: (HBM bytes, roofline seconds) from the cost
    model. Weights: every block's linear layers and the LM head as GEMVs; kv: attention of every layer against
    the cache of ``context`` tokens, pruned to ``capacity`` when given."""
    weights = [costs.dense(1, i, o, elem_bytes=ELEM_BYTES) for i, o in cfg.linear_shapes()]  # one block's
    head = costs.dense(1, cfg.hidden, cfg.vocab, elem_bytes=ELEM_BYTES)
    w_bytes = cfg.n_layers * sum(int(c.hbm_bytes) for c in weights) + int(head.hbm_bytes)
    w_time = cfg.n_layers * sum(float(c.time(hw).seconds) for c in weights) + float(head.time(hw).seconds)
    attn = costs.decode(1, cfg.n_heads, cfg.n_kv_heads, context, cfg.head_dim, elem_bytes=ELEM_BYTES,
                        capacity=capacity, sram_bytes=hw.sram_per_sm_bytes)
    return {"weights": (w_bytes, w_time),
            "kv": (cfg.n_layers * int(attn.hbm_bytes), cfg.n_layers * float(attn.time(hw).seconds))}


def _gb(nbytes) -> str:
    return f"{float(nbytes) / 1e9:,.2f} GB"


def _draw(path, cfg, hw, capacity):
    from ..report.charts import figure, save

    fig, axes = figure(width=6.0, height=3.4)
    ax = axes[0, 0]
    ctx = np.array([c for c in (256, 512) + CONTEXTS])
    steps = [decode_step(cfg, hw, int(c)) for c in ctx]
    pruned = [decode_step(cfg, hw, int(c), capacity) for c in ctx]
    ax.plot(ctx, [s["weights"][0] / 1e9 for s in steps], "k-", label="weights (fp16)")
    ax.plot(ctx, [s["kv"][0] / 1e9 for s in steps], "tab:red", marker="o", label="KV cache, full")
    ax.plot(ctx, [s["kv"][0] / 1e9 for s in pruned], "tab:blue", marker="o", label=f"KV cache, SnapKV {capacity}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("GB read per decode step")
    ax.set_title(f"{cfg.name}, batch 1, on {hw.name} (cost model)", fontsize=9)
    ax.legend(fontsize=8)
    save(fig, path)


def run(lesson, *, preset="llama-3.1-8b", context=32768, capacity=1024, hardware="H100-SXM"):
    cfg = get_config(preset) if isinstance(preset, str) else preset
    hw = load(hardware) if isinstance(hardware, str) else hardware
    if capacity >= context:  # (it printed "keeps 100,000 of the 2,048 prompt tokens ... 1× less")
        raise ValueError(f"capacity must be below the context ({context:,} tokens): SnapKV prunes a cache to a "
                         f"smaller budget; got {capacity:,}")
    lesson.heading("Bytes per token of context")
    lesson.say("Every layer keeps K and V of every token for every kv head: 2 · layers · kv heads · head dim · "
               f"{ELEM_BYTES} bytes (fp16) per token (`models.kv_cache_bytes_per_token`).")
    lesson.table(["model", "attention", "KV bytes / token", *(f"at {c // 1024}k" for c in CONTEXTS[1:]),
                  "fp16 weights"],
                 [[name, attention_kind(c), f"{kv_cache_bytes_per_token(c, ELEM_BYTES):,}",
                   *(_gb(kv_cache_bytes(c, n, elem_bytes=ELEM_BYTES)) for n in CONTEXTS[1:]),
                   _gb(weight_bytes(c, "fp16"))] for name, c in PRESETS.items()])
    lesson.heading(f"MHA vs GQA vs MQA: {cfg.name} with fewer kv heads")
    variants = {f"MHA ({cfg.n_heads} kv heads)": cfg.n_heads, f"as published ({cfg.n_kv_heads} kv heads)":
                cfg.n_kv_heads, "MQA (1 kv head)": 1}
    rows = []
    for label, hkv in variants.items():
        v = dataclasses.replace(cfg, n_kv_heads=hkv)
        rows.append([label, f"{kv_cache_bytes_per_token(v, ELEM_BYTES):,}", _gb(kv_cache_bytes(v, context)),
                     num(kv_cache_bytes_per_token(dataclasses.replace(cfg, n_kv_heads=cfg.n_heads), ELEM_BYTES)
                         / kv_cache_bytes_per_token(v, ELEM_BYTES))])
    lesson.table(["variant", "KV bytes / token", f"at {context:,} tokens", "smaller than MHA by"], rows)
    full, kept = kv_cache_bytes(cfg, context), kv_cache_bytes(cfg, capacity)
    lesson.heading(f"A SnapKV budget of {capacity:,} tokens")
    lesson.say(f"SnapKV keeps {capacity:,} of the {context:,} prompt tokens per kv head and layer: the cache of "
               f"{cfg.name} shrinks from {_gb(full)} to {_gb(kept)}, {num(full / kept)}× less.")
    lesson.heading(f"One decode step on {hw.name}: the cache against the weights")
    lesson.say(f"Batch 1: each new token reads every weight once and, in every layer, the K and V of every cached "
               f"token. From the cost model (`costs.dense` for the {len(cfg.linear_shapes())} linear layers of "
               f"each block and the LM head, `costs.decode` for attention), roofline time on {hw.name} "
               f"({hw.hbm_bandwidth / 1e12:.2f} TB/s):")
    rows = []
    for n in CONTEXTS:
        step, pruned = decode_step(cfg, hw, n), decode_step(cfg, hw, n, capacity)
        (wb, wt), (kb, kt), (pb, pt) = step["weights"], step["kv"], pruned["kv"]
        rows.append([f"{n:,}", _gb(wb), _gb(kb), num(100 * kb / (kb + wb), 3) + "%",
                     f"{(wt + kt) * 1e3:,.2f}", _gb(pb), f"{(wt + pt) * 1e3:,.2f}"])
    lesson.table(["context", "weights", "KV cache", "cache share", "step ms", f"KV, SnapKV {capacity}",
                  "step ms, SnapKV"], rows)
    lesson.say("These are the two-level counts (HBM ↔ SRAM): the shared-cache level of the cost model is separate "
               "work (issue 16).")
    lesson.chart("kv_cache.png", lambda p: _draw(p, cfg, hw, capacity),
                 "bytes read per decode step: weights, full KV cache, SnapKV-pruned cache")
