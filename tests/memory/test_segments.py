"""SegmentedResource bookkeeping over a host-memory upstream (no GPU needed)."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
from cuda.core import Buffer

from dask_gpupool import PoolClosedError, PoolExhaustedError, UnknownPoolError
from dask_gpupool.memory.host import HostOnlyResource
from dask_gpupool.memory.segments import BUFFER_ALIGNMENT, SEGMENT_ALIGNMENT, SegmentedResource

MiB = 1 << 20


class HostUpstream(HostOnlyResource):
    """Plain host memory with a capacity, standing in for the CUDA pool segments come from."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.live: dict[int, Any] = {}
        self.closed = False

    def allocate(self, size: int, *, stream: Any = None) -> Buffer:
        if sum(len(b) for b in self.live.values()) + size > self.capacity:
            raise PoolExhaustedError(f"upstream full: {size} bytes")
        raw = ctypes.create_string_buffer(size)
        self.live[ctypes.addressof(raw)] = raw
        return Buffer.from_handle(ctypes.addressof(raw), size, mr=self)

    def deallocate(self, ptr: Any, size: int, *, stream: Any = None) -> None:
        del self.live[int(ptr)]

    def close(self) -> None:
        self.closed = True


def segmented(capacity: int = 64 * MiB, segment: int = 8 * MiB) -> tuple[SegmentedResource, HostUpstream]:
    up = HostUpstream(capacity)
    return SegmentedResource(up, segment, None, lambda b: int(b.handle).to_bytes(8, "little")), up


def test_buffers_share_a_segment_and_locate_back():
    res, up = segmented()
    bufs = [res.allocate(100 + i) for i in range(10)]
    assert res.segments == 1 and len(up.live) == 1
    seg, _first = res.locate(int(bufs[0].handle))
    assert seg.size == 8 * MiB and seg.payload == seg.base.to_bytes(8, "little")
    for b in bufs:
        s, offset = res.locate(int(b.handle))
        assert s is seg and offset % BUFFER_ALIGNMENT == 0 and int(b.handle) == seg.base + offset
    assert res.attributes.used_mem_current == 10 * BUFFER_ALIGNMENT
    for b in bufs:
        b.close()
    assert res.attributes.used_mem_current == 0 and res.attributes.reserved_mem_current == 8 * MiB


def test_a_freed_range_is_reused_and_a_full_segment_adds_another():
    res, _up = segmented()
    a = res.allocate(6 * MiB)
    b = res.allocate(6 * MiB)  # does not fit next to a
    assert res.segments == 2
    a_addr = int(a.handle)
    a.close()
    c = res.allocate(5 * MiB)
    assert int(c.handle) == a_addr and res.segments == 2
    del b, c


def test_a_buffer_larger_than_a_segment_gets_its_own_and_keeps_it():
    res, _up = segmented()
    big = res.allocate(20 * MiB + 1)
    seg, offset = res.locate(int(big.handle))
    assert offset == 0 and seg.size == 22 * MiB and seg.size % SEGMENT_ALIGNMENT == 0
    big.close()
    again = res.allocate(21 * MiB)
    assert res.locate(int(again.handle))[0] is seg and res.segments == 1
    assert res.attributes.reserved_mem_high == 22 * MiB


def test_a_full_upstream_is_a_clear_error_and_loses_nothing():
    res, _up = segmented(capacity=16 * MiB)
    a = res.allocate(8 * MiB)
    b = res.allocate(8 * MiB)
    with pytest.raises(PoolExhaustedError, match="no segment has room"):
        res.allocate(MiB)
    assert res.attributes.used_mem_current == 16 * MiB
    b.close()
    res.allocate(MiB).close()
    del a


def test_an_upstream_short_of_a_whole_segment_gives_a_smaller_one():
    """When the upstream has room for less than a segment, a buffer goes into a new segment of half (a quarter, ...)
    the segment size, down to its own size rounded up to 2 MiB, rather than failing while memory is left."""
    res, _up = segmented(capacity=14 * MiB)
    bufs = [res.allocate(8 * MiB)]  # the whole first segment; 6 MiB left upstream
    bufs.append(res.allocate(3 * MiB))
    assert res.locate(int(bufs[-1].handle))[0].size == 4 * MiB  # not 8: 2 MiB left
    bufs.append(res.allocate(MiB))  # beside it
    bufs.append(res.allocate(2 * MiB))
    assert res.locate(int(bufs[-1].handle))[0].size == 2 * MiB and res.segments == 3
    with pytest.raises(PoolExhaustedError, match="no segment has room"):
        res.allocate(1)
    assert res.attributes.reserved_mem_current == 14 * MiB
    for b in bufs:
        b.close()
    res.close(free_segments=True)


