"""Passkey retrieval: a long, seeded haystack of filler sentences hides one 5-digit number at a chosen depth, and the
model is asked for it at the end (the synthetic long-context test of Mohtashami & Jaggi 2023, "Landmark
Attention", §4.2). Everything is generated here from a seed; nothing is downloaded.

The evaluation prefills each prompt once and then decodes the answer under every KV-cache policy from the same
prefill, so the policies differ only in which keys and values they keep. The question sits at the end of the
prompt, which matters for who can find the passkey:

- SnapKV scores keys with the queries of the prompt's last ``window`` tokens: the question and the answer's
  opening words. It sees the question when it chooses.
- H2O keeps the keys with the largest attention summed over every query of the prefill; the question's queries
  are among them but carry no more weight than the haystack's, so it half-sees it.
- StreamingLLM keeps the first ``n_sink`` tokens and the most recent ones whatever the content: it never sees the
  question, and finds the passkey only when the passkey lies within the recent window.
"""
from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass

import numpy as np

from kernels import kvprune

from .smollm2 import DEFAULT_SYSTEM, cache_policy

# Filler in the spirit of the original test: short, true, repetitive sentences with no numbers in them, drawn in a
# seeded order so that haystacks differ between seeds but not between runs.
FILLER = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Water flows downhill.",
    "Birds sing in the morning.", "The road goes on and on.", "Clouds drift across the hills.",
    "The river runs to the sea.", "Leaves fall in autumn.", "Snow melts in spring.", "The wind moves the trees.",
    "Here we go again.", "There and back again.", "The night is quiet.", "Stars shine above the fields.",
)
# The wording matters to a 135M-parameter model: with "a pass key" and the bare question "What is the pass key?" it
# often explained what a pass key is (full cache, seed 0: 78% correct at 1024 tokens, 22% at 2048, 0% at 4096);
# naming the 5 digits in the instruction and in the question brought the full cache to 27 of 27 (seed 0: 9 depths
# at each of 1024, 2048 and 4096 tokens).
INSTRUCTION = ("There is a 5-digit pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
               "I will ask you what the pass key is.")
QUESTION = "What is the pass key? Answer with the 5-digit number."
ANSWER_PREFIX = "The pass key is"
DEPTHS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
CONTEXTS = (1024, 2048, 4096)
CAPACITIES = (128, 256, 512, 1024)
POLICIES = ("snapkv", "streaming", "h2o")


@dataclass(frozen=True)
class PasskeyCase:
    ids: list  # the prompt's token ids: chat template, instruction, haystack with the needle, question, answer prefix
    passkey: str
    depth: float  # where the needle sits, as a fraction of the haystack's tokens
    needle_position: int  # index of the needle's first token in ids
    needle_length: int  # tokens of the needle sentence, ids[needle_position:needle_position + needle_length]


def _needle(passkey: str) -> str:
    return f" The pass key is {passkey}. Remember it. {passkey} is the pass key. "


