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
