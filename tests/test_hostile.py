"""The hostile-input suite: every case of ``tests/hostile_cases.py`` (bad arrays, sizes, numbers and choices for the
public kernels and the cost model) must end in a clear ValueError/TypeError naming the argument, or in the
oracle's result. The cases run in a child process, so that a crash (a kernel driven out of bounds) is a failed
case, not a dead test run: after a crash the child starts again after the case that killed it."""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cases():
    outcomes, first = {}, 0
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    while True:
        child = subprocess.run([sys.executable, "-m", "tests.hostile_cases", str(first)], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=900)
        lines = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
        outcomes.update({r["case"]: r["outcome"] for r in lines})
        if child.returncode == 0:
            return outcomes
        crashed = (lines[-1]["index"] + 1) if lines else first
        outcomes[f"case #{crashed}"] = f"crashed the process (exit {child.returncode}): {child.stderr[-300:]}"
        first = crashed + 1


def test_every_hostile_case_is_refused_clearly_or_follows_the_oracle():
    outcomes = run_cases()
    by_function = collections.Counter(case.split(":")[0] for case in outcomes)
    assert len(outcomes) > 300 and len(by_function) >= 12, by_function  # the suite itself must not shrink
    bad = {case: outcome for case, outcome in outcomes.items() if outcome != "ok"}
    assert not bad, "\n".join(f"{case}: {outcome}" for case, outcome in bad.items())
