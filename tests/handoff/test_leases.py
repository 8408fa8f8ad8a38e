"""Leases that hold through stalls, broken links and lying members.

Real ``Nanny`` worker processes on ``host`` pools, stopped with SIGSTOP and
resumed with SIGCONT. Each case reads the bytes a stalled or surviving reader
sees after the producer reused every byte it could, and ends back at the
baseline (fds, sockets, leases, pool bytes). The stalled-consumer and
stalled-producer cases run on ``device`` pools too (gpu-marked).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any

import pytest
from conftest import (
    back_to,
    counters,
    kind_cluster,
    nanny_cluster,
    pool_kinds,
    stalled_consumer,
    stalled_producer,
    wait_for,
    warm_up,
    worker_addresses,
)

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import testing as T
from dask_gpupool.handoff.leases import LeaseTable

MiB = 1 << 20


# -- the lease table -------------------------------------------------------------------


def test_leases_end_only_when_their_importer_is_done():
    table = LeaseTable(0.01)
    held = bytearray(8)
    a = table.grant(held, 8, "tcp://b:1")
    other = table.grant(held, 8, "tcp://c:1")
    assert a != other and a > 0 and other > 0

    # no timer ends a lease: overdue only counts (and logs once)
    assert table.overdue(time.monotonic() + 10) == 2 and len(table) == 2
    # a lease is claimed only by the worker it was granted to
    assert table.claim([a, other], "tcp://b:1") == [other]
    assert table.claim([a], "tcp://b:1") == []  # twice is harmless
    # another worker can neither claim nor release it
    assert table.claim([a], "tcp://c:1") == [a]
    assert table.release([a], "tcp://c:1") == 0 and len(table) == 2
    # the reply that carried them ended: unclaimed ones end, claimed ones stay
    assert table.settle([a, other]) == (1, []) and table.abandoned_total == 1
    assert table.holder(a) is held and table.holder(other) is None
    # a claim after the reply ended is refused
    assert table.claim([other], "tcp://c:1") == [other]
    # resync: claimed leases not in the live set end, unclaimed ones are left alone
    b2 = table.grant(held, 8, "tcp://b:1")
    assert table.resync("tcp://b:1", []) == 1 and table.holder(b2) is held and table.holder(a) is None
    # resync of a lease not claimed yet counts it as claimed
    assert table.resync("tcp://b:1", [b2]) == 0 and table.unclaimed == 0
    # the importer died
    assert table.release_importer("tcp://b:1") == 1 and len(table) == 0 and table.nbytes == 0


def test_a_lease_claimed_by_its_reply_is_claimed_by_the_ok_and_in_doubt_when_the_reply_failed():
    """A lease claimed by the reply: the exporter never ends it on its own: the "OK" claims it, and after a
    failed reply only the importer's answer (held, or refused for good) decides."""
    table = LeaseTable(60)
    held = bytearray(8)
    ok_lease, failed_lease = (table.grant(held, 8, "tcp://b:1", by_reply=True) for _ in range(2))
    broker = table.grant(held, 8, "tcp://b:1")
    # the reply was acknowledged: claimed, nothing in doubt
    assert table.settle([ok_lease], ok=True) == (0, []) and table.unclaimed == 2
    # a failed reply: a broker-claimed lease still unclaimed ends, a reply-claimed one is kept, in doubt
    assert table.settle([failed_lease, broker], ok=False) == (1, [failed_lease]) and table.doubtful == 1
    assert table.holder(failed_lease) is held and table.holder(broker) is None
    assert table.in_doubt([failed_lease, ok_lease], "tcp://b:1") == [failed_lease]
    assert table.in_doubt([failed_lease], "tcp://c:1") == []  # only its importer's answer counts
    # a resync does not end it either (its reply may still be on the way)
    assert table.resync("tcp://b:1", [ok_lease]) == 0 and table.holder(failed_lease) is held
    # another worker's answer changes nothing; the importer's "held" claims it
    assert table.resolve([failed_lease], "tcp://c:1", []) == (0, []) and table.holder(failed_lease) is held
    assert table.resolve([failed_lease], "tcp://b:1", [failed_lease]) == (0, []) and table.unclaimed == 0
    assert table.doubtful == 0
    # "not held" ends it, and gives back the segment noted at its grant
    lost = table.grant(held, 8, "tcp://b:1", segment=7, by_reply=True)
    assert table.settle([lost]) == (0, [lost])
    assert table.resolve([lost], "tcp://b:1", []) == (1, [7]) and table.holder(lost) is None
    assert table.abandoned_total == 2
    # a lease claimed over the broker meanwhile stays, whatever the answer
    raced = table.grant(held, 8, "tcp://b:1", by_reply=True)
    table.settle([raced])
    assert table.claim([raced], "tcp://b:1") == []
    assert table.resolve([raced], "tcp://b:1", []) == (0, []) and table.holder(raced) is held
    # its importer may forward it before the exporter read the "OK": asking proves it holds it
    fresh = table.grant(held, 8, "tcp://b:1", by_reply=True)
    assert table.forward(fresh, "tcp://b:1", "tcp://c:1") is not None
    assert table.in_doubt([fresh], "tcp://b:1") == [] and table.claim([fresh], "tcp://b:1") == []
    # but a broker-claimed lease must be claimed first
    assert table.forward(table.grant(held, 8, "tcp://b:1"), "tcp://b:1", "tcp://c:1") is None


