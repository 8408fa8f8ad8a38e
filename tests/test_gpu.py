"""The CUDA paths with real Nanny workers: ``device`` and ``pinned`` pools (run on the GPU machine)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from conftest import (
    back_to,
    counters,
    handoff_round_trip,
    kill_consumer_holding_leases,
    kill_the_middle_of_a_chain,
    nanny_cluster,
    pid_of,
    run_with_frequent_collections,
    stress,
    wait_for,
    wait_forgotten,
    warm_up,
    worker_addresses,
)

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import testing as T
from dask_gpupool.memory.topology import local_devices

pytestmark = pytest.mark.gpu

MiB = 1 << 20
#: A worker on GPU 0 (two of them share it).
ONE_GPU = {"env": {"CUDA_VISIBLE_DEVICES": "0"}}
#: dask-cuda's layout on two GPUs: each worker's own GPU is its ordinal 0, and both GPUs are visible.
ROTATED = [{"env": {"CUDA_VISIBLE_DEVICES": "0,1"}}, {"env": {"CUDA_VISIBLE_DEVICES": "1,0"}}]


def gpus(n: int) -> None:
    """Skip unless ``n`` GPUs are visible, and CuPy (which the checks read device memory with) imports."""
    if len(local_devices().uuids) < n:
        pytest.skip(f"needs {n} GPUs, sees {len(local_devices().uuids)}")
    pytest.importorskip("cupy", reason="the GPU tests read device memory with CuPy")


def test_two_workers_on_one_gpu():
    gpus(1)
    one_gpu = {"env": {"CUDA_VISIBLE_DEVICES": local_devices().uuids[0]}}
    with nanny_cluster([one_gpu, one_gpu], GPUPool(kind="device", max_size="1 GiB")) as c:
        rows = handoff_round_trip(c, 8 * MiB, b"device bytes written by A" * 100)
        a, b = worker_addresses(c)
        assert {r.kind for r in rows.values()} == {"device"}
        assert rows[a].device == rows[b].device == local_devices().uuids[0]
        assert rows[a].max_size == 1 << 30


def test_pinned_pools_on_one_gpu():
    """Pinned host pools: registered with the worker's GPU; a peer maps the pool and reads (CPU and GPU paths)."""
    gpus(1)
    with nanny_cluster([ONE_GPU, ONE_GPU], GPUPool(kind="pinned", max_size="1 GiB")) as c:
        rows = handoff_round_trip(c, 8 * MiB, b"pinned bytes written by A" * 100)
        a, b = worker_addresses(c)
        assert {r.kind for r in rows.values()} == {"pinned"} and rows[a].device == local_devices().uuids[0]
        desc = c.submit(T.hold, "p", MiB, b"pinned, read by B's GPU", workers=[a], pure=False).result()
        assert c.submit(T.read_peer_on_gpu, desc, 23, workers=[b], pure=False).result() == b"pinned, read by B's GPU"
        c.submit(T.release, "p", workers=[a], pure=False).result()


def test_one_worker_per_gpu_with_rotated_visible_devices():
    gpus(2)
    uuids = local_devices().uuids
    with nanny_cluster(ROTATED, GPUPool(kind="device", max_size="1 GiB")) as c:
        rows = handoff_round_trip(c, 64 * MiB, b"across NVLink" * 1000)
        a, b = worker_addresses(c)
        assert (rows[a].device, rows[b].device) == (uuids[0], uuids[1])
        assert rows[a].devices == uuids and rows[b].devices == (uuids[1], uuids[0])


def test_owner_gpu_not_visible_to_the_importer():
    gpus(2)
    alone = [{"env": {"CUDA_VISIBLE_DEVICES": "0"}}, {"env": {"CUDA_VISIBLE_DEVICES": "1"}}]
    with nanny_cluster(alone, GPUPool(kind="device", max_size="1 GiB")) as c:
        handoff_round_trip(c, MiB, b"granted with cuMemPoolSetAccess")


def test_device_pool_stats_and_full_pool():
    gpus(1)
    with nanny_cluster([{}], GPUPool(kind="device", max_size="64 MiB")) as c:
        (a,) = worker_addresses(c)

        def fill() -> tuple[dict, str]:
            bufs = [dask_gpupool.allocate(16 * MiB) for _ in range(3)]
            try:
                dask_gpupool.allocate(64 * MiB)
                err = "no error"
            except dask_gpupool.PoolExhaustedError as e:
                err = str(e)
            stats = dask_gpupool.dask.api.current_service().pool.stats().to_msg()
            del bufs
            return stats, err

        stats, err = c.submit(fill, workers=[a], pure=False).result()
        assert stats["used_high"] >= 48 * MiB and stats["reserved_high"] >= 48 * MiB
        assert "cannot allocate" in err


# -- zero-copy handoff (issue 3) ---------------------------------------------------------


def _handoff_roundtrip(c, nbytes: int) -> None:
    """Buffer and CuPy array from w0 to w1: mapped, not copied; writes visible; leases end; nothing leaks."""
    import numpy as np

    a, b = worker_addresses(c)
    baseline = warm_up(c, a, b)
    before = counters(c)
    x = c.submit(T.make_buffer, nbytes, b"device bytes from A", workers=[a], pure=False)
    y = c.submit(T.keep, x, workers=[b], pure=False)
    assert c.submit(T.describe, y, workers=[b], pure=False).result()["imported"]
    assert c.submit(T.head, y, 19, workers=[b], pure=False).result() == b"device bytes from A"
    c.submit(T.overwrite, x, b"DEVICE BYTES FROM A", workers=[a], pure=False).result()
    assert c.submit(T.head, y, 19, workers=[b], pure=False).result() == b"DEVICE BYTES FROM A"
    arr = c.submit(T.make_array, 1 << 20, workers=[a], pure=False)
    got = c.submit(T.describe, c.submit(T.keep, arr, workers=[b], pure=False), workers=[b], pure=False).result()
    assert got == {"type": "cupy.ndarray", "imported": True, "in_own_pool": False}
    assert c.submit(T.total, arr, workers=[b], pure=False).result() == float(np.arange(1 << 20).sum())
    now = counters(c)
    assert now[b]["copied_bytes"] == before[b]["copied_bytes"]
    assert now[b]["zero_copy_bytes"] - before[b]["zero_copy_bytes"] == nbytes + 8 * (1 << 20)
    assert now[a]["leases"] == 2
    del x, y, arr, got
    back_to(c, baseline)


def test_handoff_two_workers_on_one_gpu():
    gpus(1)
    one_gpu = {"env": {"CUDA_VISIBLE_DEVICES": local_devices().uuids[0]}}
    with nanny_cluster([one_gpu, one_gpu], GPUPool(kind="device", max_size="2 GiB")) as c:
        _handoff_roundtrip(c, 64 * MiB)


def test_handoff_one_worker_per_gpu():
    gpus(2)
    with nanny_cluster(ROTATED, GPUPool(kind="device", max_size="2 GiB")) as c:
        a, b = worker_addresses(c)
        rows = {r.worker: r for r in dask_gpupool.pools(c)}
        assert rows[a].peers == (rows[b].device,) and rows[b].peers == (rows[a].device,)
        _handoff_roundtrip(c, 64 * MiB)


def test_concurrent_handoffs_across_gpus_while_the_producer_allocates():
    # The pattern that broke the consumer's context before pools granted peers access
    # themselves: the consumer imports buffer i while the producer's pool grows for i + 1.
    gpus(2)

    with nanny_cluster(ROTATED, GPUPool(kind="device", max_size="2 GiB")) as c:
        a, b = worker_addresses(c)

        def batch() -> None:
            xs = [c.submit(T.make_buffer, 16 * MiB, bytes([i + 1]), workers=[a], pure=False) for i in range(8)]
            ys = [c.submit(T.keep, x, workers=[b], pure=False) for x in xs]
            got = c.gather([c.submit(T.head, y, 1, workers=[b], pure=False) for y in ys])
            assert got == [bytes([i + 1]) for i in range(8)]
            assert c.run(T.handoff_counters)[b]["copied_bytes"] == 0

        batch()  # cold: the consumer maps the pool while it grows
        baseline = warm_up(c, a, b)
        batch()
        batch()
        back_to(c, baseline)


def test_handoff_to_another_gpu_is_zero_copy():
    gpus(2)
    with nanny_cluster(ROTATED, GPUPool(kind="device", max_size="2 GiB")) as c:  # the other GPU granted access
        assert all(len(r.peers) == 1 for r in dask_gpupool.pools(c))
        a, b = worker_addresses(c)
        x = c.submit(T.fill, 16 * MiB, 9, workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.all_equal, y, 9, workers=[b], pure=False).result()
        got = c.run(T.handoff_counters)
        assert got[b]["zero_copy_bytes"] == 16 * MiB and got[b]["copied_bytes"] == 0, got


