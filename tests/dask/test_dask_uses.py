"""What users do with Dask around pool values: spilling, scatter, datasets, pickling, plugin life cycle.

Every value that leaves a worker for anything but a same-host worker's ``get_data`` must be a real copy, never a
descriptor that outlives its lease (real Nanny workers, ``host`` pools).
"""

from __future__ import annotations

from typing import Any

import dask
from conftest import HOST_POOL, back_to, counters, nanny_cluster, wait_for, warm_up, worker_addresses

from dask_gpupool import testing as T

MiB = 1 << 20

#: The nanny (in the test process) reads its terminate threshold from this process's config.
NO_TERMINATE = {"distributed.worker.memory.terminate": False}


def _spilling(limit: str) -> dict[str, Any]:
    """Nanny options: spill by managed memory only, at half of ``limit`` (no pause; the nanny's termination is
    turned off by :data:`NO_TERMINATE` in the test process, where the nanny runs)."""
    memory = {"target": 0.5, "spill": False, "pause": False, "terminate": False}
    return {"memory_limit": limit, "config": {f"distributed.worker.memory.{k}": v for k, v in memory.items()}}


def test_a_value_spilled_while_answering_a_peer_is_a_real_copy_and_leaves_no_lease():
    """B's get_data unspills x on A, which evicts y to disk inside the reply: y must be spilled as bytes."""
    with dask.config.set(NO_TERMINATE), nanny_cluster([_spilling("8 MiB"), {}], HOST_POOL) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)

        x = c.submit(T.make_buffer, 3 * MiB, b"x-bytes", workers=[a], pure=False)
        x.result()
        y = c.submit(T.make_buffer, 3 * MiB, b"y-bytes", workers=[a], pure=False)
        y.result()
        wait_for(lambda key=x.key: key in c.run(T.spilled_bytes, workers=[a])[a], what="x to be spilled")
        z = c.submit(T.keep, x, workers=[b], pure=False)  # A unspills x in get_data, evicting y
        assert c.submit(T.head, z, 7, workers=[b], pure=False).result() == b"x-bytes"
        spilled = c.run(T.spilled_bytes, workers=[a])[a]
        assert y.key in spilled, spilled
        assert spilled[y.key] >= 3 * MiB, f"y went to disk as {spilled[y.key]} bytes, not a copy of its 3 MiB"
        assert counters(c, a)[a]["leases"] == 1  # B's lease on x only
        assert c.submit(T.head, y, 7, workers=[a], pure=False).result() == b"y-bytes"
        del x, y, z
        back_to(c, baseline)


def test_user_code_that_pickles_a_pool_buffer_gets_a_host_copy():
    with nanny_cluster([{}, {}], HOST_POOL) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        x = c.submit(T.make_buffer, MiB, b"pickled!", workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)  # B's import of A's memory
        for which in ("pickle", "cloudpickle"):
            for value, w in ((x, a), (y, b)):
                got = c.submit(T.pickled_copy, value, which, workers=[w], pure=False).result()
                assert got == {
                    "type": "Buffer",
                    "size": MiB,
                    "before": b"pickled!",
                    "after": b"pickled!",
                    "same": False,
                }, (which, w)
        assert counters(c, a)[a]["leases"] == 1  # B's import; pickling granted none
        del x, y, value
        back_to(c, baseline)


def _wrapped(n: int, pool: bool) -> Any:
    """Task: an array of ``n`` float64 (over a pool buffer, or plain) inside an object Dask pickles."""
    import types

    import numpy as np

    return types.SimpleNamespace(arr=T.make_array(n) if pool else np.arange(n, dtype="f8"))


def _wrapped_total(x: Any) -> float:
    return float(x.arr.sum())


def test_arrays_inside_a_pickled_object_are_a_counted_same_host_copy():
    """Dask pickles an object none of our serializers knows, and the arrays in it go in the frames: a copy between
    same-host workers, so counted as a fallback (``pickled``) rather than silent."""
    with nanny_cluster([{}, {}], HOST_POOL) as c:
        a, b = worker_addresses(c)
        for pool in (True, False):
            x = c.submit(_wrapped, 1 << 17, pool, workers=[a], pure=False)
            assert c.submit(_wrapped_total, x, workers=[b], pure=False).result() == float(sum(range(1 << 17)))
        assert counters(c, a)[a]["fallbacks"] == {"pickled": 2}
        # a pickled value with no buffer in it (a number, a string) copies nothing worth counting
        n = c.submit(sum, [1, 2, 3], workers=[a], pure=False)
        assert c.submit(str, n, workers=[b], pure=False).result() == "6"
        assert counters(c, a)[a]["fallbacks"] == {"pickled": 2}


