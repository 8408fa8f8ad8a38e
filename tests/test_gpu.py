"""The CUDA paths with real Nanny workers: ``device`` and ``pinned`` pools (run on the GPU machine)."""

from __future__ import annotations

import pytest
from conftest import handoff_round_trip, nanny_cluster, worker_addresses

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import _testing as T
from dask_gpupool._topology import local_devices

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def gpus(n: int) -> None:
    if len(local_devices().uuids) < n:
        pytest.skip(f"needs {n} GPUs, sees {len(local_devices().uuids)}")


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
    one_gpu = {"env": {"CUDA_VISIBLE_DEVICES": "0"}}
    with nanny_cluster([one_gpu, one_gpu], GPUPool(kind="pinned", max_size="1 GiB")) as c:
        rows = handoff_round_trip(c, 8 * MiB, b"pinned bytes written by A" * 100)
        a, b = worker_addresses(c)
        assert {r.kind for r in rows.values()} == {"pinned"} and rows[a].device == local_devices().uuids[0]
        desc = c.submit(T.hold, "p", MiB, b"pinned, read by B's GPU", workers=[a], pure=False).result()
        assert c.submit(T.read_peer_on_gpu, desc, 23, workers=[b], pure=False).result() == b"pinned, read by B's GPU"
        c.submit(T.release, "p", workers=[a], pure=False).result()


def test_one_worker_per_gpu_with_rotated_visible_devices():
    gpus(2)
    uuids = local_devices().uuids
    rotated = [{"env": {"CUDA_VISIBLE_DEVICES": "0,1"}}, {"env": {"CUDA_VISIBLE_DEVICES": "1,0"}}]
    with nanny_cluster(rotated, GPUPool(kind="device", max_size="1 GiB")) as c:
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
            stats = T.current_service().stats().to_msg()
            del bufs
            return stats, err

        stats, err = c.submit(fill, workers=[a], pure=False).result()
        assert stats["used_high"] >= 48 * MiB and stats["reserved_high"] >= 48 * MiB
        assert "cannot allocate" in err