def test_a_lease_in_doubt_claimed_another_way_is_no_longer_counted_in_doubt():
    """A reply-claimed lease in doubt (its reply failed at the exporter) that its importer then claims over the
    broker (an import that fell back to a copy, or a claim while a resync was open) or lists in a resync is held:
    the exporter stops asking about it (``in_doubt``), and ``leases_in_doubt`` (``doubtful``) no longer counts it.
    The flag must not stay set for as long as the importer holds the value, with ``stats()`` showing the lease in
    doubt, waiting for an answer nobody would ask for."""
    table = LeaseTable(60)
    held = bytearray(8)
    by_claim, by_resync = (table.grant(held, 8, "tcp://b:1", by_reply=True) for _ in range(2))
    assert table.settle([by_claim, by_resync], ok=False) == (0, [by_claim, by_resync]) and table.doubtful == 2
    assert table.claim([by_claim], "tcp://b:1") == []
    assert table.in_doubt([by_claim], "tcp://b:1") == [] and table.doubtful == 1
    assert table.resync("tcp://b:1", [by_claim, by_resync]) == 0
    assert table.in_doubt([by_resync], "tcp://b:1") == [] and table.doubtful == 0 and table.unclaimed == 0
    assert table.holder(by_claim) is held and table.holder(by_resync) is held
    assert table.release([by_claim, by_resync], "tcp://b:1") == 2 and len(table) == 0


def test_leases_of_headers_never_sent_are_revoked_and_a_copy_takes_back_the_segment_claim():
    """A serializer that gives up on a value after granting leases for its first frames revokes them (no "OK" may
    claim them); an importer that asks for a copy of a lease it could not map never counts its segment."""
    table = LeaseTable(60)
    held = bytearray(8)
    sent = table.grant(held, 8, "tcp://b:1", segment=3, by_reply=True)
    unsent = table.grant(held, 8, "tcp://b:1", segment=4, by_reply=True)
    broker = table.grant(held, 8, "tcp://b:1", segment=5)
    assert table.revoke([unsent, broker]) == (2, [4])  # the broker-claimed one was never noted
    assert table.holder(sent) is held and table.holder(unsent) is None and table.holder(broker) is None
    # a copy instead of a mapping: the claim noted at the grant goes back once, and not again if it ends unheld
    assert table.copied_instead(sent, "tcp://c:1") == 0  # not that importer's
    assert table.copied_instead(sent, "tcp://b:1") == 3
    assert table.copied_instead(sent, "tcp://b:1") == 0
    table.settle([sent])
    assert table.resolve([sent], "tcp://b:1", []) == (1, [])
    # a broker-claimed lease counts its segment once claimed, not before
    late = table.grant(held, 8, "tcp://b:1", segment=6)
    assert table.copied_instead(late, "tcp://b:1") == 0
    assert table.claim([late], "tcp://b:1", []) == [] and table.copied_instead(late, "tcp://b:1") == 6


def test_stream_leases_are_pulled_once():
    table = LeaseTable(60)
    lease = table.grant(bytearray(8), 8, "tcp://b:1")
    assert table.claim_stream(lease, -1) and not table.claim_stream(lease, -2)
    assert table.release_stream(lease, -2) == 0 and table.release_stream(lease, -1) == 1


