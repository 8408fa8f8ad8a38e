"""GPU memory in one process: VMM and legacy IPC memory, segments over VMM memory, UCX staging blocks; and a
``device`` pool's stats and bound on a worker (gpu-marked: run on the GPU machine)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from conftest import (
    gpus,
    nanny_cluster,
    run_with_frequent_collections,
    worker_addresses,
)

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import testing as T

pytestmark = pytest.mark.gpu

MiB = 1 << 20


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
    one it is a ProtocolError with the mapping closed again, so no buffer past the allocation's end is made."""
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
