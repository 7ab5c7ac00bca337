"""``ioaware costs attention``: both levels, the tiles it used and why, and the issue's done-when case."""
from __future__ import annotations

import re

import pytest

from simulator.cli import main


def _row(out, label):
    line = next(line for line in out.splitlines() if line.strip().startswith(label))
    return re.split(r"\s{2,}", line.strip())[1:]


def test_fa2_on_h100_is_compute_bound_at_its_compulsory_traffic(capsys):
    assert main(["costs", "attention", "--n", "4096", "--d", "64", "--heads", "16", "--hardware", "H100-SXM"]) == 0
    out = capsys.readouterr().out
    assert "flash2 tiles: flash-attn" in out
    standard, flash1, flash2 = _row(out, "bound")
    assert flash2 == "compute" and standard == "dram"
    dram = [float(x) for x in _row(out, "L2<->DRAM MB")]
    compulsory_mb = (4 * 16 * 4096 * 64 * 2 + 16 * 4096 * 4) / 1e6  # Q, K, V, O once, lse
    assert abs(dram[2] - compulsory_mb) < 0.01
    assert dram[2] <= dram[1]  # FA-2 no longer moves more than FA-1
    # S and P: all their bytes at both levels for the standard algorithm, none for FlashAttention
    assert _row(out, "S MB L2 / DRAM")[2] == "0.00 / 0.00"


def test_tiles_can_be_chosen_and_are_named(capsys):
    assert main(["costs", "attention", "--n", "2048", "--hardware", "A100-40GB-SXM", "--tiles", "paper"]) == 0
    out = capsys.readouterr().out
    assert "flash2 tiles: paper" in out and "Br <= d" in out
    assert main(["costs", "attention", "--n", "2048", "--hardware", "T4"]) == 0  # flash-attn 2 does not run there
    assert "flash2 tiles: paper" in capsys.readouterr().out
    assert main(["costs", "attention", "--n", "2048", "--hardware", "T4", "--tiles", "flash-attn"]) == 2
    assert "Ampere" in capsys.readouterr().err


def test_dtype_sets_the_rate_the_products_run_at(capsys):
    """--dtype fp32 prices the FLOPs at the fp32 peak, not the tensor cores' fp16 one; a precision the hardware has
    no rate of is refused before any output."""
    from simulator.hardware import load

    h100 = load("H100-SXM")
    for dtype, kind in (("fp16", "fp16"), ("fp32", "fp32")):
        assert main(["costs", "matmul", "--m", "4096", "--k", "4096", "--n", "4096", "--dtype", dtype]) == 0
        compute_us = float(_row(capsys.readouterr().out, "compute us")[0])
        assert abs(compute_us - 2 * 4096**3 / h100.peak(kind) * 1e6) < 0.1
    assert main(["costs", "attention", "--n", "4096", "--dtype", "fp32"]) == 0
    fp32_us = [float(x) for x in _row(capsys.readouterr().out, "compute us")]
    assert main(["costs", "attention", "--n", "4096", "--dtype", "fp16"]) == 0
    fp16_us = [float(x) for x in _row(capsys.readouterr().out, "compute us")]
    ratio = h100.peak("fp16") / h100.peak("fp32")
    assert all(abs(a / b - ratio) < 1e-2 * ratio for a, b in zip(fp32_us, fp16_us))  # (printed to 0.1 us)
    assert main(["costs", "attention", "--n", "1024", "--dtype", "bf16", "--hardware", "T4"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "T4 has no bf16 rate" in err


def test_a_negative_outlier_count_is_refused_by_its_option(capsys):
    with pytest.raises(SystemExit):
        main(["costs", "matmul", "--outliers", "-3"])
    assert "--outliers: must be >= 0" in capsys.readouterr().err  # ("n_outliers ..." from the cost model before)