def test_a_forwarded_lease_is_the_new_importers_own_and_outlives_the_forwarders():
    table = LeaseTable(60)
    holder = bytearray(8)
    b, c = "tcp://b:1", "tcp://c:1"
    lease_b = table.grant(holder, 8, b, segment=4)
    assert table.forward(lease_b, b, c) is None  # not claimed yet
    table.claim([lease_b], b)
    assert table.forward(lease_b, c, c) is None  # only its importer forwards it
    lease_c, segment = table.forward(lease_b, b, c)  # type: ignore[misc]
    assert segment == 4 and table.holder(lease_c) is holder
    segments: list[int] = []
    assert table.claim([lease_c], b) == [lease_c]  # the forwarder cannot claim it
    assert table.claim([lease_c], c, segments) == [] and segments == [4]
    assert table.release([lease_b], b) == 1
    assert table.holder(lease_c) is holder  # B let go; C's lease keeps the memory
    assert table.settle_forwarded([lease_c], b) == 0  # claimed: settling does not end it
    assert table.release_importer(b) == 0
    assert table.release([lease_c], c) == 1 and len(table) == 0


def test_an_unclaimed_forwarded_lease_ends_with_its_forwarders_reply_or_its_death():
    table = LeaseTable(60)
    b, c = "tcp://b:1", "tcp://c:1"
    lease_b = table.grant(bytearray(8), 8, b)
    table.claim([lease_b], b)
    first, _ = table.forward(lease_b, b, c)  # type: ignore[misc]
    second, _ = table.forward(lease_b, b, c)  # type: ignore[misc]
    assert table.settle_forwarded([first], c) == 0  # only the forwarder settles
    assert table.settle_forwarded([first], b) == 1 and table.holder(first) is None
    assert table.release_importer(b) == 2  # its own lease, and the forward nobody claimed
    assert table.holder(second) is None and len(table) == 0


def test_a_lease_in_the_exporters_own_name_is_taken_once_and_only_by_it():
    """A value forwarded back to its exporter: the exporter takes the holder out of the table (the lease ends)."""
    table = LeaseTable(60)
    holder = bytearray(8)
    a, b = "tcp://a:1", "tcp://b:1"
    lease_b = table.grant(holder, 8, b)
    table.claim([lease_b], b)
    home, _ = table.forward(lease_b, b, a)  # type: ignore[misc]
    assert table.take(home, b) is None  # not B's
    assert table.take(home, a) is holder and table.take(home, a) is None
    assert table.settle_forwarded([home], b) == 0  # B's reply ends after A took it: nothing left to end
    assert table.holder(lease_b) is holder and len(table) == 1 and table.released_total == 1


def test_a_stream_lease_cannot_be_forwarded():
    table = LeaseTable(60)
    lease = table.grant(bytearray(8), 8, "tcp://b:1")
    assert table.claim_stream(lease, 1)
    assert table.forward(lease, "tcp://b:1", "tcp://c:1") is None


# -- case 1: a consumer stalled between grant and claim ------------------------------------


@pool_kinds("one-gpu", "two-gpus")
def test_a_consumer_stalled_past_lease_timeout_reads_the_original_bytes(kind):
    """B stops after A granted the lease and before B claimed it, for longer than ``lease-timeout``.

    Before: the lease expired, B's claim went unanswered and B read what A
    wrote into the reused memory. Now the lease waits for B. Across GPUs the
    stalled consumer's CUDA context survives too: it reads after resuming.
    """
    nbytes, max_size = (MiB, "64 MiB") if kind == "host" else (8 * MiB, "1 GiB")
    with kind_cluster(kind, max_size, lease_timeout="1s") as c:
        stalled_consumer(c, nbytes)


# -- case 1b: a reply that failed at the exporter (leases claimed by the reply) ----------------------


