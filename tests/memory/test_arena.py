from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_gpupool import PoolExhaustedError
from dask_gpupool.memory.arena import Arena


def test_allocations_are_aligned_and_disjoint():
    a = Arena(4096, alignment=256)
    offsets = [a.allocate(n) for n in (1, 256, 300, 0)]
    assert offsets == [0, 256, 512, 1024]
    assert a.used == 256 + 256 + 512 + 256


def test_free_coalesces_neighbours():
    a = Arena(1024, alignment=256)
    x, y, z, w = (a.allocate(256) for _ in range(4))
    with pytest.raises(PoolExhaustedError):
        a.allocate(1)
    a.free(y)
    a.free(w)
    a.free(z)  # merges with y (left) and w (right)
    assert a.allocate(768) == y
    a.free(x)
    assert a.allocate(256) == x
    assert a.used_high == 1024 and a.extent == 1024


def test_exhaustion_and_double_free_are_clear_errors():
    a = Arena(512, alignment=256)
    a.allocate(512)
    with pytest.raises(PoolExhaustedError, match="cannot allocate 1 bytes"):
        a.allocate(1)
    with pytest.raises(ValueError, match="no allocation at offset 256"):
        a.free(256)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3000)), max_size=60))
def test_random_alloc_free_keeps_invariants(ops):
    a = Arena(16384, alignment=64)
    live: dict[int, int] = {}
    for is_alloc, n in ops:
        if is_alloc or not live:
            try:
                off = a.allocate(n)
            except PoolExhaustedError:
                continue
            size = max(64, -(-n // 64) * 64)
            assert all(off + size <= o or o + s <= off for o, s in live.items())
            assert off % 64 == 0 and off + size <= a.capacity
            live[off] = size
        else:
            off = sorted(live)[n % len(live)]
            assert a.free(off) == live.pop(off)
        assert a.used == sum(live.values())
    for off in list(live):
        a.free(off)
    assert a.used == 0
    assert a.allocate(16384) == 0  # everything coalesced back into one range


def test_sizes_are_exact_integers_even_huge_numpy_ones():
    """``np.int64`` sizes near 2**63 overflowed when rounded up and wrapped to one alignment unit."""
    import numpy as np

    a = Arena(1 << 20, alignment=256)
    for size in (np.int64(2**63 - 100), np.uint64(2**64 - 1), 2**64):
        with pytest.raises(PoolExhaustedError, match="more than the whole pool"):
            a.allocate(size)
    for size in (1.5, "8", None):
        with pytest.raises(TypeError):
            a.allocate(size)
    with pytest.raises(ValueError, match="cannot allocate -1 bytes"):
        a.allocate(np.int64(-1))
    assert a.allocate(np.int64(300)) == 0 and a.used == 512
    assert a.used == 512 and a.live == 1
