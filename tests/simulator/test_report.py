"""The report: files written CSV-first, charts from the CSV, Markdown and HTML pages, atomic run directories,
a golden CSV for the deterministic part, and the CLI."""
from __future__ import annotations

import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import kernels
from kernels import int8
from simulator import calibrate, hardware, report
from simulator.cli import main
from simulator.report import RunContext, Section, build_report, measured, read_csv

GOLDEN = Path(__file__).with_name("golden") / "across_hardware.csv"


@pytest.fixture
def tiny_sizes(monkeypatch):
    monkeypatch.setitem(report.ATTN_SIZES, True, (64, 512))


@pytest.fixture
def no_model_extra(monkeypatch):
    """The model extra hidden (importing gguf or tokenizers raises ImportError), and fetching the GGUF a failure:
    the report's model sections must skip before any download."""
    import models.smollm2

    for name in models.smollm2.MODEL_EXTRA:
        monkeypatch.setitem(sys.modules, name, None)

    def no_fetch(*args, **kwargs):
        raise AssertionError("the GGUF was fetched although the model extra is missing")

    monkeypatch.setattr(models.smollm2, "fetch_gguf", no_fetch)


@pytest.fixture(scope="module")
def cpu_spec(tmp_path_factory):
    """This machine's spec, calibrated into a cache directory of this module's own (undone after the module)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("IOAWARE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield calibrate.cpu_spec()


def _png_size(path: Path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_quick_report_is_complete_and_consistent(tmp_path, tiny_sizes, cpu_spec, no_model_extra):
    steps = []
    out = build_report(tmp_path / "run", quick=True, hardware=hardware.load("H100-SXM"), cpu=cpu_spec,
                       progress=steps.append)
    names = {p.name for p in out.iterdir()}
    assert {"index.md", "index.html", "machine.csv", "attention_cpu.csv", "attention_phases.csv", "attention_cpu.png",
            "bytes_by_tensor.csv", "bytes_by_tensor.png", "sram_sweep.csv", "sram_sweep.png", "roofline.csv",
            "roofline.png", "across_hardware.csv", "across_hardware.png", "int8_weight_memory.csv",
            "int8_weight_memory.png", "int8_error.csv", "int8_error.png", "int8_gemv.csv", "int8_gemv.png",
            "kv_cache_memory.csv", "kv_cache_memory.png", "kv_decode.csv", "kv_decode.png"} <= names
    # every file the HTML references exists, and every PNG is a real, non-empty image
    page = (out / "index.html").read_text()
    referenced = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert len(referenced) >= 10
    for ref in referenced:
        assert (out / ref).is_file(), f"index.html references missing {ref}"
    for png in out.glob("*.png"):
        width, height = _png_size(png)
        assert width >= 300 and height >= 200 and png.stat().st_size > 10_000
    machine = {r["property"]: r["value"] for r in read_csv(out / "machine.csv")}
    assert machine["int8_products"] == int8.product_path()  # which instructions the int8 rows were measured on
    assert machine["serial_when_held"] == str(kernels.pool_info()["serial_when_held"])  # the threading option
    rows = read_csv(out / "attention_cpu.csv")
    assert {(r["algorithm"], r["causal"], r["n"]) for r in rows} == {
        (a, c, n) for a in ("standard", "flash") for c in ("False", "True") for n in ("64", "512")}
    for r in rows:
        assert float(r["measured_s"]) > 0 and float(r["predicted_s"]) > 0
        error = 100 * (float(r["predicted_s"]) - float(r["measured_s"])) / float(r["measured_s"])
        assert float(r["error_pct"]) == pytest.approx(error, abs=0.1)
    # the standard algorithm's phases: each predicted beside its measurement, the mask only with one
    phase_rows = read_csv(out / "attention_phases.csv")
    standard = [r for r in phase_rows if r["algorithm"] == "standard" and r["n"] == "512"]
    assert [r["phase"] for r in standard if r["causal"] == "True"] == list(kernels.attn.STANDARD_PHASES)
    assert all(float(r["measured_s"]) > 0 and float(r["predicted_s"]) > 0 for r in standard)
    assert all(r["measured_s"] == "" for r in phase_rows if r["algorithm"] == "flash")
    # S and P are 2·H·N² float32: the standard algorithm's peak must show them; flash's is what its own tiles
    # predict (its per-thread tiles follow this machine's cache, so no fixed fraction of the standard's holds)
    big = {r["algorithm"]: int(r["peak_traced_bytes"]) for r in rows if r["n"] == "512" and r["causal"] == "False"}
    shape = (1, measured.ATTN_HEADS, 512, measured.ATTN_D)
    assert big["standard"] >= 2 * measured.ATTN_HEADS * 512 * 512 * 4
    assert big["flash"] <= kernels.attn.flash_memory_bytes(shape, shape, 4) + 64 * 1024
    md = (out / "index.md").read_text()
    for heading in ("## This machine", "## Attention on this CPU", "## Bytes moved", "## SRAM size",
                    "## Roofline of H100-SXM", "## Across hardware", "## LLM.int8()", "## SnapKV",
                    "## SmolLM2-135M", "## Passkey retrieval"):
        assert heading in md
    assert md.count("Skipped: the model extra is not installed") == 2  # SmolLM2 and passkey, nothing downloaded
    ran = [s for s in report.SECTIONS if s not in (report.model_section, report.passkey_section)]
    assert len(steps) == report.planned_steps(ran, quick=True)  # the progress bar's total, section by section
    errors = {float(r["threshold"]): float(r["mean_rel_error"]) for r in read_csv(out / "int8_error.csv")}
    assert errors[6.0] < errors[0.0] / 3  # the decomposition pays off on the planted outliers


@pytest.mark.parametrize("section_read, beside_read, step_fp32, step_int8", [
    (13.8e9, 27.0e9, 20e9, 19e9), (27.0e9, 13.8e9, 20e9, 19e9), (13.8e9, 20e9, 27.0e9, 19e9),
    (13.8e9, 20e9, 19e9, 27.0e9)])
def test_the_decode_bound_takes_the_best_read_seen_around_the_decode(monkeypatch, section_read, beside_read,
                                                                     step_fp32, step_int8):
    # the best of the section's read, the read right after the decode and the step's own streaming rates: a slow
    # moment of the host in one of them made the bound a rate the decode beat (the full report at 1357ec1: fp32 49.5
    # tokens/s against a "bound" of 25.6 from a read of 13.8 GB/s; at a201d62 45.5 against 45 with the step at 26.0)
    import types

    from simulator.report import model as section

    class Model:
        def encode(self, text):
            return [1, 2, 3]

        def generate(self, prompt, n, timings=None):
            if timings is not None:
                timings["decode_s"] = 0.5
            return list(range(n))

        def weight_bytes_per_token(self):
            return 537_919_488

        def _one_region_step(self):
            return types.SimpleNamespace(tasks_per_thread=2, tuned_seconds={4: 0.0051, 2: 0.0049, 1: 0.005})

    monkeypatch.setattr(section, "read_bandwidth_of", lambda buffer, repeats: beside_read)
    monkeypatch.setattr(section, "rates_for", lambda model, rates, buffer: rates)
    monkeypatch.setattr(section, "decode_token_parts", lambda model, rates, context: {"streaming_s": 0.02})
    rates = types.SimpleNamespace(read_all=section_read, step_fp32_dram=step_fp32, step_int8_dram=step_int8)
    row = section._decode_speed(Model(), "fp32", rates, buffer=None)
    assert float(row["read_GBps"]) == 27.0
    assert float(row["bound_tokens_per_s"]) == pytest.approx(27.0e9 / 537_919_488, rel=1e-3)
    assert row["tasks_per_thread"] == 2  # the count the step's tuning chose, beside its rate, and what it timed
    assert row["tuning_ms_per_call"] == "4:5.100 2:4.900 1:5.000"


@pytest.mark.parametrize("section", [report.model_section, report.passkey_section], ids=["smollm2", "passkey"])
def test_model_sections_skip_without_the_extra_and_fetch_nothing(tmp_path, no_model_extra, section):
    result = section(RunContext(directory=tmp_path, quick=True))
    assert "Skipped: the model extra is not installed" in result.markdown and "pip install -e .[model]" in \
        result.markdown
    assert result.files == () and list(tmp_path.iterdir()) == []


def test_across_hardware_matches_the_golden_csv(tmp_path):
    ctx = RunContext(directory=tmp_path, quick=True)
    report.across_hardware_section(ctx)
    assert (tmp_path / "across_hardware.csv").read_text() == GOLDEN.read_text()


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


def test_cli_report(tmp_path, tiny_sizes, cpu_spec, no_model_extra, capsys, monkeypatch):
    """The CLI's plumbing (its message, the run directory's mode, refusing an existing one) over two fast sections:
    the whole quick report is the test above's."""
    import os

    import simulator.report as report
    from simulator import precompile

    monkeypatch.setattr(report, "SECTIONS", (report.machine_section, report.roofline_section))
    compiled = []  # the CLI compiles the kernels first (simulator.precompile); here nothing, and fast
    monkeypatch.setattr(precompile, "precompile", lambda: compiled.append(True))
    assert main(["report", "--quick", "--no-progress", "--hardware", "T4", "--out", str(tmp_path / "r")]) == 0
    assert compiled == [True]
    assert "report written to" in capsys.readouterr().out
    assert "## Roofline of T4" in (tmp_path / "r" / "index.md").read_text()
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "r").stat().st_mode & 0o777 == 0o777 & ~umask  # as mkdir makes it, not mkdtemp's 0700
    assert main(["report", "--quick", "--no-progress", "--out", str(tmp_path / "r")]) == 2
    assert "already exists" in capsys.readouterr().err