def test_a_reply_that_failed_at_the_exporter_leaves_its_leases_to_the_importers_answer():
    """B deserializes A's reply and holds the lease with no round trip; A's reply then fails (no "OK").

    A cannot tell whether B got the lease, so it ends none: it asks B. B holds the first value: A keeps it claimed,
    and B reads the original bytes after A reused every free byte of its pool. B never deserialized the second:
    B refuses it for good as it answers, so A ends it, and B deserializing that header later fails (a
    ``DataLostError``: Dask fetches again) instead of reading reused memory. Back to baseline after; nothing
    of the failed replies is kept in the UCX quarantine (their comm is TCP).
    """
    with nanny_cluster([{}, {}], GPUPool(kind="host", max_size="64 MiB")) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        x = c.submit(T.make_buffer, MiB, b"kept by B", workers=[a], pure=False)
        x.result()
        assert c.run(T.get_data_without_ok, a, x.key, True, workers=[b])[b] == 1
        wait_for(lambda: c.run(T.lease_counts, workers=[a])[a] == _leases(1, unclaimed=0), what="A's answer from B")
        c.submit(T.scribble, 60 * MiB, b"reused", workers=[a], pure=False).result()
        assert c.run(T.kept_head, 9, workers=[b])[b] == b"kept by B"
        c.run(T.drop_kept, workers=[b])
        wait_for(lambda: c.run(T.lease_counts, workers=[a])[a]["leases"] == 0, what="B's release")

        y = c.submit(T.make_buffer, MiB, b"never held", workers=[a], pure=False)
        y.result()
        assert c.run(T.get_data_without_ok, a, y.key, False, workers=[b])[b] == 1
        wait_for(lambda: c.run(T.lease_counts, workers=[a])[a]["leases"] == 0, what="A ending the unheld lease")
        # read now as A's reply: refused here, by B's own answer, not by A's broker (no claim is asked)
        error = c.run(T.deserialize_kept, a, workers=[b])[b]
        assert error.startswith("DataLostError") and "was refused here" in error, error
        # B's transfers go as copies for a while (its reply failed), so Dask's retry succeeds
        assert c.submit(T.head, y, 10, workers=[b], pure=False).result(timeout=60) == b"never held"
        assert _fallbacks(c, a).get("peer-unreachable", 0) >= 1
        del x, y
        back_to(c, baseline)
        # over TCP the failed replies' bytes went into the socket: nothing is kept from reuse for UCX
        assert counters(c, a)[a]["ucx_quarantined"] == 0 == counters(c, a)[a]["ucx_quarantined_bytes"]


def _leases(n: int, unclaimed: int) -> dict[str, int]:
    return {"leases": n, "unclaimed": unclaimed, "in_doubt": 0, "held": 0, "resyncs": 0}


# -- case 2: a producer stalled past broker-timeout while its consumer releases ---------------


@pool_kinds("one-gpu", "two-gpus")
def test_a_producer_stalled_past_broker_timeout_keeps_the_leases_its_consumer_holds(kind):
    """A stops while B releases imports one by one until B's link to A times out and closes.

    Before: A, on resuming, saw the connection close and ended every lease
    claimed on it, including one B still held: B's data changed. Now a
    closed link is not a dead importer: B opens a new link and resyncs.
    """
    nbytes, max_size = (MiB, "256 MiB") if kind == "host" else (8 * MiB, "1 GiB")
    with kind_cluster(kind, max_size, broker_timeout="1s") as c:
        stalled_producer(c, nbytes)


# -- case 4: every failure reaches the task or heals -------------------------------------------


def _fallbacks(c: Any, worker: str) -> dict[str, int]:
    return counters(c, worker)[worker]["fallbacks"]


def test_a_link_that_cannot_be_opened_becomes_a_copy_not_a_hung_task():
    plugin = GPUPool(kind="host", max_size="64 MiB")
    with nanny_cluster([{}, {}], plugin) as c:
        a, b = worker_addresses(c)
        warm_up(c, a, b)
        x = c.submit(T.make_buffer, MiB, b"reachable", workers=[a], pure=False)
        x.result()
        c.run(T.hide_broker, workers=[a])
        c.run(T.close_links, workers=[b])
        try:
            y = c.submit(T.head, x, 9, workers=[b], pure=False)
            assert y.result(timeout=60) == b"reachable"
            assert _fallbacks(c, a).get("peer-unreachable", 0) >= 1
            assert c.run(T.lease_counts, workers=[a])[a]["leases"] == 0
        finally:
            c.run(T.restore_broker, workers=[a])


def test_a_pull_that_fails_becomes_a_copy_in_the_frames():
    # Two "hosts": A's values from 4 MiB (tuning.COPY_STREAM_THRESHOLD) reach B over the pipelined copy path (a pull
    # from A's copy server).
    plugin = GPUPool(kind="host", max_size="64 MiB")
    workers = [{"config": {"gpupool": {"host-id": "one"}}}, {"config": {"gpupool": {"host-id": "two"}}}]
    with nanny_cluster(workers, plugin) as c:
        a, b = worker_addresses(c)
        x = c.submit(T.make_buffer, 4 * MiB, b"streamed", workers=[a], pure=False)
        assert c.submit(T.head, x, 8, workers=[b], pure=False).result() == b"streamed"
        assert counters(c, b)[b]["streamed_bytes"] == 4 * MiB
        c.run(T.stop_copy_server, workers=[a])
        x2 = c.submit(T.make_buffer, 4 * MiB, b"in frames", workers=[a], pure=False)
        assert c.submit(T.head, x2, 9, workers=[b], pure=False).result(timeout=60) == b"in frames"
        assert c.run(T.lease_counts, workers=[a])[a]["leases"] == 0


