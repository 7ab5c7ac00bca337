"""The check's unit of work and its record: a ``Case`` (one measurement, run in a worker process) and a
``RowLog`` (a CSV file that gets each row the moment it exists, so a run cut short keeps everything before the cut).
"""
from __future__ import annotations

import csv
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# A row's status, one word each (the CSV's ``status`` column): a check that passed or failed, a case that raised,
# one stopped at its time limit, one not started (global deadline, or something it needs is missing), and a
# measurement that produced its figures ("ok": benchmarks, machine facts, tool runs).
STATUSES = ("passed", "failed", "error", "timed out", "skipped", "not run", "ok")


@dataclass(frozen=True)
class Case:
    """One case of a part: ``run()`` returns its row's columns (``status`` among them, "ok" when omitted).

    ``needs`` names what it cannot run without ("cupy", "numba-cuda", "torch", ...): the worker writes a
    "skipped" row instead of calling it when one is missing. ``estimate_s`` is the dry run's estimate of its
    wall time (see ``plan.py`` for how each is made), and ``limit_s`` the time after which the runner stops it.
    """

    name: str
    size: str
    run: Callable[[], dict]
    estimate_s: float
    needs: tuple[str, ...] = ()
    limit_s: float | None = None
    columns: dict = field(default_factory=dict)  # fixed columns written whatever happens (tier, kernel, ...)

    def time_limit(self) -> float:
        """Seconds the case may run: ``limit_s``, else a generous multiple of the estimate (an estimate is made
        before any GPU run, so it may be several times off)."""
        return self.limit_s if self.limit_s is not None else max(60.0, 5.0 * self.estimate_s)


def row_columns(columns) -> list[str]:
    """A part's CSV columns: the case id, the part's own, then the ones every row has."""
    return list(dict.fromkeys(["case_id", *columns, "seconds", "status", "note"]))


class RowLog:
    """A CSV file with fixed columns, each row appended and flushed at once; ``rows()`` reads them back."""

    def __init__(self, path: Path, columns: list[str]):
        self.path = Path(path)
        self.columns = row_columns(columns)
        if not self.path.exists() or self.path.stat().st_size == 0:
            with self.path.open("w", newline="") as f:
                csv.DictWriter(f, fieldnames=self.columns).writeheader()

    def write(self, row: dict) -> dict:
        unknown = set(row) - set(self.columns)
        if unknown:
            raise ValueError(f"{self.path.name} has no column(s) {sorted(unknown)}; columns: {self.columns}")
        if row.get("status", "") not in STATUSES:
            raise ValueError(f"status {row.get('status')!r} is not one of {STATUSES}")
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns, restval="").writerow(row)
        return row

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        with self.path.open(newline="") as f:
            return list(csv.DictReader(f))

    def ids(self) -> set[int]:
        return {int(r["case_id"]) for r in self.rows() if r.get("case_id", "").isdigit()}


def error_note(err: BaseException, limit: int = 300) -> str:
    """The exception's type, message and innermost frame, on one line (for the ``note`` column)."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    text = f"{type(err).__name__}: {err}{where}".replace("\n", " ")
    return text[:limit]


def fixed_columns(case_id: int, case: Case, log: RowLog) -> dict:
    """The columns a case's row has whatever happens to it: its id, its fixed columns and its size."""
    return {"case_id": case_id, **case.columns, **({"size": case.size} if "size" in log.columns else {})}


def run_case(case_id: int, case: Case, log: RowLog, available: Callable[[str], bool]) -> dict:
    """Run one case in this process and write its row whatever happens (an exception is an "error" row)."""
    missing = [n for n in case.needs if not available(n)]
    row = fixed_columns(case_id, case, log)
    if missing:
        return log.write({**row, "status": "skipped", "note": f"needs {', '.join(missing)}, not available here"})
    t0 = time.perf_counter()
    try:
        result = dict(case.run())
        result.setdefault("status", "ok")
    except Exception as err:  # one case's failure is its row, and the next case still runs
        result = {"status": "error", "note": error_note(err)}
    return log.write({**row, **result, "seconds": f"{time.perf_counter() - t0:.3f}"})
