"""The passkey section: can SmolLM2 still read a 5-digit number back out of a long haystack when its KV cache is
pruned by SnapKV, StreamingLLM or H2O after the prefill? Skipped, with the reason, like the SmolLM2 section."""
from __future__ import annotations

from .charts import figure, save
from .core import RunContext, Section, planned, read_csv, write_csv

TITLE = "Passkey retrieval with a pruned KV cache"
POLICY_LABELS = {"snapkv": "SnapKV", "streaming": "StreamingLLM", "h2o": "H2O"}
POLICY_COLORS = {"snapkv": "tab:blue", "streaming": "tab:orange", "h2o": "tab:green"}


# (contexts, depths, capacities) keyed by quick; None: the evaluation's defaults. Quick mode answers one prompt
# (one prefill) per policy, so that the whole quick report stays near a minute on 2 cores.
QUICK_PLAN = ((1024,), (0.5,), (256,))


def _plan(quick):
    from models import passkey

    return QUICK_PLAN if quick else (passkey.CONTEXTS, passkey.DEPTHS, passkey.CAPACITIES)


def _planned_prompts(quick):
    try:
        contexts, depths, _ = _plan(quick)
    except ImportError:
        return 0
    return len(contexts) * len(depths)


@planned(_planned_prompts)  # one per prompt
def passkey_section(ctx: RunContext) -> Section:
    try:
        from models import passkey
        from models.smollm2 import SmolLM2, fetch_gguf, require_model_extra

        require_model_extra()  # before the download, as the SmolLM2 section
        path = fetch_gguf()
    except ImportError:
        return Section(TITLE, "Skipped: the model extra is not installed (`pip install -e .[model]`).\n")
    except RuntimeError as err:
        return Section(TITLE, f"Skipped: the GGUF could not be fetched ({err}).\n")
    contexts, depths, capacities = _plan(ctx.quick)
    model = SmolLM2(path)
    rows = passkey.evaluate(model, contexts, depths, capacities, seed=ctx.seed, progress=ctx.step)
    write_csv(ctx.directory / "passkey.csv", rows)
    plot_accuracy(ctx.directory, contexts)
    table = passkey.format_table(passkey.accuracy_table(rows), contexts)
    body = (f"A seeded haystack of short filler sentences hides the line \"The pass key is NNNNN. Remember it. "
            f"NNNNN is the pass key.\" at depths {', '.join(f'{d:g}' for d in depths)} of its length; the prompt "
            f"(chat template, {', '.join(map(str, contexts))} tokens) ends with the question and the opening "
            f"\"{passkey.ANSWER_PREFIX}\", and an answer counts when the first number the model then writes "
            f"(greedy, 8 tokens) is the passkey. Each prompt is prefilled once with the full cache; every policy "
            f"then prunes a copy of that cache in every layer to the given capacity (tokens per kv head) and the "
            f"answer is decoded from it. Fraction answered correctly over the depths:\n\n{table}\n\n"
            f"Who sees the question when choosing what to keep: SnapKV scores the prompt by the attention of its "
            f"last 32 queries (window 32), which are the question and the answer's opening, so it looks for what "
            f"will be asked; H2O ranks keys by the attention they received from every query of the prompt, the "
            f"question's among thousands; StreamingLLM keeps the first 4 tokens and the most recent ones whatever "
            f"they hold, so it finds the passkey only when the needle lies in that recent window. \"= full\" marks "
            f"a capacity at least as long as the prompt (nothing pruned). The full-cache row is this small model's "
            f"own ceiling.\n\n![passkey accuracy by capacity](passkey.png)\n\nData (every answer): "
            f"[passkey.csv](passkey.csv)\n")
    return Section(TITLE, body, ("passkey.csv", "passkey.png"))


def plot_accuracy(directory, contexts) -> None:
    rows = read_csv(directory / "passkey.csv")
    fig, axes = figure(ncols=len(contexts), width=4.2, height=3.6)
    for ax, n in zip(axes[0], contexts):
        here = [r for r in rows if int(r["n"]) == n]
        full = [int(r["correct"]) for r in here if r["policy"] == "full"]
        ax.axhline(sum(full) / len(full), color="black", linestyle="--", label="full cache")
        for policy, label in POLICY_LABELS.items():
            caps = sorted({int(r["capacity"]) for r in here if r["policy"] == policy})
            acc = [sum(int(r["correct"]) for r in here if r["policy"] == policy and int(r["capacity"]) == c)
                   / sum(1 for r in here if r["policy"] == policy and int(r["capacity"]) == c) for c in caps]
            if caps:
                ax.plot(caps, acc, marker="o", color=POLICY_COLORS[policy], label=label)
        ax.set_xscale("log", base=2)
        ax.set(title=f"{n}-token prompt", xlabel="kept tokens per kv head", ylim=(-0.05, 1.05))
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("passkey answered correctly")
    axes[0][0].legend(fontsize=8)
    save(fig, directory / "passkey.png")