def test_a_header_naming_an_unknown_pool_becomes_a_copy():
    plugin = GPUPool(kind="host", max_size="64 MiB")
    with nanny_cluster([{}, {}], plugin) as c:
        a, b = worker_addresses(c)
        pool_a = {r.worker: r.pool for r in dask_gpupool.pools(c)}[a]
        x = c.submit(T.make_buffer, MiB, b"known", workers=[a], pure=False)
        x.result()
        c.run(T.forget_pool, pool_a, workers=[b])
        assert c.submit(T.head, x, 5, workers=[b], pure=False).result(timeout=60) == b"known"
        assert c.run(T.lease_counts, workers=[a])[a]["leases"] == 0


def test_a_failed_receive_is_a_connection_error_for_dask():
    from cuda.core import Buffer
    from distributed.protocol import dask_deserialize

    with pytest.raises(dask_gpupool.DataLostError) as info:
        dask_deserialize.dispatch(Buffer)({"gpupool": {"path": "ipc", "kind": "host", "nbytes": 8}}, [])
    assert isinstance(info.value, ConnectionError)
    assert isinstance(info.value.__cause__, dask_gpupool.ProtocolError)


# -- the broker: claims scoped to the worker on the other end ------------------------------


@pytest.fixture
def exporter(tmp_path):
    """A real host pool, its lease table and broker, and a registry with two importers in this process."""
    from dask_gpupool.config import PoolOptions
    from dask_gpupool.handoff.exporter import ExportSide
    from dask_gpupool.handoff.registry import RegistryView
    from dask_gpupool.memory.pool import Pool
    from dask_gpupool.memory.topology import LocalDevices
    from dask_gpupool.transport.broker import FdBroker
    from dask_gpupool.wire.registry import PoolRecord, RegistryUpdate

    pool = Pool.create(PoolOptions.from_config(kind="host", max_size="16 MiB"), LocalDevices(()))
    leases = LeaseTable(60)
    registry = RegistryView()
    rows = [
        PoolRecord(str(uuid.uuid4()), f"tcp://127.0.0.1:{port}", os.getpid(), "h", "h", "host", None, MiB, "/x")
        for port in (1, 2)
    ]
    registry.apply(RegistryUpdate(version=1, added=tuple(rows)))
    broker = FdBroker(ExportSide(pool, leases, registry, "h"), str(tmp_path), 2.0, pool.uuid, TOKEN)
    try:
        yield pool, leases, broker, [r.worker for r in rows]
    finally:
        broker.close()
        leases.clear()
        pool.close()


TOKEN = b"cluster-token-0123456789abcdef!!"


def test_another_worker_can_neither_claim_nor_release_a_lease(exporter):
    from dask_gpupool.handoff.exporter import Exported
    from dask_gpupool.transport.link import PeerLink

    pool, leases, broker, (b, c) = exporter
    buf = pool.allocate(4096)
    lease = leases.grant(Exported(buf, buf), 4096, b)
    del buf
    as_c, as_b = PeerLink(broker.address, 2.0, TOKEN, c), PeerLink(broker.address, 2.0, TOKEN, b)
    try:
        assert as_c.claim([lease]) == [lease]  # not C's: refused, and nothing else happens
        as_c.release([lease])
        assert as_b.claim([lease]) == []
        as_c.release([lease])
        as_c.claim([1])  # a round trip: C's release above has been handled
        assert len(leases) == 1
        # closing B's link does not end B's lease: B's process lives
        as_b.close()
        wait_for(lambda: broker.connections == 1, what="the broker to see B's link close")
        as_c.claim([1])  # a round trip: the broker's handling of that close has ended
        assert len(leases) == 1
        as_b = PeerLink(broker.address, 2.0, TOKEN, b, live=[])  # a resync that no longer lists it
        assert len(leases) == 0 and pool.stats().used == 0
    finally:
        as_b.close()
        as_c.close()


