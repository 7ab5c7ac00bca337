"""transformer: the original encoder-decoder Transformer (Vaswani et al. 2017) built from this library's pieces
(``models.transformer``, attention through ``kernels.attention``), run on small random weights beside its float64
reference; then each component's bytes and FLOPs from the cost model at the paper's base size, and which part
dominates as N grows."""
from __future__ import annotations

import numpy as np

from models.transformer import BASE, Transformer, TransformerConfig, random_weights, reference

from .. import costs
from ..hardware import load
from ._lesson import num

TITLE = "transformer: Attention Is All You Need, from this library's pieces"
SUMMARY = "the encoder-decoder Transformer on kernels.attention, checked in float64; its bytes and FLOPs as N grows"
OPTIONS = ("seed", "n", "hardware")
SMALL = TransformerConfig(d_model=32, n_heads=4, d_ff=64, n_layers=2, vocab=50)  # the random-weight model
SWEEP = (128, 512, 2048, 8192, 32768)
ELEM_BYTES = 2  # fp16 at the realistic size
GROUPS = ("projections", "attention core", "FFN", "output projection")


def run_small(seed=0, n_src=9, n_tgt=7):
    """The small model on a padded batch of two: (trace, logits, reference logits, lengths)."""
    rng = np.random.default_rng(seed)
    weights = random_weights(SMALL, rng)
    src = rng.integers(0, SMALL.vocab, (2, n_src))  # (B, Ns)
    tgt = rng.integers(0, SMALL.vocab, (2, n_tgt))  # (B, Nt)
    src_lengths, tgt_lengths = [n_src, max(1, n_src - 3)], [n_tgt, max(1, n_tgt - 2)]
    model = Transformer(SMALL, weights)
    model.trace = []
    logits = model.forward(src, tgt, src_lengths, tgt_lengths)  # (B, Nt, vocab)
    ref = reference(SMALL, weights, src, tgt, src_lengths, tgt_lengths)  # (B, Nt, vocab), float64
    return model.trace, logits, ref, (src_lengths, tgt_lengths)


def component_costs(cfg, n_src, n_tgt, *, sram_bytes, algorithm="flash2", batch=1):
    """{component: [Cost, ...]} of one forward at ``cfg`` over all layers, from the cost model. Projections:
    W_Q, W_K, W_V, W_O of every attention; the attention core: standard or FlashAttention-2 forward per attention
    (causal in the decoder's self-attention, Nq = Nt ≠ Nk = Ns in cross-attention); the FFN's two matmuls; the
    output projection. The core's tiles fit ``sram_bytes``. Embedding lookups, LayerNorms and residual adds are
    elementwise and not in the cost model."""
    d, h, dk, f = cfg.d_model, cfg.n_heads, cfg.d_k, cfg.d_ff
    core = costs.flash2_forward if algorithm == "flash2" else costs.standard_forward
    out = {g: [] for g in GROUPS}
    attentions = [(n_src, n_src, False)] * cfg.n_layers + [(n_tgt, n_tgt, True), (n_tgt, n_src, False)] * cfg.n_layers
    for nq, nk, causal in attentions:
        out["projections"] += [costs.dense(batch * nq, d, d, elem_bytes=ELEM_BYTES)] * 2  # W_Q, W_O
        out["projections"] += [costs.dense(batch * nk, d, d, elem_bytes=ELEM_BYTES)] * 2  # W_K, W_V
        out["attention core"].append(core(batch, h, h, nq, nk, dk, causal=causal, elem_bytes=ELEM_BYTES,
                                          sram_bytes=sram_bytes))
    for n in [n_src] * cfg.n_layers + [n_tgt] * cfg.n_layers:
        out["FFN"] += [costs.dense(batch * n, d, f, elem_bytes=ELEM_BYTES), costs.dense(batch * n, f, d,
                                                                                        elem_bytes=ELEM_BYTES)]
    out["output projection"].append(costs.dense(batch * n_tgt, d, cfg.vocab, elem_bytes=ELEM_BYTES))
    return out


def totals(parts, hw=None):
    """{component: (HBM bytes, FLOPs, roofline seconds or None)} summed over a ``component_costs`` result."""
    return {g: (sum(int(c.hbm_bytes) for c in cs), sum(float(c.flops) for c in cs),
                None if hw is None else sum(float(c.time(hw).seconds) for c in cs)) for g, cs in parts.items()}


def _draw(path, sweep):
    from ..report.charts import figure, save

    fig, axes = figure(ncols=2, width=3.8, height=3.0)
    for ax, algorithm in zip(axes[0], ("standard", "flash2")):
        bottom = np.zeros(len(SWEEP))
        for g in GROUPS:
            share = np.array([sweep[(n, algorithm)][g][0] / sum(v[0] for v in sweep[(n, algorithm)].values())
                              for n in SWEEP])
            ax.bar([str(n) for n in SWEEP], share, bottom=bottom, label=g)
            bottom += share
        ax.set_title(f"HBM bytes by component, {'standard' if algorithm == 'standard' else 'flash'} attention",
                     fontsize=8)
        ax.set_xlabel("N (source = target)")
        ax.tick_params(labelsize=7)
    axes[0, 0].set_ylabel("share of a forward's bytes")
    axes[0, 1].legend(fontsize=6)
    save(fig, path)