def _is_depth(value) -> bool:
    """A needle's depth: a number within [0, 1] (a fraction of the haystack's tokens)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and 0.0 <= value <= 1.0


def make_case(encode, n_tokens: int, depth: float, seed: int) -> PasskeyCase:
    """A prompt of exactly ``n_tokens`` tokens (``encode``: text -> ids) with a seeded 5-digit passkey placed after
    ``depth`` of the haystack's tokens (at a sentence boundary)."""
    if not _is_depth(depth):
        raise ValueError(f"depth must be a number within [0, 1]; got {depth!r}")
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, numbers.Integral):
        raise ValueError(f"n_tokens must be an int; got {n_tokens!r}")
    rng = np.random.default_rng(seed)
    passkey = str(int(rng.integers(10000, 100000)))
    head = encode(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\n{INSTRUCTION}\n")
    tail = encode(f"\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n{ANSWER_PREFIX}")
    needle = encode(_needle(passkey))
    budget = n_tokens - len(head) - len(tail) - len(needle)
    if budget < 16:
        raise ValueError(f"n_tokens={n_tokens} leaves no room for a haystack (needs >= {n_tokens - budget + 16})")
    sentences = [encode(" " + s) for s in FILLER]
    hay = []
    while len(hay) < budget:
        hay.extend(sentences[int(rng.integers(len(sentences)))])
    hay = hay[:budget]
    # put the needle at the sentence boundary nearest to the requested depth
    boundaries = [i + 1 for i, t in enumerate(hay) if t == sentences[0][-1]] or [0]
    cut = min([0, *boundaries], key=lambda b: abs(b - depth * budget))
    ids = head + hay[:cut] + needle + hay[cut:] + tail
    return PasskeyCase(ids, passkey, depth, len(head) + cut, len(needle))


def answer_found(answer: str, passkey: str) -> bool:
    """Whether the decoded answer's first number is the passkey."""
    digits = "".join(ch if ch.isdigit() else " " for ch in answer).split()
    return bool(digits) and digits[0] == passkey


def evaluate(model, contexts=CONTEXTS, depths=DEPTHS, capacities=CAPACITIES, policies=POLICIES, *, seed=0,
             window=32, max_new_tokens=8, progress=None, on_row=None):
    """Passkey accuracy rows: one per (n, depth, policy, capacity), n the prompt's tokens, with the full cache as
    policy "full"; ``on_row`` (optional) gets each row as soon as it exists (so a long run loses nothing when
    stopped). Each prompt is prefilled once; every policy compresses a copy of that prefill's cache and decodes
    greedily. Contexts that the model's own (``context_length``) cannot hold with the answer's tokens are refused
    before any runs."""
    check_options(depths, capacities, policies, window)
    limit = getattr(model, "context_length", None)
    too_long = [n for n in contexts if limit is not None and n + max_new_tokens > limit]
    if too_long:
        raise ValueError(f"contexts {too_long} and max_new_tokens {max_new_tokens} exceed the model's context of "
                         f"{limit} tokens")
    rows = []
    for n_tokens in contexts:
        for i, depth in enumerate(depths):
            case = make_case(model.encode, n_tokens, depth, seed=seed * 1000 + n_tokens + i)
            if progress is not None:
                progress(f"passkey {n_tokens} tokens, depth {depth}")
            cache, queries = model.new_cache(n_tokens + max_new_tokens), []
            hidden = model.forward(case.ids, cache, 0, logits=False, queries=queries)  # (N, hidden)
            logits = model.lm_head(hidden[-1:])[0]  # (vocab,) of the last position only
            runs = [("full", n_tokens)] + [(name, c) for name in policies for c in capacities if c < n_tokens]
            h2o_scores = None
            if any(name == "h2o" for name, _ in runs):  # scored once per layer, shared by every capacity
                h2o_scores = [kvprune.h2o_scores(q[None], kv[0][None]) for q, kv in zip(queries, cache)]
            for name, capacity in runs:
                kept = cache.copy()  # the policies compress it in place; the prefill's cache stays for the next
                if name == "h2o":
                    model.compress_cache(kept, queries, [functools.partial(kvprune.h2o, capacity=capacity, scores=s)
                                                         for s in h2o_scores])
                elif name != "full":
                    options = {"window": window} if name == "snapkv" else {}
                    model.compress_cache(kept, queries, cache_policy(name, capacity=capacity, **options))
                out = model.continue_decoding(logits, kept, len(case.ids), max_new_tokens)
                answer = model.decode(out)
                rows.append({"n": n_tokens, "depth": depth, "policy": name, "capacity": capacity,
                             "passkey": case.passkey, "answer": answer.strip(),
                             "correct": int(answer_found(answer, case.passkey))})
                if on_row is not None:
                    on_row(rows[-1])
    return rows


def check_options(depths, capacities, policies, window=32):
    """Refuse, before any model runs, a depth outside [0, 1] and a capacity that a policy refuses: each policy is
    run once on a small random prompt one token longer than the capacity (its own checks, e.g. SnapKV's capacity
    above its window), so that a bad option fails in seconds, not after a prefill."""
    for depth in depths:
        if not _is_depth(depth):
            raise ValueError(f"depths must be numbers within [0, 1]; got {depth!r}")
    rng = np.random.default_rng(0)
    for capacity in capacities:
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral) or capacity < 1:
            raise ValueError(f"capacities must be ints >= 1; got {capacity!r}")
        q, k, v = (rng.standard_normal((1, 1, int(capacity) + 1, 2), dtype=np.float32) for _ in range(3))
        for name in policies:
            if name == "full":  # (no policy: the whole cache)
                continue
            options = {"window": window} if name == "snapkv" else {}
            try:
                cache_policy(name, capacity=capacity, **options)(q, k, v)
            except ValueError as err:
                raise ValueError(f"capacity {capacity} for {name}: {err}") from None


def accuracy_table(rows):
    """{(policy, capacity, n): fraction correct over depths}."""
    table = {}
    for r in rows:
        key = (r["policy"], int(r["capacity"]) if r["policy"] != "full" else None, int(r["n"]))
        table.setdefault(key, []).append(int(r["correct"]))
    return {key: sum(v) / len(v) for key, v in table.items()}


def format_table(table, contexts):
    """The accuracy table as Markdown: one row per policy and capacity, one column per context length."""
    lines = ["| cache | " + " | ".join(f"{n} tokens" for n in contexts) + " |",
             "|---|" + "---|" * len(contexts)]
    keys = sorted({key[:2] for key in table}, key=lambda k: (k[0] != "full", k[0], k[1] or 0))
    for policy, capacity in keys:
        label = "full" if policy == "full" else f"{policy} {capacity}"
        cells = [f"{table[(policy, capacity, n)]:.0%}" if (policy, capacity, n) in table else "= full"
                 for n in contexts]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
