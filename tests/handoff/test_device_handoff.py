"""Handoffs between real Nanny workers on ``device`` and ``pinned`` pools: mapped, not copied, on one GPU and
across two, and read in the producer's stream order (gpu-marked: run on the GPU machine)."""

from __future__ import annotations

import pytest
from conftest import (
    ONE_GPU,
    ROTATED,
    back_to,
    counters,
    gpus,
    handoff_round_trip,
    layout_workers,
    nanny_cluster,
    stress,
    wait_for,
    warm_up,
    worker_addresses,
)

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import testing as T
from dask_gpupool.memory.topology import local_devices

pytestmark = pytest.mark.gpu

MiB = 1 << 20


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


def test_handoff_pinned_pools():
    gpus(1)
    with nanny_cluster([ONE_GPU, ONE_GPU], GPUPool(kind="pinned", max_size="1 GiB")) as c:
        _handoff_roundtrip(c, 8 * MiB)


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


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
def test_device_pools_hand_small_pool_arrays_to_same_host_workers(placement):
    """Device pools hand over every size (routes.handoff_threshold_of): a 16 KiB pool array goes to a worker on the
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
    per-allocation imports under which the consumer's context broke are gone. Segments of VMM
    memory, or of legacy IPC memory (``gpupool.segment-memory: legacy``, each opened once by its handle): handoffs,
    releases and reuse under load, every value read right, nothing copied."""
    gpus(2)
    plugin = GPUPool(kind="device", max_size="4 GiB", **options)
    with nanny_cluster(ROTATED, plugin) as c:
        stress(c, 40, 16 * MiB)
        b = worker_addresses(c)[1]
        seen = c.run(T.handoff_counters, workers=[b])[b]
        assert seen["zero_copy_bytes"] > 0 and seen["copied_bytes"] == 0, seen


@pytest.mark.parametrize("ordering", ["sync", "device"])
@pytest.mark.parametrize("layout", ["one-gpu", "two-gpus"])
def test_a_consumer_never_reads_before_the_producers_kernel_wrote(layout, ordering):
    """Stream order: the producer's task queues a kernel that spins 300 ms and then fills a 16 MiB pool
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
    """Stream order without stalling the producer, at the default ordering: a task's 16 MiB pool result
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
