"""This machine's spec: measured once, plausible, cached, and measured again only when asked."""
from __future__ import annotations

import pytest

from simulator import calibrate


def test_cpu_calibration_is_plausible_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("IOAWARE_CACHE_DIR", str(tmp_path))
    hw = calibrate.cpu_spec()
    assert hw.kind == "cpu" and hw.measured_on
    assert 1e9 < hw.hbm_bandwidth < 2e12  # 1 GB/s .. 2 TB/s
    assert 1e9 < hw.fp32_flops < 1e14
    assert hw.sram_bandwidth > hw.hbm_bandwidth  # a core's cache is faster than DRAM
    assert hw.sm_count >= 1 and hw.sram_per_sm_bytes > 0
    assert (tmp_path / calibrate.CACHE_FILE).exists()
    # the second call reads the cache, and force measures again

    def fail():
        raise AssertionError("measured again")

    monkeypatch.setattr(calibrate, "calibrate", fail)
    assert calibrate.cpu_spec() == hw
    with pytest.raises(AssertionError, match="measured again"):
        calibrate.cpu_spec(force=True)


def test_a_cache_file_from_other_code_is_measured_again(tmp_path, monkeypatch):
    # the rates are measured on the kernels: a file written by another version of them (or by one that had no
    # stamp) is not used
    monkeypatch.setenv("IOAWARE_CACHE_DIR", str(tmp_path))
    hw = calibrate.cpu_spec()
    path = tmp_path / calibrate.CACHE_FILE
    text = path.read_text()
    assert text.startswith(calibrate.cache_stamp()) and len(calibrate.code_stamp()) == 16
    assert calibrate.cached_spec() == hw
    path.write_text(text.replace(calibrate.code_stamp(), "0" * 16))
    assert calibrate.cached_spec() is None
    path.write_text(text[len(calibrate.cache_stamp()):])  # no stamp: written before stamps
    assert calibrate.cached_spec() is None
    measured = []
    monkeypatch.setattr(calibrate, "calibrate", lambda: measured.append(1) or hw)
    assert calibrate.cpu_spec() == hw and measured == [1]
    assert path.read_text().startswith(calibrate.cache_stamp())


def test_the_code_stamp_follows_the_kernels_source(tmp_path, monkeypatch):
    # a stand-in tree: the digest changes with a kernel's source and not with a file it does not cover
    root = tmp_path / "tree"
    (root / "kernels" / "attn").mkdir(parents=True)
    (root / "simulator").mkdir()
    (root / "kernels" / "attn" / "a.py").write_text("x = 1\n")
    (root / "simulator" / "calibrate.py").write_text("")
    (root / "simulator" / "measure.py").write_text("")
    (root / "simulator" / "report.py").write_text("")
    monkeypatch.setattr(calibrate, "__file__", str(root / "simulator" / "calibrate.py"))

    def stamp():
        calibrate.code_stamp.cache_clear()
        return calibrate.code_stamp()

    try:
        first = stamp()
        (root / "simulator" / "report.py").write_text("y = 2\n")
        assert stamp() == first
        (root / "kernels" / "attn" / "a.py").write_text("x = 2\n")
        assert stamp() != first
    finally:
        calibrate.code_stamp.cache_clear()


def test_a_cache_directory_that_cannot_be_written_is_warned_of(tmp_path, monkeypatch, capsys):
    # IOAWARE_CACHE_DIR below a file: the spec is measured and used, the cache left with a warning (the CLI's
    # --hardware cpu used to end in a traceback there)
    from simulator.cli import main

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    monkeypatch.setenv("IOAWARE_CACHE_DIR", str(a_file / "cache"))
    with pytest.warns(RuntimeWarning, match="could not write the cache file"):
        hw = calibrate.cpu_spec()
    monkeypatch.setattr(calibrate, "calibrate", lambda: hw)  # measured again each time: no cache
    with pytest.warns(RuntimeWarning, match="could not write the cache file"):
        assert main(["costs", "matmul", "--hardware", "cpu"]) == 0
    assert "on cpu (" in capsys.readouterr().out