def test_the_page_drops_a_workers_stats_when_its_pool_leaves_with_the_worker_plugin():
    """``client.unregister_worker_plugin("gpupool")``: stats() says the workers have no pool, and the /gpupool page
    no longer shows their last counters as if they had one."""
    import json
    import urllib.request

    import dask_gpupool

    with nanny_cluster([{}, {}], HOST_POOL) as c:
        a, b = worker_addresses(c)
        info = c.scheduler_info()
        host = info["address"].split("://")[1].rsplit(":", 1)[0]
        url = f"http://{host}:{info['services']['dashboard']}/gpupool.json"

        def snapshot() -> dict[str, Any]:
            with urllib.request.urlopen(url, timeout=10) as r:
                return dict(json.loads(r.read().decode()))

        wait_for(lambda: set(snapshot()["workers"]) == {a, b}, what="both workers' stats on the page")
        c.unregister_worker_plugin("gpupool")
        wait_for(lambda: not snapshot()["pools"], what="the pools to leave the registry")
        assert all("error" in s for s in dask_gpupool.stats(c).values())
        assert snapshot()["workers"] == {}


def _allocate_and_raise(nbytes: int) -> None:
    """Task: allocate ``nbytes`` from the pool, then fail (the buffer is a local of the failed frame)."""
    import dask_gpupool

    buf = dask_gpupool.allocate(nbytes)
    raise ValueError(f"failed holding {buf.size} bytes of the pool")


def _allocate_close_and_raise(nbytes: int) -> None:
    """Task: allocate ``nbytes``, then fail, closing the buffer on the way out (docs/operations.rst)."""
    import dask_gpupool

    buf = dask_gpupool.allocate(nbytes)
    try:
        raise ValueError(f"failed holding {buf.size} bytes of the pool")
    except BaseException:
        buf.close()
        raise


def _allocate(nbytes: int) -> int:
    """Task: allocate ``nbytes`` from the pool and give them back; the size allocated."""
    import dask_gpupool

    buf = dask_gpupool.allocate(nbytes)
    size = int(buf.size)
    buf.close()
    return size


def test_tasks_that_fail_after_allocating_never_exhaust_the_pool():
    """Ten tasks each allocate 1 MiB of an 8 MiB ``host`` pool and raise. Distributed's record of a failed task holds
    its frames, and so its buffer, in a reference cycle (docs/operations.rst, "A failed task's pool memory"): with the
    worker's automatic garbage collection off, the buffers stay allocated until a task's allocation finds the pool
    full, which collects them. So each task fails with its own error, never ``PoolExhaustedError``, and 6 MiB can be
    allocated after them, with no collection called by hand. A task that closes its buffer on the way out of its
    failure (the documented way) leaves nothing allocated. Back to the baseline after."""
    import gc

    import pytest

    import dask_gpupool
    from dask_gpupool import GPUPool

    with nanny_cluster([{}], GPUPool(kind="host", max_size="8 MiB")) as c:
        (a,) = worker_addresses(c)
        baseline = c.run(T.resources)
        c.run(gc.disable)
        try:
            for _ in range(10):
                failed = c.submit(_allocate_and_raise, MiB, workers=[a], pure=False)
                with pytest.raises(ValueError, match="failed holding"):
                    failed.result()
                del failed
            assert dask_gpupool.pool_stats(c)[a]["used"] > 0  # held by the failures' cycles: nothing collected them
            assert c.submit(_allocate, 6 * MiB, workers=[a], pure=False).result() == 6 * MiB
            # closed on the way out of the failure, a buffer goes back at once
            used = dask_gpupool.pool_stats(c)[a]["used"]
            for _ in range(3):
                failed = c.submit(_allocate_close_and_raise, MiB, workers=[a], pure=False)
                with pytest.raises(ValueError, match="failed holding"):
                    failed.result()
                del failed
                assert dask_gpupool.pool_stats(c)[a]["used"] == used
        finally:
            c.run(gc.enable)
        back_to(c, baseline)