def test_unknown_addresses_and_close():
    res, up = segmented()
    keep = res.allocate(MiB)
    with pytest.raises(ValueError, match="in no segment"):
        res.locate(1)
    res.close(free_segments=True)
    res.close()
    assert up.closed and not up.live
    with pytest.raises(PoolClosedError):
        res.allocate(1)
    del keep  # freeing after close is a no-op


def test_closing_frees_unmapped_segments_and_keeps_those_a_peer_may_still_map():
    from dask_gpupool.memory.lifetime import KEPT_UNTIL_EXIT

    res, up = segmented()
    a = res.allocate(MiB)
    b = res.allocate(7 * MiB + 1)  # a second arena segment
    assert res.segments == 2
    seg_a = res.locate(int(a.handle))[0]
    res.note_claims([seg_a.id], connection=3)  # a peer claimed a lease on a: it maps a's segment
    a.close()
    b.close()
    before = len(KEPT_UNTIL_EXIT)
    res.close()
    assert up.closed and len(up.live) == 1 and len(KEPT_UNTIL_EXIT) == before + 1
    assert int(KEPT_UNTIL_EXIT[-1].handle) == seg_a.base
    KEPT_UNTIL_EXIT.pop()


def test_retired_segments_go_once_no_buffer_lives_in_them_and_no_peer_maps_them():
    res, up = segmented()
    idle = res.allocate(MiB)
    seg_idle = res.locate(int(idle.handle))[0]
    idle.close()
    held = res.allocate(7 * MiB + 1)
    mapped = res.allocate(6 * MiB)
    seg_held, seg_mapped = (res.locate(int(x.handle))[0] for x in (held, mapped))
    assert seg_idle is seg_held and seg_mapped is not seg_held
    res.note_claims([seg_mapped.id, seg_mapped.id], connection=5)
    mapped.close()
    below = res.retire()
    assert below == max(seg_held.id, seg_mapped.id) + 1 and res.retiring == 2 and len(up.live) == 2

    fresh = res.allocate(MiB)  # retired segments take no new buffers
    assert res.locate(int(fresh.handle))[0].id >= below and res.segments == 3
    held.close()  # its segment: no buffer, no peer
    assert res.segments == 2 and res.retiring == 1

    res.note_released([(seg_mapped.id, 1)], connection=5)  # stale: a second claim crossed it
    assert res.retiring == 1
    res.note_released([(seg_mapped.id, 2)], connection=5)
    assert res.retiring == 0 and res.segments == 1 and len(up.live) == 1
    fresh.close()
    res.close(free_segments=True)
    assert not up.live


def test_a_closed_connection_unmaps_and_unknown_releases_are_ignored():
    res, up = segmented()
    buf = res.allocate(MiB)
    seg = res.locate(int(buf.handle))[0]
    res.note_claims([seg.id, 999], connection=1)
    res.note_claims([seg.id], connection=2)
    buf.close()
    res.retire()
    res.note_released([(999, 1), (seg.id, 1)], connection=7)  # a connection that claimed nothing
    res.drop_connection(1)
    assert res.retiring == 1
    res.drop_connection(2)
    assert res.retiring == 0 and not up.live


def test_large_buffers_get_own_segments_that_later_large_buffers_reuse_until_retired():
    res, up = segmented()
    big = res.allocate(20 * MiB + 1)
    seg, offset = res.locate(int(big.handle))
    assert seg.own and offset == 0 and seg.size == 22 * MiB
    big.close()
    again = res.allocate(21 * MiB)
    assert res.locate(int(again.handle))[0] is seg  # the spare, reused
    other = res.allocate(12 * MiB)  # the 22 MiB spare is in use: a segment of its own
    assert res.locate(int(other.handle))[0] is not seg
    again.close()
    small = res.allocate(9 * MiB)  # 10 MiB needed; the 22 MiB spare would waste over half
    assert res.locate(int(small.handle))[0] is not seg
    res.retire()
    assert seg.base not in up.live  # a retired spare nobody maps is freed
    for b in (other, small):
        b.close()
    assert not up.live


