"""A value a worker received zero-copy and passes on is mapped from its exporter, under the next worker's own lease.

B holds an import of A's memory and C asks B for it. B asks A (over
its link) to grant C a lease on the same memory and sends C A's descriptor; C
maps A's pool itself. The memory then lives until C lets go, whatever B does.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import (
    HOST_POOL,
    back_to,
    counters,
    kill_the_middle_of_a_chain,
    kind_cluster,
    nanny_cluster,
    pool_kinds,
    wait_for,
    wait_forgotten,
    warm_up,
    worker_addresses,
)

from dask_gpupool import GPUPool
from dask_gpupool import testing as T
from dask_gpupool.testing import faults as F

MiB = 1 << 20


def _warm(c: Any, *workers: str) -> dict[str, Any]:
    """Links and mappings between every pair (both ways); returns the resource baseline."""
    baseline: dict[str, Any] = {}
    for i, w in enumerate(workers):
        for v in workers[i + 1 :]:
            baseline = warm_up(c, w, v)
    return baseline


def test_a_value_passed_on_is_mapped_from_its_exporter_and_outlives_the_middle_worker():
    with nanny_cluster([{}, {}, {}], HOST_POOL) as c:
        a, b, w = worker_addresses(c)
        baseline = _warm(c, a, b, w)
        before = counters(c)
        x = c.submit(T.make_buffer, MiB, b"two hops", workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        z = c.submit(T.keep, y, workers=[w], pure=False)
        assert c.submit(T.describe, z, workers=[w], pure=False).result() == {
            "type": "cuda.core._memory._buffer.Buffer",
            "imported": True,
            "in_own_pool": False,
        }
        now = counters(c)
        assert now[b]["forwards"] - before[b]["forwards"] == 1
        assert now[w]["zero_copy_bytes"] - before[w]["zero_copy_bytes"] == MiB
        assert now[w]["copied_bytes"] == before[w]["copied_bytes"]
        assert now[b]["copied_out_bytes"] == before[b]["copied_out_bytes"]
        assert now[a]["leases"] == 2 and now[b]["fallbacks"] == {} and now[w]["fallbacks"] == {}
        # B and A drop their keys: only W's lease (granted by A, through B) keeps the memory
        del x, y
        wait_for(lambda: counters(c, a)[a]["leases"] == 1, what="B's lease on A to end")
        for _ in range(8):
            c.submit(T.scribble_all, MiB, ord("S"), workers=[a], pure=False).result()
        assert c.submit(T.head, z, 8, workers=[w], pure=False).result() == b"two hops"
        # the third hop goes back to A, whose memory it is: A takes its own buffer back, nothing mapped or copied
        back = c.submit(T.keep, z, workers=[a], pure=False)
        assert c.submit(T.describe, back, workers=[a], pure=False).result()["in_own_pool"]
        assert c.submit(T.head, back, 8, workers=[a], pure=False).result() == b"two hops"
        got = counters(c)
        assert got[w]["fallbacks"] == {} and got[w]["forwards"] == 1, got[w]
        assert got[a]["returns"] - before[a]["returns"] == 1
        assert got[a]["copied_bytes"] == before[a]["copied_bytes"] and got[a]["imports"] == before[a]["imports"]
        assert got[a]["leases"] == 1  # W's; the one A had in its own name ended when A took the buffer back
        del back
        del z
        back_to(c, baseline)


def test_a_chain_of_three_forwards_maps_the_first_exporter_each_time():
    with nanny_cluster([{}, {}, {}, {}], HOST_POOL) as c:
        a, b, w, v = worker_addresses(c)
        baseline = _warm(c, a, b, w, v)
        x = c.submit(T.make_array, 100_003, workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        z = c.submit(T.keep, y, workers=[w], pure=False)
        u = c.submit(T.keep, z, workers=[v], pure=False)
        total = c.submit(T.total, u, workers=[v], pure=False).result()
        assert total == float(sum(range(100_003)))
        assert c.submit(T.describe, u, workers=[v], pure=False).result()["imported"]
        got = counters(c)
        assert got[b]["forwards"] >= 1 and got[w]["forwards"] >= 1
        assert got[a]["leases"] == 3  # B's, W's and V's, all on A's memory
        assert all(got[k]["fallbacks"] == {} for k in (a, b, w, v))
        del x, y, z, u
        back_to(c, baseline)


def test_a_staged_arrays_source_goes_with_its_key():
    """The export waits for a staging copy (``handoff-ordering: sync``), so the copy has finished when the header
    goes out and the lease keeps only the staged copy: the source array goes with its key."""
    plugin = GPUPool(kind="host", max_size="64 MiB")
    with nanny_cluster([{}, {}], plugin) as c:
        a, b = worker_addresses(c)
        c.run(T.route_sizes, stage=64 << 10, workers=[a])  # host pools stage nothing by default
        x = c.submit(T.tracked_plain_fill, 2 * MiB, 7, workers=[a], pure=False)  # NumPy's own memory
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.total, y, workers=[b], pure=False).result() == 7 * 2 * MiB
        keys = [x.key]
        del x
        wait_forgotten(c, keys)
        assert c.run(T.tracked_alive, workers=[a])[a] == 0
        del y
        wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="B to release the staged copy")
        assert c.run(T.tracked_alive, workers=[a])[a] == 0


def test_a_plain_array_staged_for_one_worker_is_passed_on_as_the_staged_copy():
    """A NumPy array outside every pool, staged into A's pool for B (a stage threshold given to A: host pools stage
    nothing by default), and passed on by B to W: W maps A's staged copy (a forward, no copy), and reads it after A's
    and B's keys are gone and A's pool was scribbled over."""
    import numpy as np

    with nanny_cluster([{}, {}, {}], HOST_POOL) as c:
        a, b, w = worker_addresses(c)
        c.run(T.route_sizes, stage=64 << 10, workers=[a])
        baseline = _warm(c, a, b, w)
        before = counters(c)
        x = c.submit(T.plain_fill, 2 * MiB, 7, workers=[a], pure=False)  # NumPy's own memory, not the pool
        y = c.submit(T.keep, x, workers=[b], pure=False)
        z = c.submit(T.keep, y, workers=[w], pure=False)
        assert c.submit(T.array_equal, z, 7, workers=[w], pure=False).result()
        now = counters(c)
        assert now[a]["fallbacks"] == {**before[a]["fallbacks"], "staged-in-pool": 1}, now[a]
        assert now[a]["pool_staged_bytes"] - before[a]["pool_staged_bytes"] == 2 * MiB
        assert now[b]["forwards"] - before[b]["forwards"] == 1
        assert now[w]["zero_copy_bytes"] - before[w]["zero_copy_bytes"] == 2 * MiB
        assert now[w]["copied_bytes"] == before[w]["copied_bytes"]
        assert now[b]["copied_out_bytes"] == before[b]["copied_out_bytes"]
        del x, y
        wait_for(lambda: counters(c, a)[a]["leases"] == 1, what="B's lease on A's staged copy to end")
        for _ in range(8):
            c.submit(T.scribble_all, 2 * MiB, 0, workers=[a], pure=False).result()
        assert c.submit(T.array_equal, z, 7, workers=[w], pure=False).result()
        assert c.submit(T.total, z, workers=[w], pure=False).result() == float(np.full(2 * MiB, 7, "u1").sum())
        del z
        back_to(c, baseline)


@pool_kinds("one-gpu", "two-gpus")
def test_sigkill_of_the_middle_worker_leaves_the_last_ones_memory_readable(kind):
    """B is killed after passing A's memory on to W: A ends B's lease, W's lives on, and W reads the right bytes
    after A's pool was scribbled over. Across GPUs A and W are on GPU 0 and B on GPU 1: every hop crosses GPUs."""
    nbytes, max_size = (MiB, "64 MiB") if kind == "host" else (8 * MiB, "1 GiB")
    with kind_cluster(kind, max_size, n=3) as c:
        a, b, w = worker_addresses(c)
        baseline = _warm(c, a, w)  # B's links and mappings go with it
        kill_the_middle_of_a_chain(c, a, b, w, nbytes, 2 * nbytes)
        survivors = [a, w]
        back_to(c, {k: baseline[k] for k in survivors}, workers=survivors)


