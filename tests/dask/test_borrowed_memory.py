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
from dask_gpupool.dask.spilling import CountOnceLRU, count_once, count_plainly

MiB = 1 << 20

#: The nanny (in the test process) reads its terminate threshold from this process's config.
NO_TERMINATE = {"distributed.worker.memory.terminate": False}

#: Room for six 8 MiB arrays in one pool, and more.
POOL = GPUPool(kind="host", max_size="128 MiB")


def _limited(limit: str, **memory: Any) -> dict[str, Any]:
    """Nanny options: ``memory_limit`` ``limit`` and ``distributed.worker.memory.<key>`` set from ``memory``."""
    return {"memory_limit": limit, "config": {f"distributed.worker.memory.{k}": v for k, v in memory.items()}}


def _spilling(limit: str) -> dict[str, Any]:
    """Nanny options: spill by managed memory only, at half of ``limit`` (no pause, no spill by process memory)."""
    return _limited(limit, target=0.5, spill=False, pause=False, terminate=False)


def _six_reads(c: Any, a: str, b: str) -> tuple[list[Any], list[Any], list[float]]:
    """B keeps six 32 MiB arrays of A's pool and reads each (a task each); returns A's and B's futures and the totals
    B read, which are asserted."""
    xs = [c.submit(T.make_array, 4 * MiB, workers=[a], pure=False) for _ in range(6)]
    ys = [c.submit(T.keep, x, workers=[b], pure=False) for x in xs]
    expected = [float(sum(range(4 * MiB)))] * 6
    assert c.gather(c.map(T.total, ys, workers=[b], pure=False)) == expected
    return xs, ys, expected


def _accounting(dask_worker: Any) -> dict[str, Any]:
    """client.run target: what the worker's spill buffer counts (managed bytes, offset) and holds in memory."""
    fast = dask_worker.data.fast
    return {
        "counted_once": isinstance(fast, CountOnceLRU),
        "managed": int(fast.total_weight),
        "offset": int(fast.offset),
        "lent_away": int(getattr(fast, "lent_away", 0)),
        "in_memory": sorted(str(k) for k in fast),
    }


def _evict(dask_worker: Any) -> int:
    """client.run target: one eviction as Dask's memory manager asks for it past the ``spill`` threshold."""
    return int(dask_worker.data.evict())


def _evict_all(dask_worker: Any) -> list[int]:
    """client.run target: evictions until one fails (-1) or nothing is left in memory."""
    out = []
    while dask_worker.data.fast:
        out.append(int(dask_worker.data.evict()))
        if out[-1] == -1:
            break
    return out


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
        seen = c.run(_accounting, workers=[b])[b]
        assert seen["counted_once"] and seen["managed"] == 0 and len(seen["in_memory"]) == 12, seen
        where = counters(c)  # where the memory is: A's pool, lent to B; B borrows it
        assert where[a]["pool_bytes"] >= 48 * MiB and where[a]["lease_bytes"] == 48 * MiB, where[a]
        assert where[b]["borrowed_bytes"] == 48 * MiB and where[a]["borrowed_bytes"] == 0, where[b]
        # Past the spill threshold (process memory), Dask's memory manager asks for evictions: none frees anything.
        assert c.run(_evict, workers=[b])[b] == -1
        totals = c.gather([c.submit(T.total, y, workers=[b], pure=False) for y in ys])
        assert totals == [float(sum(range(MiB)))] * 6
        assert c.run(T.spilled_bytes, workers=[b])[b] == {}
        del xs, ys
        wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="B's leases to end")
        assert counters(c, b)[b]["borrowed_bytes"] == 0
        back_to(c, baseline)


