"""A lesson: Markdown blocks shown as they are computed (rich text on a terminal, plain Markdown when piped) and,
with an output directory, written as ``index.md`` and ``index.html`` beside the charts and animations they embed."""
from __future__ import annotations

from pathlib import Path

from ..report.core import markdown_to_html


class Lesson:
    """Collects one topic's Markdown blocks in order; ``emit`` (a callable taking one block) shows each as it comes.

    ``directory`` is where charts go; without one, ``chart`` draws nothing and the lesson stays text.
    """

    def __init__(self, title: str, directory: Path | None = None, emit=None):
        self.title = title
        self.directory = None if directory is None else Path(directory)
        self.blocks: list[str] = []
        self.files: list[str] = []
        self._emit = emit

    def _add(self, block: str) -> None:
        self.blocks.append(block)
        if self._emit is not None:
            self._emit(block)

    def heading(self, text: str) -> None:
        self._add(f"## {text}")

    def say(self, text: str) -> None:
        """One paragraph of Markdown (inline code, emphasis and links; no lists)."""
        self._add(" ".join(line.strip() for line in text.strip().splitlines()))

    def table(self, header, rows) -> None:
        lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
        self._add("\n".join(lines))

    def chart(self, filename: str, draw, caption: str) -> None:
        """``draw(path)`` writes ``filename`` into the directory (only when there is one) and the lesson embeds it."""
        if self.directory is None:
            return
        draw(self.directory / filename)
        self.files.append(filename)
        self._add(f"![{caption}]({filename})")

    def skip(self, reason: str) -> None:
        self._add(f"*Skipped: {reason}*")

    @property
    def markdown(self) -> str:
        return f"# {self.title}\n\n" + "\n\n".join(self.blocks) + "\n"

    def write(self) -> list[Path]:
        """Write ``index.md`` and ``index.html`` (which embeds every chart by its relative path) into the directory."""
        if self.directory is None:
            raise ValueError("this lesson has no output directory")
        md, html = self.directory / "index.md", self.directory / "index.html"
        md.write_text(self.markdown)
        html.write_text(markdown_to_html(self.markdown, self.title))
        return [md, html] + [self.directory / name for name in self.files]


def num(x, digits: int = 3) -> str:
    """A number for the text: ``digits`` significant digits, no exponent for ordinary magnitudes."""
    x = float(x)
    if x == 0 or 1e-4 <= abs(x) < 1e6:
        return f"{x:.{digits}g}" if abs(x) < 10**digits else f"{x:,.0f}"
    return f"{x:.{digits - 1}e}"


def vector(xs, digits: int = 3) -> str:
    return "[" + ", ".join(num(x, digits) for x in xs) + "]"


def mb(nbytes) -> str:
    return f"{float(nbytes) / 1e6:,.2f} MB"
