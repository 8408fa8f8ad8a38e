"""dask-cuda's ``LocalCUDACluster`` with the plugin registered, at its own layout and with each of its RMM
options (gpu-marked: run on the GPU machine)."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import (
    back_to,
    gpus,
    wait_for,
    warm_up,
    worker_addresses,
)

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import testing as T

pytestmark = pytest.mark.gpu

MiB = 1 << 20


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
    """dask-cuda's RMM combinations: LocalCUDACluster with each RMM option (a pool, the async allocator,
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