def test_an_owner_spills_values_that_free_memory_and_counts_a_lent_value_until_its_last_lease_ends():
    """A (target 32 MiB) lends three 8 MiB arrays to B, then makes more: it spills only the values no lease holds,
    refuses to spill the lent ones, counts a lent value Dask forgot there until B's lease ends, and B reads the same
    bytes throughout, A's pool reused meanwhile."""
    with dask.config.set(NO_TERMINATE), nanny_cluster([_spilling("64 MiB"), {}], POOL) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        xs = [c.submit(T.make_array, MiB, workers=[a], pure=False) for _ in range(3)]
        ys = [c.submit(T.keep, x, workers=[b], pure=False) for x in xs]
        c.gather(c.map(T.total, ys, workers=[b], pure=False))
        assert counters(c, a)[a]["leases"] == 3
        zs = [c.submit(T.make_array, MiB, workers=[a], pure=False) for _ in range(3)]
        c.gather(c.map(T.total, zs, workers=[a], pure=False))
        spilled = c.run(T.spilled_bytes, workers=[a])[a]
        assert spilled and set(spilled) <= {z.key for z in zs}, spilled  # over target: only what frees memory
        assert c.run(_evict_all, workers=[a])[a][-1] == -1  # the lent values stay
        seen = c.run(_accounting, workers=[a])[a]
        assert sorted(seen["in_memory"]) == sorted(x.key for x in xs), seen
        lent = seen["managed"]
        assert lent >= 3 * 8 * MiB, seen  # counted once, by their owner

        del xs  # Dask forgets them on A; B's leases keep their memory
        wait_for(lambda: c.run(_accounting, workers=[a])[a]["in_memory"] == [], what="A to forget the lent values")
        seen = c.run(_accounting, workers=[a])[a]
        assert seen["managed"] == 0 and seen["offset"] == seen["lent_away"] == lent, seen
        for value in range(1, 4):  # A's pool reused around the lent memory
            c.submit(T.scribble_all, 16 * MiB, value, workers=[a], pure=False).result()
        totals = c.gather(c.map(T.total, ys, workers=[b], pure=False))
        assert totals == [float(sum(range(MiB)))] * 3  # nothing read under a lease changed
        # One comes back to A (its own memory, taken back): its key weighs it, and the offset no longer does.
        back = c.submit(T.total, ys[0], workers=[a], pure=False)
        assert back.result() == float(sum(range(MiB)))
        del back
        kept = [ys[0].key]
        wait_for(lambda: c.run(_accounting, workers=[a])[a]["in_memory"] == kept, what="A to keep ys[0] only")
        seen = c.run(_accounting, workers=[a])[a]
        assert seen["managed"] == lent // 3, seen
        assert seen["offset"] == seen["lent_away"] == lent - lent // 3, seen

        del ys, zs
        wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="B's leases to end")
        wait_for(lambda: c.run(_accounting, workers=[a])[a]["offset"] == 0, what="A to stop counting them")
        back_to(c, baseline)


def test_the_worker_plugin_counts_once_on_dasks_spill_buffer_and_puts_it_back(tmp_path: Any):
    """What :func:`count_once` relies on in Dask's ``SpillBuffer``: a ``zict.Buffer`` whose ``fast`` part is a
    ``zict.LRU`` it may replace, whose ``evict()`` returns what that LRU's returns. Fails if Dask changes it."""
    import numpy as np
    import zict
    from distributed.spill import SpillBuffer

    data = SpillBuffer(str(tmp_path), target=1 << 20)
    data["a"] = np.ones(1000)
    data["b"] = np.ones(2000)
    assert count_once(data) == 1 and count_once(data) == 0  # once
    assert isinstance(data.fast, CountOnceLRU) and set(data.fast) == {"a", "b"}
    assert data.fast.total_weight >= 3000 * 8  # values of no pool weigh their sizeof
    weight = data.evict()  # what Dask's memory manager calls past the spill threshold
    assert weight >= 8000 and "a" in data.slow and list(data.fast) == ["b"]
    data["c"] = np.ones(1 << 18)  # 2 MiB: heavier than the target, straight to disk
    assert "c" in data.slow and "c" not in data.fast
    count_plainly(data)
    assert type(data.fast) is zict.LRU and list(data.fast) == ["b"]
    assert float(data["a"].sum()) == 1000.0 and "a" in data.fast


def _resident(dask_worker: Any) -> dict[str, Any]:
    """client.run target: this process's resident bytes (what the nanny reads), the part of it that is peers' pool
    pages, and the worker's status."""
    import psutil

    from dask_gpupool.memory.lifetime import peer_resident_bytes

    return {
        "rss": psutil.Process().memory_info().rss,
        "peer": peer_resident_bytes(),
        "status": str(dask_worker.status),
    }


def test_a_borrowers_resident_memory_leaves_out_the_borrowed_pages_past_its_spill_threshold():
    """B (limit 320 MiB, spill at 70%) reads six 32 MiB arrays of A's pool: 192 MiB of A's pages in B's ``rss``
    would take it past 224 MiB, where the nanny's figure says B holds memory it does not own. B drops them from its
    page tables instead: its ``rss`` stays under the threshold, it neither spills nor pauses, and it reads the same
    values again (the pages fault back in, unchanged)."""
    limited = _limited("320 MiB", target=False, spill=0.7, pause=0.8, terminate=False)
    pool = GPUPool(kind="host", max_size="512 MiB")
    with dask.config.set(NO_TERMINATE), nanny_cluster([{}, limited], pool) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        xs, ys, expected = _six_reads(c, a, b)
        assert counters(c, b)[b]["borrowed_bytes"] == 192 * MiB
        threshold = int(0.7 * 320 * MiB)
        wait_for(lambda: c.run(_resident, workers=[b])[b]["rss"] < threshold, what="B's rss under its threshold")
        seen = c.run(_resident, workers=[b])[b]
        assert seen["peer"] < 192 * MiB and seen["status"] == "Status.running", seen
        assert c.gather(c.map(T.total, ys, workers=[b], pure=False, key=[f"again-{i}" for i in range(6)])) == expected
        assert c.run(T.spilled_bytes, workers=[b])[b] == {}
        del xs, ys
        wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="B's leases to end")
        back_to(c, baseline)


