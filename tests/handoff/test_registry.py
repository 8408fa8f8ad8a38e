from __future__ import annotations

import uuid

from dask_gpupool.handoff.registry import PoolRegistry, RegistryView
from dask_gpupool.wire.registry import PoolRecord, RegistryUpdate


def record(worker: str) -> PoolRecord:
    return PoolRecord(str(uuid.uuid4()), worker, 1, "h", "h", "host", None, 1024, "/tmp/b.sock")


def test_registry_adds_removes_and_versions():
    reg = PoolRegistry()
    a, b = record("tcp://a"), record("tcp://b")
    assert reg.add(a) == RegistryUpdate(1, added=(a,))
    reg.add(b)
    assert reg.remove_worker("tcp://a") == RegistryUpdate(3, removed=(a.pool,))
    assert reg.remove_worker("tcp://a") is None
    assert reg.records() == [b]
    assert reg.snapshot() == RegistryUpdate(3, added=(b,), snapshot=True)


def test_view_follows_the_registry():
    reg, view = PoolRegistry(), RegistryView()
    a, b = record("tcp://a"), record("tcp://b")
    view.apply(reg.add(a))
    view.apply(reg.add(b))
    view.apply(reg.remove([a.pool]))
    assert view.records() == [b] and view.version == 3


def test_old_snapshot_neither_revives_nor_drops_newer_rows():
    reg, view = PoolRegistry(), RegistryView()
    a = record("tcp://a")
    reg.add(a)
    old = reg.snapshot()  # version 1, holds a
    b = record("tcp://b")
    view.apply(reg.add(b))  # version 2 arrives first
    view.apply(reg.remove([a.pool]))  # version 3
    view.apply(old)  # the stale snapshot arrives last
    assert view.get(a.pool) is None
    assert view.get(b.pool) == b


def test_snapshot_drops_rows_it_no_longer_has():
    reg, view = PoolRegistry(), RegistryView()
    a = record("tcp://a")
    view.apply(reg.add(a))
    reg.remove([a.pool])
    view.apply(reg.snapshot())
    assert len(view) == 0


def test_registry_finds_rows_by_pool_and_names_their_owners():
    reg = PoolRegistry()
    a, b = record("tcp://a"), record("tcp://b")
    reg.add(a)
    reg.add(b)
    assert reg.get(a.pool) == a and reg.get(str(uuid.uuid4())) is None
    assert reg.owners() == {"tcp://a", "tcp://b"}
    reg.remove_worker("tcp://a")
    assert reg.get(a.pool) is None and reg.owners() == {"tcp://b"}
