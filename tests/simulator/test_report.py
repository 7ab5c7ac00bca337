"""The report: files written CSV-first, charts from the CSV, atomic run directories, and the CLI."""
from __future__ import annotations

import subprocess
import sys

import pytest

from simulator import report
from simulator.cli import main
from simulator.report import RunContext, Section, build_report, read_csv


@pytest.fixture
def tiny_sizes(monkeypatch):
    monkeypatch.setitem(report.ATTN_SIZES, True, (64, 512))


def test_quick_report_writes_csv_chart_and_page(tmp_path, tiny_sizes):
    steps = []
    out = build_report(tmp_path / "run", quick=True, progress=steps.append)
    assert sorted(p.name for p in out.iterdir()) == ["attention_cpu.csv", "attention_cpu.png", "index.md",
                                                      "machine.csv"]
    rows = read_csv(out / "attention_cpu.csv")
    assert {(r["algorithm"], r["causal"], r["n"]) for r in rows} == {
        (a, c, n) for a in ("standard", "flash") for c in ("False", "True") for n in ("64", "512")}
    for r in rows:
        assert float(r["median_s"]) > 0 and float(r["gflops_per_s"]) > 0
    # S and P are 2·H·N² float32: the standard algorithm's peak must show them, flash's must not
    big = {r["algorithm"]: int(r["peak_traced_bytes"]) for r in rows if r["n"] == "512" and r["causal"] == "False"}
    assert big["standard"] >= 2 * 8 * 512 * 512 * 4
    assert big["flash"] < big["standard"] / 4
    assert (out / "attention_cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "index.md").read_text()
    assert "## Attention on this CPU" in page and "](attention_cpu.png)" in page
    assert len(steps) == len(rows)


def test_existing_directory_is_not_overwritten(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        build_report(tmp_path / "run", quick=True, sections=())


def test_interrupted_report_leaves_nothing(tmp_path):
    def writes_then_fails(ctx: RunContext) -> Section:
        (ctx.directory / "partial.csv").write_text("a\n1\n")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_report(tmp_path / "run", quick=True, sections=(writes_then_fails,))
    assert list(tmp_path.iterdir()) == []


def test_cli_report(tmp_path, tiny_sizes, capsys):
    assert main(["report", "--quick", "--no-progress", "--out", str(tmp_path / "r")]) == 0
    assert "report written to" in capsys.readouterr().out
    assert (tmp_path / "r" / "index.md").exists()
    assert main(["report", "--quick", "--no-progress", "--out", str(tmp_path / "r")]) == 2
    assert "already exists" in capsys.readouterr().err


def test_cli_help_and_bad_arguments():
    run = subprocess.run([sys.executable, "-m", "simulator", "report", "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and "--quick" in run.stdout and "--out" in run.stdout
    run = subprocess.run([sys.executable, "-m", "simulator", "reprot"], capture_output=True, text=True)
    assert run.returncode == 2 and "invalid choice" in run.stderr


def test_console_script_runs_the_cli():
    from pathlib import Path

    script = Path(sys.executable).parent / "ioaware"
    if not script.exists():
        pytest.skip(f"the package is not installed into {Path(sys.executable).parent} (pip install -e . adds it)")
    run = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and "report" in run.stdout