def test_a_resync_older_than_one_applied_ends_nothing(exporter):
    """A resync sent on a link that broke can reach the broker after a newer one (or after a lease was claimed by
    its reply since): the broker ignores a snapshot older than the newest it applied from that importer."""
    from dask_gpupool.handoff.exporter import Exported
    from dask_gpupool.transport.link import PeerLink

    pool, leases, broker, (b, _) = exporter
    buf = pool.allocate(4096)
    lease = leases.grant(Exported(buf, buf), 4096, b, by_reply=True)
    del buf
    links = []
    try:
        links.append(PeerLink(broker.address, 2.0, TOKEN, b, live=[], epoch=2))  # before the lease was held
        leases.settle([lease], ok=True)  # the reply's "OK": claimed
        links.append(PeerLink(broker.address, 2.0, TOKEN, b, live=[], epoch=1))  # stale: ignored
        links.append(PeerLink(broker.address, 2.0, TOKEN, b, live=[], epoch=2))  # not newer either
        assert len(leases) == 1 and leases.unclaimed == 0
        links.append(PeerLink(broker.address, 2.0, TOKEN, b, live=[lease], epoch=3))
        assert len(leases) == 1
        links.append(PeerLink(broker.address, 2.0, TOKEN, b, live=[], epoch=4))  # released since: it ends
        assert len(leases) == 0 and pool.stats().used == 0
    finally:
        for link in links:
            link.close()


def test_one_thread_at_a_time_opens_a_link_to_an_exporter(exporter):
    """Two resyncs of one importer in flight at once could reach the broker in either order: threads that find the
    link to an exporter closed at the same moment wait for one of them to open it."""
    from dask_gpupool.config import PoolOptions
    from dask_gpupool.handoff.held import HeldLeases
    from dask_gpupool.handoff.links import ExporterLinks
    from dask_gpupool.wire.registry import PoolRecord

    pool, _leases, broker, (b, _) = exporter

    class CountingHeld(HeldLeases):
        snapshots = 0

        def snapshot(self, exporter: str) -> tuple[list[int], int]:
            CountingHeld.snapshots += 1
            time.sleep(0.05)  # widen the window two openers would share
            return super().snapshot(exporter)

    links = ExporterLinks(PoolOptions.from_config(kind="host", max_size="16 MiB"), pool, b, CountingHeld())
    links.token = TOKEN
    record = PoolRecord(pool.uuid, "tcp://127.0.0.1:3", os.getpid(), "h", "h", "host", None, MiB, broker.address)
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(links.link(record))) for _ in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(got) == 8 and len({id(x) for x in got}) == 1 and CountingHeld.snapshots == 1
    finally:
        links.drop()


def test_a_forward_to_a_worker_whose_transfers_go_as_copies_is_refused(exporter):
    """TransferFailed reaches the first exporter A, but Dask retries from the forwarder B: A refuses B's forward to
    a worker it sends copies to for now (``refuses``), so B sends a copy (fallback forward-refused) and the retry
    does not take the same path."""
    from dask_gpupool.handoff.exporter import Exported
    from dask_gpupool.transport.link import PeerLink

    pool, leases, broker, (b, c) = exporter
    buf = pool.allocate(4096)
    lease = leases.grant(Exported(buf, buf), 4096, b)
    as_b = PeerLink(broker.address, 2.0, TOKEN, b)
    try:
        assert as_b.claim([lease]) == []
        broker.handler.refuses = lambda worker: worker == c
        with pytest.raises(dask_gpupool.BrokerRefusedError, match="go as copies"):
            as_b.forward(lease, c)
        broker.handler.refuses = None
        forwarded, _ = as_b.forward(lease, c)
        assert forwarded
    finally:
        as_b.close()
        del buf


def test_a_failed_transfer_reported_over_a_link_reaches_the_exporter_as_its_importer(exporter):
    """TransferFailed: the exporter's handler hears which importer's transfer failed (the connection's, not one
    the message could name), and a link of a handler that does not listen is answered by nothing at all."""
    from dask_gpupool.transport.link import PeerLink

    _pool, _leases, broker, (b, _c) = exporter
    heard: list[str] = []
    broker.handler.on_transfer_failed = heard.append
    as_b = PeerLink(broker.address, 2.0, TOKEN, b)
    try:
        as_b.transfer_failed()
        assert as_b.claim([1]) == [1]  # a round trip: the message before it has been handled
        assert heard == [b]
        broker.handler.on_transfer_failed = None
        as_b.transfer_failed()
        assert as_b.claim([1]) == [1] and heard == [b]
    finally:
        as_b.close()


