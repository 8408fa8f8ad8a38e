"""Memory counted once: a borrowed value (imported from a peer's pool under a lease) costs its borrower nothing in
Dask's accounting and is never spilled by it; its owner counts a lent value once and spills what frees memory.

Real Nanny workers with ``host`` pools; each test ends with every lease ended and the workers' resources back to their
baseline.
"""

from __future__ import annotations

from typing import Any

import dask
from conftest import back_to, counters, nanny_cluster, wait_for, warm_up, worker_addresses

from dask_gpupool import GPUPool
from dask_gpupool import testing as T

MiB = 1 << 20

#: The nanny (in the test process) reads its terminate threshold from this process's config.
NO_TERMINATE = {"distributed.worker.memory.terminate": False}

#: Room for six 8 MiB arrays in one pool, and more.
POOL = GPUPool(kind="host", max_size="128 MiB")


def _spilling(limit: str) -> dict[str, Any]:
    """Nanny options: spill by managed memory only, at half of ``limit`` (no pause, no spill by process memory)."""
    memory = {"target": 0.5, "spill": False, "pause": False, "terminate": False}
    return {"memory_limit": limit, "config": {f"distributed.worker.memory.{k}": v for k, v in memory.items()}}


def test_a_borrower_never_spills_a_borrowed_value():
    """B (target 32 MiB of managed memory) holds six 8 MiB arrays of A's pool, each under two keys (the fetched
    dependency and B's own result): 96 MiB by ``sizeof``, none of it B's memory. B spills none of them."""
    with dask.config.set(NO_TERMINATE), nanny_cluster([{}, _spilling("64 MiB")], POOL) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        xs = [c.submit(T.make_array, MiB, workers=[a], pure=False) for _ in range(6)]
        ys = [c.submit(T.keep, x, workers=[b], pure=False) for x in xs]
        c.gather(ys)
        assert c.run(T.spilled_bytes, workers=[b])[b] == {}
        assert counters(c, a)[a]["leases"] == 6  # zero-copy, and still: B holds a lease on each
        totals = c.gather([c.submit(T.total, y, workers=[b], pure=False) for y in ys])
        assert totals == [float(sum(range(MiB)))] * 6
        assert c.run(T.spilled_bytes, workers=[b])[b] == {}
        del xs, ys
        wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="B's leases to end")
        back_to(c, baseline)