def test_vmm_memory_outlives_its_maker_for_an_importer():
    """VmmMemoryResource + VmmMapping in one process: the import holds its own reference to the memory."""
    gpus(1)
    from cuda.core import Device

    from dask_gpupool.memory.vmm import VmmMapping, VmmMemoryResource, vmm_supported

    dev = Device(0)
    dev.set_current()
    if not vmm_supported(0):
        pytest.skip("GPU 0 cannot export virtual memory as POSIX fds")
    res = VmmMemoryResource(0, 64 * MiB)
    buf = res.allocate(3 * MiB)
    assert buf.size == res.round(3 * MiB) and res.used == buf.size
    T.set_all(buf, 9)
    fd = res.export_fd(int(buf.handle))
    try:
        mapping = VmmMapping.open(fd, buf.size, 0)
    finally:
        os.close(fd)
    buf.close(dev.default_stream)  # the maker lets go first
    assert res.used == 0
    import cupy

    mem = cupy.cuda.UnownedMemory(mapping.handle, mapping.size, mapping, device_id=0)
    arr = cupy.ndarray((mapping.size,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
    refill = [res.allocate(8 * MiB) for _ in range(6)]  # new allocations get other memory
    for r in refill:
        T.set_all(r, 1)
    assert bool((arr == 9).all())
    mapping.close(dev.default_stream)
    with pytest.raises(dask_gpupool.PoolExhaustedError, match="of 67108864 bytes in use"):
        res.allocate(32 * MiB)
    with pytest.raises(KeyError):
        res.export_fd(12345)
    for r in refill:
        r.close()
    res.close()
    with pytest.raises(dask_gpupool.PoolClosedError):
        res.allocate(MiB)


def vmm_segments(segment_size: int, max_size: int) -> Any:
    """A SegmentedResource over VMM memory of ``max_size`` bytes on GPU 0 (no Dask), as a ``device`` pool makes one,
    with segments of ``segment_size``; skips where GPU 0 cannot export virtual memory as POSIX fds."""
    from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions

    from dask_gpupool.memory.segments import SegmentedResource
    from dask_gpupool.memory.vmm import VmmMemoryResource, vmm_supported

    dev = Device(0)
    dev.set_current()
    if not vmm_supported(0):
        pytest.skip("GPU 0 cannot export virtual memory as POSIX fds")
    up = DeviceMemoryResource(dev, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=max_size))
    return SegmentedResource(up, segment_size, 0, lambda b: b"", VmmMemoryResource(0, max_size))


def test_the_arena_places_buffers_in_segments_and_retiring_frees_them():
    """The arena over VMM segments (no Dask): every buffer lies inside one segment of the segment size, large ones
    get their own, a buffer freed on another stream is reused after its event, a full upstream is a clear error,
    retire frees all."""
    gpus(1)
    from cuda.core import Device

    dev = Device(0)
    res = vmm_segments(256 * MiB, 1536 * MiB)
    sizes = [0, 1, 4096, 100 * MiB, 200 * MiB, 250 * MiB, 3 * MiB]
    bufs = [res.allocate(n) for n in sizes]
    for b in bufs:
        seg, offset = res.locate(int(b.handle))
        assert not seg.own and seg.size == 256 * MiB and offset + b.size <= seg.size
    assert res.segments >= 3
    big = res.allocate(300 * MiB)
    seg, offset = res.locate(int(big.handle))
    assert seg.own and offset == 0
    stream = dev.create_stream()
    other = res.allocate(MiB, stream=stream)  # stream-ordered: freed on its stream, reused after it
    other.close(stream)
    with pytest.raises(dask_gpupool.PoolExhaustedError, match="no segment has room"):
        res.allocate(1 << 30)  # about 1068 MiB of the 1536 MiB upstream are in segments
    assert res.attributes.used_mem_current >= sum(sizes) + 300 * MiB
    for b in [*bufs, big]:
        b.close()
    assert res.attributes.used_mem_current == 0
    res.retire()
    assert res.segments == 0 and res.attributes.reserved_mem_current == 0
    again = res.allocate(MiB)  # a new segment
    assert res.locate(int(again.handle))[0].id >= res.retire_below
    again.close()
    res.close()
    stream.close()


def test_an_allocation_on_another_stream_waits_for_the_default_streams_frees_not_its_later_kernels():
    """A staging copy's allocation on a stream of its own while the default stream is busy: the range freed on the
    default stream is reused at once, and the other stream waits for that free, not for the 2 s kernel queued on the
    default stream after it (the kernel still runs when the other stream's work is done). A free queued after the
    kernel is waited for: the next allocation's stream is not done before the kernel is."""
    gpus(1)
    from cuda.bindings import driver
    from cuda.core import Device, StreamOptions

    dev = Device(0)
    res = vmm_segments(256 * MiB, 1 << 30)
    default = dev.default_stream
    side = dev.create_stream(options=StreamOptions(nonblocking=True))

    def default_busy() -> bool:
        (err,) = driver.cuStreamQuery(driver.CUstream(int(default.handle)))
        return bool(err == driver.CUresult.CUDA_ERROR_NOT_READY)

    first = res.allocate(MiB)
    ptr = int(first.handle)
    first.close(default)  # freed on the default stream
    T.spin(2000)  # a later task's kernel on the legacy default stream, still running below
    reused = res.allocate(MiB, stream=side)
    assert int(reused.handle) == ptr
    side.record().sync()  # what the side stream waits for has run...
    assert default_busy()  # ...while the kernel queued after the free still runs
    later = res.allocate(MiB)
    later.close(default)  # freed after the kernel
    again = res.allocate(MiB, stream=side)
    after = side.record()
    assert not after.is_done and default_busy()  # waits for that free, so for the kernel before it
    after.sync()
    assert not default_busy()
    for b in (reused, again):
        b.close(side)
    side.sync()
    assert res.attributes.used_mem_current == 0
    res.close()
    side.close()


def test_handoff_with_segments_on_one_gpu():
    """Buffers placed in segments: B maps a segment once and later handoffs reuse it."""
    gpus(1)
    with nanny_cluster([ONE_GPU, ONE_GPU], GPUPool(kind="device", max_size="4 GiB")) as c:
        a, b = worker_addresses(c)
        _handoff_roundtrip(c, 64 * MiB)
        segments = c.run(T.mapped_segments, workers=[b])[b]
        # A buffer over the segment size (1 GiB) gets a segment of its own; the next one of that size reuses it.
        for _ in range(2):
            x = c.submit(T.fill, 1280 * MiB, 3, workers=[a], pure=False)
            y = c.submit(T.keep, x, workers=[b], pure=False)
            assert c.submit(T.all_equal, y, 3, workers=[b], pure=False).result()
            del x, y
            # the segment is free again only once B let go of its lease
            wait_for(lambda: counters(c, a)[a]["used"] == 0, what="A's pool bytes to return")
        assert c.run(T.mapped_segments, workers=[b])[b] == segments + 1
        assert c.run(T.handoff_counters)[b]["copied_bytes"] == 0


@pytest.mark.parametrize("memory", ["auto", "legacy"])
def test_trim_frees_retired_segments_once_the_peer_let_go(memory):
    """The retire protocol: A retires its segments; B's live import keeps one; when B lets go it
    unmaps it and says so, and A frees it. New buffers go to new segments, mapped afresh. Segments of VMM memory
    (``auto``) or of legacy IPC memory (``cuMemAlloc``; a new segment may get a freed one's address, and a handle
    of its own)."""
    gpus(1)
    plugin = GPUPool(kind="device", max_size="4 GiB", segment_memory=memory)
    with nanny_cluster([ONE_GPU, ONE_GPU], plugin) as c:
        a, b = worker_addresses(c)
        made_of = "vmm" if memory == "auto" else memory
        why = dask_gpupool.stats(c)[a]["routing"]["segment-memory"]
        want = (
            "legacy (gpupool.segment-memory)"
            if memory == "legacy"
            else "vmm (auto): this worker does not listen over UCX"
        )
        assert why == want, why
        baseline = warm_up(c, a, b)
        # after a handoff each way, so that each worker's copy of the registry holds both rows (it is filled as
        # pools are looked up, not at start: the twenty-seventh session saw it without the peer's row before)
        assert c.run(T.segment_memory, workers=[b])[b] == {"pool": made_of, "row": made_of, a: made_of, b: made_of}
        x = c.submit(T.fill, 64 * MiB, 3, workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.all_equal, y, 3, workers=[b], pure=False).result()
        del x
        mapped = c.run(T.mapped_segments, workers=[b])[b]
        assert mapped >= 1
        trimmed = dask_gpupool.trim(c)
        assert trimmed[a]["retire_below"] > 0 and trimmed[a]["segments_retiring"] >= 1, trimmed
        # B still reads its import: the segment under it stays
        assert c.submit(T.all_equal, y, 3, workers=[b], pure=False).result()
        assert counters(c, a)[a]["segments_retiring"] >= 1
        del y
        wait_for(lambda: counters(c, a)[a]["segments_retiring"] == 0, what="A to free its retired segments")
        assert c.run(T.mapped_segments, workers=[b])[b] == 0
        assert counters(c, b)[b]["segments_released"] >= 1
        stats = dask_gpupool.pool_stats(c)
        assert stats[a]["used"] == 0 and stats[a]["reserved"] == 0, stats[a]
        # after the trim: new segments, mapped afresh, right bytes
        x = c.submit(T.fill, 32 * MiB, 7, workers=[a], pure=False)
        assert c.submit(T.all_equal, c.submit(T.keep, x, workers=[b], pure=False), 7, workers=[b], pure=False).result()
        assert c.run(T.mapped_segments, workers=[b])[b] == 1
        del x
        dask_gpupool.trim(c)
        wait_for(lambda: counters(c, a)[a]["segments"] == 0, what="A to free the second segment")
        back_to(c, baseline)


def test_a_value_in_a_segment_the_peer_released_after_a_trim_comes_as_a_copy_and_the_segment_is_freed():
    """After a trim, B unmaps a retired segment and releases it with its claims; a value still living in that
    segment and fetched again goes to B as a copy (fallback ``retired-segment``), with the right bytes, instead of
    a new mapping whose claims the owner's ledger would never see settled; and A frees the segment once the value
    goes (a review of the lease protocol, thirtieth session: A used to keep it until B exited)."""
    gpus(1)
    plugin = GPUPool(kind="device", max_size="4 GiB")
    with nanny_cluster([ONE_GPU, ONE_GPU], plugin) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        x1 = c.submit(T.fill, 64 * MiB, 1, workers=[a], pure=False)
        x2 = c.submit(T.fill, 64 * MiB, 2, workers=[a], pure=False)  # the same segment as x1
        assert c.submit(T.all_equal, x1, 1, workers=[b], pure=False).result()  # B maps the segment
        keys = [x1.key]
        del x1
        wait_forgotten(c, keys)
        wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="B to release x1")
        dask_gpupool.trim(c)
        wait_for(lambda: c.run(T.mapped_segments, workers=[b])[b] == 0, what="B to unmap the retired segment")
        before = counters(c, b)[b]["fallbacks"].get("retired-segment", 0)
        assert c.submit(T.all_equal, x2, 2, workers=[b], pure=False).result()
        assert counters(c, b)[b]["fallbacks"].get("retired-segment", 0) == before + 1
        assert c.run(T.mapped_segments, workers=[b])[b] == 0  # not mapped again
        keys = [x2.key]
        del x2
        wait_forgotten(c, keys)
        wait_for(lambda: counters(c, a)[a]["segments_retiring"] == 0, what="A to free its retired segments")
        assert dask_gpupool.pool_stats(c)[a]["reserved"] == 0
        back_to(c, baseline)


def test_stress_with_segments_one_gpu():
    gpus(1)
    with nanny_cluster([ONE_GPU, ONE_GPU], GPUPool(kind="device", max_size="4 GiB")) as c:
        stress(c, 20, 16 * MiB)


@pytest.mark.parametrize(
    "options",
    [{}, {"segment_memory": "legacy"}],
    ids=["vmm", "legacy"],
)
def test_stress_with_segments_two_gpus(options):
    """Across two GPUs with segments: each segment is imported once and stays mapped, so the
    per-allocation imports under which the consumer's context broke (docs/gpu-checks.md) are gone. Segments of VMM
    memory, or of legacy IPC memory (``gpupool.segment-memory: legacy``, each opened once by its handle): handoffs,
    releases and reuse under load, every value read right, nothing copied."""
    gpus(2)
    plugin = GPUPool(kind="device", max_size="4 GiB", **options)
    with nanny_cluster(ROTATED, plugin) as c:
        stress(c, 40, 16 * MiB)
        b = worker_addresses(c)[1]
        seen = c.run(T.handoff_counters, workers=[b])[b]
        assert seen["zero_copy_bytes"] > 0 and seen["copied_bytes"] == 0, seen


def test_legacy_ipc_memory_resource_allocates_names_and_bounds_its_memory():
    """LegacyMemoryResource in one process: ``cuMemAlloc`` memory rounded to 2 MiB, a distinct 64-byte IPC handle
    per allocation, ``max_size`` kept (a clear error past it), frees counted, and no allocation after close."""
    gpus(1)
    from cuda.core import Device

    from dask_gpupool.memory.legacy import HANDLE_BYTES, LegacyMemoryResource, legacy_payload, legacy_supported

    dev = Device(0)
    dev.set_current()
    if not legacy_supported(0):
        pytest.skip("GPU 0 does not share memory by IPC handles")
    res = LegacyMemoryResource(0, 64 * MiB)
    a = res.allocate(3 * MiB)
    b = res.allocate(1)
    assert (a.size, b.size, res.used) == (4 * MiB, 2 * MiB, 6 * MiB)
    T.set_all(a, 9)
    handles = {legacy_payload(a), legacy_payload(b)}
    assert len(handles) == 2 and all(len(h) == HANDLE_BYTES for h in handles)
    with pytest.raises(dask_gpupool.PoolExhaustedError, match="of 67108864 bytes in use"):
        res.allocate(60 * MiB)
    a.close(dev.default_stream)
    b.close()
    assert res.used == 0
    res.close()
    with pytest.raises(dask_gpupool.PoolClosedError):
        res.allocate(MiB)


def test_a_legacy_ipc_handle_given_for_a_larger_segment_than_its_allocation_is_refused():
    """``LegacyMapping.open`` maps what the handle names, whatever extent the descriptor says: a handle of a 4 MiB
    allocation (made in another process, as a peer's segment is) opens as a 4 MiB segment, and given for a 1 GiB
    one it is a ProtocolError with the mapping closed again, so no buffer past the allocation's end is made (found
    by a review of bad input, thirtieth session)."""
    gpus(1)
    import subprocess
    import sys

    from cuda.core import Device

    from dask_gpupool.memory.legacy import LegacyMapping, legacy_supported

    Device(0).set_current()
    if not legacy_supported(0):
        pytest.skip("GPU 0 does not share memory by IPC handles")
    code = (
        "import sys\n"
        "from cuda.core import Device\n"
        "from dask_gpupool.memory.legacy import LegacyMemoryResource, legacy_payload\n"
        "Device(0).set_current()\n"
        "buf = LegacyMemoryResource(0, 64 << 20).allocate(4 << 20)\n"
        "print(legacy_payload(buf).hex(), flush=True)\n"
        "sys.stdin.read()\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        payload = bytes.fromhex(owner.stdout.readline().strip())
        good = LegacyMapping.open(payload, 4 * MiB, 0)
        assert good.size == 4 * MiB
        good.close()
        with pytest.raises(dask_gpupool.ProtocolError, match="4194304-byte allocation given for a segment of"):
            LegacyMapping.open(payload, 1 << 30, 0)
        again = LegacyMapping.open(payload, 2 * MiB, 0)  # closed after the refusal: opens again
        again.close()
    finally:
        owner.stdin.close()
        assert owner.wait(timeout=60) == 0


def test_a_received_device_frame_is_taken_at_its_own_size():
    """On a GPU, the frames distributed-ucxx receives (a CuPy byte array, an ``rmm.DeviceBuffer``) give a Buffer of
    their own size; a header that says another size is a ProtocolError (bad-input review, thirtieth session)."""
    gpus(1)
    import cupy

    from dask_gpupool.dask.cuda_family import _cuda_deserialize_buffer

    frames: list[Any] = [cupy.arange(16, dtype="u1")]
    try:
        import rmm

        frames.append(rmm.DeviceBuffer(size=16))
    except ImportError:
        pass
    for frame in frames:
        buf = _cuda_deserialize_buffer({"nbytes": 16}, [frame])
        assert buf.size == 16 and int(buf.handle) == int(frame.__cuda_array_interface__["data"][0])
        with pytest.raises(dask_gpupool.ProtocolError, match="a device frame of 16 bytes"):
            _cuda_deserialize_buffer({"nbytes": 1 << 30}, [frame])


def dask_cuda_cluster(placement: str, **options: Any) -> Any:
    """dask-cuda's ``LocalCUDACluster`` with two workers: one per GPU (``two-gpus``, dask-cuda's own layout), or
    both on GPU 0 (``one-gpu``: dask-cuda names each worker after its GPU and makes one per GPU, so the second is
    a twin of the first's spec, with the same ``CUDA_VISIBLE_DEVICES``, RMM set-up and spilling, added to the
    cluster's ``worker_spec`` the way ``SpecCluster.scale`` adds one)."""
    import copy

    import dask_cuda

    if placement == "two-gpus":
        return dask_cuda.LocalCUDACluster(n_workers=2, threads_per_worker=1, dashboard_address=":0", **options)
    cluster = dask_cuda.LocalCUDACluster(
        CUDA_VISIBLE_DEVICES="0", n_workers=1, threads_per_worker=1, dashboard_address=":0", **options
    )
    try:
        (name, spec), *_ = cluster.worker_spec.items()
        cluster.worker_spec[f"{name}-twin"] = copy.deepcopy(spec)
        cluster.sync(cluster._correct_state)
        cluster.wait_for_workers(2, timeout=60)
    except BaseException:
        cluster.close()
        raise
    return cluster


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
def test_dask_cuda_local_cuda_cluster_hands_over(placement):
    """dask-cuda's own cluster with the plugin registered: one worker per GPU (CUDA_VISIBLE_DEVICES rotated), or two
    workers on GPU 0. A 32 MiB pool buffer reaches the other worker zero-copy with the right bytes, and every
    worker's leases, mappings and pool bytes are back to the warm-up's after."""
    gpus(2 if placement == "two-gpus" else 1)
    pytest.importorskip("dask_cuda")
    from distributed import Client

    plugin = GPUPool(
        kind="device",
        max_size="1 GiB",
    )
    with dask_cuda_cluster(placement) as cluster, Client(cluster) as c:
        c.register_plugin(plugin)
        a, b = worker_addresses(c)
        rows = {r.worker: r for r in dask_gpupool.pools(c)}
        # dask-cuda gives each worker its own GPU; the twins share GPU 0
        assert (rows[a].device == rows[b].device) == (placement == "one-gpu"), rows
        baseline = warm_up(c, a, b)
        x = c.submit(T.fill, 32 * MiB, 9, workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.describe, y, workers=[b], pure=False).result()["imported"]
        assert c.submit(T.all_equal, y, 9, workers=[b], pure=False).result()
        assert c.run(T.handoff_counters, workers=[b])[b]["zero_copy_bytes"] >= 32 * MiB
        del x, y
        back_to(c, baseline)


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
@pytest.mark.parametrize(
    "rmm_options",
    [{}, {"rmm_pool_size": "1GiB"}, {"rmm_async": True}, {"rmm_managed_memory": True}],
    ids=["no-rmm", "rmm-pool", "rmm-async", "rmm-managed"],
)
def test_dask_cuda_rmm_options_meet_the_plugin_at_its_defaults(rmm_options, placement):
    """Issue 18, dask-cuda's RMM combinations: LocalCUDACluster with each RMM option (a pool, the async allocator,
    managed memory, none), the plugin registered at its defaults, two workers on one GPU or one per GPU. dask-cuda's
    allocator stays; an 8 MiB plain CuPy array, made by whatever dask-cuda set up, reaches the
    other worker staged into the pool and handed over (staged-in-pool: managed memory cannot be exported, its bytes
    are copied on the GPU), with the right values and 0 bytes through the comm; no lease and no staged bytes left."""
    gpus(2 if placement == "two-gpus" else 1)
    pytest.importorskip("dask_cuda")
    if rmm_options:
        pytest.importorskip("rmm")
    import numpy as np
    from distributed import Client

    with dask_cuda_cluster(placement, **rmm_options) as cluster, Client(cluster) as c:
        c.register_plugin(GPUPool(kind="device", max_size="1 GiB"))
        a, b = worker_addresses(c)
        rows = {r.worker: r for r in dask_gpupool.pools(c)}
        assert (rows[a].device == rows[b].device) == (placement == "one-gpu"), rows
        before = c.run(T.handoff_counters)
        x = c.submit(T.plain_cupy, 1 << 20, workers=[a], pure=False)  # 8 MiB
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.describe, y, workers=[b], pure=False).result()["imported"]
        assert c.submit(T.total, y, workers=[b], pure=False).result() == float(np.arange(1 << 20).sum())
        now = c.run(T.handoff_counters)
        assert now[a]["fallbacks"].get("staged-in-pool", 0) - before[a]["fallbacks"].get("staged-in-pool", 0) == 1
        assert now[b]["zero_copy_bytes"] - before[b]["zero_copy_bytes"] == 8 * MiB, now[b]
        assert now[b]["copied_bytes"] == before[b]["copied_bytes"], now[b]
        del x, y
        wait_for(lambda: c.run(T.handoff_counters, workers=[a])[a]["leases"] == 0, what="the leases to end")
        assert c.run(T.handoff_counters, workers=[a])[a]["used"] == before[a]["used"]


