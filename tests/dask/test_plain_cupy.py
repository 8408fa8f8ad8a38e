"""Plain CuPy arrays (memory of CuPy's or RMM's, not of the pool) over TCP: from the stage threshold up staged
into the producer's pool after the kernel that made them, and handed over (gpu-marked: run on the GPU
machine)."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import (
    ONE_GPU,
    ROTATED,
    back_to,
    counters,
    gpus,
    nanny_cluster,
    wait_for,
    warm_up,
    worker_addresses,
)

from dask_gpupool import GPUPool
from dask_gpupool import testing as T

pytestmark = pytest.mark.gpu

MiB = 1 << 20


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
