"""snapkv: what SnapKV's observation window sees on a real passkey prompt through SmolLM2 (Li et al. 2024): the
window's pooled votes over the prompt, the positions each kv head keeps, the needle among them; StreamingLLM and
H2O at the same budget beside it, and whether each still finds the passkey."""
from __future__ import annotations

import functools

import numpy as np

from kernels import kvprune

from ._lesson import num
from ._model import load_smollm2

TITLE = "snapkv: what the observation window sees"
SUMMARY = "a passkey prompt through SmolLM2: the window's votes, the kept positions per head, vs StreamingLLM and H2O"
OPTIONS = ("seed", "context", "capacity", "model")
WINDOW = 32  # SnapKV's observation window (Li et al. 2024, §5: 32 in its experiments)
KERNEL_SIZE = 7  # the pooling width of SnapKV's reference configuration
DEPTH = 0.5  # where the needle sits in the haystack
POLICIES = ("snapkv", "streaming", "h2o")
LABELS = {"snapkv": "SnapKV", "streaming": "StreamingLLM", "h2o": "H2O"}


def observe(model, case, *, capacity, window=WINDOW, layer=None, max_new_tokens=8):
    """Prefill ``case.ids`` once; in ``layer`` (default the middle one) the window's votes (Hkv, N − window) and
    the positions each policy keeps (Hkv, capacity); per policy, applied to every layer, the decoded answer."""
    cache, queries = model.new_cache(), []
    hidden = model.forward(case.ids, cache, 0, logits=False, queries=queries)  # (N, hidden)
    logits = model.lm_head(hidden[-1:])[0]  # (vocab,): the last position's only
    layer = len(cache) // 2 if layer is None else layer
    q, k, v = queries[layer][None], cache[layer][0][None], cache[layer][1][None]  # (1, Hq | Hkv, N, d)
    votes = kvprune.snapkv_scores(q[:, :, -window:], k, kernel_size=KERNEL_SIZE)[0]  # (Hkv, N − window)
    h2o_scores = [kvprune.h2o_scores(qi[None], kv[0][None]) for qi, kv in zip(queries, cache)]  # per layer
    policies = {
        "snapkv": functools.partial(kvprune.snapkv_compress, capacity=capacity, window=window,
                                    kernel_size=KERNEL_SIZE),
        "streaming": functools.partial(kvprune.streaming_llm, capacity=capacity),
        "h2o": [functools.partial(kvprune.h2o, capacity=capacity, scores=s) for s in h2o_scores],
    }
    kept, answers = {}, {}
    for name, policy in policies.items():
        one = policy[layer] if isinstance(policy, list) else policy
        kept[name] = one(q, k, v)[2][0]  # (Hkv, capacity) positions, ascending
        pruned = cache.copy()  # compress_cache writes the kept keys into the cache it is given
        model.compress_cache(pruned, queries, policy)
        answers[name] = model.continue_decoding(logits, pruned, len(case.ids), max_new_tokens)
    answers["full"] = model.continue_decoding(logits, cache.copy(), len(case.ids), max_new_tokens)
    return {"layer": layer, "votes": votes, "kept": kept, "answers": answers}


def needle_kept(kept, case):
    """Per kv head, how many of the needle's tokens a policy kept."""
    needle = np.arange(case.needle_position, case.needle_position + case.needle_length)
    return [int(np.isin(needle, row).sum()) for row in kept]


