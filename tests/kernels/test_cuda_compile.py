"""Every CUDA C file of the tensor-core tier compiles with this machine's nvcc for sm_80 (A100) and sm_90 (H100,
H200), every template instance included, without a warning and without a register spill. The resource report
(registers, shared memory, spills per kernel, from ``-Xptxas -v``) is printed whether the test passes or not."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "kernels").rglob("*.cu"))
NVCC = shutil.which("nvcc")


def ptxas_report(text: str) -> list[dict]:
    """One row per kernel from nvcc's ``-Xptxas -v`` output: registers, shared bytes, spill stores and loads."""
    rows, current = [], None
    for line in text.splitlines():
        if m := re.search(r"Compiling entry function '(\S+)'", line):
            current = {"kernel": m.group(1), "registers": 0, "smem": 0, "spill_stores": 0, "spill_loads": 0}
            rows.append(current)
        elif current is not None and (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            current["spill_stores"], current["spill_loads"] = int(m.group(1)), int(m.group(2))
        elif current is not None and (m := re.search(r"Used (\d+) registers", line)):
            current["registers"] = int(m.group(1))
            smem = re.search(r"(\d+) bytes smem", line)
            current["smem"] = int(smem.group(1)) if smem else 0
    return rows


def test_there_are_sources():
    assert {p.name for p in SOURCES} >= {"flash_attention.cu", "int8_matmul.cu", "snapkv.cu"}


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on the PATH (the CUDA toolkit is not installed)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", SOURCES, ids=[p.name for p in SOURCES])
def test_compiles_without_warnings_or_spills(source, arch, tmp_path, capsys):
    cmd = [NVCC, "-std=c++17", f"-arch={arch}", "-cubin", "-o", str(tmp_path / "out.cubin"), "-Werror",
           "all-warnings", "-Xptxas", "-v", "-DIOAWARE_INSTANTIATE_ALL", str(source)]
    run = subprocess.run(cmd, capture_output=True, text=True, check=False)
    output = run.stdout + run.stderr
    rows = ptxas_report(output)
    with capsys.disabled():
        print(f"\n{source.name} ({arch}):")
        for r in rows:
            print(f"  {r['kernel'][:70]:70s} {r['registers']:4d} regs {r['smem']:6d} B smem "
                  f"spills {r['spill_stores']}/{r['spill_loads']} B")
    assert run.returncode == 0, f"nvcc failed:\n{output}"
    assert "warning" not in output.lower(), output
    assert rows, f"no kernel in the ptxas report:\n{output}"
    spilled = [r["kernel"] for r in rows if r["spill_stores"] or r["spill_loads"]]
    assert not spilled, f"register spills in {spilled}"


def _nvrtc():
    """NVRTC (the compiler CuPy's RawModule uses) and the CUDA headers' folder, or a reason to skip."""
    try:
        from cuda.bindings import nvrtc

        nvrtc.nvrtcVersion()  # loads libnvrtc; raises when it cannot be found
    except Exception as err:  # ImportError, or the library is missing
        return None, None, f"NVRTC is not available ({type(err).__name__}); pip install nvidia-cuda-nvrtc"
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    if NVCC:
        roots.append(str(Path(NVCC).resolve().parent.parent))
    for root in filter(None, roots):
        if (Path(root) / "include" / "cuda_fp16.h").exists():
            return nvrtc, Path(root) / "include", ""
    return None, None, "the CUDA headers (cuda_fp16.h) were not found (set CUDA_HOME)"


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
@pytest.mark.parametrize("module", ["kernels.attn._cupy", "kernels.int8._cupy", "kernels.kvprune._cupy"])
def test_nvrtc_compiles_every_instance_the_launchers_ask_for(module, arch):
    import importlib

    nvrtc, include, reason = _nvrtc()
    if nvrtc is None:
        pytest.skip(reason)
    launcher = importlib.import_module(module)
    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    err, prog = nvrtc.nvrtcCreateProgram(launcher.SOURCE.read_bytes(), launcher.SOURCE.name.encode(), 0, [], [])
    assert err == ok
    for name in launcher.NAMES:
        assert nvrtc.nvrtcAddNameExpression(prog, name.encode())[0] == ok
    options = [b"-std=c++17", f"-arch={arch}".encode(), f"-I{include}".encode()]
    result = nvrtc.nvrtcCompileProgram(prog, len(options), options)[0]
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert result == ok, log.decode(errors="replace")
    for name in launcher.NAMES:  # every name expression resolves to a kernel symbol
        err, lowered = nvrtc.nvrtcGetLoweredName(prog, name.encode())
        assert err == ok and lowered.startswith(b"_Z"), name
    nvrtc.nvrtcDestroyProgram(prog)


def test_the_report_parser_sees_spills():
    text = ("ptxas info    : Compiling entry function '_Z1kv' for 'sm_90'\n"
            "    8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads\n"
            "ptxas info    : Used 255 registers, used 1 barriers, 2048 bytes smem\n")
    assert ptxas_report(text) == [{"kernel": "_Z1kv", "registers": 255, "smem": 2048, "spill_stores": 12,
                                   "spill_loads": 16}]
