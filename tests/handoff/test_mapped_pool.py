"""A peer's mapping of an owner's pool (``MappedPool``): on a live cluster, the pool mapped once and read; and a
peer's view of the owner's retired and reclaimed segments (``MappedPool.retire`` / ``unshare``).

Segments are mapped only from ``device`` pools, so the segment tests put a mapped segment's record in place the way
``MappedPool._acquire_segment`` does (``[import, users, segment id, leases claimed]``), the import being a
``cuda.core`` Buffer over host memory: the bookkeeping of which segment goes when, and with which release, is what
is tested there. The mapping itself is exercised on a GPU (``test_device_segments.py``, reclaim and trim tests).
"""

from __future__ import annotations

import ctypes
import uuid

import pytest
from conftest import handoff_round_trip, kind_cluster, pool_kinds, worker_addresses
from cuda.core import Buffer

from dask_gpupool.handoff.mapped_pool import MappedPool
from dask_gpupool.memory.topology import local_devices
from dask_gpupool.wire.registry import PoolRecord

RECORD = PoolRecord(str(uuid.uuid4()), "tcp://a:1", 42, "h", "h", "device", "GPU-1", 1 << 30, "/tmp/b.sock")


MiB = 1 << 20


@pool_kinds("one-gpu")
def test_peer_maps_the_pool_once_and_reads_the_owners_bytes(kind):
    """w1 maps w0's pool through w0's broker, once, reads what w0 wrote, and both end back at their baseline
    (:func:`conftest.handoff_round_trip`); the registry rows name the pools' kind, GPU and bound."""
    nbytes, max_size = (MiB, 64 * MiB) if kind == "host" else (8 * MiB, 1 << 30)
    with kind_cluster(kind, max_size) as c:
        rows = handoff_round_trip(c, nbytes, b"bytes written by A" * 100)
        a, b = worker_addresses(c)
        device = None if kind == "host" else local_devices().uuids[0]
        assert {r.kind for r in rows.values()} == {kind.split("-")[0]}
        assert rows[a].device == rows[b].device == device and rows[a].max_size == max_size


_MEMORY: list[ctypes.Array[ctypes.c_char]] = []


def segment_import(nbytes: int = 4096) -> Buffer:
    """A Buffer over host memory kept by this module, in the place of a segment's import."""
    _MEMORY.append(raw := ctypes.create_string_buffer(nbytes))
    return Buffer.from_handle(ctypes.addressof(raw), nbytes)


def mapped_with(*segments: tuple[int, int, int]) -> MappedPool:
    """A MappedPool of RECORD holding segments ``(id, users, leases claimed on it)``."""
    m = MappedPool(RECORD, object(), None)
    for seg_id, users, claims in segments:
        m._segments[seg_id] = [segment_import(), users, seg_id, claims]
    return m


def key_of(seg_id: int) -> tuple[int, int, int]:
    return (seg_id, 0, -1)  # what acquire() hands out for a segment (mapped_pool._SEGMENT)


def test_a_reclaimed_segment_no_import_uses_goes_at_once_and_a_used_one_with_its_last_import():
    m = mapped_with((6, 0, 2), (7, 1, 1), (8, 0, 1))
    m.imports = 1
    gone, released = m.retire(0, (6, 7))
    assert len(gone) == 1 and released == [(6, 2)] and 6 not in m._segments
    assert 8 in m._segments  # not reclaimed: kept mapped for the next buffer
    raw, release = m.unshare(key_of(7))
    assert raw is not None and release == (7, 1) and 7 not in m._segments


def test_a_later_row_that_no_longer_names_a_segment_still_used_here_does_not_keep_it_mapped():
    """Rows can arrive out of order, or name only what is not freed yet: reclaimed ids accumulate here."""
    m = mapped_with((6, 1, 2))
    m.imports = 1
    assert m.retire(0, (6,)) == ([], [])  # in use: goes with its last import
    m.retire(0, (9,))
    assert m.reclaim == {6, 9}
    raw, release = m.unshare(key_of(6))
    assert raw is not None and release == (6, 2)


def test_segments_below_retire_below_and_reclaimed_ones_both_go():
    m = mapped_with((2, 0, 1), (5, 0, 3), (11, 0, 1))
    gone, released = m.retire(4, (11,))
    assert sorted(released) == [(2, 1), (11, 1)] and len(gone) == 2 and list(m._segments) == [5]


