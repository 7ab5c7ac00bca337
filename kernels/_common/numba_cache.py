"""Numba's on-disk cache of ioaware's compiled kernels, made stale by any change to the ``kernels`` package.

Why: Numba keys a cached function on the source of its own file only (``numba.core.caching``: a locator's
``get_source_stamp``, a hash of that file). A cached function carries the compiled code of every function it calls,
so after an edit to a callee in another file it is loaded as it was: the decode step of ``kernels/decode/_step.py``
kept the attention of an older ``kernels/decode/_fused.py``, whose per-layer path was recompiled, and the two paths
that must agree bit for bit disagreed. In a checkout (``git pull``, an editable install) that is a silently wrong
result.

The locators here are Numba's own three for a source file (``NUMBA_CACHE_DIR``, the ``__pycache__`` beside the
file, the user-wide cache), restricted to files of ``kernels``, ``simulator`` and ``models`` (the packages whose
cached functions call kernels), with a stamp that adds a hash of every ``.py`` file of ``kernels`` (a function of
kernels: kernels calls nothing outside itself) or of all three packages (a function of simulator or models). They
are put first in Numba's list, so every other cached function is located as before; ``NUMBA_CACHE_LOCATOR_CLASSES``,
where a user sets it, still replaces the list.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from numba.core import caching

KERNELS_DIR = Path(__file__).resolve().parents[1]  # the kernels package
PACKAGE_DIRS = tuple(KERNELS_DIR.parent / name for name in ("kernels", "simulator", "models"))


def sources_stamp(directory: Path) -> str:
    """A SHA-256 of every ``.py`` file under ``directory``: their paths relative to it and their bytes, in order."""
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*.py")):
        digest.update(str(path.relative_to(directory)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def kernels_stamp() -> str:
    """``sources_stamp`` of the kernels package, once per process (its files do not change under a running
    process that has compiled from them)."""
    return sources_stamp(KERNELS_DIR)


@functools.lru_cache(maxsize=1)
def packages_stamp() -> str:
    """``sources_stamp`` of kernels, simulator and models together (for a cached function of simulator or models,
    which may call kernels' functions and each other's)."""
    return hashlib.sha256("".join(sources_stamp(d) for d in PACKAGE_DIRS if d.is_dir()).encode()).hexdigest()


def _under(directory: Path, py_file) -> bool:
    path = Path(py_file).resolve()
    return directory == path.parent or directory in path.parents


def _in_packages(py_file) -> bool:
    return any(_under(directory, py_file) for directory in PACKAGE_DIRS)


class _PackageStamped:
    """A locator mixin: only ioaware's files, and a source stamp that changes with any file of ``kernels`` (for
    kernels' functions) or of any of the three packages (for simulator's and models')."""

    def get_source_stamp(self):
        return super().get_source_stamp(), kernels_stamp() if _under(KERNELS_DIR, self._py_file) else packages_stamp()

    @classmethod
    def from_function(cls, py_func, py_file):
        if not _in_packages(py_file):
            return None
        return super().from_function(py_func, py_file)


def _numba(name):
    """A class of ``numba.core.caching`` by its name in Numba 0.68, or with the leading underscore of earlier
    releases (0.60 names the locators ``_InTreeCacheLocator``, ``_UserWideCacheLocator``, ...)."""
    return getattr(caching, name, None) or getattr(caching, "_" + name)


class UserProvidedLocator(_PackageStamped, _numba("UserProvidedCacheLocator")):
    """``NUMBA_CACHE_DIR``, where it is set."""


class InTreeLocator(_PackageStamped, _numba("InTreeCacheLocator")):
    """The ``__pycache__`` directory beside the source file, where it is writable."""


class UserWideLocator(_PackageStamped, _numba("UserWideCacheLocator")):
    """The user-wide cache directory (a read-only install)."""


LOCATORS = (UserProvidedLocator, InTreeLocator, UserWideLocator)  # Numba's order for its own three


def install() -> None:
    """Put LOCATORS first in Numba's list of cache locators (once; before any of ioaware's cached functions is
    defined, as a locator is chosen when its decorator runs)."""
    classes = _numba("CacheImpl")._locator_classes
    if classes[:len(LOCATORS)] != list(LOCATORS):
        classes[:0] = LOCATORS
