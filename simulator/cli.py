"""Command line: ``python -m simulator`` or ``ioaware``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tqdm import tqdm


def _report(args) -> int:
    from .report import SECTIONS, build_report, default_out_dir

    out = Path(args.out) if args.out else default_out_dir()
    if out.exists():
        print(f"error: --out {out} already exists; choose another directory", file=sys.stderr)
        return 2
    with tqdm(desc="report", unit="step", file=sys.stderr, disable=args.no_progress) as bar:
        def progress(description):
            bar.set_postfix_str(description)
            bar.update(1)

        path = build_report(out, quick=args.quick, seed=args.seed, progress=progress, sections=SECTIONS)
    print(f"report written to {path / 'index.md'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ioaware", description="IO-aware kernels beside the bytes they move: measurement and reports.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    report = commands.add_parser(
        "report", help="measure this machine and write a report (CSV, PNG charts, index.md)",
        description="Measure standard vs flash attention on this CPU and write a report into a run directory.")
    report.add_argument("--quick", action="store_true", help="small sizes, under a minute on 2 cores")
    report.add_argument("--out", metavar="DIR", help="run directory to create (default: reports/runs/<date>-cpu)")
    report.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    report.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")
    report.set_defaults(func=_report)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