def _draw(path, seen, case, capacity):
    from ..report.charts import figure, save

    votes, kept = seen["votes"], seen["kept"]
    n = len(case.ids)
    fig, axes = figure(nrows=2, width=7.5, height=2.6)
    lo, hi = case.needle_position, case.needle_position + case.needle_length
    for h, row in enumerate(votes):
        axes[0, 0].plot(np.arange(row.size), row, lw=0.8, label=f"kv head {h}")
    axes[0, 0].set_yscale("log")
    axes[0, 0].set_ylabel("pooled votes")
    axes[0, 0].set_title(f"layer {seen['layer']}: the last {n - votes.shape[1]} queries vote (needle shaded)",
                         fontsize=9)
    axes[0, 0].legend(fontsize=7)
    labels = []
    for r, (name, positions) in enumerate((name, p) for name in POLICIES for p in kept[name]):
        y = len(labels)
        axes[1, 0].scatter(positions, np.full(positions.size, y), s=1.5, marker="|", color="tab:blue")
        labels.append(f"{LABELS[name]} h{r % kept[name].shape[0]}")
    axes[1, 0].set_yticks(range(len(labels)), labels, fontsize=6)
    axes[1, 0].invert_yaxis()
    axes[1, 0].set_xlabel(f"prompt position (kept: {capacity} of {n} per head)")
    for ax in axes[:, 0]:
        ax.axvspan(lo, hi, color="tab:red", alpha=0.3)
        ax.set_xlim(0, n)
    save(fig, path)


def run(lesson, *, seed=0, context=1024, capacity=256, model=None):
    from models.passkey import answer_found, make_case

    if model is None:
        model, reason = load_smollm2()
        if model is None:
            lesson.skip(reason)
            return
    if capacity <= WINDOW or capacity >= context:
        raise ValueError(f"capacity must lie between the window ({WINDOW}) and the context ({context}); "
                         f"got {capacity}")
    case = make_case(model.encode, context, DEPTH, seed=seed)
    lesson.say(f"A passkey prompt of {len(case.ids)} tokens (seed {seed}): filler sentences, a 5-digit passkey "
               f"at depth {DEPTH} (tokens {case.needle_position}–{case.needle_position + case.needle_length - 1}), "
               f"the question at the end. One prefill through SmolLM2-135M; then each cache policy keeps "
               f"{capacity} tokens per kv head in every layer and the model answers from what was kept.")
    seen = observe(model, case, capacity=capacity)
    votes = seen["votes"]
    lesson.heading(f"The observation window's votes (layer {seen['layer']})")
    lo, hi = case.needle_position, case.needle_position + case.needle_length
    share = votes[:, lo:hi].sum(axis=1) / votes.sum(axis=1)
    lesson.say(f"SnapKV's last {WINDOW} queries (the question and the answer's opening) score every earlier "
               f"position by their attention, max-pooled over {KERNEL_SIZE} neighbours. The needle is "
               f"{case.needle_length} of {votes.shape[1]} scored positions "
               f"({num(100 * case.needle_length / votes.shape[1], 2)}%); its share of the votes per kv head: "
               + ", ".join(f"{num(100 * s, 3)}%" for s in share) + ".")
    lesson.heading("What each policy keeps, and whether the model still answers")
    rows = []
    for name in POLICIES:
        answer = model.decode(seen["answers"][name]) if model.tokenizer is not None else str(seen["answers"][name])
        found = answer_found(answer, case.passkey)
        rows.append([LABELS[name], " / ".join(map(str, needle_kept(seen["kept"][name], case))), answer.strip(),
                     "yes" if found else "no"])
    full = model.decode(seen["answers"]["full"]) if model.tokenizer is not None else str(seen["answers"]["full"])
    rows.append(["full cache", f"all {case.needle_length}", full.strip(),
                 "yes" if answer_found(full, case.passkey) else "no"])
    lesson.table(["policy", f"needle tokens kept per kv head (layer {seen['layer']})", "answer",
                  f"finds {case.passkey}"], rows)
    lesson.say("StreamingLLM keeps the first tokens and the most recent ones whatever they say; H2O keeps what the "
               "whole prompt attended to most, and the recent half; SnapKV keeps what the question attends to.")
    lesson.chart("snapkv.png", lambda p: _draw(p, seen, case, capacity),
                 "the window's votes per kv head, and the positions each policy keeps (needle in red)")