def test_a_full_upstream_frees_idle_large_buffer_segments_no_peer_maps():
    res, up = segmented(capacity=64 * MiB)
    a = res.allocate(30 * MiB)
    b = res.allocate(30 * MiB)
    seg_b = res.locate(int(b.handle))[0]
    res.note_claims([seg_b.id], connection=4)  # a peer maps b's segment: it must stay
    a.close()
    b.close()
    big = res.allocate(34 * MiB)  # no spare fits (30 < 34) and 4 MiB are left: a's idle segment goes
    assert len(up.live) == 2 and res.locate(int(big.handle))[0].size == 34 * MiB
    assert any(int(k) == seg_b.base for k in up.live)
    with pytest.raises(PoolExhaustedError):
        res.allocate(40 * MiB)  # b's segment is mapped, big's is in use: nothing more to free


def full_with_a_mapped_spare() -> tuple[SegmentedResource, HostUpstream, Any]:
    """A 64 MiB upstream holding a 30 MiB spare that a peer (connection 4) maps, and a 30 MiB buffer in use."""
    res, up = segmented(capacity=64 * MiB)
    spare = res.allocate(30 * MiB)
    seg = res.locate(int(spare.handle))[0]
    res.note_claims([seg.id], connection=4)
    spare.close()
    in_use = res.allocate(31 * MiB)  # 31 > 30: not the spare; 61 MiB of 64 taken
    return res, up, (seg, in_use)


def test_a_full_pool_reclaims_a_spare_that_a_peer_maps_and_waits_for_its_release():
    """A large buffer's spare segment that a peer maps is retired one by one when the pool is full (it takes no
    buffer any more and is published in ``reclaim``); a task's allocation waits for the peer's release, then
    fits."""
    import threading

    res, up, (seg, in_use) = full_with_a_mapped_spare()
    published: list[tuple[int, ...]] = []

    def publish() -> None:  # the peer sees the row, unmaps, and releases soon after
        published.append(res.reclaim)
        threading.Timer(0.2, res.note_released, ([(seg.id, 1)],), {"connection": 4}).start()

    res.reclaimer.through(publish, timeout=10.0)
    big = res.allocate(32 * MiB, wait=True)  # 30 + 31 + 32 > 64: fits only once the spare is gone
    assert published == [(seg.id,)]
    assert seg.base not in up.live and res.locate(int(big.handle))[0].size == 32 * MiB
    assert res.reclaim == ()  # freed: nothing left to reclaim
    big.close()
    in_use.close()
    res.close()


def test_a_reclaim_that_peers_do_not_answer_in_time_fails_is_published_again_and_frees_later():
    """No release within the timeout: PoolExhaustedError saying so, the spare stays retired (no new buffer goes
    there), and the next full allocation publishes the row again (the first may have been lost); the release
    arriving later frees it, and the next allocation fits without waiting."""
    res, up, (seg, in_use) = full_with_a_mapped_spare()
    published: list[tuple[int, ...]] = []
    res.reclaimer.through(lambda: published.append(res.reclaim), timeout=0.2)
    with pytest.raises(PoolExhaustedError, match="being reclaimed"):
        res.allocate(32 * MiB, wait=True)
    assert published == [(seg.id,)] and res.reclaim == (seg.id,)
    with pytest.raises(PoolExhaustedError):
        res.allocate(30 * MiB)  # the spare would fit, but it is retired: not reused
    assert published == [(seg.id,), (seg.id,)]  # published again
    res.note_released([(seg.id, 1)], connection=4)
    assert seg.base not in up.live and res.reclaim == ()
    res.allocate(32 * MiB).close()
    in_use.close()
    res.close()