def test_a_worker_that_reports_a_failed_transfer_gets_copies_from_its_exporter():
    """Real workers: B tells A over its link that a transfer failed after its claims; A's next handoffs to B go
    as copies (fallback peer-unreachable) with the right bytes, and no lease is left behind."""
    plugin = GPUPool(kind="host", max_size="64 MiB")
    with nanny_cluster([{}, {}], plugin) as c:
        a, b = worker_addresses(c)
        warm_up(c, a, b)
        assert c.run(T.report_failed_transfer, a, workers=[b])[b]
        x = c.submit(T.make_buffer, MiB, b"a copy now", workers=[a], pure=False)
        assert c.submit(T.head, x, 10, workers=[b], pure=False).result(timeout=60) == b"a copy now"
        assert _fallbacks(c, a).get("peer-unreachable", 0) >= 1
        del x
        assert c.run(T.lease_counts, workers=[a])[a]["leases"] == 0


def test_forwards_over_the_broker_are_scoped_to_the_lease_holder_and_settled_by_it(exporter):
    from dask_gpupool.handoff.exporter import Exported
    from dask_gpupool.transport.link import PeerLink

    pool, leases, broker, (b, c) = exporter
    buf = pool.allocate(4096)
    lease = leases.grant(Exported(buf, buf), 4096, b)
    del buf
    as_b, as_c = PeerLink(broker.address, 2.0, TOKEN, b), PeerLink(broker.address, 2.0, TOKEN, c)
    try:
        with pytest.raises(dask_gpupool.DataLostError, match="not a claimed IPC lease"):
            as_b.forward(lease, c)  # B has not claimed it yet
        assert as_b.claim([lease]) == []
        with pytest.raises(dask_gpupool.DataLostError):
            as_c.forward(lease, b)  # not C's lease
        with pytest.raises(dask_gpupool.NotAMemberError):
            as_b.forward(lease, "tcp://127.0.0.1:9")  # not a worker of this host
        with pytest.raises(dask_gpupool.NotAMemberError):
            as_b.forward(lease, b)  # to itself
        unclaimed, _ = as_b.forward(lease, c)
        claimed, _ = as_b.forward(lease, c)
        assert as_c.claim([claimed]) == [] and len(leases) == 3
        as_c.settle_forwarded([unclaimed])  # only the forwarder settles
        as_b.settle_forwarded([unclaimed, claimed])  # the reply ended: the unclaimed one goes
        as_b.claim([1])  # a round trip: the settles above have been handled
        assert len(leases) == 2 and leases.holder(unclaimed) is None
        as_b.release([lease])
        as_c.release([claimed])
        as_c.claim([1])
        assert len(leases) == 0 and pool.stats().used == 0
        with pytest.raises(dask_gpupool.DataLostError, match="not a claimed IPC lease"):
            as_b.forward(lease, c)  # a lease that ended: refused, and nothing granted
        with pytest.raises(dask_gpupool.DataLostError):
            as_c.forward(claimed, b)  # nor a forwarded one that ended
        assert as_b.claim([1]) == [1] and len(leases) == 0  # the link still answers
    finally:
        as_b.close()
        as_c.close()


def test_a_process_that_is_not_the_registered_worker_is_refused(exporter):
    from dask_gpupool.transport.link import PeerLink

    _pool, _leases, broker, _ = exporter
    with pytest.raises(dask_gpupool.NotAMemberError, match="not the process of worker"):
        PeerLink(broker.address, 2.0, TOKEN, "tcp://127.0.0.1:3")


def test_copies_of_ipc_and_stream_leases_go_only_to_their_importer(exporter):
    import mmap

    from dask_gpupool.handoff.exporter import Exported
    from dask_gpupool.transport.link import PeerLink
    from dask_gpupool.transport.stream import Staged

    pool, leases, broker, (b, c) = exporter
    buf = pool.allocate(8192)
    T.write_bytes(buf, b"0123456789")
    ipc = leases.grant(Exported(buf, buf), 8192, b)
    stream = leases.grant(Staged(buf, buf, 4, 6), 6, b)
    del buf
    as_b, as_c = PeerLink(broker.address, 2.0, TOKEN, b), PeerLink(broker.address, 2.0, TOKEN, c)
    try:
        for lease, want in ((ipc, b"0123456789"), (stream, b"456789")):
            reply, fd = as_b.fetch_copy(lease)
            try:
                with mmap.mmap(fd, reply.size, prot=mmap.PROT_READ) as m:
                    assert m[: len(want)] == want
            finally:
                os.close(fd)
        with pytest.raises(dask_gpupool.DataLostError, match="has ended"):
            as_c.fetch_copy(ipc)
    finally:
        as_b.close()
        as_c.close()
        leases.clear()


