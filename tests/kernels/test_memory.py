"""kernels._common.memory.huge_page_empty: arrays that a kernel streams, on memory advised for huge pages."""
from __future__ import annotations

import mmap

import numpy as np
import pytest

from kernels._common import memory
from kernels._common.memory import HUGE_PAGE_BYTES, huge_page_empty

from tests.helpers import HUGE_PAGES, NO_HUGE_PAGES, vm_flags


@pytest.mark.parametrize("dtype", [np.int8, np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 7, 4099, 2**21 + 3])
def test_the_array_is_writeable_contiguous_and_a_large_one_starts_on_a_huge_page(rng, n, dtype):
    a = huge_page_empty(n, dtype)
    assert a.shape == (n,) and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
    values = rng.integers(-128, 128, n).astype(dtype)  # within every dtype's range
    a[:] = values
    assert np.array_equal(a, values)
    if HUGE_PAGES and a.nbytes >= HUGE_PAGE_BYTES:  # a smaller one is np.empty's
        assert a.ctypes.data % HUGE_PAGE_BYTES == 0


@pytest.mark.skipif(not HUGE_PAGES, reason=NO_HUGE_PAGES)
def test_the_memory_is_advised_for_huge_pages():
    a = huge_page_empty(3 * HUGE_PAGE_BYTES // 4 + 5, np.float32)
    for address in (a.ctypes.data, a.ctypes.data + a.nbytes - 1):
        assert "hg" in vm_flags(address)  # "hg: huge page advise flag" (proc(5))


def test_no_elements_gives_an_empty_array():
    a = huge_page_empty(0, np.float32)
    assert a.shape == (0,) and a.dtype == np.float32


@pytest.mark.skipif(not HUGE_PAGES, reason=NO_HUGE_PAGES)
def test_an_os_that_refuses_the_advice_still_gets_its_array(rng, monkeypatch):
    class Refusing(mmap.mmap):  # a kernel built without transparent huge pages answers EINVAL
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    class Module:  # the mmap module as memory.py uses it, with the refusing mapping
        MADV_HUGEPAGE, MAP_PRIVATE, MAP_ANONYMOUS = mmap.MADV_HUGEPAGE, mmap.MAP_PRIVATE, mmap.MAP_ANONYMOUS
        mmap = Refusing

    monkeypatch.setattr(memory, "mmap", Module)
    a = huge_page_empty(HUGE_PAGE_BYTES + 5, np.int8)
    values = rng.integers(-128, 128, a.size).astype(np.int8)
    a[:] = values
    assert a.flags.writeable and np.array_equal(a, values)
