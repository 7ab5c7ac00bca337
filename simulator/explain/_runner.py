"""The ``explain`` subcommand: list the topics, or show one lesson block by block (rich text on a terminal, plain
Markdown when piped) and, with ``--out``, write its page."""
from __future__ import annotations

import shutil
import sys
import time

from . import TOPICS, run_topic, topic_module


def _printer():
    """A callable that shows one Markdown block: through rich on a terminal, as plain text otherwise."""
    if not sys.stdout.isatty():
        return lambda block: print(block + "\n", flush=True)
    from rich.console import Console
    from rich.markdown import Markdown

    console = Console()
    return lambda block: console.print(Markdown(block), "")


def _explain(args) -> int:
    if args.topic is None:
        width = max(map(len, TOPICS))
        for name in TOPICS:
            print(f"{name.ljust(width)}  {topic_module(name).SUMMARY}")
        print("\nioaware explain TOPIC [--out DIR] shows one; --help lists the options.")
        return 0
    from ..cli import out_problem

    problem = out_problem(args.out)  # as the report: a page is never written over another, nor into "."
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    show = _printer()
    show(f"# {topic_module(args.topic).TITLE}")
    start = time.perf_counter()
    try:
        lesson = run_topic(args.topic, out=args.out, emit=show, seed=args.seed, n=args.n, tile=args.tile,
                           hardware=args.hardware, preset=args.model, context=args.context, capacity=args.capacity)
    except BaseException as err:
        # the directory this call made (out_problem refused one that existed) goes: left, it would refuse a rerun
        if args.out is not None:
            shutil.rmtree(args.out, ignore_errors=True)
        if not isinstance(err, ValueError):
            raise
        print(f"error: {err}", file=sys.stderr)  # a size the topic refuses (e.g. a capacity outside the context)
        return 2
    seconds = time.perf_counter() - start
    if args.out is not None:
        print(f"written to {args.out}/index.md and {args.out}/index.html ({len(lesson.files)} charts)",
              file=sys.stderr)
    print(f"{args.topic}: {seconds:.1f} s", file=sys.stderr)
    return 0


def add_subcommand(commands, hardware_type, positive, nonnegative) -> None:
    """Add ``explain`` to the CLI's subparsers (``hardware_type``, ``positive``, ``nonnegative``: the CLI's argparse
    types)."""
    from models import PRESETS

    p = commands.add_parser("explain", help="lessons of IO-aware inference, computed by this library",
                            description="Lessons whose every number comes out of the kernels, the cost model and "
                                        "the tile simulator. Without TOPIC: the list of topics.")
    p.add_argument("topic", nargs="?", choices=list(TOPICS), metavar="TOPIC", help=", ".join(TOPICS))
    p.add_argument("--out", metavar="DIR", help="also write index.md, index.html, PNG charts and GIF animations")
    p.add_argument("--seed", type=nonnegative, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--n", type=positive, help="sequence length (softmax-tiles, transformer)")
    p.add_argument("--tile", type=positive, help="tile size (softmax-tiles: key tile; flash-tiles: tiles per side)")
    p.add_argument("--hardware", type=hardware_type, metavar="NAME|FILE.toml", help="preset for kv-cache, "
                   "transformer (default H100-SXM)")
    p.add_argument("--model", choices=sorted(PRESETS), metavar="PRESET",
                   help=f"model preset for kv-cache (default llama-3.1-8b; known: {', '.join(PRESETS)})")
    p.add_argument("--context", type=positive, help="prompt tokens (snapkv, kv-cache)")
    p.add_argument("--capacity", type=positive, help="KV-cache budget in tokens (snapkv, kv-cache)")
    p.set_defaults(func=_explain)