def _own_pool(dask_worker: Any) -> dict[str, Any]:
    """client.run target: this worker's ``rss``, its pool's resident bytes and bytes in live buffers, its status."""
    import psutil

    from dask_gpupool.handoff.registry import active_service

    service = active_service()
    assert service is not None and service.pool.shared_host is not None
    attributes = service.pool.shared_host.attributes
    return {
        "rss": psutil.Process().memory_info().rss,
        "resident": attributes.reserved_mem_current,
        "used": attributes.used_mem_current,
        "status": str(dask_worker.status),
    }


def test_a_worker_past_its_spill_threshold_gives_its_pools_free_pages_back():
    """A (limit 256 MiB, spill at 70%) wrote and freed 160 MiB of its pool: freed pages stay resident (for the next
    buffer there), which puts A's ``rss`` past 179 MiB with nothing Dask can spill, so Dask would pause A or spill its
    values to disk while its pool holds memory no value uses. A gives those pages back instead: its ``rss`` goes under
    the threshold, it does not pause, and its pool still hands out zeroed-then-written buffers."""
    limited = _limited("256 MiB", target=False, spill=0.7, pause=0.8, terminate=False)
    pool = GPUPool(kind="host", max_size="512 MiB")
    with dask.config.set(NO_TERMINATE), nanny_cluster([limited, {}], pool) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        c.submit(T.scribble_all, 160 * MiB, 7, workers=[a], pure=False).result()
        threshold = int(0.7 * 256 * MiB)
        wait_for(lambda: c.run(_own_pool, workers=[a])[a]["rss"] < threshold, what="A's rss under its threshold")
        seen = c.run(_own_pool, workers=[a])[a]
        assert seen["resident"] < 16 * MiB and seen["status"] == "Status.running", seen
        x = c.submit(T.make_array, 4 * MiB, workers=[a], pure=False)
        assert c.submit(T.total, x, workers=[b], pure=False).result() == float(sum(range(4 * MiB)))
        assert c.run(T.spilled_bytes, workers=[a])[a] == {}
        del x
        wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="B's lease to end")
        back_to(c, baseline)


def test_an_owner_counts_a_copy_it_staged_for_a_peer_until_the_peers_lease_ends():
    """A's plain NumPy arrays, asked for by B, are copied into A's pool and handed over (staged): the copies are
    A's memory, lent to B, which counts them as nothing. A counts each once, beside the arrays themselves, and
    after it forgot them, until B lets go; B reads the values A made."""
    with dask.config.set(NO_TERMINATE), nanny_cluster([_spilling("64 MiB"), {}], POOL) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        xs = [c.submit(T.plain_fill, 4 * MiB, i + 1, workers=[a], pure=False) for i in range(3)]
        ys = [c.submit(T.keep, x, workers=[b], pure=False) for x in xs]
        assert c.gather(c.map(T.total, ys, workers=[b], pure=False)) == [float(4 * MiB * (i + 1)) for i in range(3)]
        assert counters(c, a)[a]["leases"] == 3  # staged and handed over, not copied through the comm
        assert c.run(_accounting, workers=[b])[b]["managed"] == 0
        seen = c.run(_accounting, workers=[a])[a]
        assert seen["managed"] >= 12 * MiB and seen["offset"] == seen["lent_away"] == 12 * MiB, seen
        del xs  # A forgets its arrays; B's leases keep the copies
        wait_for(lambda: c.run(_accounting, workers=[a])[a]["in_memory"] == [], what="A to forget its arrays")
        seen = c.run(_accounting, workers=[a])[a]
        assert seen["managed"] == 0 and seen["offset"] == seen["lent_away"] == 12 * MiB, seen
        del ys
        wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="B's leases to end")
        wait_for(lambda: c.run(_accounting, workers=[a])[a]["offset"] == 0, what="A to stop counting the copies")
        back_to(c, baseline)


def test_a_borrower_drops_the_pages_it_read_once_each_task_ends_past_its_threshold():
    """B (limit 320 MiB, its periodic memory checks a minute apart) reads six 32 MiB arrays of A's pool one task
    after another: 192 MiB of A's pages would pile up in B's ``rss`` between two periodic checks, and the nanny,
    checking as often, would restart B for memory that is not its own. B drops them as each task ends once past its
    threshold, so its ``rss`` is under it when the last read ends, with no periodic check run."""
    limited = _limited("320 MiB", target=False, spill=0.7, pause=False, terminate=False, **{"monitor-interval": "60s"})
    pool = GPUPool(kind="host", max_size="512 MiB")
    with dask.config.set(NO_TERMINATE), nanny_cluster([{}, limited], pool) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        xs, ys, _ = _six_reads(c, a, b)
        seen = c.run(_resident, workers=[b])[b]
        assert seen["rss"] < int(0.7 * 320 * MiB) and seen["peer"] < 192 * MiB, seen
        assert c.run(T.spilled_bytes, workers=[b])[b] == {}
        del xs, ys
        wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="B's leases to end")
        back_to(c, baseline)
