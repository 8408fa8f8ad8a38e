"""Values passed on along a chain of workers on ``device`` pools (A -> B -> W: W maps A's memory), on one GPU
and across two (gpu-marked: run on the GPU machine). The ``host`` cases are in ``test_forwarding.py``."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import (
    ROTATED,
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
from dask_gpupool.memory.topology import local_devices

pytestmark = pytest.mark.gpu

MiB = 1 << 20


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
    """On device pools: A -> B -> W, each hop zero-copy (W maps A's memory under a lease A granted through
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
    went``: B maps one allocation of A (in a segment) under two keys, the second
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