def test_only_a_tasks_allocation_waits_and_never_on_an_event_loop():
    """Without ``wait`` (a caller with a fallback) and on a thread running an event loop (a worker's),
    a full pool publishes the reclaim and fails at once."""
    import asyncio
    import time

    res, _up, (seg, in_use) = full_with_a_mapped_spare()
    published: list[tuple[int, ...]] = []
    res.reclaimer.through(lambda: published.append(res.reclaim), timeout=30.0)
    start = time.monotonic()
    with pytest.raises(PoolExhaustedError):
        res.allocate(32 * MiB)

    async def on_the_loop() -> None:
        res.allocate(32 * MiB, wait=True)

    with pytest.raises(PoolExhaustedError):
        asyncio.run(on_the_loop())
    assert time.monotonic() - start < 5.0  # neither waited its 30 s
    assert published == [(seg.id,), (seg.id,)]
    in_use.close()
    res.close()


def test_closing_ends_an_allocation_that_waits_for_a_reclaim():
    import threading
    import time

    res, _up, (_seg, in_use) = full_with_a_mapped_spare()
    published = threading.Event()  # the allocation found the pool full, published the reclaim, and waits
    res.reclaimer.through(published.set, timeout=30.0)
    got: list[BaseException] = []

    def allocate() -> None:
        try:
            res.allocate(32 * MiB, wait=True)
        except BaseException as e:
            got.append(e)

    t = threading.Thread(target=allocate)
    start = time.monotonic()
    t.start()
    assert published.wait(10), "the allocation did not wait for a reclaim"
    in_use.close()
    res.close()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - start < 5.0
    assert len(got) == 1 and isinstance(got[0], PoolClosedError)


def test_without_a_reclaimer_a_mapped_spare_stays_and_the_pool_is_full():
    res, up, (seg, in_use) = full_with_a_mapped_spare()
    with pytest.raises(PoolExhaustedError):
        res.allocate(32 * MiB, wait=True)
    assert seg.base in up.live and not seg.retiring and res.reclaim == ()
    in_use.close()
    res.close()


def test_segments_are_exported_by_fd_only_when_their_memory_says_so():
    """Peers fetch a segment's fd from the broker only for memory that exports fds (VMM); segments of legacy IPC
    memory travel by the handle in their descriptor (as do those of an upstream's own memory, in these host tests).
    The resources are only constructed here (no CUDA call): what is checked is the decision, not the driver."""
    from dask_gpupool.memory.driver_segments import SegmentMemory
    from dask_gpupool.memory.legacy import LegacyMemoryResource
    from dask_gpupool.memory.vmm import VmmMemoryResource

    class FdSegments(SegmentMemory):  # as VmmMemoryResource declares it, without its driver calls
        exports_fds = VmmMemoryResource.exports_fds

    up = HostUpstream(64 * MiB)
    payload = lambda b: b""  # noqa: E731
    assert not SegmentedResource(up, 8 * MiB, None, payload).exports_segments  # the upstream's own memory
    legacy = SegmentedResource(up, 8 * MiB, None, payload, memory=LegacyMemoryResource(0, 64 * MiB))
    assert not legacy.exports_segments
    with pytest.raises(UnknownPoolError, match="not by fd"):
        legacy.segment_fd(1)
    assert SegmentedResource(up, 8 * MiB, None, payload, memory=FdSegments(0, 64 * MiB)).exports_segments


def test_a_buffer_freed_by_the_garbage_collector_inside_a_placement_does_not_deadlock_it():
    """A segment buffer in a reference cycle freed by the collector inside the resource's own allocation (on the
    thread that holds the segment's arena lock) must neither deadlock nor be freed twice."""
    import gc

    from conftest import run_with_frequent_collections

    res, up = segmented()

    def step() -> None:
        b = res.allocate(4096)
        cycle: list[Any] = [b]
        cycle.append(cycle)
        del b, cycle
        res.allocate(100).close()

    run_with_frequent_collections(step)
    gc.collect()
    res.allocate(1).close()  # reaps what is pending
    assert res.attributes.used_mem_current == 0
    res.close(free_segments=True)
    assert not up.live


@pytest.mark.parametrize("size", [-1, 1.5, "8", None])
def test_sizes_that_are_not_byte_counts_are_refused_and_cost_nothing(size):
    res, up = segmented()
    with pytest.raises((TypeError, ValueError)):
        res.allocate(size)
    assert res.attributes.used_mem_current == 0
    res.close(free_segments=True)
    assert not up.live


