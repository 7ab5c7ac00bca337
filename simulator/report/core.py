"""Report plumbing: the run context, sections, CSV files, the Markdown and HTML pages, atomic run directories."""
from __future__ import annotations

import csv
import datetime as _dt
import html
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunContext:
    """What every section gets: where to write, quick or full, a seed, the hardware the predictions are for, this
    machine's calibrated spec, and a progress callback."""

    directory: Path
    quick: bool
    seed: int = 0
    hardware: object = None  # HardwareSpec of the chosen preset (GPU sections)
    cpu: object = None  # HardwareSpec of this machine (calibrated)
    progress: object = None  # a callable(description: str) -> None, or None
    phase_rates: object = None  # this machine's PhaseRates, measured once per run (report.measured.rates_now)
    dram_buffer: object = None  # a mapped float32 array of twice the largest cache (report.measured.dram_buffer)

    def step(self, description: str) -> None:
        if self.progress is not None:
            self.progress(description)


@dataclass(frozen=True)
class Section:
    """One part of the report: its heading, Markdown body, and the files it wrote (relative paths)."""

    title: str
    markdown: str
    files: tuple[str, ...] = field(default_factory=tuple)


def planned(steps):
    """Declare how many times a section calls ``ctx.step``: ``steps(quick) -> int``, for the progress bar's total
    (the quick report's test checks the declarations against the calls)."""
    def mark(section):
        section.planned_steps = steps
        return section
    return mark


def planned_steps(sections, quick: bool) -> int:
    """The ``ctx.step`` calls the sections declare (0 for a section that declares none)."""
    return sum(getattr(section, "planned_steps", lambda quick: 0)(quick) for section in sections)


def write_csv(path: Path, rows: list[dict]) -> None:
    """Write dict rows with the first row's keys as the header (units belong in the column names)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def default_out_dir(hardware: str = "cpu") -> Path:
    """``reports/runs/<date>T<time>-<hardware>`` under the current directory."""
    stamp = _dt.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    return Path("reports") / "runs" / f"{stamp}-{hardware}"


# --- HTML: the Markdown the sections write is a small subset (headings, paragraphs, tables, images, links,
# --- inline code, emphasis), rendered here without a dependency.

_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;line-height:1.5;
color:#222}h1,h2{border-bottom:1px solid #ddd;padding-bottom:.2em}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}th{background:#f3f3f3}img{max-width:100%;
border:1px solid #eee}code{background:#f3f3f3;padding:0 .2em}"""


_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^()\s]+)\)")  # ![alt](src) or [label](href)
# a path relative to the page, inside the run directory: no scheme (javascript:, data:, http:), not absolute, no
# "..", no characters that could end an attribute or start a tag
_RELATIVE_PATH = re.compile(r"(?![A-Za-z][A-Za-z0-9+.-]*:)(?![/\\])(?!(?:.*/)?\.\.(?:/|$))[A-Za-z0-9_.,=+~%/#-]+")


def _text(text: str) -> str:
    """Plain text: every character escaped (quotes too), then code, bold and emphasis."""
    text = html.escape(text, quote=True)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    text = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", text)
    text = re.sub(r"(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])", r"<em>\1</em>", text)
    return text


def _inline(text: str) -> str:
    """One line of the Markdown subset as HTML. Whatever comes from data (a hardware name from a user's TOML file,
    say) is escaped; links and images are rendered only for paths relative to the page, the files of the run
    directory: anything else (``javascript:``, other sites, a quote that would end the attribute) stays text."""
    out, pos = [], 0
    for match in _LINK.finditer(text):
        image, label, url = match.groups()
        out.append(_text(text[pos:match.start()]))
        if _RELATIVE_PATH.fullmatch(url):
            href = html.escape(url, quote=True)
            out.append(f'<img alt="{html.escape(label, quote=True)}" src="{href}">' if image
                       else f'<a href="{href}">{_text(label)}</a>')
        else:
            out.append(_text(match.group(0)))
        pos = match.end()
    out.append(_text(text[pos:]))
    return "".join(out)


def markdown_to_html(markdown: str, title: str) -> str:
    out, lines, i = [], markdown.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{_inline(line[level:].strip())}</h{level}>")
            i += 1
        elif line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
                if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                    rows.append(cells)
                i += 1
            head, body = rows[0], rows[1:]
            out.append("<table><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head) + "</tr>" + "".join(
                "<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in row) + "</tr>" for row in body) + "</table>")
        else:
            para = []
            while i < len(lines) and lines[i].strip() and not lines[i].startswith(("#", "|")):
                para.append(lines[i])
                i += 1
            out.append(f"<p>{_inline(' '.join(para))}</p>")
    body = "\n".join(out)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_CSS}</style></head><body>\n{body}\n</body></html>\n")


def build_report(out_dir: Path, *, quick: bool = False, seed: int = 0, hardware=None, cpu=None, progress=None,
                 sections=None, precompile: bool = False) -> Path:
    """Run every section into a temporary directory, write ``index.md`` and ``index.html``, then rename it to
    ``out_dir``. ``hardware`` defaults to the H100-SXM preset, ``cpu`` to this machine's (cached) calibration.
    ``precompile``: first compile the kernels that Numba's cache lacks, on all cores (``simulator.precompile``;
    one more progress step). Raises ``FileExistsError`` if ``out_dir`` exists (a report is never overwritten in
    place)."""
    if sections is None:
        from . import SECTIONS as sections
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"output directory {out_dir} already exists; choose another --out")
    if hardware is None or cpu is None:
        from ..calibrate import cpu_spec
        from ..hardware import load

        hardware = load("H100-SXM") if hardware is None else hardware
        cpu = cpu_spec() if cpu is None else cpu
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        ctx = RunContext(directory=tmp, quick=quick, seed=seed, hardware=hardware, cpu=cpu, progress=progress)
        if precompile:  # before any section measures: the compiles would otherwise share the cores with it
            from ..precompile import precompile as compile_kernels

            ctx.step("compile the kernels")
            compile_kernels()
        results = [section(ctx) for section in sections]
        mode = "quick" if quick else "full"
        predicted_for = f"; predictions for {hardware.name}" if hardware is not None else ""
        header = (f"# ioaware report\n\nMode: {mode}; seed {seed}{predicted_for}; generated "
                  f"{_dt.datetime.now().isoformat(timespec='seconds')} by `python -m simulator report`.\n")
        markdown = "\n".join([header] + [f"## {s.title}\n\n{s.markdown}" for s in results])
        (tmp / "index.md").write_text(markdown)
        (tmp / "index.html").write_text(markdown_to_html(markdown, "ioaware report"))
        umask = os.umask(0)  # (read it back: the only way to learn the umask)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # the run directory as mkdir would make it (mkdtemp's is 0700)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