def test_a_reply_of_values_to_pass_on_is_serialized_on_the_event_loop():
    """As for the exporter's own buffers: no hop to Dask's offload thread for a reply of descriptors."""
    with nanny_cluster([{}, {}, {}], HOST_POOL) as c:
        a, b, w = worker_addresses(c)
        x = c.submit(T.make_buffer, 12 * MiB, b"big", workers=[a], pure=False)  # over Dask's 10 MiB offload size
        y = c.submit(T.keep, x, workers=[b], pure=False)
        y.result()
        assert c.run(T.serialized_inline, [y.key], w, workers=[b])[b]
        assert c.submit(T.head, y, 3, workers=[w], pure=False).result() == b"big"
        assert counters(c, b)[b]["forwards"] == 1


def test_a_value_imported_twice_is_still_passed_on_once_its_other_import_went():
    """B fetches one allocation of A under two keys: two imports (one shared mapping), two Buffers at one address.
    A view index of one Buffer per address, the last one added, would forget the other one's arrays once that
    import went, and B would send them as copies: B still passes them on as pool memory."""
    n = 100_000
    with nanny_cluster([{}, {}, {}], HOST_POOL) as c:
        a, b, w = worker_addresses(c)
        baseline = _warm(c, a, b, w)
        x = c.submit(T.make_array, n, workers=[a], pure=False)
        twin = c.submit(T.keep, x, workers=[a], pure=False)  # the same array under another key
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
        assert c.submit(T.total, z, workers=[w], pure=False).result() == float(sum(range(n)))
        now = counters(c)
        assert now[b]["fallbacks"] == before[b]["fallbacks"], now[b]["fallbacks"]
        assert now[b]["forwards"] - before[b]["forwards"] == 1
        assert now[w]["zero_copy_bytes"] - before[w]["zero_copy_bytes"] == 8 * n
        assert now[w]["copied_bytes"] == before[w]["copied_bytes"]
        del x, y, z
        back_to(c, baseline)


