"""Copies of GPU pool memory to a worker of another host: pulled in chunks over TCP into GPU memory, through
vkgdr or pinned staging (gpu-marked: run on the GPU machine)."""

from __future__ import annotations

import pytest
from conftest import (
    ONE_GPU,
    back_to,
    counters,
    gpus,
    nanny_cluster,
    wait_for,
    wait_forgotten,
    warm_up,
    worker_addresses,
)

from dask_gpupool import GPUPool
from dask_gpupool import testing as T

pytestmark = pytest.mark.gpu

MiB = 1 << 20


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