# A process that claims one lease per worker address it is given (as those workers, one link each), then
# lives until it is killed.
CLAIMING_CHILD = """
import sys
from dask_gpupool.transport.link import PeerLink
address, token = sys.argv[1], bytes.fromhex(sys.argv[2])
for worker in sys.argv[3:]:
    lease = int(sys.stdin.readline())
    link = PeerLink(address, 5.0, token, worker)
    assert link.claim([lease]) == []
    link.close()
print("claimed", flush=True)
sys.stdin.readline()  # stays alive until killed
"""


def test_a_closed_link_keeps_the_leases_and_the_importers_exit_ends_them(exporter):
    """Link loss is not importer death: the broker ends the leases only when the importer's process exits."""
    import subprocess
    import sys

    from dask_gpupool.handoff.exporter import Exported
    from dask_gpupool.transport.link import request_pool_fd
    from dask_gpupool.wire.registry import PoolRecord, RegistryUpdate

    pool, leases, broker, _ = exporter
    worker = "tcp://127.0.0.1:9"
    child = subprocess.Popen(
        [sys.executable, "-c", CLAIMING_CHILD, broker.address, TOKEN.hex(), worker],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        row = PoolRecord(str(uuid.uuid4()), worker, child.pid, "h", "h", "host", None, MiB, "/x")
        broker.handler._registry.apply(RegistryUpdate(version=2, added=(row,)))  # type: ignore[attr-defined]
        buf = pool.allocate(4096)
        lease = leases.grant(Exported(buf, buf), 4096, worker)
        del buf
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(f"{lease}\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "claimed"
        wait_for(lambda: broker.connections == 0, what="the broker to see the child's link close")
        with pytest.raises(dask_gpupool.UnknownPoolError):  # a round trip: the broker handled that close
            request_pool_fd(broker.address, str(uuid.uuid4()), 2.0, TOKEN)
        assert len(leases) == 1 and leases.unclaimed == 0  # claimed, its link closed, still held
        child.kill()
        child.wait(10)
        deadline = time.monotonic() + 10
        while len(leases) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(leases) == 0 and pool.stats().used == 0 and broker.watched == 0
    finally:
        child.kill()
        child.wait(10)


def test_the_leases_of_two_workers_of_one_process_end_with_that_process_and_not_before(exporter):
    """Two workers in one process (``dask worker --no-nanny --nworkers 2``) import from this exporter. Each
    leaving the registry while the process lives ends nothing; the process exiting ends the leases of both."""
    import subprocess
    import sys

    from dask_gpupool.handoff.exporter import Exported
    from dask_gpupool.transport.link import PeerLink
    from dask_gpupool.wire.registry import PoolRecord, RegistryUpdate

    pool, leases, broker, (here, _) = exporter
    workers = ["tcp://127.0.0.1:7", "tcp://127.0.0.1:8"]
    child = subprocess.Popen(
        [sys.executable, "-c", CLAIMING_CHILD, broker.address, TOKEN.hex(), *workers],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        rows = [PoolRecord(str(uuid.uuid4()), w, child.pid, "h", "h", "host", None, MiB, "/x") for w in workers]
        broker.handler._registry.apply(RegistryUpdate(version=2, added=tuple(rows)))  # type: ignore[attr-defined]
        assert child.stdin is not None and child.stdout is not None
        for w in workers:
            buf = pool.allocate(4096)
            child.stdin.write(f"{leases.grant(Exported(buf, buf), 4096, w)}\n")
            del buf
        child.stdin.flush()
        assert child.stdout.readline().strip() == "claimed"
        assert leases.importers() == dict.fromkeys(workers, 1) and leases.unclaimed == 0
        # the scheduler removes both (a stalled process, past worker-ttl) while the process lives
        for w in workers:
            broker.importer_left(w, child.pid)
        barrier = PeerLink(broker.address, 2.0, TOKEN, here)  # answered on the broker's loop after the two calls
        assert barrier.claim([1]) == [1]
        barrier.close()
        assert leases.importers() == dict.fromkeys(workers, 1), "a lease ended while its importer's process lives"
        assert broker.watched == 2  # the child, once for both of its workers, and this process (the barrier)
        child.kill()
        child.wait(10)
        deadline = time.monotonic() + 10
        while len(leases) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(leases) == 0 and pool.stats().used == 0 and broker.watched == 1  # this process
    finally:
        child.kill()
        child.wait(10)
