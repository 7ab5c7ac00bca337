"""Hardware specs: sourced presets, user TOML files, validation (this machine's calibration: test_calibrate.py)."""
from __future__ import annotations

import os
import re

import pytest

from simulator import hardware
from simulator.hardware import spec as spec_module

PRESETS = hardware.preset_names()


def test_the_eight_presets_are_there():
    assert set(PRESETS) == {"A100-40GB-SXM", "A100-80GB-SXM", "H100-SXM", "H200-SXM", "L4", "T4", "RTX-4090",
                            "RTX-3090"}


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_value_cites_its_source(name):
    text = (spec_module.PRESET_DIR / f"{name}.toml").read_text()
    for line in text.splitlines():
        if "=" not in line or line.lstrip().startswith("#") or line.split("=")[0].strip() in ("name", "kind"):
            continue
        key, _, rest = line.partition("=")
        value, hash_, source = rest.partition("#")
        assert hash_ and re.search(r"[A-Za-z]{3}", source), f"{name}: {key.strip()} has no source comment"


# FP16 tensor TFLOPS / DRAM TB/s, the ridge points of shared/hardware-facts.md
RIDGE = {"A100-40GB-SXM": 201, "A100-80GB-SXM": 153, "H100-SXM": 295, "H200-SXM": 206, "L4": 403, "T4": 203,
         "RTX-4090": 164, "RTX-3090": 76}


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load_with_si_units(name):
    hw = hardware.load(name)
    assert hw.kind == "gpu"
    assert 1e11 < hw.hbm_bandwidth < 1e13  # 100 GB/s .. 10 TB/s
    assert 32 * 2**10 <= hw.sram_per_sm_bytes <= 256 * 2**10
    assert hw.ridge_point("fp16") == pytest.approx(RIDGE[name], abs=1)
    assert hw.sram_bandwidth == 128 * hw.sm_count * hw.clock_hz


def test_names_are_case_insensitive_and_unknown_names_list_the_known():
    assert hardware.load("h100-sxm") == hardware.load("H100-SXM")
    with pytest.raises(ValueError, match=r"unknown hardware 'A10'; known: A100-40GB-SXM, .*T4.*'cpu'"):
        hardware.load("A10")


def test_user_toml_round_trips(tmp_path):
    hw = hardware.replace(hardware.load("L4"), name="my-L4", sram_per_sm_bytes=64 * 2**10)
    path = tmp_path / "mine.toml"
    path.write_text(hw.to_toml())
    assert hardware.load(str(path)) == hw


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("hbm_gb_per_s = 300", "hbm_gb_per_s = -300"), "hbm_gb_per_s must be >= 0"),
    (lambda t: "\n".join(line for line in t.splitlines() if not line.startswith("sm_count")),
     "missing field.*sm_count"),
    (lambda t: t + "\nwarp_size = 32\n", "unknown field.*warp_size"),
    (lambda t: t.replace('kind = "gpu"', 'kind = "tpu"'), "kind must be 'gpu' or 'cpu'"),
    (lambda t: t.replace("sm_count = 58", 'sm_count = "58"'), "sm_count must be a number"),
    (lambda t: t.replace("hbm_gb_per_s = 300", "hbm_gb_per_s = 0"), "hbm_bandwidth must be > 0"),
    (lambda t: t.replace("sm_count = 58", "sm_count = 57.9"), "sm_count must be a whole number"),  # (57 before)
    (lambda t: t.replace("sram_per_sm_kib = 100", "sram_per_sm_kib = 100.3"), "sram_per_sm_kib must be a whole "
                                                                              "number of bytes"),
    (lambda t: t + "\nsram_gb_per_s = nan\n", "sram_gb_per_s must be a finite number"),  # (accepted before)
    (lambda t: t.replace('compute_capability = "8.9"', 'compute_capability = "sm_89"'), "compute_capability must"),
    (lambda t: t.replace('compute_capability = "8.9"', 'compute_capability = "8.90"'), "compute_capability must"),
    # a name is printed into the reports' Markdown and HTML and into TOML: markup and quotes are refused
    (lambda t: t.replace('name = "L4"', 'name = "L4 | x"'), "name must be 1-80 letters"),
    (lambda t: t.replace('name = "L4"', 'name = "L4\\n## Injected"'), "name must be 1-80 letters"),
    (lambda t: t.replace('name = "L4"', 'name = "<script>alert(1)</script>"'), "name must be 1-80 letters"),
    (lambda t: t.replace('name = "L4"', 'name = "a\\"b"'), "name must be 1-80 letters"),
    (lambda t: t.replace('name = "L4"', 'name = ""'), "name must be 1-80 letters"),
])
def test_bad_specs_raise(edit, message):
    text = (spec_module.PRESET_DIR / "L4.toml").read_text()
    with pytest.raises(ValueError, match=message):
        hardware.from_toml(edit(text))