@pytest.mark.parametrize("out, message", [("", "must name a directory"), ("a-file/run", "is a file")])
def test_cli_report_refuses_an_out_it_cannot_create(tmp_path, monkeypatch, capsys, out, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a directory")
    assert main(["report", "--quick", "--no-progress", "--out", out]) == 2
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing measured, nothing written


def test_cli_report_refuses_before_it_measures(tmp_path, monkeypatch, capsys):
    # a spec without the fp16 rate that the predictions price at, a dangling link as --out, a negative seed: each
    # failed after the compile and the measurements
    from simulator.hardware import load

    monkeypatch.chdir(tmp_path)
    spec = load("T4").to_toml().replace("fp16_tflops = 65", "fp16_tflops = 0")
    assert "fp16_tflops = 0" in spec
    (tmp_path / "no_fp16.toml").write_text(spec)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for args, message in ((["--hardware", "no_fp16.toml"], "has no fp16 rate"), (["--out", "dangling"], "exists"),
                          (["--seed", "-1"], "--seed: must be >= 0")):
        try:
            assert main(["report", "--quick", "--no-progress", *args]) == 2
        except SystemExit as stop:  # (argparse's own refusal)
            assert stop.code == 2
        assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "no_fp16.toml"]  # nothing measured or written


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_a_report_stopped_by_a_signal_leaves_nothing(tmp_path, signame):
    # SIGINT was handled (KeyboardInterrupt); SIGTERM and SIGHUP left a hidden half-written run directory
    import os
    import signal
    import time

    env = {**os.environ, "IOAWARE_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(Path.cwd())}
    process = subprocess.Popen([sys.executable, "-m", "simulator", "report", "--quick", "--no-progress", "--out",
                                str(tmp_path / "runs" / "r")], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not list((tmp_path / "runs").glob(".r.*")):  # the report has started writing
            assert process.poll() is None and time.monotonic() < deadline, "the report never started"
            time.sleep(0.05)
        process.send_signal(getattr(signal, signame))
        assert process.wait(timeout=120) == 128 + getattr(signal, signame)
    finally:
        process.kill()
    assert list((tmp_path / "runs").iterdir()) == []


@pytest.mark.parametrize("where", ["before a step", "after the last step"])
def test_a_stop_signal_dropped_where_it_landed_still_stops_the_report(tmp_path, monkeypatch, cpu_spec, where):
    # the SystemExit a handler raises inside a ctypes callback (llvmlite's object-cache hook, as Numba compiles) is
    # printed as "ignored" and dropped: the report must stop at its next step, or after its last, and leave nothing
    import signal

    import simulator.calibrate
    import simulator.report

    out = tmp_path / "runs" / "r"

    def dropped():
        try:
            signal.raise_signal(signal.SIGTERM)
        except SystemExit:
            pass  # what the ctypes callback does with it

    def build_report(path, *, progress, **options):
        path.mkdir(parents=True)
        dropped()
        if where == "before a step":
            progress("the next step")
            raise AssertionError("the report went on past its next step")
        return path

    monkeypatch.setattr(simulator.calibrate, "cpu_spec", lambda force=False: cpu_spec)
    monkeypatch.setattr(simulator.report, "build_report", build_report)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stop:
        main(["report", "--quick", "--no-progress", "--out", str(out)])
    assert stop.value.code == 128 + signal.SIGTERM
    if where == "after the last step":
        assert not out.exists()
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back


def test_cli_costs_and_hardware(capsys, cpu_spec):
    assert main(["costs", "attention", "--n", "4096", "--d", "64", "--heads", "16", "--hardware", "H100-SXM"]) == 0
    out = capsys.readouterr().out
    assert "standard" in out and "flash2" in out and "S MB" in out and "predicted us" in out
    assert main(["costs", "matmul", "--m", "1", "--k", "512", "--n", "256", "--outliers", "4"]) == 0
    assert "W_i8" in capsys.readouterr().out
    assert main(["costs", "attention", "--n", "64", "--heads", "9", "--kv-heads", "2"]) == 2
    assert "not a multiple" in capsys.readouterr().err
    assert main(["hardware"]) == 0
    assert "H200-SXM" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["costs", "attention", "--n", "4096", "--hardware", "A10"], "unknown hardware 'A10'; known: A100-40GB-SXM"),
    (["costs", "attention", "--n", "0"], "must be >= 1"),
    (["costs", "attention", "--n", "many"], "expected a whole number"),
    (["reprot"], "invalid choice"),
])
def test_cli_bad_arguments(argv, message):
    run = subprocess.run([sys.executable, "-m", "simulator", *argv], capture_output=True, text=True)
    assert run.returncode == 2 and message in run.stderr