def test_a_legacy_ipc_segment_needs_its_handle_and_a_gpu_and_comes_only_as_a_segment():
    """A pool whose row says its segments are legacy IPC memory (``gpupool.segment-memory: legacy``) is mapped
    segment by segment from the 64-byte handle in each descriptor; a descriptor without it, a process without a
    GPU, or a buffer descriptor outside a segment is a ProtocolError before any CUDA call."""
    import dataclasses

    from dask_gpupool.errors import ProtocolError
    from dask_gpupool.wire.handoff import BufferDescriptor

    legacy = dataclasses.replace(RECORD, segment_memory="legacy")
    m = MappedPool(legacy, object(), None)
    no_handle = BufferDescriptor(legacy.pool, 4096, b"", 0, 1 << 20, 3)
    with pytest.raises(ProtocolError, match="legacy IPC memory needs its 64-byte handle"):
        m.acquire(no_handle, segment_fd=lambda: -1)
    with pytest.raises(ProtocolError, match="legacy IPC memory needs its 64-byte handle and a GPU here"):
        m.acquire(BufferDescriptor(legacy.pool, 4096, b"\1" * 64, 0, 1 << 20, 3))
    with pytest.raises(ProtocolError, match="mapped by segment"):
        m.import_buffer(BufferDescriptor(legacy.pool, 4096, b"\1" * 64))
    assert m.imports == 0 and m.segments == 0


@pytest.mark.parametrize("memory", ["vmm", "legacy"])
def test_a_device_pool_buffer_outside_a_segment_is_refused_before_any_cuda_call(memory):
    """A ``device`` pool places every buffer in a segment, so a descriptor of one with no segment (a 64-byte handle,
    no offset, no extent: a ``pinned`` pool's shape) names nothing its owner hands over: a ProtocolError, from
    ``import_buffer`` and from ``acquire`` alike, with nothing counted."""
    import dataclasses

    from dask_gpupool.errors import ProtocolError
    from dask_gpupool.wire.handoff import BufferDescriptor

    record = dataclasses.replace(RECORD, segment_memory=memory)
    m = MappedPool(record, object(), None)
    desc = BufferDescriptor(record.pool, 4096, b"\1" * 64)
    with pytest.raises(ProtocolError, match="device pool: its buffers are mapped by segment"):
        m.import_buffer(desc)
    with pytest.raises(ProtocolError, match="device pool: its buffers are mapped by segment"):
        m.acquire(desc)
    assert m.imports == 0 and m.segments == 0 and not m._shared


def test_a_descriptor_past_the_end_of_a_segment_mapped_here_is_refused():
    """The bounds of a segment already mapped are those of its mapping, not the extent a later descriptor claims:
    a descriptor naming the same segment id with a larger extent and an offset past the mapping is a ProtocolError,
    and the segment's users are not counted up."""

    from dask_gpupool.errors import ProtocolError
    from dask_gpupool.wire.handoff import BufferDescriptor

    m = mapped_with((3, 0, 0))  # segment 3 mapped here: 4096 bytes
    inside = BufferDescriptor(RECORD.pool, 1024, b"\1" * 64, 3072, 4096, 3)
    key, raw, ptr = m.acquire(inside)
    assert ptr + inside.size <= int(raw.handle) + int(raw.size)
    for offset, size, extent in ((1 << 28, 1 << 20, 1 << 29), (4096, 1, 8192), (3072, 2048, 8192)):
        with pytest.raises(ProtocolError, match="past the end of segment 3"):
            m.acquire(BufferDescriptor(RECORD.pool, size, b"\1" * 64, offset, extent, 3))
    assert m._segments[3][1] == 1 and m.imports == 1  # only the good import counted
    assert m.unshare(key)[0] is None  # still mapped: not retired


def test_a_segment_released_here_is_not_mapped_again():
    """Once this process unmapped a retired segment and released it (its ``(id, claims)`` sent), the segment is
    not mapped here again: a later claim would restart its count where the owner's ledger goes on, and the owner
    would keep the segment for good (the handoff goes as a copy instead, fallback ``retired-segment``). A retired
    segment unmapped with no claim sent nothing, and may be."""

    from dask_gpupool.errors import PeerAccessError
    from dask_gpupool.wire.handoff import BufferDescriptor

    m = mapped_with((6, 0, 2), (7, 0, 0))
    gone, released = m.retire(8)
    assert released == [(6, 2)] and len(gone) == 2
    assert m.has_released(6) and not m.has_released(7)
    with pytest.raises(PeerAccessError, match=r"segment 6 .* released here"):
        m.acquire(BufferDescriptor(RECORD.pool, 1024, b"\1" * 64, 0, 4096, 6))
    assert m.imports == 0 and m.segments == 0
    # released through its last import (unshare) too
    m = mapped_with((9, 1, 1))
    m.imports = 1
    m.retire(10)
    assert not m.has_released(9)  # still in use
    m.unshare(key_of(9))
    assert m.has_released(9)


def test_a_claim_the_owner_never_acknowledged_is_taken_back_from_the_segments_count():
    """The ``(id, claims)`` of a release must count only claims the owner acknowledged: a broker claim it refused
    (or never answered) is taken back before the buffer closes (``unclaim``), so the release matches the owner's
    ledger instead of keeping the segment there for good."""
    from dask_gpupool.wire.handoff import BufferDescriptor

    m = mapped_with((6, 0, 1))
    key, _raw, _ptr = m.acquire(BufferDescriptor(RECORD.pool, 1024, b"\1" * 64, 0, 4096, 6))
    assert m._segments[6][3] == 2
    m.unclaim(key)
    m.retire(7)
    assert m.unshare(key)[1] == (6, 1)  # the refused claim is not in the release
