"""The on-disk cache of compiled kernels goes stale with any change to the kernels package
(``kernels/_common/numba_cache.py``), not only with a change to the cached function's own file."""
import subprocess
import sys
from pathlib import Path

import pytest

from kernels._common import numba_cache

ROOT = Path(__file__).resolve().parents[2]


def test_the_stamp_changes_with_any_file_and_only_then(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not source")
    first = numba_cache.sources_stamp(tmp_path)
    assert numba_cache.sources_stamp(tmp_path) == first
    (tmp_path / "notes.txt").write_text("changed, still not source")
    assert numba_cache.sources_stamp(tmp_path) == first
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    changed = numba_cache.sources_stamp(tmp_path)
    assert changed != first
    (tmp_path / "sub" / "b.py").rename(tmp_path / "sub" / "c.py")  # same bytes, another module
    assert numba_cache.sources_stamp(tmp_path) not in (first, changed)


def test_ioaware_cached_functions_use_the_package_stamp_and_others_do_not(tmp_path):
    from simulator import calibrate_phases
    from kernels.decode import _step
    from kernels.int8 import rows

    kernels, packages = numba_cache.kernels_stamp(), numba_cache.packages_stamp()
    for function, stamp in ((_step._worker, kernels), (rows._rows_vnni, kernels),
                            (calibrate_phases._step_int8, packages)):
        locator = function._cache._impl._locator
        assert isinstance(locator, numba_cache.LOCATORS)
        assert locator.get_source_stamp()[1] == stamp
    assert numba_cache.packages_stamp() != numba_cache.kernels_stamp()
    module = tmp_path / "elsewhere.py"
    module.write_text("from numba import njit\n\n@njit(cache=True)\ndef f(x):\n    return x + 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import elsewhere
    finally:
        sys.path.remove(str(tmp_path))
    assert not isinstance(elsewhere.f._cache._impl._locator, numba_cache.LOCATORS)


# A cached caller in one file, its callee in another: the callee changes, the caller's file does not.
CALLEE = "from numba import njit\n\n\n@njit(cache=True)\ndef value():\n    return {}\n"
CALLER = "from numba import njit\n\nfrom .callee import value\n\n\n@njit(cache=True)\ndef call():\n    return value()\n"
RUN = """
import sys
from pathlib import Path
sys.path.insert(0, {root!r})
sys.path.insert(0, {tmp!r})
if {ours}:
    from kernels._common import numba_cache
    numba_cache.KERNELS_DIR = Path({tmp!r}) / "pkg"
    numba_cache.PACKAGE_DIRS = (numba_cache.KERNELS_DIR,)
    numba_cache.kernels_stamp.cache_clear()
    numba_cache.packages_stamp.cache_clear()
    numba_cache.install()
from pkg.caller import call
print(call())
"""


@pytest.mark.parametrize("ours", [False, True], ids=["numba-alone", "package-stamp"])
def test_a_callee_changed_in_another_file_is_recompiled(tmp_path, ours):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "caller.py").write_text(CALLER)

    def run():
        script = RUN.format(root=str(ROOT), tmp=str(tmp_path), ours=ours)
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                              env={"PATH": "/usr/bin:/bin", "NUMBA_CACHE_DIR": str(tmp_path / "cache"),
                                   # no .pyc: Python trusts one whose source has the same size and second of mtime
                                   "PYTHONDONTWRITEBYTECODE": "1"}).stdout.strip()

    (package / "callee.py").write_text(CALLEE.format(1))
    assert run() == "1"
    (package / "callee.py").write_text(CALLEE.format(2))
    # Numba alone loads the caller as compiled against the old callee; with the package stamp it recompiles
    assert run() == ("2" if ours else "1")
