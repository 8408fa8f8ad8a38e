"""Pool memory and plain CuPy arrays over distributed-ucxx comms: handed over to a same-host worker; to another
host as device frames (staged or not) or one host frame; received into the receive pool; and replies that
end without their "OK" (gpu-marked: run on the GPU machine, with the UCXX wheels)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from conftest import (
    ONE_GPU,
    ROTATED,
    counters,
    gpus,
    nanny_cluster,
    pid_of,
    wait_for,
    worker_addresses,
)

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import testing as T

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def test_the_serializer_family_a_ucx_comm_gets_for_pool_memory():
    """With a UCX comm's serializer list, pool arrays and pool Buffers go as device frames ("cuda"),
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
    """On UCXX clusters, on one GPU and across two: values reach the consumer with the right bytes and
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
    """UCX clusters: ``gpupool.segment-memory: auto`` on workers that listen over UCX makes segments of
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
def test_every_pair_of_two_hosts_over_ucxx_hands_over_or_sends_device_frames(placement):
    """UCX clusters: four workers that look like two hosts (gpupool.host-id) of two GPUs, w0 and w2 on
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
    if tasks:  # the handlers end: the get_data hook settles the reply in its finally
        await asyncio.wait(tasks, timeout=30)
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
    """A ``get_data`` reply of a staged value cancelled while
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
        # B learns of A's pool from the scheduler's registry, after the cluster is up: reported once it knows it
        wait_for(lambda: c.run(T.report_failed_transfer, a, workers=[b])[b], what="B to know A's pool")
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