def test_a_huge_numpy_size_is_a_clear_error_not_a_wrapped_around_one():
    """A size computed with NumPy (``np.prod(shape) * itemsize``) is an ``int64``: rounding it up to the
    alignment overflowed and wrapped to a negative number, and a buffer claiming 2**63 bytes was placed in a
    few hundred."""
    import numpy as np

    res, _up = segmented()
    for size in (np.int64(2**63 - 100), np.uint64(2**64 - 1), np.int64(7 * MiB)):
        try:
            buf = res.allocate(size)
        except PoolExhaustedError:
            continue
        assert int(size) == 7 * MiB, f"{size!r} bytes placed in a pool of 64 MiB"
        assert buf.size == 7 * MiB
        buf.close()
    assert res.attributes.used_mem_current == 0
    res.close(free_segments=True)


def test_buffers_freed_after_close_leave_the_used_bytes():
    """Closing with buffers alive keeps their segments until the process exits (a peer may map them); the
    buffers freed after count as freed, so the used bytes come back to 0 (before: they stayed, above the 0 bytes
    reserved, for good)."""
    from dask_gpupool.memory.lifetime import KEPT_UNTIL_EXIT

    res, _up = segmented()
    small, big = res.allocate(MiB), res.allocate(20 * MiB)
    kept = len(KEPT_UNTIL_EXIT)
    res.close()
    assert res.attributes.used_mem_current == MiB + 20 * MiB
    small.close()
    big.close()
    big.close()  # a second close frees nothing twice
    stats = res.attributes
    assert (stats.used_mem_current, stats.reserved_mem_current) == (0, 0)
    del KEPT_UNTIL_EXIT[kept:]


@pytest.mark.parametrize(
    ("wanted", "prefer_legacy", "gpu_has", "made_of"),
    [
        ("auto", False, {"vmm", "legacy"}, "vmm"),  # a worker that listens over TCP
        ("auto", True, {"vmm", "legacy"}, "legacy"),  # over UCX: UCX sends legacy IPC memory as it is
        ("auto", False, {"legacy"}, "legacy"),  # each where the GPU supports it, else the other
        ("auto", True, {"vmm"}, "vmm"),
        ("vmm", True, {"vmm", "legacy"}, "vmm"),  # a set value holds whatever the comm
        ("legacy", False, {"legacy"}, "legacy"),
    ],
)
def test_segments_are_vmm_or_legacy_ipc_memory_as_the_gpu_allows(wanted, prefer_legacy, gpu_has, made_of):
    """A ``device`` pool's segment memory, from the option, the worker's comm and what the GPU supports (the GPU's
    answers given here as a set; on a GPU they are its driver attributes)."""
    from dask_gpupool.config import PoolOptions
    from dask_gpupool.memory.device_pool import segment_memory_of

    options = PoolOptions.from_config(kind="device", segment_memory=wanted)
    assert segment_memory_of(options, 0, gpu_has.__contains__, prefer_legacy) == made_of


def test_a_gpu_without_vmm_or_legacy_ipc_memory_is_a_clear_error():
    """No allocations of CUDA's IPC pool as a way out: a set segment memory the GPU lacks names the one it has, and a
    GPU with neither makes no ``device`` pool, naming the kinds that need neither."""
    from dask_gpupool import ConfigError
    from dask_gpupool.config import PoolOptions
    from dask_gpupool.memory.device_pool import segment_memory_of

    vmm = PoolOptions.from_config(kind="device", segment_memory="vmm")
    with pytest.raises(ConfigError, match=r"segment-memory='vmm': GPU 1 cannot export .* valid here: 'legacy'"):
        segment_memory_of(vmm, 1, {"legacy"}.__contains__)
    legacy = PoolOptions.from_config(kind="device", segment_memory="legacy")
    with pytest.raises(ConfigError, match=r"segment-memory='legacy': GPU 0 cannot share .* valid here: 'vmm'"):
        segment_memory_of(legacy, 0, {"vmm"}.__contains__)
    for options in (vmm, legacy, PoolOptions.from_config(kind="auto")):
        with pytest.raises(ConfigError, match=r"GPU 0 can neither .* valid here: gpupool.kind 'pinned' or 'host'"):
            segment_memory_of(options, 0, set().__contains__, prefer_legacy=True)
