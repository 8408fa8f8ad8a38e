"""The Importer and PoolService driven in one process, without Dask: the core classes without a cluster.

Two services with ``host`` pools stand for two workers; the test plays the
scheduler (one registry snapshot and the cluster's token for both). What is
real: the pools (memfds), the exporter's broker and its Unix socket, the
importer's link, mapping and release. A value is never handed over within one
process in production (``same-process``); here the importer maps the other
service's pool through the same broker protocol a peer process uses.
"""

from __future__ import annotations

import ctypes
import secrets

import pytest

from dask_gpupool import DataLostError, PoolClosedError, PoolOptions, ProtocolError, UnknownPoolError
from dask_gpupool.handoff.startup import start_service
from dask_gpupool.memory.buffers import copy_from_host
from dask_gpupool.wire.handoff import BufferDescriptor, HandoffHeader
from dask_gpupool.wire.registry import Membership, RegistryUpdate


@pytest.fixture
def pair(tmp_path, no_fd_leak):
    options = PoolOptions.from_config(kind="host", max_size="16 MiB", broker_dir=str(tmp_path))
    a = start_service(options, "tcp://127.0.0.1:40001")
    b = start_service(options, "tcp://127.0.0.1:40002")
    token = secrets.token_bytes(32)
    snapshot = RegistryUpdate(1, (a.record, b.record), (), snapshot=True)
    for s in (a, b):
        s.join(Membership(snapshot, token))
    yield a, b
    b.close()
    a.close()


def test_the_importer_maps_a_peer_pool_once_and_reads_its_bytes(pair):
    a, b = pair
    buf = a.pool.allocate(4096)
    copy_from_host(buf, b"from the exporter")
    desc = a.pool.export(buf)
    seen = b.importer.import_buffer(desc)
    again = b.importer.import_buffer(desc)
    assert ctypes.string_at(int(seen.handle), 17) == b"from the exporter"
    assert int(seen.handle) != int(buf.handle)  # another mapping of the same pages, not the exporter's address
    stats = b.importer.stats()
    assert stats["mapped_pools"] == 1 and stats["links"] == 1  # one mapping, one link, for both imports
    copy_from_host(buf, b"FROM")
    assert ctypes.string_at(int(again.handle), 4) == b"FROM"  # the same memory, no copy
    seen.close()
    again.close()
    buf.close()


def test_the_importer_lands_copies_in_its_own_pool(pair):
    _a, b = pair
    got = b.importer.copies.receive_copy("host", b"copied bytes", "tcp://127.0.0.1:40001")
    assert b.pool.owns(got) and ctypes.string_at(int(got.handle), 12) == b"copied bytes"
    assert b.handoffs.copied_bytes == 12
    got.close()


def test_what_the_importer_refuses_is_a_typed_error(pair):
    a, b = pair
    stranger = BufferDescriptor("00000000-0000-0000-0000-00000000abcd", 16, b"", 0)
    with pytest.raises(UnknownPoolError, match="not registered"):
        b.importer.import_buffer(stranger)
    with pytest.raises(DataLostError, match="not registered"):  # a header naming a pool nobody registered
        b.importer.import_handoff(HandoffHeader("ipc", "host", 16, exporter=a.record.worker, desc=stranger, lease=7))
    own = a.pool.export(a.pool.allocate(16))
    with pytest.raises(ProtocolError, match="this process's own"):  # handed over within one process: never
        b.importer.import_handoff(HandoffHeader("ipc", "host", 16, exporter=a.record.worker, desc=own, lease=7))


def test_a_closed_importer_maps_nothing(pair):
    a, b = pair
    desc = a.pool.export(a.pool.allocate(16))
    b.close()
    with pytest.raises(PoolClosedError, match="closed"):
        b.importer.import_buffer(desc)


def test_a_claim_refused_after_the_link_was_opened_again_tells_the_exporter(pair):
    """A claim that ends refused on its second try (for example one that outlasted broker-timeout while the
    exporter waited for its GPU, whose lease the reopened link's resync ended) tells the exporter the transfer
    failed: Dask's retry gets copies (peer-unreachable) instead of the same handoff."""
    import time

    a, b = pair
    record = b.registry.get(a.record.pool)
    assert record is not None and not a.routes.is_unreachable(b.record.worker)
    with pytest.raises(DataLostError, match="refused lease"):
        b.importer.links.claim(record, b.importer.links.link(record), [12345])  # never granted: refused twice
    deadline = time.monotonic() + 5
    while not a.routes.is_unreachable(b.record.worker) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert a.routes.is_unreachable(b.record.worker)