def test_cupy_arrays_of_an_allocator_installed_before_the_plugin_are_staged_at_defaults():
    """dask-cuda's RMM set-up: CuPy given RMM's allocator before the plugin starts keeps it; at default
    settings an 8 MiB RMM-made CuPy array is copied into the pool on the GPU and handed over (staged-in-pool), as
    is a 128 KiB one (the stage threshold: 64 KiB over TCP), a 32 KiB one goes through the comm (fallback small);
    the right values either way."""
    gpus(1)
    pytest.importorskip("rmm")
    import numpy as np

    def rmm_for_cupy() -> str:
        import cupy
        from rmm.allocators.cupy import rmm_cupy_allocator

        cupy.cuda.set_allocator(rmm_cupy_allocator)
        return "ok"

    with nanny_cluster([ONE_GPU, ONE_GPU]) as c:
        assert set(c.run(rmm_for_cupy).values()) == {"ok"}
        c.register_plugin(GPUPool(kind="device", max_size="1 GiB"))
        a, b = worker_addresses(c)
        big = c.submit(T.plain_cupy, 1 << 20, workers=[a], pure=False)  # 8 MiB, made by RMM
        medium = c.submit(T.plain_cupy, 1 << 14, workers=[a], pure=False)  # 128 KiB
        small = c.submit(T.plain_cupy, 1 << 12, workers=[a], pure=False)  # 32 KiB
        got = c.submit(T.keep, big, workers=[b], pure=False)
        assert c.submit(T.describe, got, workers=[b], pure=False).result()["imported"]
        assert c.submit(T.total, got, workers=[b], pure=False).result() == float(np.arange(1 << 20).sum())
        assert c.submit(T.total, medium, workers=[b], pure=False).result() == float(np.arange(1 << 14).sum())
        assert c.submit(T.total, small, workers=[b], pure=False).result() == float(np.arange(1 << 12).sum())
        now = c.run(T.handoff_counters)
        assert now[a]["fallbacks"] == {"staged-in-pool": 2, "small": 1}, now[a]
        assert now[b]["zero_copy_bytes"] >= 8 * MiB + (128 << 10), now[b]
        del big, medium, small, got


def test_handoff_pinned_pools():
    gpus(1)
    with nanny_cluster([ONE_GPU, ONE_GPU], GPUPool(kind="pinned", max_size="1 GiB")) as c:
        _handoff_roundtrip(c, 8 * MiB)


def test_handoff_copies_across_host_ids_on_gpus():
    """Other hosts get copies: large ones pulled in 16 MiB chunks, small ones in the frames. The chunks land straight
    in GPU memory vkgdr maps into the host where vkgdr runs, else through pinned staging, then device to device: the
    same bytes either way, the last lane short."""
    import numpy as np

    gpus(1)
    hosts = [{**ONE_GPU, "config": {"gpupool": {"host-id": f"host-{i}"}}} for i in range(2)]
    with nanny_cluster(hosts, GPUPool(kind="device", max_size="1 GiB")) as c:
        a, b = worker_addresses(c)
        vkgdr = c.run(T.vkgdr_unavailable, workers=[b])[b] is None
        warm_up(c, a, b)
        # the first pull allocates the process's pinned staging, kept for the next ones
        first = c.submit(T.fill, 8 * MiB, 1, workers=[a], pure=False)
        c.submit(T.all_equal, first, 1, workers=[b], pure=False).result()
        keys = [first.key]
        del first
        wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="the warm-up pull's lease to end")
        wait_forgotten(c, keys)
        baseline = c.run(T.resources)
        before = counters(c)
        x = c.submit(T.fill, 32 * MiB + 3, 7, workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.describe, y, workers=[b], pure=False).result()["in_own_pool"]
        assert c.submit(T.all_equal, y, 7, workers=[b], pure=False).result()
        n = 5_000_001  # float64: two chunks and a short one
        arr = c.submit(T.make_array, n, "cupy", workers=[a], pure=False)
        assert c.submit(T.total, arr, workers=[b], pure=False).result() == float(np.arange(n).sum())
        small = c.submit(T.fill, MiB, 5, workers=[a], pure=False)
        assert c.submit(T.all_equal, small, 5, workers=[b], pure=False).result()
        now = counters(c)
        streamed = 32 * MiB + 3 + n * 8
        assert now[b]["streamed_bytes"] - before[b]["streamed_bytes"] == streamed
        assert now[b]["copied_bytes"] - before[b]["copied_bytes"] == streamed + MiB
        assert now[a]["streamed_out_bytes"] - before[a]["streamed_out_bytes"] == streamed
        # the chunks went through vkgdr's slots (kept for the next pull) where vkgdr runs, or none were made
        assert (c.run(T.vkgdr_kept_bytes, workers=[b])[b] > 0) == vkgdr
        del x, y, arr, small
        back_to(c, baseline)


def test_stress_producers_release_while_consumers_read_one_gpu():
    gpus(1)
    with nanny_cluster([ONE_GPU, ONE_GPU], GPUPool(kind="device", max_size="4 GiB")) as c:
        stress(c, 40, 16 * MiB)


# -- faults on GPU pools (issue 5) --------------------------------------------------------


def test_sigkill_of_the_consumer_releases_its_leases_on_a_device_pool():
    gpus(1)

    with nanny_cluster([ONE_GPU, ONE_GPU], GPUPool(kind="device", max_size="1 GiB")) as c:
        a, b = worker_addresses(c)
        xs = [c.submit(T.fill, 16 * MiB, 4, workers=[a], pure=False) for _ in range(8)]
        kill_consumer_holding_leases(c, a, b, xs)
        del xs
        wait_for(lambda: counters(c, a)[a]["used"] == 0, what="A's pool bytes to return")


def successors(workers: list[str], dead: str, kept: str) -> list[str]:
    """The worker that replaced ``dead`` beside ``kept``, as a one-item list, from one snapshot of the workers; empty
    until the cluster is two workers again without ``dead``."""
    if len(workers) != 2 or dead in workers or kept not in workers:
        return []
    return [w for w in workers if w != kept]


def own_baseline(c: Any, b: str) -> dict[str, Any]:
    """B's resources before it maps anything of a peer's, taken once B checked a buffer of its own (so CuPy is
    loaded): what B should hold again once its producer is gone and B let go of what it mapped."""
    own = c.submit(T.fill, MiB, 1, workers=[b], pure=False)
    assert c.submit(T.all_equal, own, 1, workers=[b], pure=False).result()
    del own
    wait_for(lambda: counters(c, b)[b]["used"] == 0, what="B's own buffer to go")
    return c.run(T.resources, workers=[b])


@pytest.mark.parametrize("layout", ["one-gpu", "two-gpus"])
@pytest.mark.parametrize("memory", ["auto", "legacy"])
def test_sigkill_of_the_producer_leaves_the_consumers_device_mapping_readable(memory, layout):
    """A's process dies while B holds an import: B still reads A's bytes, even once A's GPU memory is reused.

    Across GPUs this needs VMM segments (the default) or legacy IPC ones (``segment-memory: legacy``): pool memory
    read from another GPU after its owner died gave CUDA_ERROR_CONTAINED (benchmarks/exporter_death.py, the chaos
    run on two H200s); legacy IPC memory did not (scripts/probes/handle_types.py on two H200s).
    """
    workers = layout_workers(layout)
    with nanny_cluster(workers, GPUPool(kind="device", max_size="1 GiB", segment_memory=memory)) as c:
        a, b = worker_addresses(c)
        base_b = own_baseline(c, b)
        x = c.submit(T.fill, 16 * MiB, 6, workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.describe, y, workers=[b], pure=False).result()["imported"]
        os.kill(pid_of(c, a), signal.SIGKILL)
        # the dead exporter's memory stays mapped and right until B lets go
        assert c.submit(T.all_equal, y, 6, workers=[b], pure=False).result()
        # one snapshot per look: two calls could see [a, b] and then [b] (A removed, its successor not yet there)
        wait_for(lambda: successors(worker_addresses(c), a, b), what="A's restart")
        (a2,) = successors(worker_addresses(c), a, b)
        # A's successor fills most of the GPU A used: the memory under B's import is not handed out again
        c.submit(T.scribble_all, 768 * MiB, 0x55, workers=[a2], pure=False).result()
        assert c.submit(T.all_equal, y, 6, workers=[b], pure=False).result()
        del x, y
        back_to(c, base_b, workers=[b])


#: Segment memory of the large-buffer tests: VMM (the default over TCP), and legacy IPC memory.
LARGE_MEMORY = {"vmm": {}, "legacy": {"segment_memory": "legacy"}}


@pytest.mark.timeout(300)  # its own waits run to 120 s: let them say what differs
@pytest.mark.parametrize("memory", list(LARGE_MEMORY))
@pytest.mark.parametrize("gib", [8, 16])
@pytest.mark.parametrize("layout", ["one-gpu", "two-gpus"])
def test_buffers_of_8_and_16_gib_hand_over_zero_copy(layout, gib, memory):
    """Issue 19, any size: with VMM segments (or legacy IPC ones) an 8 or 16 GiB pool buffer
    reaches the consumer on the same GPU or the other one mapped, not copied, with the right bytes at its start,
    middle and end and everywhere (all_equal), and everything back to the baseline once it is dropped. Workers
    without a host memory limit: Dask counts a device value's bytes as managed memory and would spill a 16 GiB
    result through the host."""
    nbytes = gib << 30
    workers = [{**w, "memory_limit": 0} for w in layout_workers(layout)]
    plugin = GPUPool(kind="device", max_size=f"{2 * gib + 2} GiB", **LARGE_MEMORY[memory])
    with nanny_cluster(workers, plugin) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        before = counters(c)
        x = c.submit(T.fill, nbytes, 7, workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.describe, y, workers=[b], pure=False).result()["imported"]
        assert c.submit(T.all_equal, y, 7, workers=[b], pure=False).result()
        now = counters(c)
        assert now[b]["zero_copy_bytes"] - before[b]["zero_copy_bytes"] == nbytes, now[b]
        assert now[b]["copied_bytes"] == before[b]["copied_bytes"] and now[a]["fallbacks"] == before[a]["fallbacks"]
        del x, y
        back_to(c, baseline, timeout=120)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("memory", list(LARGE_MEMORY))
@pytest.mark.parametrize("killed", ["producer", "consumer"])
@pytest.mark.parametrize("layout", ["one-gpu", "two-gpus"])
def test_sigkill_with_an_8_gib_mapping_held(layout, killed, memory):
    """Issue 19, faults at any size: B maps an 8 GiB buffer of A's (VMM segments, or legacy IPC ones). A SIGKILLed:
    B still reads every byte right. B SIGKILLed: A ends its lease and its pool is back to 0 bytes used."""
    nbytes = 8 << 30
    workers = [{**w, "memory_limit": 0} for w in layout_workers(layout)]
    plugin = GPUPool(kind="device", max_size="18 GiB", **LARGE_MEMORY[memory])
    with nanny_cluster(workers, plugin) as c:
        a, b = worker_addresses(c)
        base_b = own_baseline(c, b)
        x = c.submit(T.fill, nbytes, 9, workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.describe, y, workers=[b], pure=False).result()["imported"]
        if killed == "consumer":
            assert counters(c, a)[a]["leases"] == 1
            os.kill(pid_of(c, b), signal.SIGKILL)
            del y  # not computed again on B's successor
            wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="A to end the dead consumer's lease")
            del x
            wait_for(lambda: counters(c, a)[a]["used"] == 0, timeout=120, what="A's pool bytes to return")
            return
        os.kill(pid_of(c, a), signal.SIGKILL)
        assert c.submit(T.all_equal, y, 9, workers=[b], pure=False).result()
        del x, y
        back_to(c, base_b, timeout=120, workers=[b])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["one-gpu", "two-gpus"])