@pytest.mark.parametrize("argv", [[], ["report"], ["costs"], ["costs", "attention"], ["costs", "matmul"],
                                  ["hardware"]])
def test_every_command_has_help(argv):
    run = subprocess.run([sys.executable, "-m", "simulator", *argv, "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and "usage:" in run.stdout


def test_console_script_runs_the_cli():
    script = Path(sys.executable).parent / "ioaware"
    if not script.exists():
        pytest.skip(f"the package is not installed into {Path(sys.executable).parent} (pip install -e . adds it)")
    run = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and "report" in run.stdout


HOSTILE = ['![y](z" onerror="alert(2))', "[x](javascript:alert(1))", "<script>alert(3)</script>",
           "[l](//evil.example/x)", "![d](data:image/png;base64,AAAA)", "[up](../../etc/passwd)", '"><img src=x>',
           "| a | <b onmouseover=alert(4)> |"]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_html_escapes_what_comes_from_data(hostile):
    # a hardware TOML's name (or any CSV value) reaches headings, tables and text; only the Markdown subset's own
    # relative links and images may become markup
    from html.parser import HTMLParser

    from simulator.report import markdown_to_html

    markdown = (f"## Roofline of {hostile}\n\n| name | value |\n|---|---|\n| {hostile} | 1 |\n\n"
                f"Text about {hostile}: ![chart](roofline.png) and [data](roofline.csv).\n")
    tags = []

    class Collect(HTMLParser):
        def handle_starttag(self, tag, attrs):
            tags.append((tag, dict(attrs)))

    Collect().feed(markdown_to_html(markdown, title=hostile))
    allowed = {"html", "head", "meta", "title", "style", "body", "h2", "table", "tr", "th", "td", "p", "img", "a",
               "code", "strong", "em"}
    assert {tag for tag, _ in tags} <= allowed
    for tag, attrs in tags:
        assert set(attrs) <= {"lang", "charset", "alt", "src", "href"}, (tag, attrs)
        for url in (attrs.get("src"), attrs.get("href")):
            assert url is None or url in ("roofline.png", "roofline.csv"), url


def test_streamed_layers_get_room_for_two_where_the_cache_buffer_is_small(tmp_path):
    import numpy as np

    from simulator.report.core import RunContext
    from simulator.report.measured import streamed_buffer

    big = np.ones(4 * 64 * 64, dtype=np.float32)
    assert streamed_buffer(RunContext(directory=tmp_path, quick=True, dram_buffer=big), 64) is big
    small = RunContext(directory=tmp_path, quick=True, dram_buffer=np.ones(64 * 64, dtype=np.float32))
    room = streamed_buffer(small, 64)
    assert room.dtype == np.float32 and room.size >= 2 * 64 * 64


def test_the_decode_caches_are_the_real_one_then_disjoint_views_of_the_dram_buffer(monkeypatch):
    import numpy as np

    import kernels
    from simulator import measure

    seen = []
    monkeypatch.setattr(kernels, "attention", lambda q, k, v, causal: seen.append((k, v)))
    buffer = np.arange(100, dtype=np.float32)
    k, v = np.ones((1, 2, 3, 2), np.float32), np.ones((1, 2, 3, 2), np.float32)  # 12 floats (48 bytes) each
    # twice an "LLC" of 240 bytes over pairs of 96 bytes: 5 pairs, the real one and 4 of views (8 fit in 100 floats)
    measure.decode_seconds(buffer, np.ones((1, 2, 1, 2), np.float32), k, v, 240, repeats=3)
    caches = seen[:5]
    assert caches[0][0] is k and caches[0][1] is v and seen[5][0] is k  # the real pair, then each in turn
    arrays = [a for pair in caches[1:] for a in pair]
    assert all(a.shape == k.shape and np.shares_memory(a, buffer) for a in arrays)
    assert sorted(int(a.reshape(-1)[0]) for a in arrays) == list(range(0, 96, 12))  # consecutive, disjoint