def test_a_lease_granted_to_an_importer_that_already_left_dead_ends(tmp_path, no_fd_leak):
    """A reply decided before its requester left the registry, granted after: the exporter's removal of that
    requester (its process already gone) released what it held then, and the lease granted after it, in doubt
    once the reply failed, must end too, not wait for ever for an answer from a process that is gone."""
    import dataclasses
    import subprocess
    import sys
    import time

    options = PoolOptions.from_config(kind="host", max_size="16 MiB", broker_dir=str(tmp_path))
    a = start_service(options, "tcp://127.0.0.1:40001")
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait(30)
        gone = dataclasses.replace(
            a.record, pool="00000000-0000-0000-0000-0000000000aa", worker="tcp://127.0.0.1:40009", pid=dead.pid
        )
        a.join(Membership(RegistryUpdate(1, (a.record, gone), (), snapshot=True), secrets.token_bytes(32)))
        row = a.registry.worker_row(gone.worker)  # the route of a reply to it, decided now
        assert row is not None
        earlier = a.pool.allocate(4096)
        a.exports.export_ipc(earlier, earlier, row, None)  # a lease of an earlier reply
        del earlier

        def leases_end() -> None:
            deadline = time.monotonic() + 10
            while len(a.leases) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(a.leases) == 0

        a.apply_registry(RegistryUpdate(2, removed=(gone.pool,)))  # it left, dead, while the reply was serialized
        leases_end()  # the removal was handled: what it held then has ended
        buf = a.pool.allocate(4096)
        header = a.exports.export_ipc(buf, buf, row, None)
        del buf
        # The reply failed: the lease is in doubt, unless the broker's loop already ended it (export_ipc saw the
        # importer gone and told the broker, which runs on its own thread: on a loaded machine it may come first).
        assert a.exports.settle([header.lease], gone.worker, ok=False) in ([header.lease], [])
        leases_end()
        assert a.pool.stats().used == 0 and a.broker.watched == 0
    finally:
        a.close()


def test_a_pool_mapped_while_its_owner_left_is_not_kept_mapped(pair):
    """The importer maps a peer's pool (a broker round trip, outside the import lock) while the peer leaves the
    registry: the removal finds nothing mapped yet, so the mapping made after it must not stay for the importer's
    life (it would keep the gone peer's memory). The import fails with a typed error and nothing is left mapped."""
    import threading

    from dask_gpupool.handoff.mapped_pool import IMPORT_LOCK

    a, b = pair
    got: list[object] = []
    with IMPORT_LOCK:  # the import below stops at the lock, before it maps (the removal takes no import lock)
        importing = threading.Thread(target=lambda: got.append(_outcome(b.importer.map_peer, a.record.pool)))
        importing.start()
        importing.join(0.5)  # time to pass the registry check (microseconds) and stop at the lock
        b.apply_registry(RegistryUpdate(2, removed=(a.record.pool,)))  # a left meanwhile
    importing.join(30)
    assert not importing.is_alive() and len(got) == 1
    assert isinstance(got[0], UnknownPoolError), got[0]
    assert a.record.pool not in b.importer.mapped and b.importer.stats()["mapped_pools"] == 0


def test_a_pool_mapped_while_the_importer_closed_is_not_kept_mapped(pair):
    """The same race with the importer's own close: the mapping made after every mapping was closed would never
    be closed. The import fails with PoolClosedError and nothing is left mapped (no fd either: ``no_fd_leak``)."""
    import threading

    from dask_gpupool.handoff.mapped_pool import IMPORT_LOCK

    a, b = pair
    got: list[object] = []
    with IMPORT_LOCK:
        importing = threading.Thread(target=lambda: got.append(_outcome(b.importer.map_peer, a.record.pool)))
        importing.start()
        importing.join(0.5)  # time to pass the closed check (microseconds) and stop at the lock
        b.importer.mapped.close_all()  # what the importer's close does after its releaser stopped
    importing.join(30)
    assert not importing.is_alive() and len(got) == 1
    assert isinstance(got[0], PoolClosedError), got[0]
    assert a.record.pool not in b.importer.mapped and b.importer.stats()["mapped_pools"] == 0


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as e:
        return e


def test_a_host_copy_of_another_size_than_the_header_says_is_data_lost(pair):
    """The exporter's copy of a leased buffer (the fallback when the import fails) is landed at the size the
    exporter's reply gives: one that is not the header's ``nbytes`` (an exporter that lies, or a lease that names
    another buffer) became a value of another size. It is ``DataLostError`` now, and the lease goes back."""
    import time

    from dask_gpupool.handoff.exporter import Exported

    a, b = pair
    buf = a.pool.allocate(4096)
    lease = a.leases.grant(Exported(buf, buf), 4096, b.record.worker)
    record = b.registry.get(a.record.pool)
    assert record is not None
    header = HandoffHeader("ipc", "host", 16, exporter=a.record.worker, desc=a.pool.export(buf), lease=lease)
    with pytest.raises(DataLostError, match="4096 bytes"):
        b.importer.copies.fetch_copy(header, record, b.importer.links.link(record))
    deadline = time.monotonic() + 10
    while a.leases.holder(lease) is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert a.leases.holder(lease) is None and len(a.leases) == 0
    buf.close()