def test_a_full_pool_reclaims_a_large_spare_that_the_consumer_still_maps(layout):
    """A 1.25 GiB buffer (a segment of its own: segments are 1 GiB) is handed over and dropped: its spare stays
    mapped by the consumer. A 1.875 GiB allocation in A's 3 GiB pool then does not fit beside it (and the warm-up's
    1 GiB segment), so A reclaims the spare (its row's ``reclaim``), B unmaps it and releases it (one more segment
    released), A frees it, and the allocation succeeds with the right bytes, with no trim()."""
    workers = [{**w, "memory_limit": 0} for w in layout_workers(layout)]
    plugin = GPUPool(kind="device", max_size="3 GiB")
    with nanny_cluster(workers, plugin) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        x = c.submit(T.fill, 5 << 28, 3, workers=[a], pure=False)  # 1.25 GiB
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.describe, y, workers=[b], pure=False).result()["imported"]
        assert c.submit(T.all_equal, y, 3, workers=[b], pure=False).result()
        del x, y
        wait_for(lambda: counters(c, a)[a]["leases"] == 0 and counters(c, a)[a]["used"] == 0, what="the lease to end")
        released = counters(c, b)[b]["segments_released"]
        big = c.submit(T.fill, 15 << 27, 4, workers=[a], pure=False)  # 1.875 GiB
        assert c.submit(T.all_equal, big, 4, workers=[a], pure=False).result()
        assert counters(c, b)[b]["segments_released"] == released + 1  # B gave the 1.25 GiB spare back
        assert c.submit(T.all_equal, c.submit(T.keep, big, workers=[b], pure=False), 4, workers=[b]).result()
        del big
        back_to(c, baseline, timeout=120)


# -- leases through stalls (issue 15, cases 1 and 2) on device pools ----------------------------


def layout_workers(layout: str) -> list[dict]:
    """Two workers on one GPU, or one on each of two (skips when the GPUs are missing)."""
    gpus(2 if layout == "two-gpus" else 1)
    return ROTATED if layout == "two-gpus" else [ONE_GPU, ONE_GPU]


@pytest.mark.parametrize("ordering", ["sync", "device"])
@pytest.mark.parametrize("layout", ["one-gpu", "two-gpus"])
def test_a_consumer_never_reads_before_the_producers_kernel_wrote(layout, ordering):
    """Issue 19, stream order: the producer's task queues a kernel that spins 300 ms and then fills a 16 MiB pool
    buffer, and returns without waiting for it. The consumer on the same GPU or the other one reads every byte
    right: with gpupool.handoff-ordering ``sync`` because the exporter waited for the event recorded when Dask
    stored the task's result (step ``export-task-wait``), with ``device`` because it synchronized its GPU."""
    plugin = GPUPool(kind="device", max_size="1 GiB", handoff_ordering=ordering)
    with nanny_cluster(layout_workers(layout), plugin) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        for i in range(3):
            x = c.submit(T.slow_fill, 16 * MiB, 11 + i, 300, workers=[a], pure=False)
            y = c.submit(T.keep, x, workers=[b], pure=False)
            assert c.submit(T.all_equal, y, 11 + i, workers=[b], pure=False).result(), (ordering, i)
            del x, y
        timings = counters(c, a)[a]["timings"]
        waits = timings.get("export-task-wait", {}).get("count", 0)
        assert waits >= 3 if ordering == "sync" else waits == 0, timings
        back_to(c, baseline)


@pytest.mark.parametrize("value", ["buffer", "array"])
@pytest.mark.parametrize("ordering", ["sync", "device"])
def test_a_sync_export_waits_for_its_tasks_event_not_for_another_streams_kernel(ordering, value):
    """Issue 19, stream order without stalling the producer, at the default ordering: a task's 16 MiB pool result
    (a pool Buffer, or a CuPy array over one) is stored, then a later task leaves a 3 s kernel running on a
    non-blocking stream of the producer. With gpupool.handoff-ordering ``sync`` the export waits for the result's
    own event only (step ``export-task-wait``) and the consumer reads the right values while the kernel still
    runs; with ``device`` the export synchronizes the whole GPU and so waits for the kernel. Two workers on one
    GPU."""
    import numpy as np
    from distributed import wait

    gpus(1)
    plugin = GPUPool(kind="device", max_size="1 GiB", handoff_ordering=ordering)
    with nanny_cluster([ONE_GPU, ONE_GPU], plugin) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        if value == "buffer":
            x = c.submit(T.fill, 16 * MiB, 5, workers=[a], pure=False)
        else:
            x = c.submit(T.make_array, 2 << 20, "cupy", workers=[a], pure=False)
        wait(x)
        busy = c.submit(T.spin, 3000, "nonblocking", workers=[a], pure=False)
        wait(busy)  # its kernel queued on a non-blocking stream, still running
        if value == "buffer":
            assert c.submit(T.all_equal, x, 5, workers=[b], pure=False).result()
        else:
            assert c.submit(T.total, x, workers=[b], pure=False).result() == float(np.arange(2 << 20).sum())
        timings = counters(c, a)[a]["timings"]
        if ordering == "sync":
            assert timings["export-task-wait"]["count"] >= 1, timings
            assert timings["export"]["max_s"] < 1.0, timings  # the 3 s kernel was not waited for
        else:
            assert "export-task-wait" not in timings, timings
            assert timings["export"]["max_s"] > 1.0, timings  # the whole GPU, the 3 s kernel with it
        del x, busy
        back_to(c, baseline)


@pytest.mark.parametrize("layout", ["one-gpu", "two-gpus"])
def test_a_stalled_consumer_reads_the_original_device_bytes(layout):
    from conftest import stalled_consumer

    plugin = GPUPool(kind="device", max_size="1 GiB", lease_timeout="1s")
    with nanny_cluster(layout_workers(layout), plugin) as c:
        # a stalled consumer across GPUs must not kill its CUDA context either: it reads after resuming
        stalled_consumer(c, 8 * MiB)


@pytest.mark.parametrize("layout", ["one-gpu", "two-gpus"])
def test_a_stalled_producer_keeps_the_device_leases_its_consumer_holds(layout):
    from conftest import stalled_producer

    plugin = GPUPool(kind="device", max_size="1 GiB", broker_timeout="1s")
    with nanny_cluster(layout_workers(layout), plugin) as c:
        stalled_producer(c, 8 * MiB)


# -- UCX comms (issue 16) ------------------------------------------------------------------


def test_the_serializer_family_a_ucx_comm_gets_for_pool_memory():
    """Issue 16: with a UCX comm's serializer list, pool arrays and pool Buffers go as device frames ("cuda"),
    never through our host copy."""
    gpus(1)
    with nanny_cluster([ONE_GPU], GPUPool(kind="device", max_size="1 GiB")) as c:
        (a,) = worker_addresses(c)
        got = c.submit(T.serializer_families, MiB, workers=[a], pure=False).result()
        print("serializer families with a UCX comm's list:", got)
        assert got == {"pool array": "cuda", "pool buffer": "cuda"}, got


#: distributed-ucxx's settings for the UCX tests (the project's anchor figures used the same).
UCX_CONFIG = {f"distributed.comm.ucx.{k}": True for k in ("create-cuda-context", "nvlink", "tcp", "cuda-copy")}


def ucx_workers(placement: str, hosts: str) -> list[dict[str, Any]]:
    """Two UCXX workers, both on GPU 0 (``one-gpu``) or one per GPU (``two-gpus``), of one host (``same``) or
    looking like two (``two``: a ``gpupool.host-id`` each)."""
    layout = ROTATED if placement == "two-gpus" else [ONE_GPU, ONE_GPU]
    two = hosts == "two"
    return [
        {**w, "protocol": "ucxx", **({"config": {"gpupool": {"host-id": f"host-{i}"}}} if two else {})}
        for i, w in enumerate(layout)
    ]


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
def test_on_ucxx_pool_memory_hands_over_or_travels_as_device_frames(placement):
    """Issue 16 on UCXX clusters, on one GPU and across two: values reach the consumer with the right bytes and
    never as a host copy. Same host: pool memory of every size goes zero-copy (descriptors in UCX's frames). Workers
    that look like two hosts (host-id): all pool memory goes as device frames staged into memory UCX can send GPU to
    GPU. A plain CuPy array goes as distributed's own device frames, which UCX copies GPU to GPU (to a same-host
    peer: fallback not-in-pool; nothing is staged into the pool over UCX). All of it counted."""
    gpus(2 if placement == "two-gpus" else 1)
    pytest.importorskip("distributed_ucxx")
    import dask
    import numpy as np

    total = float(np.arange(1 << 20).sum())
    for hosts in ("same", "two"):
        workers = ucx_workers(placement, hosts)
        plugin = GPUPool(
            kind="device",
            max_size="1 GiB",
            segment_memory="vmm",  # the staging copy (auto over UCX makes legacy segments, which UCX sends unstaged)
        )
        with dask.config.set(UCX_CONFIG), nanny_cluster(workers, plugin, protocol="ucxx") as c:
            a, b = worker_addresses(c)
            assert a.startswith("ucxx://")
            x = c.submit(T.make_buffer, MiB, b"over ucx", workers=[a], pure=False)
            assert c.submit(T.head, x, 8, workers=[b], pure=False).result() == b"over ucx"
            arr = c.submit(T.make_array, 1 << 20, "cupy", workers=[a], pure=False)
            assert c.submit(T.total, arr, workers=[b], pure=False).result() == total
            strided = c.submit(T.every_other, arr, workers=[a], pure=False)  # a non-contiguous view of pool memory
            assert c.submit(T.total, strided, workers=[b], pure=False).result() == float(np.arange(0, 1 << 20, 2).sum())
            plain = c.submit(T.plain_cupy, 1 << 20, workers=[a], pure=False)
            assert c.submit(T.total, plain, workers=[b], pure=False).result() == total
            got = c.run(T.handoff_counters)
            print(placement, hosts, "hosts:", {w: {k: v for k, v in got[w].items() if v} for w in (a, b)})
            assert got[a]["copied_out_bytes"] == 0 and got[b]["copied_bytes"] == 0, got  # never a host copy
            pool_bytes = MiB + 8 * MiB + 4 * MiB  # the Buffer, the array, its strided view
            if hosts == "same":
                assert got[b]["zero_copy_bytes"] >= MiB + 8 * MiB, got  # the Buffer, the array and its view
                assert got[a]["device_staged_bytes"] == 0, got
                # the plain array: distributed's device frames, which UCX copies into the consumer's memory
                assert got[a]["device_frames_out_bytes"] == 8 * MiB == got[b]["device_frames_bytes"], got
                assert got[a]["pool_staged_bytes"] == 0, got
            else:
                assert got[b]["zero_copy_bytes"] == 0, got
                assert got[a]["device_staged_bytes"] == pool_bytes, got
                assert got[a]["device_frames_out_bytes"] == pool_bytes + 8 * MiB == got[b]["device_frames_bytes"]
                assert dask_gpupool.trim(c)[a]["ucx_staging_freed"] > 0  # the staging kept for reuse goes back
            # the plain CuPy array is a same-host copy on the GPUs, counted with its reason; to another host not
            assert got[a]["fallbacks"] == ({"not-in-pool": 1} if hosts == "same" else {}), got
            del x, arr, strided, plain
            wait_for(lambda c=c, a=a: counters(c, a)[a]["leases"] == 0, what="the leases to end")