def test_loading_a_spec_never_measures():
    with pytest.raises(ValueError, match="measured rather than read.*simulator.calibrate.cpu_spec"):
        hardware.load("cpu")


def test_the_shared_level_is_sourced_or_marked_unknown():
    for name in PRESETS:
        hw = hardware.load(name)
        text = (spec_module.PRESET_DIR / f"{name}.toml").read_text()
        if hw.l2_bandwidth:
            # the L2 sits between SRAM and DRAM in bandwidth as in capacity
            assert hw.hbm_bandwidth < hw.l2_bandwidth < hw.sram_bandwidth
        else:
            assert "l2_gb_per_s: no datasheet or published microbenchmark" in text
        assert hw.compute_capability and float(hw.compute_capability) >= 7.5


@pytest.mark.parametrize("edit, message", [
    (lambda t: t + "\nl2_gb_per_s = -5\n", "l2_gb_per_s must be >= 0"),
    (lambda t: t + '\nl2_gb_per_s = "fast"\n', "l2_gb_per_s must be a number"),
])
def test_bad_l2_bandwidth_raises(edit, message):
    with pytest.raises(ValueError, match=message):
        hardware.from_toml(edit((spec_module.PRESET_DIR / "L4.toml").read_text()))


def test_ctas_in_flight_follow_the_sram_and_the_registers():
    h100 = hardware.load("H100-SXM")
    assert h100.ctas_in_flight(48 * 1024) == 132 * 4  # 228 KiB / 48 KiB
    assert h100.ctas_in_flight(200 * 1024) == 132
    assert h100.ctas_in_flight(300 * 1024) == 132  # a CTA larger than an SM's SRAM still runs one (the model)
    assert h100.ctas_in_flight(1024) == 132 * spec_module.MAX_CTAS_PER_SM
    # 128 threads of 255 registers: 65536 // 32640 = 2 per SM
    assert h100.ctas_in_flight(48 * 1024, threads_per_cta=128, registers_per_thread=255) == 132 * 2
    cpu = hardware.replace(h100, kind="cpu", sm_count=2)
    assert cpu.ctas_in_flight(48 * 1024) == 2  # one task per core


def test_a_cpu_model_string_becomes_a_safe_name(monkeypatch):
    # the calibrated spec's name and the report's machine table come from /proc/cpuinfo's string
    from simulator import calibrate

    assert spec_module.safe_name("Intel(R) Xeon(R) Platinum 8480+ @ 2.00GHz") == \
        "Intel(R) Xeon(R) Platinum 8480+ @ 2.00GHz"
    monkeypatch.setattr(calibrate, "cpu_model", lambda: 'EVIL | <b>x</b> `y` "z"\n## h')
    name = f"cpu ({calibrate.machine_id()})"
    assert name == f"cpu (EVIL b x /b y z h x{os.cpu_count()})"
    hw = hardware.replace(hardware.load("L4"), name=name)
    assert hardware.from_toml(hw.to_toml()) == hw  # the round trip the calibration makes


def test_a_directory_named_like_a_spec_file_is_named_as_such(tmp_path):
    (tmp_path / "x.toml").mkdir()
    with pytest.raises(ValueError, match="x.toml is a directory"):
        hardware.load(str(tmp_path / "x.toml"))