def run(lesson, *, seed=0, n=512, hardware="H100-SXM"):
    hw = load(hardware) if isinstance(hardware, str) else hardware
    trace, logits, ref, (src_lengths, tgt_lengths) = run_small(seed)
    lesson.heading("The model, from this library's pieces")
    lesson.say(f"d_model {SMALL.d_model}, {SMALL.n_heads} heads of d_k = {SMALL.d_k}, d_ff {SMALL.d_ff}, "
               f"{SMALL.n_layers} encoder and {SMALL.n_layers} decoder layers, a vocabulary of {SMALL.vocab}, random "
               f"weights (seed {seed}). A batch of two: source lengths {src_lengths} and target lengths "
               f"{tgt_lengths}, padded at the end. The padding mask is the keys each sequence is given, the causal "
               f"mask the `causal` flag of `kernels.attention`; cross-attention has Nq ≠ Nk.")
    seen, rows = set(), []
    for component, shape in trace:
        if component not in seen:
            seen.add(component)
            rows.append([component, " × ".join(map(str, shape))])
    lesson.table(["component (first layer of each kind)", "output shape"], rows)
    err = float(np.abs(logits - ref).max())
    lesson.say(f"Against the float64 NumPy reference (`models.transformer.reference`: full mask matrices, a plain "
               f"softmax): largest logit difference {num(err, 2)}, the logits' largest magnitude "
               f"{num(np.abs(ref).max())} (the model computes in float32).")
    n_src = n_tgt = n
    lesson.heading(f"The paper's base model at N = {n}: bytes and FLOPs from the cost model")
    lesson.say(f"d_model {BASE.d_model}, {BASE.n_heads} heads, d_ff {BASE.d_ff}, {BASE.n_layers} + {BASE.n_layers} "
               f"layers, vocabulary {BASE.vocab:,} (Vaswani et al., Table 3 and §5.1); batch 1, fp16; roofline time "
               f"on {hw.name}. Embedding lookups, LayerNorm and the residual adds are elementwise and not in the "
               f"cost model, so they are left out.")
    sram = hw.sram_per_sm_bytes
    flash, std = (totals(component_costs(BASE, n_src, n_tgt, sram_bytes=sram, algorithm=a), hw)
                  for a in ("flash2", "standard"))
    d, f, L = BASE.d_model, BASE.d_ff, BASE.n_layers
    shapes = {"projections": f"{4 * 3 * L} × ({n} × {d}) · ({d} × {d})",
              "attention core": f"{3 * L} × {BASE.n_heads} heads of ({n} × {BASE.d_k}) · ({BASE.d_k} × {n}), "
                                f"causal in {L}",
              "FFN": f"{2 * L} × ({n} × {d}) · ({d} × {f}) and ({n} × {f}) · ({f} × {d})",
              "output projection": f"({n} × {d}) · ({d} × {BASE.vocab:,})"}
    lesson.table(["component", "products", "GFLOP", "HBM MB", "µs", "HBM MB with standard attention"],
                 [[g, shapes[g], f"{flash[g][1] / 1e9:,.2f}", f"{flash[g][0] / 1e6:,.1f}",
                   f"{flash[g][2] * 1e6:,.1f}", f"{std[g][0] / 1e6:,.1f}"] for g in GROUPS])
    sweep = {(m, a): totals(component_costs(BASE, m, m, sram_bytes=sram, algorithm=a)) for m in SWEEP
             for a in ("standard", "flash2")}
    lesson.heading("Which part dominates as N grows")
    rows = []
    for m in SWEEP:
        st, fl = sweep[(m, "standard")], sweep[(m, "flash2")]
        rows.append([f"{m:,}", *(f"{100 * fl[g][1] / sum(v[1] for v in fl.values()):.0f}%" for g in GROUPS),
                     max(st, key=lambda g: st[g][0]), max(fl, key=lambda g: fl[g][0]),
                     num(st["attention core"][0] / fl["attention core"][0])])
    lesson.table(["N", *(f"FLOPs: {g}" for g in GROUPS), "most bytes (standard)", "most bytes (flash)",
                  "attention bytes, standard / flash"], rows)
    lesson.say("The projections, the FFN and the output projection grow like N; the attention core's FLOPs grow "
               "like N². Standard attention's bytes grow like N² as well: it writes S and P and reads them back. "
               "FlashAttention-2 never writes them, but it reads K and V once per query block, so its bytes grow "
               "like N²·d / Br, with the block height Br that the SRAM allows (FlashAttention, Theorem 2).")
    lesson.chart("transformer_bytes.png", lambda p: _draw(p, sweep),
                 "share of a forward's HBM bytes per component as N grows, standard vs flash attention")
