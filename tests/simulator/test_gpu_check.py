"""The GPU check's robustness without a GPU: its real runner and worker on fake cases (one that raises, one that
kills its process, one that hangs, one that needs a missing package), the global deadline, tools that time out,
are missing or refuse the device (fake executables on PATH), the ncu and sanitizer parsers, and the dry run."""
from __future__ import annotations

import re
import stat
import sys
import time

import pytest

from simulator import cli, gpu_check
from simulator.gpu_check import _runner, ncu, sanitizers
from simulator.gpu_check._rows import Case, RowLog
from simulator.gpu_probe import COMPLETION, KERNEL_REGEX

FAKES = "tests.simulator.gpu_check_fakes"


def _fake_tool(tmp_path, name, script):
    """An executable ``name`` in tmp_path that runs the shell ``script``."""
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_each_case_gets_its_row_whatever_it_does(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    rows = _runner.run_part("fakes", f"{FAKES}:cases", out, quick=False, deadline=time.time() + 120,
                            log_path=out / "log.txt", progress=lambda text: None)
    by_name = {r["name"]: r for r in rows}
    assert [r["case_id"] for r in rows] == [str(i) for i in range(6)]
    assert by_name["ok"]["status"] == "passed" and by_name["ok"]["value"] == "1"
    assert by_name["raises"]["status"] == "error" and "ValueError: planted failure" in by_name["raises"]["note"]
    assert by_name["crashes"]["status"] == "error" and "exit status 7" in by_name["crashes"]["note"]
    assert by_name["hangs"]["status"] == "timed out" and "limit of 2 s" in by_name["hangs"]["note"]
    assert by_name["needs-missing"]["status"] == "skipped"
    assert "no_such_package_for_ioaware_tests" in by_name["needs-missing"]["note"]
    assert by_name["after"]["status"] == "ok" and by_name["after"]["value"] == "3"  # the run went on after all that


def test_rows_are_on_disk_as_soon_as_they_exist(tmp_path):
    log = RowLog(tmp_path / "part.csv", ["name"])
    log.write({"case_id": 0, "name": "first", "status": "passed"})
    assert (tmp_path / "part.csv").read_text().splitlines()[1].startswith("0,first,")
    with pytest.raises(ValueError, match="no column"):
        log.write({"case_id": 1, "nme": "typo", "status": "passed"})
    with pytest.raises(ValueError, match="status 'fine'"):
        log.write({"case_id": 1, "name": "x", "status": "fine"})


def test_the_deadline_stops_the_case_in_flight_and_skips_the_rest(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    rows = _runner.run_part("slow", f"{FAKES}:slow_cases", out, quick=False, deadline=time.time() + 2.5,
                            log_path=out / "log.txt", progress=lambda text: None)
    statuses = [r["status"] for r in rows]
    assert len(rows) == 4 and statuses[-1] == "skipped"
    assert set(statuses) <= {"ok", "timed out", "skipped"}
    assert any("deadline" in r["note"] for r in rows)


def test_a_tool_that_outlives_its_limit_is_stopped(tmp_path):
    t0 = time.perf_counter()
    result = _runner.run_tool([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
                              timeout_s=1.0, cwd=tmp_path)
    assert result.timed_out and result.returncode is None
    assert "started" in result.stdout and time.perf_counter() - t0 < 30


def test_a_missing_tool_is_a_result_not_an_exception(tmp_path):
    result = _runner.run_tool([str(tmp_path / "no-such-ncu"), "--version"], timeout_s=5)
    assert result.missing and result.returncode is None and "FileNotFoundError" in result.stderr


def test_tools_missing_from_path_mean_not_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # neither ncu nor compute-sanitizer there
    for case in sanitizers.cases(quick=False)[:1] + ncu.cases(quick=False)[:1]:
        row = case.run()
        assert row["status"] == "not run" and "not on the PATH" in row["note"]


def test_a_sanitizer_that_refuses_the_device_reads_not_run(tmp_path, monkeypatch):
    _fake_tool(tmp_path, "compute-sanitizer", 'echo "========= Error: Device not supported"; exit 1')
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    row = sanitizers.cases(quick=False)[0].run()
    assert row["status"] == "not run" and "Device not supported" in row["note"] and row["tool_rc"] == 1


def test_an_ncu_that_hangs_is_stopped_at_its_limit(tmp_path, monkeypatch):
    _fake_tool(tmp_path, "ncu", "sleep 60")
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setattr(ncu, "TOOL_LIMIT_S", 1.0)
    row = ncu.cases(quick=False)[0].run()
    assert row["status"] == "timed out" and row["tool_rc"] == ""


@pytest.mark.parametrize("output, returncode, status", [
    ("========= Error: Device not supported\n", 1, "not run"),
    ("{c}\n========= ERROR SUMMARY: 0 errors\n", 0, "passed"),
    ("========= Invalid __global__ read of size 2\n{c}\n========= ERROR SUMMARY: 3 errors\n", 1, "failed"),
    ("Traceback (most recent call last):\n========= ERROR SUMMARY: 0 errors\n", 1, "error"),
    ("{c}\n========= ERROR SUMMARY: 0 errors\n", 139, "failed"),
    # racecheck's own summary, as the first GPU check's H200 printed it
    ("{c}\n========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n", 0, "passed"),
    ("========= Error: Race reported between Write access at ioaware::softmax_rows\n{c}\n"
     "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n", 1, "failed"),
    ("{c}\nRACECHECK finished\n", 0, "not run"),
])
def test_sanitizer_verdicts(output, returncode, status):
    probes = ("int8", "snapkv")
    text = output.replace("{c}", "\n".join(COMPLETION.format(case=p) for p in probes))
    row = sanitizers.judge(probes, _runner.ToolRun(returncode, text, ""))
    assert row["status"] == status and row["tool_rc"] == returncode


def test_a_failed_sanitizer_run_says_what_the_tool_found():
    probes = ("int8",)
    text = ("========= COMPUTE-SANITIZER\n========= Invalid __global__ read of size 4 bytes\n"
            "=========     at kernel_x+0x40\n========= Invalid __global__ read of size 4 bytes\n"
            + COMPLETION.format(case="int8") + "\nwarn(NumbaPerformanceWarning)\n========= ERROR SUMMARY: 2 errors\n")
    row = sanitizers.judge(probes, _runner.ToolRun(1, text, ""))
    assert row["status"] == "failed" and row["errors"] == 2
    assert row["note"].startswith("Invalid __global__ read of size 4 bytes / at kernel_x+0x40 / ")


LOOKUP_REPORT = ('========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call '
                 'to cuGetProcAddress_v2.\n=========     Saved host backtrace up to driver entry point at error\n'
                 '=========         Host Frame:  [0xd4a2] in cydriver.cpython-312-x86_64-linux-gnu.so\n')


@pytest.mark.parametrize("real, returncode, status, errors", [
    ("", sanitizers.ERROR_EXIT, "passed", 0),
    ("", 1, "failed", 0),  # an exit status that is not the tool's own
    ("========= Invalid __global__ write of size 4 bytes\n=========     at ioaware::gather_rows+0x80\n",
     sanitizers.ERROR_EXIT, "failed", 1),
    ('========= Program hit cudaErrorInvalidConfiguration (error 9) due to "invalid configuration argument" on CUDA '
     'API call to cuLaunchKernel.\n', sanitizers.ERROR_EXIT, "failed", 1),
])
def test_memcheck_sets_aside_the_bindings_entry_point_lookups_and_nothing_else(real, returncode, status, errors):
    # the H200's int8 + SnapKV memcheck run: 34 failed cuGetProcAddress lookups and nothing else
    probes = ("int8", "snapkv")
    text = ("========= COMPUTE-SANITIZER\n" + LOOKUP_REPORT * 3 + real + LOOKUP_REPORT * 31
            + "\n".join(COMPLETION.format(case=p) for p in probes)
            + f"\n========= ERROR SUMMARY: {34 + errors} errors\n")
    row = sanitizers.judge(probes, _runner.ToolRun(returncode, text, ""))
    assert (row["status"], row["errors"]) == (status, errors)
    assert "34 failed cuGetProcAddress lookups" in row["note"]
    if real:  # the note starts with what was found, not with a lookup
        assert row["note"].startswith(real.splitlines()[0].lstrip("= "))


def test_the_ncu_parser_sums_the_kernels_and_skips_the_units_row():
    text = ('==PROF== Connected to process 1\n"ID","Kernel Name","dram__bytes_read.sum","dram__bytes_write.sum"\n'
            '"","","byte","byte"\n"0","flash_forward","1,000","200"\n"1","nvjet_hsh_128x256","50","5"\n')
    assert ncu.parse_ncu_csv(text) == (1050.0, 205.0, 2)
    assert ncu.parse_ncu_csv("==ERROR== LibraryNotLoaded") == (0.0, 0.0, 0)


def test_the_ncu_note_gives_each_kernel_name_its_launches_and_bytes_largest_first():
    rows = [("softmax_rows", 2.1e9, 2.0e9), ("nvjet_hsh_128x256", 1.0e9, 2.2e9), ("softmax_rows", 0.1e9, 0.2e9),
            ("vectorized_elementwise_kernel", 4e6, 0.0)]
    # ncu's columns, then its units row
    header = '"ID","Kernel Name","dram__bytes_read.sum","dram__bytes_write.sum"\n"","","byte","byte"\n'
    text = header + "".join(f'"{i}","{name}","{read:.0f}","{write:.0f}"\n'
                            for i, (name, read, write) in enumerate(rows))
    assert ncu.by_kernel(text) == ("by kernel (read/written): softmax_rows ×2 2200.0/2200.0 MB; "
                                   "nvjet_hsh_128x256 ×1 1000.0/2200.0 MB; "
                                   "vectorized_elementwise_kernel ×1 4.0/0.0 MB")
    assert ncu.by_kernel(text, top=1).endswith("softmax_rows ×2 2200.0/2200.0 MB; 2 more")
    assert ncu.by_kernel("==ERROR== LibraryNotLoaded") == ""
    # two cuBLAS kernels alike in their first characters stay two, each cut in its middle
    long = ["sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x256x64_warpgroupsize1x1x1_execute_segment_k_off",
            "sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off"]
    text = header + f'"0","{long[0]}","2000000","0"\n"1","{long[1]}","1000000","0"\n'
    note = ncu.by_kernel(text)
    assert note.count("×1 ") == 2 and "128x256x64" not in note  # two entries, neither name whole
    assert all(len(part.split(" ×")[0]) <= ncu.NAME_CHARS for part in note.split(": ", 1)[1].split("; "))


@pytest.mark.parametrize("name", ["nvjet_hsh_256x128_64x4_1x2_h_bz_coopB_NNT", "sm90_xmma_gemm_f16f16_f16f32_f32_tn_n",
                                  "ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_nn",
                                  "_ZN7ioaware13flash_forwardI6__halfLi128ELi64ELi64EEEvPKT_"])
def test_the_kernel_filter_matches_cublas_hopper_and_our_kernels(name):
    assert re.search(KERNEL_REGEX, name)


def test_a_whole_run_on_fake_parts_writes_its_files_and_fails_on_a_failed_case(tmp_path, monkeypatch):
    from kernels._common import gpu as _gpu

    monkeypatch.setattr(_gpu, "cupy_module", lambda: object())  # "a GPU is there": the fake parts need none
    out = tmp_path / "run"
    parts = (("machine", "simulator.gpu_check.machine:cases"), ("correctness", f"{FAKES}:cases"))
    lines = []
    status = gpu_check.run(out, deadline_s=120, progress=lines.append, parts=parts)
    assert status == 1  # the fake correctness part has an error row
    assert {p.name for p in out.iterdir()} >= {"machine.csv", "correctness.csv", "index.md", "gpu_check.log"}
    index = (out / "index.md").read_text()
    assert "FAILED" in index and "planted failure" in index and "## correctness" in index
    assert gpu_check.run(out, progress=lines.append, parts=parts) == 2  # never over an earlier run's files


def test_without_a_gpu_the_check_refuses_and_the_dry_run_plans(tmp_path, capsys):
    from kernels._common import gpu as _gpu

    if _gpu.cupy_module() is None:
        assert cli.main(["gpu-check", "--out", str(tmp_path / "run")]) == 2
    assert cli.main(["gpu-check", "--dry-run", "--deadline-s", "300"]) == 0
    text = capsys.readouterr().out
    for part, _ in gpu_check.PARTS:
        assert re.search(rf"^{part}: \d+ cases, estimated \d+ s$", text, re.M), part
    assert "B=1 Hq=66000" in text and "M=70000" in text  # the grid-limit cases are listed
    assert re.search(r"total estimated \d+ s against a deadline of 300 s", text)


def test_case_time_limits_come_from_the_estimate_or_the_case():
    assert Case("a", "", lambda: {}, estimate_s=100.0).time_limit() == 500.0
    assert Case("a", "", lambda: {}, estimate_s=1.0).time_limit() == 60.0
    assert Case("a", "", lambda: {}, estimate_s=1.0, limit_s=2.0).time_limit() == 2.0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_checks_low_precision_judge_passes_a_right_answer_and_fails_a_wrong_one(rng, dtype):
    import numpy as np

    from kernels.attn import plain_attention, reference, round_to, within_tolerance

    q, k, v = (round_to(rng.standard_normal((1, 4, 70, 64)), dtype) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # GQA: 4 query heads on 2 kv heads
    ref = reference(q, k, v, causal=True)
    plain = plain_attention(q, k, v, True, dtype)
    assert within_tolerance(round_to(ref, dtype), ref, dtype, plain)[2]  # the oracle rounded once passes
    wrong = ref.copy()
    wrong[0, 1, 30, 5] += 0.05  # one element off by far more than the precision's error
    assert not within_tolerance(wrong, ref, dtype, plain)[2]
    wrong[0, 1, 30, 5] = np.nan
    assert not within_tolerance(wrong, ref, dtype, plain)[2]


@pytest.mark.parametrize("probe", ncu.PROBES)
def test_every_ncu_probe_has_a_prediction_from_the_cost_model(probe):
    from simulator.gpu_probe import sizes

    predicted = ncu.predicted_bytes(probe, sizes(probe, small=False))
    assert predicted is not None and predicted > 0


def test_parts_keep_their_estimates_in_order_of_priority_when_time_is_short():
    from simulator.gpu_check.plan import MARGIN, part_budget

    assert part_budget(10, [100, 100], left_s=50) == 10  # the first part keeps its estimate, the last ones are cut
    assert part_budget(10, [5], left_s=1000) == MARGIN * 10  # with slack, a margin for a slow part
    assert part_budget(100, [], left_s=30) == 30  # never more than is left
    assert part_budget(10, [1], left_s=0) == 0


def test_a_whole_run_of_the_real_parts_without_a_gpu_says_why_each_row_did_not_run(tmp_path, monkeypatch):
    import csv

    from kernels._common import gpu as _gpu

    monkeypatch.setattr(_gpu, "cupy_module", lambda: object())  # past the first check; the workers see no GPU
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")  # no ncu, no compute-sanitizer
    out = tmp_path / "run"
    assert gpu_check.run(out, deadline_s=150, progress=lambda text: None) == 0
    for name, factory in gpu_check.PARTS:
        rows = list(csv.DictReader((out / f"{name}.csv").open()))
        assert len(rows) == len(_runner.load_part(factory)[1](False)), name
        for row in rows:
            assert row["status"] in ("ok", "skipped", "not run"), row
            assert row["status"] == "ok" or row["note"], row
    assert len(list(out.iterdir())) <= 8  # what a lent machine sends back