def test_a_forward_settle_that_could_not_be_sent_is_sent_once_the_exporter_is_reached_again():
    """B passes A's value on to W in a reply that fails before W claimed it, at a moment B cannot reach A's broker:
    the ForwardSettle could not be sent. Dropped, A would keep the forwarded lease, and the memory, until B died:
    B sends it again, as it does releases, once a link to A opens."""
    with nanny_cluster([{}, {}, {}], HOST_POOL) as c:
        a, b, w = worker_addresses(c)
        baseline = _warm(c, a, b, w)
        x = c.submit(T.make_buffer, MiB, b"settle", workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        y.result()
        assert c.run(F.get_data_held_open, b, y.key, workers=[w])[w] == 1  # read, not deserialized: nothing claimed
        assert counters(c, b)[b]["forwards"] == 1
        assert c.run(T.lease_counts, workers=[a])[a]["unclaimed"] == 1  # W's forwarded lease
        c.run(F.close_links, workers=[b])
        c.run(F.hide_broker, workers=[a])
        try:
            c.run(F.abort_held_reply, workers=[w])  # B's reply fails; its ForwardSettle cannot reach A now
            # B notices at once (its read of the "OK" fails), cannot settle, and keeps the settle for a new link
            wait_for(lambda: c.run(T.settles_waiting, workers=[b])[b] == 1, what="B to keep its unsent settle")
        finally:
            c.run(F.restore_broker, workers=[a])
        wait_for(
            lambda: c.run(T.lease_counts, workers=[a])[a]["unclaimed"] == 0,
            timeout=20,
            what="the forwarded lease nobody claimed to end",
        )
        assert c.submit(T.head, y, 6, workers=[b], pure=False).result() == b"settle"
        del x, y
        warm_up(c, b, w)  # B's link to W, closed above, opens again
        back_to(c, baseline)


@pytest.mark.parametrize("order", ["settle-first", "claim-first"])
def test_a_forward_and_its_settle_in_either_order(order):
    """W reads B's reply that passes on A's value, and B's reply fails (no "OK"). ``settle-first``: W deserializes
    it only after B settled the forward: A refuses W's claim (the lease ended), W gets a DataLostError and holds
    nothing. ``claim-first``: W claimed before the reply failed: the settle leaves W's lease alone, and W reads
    A's memory after A and B dropped their keys and A's pool was scribbled over."""
    with nanny_cluster([{}, {}, {}], HOST_POOL) as c:
        a, b, w = worker_addresses(c)
        baseline = _warm(c, a, b, w)
        x = c.submit(T.make_buffer, MiB, b"either", workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        y.result()
        deserialize = order == "claim-first"
        assert c.run(T.get_data_without_ok, b, y.key, deserialize, workers=[w])[w] == 1
        wait_for(lambda: c.run(T.lease_counts, workers=[a])[a]["leases"] == (2 if deserialize else 1), what="settle")
        if deserialize:
            del x, y
            wait_for(lambda: counters(c, a)[a]["leases"] == 1, what="B's lease on A to end")
            for _ in range(8):
                c.submit(T.scribble_all, MiB, ord("S"), workers=[a], pure=False).result()
            assert c.run(T.kept_head, 6, workers=[w])[w] == b"either"
            c.run(T.drop_kept, workers=[w])
        else:
            outcome = c.run(T.deserialize_kept, b, workers=[w])[w]
            assert outcome.startswith("DataLostError"), outcome
            assert c.submit(T.head, y, 6, workers=[b], pure=False).result() == b"either"
            del x, y
        back_to(c, baseline)


def test_a_forwarded_descriptor_replayed_by_its_forwarder_cannot_end_the_lease_of_the_import_it_came_with():
    """B passes A's value on to W (W maps A's memory under its own lease L), then, lying, sends W the same header
    again for another key: a replayed descriptor. Were W to claim L a second time (A answers a second claim of a
    lease as held) and hold two imports under one lease, the replayed key's release would end L at A while W's
    first import still mapped the memory, so a member could make an exporter free memory another worker maps
    (docs/security.md says it cannot), and W's own value would read zeros. W imports a lease once: a header naming a
    lease it holds is ``DataLostError``, and its value keeps its lease."""
    with nanny_cluster([{}, {}, {}], HOST_POOL) as c:
        a, b, w = worker_addresses(c)
        baseline = _warm(c, a, b, w)
        x = c.submit(T.make_buffer, MiB, b"original", workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        z = c.submit(T.keep, y, workers=[w], pure=False)
        z.result()
        assert counters(c, b)[b]["forwards"] == 1
        outcome = c.run(F.replay_import, z.key, b, workers=[w])[w]
        c.run(F.drop_replayed, workers=[w])  # the replayed key goes: its import (if any) closes
        del x, y
        wait_for(lambda: counters(c, a)[a]["leases"] <= 1, what="B's lease on A to end")
        assert c.run(T.lease_counts, workers=[a])[a]["leases"] == 1, "W's lease of its own value ended"
        for _ in range(8):
            c.submit(T.scribble_all, MiB, ord("S"), workers=[a], pure=False).result()
        assert c.submit(T.head, z, 8, workers=[w], pure=False).result() == b"original"
        assert outcome.startswith("DataLostError") and "imported here already" in outcome, outcome
        del z
        back_to(c, baseline)