@pytest.mark.parametrize("memory", ["auto", "legacy"])
@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
def test_on_ucxx_legacy_ipc_segments_go_to_another_host_without_the_staging_copy(placement, memory):
    """Issue 19, UCX clusters: ``gpupool.segment-memory: auto`` on workers that listen over UCX makes segments of
    legacy IPC memory, as ``legacy`` does, and says so in ``stats()``. Pool memory sent to a worker of another
    "host" goes to UCX as it is, which exports ``cuMemAlloc`` memory itself (``cuda_ipc``), not through a staging
    copy: a 1 MiB Buffer, an 8 MiB array and a strided view of it (distributed's serializer copies the view, as for
    any non-contiguous array) arrive with the right bytes, nothing staged, nothing through the host. To a worker
    of the same "host" they are handed over zero-copy. No lease left."""
    gpus(2 if placement == "two-gpus" else 1)
    pytest.importorskip("distributed_ucxx")
    import dask
    import numpy as np

    total = float(np.arange(1 << 20).sum())
    for hosts in ("same", "two"):
        workers = ucx_workers(placement, hosts)
        plugin = GPUPool(kind="device", max_size="1 GiB", segment_memory=memory)
        with dask.config.set(UCX_CONFIG), nanny_cluster(workers, plugin, protocol="ucxx") as c:
            a, b = worker_addresses(c)
            assert c.run(T.segment_memory, workers=[a])[a]["pool"] == "legacy"
            why = dask_gpupool.stats(c)[a]["routing"]["segment-memory"]
            assert why.startswith("legacy (auto): this worker listens over UCX" if memory == "auto" else "legacy ("), (
                why
            )
            for _ in range(2):  # the second time UCX's cache of the opened handle is used
                x = c.submit(T.make_buffer, MiB, b"legacy!!", workers=[a], pure=False)
                assert c.submit(T.head, x, 8, workers=[b], pure=False).result() == b"legacy!!"
                arr = c.submit(T.make_array, 1 << 20, "cupy", workers=[a], pure=False)
                assert c.submit(T.total, arr, workers=[b], pure=False).result() == total
                strided = c.submit(T.every_other, arr, workers=[a], pure=False)
                want = float(np.arange(0, 1 << 20, 2).sum())
                assert c.submit(T.total, strided, workers=[b], pure=False).result() == want
                del x, arr, strided
            got = c.run(T.handoff_counters)
            print(placement, hosts, "hosts:", {w: {k: v for k, v in got[w].items() if v} for w in (a, b)})
            assert got[a]["copied_out_bytes"] == 0 and got[b]["copied_bytes"] == 0, got  # never a host copy
            assert got[a]["device_staged_bytes"] == 0 and got[a]["host_frames_out_bytes"] == 0, got
            if hosts == "same":
                assert got[b]["zero_copy_bytes"] >= 2 * (MiB + 8 * MiB), got
            else:
                assert got[b]["zero_copy_bytes"] == 0, got
                sent = 2 * (MiB + 8 * MiB + 4 * MiB)
                assert got[a]["device_frames_out_bytes"] == sent == got[b]["device_frames_bytes"], got
            wait_for(lambda c=c, a=a: counters(c, a)[a]["leases"] == 0, what="the leases to end")


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
def test_on_ucxx_replies_of_device_pool_memory_skip_the_offload_thread(placement):
    """Over UCX a reply over Dask's 10 MiB offload size of device values, pool memory (to a worker of the same
    "host" a descriptor, to another staged device frames, the copy left to distributed-ucxx's synchronize) or plain
    CuPy arrays (distributed's device frames), is serialized on the event loop; one with a host value, or with more
    than ``INLINE_MAX_VALUES`` values, stays in Dask's thread. The bytes arrive right either way."""
    gpus(2 if placement == "two-gpus" else 1)
    pytest.importorskip("distributed_ucxx")
    import dask
    import numpy as np
    from distributed import wait

    ucx = {f"distributed.comm.ucx.{k}": True for k in ("create-cuda-context", "nvlink", "tcp", "cuda-copy")}
    layout = ROTATED if placement == "two-gpus" else [ONE_GPU, ONE_GPU]
    for hosts in ("same", "other"):
        workers = [
            {**w, "protocol": "ucxx", "config": {"gpupool": {"host-id": "h" if hosts == "same" else f"h{i}"}}}
            for i, w in enumerate(layout)
        ]
        plugin = GPUPool(kind="device", max_size="1 GiB", segment_memory="vmm")  # staged
        with dask.config.set(ucx), nanny_cluster(workers, plugin, protocol="ucxx") as c:
            a, b = worker_addresses(c)
            n = 12 << 17  # 12 MiB of float64
            arr = c.submit(T.make_array, n, "cupy", workers=[a], pure=False)
            plain = c.submit(T.plain_cupy, n, workers=[a], pure=False)
            host = c.submit(np.ones, n, workers=[a], pure=False)
            many = [c.submit(T.plain_cupy, 1 << 18, workers=[a], pure=False) for _ in range(9)]  # 9 x 2 MiB
            wait([arr, plain, host, *many])  # not gathered: the client is another "host", which would stage the array

            def inline(keys: list[str], c: Any = c, a: str = a, b: str = b) -> bool:
                return c.run(T.serialized_inline, keys, b, scheme="ucxx", workers=[a])[a]

            assert inline([arr.key]) and inline([plain.key]) and inline([arr.key, plain.key]), hosts
            assert not inline([arr.key, host.key]), hosts  # a host value is pickled: Dask's thread
            assert not inline([m.key for m in many]) and inline([m.key for m in many[:6]]), hosts
            total = float(np.arange(n).sum())
            for _ in range(3):  # kept staging memory reused, the copy never waited for here
                assert c.submit(T.total, arr, workers=[b], pure=False).result() == total
                arr = c.submit(T.make_array, n, "cupy", workers=[a], pure=False)
            got = c.run(T.handoff_counters)
            assert got[a]["copied_out_bytes"] == 0 and got[b]["copied_bytes"] == 0, got
            assert (got[b]["zero_copy_bytes"] > 0) == (hosts == "same"), got
            assert (got[a]["device_staged_bytes"] > 0) == (hosts == "other"), got
            plain_total = c.submit(T.total, plain, workers=[b], pure=False).result()
            assert plain_total == total
            del arr, plain, host, many
            wait_for(lambda c=c, a=a: counters(c, a)[a]["leases"] == 0, what="the leases to end")


def test_a_staged_cupy_header_matches_distributeds_and_deserializes():
    """The header a staged CuPy array goes with over UCX is what distributed's own serializer writes for a C-ordered
    copy (shape, typestr, strides), and distributed's deserializer rebuilds the array from it and the frame."""
    gpus(1)
    import cupy
    from distributed.protocol.cupy import cuda_deserialize_cupy_ndarray, cuda_serialize_cupy_ndarray

    from dask_gpupool.dask.cuda_family import staged_cupy_header

    for x in (
        cupy.arange(12, dtype="f8").reshape(3, 4),
        cupy.arange(30, dtype="i2").reshape(5, 6)[:, ::2],  # staged as a C-ordered copy
        cupy.asarray(7.0, dtype="f4"),
        cupy.empty((0, 5), dtype="f8"),
    ):
        c_ordered = x.copy(order="C")  # (not ascontiguousarray, which makes a 0-d array 1-d)
        theirs, frames = cuda_serialize_cupy_ndarray(c_ordered)
        ours = staged_cupy_header(tuple(x.shape), x.dtype, int(c_ordered.data.ptr))
        assert tuple(ours["shape"]) == tuple(theirs["shape"]) and ours["typestr"] == theirs["typestr"]
        if x.size:  # an empty array's strides are any
            assert tuple(ours["strides"]) == tuple(theirs["strides"]), (ours, theirs)
        back = cuda_deserialize_cupy_ndarray(ours, frames)
        assert back.shape == x.shape and bool((back == x).all())


