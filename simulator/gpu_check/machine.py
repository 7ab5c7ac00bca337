"""Part 0, the machine: nvidia-smi's view of the card, CuPy's device properties, package and tool versions; one row
each, so that a run records where it ran even when everything after this part fails."""
from __future__ import annotations

import importlib.metadata
import shutil

from ._rows import Case
from ._runner import run_tool

COLUMNS = ["fact", "value"]
SMI_FIELDS = ("name,driver_version,memory.total,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.limit,"
              "temperature.gpu")
PACKAGES = ("numpy", "cupy-cuda13x", "cupy-cuda12x", "numba", "numba-cuda", "torch", "triton", "bitsandbytes")
TOOLS = ("nvcc", "ncu", "compute-sanitizer")


def _smi():
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"status": "not run", "note": "nvidia-smi is not on the PATH"}
    result = run_tool([smi, f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader"], 20)
    line = result.stdout.strip().splitlines()[:1]
    if not line:
        return {"status": "error", "note": result.tail()}
    return {"value": "; ".join(f"{k}={v.strip()}" for k, v in zip(SMI_FIELDS.split(","), line[0].split(",")))}


def _device():
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    optin = cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                                 cupy.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return {"value": f"{name}; compute capability {props['major']}.{props['minor']}; "
                     f"{props['multiProcessorCount']} SMs; L2 {props['l2CacheSize']} B; shared memory opt-in "
                     f"{optin} B per block; {props['totalGlobalMem']} B memory"}


def _versions():
    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return {"value": "; ".join(found)}


def _tools():
    return {"value": "; ".join(f"{t}: {shutil.which(t) or 'not on the PATH'}" for t in TOOLS)}


def cases(quick: bool) -> list[Case]:
    def fact(name, run, needs=()):
        return Case(name=name, size="", run=run, estimate_s=1.0, needs=needs, columns={"fact": name})

    return [fact("nvidia-smi", _smi), fact("device", _device, ("cupy",)), fact("packages", _versions),
            fact("tools", _tools)]
