"""The validation section: published GPU measurements of attention beside the model's predictions, with the error
and, where it exceeds the tolerance, why (``simulator.costs.published``)."""
from __future__ import annotations

from ..costs.published import TOLERANCE, validation_rows
from .core import RunContext, Section, planned, write_csv


def _value(x: float, unit: str) -> str:
    if unit == "B":
        return f"{x / 1e9:.3g} GB"
    if unit == "s":
        return f"{x * 1e3:.3g} ms"
    if unit == "FLOP/s":
        return f"{x / 1e12:.3g} TFLOP/s"
    return f"{x:.3g}"


@planned(lambda quick: 1)
def validation_section(ctx: RunContext) -> Section:
    ctx.step("validation against published measurements")
    rows = validation_rows()
    write_csv(ctx.directory / "validation_gpu.csv", [
        {"source": r.source, "quantity": r.quantity, "published": f"{r.published:.6g}",
         "predicted": f"{r.predicted:.6g}", "unit": r.unit, "error": f"{r.error:+.4f}", "within": r.within,
         "why": r.why} for r in rows])
    table = ["| source | quantity | published | predicted | error | why |", "|---|---|---|---|---|---|"]
    sources = {}
    for r in rows:
        key = sources.setdefault(r.source, f"[{len(sources) + 1}]")
        table.append(f"| {key} | {r.quantity} | {_value(r.published, r.unit)} | {_value(r.predicted, r.unit)} | "
                     f"{100 * r.error:+.0f}%{'' if r.within else ' (out)'} | {r.why if not r.within else ''} |")
    notes = "\n".join(f"{key} {source}" for source, key in sources.items())
    held = sum(r.within for r in rows)
    body = (f"The cost model on the datasheet presets, nothing fitted, against measurements published for real "
            f"GPUs; tolerance ±{100 * TOLERANCE:.0f}%. {held} of {len(rows)} rows hold. Traffic is reproduced "
            f"where the model's schedule is the measured kernel's (the unfused standard algorithm); runtimes are "
            f"not: the roofline at datasheet peaks is a lower bound on time, and the measured kernels reach a "
            f"fraction of peak that the model does not calibrate on a GPU. Each row off by more says why.\n\n"
            + "\n".join(table) + "\n\n" + notes + "\n\nData: [validation_gpu.csv](validation_gpu.csv)\n")
    return Section("Validation against published GPU measurements", body, ("validation_gpu.csv",))