def test_a_staging_copy_left_to_the_comm_keeps_its_source_alive_and_lands_right():
    """``UcxStaging.copy_of(..., wait=False)`` (a UCX reply over distributed-ucxx, which synchronizes the GPU before it
    sends): the copy is enqueued on the legacy default stream behind the kernel that wrote the source, the staging
    memory keeps the source alive (dropping every other reference frees nothing under the copy), and after a
    synchronize, what the comm does, it holds the source's bytes. With ``wait`` the source is not kept."""
    gpus(1)
    import cupy

    from dask_gpupool.memory.ucx_staging import UcxStaging

    nbytes = 64 << 20
    with cupy.cuda.Device(0), cupy.cuda.Stream.null:
        src = cupy.arange(nbytes // 8, dtype="float64")
        src *= 3  # still running, maybe, when the copy is enqueued
        ptr = int(src.data.ptr)
        staged = UcxStaging.copy_of(ptr, nbytes, 0, source=src, wait=False)
        assert staged.source is src
        del src  # the staging memory keeps it: the pool may not reuse it under the copy
        cupy.cuda.runtime.deviceSynchronize()
        mem = cupy.cuda.UnownedMemory(staged.ptr, nbytes, staged, device_id=0)
        got = cupy.ndarray((nbytes // 8,), "float64", cupy.cuda.MemoryPointer(mem, 0))
        assert bool((got == cupy.arange(nbytes // 8, dtype="float64") * 3).all())
        waited = UcxStaging.copy_of(int(got.data.ptr), nbytes, 0)
        assert waited.source is None


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
def test_on_ucxx_pool_memory_below_the_staging_threshold_goes_to_ucx_unstaged(placement):
    """tuning.UCX_STAGING_THRESHOLD (8 KiB): a 4 KiB pool array and a strided view of it, gathered by the client
    (which reads no host frames, so they go as device frames), go as device frames of the pool memory itself (no
    staging copy), with the right values; a 2 MiB pool array to a worker of another "host" is staged. None is a
    host copy of ours."""
    gpus(2 if placement == "two-gpus" else 1)
    pytest.importorskip("distributed_ucxx")
    import dask
    import numpy as np

    ucx = {f"distributed.comm.ucx.{k}": True for k in ("create-cuda-context", "nvlink", "tcp", "cuda-copy")}
    layout = ROTATED if placement == "two-gpus" else [ONE_GPU, ONE_GPU]
    workers = [{**w, "protocol": "ucxx", "config": {"gpupool": {"host-id": f"host-{i}"}}} for i, w in enumerate(layout)]
    # VMM segments: staged from the threshold up (auto over UCX makes legacy segments, which UCX sends unstaged)
    plugin = GPUPool(kind="device", max_size="1 GiB", segment_memory="vmm")
    with dask.config.set(ucx), nanny_cluster(workers, plugin, protocol="ucxx") as c:
        a, b = worker_addresses(c)
        arr = c.submit(T.make_array, 512, "cupy", workers=[a], pure=False)  # 4 KiB of float64
        strided = c.submit(T.every_other, arr, workers=[a], pure=False)
        assert float(arr.result().sum()) == float(np.arange(512).sum())
        assert float(strided.result().sum()) == float(np.arange(0, 512, 2).sum())
        got = c.run(T.handoff_counters)
        assert got[a]["device_staged_bytes"] == 0, got
        assert got[a]["device_frames_out_bytes"] == 4096 + 2048, got
        big = c.submit(T.make_array, 1 << 18, "cupy", workers=[a], pure=False)  # 2 MiB: staged
        assert c.submit(T.total, big, workers=[b], pure=False).result() == float(np.arange(1 << 18).sum())
        got = c.run(T.handoff_counters)
        print(placement, {w: {k: v for k, v in got[w].items() if v} for w in (a, b)})
        assert got[a]["device_staged_bytes"] == 2 * MiB, got
        assert got[a]["device_frames_out_bytes"] == 4096 + 2048 + 2 * MiB, got
        assert got[b]["device_frames_bytes"] == 2 * MiB, got
        assert got[a]["copied_out_bytes"] == 0 and got[b]["copied_bytes"] == 0, got
        del arr, strided, big
        wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="the leases to end")


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
def test_on_ucxx_cupy_arrays_below_the_host_frame_threshold_go_as_one_host_frame(placement):
    """tuning.UCX_HOST_FRAME_THRESHOLD (8 KiB): to a worker of another "host", a 4 KiB pool array, a strided 2 KiB
    view of it, a 4 KiB plain CuPy array, a 0-d and an empty one, and a 4 KiB pool Buffer (which lands in the
    receiver's pool) go as one host frame each and arrive with the right values; to the client, device frames; an
    8 KiB pool array goes as a staged device frame as before. Host frames are counted on both sides and not as host
    copies; no lease left."""
    gpus(2 if placement == "two-gpus" else 1)
    pytest.importorskip("distributed_ucxx")
    import dask
    import numpy as np

    ucx = {f"distributed.comm.ucx.{k}": True for k in ("create-cuda-context", "nvlink", "tcp", "cuda-copy")}
    layout = ROTATED if placement == "two-gpus" else [ONE_GPU, ONE_GPU]
    workers = [{**w, "protocol": "ucxx", "config": {"gpupool": {"host-id": f"host-{i}"}}} for i, w in enumerate(layout)]
    plugin = GPUPool(kind="device", max_size="1 GiB", segment_memory="vmm")  # 8 KiB: staged
    with dask.config.set(ucx), nanny_cluster(workers, plugin, protocol="ucxx") as c:
        a, b = worker_addresses(c)
        arr = c.submit(T.make_array, 512, "cupy", workers=[a], pure=False)  # 4 KiB of float64, pool memory
        assert c.submit(T.total, arr, workers=[b], pure=False).result() == float(np.arange(512).sum())
        strided = c.submit(T.every_other, arr, workers=[a], pure=False)
        assert c.submit(T.total, strided, workers=[b], pure=False).result() == float(np.arange(0, 512, 2).sum())
        plain = c.submit(T.plain_cupy, 512, workers=[a], pure=False)
        assert c.submit(T.total, plain, workers=[b], pure=False).result() == float(np.arange(512).sum())
        for shape in [(), (0, 3), (4, 8)]:
            v = c.submit(T.plain_cupy_shaped, shape, workers=[a], pure=False)
            got = c.submit(T.keep, v, workers=[b], pure=False).result()
            assert got.shape == shape and np.array_equal(got.get(), np.arange(int(np.prod(shape))).reshape(shape))
            del v
        buf = c.submit(T.make_buffer, 4096, b"host frame", workers=[a], pure=False)
        assert c.submit(T.head, buf, 10, workers=[b], pure=False).result() == b"host frame"
        big = c.submit(T.make_array, 1024, "cupy", workers=[a], pure=False)  # 8 KiB: staged device frames
        assert c.submit(T.total, big, workers=[b], pure=False).result() == float(np.arange(1024).sum())
        got = c.run(T.handoff_counters)
        print(placement, {w: {k: v for k, v in got[w].items() if v} for w in (a, b)})
        host_frames = 4096 + 2048 + 4096 + 8 + 0 + 256 + 4096
        assert got[a]["host_frames_out_bytes"] == host_frames == got[b]["host_frames_bytes"], got
        assert got[a]["device_frames_out_bytes"] == 8192 == got[b]["device_frames_bytes"], got
        assert got[a]["device_staged_bytes"] == 8192, got
        assert got[a]["copied_out_bytes"] == 0 and got[b]["copied_bytes"] == 0, got
        del arr, strided, plain, buf, big
        wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="the leases to end")


def _receive_device_array(dask_worker: Any) -> str:
    """client.run target: what distributed-ucxx receives device frames with on this worker (a ReceivePool or its
    own)."""
    import distributed_ucxx.ucxx as comm

    return type(getattr(comm.device_array, "__self__", None)).__name__


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
def test_on_ucxx_device_frames_are_received_into_the_receive_pool(placement):
    """On workers whose RMM resource is RMM's default, distributed-ucxx receives the device frames of another "host"
    into an RMM pool of at most 1 GiB, not a cudaMalloc each: a 1 MiB pool array (staged) and a 1 MiB plain CuPy
    array arrive with the right values, counted in receive_pooled_bytes. A 1 GiB + 1 MiB plain array is over the
    ceiling: a miss, received from RMM's resource as before, with the right values. Removing the plugin puts
    distributed-ucxx's own back; no lease left."""
    gpus(2 if placement == "two-gpus" else 1)
    pytest.importorskip("distributed_ucxx")
    pytest.importorskip("rmm")
    import dask
    import numpy as np

    def arange_total(n: int) -> float:
        return float(np.arange(n).sum())

    plugin = GPUPool(kind="device", max_size="1 GiB")
    with dask.config.set(UCX_CONFIG), nanny_cluster(ucx_workers(placement, "two"), plugin, protocol="ucxx") as c:
        a, b = worker_addresses(c)
        why = dask_gpupool.stats(c)[b]["routing"]["ucx-receive"]
        assert why == "on: device frames received into an RMM pool of at most 1.00 GiB", why
        assert c.run(_receive_device_array, workers=[b])[b] == "ReceivePool"
        n = MiB // 8
        held = [
            c.submit(T.make_array, n, "cupy", workers=[a], pure=False),
            c.submit(T.plain_cupy, n, workers=[a], pure=False),
        ]
        for x in held:
            assert c.submit(T.total, x, workers=[b], pure=False).result() == arange_total(n)
        got = c.run(T.handoff_counters)
        assert got[b]["receive_pooled_bytes"] == 2 * MiB and got[b]["receive_pool_misses"] == 0, got[b]
        assert got[b]["device_frames_bytes"] == 2 * MiB and got[b]["copied_bytes"] == 0, got[b]
        over = (1 << 30) + MiB
        y = c.submit(T.plain_fill, over, 7, workers=[a], pure=False)  # over the ceiling
        assert c.submit(T.array_equal, y, 7, workers=[b], pure=False).result()
        del y
        got = c.run(T.handoff_counters)
        assert got[b]["receive_pooled_bytes"] == 2 * MiB and got[b]["receive_pool_misses"] == 1, got[b]
        assert got[b]["device_frames_bytes"] == 2 * MiB + over and got[b]["copied_bytes"] == 0, got[b]
        del held, x
        wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="the leases to end")
        c.unregister_worker_plugin("gpupool")
        assert c.run(_receive_device_array, workers=[b])[b] == "NoneType"  # distributed-ucxx's own function


def test_on_ucxx_the_receive_pool_stands_aside_beside_an_rmm_pool_set_before_it():
    """The UCX receive pool beside distributed.rmm.pool-size (distributed-ucxx makes RMM's resource a pool
    before any plugin runs, as dask-cuda's rmm_pool_size does): the plugin leaves it to serve the frames, says why,
    and counts nothing; a plain CuPy array from another "host" arrives with the right values."""
    gpus(1)
    pytest.importorskip("distributed_ucxx")
    pytest.importorskip("rmm")
    import dask
    import numpy as np

    plugin = GPUPool(kind="device", max_size="1 GiB")
    config = {**UCX_CONFIG, "distributed.rmm.pool-size": "256 MiB"}
    with dask.config.set(config), nanny_cluster(ucx_workers("one-gpu", "two"), plugin, protocol="ucxx") as c:
        a, b = worker_addresses(c)
        why = dask_gpupool.stats(c)[b]["routing"]["ucx-receive"]
        assert why.startswith("off: RMM's resource PoolMemoryResource was set before the plugin"), why
        assert c.run(_receive_device_array, workers=[b])[b] == "NoneType"
        x = c.submit(T.plain_cupy, MiB // 8, workers=[a], pure=False)
        assert c.submit(T.total, x, workers=[b], pure=False).result() == float(np.arange(MiB // 8).sum())
        got = c.run(T.handoff_counters)
        assert got[b]["receive_pooled_bytes"] == 0 and got[b]["receive_pool_misses"] == 0, got[b]
        assert got[b]["device_frames_bytes"] == MiB, got[b]


def _hold_device_frame_receives(waiting: str, release: str, nbytes: int, dask_worker: Any) -> None:
    """client.run target: the next device frame of at least ``nbytes`` this worker's distributed-ucxx receives waits,
    before its receive is posted, until the file ``release`` exists (at most 120 s), after creating the file
    ``waiting``; once. The worker's event loop waits with it, so the sender's send of that frame waits too."""
    import time

    import distributed_ucxx.ucxx as comm

    inner = comm.device_array

    def device_array(n: int) -> Any:
        if n >= nbytes and comm.device_array is device_array:
            comm.device_array = inner  # once
            open(waiting, "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(release) and time.monotonic() < deadline:
                time.sleep(0.05)
        return inner(n)

    comm.device_array = device_array


async def _cancel_get_data_replies(dask_worker: Any) -> int:
    """client.run target: cancel the tasks answering ``get_data`` on this worker, as a server closing in a process
    that hosts several workers cancels its handlers; how many there were."""
    import asyncio

    tasks = [
        t
        for t in list(dask_worker._ongoing_background_tasks._ongoing_tasks)
        if (frame := getattr(t.get_coro(), "cr_frame", None)) is not None
        and dask_worker._comms.get(frame.f_locals.get("comm")) == "get_data"
    ]
    for task in tasks:
        task.cancel()
    await asyncio.sleep(0.5)  # the handlers end: the get_data hook settles the reply
    return len(tasks)


def _staging_blocks(dask_worker: Any) -> dict[str, Any]:
    """client.run target: this process's staging blocks that its UCX quarantine keeps (pointers), those in its free
    list, and the quarantine's bytes."""
    from dask_gpupool.memory import ucx_staging
    from dask_gpupool.memory.lifetime import QUARANTINE

    parked = [
        frame.owner.ptr
        for _, frames, _ in list(QUARANTINE._entries)
        for frame in frames
        if isinstance(getattr(frame, "owner", None), ucx_staging.UcxStaging)
    ]
    free = [ptr for entries in list(ucx_staging._free.values()) for _, ptr in entries]
    return {"parked": parked, "free": free, "bytes": QUARANTINE.nbytes}


def _scribble_staging(nbytes: int, dask_worker: Any) -> int:
    """client.run target: staging memory for ``nbytes`` (a block of the free list if it has one, as the next staged
    reply takes), filled with 0xFF and kept on the worker; its pointer."""
    from cuda.bindings import driver

    from dask_gpupool.memory.ucx_staging import UcxStaging

    staged = UcxStaging(nbytes, 0)
    assert driver.cuMemsetD8(staged.ptr, 0xFF, nbytes)[0] == driver.CUresult.CUDA_SUCCESS
    assert driver.cuCtxSynchronize()[0] == driver.CUresult.CUDA_SUCCESS
    dask_worker._gpupool_scribbled = staged
    return staged.ptr


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
def test_on_ucxx_a_cancelled_reply_keeps_its_staging_memory_until_the_consumer_exits(placement, tmp_path):
    """Thirty-first session (the review's open UCX case): a ``get_data`` reply of a staged value cancelled while
    distributed-ucxx waits for its send (here: the consumer's receive of the device frame held back, the producer's
    handler task cancelled as a closing server cancels it) may leave the consumer's ``cuda_ipc`` read of the staging
    block running. The producer parks the block in its quarantine (``ucx_quarantined_bytes``), not in the staging
    free list: the next staging of that size, scribbled with 0xFF, gets other memory. The consumer's read then goes
    on (completing from the parked block, or failing and fetching the value again): its total is right, never a
    wrong byte. When the consumer's process exits (SIGKILL), the producer lets the block go."""
    gpus(2 if placement == "two-gpus" else 1)
    pytest.importorskip("distributed_ucxx")
    import dask
    import numpy as np

    n = 8 * MiB  # float64: 64 MiB of pool memory
    # staged device frames to a same-host worker (whose process the producer can watch): B reports a failed
    # transfer, so A sends it copies (device frames) for lease-timeout, from VMM segments (legacy ones go unstaged)
    plugin = GPUPool(kind="device", max_size="1 GiB", segment_memory="vmm", lease_timeout="600s")
    with dask.config.set(UCX_CONFIG), nanny_cluster(ucx_workers(placement, "same"), plugin, protocol="ucxx") as c:
        a, b = worker_addresses(c)
        assert c.run(T.report_failed_transfer, a, workers=[b])[b]
        before = c.run(_staging_blocks, workers=[a])[a]
        x = c.submit(T.make_array, n, "cupy", workers=[a], pure=False)
        x.result()
        waiting, release = tmp_path / "waiting", tmp_path / "release"
        c.run(_hold_device_frame_receives, str(waiting), str(release), 8 * n, workers=[b])
        y = c.submit(T.total, x, workers=[b], pure=False)
        wait_for(waiting.exists, what="the consumer to reach the receive of the device frame")
        time.sleep(0.5)  # the producer sends the frame's header first, then waits in the send of the frame itself
        assert c.run(_cancel_get_data_replies, workers=[a])[a] == 1
        got = c.run(_staging_blocks, workers=[a])[a]
        print(placement, "after the cancel:", got)
        assert got["bytes"] - before["bytes"] >= 8 * n, got
        (parked,) = set(got["parked"]) - set(before["parked"])
        assert parked not in got["free"], "a staging block the consumer may still read is in the free list"
        scribbled = c.run(_scribble_staging, 8 * n, workers=[a])[a]  # what the next staged reply would take
        assert scribbled != parked
        assert counters(c, a)[a]["ucx_quarantined_bytes"] == got["bytes"]
        assert counters(c, a)[a]["device_staged_bytes"] >= 8 * n  # it was staged, not handed over
        release.touch()
        assert y.result() == float(np.arange(n).sum())  # whichever way the consumer got it: never a wrong byte
        os.kill(pid_of(c, b), signal.SIGKILL)
        wait_for(
            lambda: parked not in c.run(_staging_blocks, workers=[a])[a]["parked"],
            what="the producer to let go of the parked block once the consumer exited",
        )
        c.run(lambda dask_worker: vars(dask_worker).pop("_gpupool_scribbled", None), workers=[a])


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
def test_on_ucxx_plain_cupy_arrays_go_unstaged_as_ucx_device_frames_by_default(placement):
    """Nothing is staged over UCX: a plain CuPy array of 8 MiB to a same-host worker, on the producer's GPU
    too, goes as distributed's own device frames, UCX's GPU-to-GPU copy (fallback not-in-pool), not staged into the
    pool, never a host copy; the right values; no lease, nothing left in the pool."""
    gpus(2 if placement == "two-gpus" else 1)
    pytest.importorskip("distributed_ucxx")
    import dask
    import numpy as np

    ucx = {f"distributed.comm.ucx.{k}": True for k in ("create-cuda-context", "nvlink", "tcp", "cuda-copy")}
    layout = ROTATED if placement == "two-gpus" else [ONE_GPU, ONE_GPU]
    workers = [{**w, "protocol": "ucxx"} for w in layout]
    plugin = GPUPool(kind="device", max_size="1 GiB")
    with dask.config.set(ucx), nanny_cluster(workers, plugin, protocol="ucxx") as c:
        a, b = worker_addresses(c)
        before = counters(c)
        # nothing is staged over UCX, so a plain CuPy result gets no event (pool memory would, for its export)
        assert dask_gpupool.stats(c)[a]["routing"]["staging"].startswith("off: over UCX"), dask_gpupool.stats(c)[a]
        plain = c.submit(T.plain_cupy, 1 << 20, workers=[a], pure=False)  # 8 MiB, CuPy's own memory
        assert c.submit(T.total, plain, workers=[b], pure=False).result() == float(np.arange(1 << 20).sum())
        assert c.run(T.task_events_recorded) == {a: 0, b: 0}
        now = counters(c)
        print(placement, {w: {k: v for k, v in now[w].items() if v} for w in (a, b)})
        assert now[a]["pool_staged_bytes"] == before[a]["pool_staged_bytes"], now
        assert now[a]["fallbacks"].get("staged-in-pool", 0) == before[a]["fallbacks"].get("staged-in-pool", 0)
        not_in_pool = now[a]["fallbacks"].get("not-in-pool", 0) - before[a]["fallbacks"].get("not-in-pool", 0)
        assert not_in_pool == 1, now
        frames = now[b]["device_frames_bytes"] - before[b]["device_frames_bytes"]
        assert frames == 8 * MiB == now[a]["device_frames_out_bytes"] - before[a]["device_frames_out_bytes"], now
        assert now[a]["copied_out_bytes"] == before[a]["copied_out_bytes"], now  # never a host copy
        assert now[b]["copied_bytes"] == before[b]["copied_bytes"], now
        del plain
        wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="the leases to end")
        after = counters(c, a)[a]
        assert after["lease_bytes"] == 0 and after["used"] == before[a]["used"], after


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
def test_device_pools_hand_small_pool_arrays_to_same_host_workers(placement):
    """Device pools hand over every size (tuning.handoff_threshold): a 16 KiB pool array goes to a worker on the
    producer's GPU, or on another GPU, as a handoff (zero-copy, no fallback ``small``); the right values, and no lease
    left after."""
    gpus(2 if placement == "two-gpus" else 1)
    import numpy as np

    layout = ROTATED if placement == "two-gpus" else [ONE_GPU, ONE_GPU]
    plugin = GPUPool(kind="device", max_size="1 GiB")
    with nanny_cluster(layout, plugin) as c:
        a, b = worker_addresses(c)
        before = counters(c)
        arr = c.submit(T.make_array, 1 << 11, "cupy", workers=[a], pure=False)  # 16 KiB of float64
        assert c.submit(T.total, arr, workers=[b], pure=False).result() == float(np.arange(1 << 11).sum())
        now = counters(c)
        small = now[a]["fallbacks"].get("small", 0) - before[a]["fallbacks"].get("small", 0)
        zero_copy = now[b]["zero_copy_bytes"] - before[b]["zero_copy_bytes"]
        assert (small, zero_copy) == (0, 16 << 10), now
        del arr
        wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="the leases to end")


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
def test_every_pair_of_two_hosts_over_ucxx_hands_over_or_sends_device_frames(placement):
    """Issue 19, UCX clusters: four workers that look like two hosts (gpupool.host-id) of two GPUs, w0 and w2 on
    GPU 0, w1 and w3 on GPU 1 (``two-gpus``), or all four on GPU 0 (``one-gpu``). For every ordered pair an 8 MiB
    pool array made on the first reaches a task on the second with the right values: the same-"host" pair as a
    descriptor (zero-copy), the other-"host" pairs as device frames that UCX moves GPU to GPU, none as a host copy;
    every byte counted on its path, and no lease left."""
    gpus(2 if placement == "two-gpus" else 1)
    pytest.importorskip("distributed_ucxx")
    import dask
    import numpy as np

    ucx = {f"distributed.comm.ucx.{k}": True for k in ("create-cuda-context", "nvlink", "tcp", "cuda-copy")}
    hosts = ["host-a", "host-a", "host-b", "host-b"]
    workers = [
        {"env": {"CUDA_VISIBLE_DEVICES": v}, "protocol": "ucxx", "config": {"gpupool": {"host-id": h}}}
        for h, v in zip(hosts, ["0,1", "1,0", "0,1", "1,0"] if placement == "two-gpus" else ["0"] * 4, strict=True)
    ]
    plugin = GPUPool(kind="device", max_size="1 GiB")
    total = float(np.arange(1 << 20).sum())
    with dask.config.set(ucx), nanny_cluster(workers, plugin, protocol="ucxx") as c:
        addrs = worker_addresses(c)
        for i, src in enumerate(addrs):
            for j, dst in enumerate(addrs):
                if i != j:  # a fresh value per pair: a replica made by an earlier pair would change the path
                    arr = c.submit(T.make_array, 1 << 20, "cupy", workers=[src], pure=False)
                    assert c.submit(T.total, arr, workers=[dst], pure=False).result() == total, (i, j)
                    del arr
        got = c.run(T.handoff_counters)
        for w in addrs:  # each received one same-host value and two from the other host, 8 MiB each
            assert got[w]["zero_copy_bytes"] == 8 * MiB, (w, got[w])
            assert got[w]["device_frames_bytes"] == 16 * MiB, (w, got[w])
            assert got[w]["copied_bytes"] == 0 and got[w]["copied_out_bytes"] == 0, (w, got[w])
        wait_for(lambda: all(s["leases"] == 0 for s in counters(c).values()), what="the leases to end")


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
def test_plain_cupy_arrays_are_staged_into_the_pool(placement):
    """From the stage threshold (64 KiB over TCP) up, a plain CuPy array of 8 MiB goes to a same-host worker over TCP
    as a device copy into the producer's pool and a handoff (fallback staged-in-pool), never through the host; a
    32 KiB one through the comm (fallback small)."""
    import numpy as np

    gpus(2 if placement == "two-gpus" else 1)
    layout = ROTATED if placement == "two-gpus" else [ONE_GPU, ONE_GPU]
    plugin = GPUPool(kind="device", max_size="1 GiB")
    with nanny_cluster(layout, plugin) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        before = counters(c)
        big = c.submit(T.plain_cupy, 1 << 20, workers=[a], pure=False)  # 8 MiB, CuPy's own memory
        small = c.submit(T.plain_cupy, 1 << 12, workers=[a], pure=False)  # 32 KiB
        got = c.submit(T.keep, big, workers=[b], pure=False)
        assert c.submit(T.total, got, workers=[b], pure=False).result() == float(np.arange(1 << 20).sum())
        assert c.submit(T.describe, got, workers=[b], pure=False).result()["imported"]
        assert c.submit(T.total, small, workers=[b], pure=False).result() == float(np.arange(1 << 12).sum())
        now = counters(c)
        assert now[a]["fallbacks"] == {"staged-in-pool": 1, "small": 1}, now[a]
        assert now[a]["pool_staged_bytes"] - before[a]["pool_staged_bytes"] == 8 * MiB
        assert now[b]["zero_copy_bytes"] - before[b]["zero_copy_bytes"] == 8 * MiB
        del big, small, got
        back_to(c, baseline)


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
def test_replies_of_staged_cupy_arrays_over_tcp_skip_the_offload_thread(placement):
    """Over TCP a reply over Dask's 10 MiB offload size of plain CuPy arrays that the producer's pool stages and hands
    over (from the stage threshold, 64 KiB) is serialized on the event loop, as replies of pool memory are; with
    more than ``INLINE_MAX_VALUES`` values, or a host value beside them, Dask's thread does it. Values arrive right."""
    import numpy as np
    from distributed import wait

    gpus(2 if placement == "two-gpus" else 1)
    layout = ROTATED if placement == "two-gpus" else [ONE_GPU, ONE_GPU]
    plugin = GPUPool(kind="device", max_size="1 GiB")
    with nanny_cluster(layout, plugin) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        n = 12 << 17  # 12 MiB of float64
        plain = c.submit(T.plain_cupy, n, workers=[a], pure=False)
        host = c.submit(np.ones, n, workers=[a], pure=False)
        # 9 x 5 MiB: staged on either placement
        many = [c.submit(T.plain_cupy, 5 << 17, workers=[a], pure=False) for _ in range(9)]
        wait([plain, host, *many])

        def inline(keys: list[str], c: Any = c, a: str = a, b: str = b) -> bool:
            return c.run(T.serialized_inline, keys, b, workers=[a])[a]

        assert inline([plain.key]) and inline([m.key for m in many[:6]])
        assert not inline([plain.key, host.key]) and not inline([m.key for m in many])
        assert not inline([plain.key], c=c, a=a, b="tcp://127.0.0.1:1")  # not a worker: a copy, in the thread
        before = counters(c, a)[a]
        got = c.submit(T.keep, plain, workers=[b], pure=False)
        assert c.submit(T.total, got, workers=[b], pure=False).result() == float(np.arange(n).sum())
        assert counters(c, a)[a]["pool_staged_bytes"] - before["pool_staged_bytes"] == 12 * MiB
        del plain, host, many, got
        back_to(c, baseline)


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
def test_plain_cupy_arrays_of_every_layout_are_staged_with_their_values(placement):
    """Plain CuPy arrays of every layout (``T.LAYOUTS`` and the whole array), staged at every size (a stage threshold
    of 1 byte given to the producer: the layouts are a few KiB, under the default 64 KiB): contiguous ones
    (whole, transposed: Fortran order, 0-d) by one driver copy of their bytes, the others (slices, negative strides,
    broadcasts) through CuPy. B reads the same shape and values, also after A's key is gone and A's pool scribbled
    over; empty arrays are sent as before."""
    import numpy as np

    gpus(2 if placement == "two-gpus" else 1)
    layout = ROTATED if placement == "two-gpus" else [ONE_GPU, ONE_GPU]
    plugin = GPUPool(kind="device", max_size="1 GiB")
    with nanny_cluster(layout, plugin) as c:
        a, b = worker_addresses(c)
        c.run(T.route_sizes, stage=1, workers=[a])
        baseline = warm_up(c, a, b)
        for name in [*sorted(T.LAYOUTS), "whole"]:
            before = counters(c, a)[a]
            x = c.submit(T.plain_view, 400, name, workers=[a], pure=False)
            y = c.submit(T.keep, x, workers=[b], pure=False)
            base = np.arange(400, dtype="f8")
            if name == "fortran":
                base = np.asfortranarray(base.reshape(20, 20))
            view = base if name == "whole" else T.LAYOUTS[name](np, base)
            want = {"shape": list(view.shape), "values": view.tolist()}
            assert c.submit(T.as_nested_list, y, workers=[b], pure=False).result() == want, name
            staged = counters(c, a)[a]["fallbacks"].get("staged-in-pool", 0) - before["fallbacks"].get(
                "staged-in-pool", 0
            )
            assert staged == (0 if name == "empty" else 1), (name, counters(c, a)[a]["fallbacks"])
            del x
            for _ in range(4):
                c.submit(T.scribble_all, 4 * MiB, ord("S"), workers=[a], pure=False).result()
            assert c.submit(T.as_nested_list, y, workers=[b], pure=False).result() == want, name
            del y
        back_to(c, baseline)


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
def test_a_staged_task_result_is_copied_after_its_own_kernel(placement):
    """A plain CuPy array that a task of the producer made, staged into the pool for a same-host worker, is copied
    on a stream of its own after the event recorded when Dask stored it (step ``stage-after-task``): its kernel spun
    300 ms before writing, and a later task's 3 s kernel is still queued on the default stream when the consumer
    asks. The consumer reads every byte right, each of three times; no lease is left after."""
    from distributed import wait

    gpus(2 if placement == "two-gpus" else 1)
    layout = ROTATED if placement == "two-gpus" else [ONE_GPU, ONE_GPU]
    plugin = GPUPool(kind="device", max_size="1 GiB")
    with nanny_cluster(layout, plugin) as c:
        a, b = worker_addresses(c)
        for i in range(3):
            x = c.submit(T.slow_plain_cupy, 16 * MiB, 7 + i, 300, workers=[a], pure=False)
            wait(x)  # stored, its kernel still spinning
            assert c.run(T.task_events_recorded, workers=[a])[a] >= 1  # over TCP: x has its event
            later = c.submit(T.spin, 3000, workers=[a], pure=False)
            wait(later)  # queued behind x's kernel on the default stream
            assert c.submit(T.array_equal, x, 7 + i, workers=[b], pure=False).result(), i
            del x, later
        timings = counters(c, a)[a]["timings"]
        assert timings["stage-after-task"]["count"] == 3 and "stage" not in timings, timings
        wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="the leases to end")


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
@pytest.mark.parametrize("kind", ["rmm", "numba"])
def test_device_objects_go_frame_by_frame_over_tcp(kind, placement):
    """Issue 18, every "cuda"-serialized object: an rmm.DeviceBuffer or a Numba device array of 8 MiB goes to a
    same-host worker over TCP as its device frame staged into the producer's pool and handed over (staged-in-pool),
    a 1 KiB one through the comm (small); the consumer rebuilds the same type with the right bytes, and keeps them
    after the producer's key is gone and its pool scribbled over. At the defaults; the consumer
    on the same GPU, or on the other one (the frame read in place over NVLink or PCIe)."""
    workers = layout_workers(placement)
    pytest.importorskip("numba.cuda" if kind == "numba" else "rmm")
    with nanny_cluster(workers, GPUPool(kind="device", max_size="1 GiB")) as c:
        a, b = worker_addresses(c)
        name = "DeviceBuffer" if kind == "rmm" else "DeviceNDArray"
        before = counters(c)
        big = c.submit(T.device_object, kind, 1 << 20, workers=[a], pure=False)
        small = c.submit(T.device_object, kind, 128, workers=[a], pure=False)
        got = c.submit(T.keep, big, workers=[b], pure=False)
        assert c.submit(T.check_device_object, got, 1 << 20, workers=[b], pure=False).result() == f"{name}:ok"
        assert c.submit(T.check_device_object, small, 128, workers=[b], pure=False).result() == f"{name}:ok"
        now = counters(c)
        assert now[a]["fallbacks"] == {"staged-in-pool": 1, "small": 1}, now[a]
        assert now[a]["pool_staged_bytes"] - before[a]["pool_staged_bytes"] == 8 * MiB
        assert now[b]["zero_copy_bytes"] - before[b]["zero_copy_bytes"] == 8 * MiB
        del big, small
        for _ in range(4):
            c.submit(T.scribble_all, 16 * MiB, ord("S"), workers=[a], pure=False).result()
        assert c.submit(T.check_device_object, got, 1 << 20, workers=[b], pure=False).result() == f"{name}:ok"
        del got


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
@pytest.mark.parametrize("kind", ["reads-on-arrival", "wants-rmm-frames"])
def test_any_cuda_serialized_type_goes_frame_by_frame_and_is_read_only_after_its_claim(kind, placement):
    """Issue 18, every "cuda"-serialized object: a type distributed does not know (``T.DeviceRecord``, registered
    with ``cuda_serialize`` only) over a 16 MiB pool buffer that a producer kernel is still filling (300 ms spin)
    reaches a same-host worker over TCP zero-copy. Its deserializer sums the bytes on arrival, as a cuDF column's
    may read them, and the sum is right: the export waited for the producer's kernel, and the object's claims ran
    before it. A deserializer that wants ``rmm.DeviceBuffer`` frames gets copies, and the right bytes.
    The consumer on the producer's GPU, or on the other one."""
    workers = layout_workers(placement)
    if kind == "wants-rmm-frames":
        pytest.importorskip("rmm")
    plugin = GPUPool(kind="device", max_size="1 GiB")
    with nanny_cluster(workers, plugin) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        before = counters(c)
        name = "RmmFramesRecord" if kind == "wants-rmm-frames" else "DeviceRecord"
        for i in range(3):
            buf = c.submit(T.slow_fill, 16 * MiB, 11 + i, 300, workers=[a], pure=False)
            rec = c.submit(T.device_record, buf, f"r{i}", kind == "wants-rmm-frames", workers=[a], pure=False)
            got = c.submit(T.keep, rec, workers=[b], pure=False)
            assert c.submit(T.check_device_record, got, 11 + i, workers=[b], pure=False).result() == f"{name}:ok"
            del buf, rec, got
        now = counters(c)
        assert now[b]["zero_copy_bytes"] - before[b]["zero_copy_bytes"] == 3 * 16 * MiB, now[b]
        assert now[a]["fallbacks"] == before[a]["fallbacks"], now[a]
        back_to(c, baseline)


def test_the_package_imports_after_cupy():
    """``import cupy`` before ``dask_gpupool`` (benchmarks/dask_array.py does): no circular import."""
    import subprocess
    import sys

    gpus(1)
    code = "import cupy, dask_gpupool, dask_gpupool.dask.cuda_family; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


_CLIENT_AFTER_DISTRIBUTEDS_CUPY = """
import sys
import dask_gpupool  # before CuPy: its CuPy serializers wait for the first CuPy dispatch
from distributed import Client
{first}
with Client(sys.argv[1], timeout=30) as client:
    got = client.get_dataset(sys.argv[2]).result(timeout=60)
    print(type(got).__module__.split(".")[0], float(got.sum()))
"""


@pytest.mark.parametrize(
    "first",
    [
        "import distributed.protocol.cupy",
        "import cupy; from distributed.protocol import cuda_deserialize; cuda_deserialize.dispatch(cupy.ndarray)",
    ],
    ids=["distributeds-cupy-module", "cuda-family-first"],
)
def test_a_client_gathers_a_pool_cupy_array_whatever_registered_cupys_serializers_first(first):
    """A client process that imported ``dask_gpupool`` before CuPy, and then distributed's CuPy module (directly, or
    through a first dispatch of the ``"cuda"`` family, as a UCX comm makes), gets a pool-backed CuPy array's copy
    header: distributed's CuPy serializers had taken the dispatch before the lazy hook that installs ours, and the
    header reached distributed's deserializer (``KeyError: 'shape'``; found by the thirty-first session's GPU run)."""
    import subprocess
    import sys

    gpus(1)
    with nanny_cluster([ONE_GPU], GPUPool(kind="device", max_size="1 GiB")) as c:
        (a,) = worker_addresses(c)
        x = c.submit(T.make_array, 1000, "cupy", workers=[a], pure=False)
        assert c.submit(T.describe, x, workers=[a], pure=False).result()["in_own_pool"]
        c.publish_dataset(x, name="pool-cupy")  # a Future by key alone in another client never resolved
        code = _CLIENT_AFTER_DISTRIBUTEDS_CUPY.format(first=first)
        done = subprocess.run(
            [sys.executable, "-c", code, c.scheduler.address, "pool-cupy"], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split() == ["cupy", str(float(999 * 1000 // 2))], done.stdout


# -- issue 18: forwarding and layouts on device pools ------------------------------------------


def _chain_cluster(placement: str) -> tuple[list[dict[str, Any]], Any]:
    """Three workers A, B, W on one GPU, or A and W on GPU 0 and B on GPU 1 (every hop crosses GPUs)."""
    if placement == "one-gpu":
        gpus(1)
        one = {"env": {"CUDA_VISIBLE_DEVICES": local_devices().uuids[0]}}
        return [one] * 3, GPUPool(kind="device", max_size="1 GiB")
    gpus(2)
    return [ROTATED[0], ROTATED[1], ROTATED[0]], GPUPool(kind="device", max_size="1 GiB")


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
def test_a_chain_a_b_w_a_on_gpus_maps_the_first_exporter_and_outlives_the_middle(placement):
    """Issue 18 on device pools: A -> B -> W, each hop zero-copy (W maps A's memory under a lease A granted through
    B), then back to A (A takes its own buffer back); B's and A's keys gone and A's pool scribbled over, W and A read
    the right bytes."""
    workers, plugin = _chain_cluster(placement)
    with nanny_cluster(workers, plugin) as c:
        a, b, w = worker_addresses(c)
        baseline = warm_up(c, a, b)
        baseline = warm_up(c, b, w)
        baseline = warm_up(c, a, w)
        before = counters(c)
        x = c.submit(T.make_buffer, 8 * MiB, b"two hops", workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        z = c.submit(T.keep, y, workers=[w], pure=False)
        assert c.submit(T.describe, z, workers=[w], pure=False).result()["imported"]
        now = counters(c)
        assert now[b]["forwards"] - before[b]["forwards"] == 1
        assert now[w]["zero_copy_bytes"] - before[w]["zero_copy_bytes"] == 8 * MiB
        assert all(now[k]["copied_bytes"] == before[k]["copied_bytes"] for k in (a, b, w)), now
        del x, y
        wait_for(lambda: counters(c, a)[a]["leases"] == 1, what="B's lease on A to end")
        for _ in range(4):
            c.submit(T.scribble_all, 16 * MiB, ord("S"), workers=[a], pure=False).result()
        assert c.submit(T.head, z, 8, workers=[w], pure=False).result() == b"two hops"
        back = c.submit(T.keep, z, workers=[a], pure=False)  # back to A: its own buffer, nothing mapped or copied
        assert c.submit(T.head, back, 8, workers=[a], pure=False).result() == b"two hops"
        now = counters(c)
        assert now[a]["returns"] - before[a]["returns"] == 1 and now[w]["fallbacks"] == {}, now
        assert now[a]["copied_bytes"] == before[a]["copied_bytes"]
        del z, back
        back_to(c, baseline)


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
def test_sigkill_of_the_middle_of_a_chain_on_gpus_leaves_the_last_ones_memory_readable(placement):
    """Issue 18 on device pools: B killed after passing A's memory on to W: A ends B's lease, W's lives on, and W
    reads the right bytes after A's pool was scribbled over."""
    workers, plugin = _chain_cluster(placement)
    with nanny_cluster(workers, plugin) as c:
        a, b, w = worker_addresses(c)
        baseline = warm_up(c, a, w)  # B's links and mappings go with it
        kill_the_middle_of_a_chain(c, a, b, w, 8 * MiB, 16 * MiB)
        back_to(c, {k: baseline[k] for k in (a, w)}, workers=[a, w])


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
def test_every_layout_hands_over_on_a_gpu_and_passes_on(placement):
    """CuPy views of every layout (``T.LAYOUTS``) reach B, and passed on by B reach W, zero-copy with the right values.

    W maps A's memory (a lease A granted through B); B's and A's keys go, and W still reads the original values.
    """
    import numpy as np

    workers, plugin = _chain_cluster(placement)
    with nanny_cluster(workers, plugin) as c:
        a, b, w = worker_addresses(c)
        for layout in sorted(T.LAYOUTS):
            before = counters(c)
            x = c.submit(T.make_array, 400, "cupy", workers=[a], pure=False)
            v = c.submit(T.view_of, x, layout, workers=[a], pure=False)
            y = c.submit(T.keep, v, workers=[b], pure=False)
            z = c.submit(T.keep, y, workers=[w], pure=False)
            base = np.arange(400, dtype="f8")
            if layout == "fortran":
                base = np.asfortranarray(base.reshape(20, 20))
            view = T.LAYOUTS[layout](np, base)
            want = {"shape": list(view.shape), "values": view.tolist()}
            assert c.submit(T.as_nested_list, y, workers=[b], pure=False).result() == want, layout
            del x, v, y
            for _ in range(4):
                c.submit(T.scribble_all, 4 * MiB, ord("S"), workers=[a], pure=False).result()
            assert c.submit(T.as_nested_list, z, workers=[w], pure=False).result() == want, layout
            now = counters(c)
            if layout != "empty":
                assert now[w]["zero_copy_bytes"] > before[w]["zero_copy_bytes"], layout
                assert now[w]["copied_bytes"] == before[w]["copied_bytes"], layout
                assert now[b]["forwards"] > before[b]["forwards"], layout
            assert all(now[k]["fallbacks"] == before[k]["fallbacks"] for k in (a, b, w)), (layout, now)
            del z


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
def test_a_device_value_imported_twice_is_still_passed_on_once_its_other_import_went(placement):
    """The GPU twin of ``test_forwarding.py::test_a_value_imported_twice_is_still_passed_on_once_its_other_import_
    went`` (thirty-first session's review): B maps one allocation of A (in a segment) under two keys, the second
    import goes, and B still passes the first one's CuPy array on to W as A's memory, not as a copy."""
    n = 1 << 20
    workers, plugin = _chain_cluster(placement)
    with nanny_cluster(workers, plugin) as c:
        a, b, w = worker_addresses(c)
        baseline = warm_up(c, a, b)
        baseline = warm_up(c, b, w)
        baseline = warm_up(c, a, w)
        x = c.submit(T.make_array, n, "cupy", workers=[a], pure=False)
        twin = c.submit(T.keep, x, workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        y.result()
        y_twin = c.submit(T.keep, twin, workers=[b], pure=False)
        assert c.submit(T.describe, y_twin, workers=[b], pure=False).result()["imported"]
        keys = [twin.key, y_twin.key]
        del twin, y_twin
        wait_forgotten(c, keys)
        wait_for(lambda: counters(c, a)[a]["leases"] == 1, what="B's second lease on A to end")
        before = counters(c)
        z = c.submit(T.keep, y, workers=[w], pure=False)
        assert c.submit(T.total, z, workers=[w], pure=False).result() == float(n * (n - 1) // 2)
        now = counters(c)
        assert now[b]["fallbacks"] == before[b]["fallbacks"], now[b]["fallbacks"]
        assert now[b]["forwards"] - before[b]["forwards"] == 1
        assert now[w]["copied_bytes"] == before[w]["copied_bytes"]
        del x, y, z
        back_to(c, baseline)


def _zero_d_cupy_in_pool() -> Any:
    """Task: a 0-d CuPy array put in the pool."""
    import cupy

    return dask_gpupool.to_pool(cupy.asarray(3.5))


def test_a_zero_d_cupy_array_goes_into_the_pool_and_hands_over():
    """The GPU twin of ``test_layouts.py::test_a_zero_d_array_goes_into_the_pool_and_hands_over``: ``as_array``
    without strides failed for a 0-d shape (thirty-first session's review), on CuPy as on NumPy."""
    gpus(1)
    with nanny_cluster([ONE_GPU, ONE_GPU], GPUPool(kind="device", max_size="1 GiB")) as c:
        a, b = worker_addresses(c)
        x = c.submit(_zero_d_cupy_in_pool, workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.as_nested_list, y, workers=[b], pure=False).result() == {"shape": [], "values": 3.5}
        assert c.submit(T.describe, y, workers=[b], pure=False).result()["imported"]


def _numpy_to_pool_on_a_device_pool() -> bool:
    """Task: whether ``to_pool`` of a NumPy array on a worker whose pool is GPU memory returned it as it is."""
    import numpy as np

    arr = np.arange(4.0)
    return dask_gpupool.to_pool(arr) is arr


def test_to_pool_of_a_numpy_array_on_a_device_pool_returns_it_as_it_is():
    """``to_pool`` of a NumPy result on a ``device`` pool (the default kind on a GPU) raised ``ValueError`` from
    ``as_array`` (GPU memory cannot be viewed as NumPy) instead of returning the array, as it does for a CuPy
    array on a ``host`` pool (review of the user-facing operations, thirty-third session)."""
    gpus(1)
    with nanny_cluster([ONE_GPU], GPUPool(kind="device", max_size="64 MiB")) as c:
        (a,) = worker_addresses(c)
        assert c.submit(_numpy_to_pool_on_a_device_pool, workers=[a], pure=False).result()


def test_a_buffer_freed_by_the_garbage_collector_inside_a_segment_allocation_does_not_deadlock_it():
    """A pool Buffer in a reference cycle is freed whenever the collector runs, also inside the pool's own
    allocation, on the thread that holds the segments' lock (the host test's case, on a GPU with VMM segments and
    its driver calls). Small segments and a retire per step make new segments often."""
    gpus(1)
    segmented = vmm_segments(2 * MiB, 1 << 30)

    def step() -> None:
        kept = []
        for _ in range(4):
            b = segmented.allocate(MiB)
            cycle: list[Any] = [b]
            cycle.append(cycle)
            del b, cycle
            kept.append(segmented.allocate(MiB))
        del kept
        segmented.retire()

    deadlocked = True
    try:
        # 10 rounds per threshold: on an H100 100 rounds did not end within the suite's time (the collector's full
        # collections of a pytest process with CuPy loaded dominate)
        run_with_frequent_collections(step, timeout=120, rounds=10)
        deadlocked = False
        import gc

        gc.collect()
        segmented.allocate(1).close()
        assert segmented.attributes.used_mem_current == 0
    finally:
        if not deadlocked:  # a thread stuck on the segments' lock would hang the close, and the suite with it
            segmented.close()


def test_a_device_value_spilled_while_answering_a_peer_is_a_host_copy_and_leaves_no_lease():
    """tests/dask/test_dask_uses.py's spill case on a ``device`` pool: B's get_data unspills x on A, which evicts y
    to disk inside the reply; y must go to disk as its bytes, not as a descriptor under a lease nobody claims."""
    import dask

    gpus(1)
    memory = {"target": 0.5, "spill": False, "pause": False, "terminate": False}
    spilling = {
        **ONE_GPU,
        "memory_limit": "64 MiB",
        "config": {f"distributed.worker.memory.{k}": v for k, v in memory.items()},
    }
    with (
        dask.config.set({"distributed.worker.memory.terminate": False}),
        nanny_cluster([spilling, ONE_GPU], GPUPool(kind="device", max_size="1 GiB")) as c,
    ):
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        x = c.submit(T.make_buffer, 24 * MiB, b"x-bytes", workers=[a], pure=False)
        x.result()
        y = c.submit(T.make_buffer, 24 * MiB, b"y-bytes", workers=[a], pure=False)
        y.result()
        wait_for(lambda key=x.key: key in c.run(T.spilled_bytes, workers=[a])[a], what="x to be spilled")
        z = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.head, z, 7, workers=[b], pure=False).result() == b"x-bytes"
        spilled = c.run(T.spilled_bytes, workers=[a])[a]
        assert spilled.get(y.key, 0) >= 24 * MiB, spilled
        assert counters(c, a)[a]["leases"] == 1
        assert c.submit(T.head, y, 7, workers=[a], pure=False).result() == b"y-bytes"
        del x, y, z
        back_to(c, baseline)


def test_user_code_that_pickles_a_device_pool_buffer_gets_a_host_copy():
    """tests/dask/test_dask_uses.py's pickling case on a ``device`` pool: cuda.core's own ``__reduce__`` would
    export an IPC descriptor with no lease behind it."""
    gpus(1)
    with nanny_cluster([ONE_GPU, ONE_GPU], GPUPool(kind="device", max_size="1 GiB")) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        x = c.submit(T.make_buffer, MiB, b"pickled!", workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        for which in ("pickle", "cloudpickle"):
            for value, w in ((x, a), (y, b)):
                got = c.submit(T.pickled_copy, value, which, workers=[w], pure=False).result()
                want = {"type": "Buffer", "size": MiB, "before": b"pickled!", "after": b"pickled!", "same": False}
                assert got == want, (which, w)
        assert counters(c, a)[a]["leases"] == 1
        del x, y, value
        back_to(c, baseline)
