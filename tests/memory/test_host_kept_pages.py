"""A ``host`` pool keeps freed pages resident in its first ``keep_resident`` bytes, gives back those beyond at once,
and gives back every free page at a trim (``dask_gpupool.tuning.HOST_KEEP_RESIDENT``)."""

from __future__ import annotations

import pytest

from dask_gpupool import tuning
from dask_gpupool.memory.host import SharedHostMemoryResource
from dask_gpupool.testing.memory import read_bytes, write_bytes

MiB = 1 << 20


def test_freed_pages_in_the_kept_range_stay_resident_for_owner_and_peer_until_a_trim(no_fd_leak):
    owner = SharedHostMemoryResource(64 * MiB, keep_resident=16 * MiB)
    assert owner.keep_resident == 16 * MiB
    kept = owner.allocate(16 * MiB)  # first fit: offset 0, the whole kept range
    beyond = owner.allocate(16 * MiB)  # right after it
    assert owner.in_kept_range(kept) and not owner.in_kept_range(beyond)
    write_bytes(kept, b"\x05" * (16 * MiB))
    write_bytes(beyond, b"\x06" * (16 * MiB))
    mapped = SharedHostMemoryResource.from_allocation_handle(owner.allocation_handle)
    view = mapped.import_buffer(owner.offset_of(kept), kept.size)
    assert read_bytes(view, 4) == b"\x05" * 4
    view.close()
    resident = owner.attributes.reserved_mem_current
    assert resident == 32 * MiB
    kept.close()
    assert owner.attributes.reserved_mem_current == resident  # kept: no page went back
    beyond.close()
    assert owner.attributes.reserved_mem_current == 16 * MiB  # its pages went back, the kept range's stay
    again = owner.allocate(8 * MiB)  # the kept pages again: written without faults, read by the peer as written
    assert owner.offset_of(again) == 0 and owner.attributes.reserved_mem_current >= 8 * MiB
    write_bytes(again, b"\x09" * (8 * MiB))
    view = mapped.import_buffer(owner.offset_of(again), again.size)
    assert read_bytes(view, 8 * MiB) == b"\x09" * (8 * MiB)
    view.close()
    again.close()
    assert owner.trim() == 0  # a trim gives the kept pages back too
    mapped.close()
    owner.close()


def test_the_kept_range_is_the_tuned_size_at_most_the_pool_and_none_on_a_mapped_pool(no_fd_leak):
    large = SharedHostMemoryResource(2 * tuning.HOST_KEEP_RESIDENT)
    assert large.keep_resident == tuning.HOST_KEEP_RESIDENT
    large.close()
    small = SharedHostMemoryResource(4 * MiB)
    assert small.keep_resident == 4 * MiB
    mapped = SharedHostMemoryResource.from_allocation_handle(small.allocation_handle)
    assert mapped.keep_resident == 0
    mapped.close()
    small.close()
    with pytest.raises(ValueError, match="keep_resident"):
        SharedHostMemoryResource(4 * MiB, keep_resident=-1)
