"""``ioaware explain TOPIC``: the classic lessons of IO-aware inference, every number computed by this library's
kernels, cost model and tile simulator, as terminal text and, with ``--out``, a page with charts and animations.

One module per topic; each has ``TITLE``, ``SUMMARY`` (one line), ``OPTIONS`` (the command-line options it takes)
and ``run(lesson, **options)``.
"""
from __future__ import annotations

import importlib

TOPICS = {"softmax-tiles": "softmax_tiles", "flash-tiles": "flash_tiles", "outliers": "outliers",
          "snapkv": "snapkv", "kv-cache": "kv_cache", "transformer": "transformer"}


def topic_module(name: str):
    """The module of topic ``name``; unknown names raise and list the known ones."""
    if name not in TOPICS:
        raise ValueError(f"unknown topic {name!r}; known: {', '.join(TOPICS)}")
    return importlib.import_module(f"{__name__}.{TOPICS[name]}")


def run_topic(name: str, out=None, emit=None, **options):
    """Build topic ``name``'s lesson (writing its files into ``out`` when given) and return the ``Lesson``.
    ``options`` not among the topic's ``OPTIONS`` are ignored; None means the topic's default."""
    from pathlib import Path

    from ._lesson import Lesson

    module = topic_module(name)
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
    lesson = Lesson(module.TITLE, out, emit)
    module.run(lesson, **{k: v for k, v in options.items() if k in module.OPTIONS and v is not None})
    if out is not None:
        lesson.write()
    return lesson


__all__ = ["TOPICS", "run_topic", "topic_module"]

from ._runner import add_subcommand  # noqa: E402  (the CLI's "explain" subcommand; it needs the names above)
