"""The import directions of the layout (STYLE.md, "Layout"), read from the source with ``ast``, lazy imports
inside functions included:

- ``kernels`` imports nothing from ``simulator`` or ``models``; ``models`` nothing from ``simulator``;
- ``simulator.costs``, ``simulator.tiles`` and ``simulator.hardware`` import no kernels, models, measurement,
  calibration, report or CLI: they take plain sizes;
- no module imports another package's private names: a private piece (a name or module starting with ``_``)
  is imported only from inside the package that holds it (``kernels._common`` from anywhere in ``kernels``,
  ``kernels.attn._validate`` only from ``kernels.attn``).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "models", "simulator")
PLAIN_SIZES = ("simulator.costs", "simulator.tiles", "simulator.hardware")
NOT_FOR_PLAIN_SIZES = ("kernels", "models", "simulator.measure", "simulator.calibrate", "simulator.report",
                       "simulator.cli", "simulator.gpu_check", "simulator.gpu_probe")
# Edges that break a rule on purpose, each with its reason. The GPU check and its probes drive a tier's launchers
# directly where no public function reaches what they measure (a forced split count, the int32 product of the
# int8 GEMM, a device-resident quantized weight, either SnapKV vote kernel), and ask the device module whether a
# GPU is there before anything imports CuPy.
_TIER = "the GPU check measures a tier's launcher directly"
_PIECES = ("the CPU calibration times the kernels' own pieces (the standard algorithm's batched matmuls, the flash "
           "kernel's exp and row max, the int8 GEMV kernel without its serial rule)")
KNOWN = {
    ("simulator.gpu_check", "kernels._common.gpu"): "is a GPU there",
    ("simulator.gpu_check.worker", "kernels._common.gpu"): "is a GPU there",
    ("simulator.gpu_check.benchmarks", "kernels.int8._cupy"): _TIER,
    ("simulator.gpu_check.benchmarks", "kernels.kvprune._cupy"): _TIER,
    ("simulator.gpu_check.correctness", "kernels.attn._cupy"): _TIER,
    ("simulator.gpu_check.correctness", "kernels.int8._cupy"): _TIER,
    ("simulator.gpu_check.correctness", "kernels.kvprune._cupy"): _TIER,
    ("simulator.gpu_probe", "kernels.attn._cupy"): _TIER,
    ("simulator.gpu_probe", "kernels.kvprune._cupy"): _TIER,
    # no public function runs these pieces alone
    ("simulator.calibrate_phases", "kernels._common.numba_cpu.FASTMATH"): _PIECES,
    ("simulator.calibrate_phases", "kernels._common.numba_cpu.exp_row"): _PIECES,
    ("simulator.calibrate_phases", "kernels._common.numba_cpu.row_max"): _PIECES,
    ("simulator.calibrate_phases", "kernels._common.blas.single_threaded_blas"): _PIECES,
    ("simulator.calibrate_phases", "kernels._common.blas.batched_matmul"): _PIECES,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path):
    """(importer, imported) for every import in the file; ``from a import b`` gives ``a.b``."""
    importer = module_name(path)
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield importer, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                yield importer, f"{base}.{alias.name}"


def violations(importer: str, imported: str) -> list[str]:
    """The rules that the import of ``imported`` (a dotted module or name) by module ``importer`` breaks."""
    found = []
    top = imported.split(".")[0]
    if importer.startswith("kernels") and top in ("simulator", "models"):
        found.append("kernels import nothing from simulator or models")
    if importer.startswith("models") and top == "simulator":
        found.append("models import nothing from simulator")
    if importer.startswith(PLAIN_SIZES) and any(imported == p or imported.startswith(p + ".")
                                                for p in NOT_FOR_PLAIN_SIZES):
        found.append("costs, tiles and hardware take plain sizes")
    parts = imported.split(".")
    private = [i for i, part in enumerate(parts) if part.startswith("_") and not part.startswith("__")]
    if private:
        owner = ".".join(parts[: private[0]])
        if not (importer == owner or importer.startswith(owner + ".")):
            found.append(f"a private name of {owner} imported from outside it")
    return found


def all_imports():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield from imports(path)


def test_the_scan_sees_the_imports():
    edges = set(all_imports())
    assert ("kernels.attn._api", "kernels._common.gpu") in edges  # `from .._common import gpu as _gpu`
    assert ("simulator.report.int8", "kernels.int8.Int8Linear") in edges
    assert len(edges) > 150


@pytest.mark.parametrize("importer, imported, rule", [
    ("kernels.int8._api", "kernels.attn._validate.COMPUTE_DTYPE", "private name of kernels.attn"),
    ("models.smollm2", "kernels._cpuinfo.user_cache_dir", "private name of kernels"),
    ("kernels.attn._api", "simulator.costs", "kernels import nothing"),
    ("simulator.tiles.matmul", "kernels.int8.quantize_vectorwise", "plain sizes"),
    ("simulator.hardware.spec", "simulator.calibrate.cpu_spec", "plain sizes"),
])
def test_the_rules_catch_a_bad_import(importer, imported, rule):
    assert any(rule in v for v in violations(importer, imported))


def test_the_import_directions_hold():
    broken = sorted(f"{importer} imports {imported}: {v}" for importer, imported in set(all_imports())
                    if (importer, imported) not in KNOWN for v in violations(importer, imported))
    assert not broken, "\n".join(broken)


def test_the_known_exceptions_still_exist():
    """An exception that no longer occurs is deleted from KNOWN, so the list never hides a new edge."""
    assert set(KNOWN) <= set(all_imports())
