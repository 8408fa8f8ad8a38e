"""What a consumer maps of a ``device`` pool's segments: segments retired by a trim or reclaimed by a full pool,
buffers of 8 and 16 GiB, and the producer or the consumer SIGKILLed with a mapping held (gpu-marked: run on
the GPU machine)."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from conftest import (
    ONE_GPU,
    back_to,
    counters,
    gpus,
    layout_workers,
    nanny_cluster,
    pid_of,
    wait_for,
    wait_forgotten,
    warm_up,
    worker_addresses,
)

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import testing as T

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.mark.parametrize("memory", ["auto", "legacy"])
def test_trim_frees_retired_segments_once_the_peer_let_go(memory):
    """The retire protocol: A retires its segments; B's live import keeps one; when B lets go it
    unmaps it and says so, and A frees it. New buffers go to new segments, mapped afresh. Segments of VMM memory
    (``auto``) or of legacy IPC memory (``cuMemAlloc``; a new segment may get a freed one's address, and a handle
    of its own)."""
    gpus(1)
    plugin = GPUPool(kind="device", max_size="4 GiB", segment_memory=memory)
    with nanny_cluster([ONE_GPU, ONE_GPU], plugin) as c:
        a, b = worker_addresses(c)
        made_of = "vmm" if memory == "auto" else memory
        why = dask_gpupool.stats(c)[a]["routing"]["segment-memory"]
        want = (
            "legacy (gpupool.segment-memory)"
            if memory == "legacy"
            else "vmm (auto): this worker does not listen over UCX"
        )
        assert why == want, why
        baseline = warm_up(c, a, b)
        # after a handoff each way, so that each worker's copy of the registry holds both rows (it is filled as
        # pools are looked up, not at start: before that it may lack the peer's row)
        assert c.run(T.segment_memory, workers=[b])[b] == {"pool": made_of, "row": made_of, a: made_of, b: made_of}
        x = c.submit(T.fill, 64 * MiB, 3, workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.all_equal, y, 3, workers=[b], pure=False).result()
        del x
        mapped = c.run(T.mapped_segments, workers=[b])[b]
        assert mapped >= 1
        trimmed = dask_gpupool.trim(c)
        assert trimmed[a]["retire_below"] > 0 and trimmed[a]["segments_retiring"] >= 1, trimmed
        # B still reads its import: the segment under it stays
        assert c.submit(T.all_equal, y, 3, workers=[b], pure=False).result()
        assert counters(c, a)[a]["segments_retiring"] >= 1
        del y
        wait_for(lambda: counters(c, a)[a]["segments_retiring"] == 0, what="A to free its retired segments")
        assert c.run(T.mapped_segments, workers=[b])[b] == 0
        assert counters(c, b)[b]["segments_released"] >= 1
        stats = dask_gpupool.pool_stats(c)
        assert stats[a]["used"] == 0 and stats[a]["reserved"] == 0, stats[a]
        # after the trim: new segments, mapped afresh, right bytes
        x = c.submit(T.fill, 32 * MiB, 7, workers=[a], pure=False)
        assert c.submit(T.all_equal, c.submit(T.keep, x, workers=[b], pure=False), 7, workers=[b], pure=False).result()
        assert c.run(T.mapped_segments, workers=[b])[b] == 1
        del x
        dask_gpupool.trim(c)
        wait_for(lambda: counters(c, a)[a]["segments"] == 0, what="A to free the second segment")
        back_to(c, baseline)


def test_a_value_in_a_segment_the_peer_released_after_a_trim_comes_as_a_copy_and_the_segment_is_freed():
    """After a trim, B unmaps a retired segment and releases it with its claims; a value still living in that
    segment and fetched again goes to B as a copy (fallback ``retired-segment``), with the right bytes, instead of
    a new mapping whose claims the owner's ledger would never see settled; and A frees the segment once the value
    goes, not when B exits."""
    gpus(1)
    plugin = GPUPool(kind="device", max_size="4 GiB")
    with nanny_cluster([ONE_GPU, ONE_GPU], plugin) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        x1 = c.submit(T.fill, 64 * MiB, 1, workers=[a], pure=False)
        x2 = c.submit(T.fill, 64 * MiB, 2, workers=[a], pure=False)  # the same segment as x1
        assert c.submit(T.all_equal, x1, 1, workers=[b], pure=False).result()  # B maps the segment
        keys = [x1.key]
        del x1
        wait_forgotten(c, keys)
        wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="B to release x1")
        dask_gpupool.trim(c)
        wait_for(lambda: c.run(T.mapped_segments, workers=[b])[b] == 0, what="B to unmap the retired segment")
        before = counters(c, b)[b]["fallbacks"].get("retired-segment", 0)
        assert c.submit(T.all_equal, x2, 2, workers=[b], pure=False).result()
        assert counters(c, b)[b]["fallbacks"].get("retired-segment", 0) == before + 1
        assert c.run(T.mapped_segments, workers=[b])[b] == 0  # not mapped again
        keys = [x2.key]
        del x2
        wait_forgotten(c, keys)
        wait_for(lambda: counters(c, a)[a]["segments_retiring"] == 0, what="A to free its retired segments")
        assert dask_gpupool.pool_stats(c)[a]["reserved"] == 0
        back_to(c, baseline)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["one-gpu", "two-gpus"])
def test_a_full_pool_reclaims_a_large_spare_that_the_consumer_still_maps(layout):
    """A 1.25 GiB buffer (a segment of its own: segments are 1 GiB) is handed over and dropped: its spare stays
    mapped by the consumer. A 1.875 GiB allocation in A's 3 GiB pool then does not fit beside it (and the warm-up's
    1 GiB segment), so A reclaims the spare (its row's ``reclaim``), B unmaps it and releases it (one more segment
    released), A frees it, and the allocation succeeds with the right bytes, with no trim()."""
    workers = [{**w, "memory_limit": 0} for w in layout_workers(layout)]
    plugin = GPUPool(kind="device", max_size="3 GiB")
    with nanny_cluster(workers, plugin) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        x = c.submit(T.fill, 5 << 28, 3, workers=[a], pure=False)  # 1.25 GiB
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.describe, y, workers=[b], pure=False).result()["imported"]
        assert c.submit(T.all_equal, y, 3, workers=[b], pure=False).result()
        del x, y
        wait_for(lambda: counters(c, a)[a]["leases"] == 0 and counters(c, a)[a]["used"] == 0, what="the lease to end")
        released = counters(c, b)[b]["segments_released"]
        big = c.submit(T.fill, 15 << 27, 4, workers=[a], pure=False)  # 1.875 GiB
        assert c.submit(T.all_equal, big, 4, workers=[a], pure=False).result()
        assert counters(c, b)[b]["segments_released"] == released + 1  # B gave the 1.25 GiB spare back
        assert c.submit(T.all_equal, c.submit(T.keep, big, workers=[b], pure=False), 4, workers=[b]).result()
        del big
        back_to(c, baseline, timeout=120)


#: Segment memory of the large-buffer tests: VMM (the default over TCP), and legacy IPC memory.
LARGE_MEMORY = {"vmm": {}, "legacy": {"segment_memory": "legacy"}}


@pytest.mark.timeout(300)  # its own waits run to 120 s: let them say what differs
@pytest.mark.parametrize("memory", list(LARGE_MEMORY))
@pytest.mark.parametrize("gib", [8, 16])
@pytest.mark.parametrize("layout", ["one-gpu", "two-gpus"])
def test_buffers_of_8_and_16_gib_hand_over_zero_copy(layout, gib, memory):
    """Any size: with VMM segments (or legacy IPC ones) an 8 or 16 GiB pool buffer
    reaches the consumer on the same GPU or the other one mapped, not copied, with the right bytes at its start,
    middle and end and everywhere (all_equal), and everything back to the baseline once it is dropped. Workers
    without a host memory limit: Dask counts a device value's bytes as managed memory and would spill a 16 GiB
    result through the host."""
    nbytes = gib << 30
    workers = [{**w, "memory_limit": 0} for w in layout_workers(layout)]
    plugin = GPUPool(kind="device", max_size=f"{2 * gib + 2} GiB", **LARGE_MEMORY[memory])
    with nanny_cluster(workers, plugin) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        before = counters(c)
        x = c.submit(T.fill, nbytes, 7, workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.describe, y, workers=[b], pure=False).result()["imported"]
        assert c.submit(T.all_equal, y, 7, workers=[b], pure=False).result()
        now = counters(c)
        assert now[b]["zero_copy_bytes"] - before[b]["zero_copy_bytes"] == nbytes, now[b]
        assert now[b]["copied_bytes"] == before[b]["copied_bytes"] and now[a]["fallbacks"] == before[a]["fallbacks"]
        del x, y
        back_to(c, baseline, timeout=120)


def successors(workers: list[str], dead: str, kept: str) -> list[str]:
    """The worker that replaced ``dead`` beside ``kept``, as a one-item list, from one snapshot of the workers; empty
    until the cluster is two workers again without ``dead``."""
    if len(workers) != 2 or dead in workers or kept not in workers:
        return []
    return [w for w in workers if w != kept]


def own_baseline(c: Any, b: str) -> dict[str, Any]:
    """B's resources before it maps anything of a peer's, taken once B checked a buffer of its own (so CuPy is
    loaded): what B should hold again once its producer is gone and B let go of what it mapped."""
    own = c.submit(T.fill, MiB, 1, workers=[b], pure=False)
    assert c.submit(T.all_equal, own, 1, workers=[b], pure=False).result()
    del own
    wait_for(lambda: counters(c, b)[b]["used"] == 0, what="B's own buffer to go")
    return c.run(T.resources, workers=[b])


@pytest.mark.parametrize("layout", ["one-gpu", "two-gpus"])
@pytest.mark.parametrize("memory", ["auto", "legacy"])
def test_sigkill_of_the_producer_leaves_the_consumers_device_mapping_readable(memory, layout):
    """A's process dies while B holds an import: B still reads A's bytes, even once A's GPU memory is reused.

    Across GPUs this needs VMM segments (the default) or legacy IPC ones (``segment-memory: legacy``): pool memory
    read from another GPU after its owner died gave CUDA_ERROR_CONTAINED (benchmarks/exporter_death.py, the chaos
    run on two H200s); legacy IPC memory did not (scripts/probes/handle_types.py on two H200s).
    """
    workers = layout_workers(layout)
    with nanny_cluster(workers, GPUPool(kind="device", max_size="1 GiB", segment_memory=memory)) as c:
        a, b = worker_addresses(c)
        base_b = own_baseline(c, b)
        x = c.submit(T.fill, 16 * MiB, 6, workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.describe, y, workers=[b], pure=False).result()["imported"]
        os.kill(pid_of(c, a), signal.SIGKILL)
        # the dead exporter's memory stays mapped and right until B lets go
        assert c.submit(T.all_equal, y, 6, workers=[b], pure=False).result()
        # one snapshot per look: two calls could see [a, b] and then [b] (A removed, its successor not yet there)
        wait_for(lambda: successors(worker_addresses(c), a, b), what="A's restart")
        (a2,) = successors(worker_addresses(c), a, b)
        # A's successor fills most of the GPU A used: the memory under B's import is not handed out again
        c.submit(T.scribble_all, 768 * MiB, 0x55, workers=[a2], pure=False).result()
        assert c.submit(T.all_equal, y, 6, workers=[b], pure=False).result()
        del x, y
        back_to(c, base_b, workers=[b])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("memory", list(LARGE_MEMORY))
@pytest.mark.parametrize("killed", ["producer", "consumer"])
@pytest.mark.parametrize("layout", ["one-gpu", "two-gpus"])
def test_sigkill_with_an_8_gib_mapping_held(layout, killed, memory):
    """Faults at any size: B maps an 8 GiB buffer of A's (VMM segments, or legacy IPC ones). A SIGKILLed:
    B still reads every byte right. B SIGKILLed: A ends its lease and its pool is back to 0 bytes used."""
    nbytes = 8 << 30
    workers = [{**w, "memory_limit": 0} for w in layout_workers(layout)]
    plugin = GPUPool(kind="device", max_size="18 GiB", **LARGE_MEMORY[memory])
    with nanny_cluster(workers, plugin) as c:
        a, b = worker_addresses(c)
        base_b = own_baseline(c, b)
        x = c.submit(T.fill, nbytes, 9, workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.describe, y, workers=[b], pure=False).result()["imported"]
        if killed == "consumer":
            assert counters(c, a)[a]["leases"] == 1
            os.kill(pid_of(c, b), signal.SIGKILL)
            del y  # not computed again on B's successor
            wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="A to end the dead consumer's lease")
            del x
            wait_for(lambda: counters(c, a)[a]["used"] == 0, timeout=120, what="A's pool bytes to return")
            return
        os.kill(pid_of(c, a), signal.SIGKILL)
        assert c.submit(T.all_equal, y, 9, workers=[b], pure=False).result()
        del x, y
        back_to(c, base_b, timeout=120, workers=[b])
