"""Segments: large IPC allocations that peers map once, with buffers placed inside.

Importing a CUDA allocation costs time linear in its size (≈1.1 ms per GiB on
one H200, ≈7.7 ms per GiB across two, 2026-11-22; docs/design.md,
"Alternatives measured and removed"), so a handoff that
imports each buffer anew is slower than UCXX at GiB sizes. A ``device`` pool
therefore takes *segments* of :data:`SEGMENT_SIZE` from its segment memory
(VMM or legacy IPC memory) and places buffers inside them
(:class:`SegmentedResource`). A buffer's descriptor is then its segment's id,
size and IPC payload (if any) and an offset: a peer imports each segment once and
keeps it mapped (:class:`~dask_gpupool.handoff.mapped_pool.MappedPool`), and a later
handoff from the same segment is pointer arithmetic and a lease.

Placement
---------
Each placement is its own class, sharing the resource's lock and
:class:`~dask_gpupool.memory.segment_table.SegmentTable`; they take the
segments they place buffers in from the resource's
:class:`~dask_gpupool.memory.segment_source.SegmentSource`.

- Buffers up to the segment size:
  :class:`~dask_gpupool.memory.arena_placement.ArenaPlacement`, an
  :class:`~dask_gpupool.memory.arena.Arena` per segment (first fit), with
  stream-ordered frees: a range freed on the GPU's default stream is reused
  at once there, and on another stream after an event recorded at the
  default stream's latest free; one freed on another stream once an event
  recorded there completed.
- A buffer larger than the segment size gets a segment of its own (rounded
  up to 2 MiB), kept when the buffer is freed and reused by a later buffer
  that fits it (at most twice as small), so repeated large results map once
  (:class:`~dask_gpupool.memory.own_segments.OwnSegments`).
  When the upstream pool is full, such idle spares are freed, or reclaimed
  from the peers that map them (:class:`~dask_gpupool.memory.reclaim.Reclaim`).

Ownership, lifetime and retirement
----------------------------------
The resource owns its segments and never frees one a peer may map
(:mod:`dask_gpupool.memory.retire` describes the retire protocol and keeps its
ledger). :meth:`SegmentedResource.close` frees what the protocol allows and
hands the rest to :func:`~dask_gpupool.memory.lifetime.keep_until_exit`.
Segments of VMM memory (:mod:`dask_gpupool.memory.vmm`) and of legacy IPC
memory (:mod:`dask_gpupool.memory.legacy`) stay readable by a peer that maps
them even after they are freed here or this process died.
"""

from __future__ import annotations

import logging
import operator
import threading
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from cuda.core import MemoryResource

from dask_gpupool.errors import PoolClosedError, PoolExhaustedError, UnknownPoolError
from dask_gpupool.memory.arena_placement import BUFFER_ALIGNMENT, ArenaPlacement
from dask_gpupool.memory.home_stream import HomeStream
from dask_gpupool.memory.lifetime import keep_until_exit
from dask_gpupool.memory.own_segments import OwnSegments
from dask_gpupool.memory.reclaim import Reclaim
from dask_gpupool.memory.retire import RetireLedger
from dask_gpupool.memory.segment_source import SegmentSource
from dask_gpupool.memory.segment_table import SEGMENT_ALIGNMENT, Segment, SegmentStats, SegmentTable

if TYPE_CHECKING:
    from cuda.core import Buffer

__all__ = [
    "BUFFER_ALIGNMENT",
    "SEGMENT_ALIGNMENT",
    "SEGMENT_SIZE",
    "Segment",
    "SegmentStats",
    "SegmentedResource",
]

#: Size of a ``device`` pool's ordinary segments: a peer maps each once, so a handoff from it is an offset and a
#: lease at any size. Mapping costs ≈1.1 ms per GiB on one H200, ≈7.7 ms per GiB across two, once per segment and
#: peer; with 1 GiB segments a 1 GiB handoff took 2.11 ms instead of 5.13 ms imported anew (two H200s, 2026-11-22,
#: docs/performance.md). A larger buffer gets a segment of its own (:mod:`dask_gpupool.memory.own_segments`).
SEGMENT_SIZE = 1 << 30

logger = logging.getLogger(__name__)


class SegmentedResource(MemoryResource):
    """Buffers placed inside large segments of an IPC-enabled upstream pool.

    Parameters
    ----------
    upstream : cuda.core.MemoryResource
        The IPC-enabled pool that names this resource (UUID, shareable
        handle), and where segments come from when ``memory`` is not given
        (owned from now on: closed by :meth:`close`).
    segment_size : int
        Size of an ordinary segment (rounded up to 2 MiB).
    device : int or None
        Ordinal of the GPU the upstream pool lives on (``None`` for host memory).
    payload_of : callable
        Returns a segment Buffer's IPC payload (bytes); ``b""`` for segments
        that peers fetch by id (VMM).
    memory : cuda.core.MemoryResource, optional
        Where segments come from, when not ``upstream`` itself: a
        :class:`~dask_gpupool.memory.vmm.VmmMemoryResource` or
        :class:`~dask_gpupool.memory.legacy.LegacyMemoryResource`, whose
        memory outlives this process for peers that map it (owned from now
        on). ``upstream`` then only names the pool.

    Notes
    -----
    Thread-safe: task threads allocate, any thread (the garbage collector's
    included) deallocates. The placements (``_arena`` and ``_own``), the
    segment source and :attr:`reclaimer` share ``_lock`` and ``_segments``
    and take the lock themselves.

    Attributes
    ----------
    reclaimer : Reclaim
        What a full pool does with its large buffers' spares; its owner
        sets how reclaimed spares are published
        (:meth:`Reclaim.through <dask_gpupool.memory.reclaim.Reclaim.through>`).
    """

    upstream: Any
    memory: Any
    segment_size: int
    retire_below: int
    _home: HomeStream | None
    _segments: SegmentTable
    _kept: SegmentTable
    _source: SegmentSource
    _arena: ArenaPlacement
    _own: OwnSegments
    _closed: bool
    _lock: threading.RLock
    _ledger: RetireLedger
    reclaimer: Reclaim

    def __init__(
        self,
        upstream: Any,
        segment_size: int,
        device: int | None,
        payload_of: Any,
        memory: Any = None,
    ) -> None:
        if segment_size <= 0:
            raise ValueError(f"segment_size must be positive, got {segment_size}")
        self.upstream = upstream
        self.memory = upstream if memory is None else memory
        self.segment_size = -(-segment_size // SEGMENT_ALIGNMENT) * SEGMENT_ALIGNMENT
        self.retire_below = 0
        self._home = home = None if device is None else HomeStream(device)
        self._segments = segments = SegmentTable()
        self._kept = SegmentTable()  # segments kept at close, until the process exits: buffers freed after count
        self._closed = False
        self._lock = lock = threading.RLock()
        self._ledger = RetireLedger()
        self._source = source = SegmentSource(self.memory, payload_of, segments, lock, self._ledger, home)
        self._arena = ArenaPlacement(segments, lock, source.new, self.segment_size, home)
        self._own = OwnSegments(segments, lock, source.new, home)
        self.reclaimer = Reclaim(segments, lock, source, self._own, self._ledger, home, lambda: self.retire_below)

    # -- MemoryResource ----------------------------------------------------------------

    def allocate(self, size: int, *, stream: Any = None, wait: bool = False) -> Buffer:
        """A buffer of ``size`` bytes inside a segment, owned by the caller.

        ``wait``: when the pool is full, wait for peers to release the spares
        it reclaims (:meth:`Reclaim.when_full
        <dask_gpupool.memory.reclaim.Reclaim.when_full>`): for a task's own
        allocation, which has nothing better to do. Without it a full pool
        still reclaims (so that later allocations fit) but fails at once:
        callers with a fallback (staging, a copy's landing buffer) take it.

        Raises
        ------
        PoolExhaustedError
            When neither a segment nor the upstream pool has room.
        PoolClosedError
            After :meth:`close`.
        TypeError, ValueError
            If ``size`` is not an integer, or negative.
        """
        from cuda.core import Buffer

        size = operator.index(size)  # a Python int: NumPy's int64 wrapped around when rounded up near 2**63
        if size < 0:
            raise ValueError(f"cannot allocate {size} bytes")
        if self._closed:
            raise PoolClosedError("the segmented resource is closed")
        if self._home is not None:
            home = self._home()
            stream = home if stream is None else stream
        place = self._own.allocate if size > self.segment_size else self._arena.allocate
        try:
            ptr = place(size, stream)
        except PoolExhaustedError as full:
            ptr = self.reclaimer.when_full(place, size, stream, full, wait)
        if stream is None:
            return Buffer.from_handle(ptr, size, mr=self)
        return Buffer.from_handle(ptr, size, mr=self, stream=stream)

    def deallocate(self, ptr: Any, size: int, *, stream: Any = None) -> None:
        """Give a buffer's range back once the work queued on ``stream`` before now is done."""
        if self._closed:
            self._freed_after_close(int(ptr))
            return
        seg, offset = self.locate(int(ptr))
        if seg.own:
            self._own.free(seg, stream)
            if seg.retiring:
                self._collect()
            return
        if not self._arena.free(seg, offset, stream):
            self._freed_after_close(int(ptr))  # closed meanwhile
            return
        if seg.retiring and seg.live == 0:
            self._collect()

    @property
    def is_device_accessible(self) -> bool:
        return bool(self.upstream.is_device_accessible)

    @property
    def is_host_accessible(self) -> bool:
        return bool(self.upstream.is_host_accessible)

    @property
    def device_id(self) -> int:
        return int(self.upstream.device_id)

    # -- what the pool and the exporter need -------------------------------------------

    @property
    def allocation_handle(self) -> Any:
        """The upstream pool's shareable handle (what peers map)."""
        return self.upstream.allocation_handle

    @property
    def uuid(self) -> Any:
        return self.upstream.uuid

    @property
    def attributes(self) -> SegmentStats:
        """Bytes in buffers and in segments, now and at most (finished frees counted)."""
        with self._lock:
            self._arena.reap(wait=False)
            return self._segments.stats()

    def locate(self, ptr: int) -> tuple[Segment, int]:
        """The segment holding address ``ptr`` and the offset inside it.

        Raises
        ------
        ValueError
            If ``ptr`` is in no segment of this resource.
        """
        with self._lock:
            found = self._segments.locate(ptr)
            if found is not None:
                return found
        raise ValueError(f"address {ptr:#x} is in no segment of this resource")

    @property
    def segments(self) -> int:
        """How many segments the resource holds."""
        return len(self._segments)

    @property
    def exports_segments(self) -> bool:
        """Whether peers map segments by fd (VMM) rather than through the pool's handle or their own IPC handle
        (legacy IPC memory: the handle travels in the descriptor): the segment memory's ``exports_fds``."""
        return self.memory is not self.upstream and bool(getattr(self.memory, "exports_fds", False))

    def segment_fd(self, segment_id: int) -> tuple[int, int]:
        """A new fd of segment ``segment_id`` and its size, for a peer; the **caller closes the fd**.

        Raises
        ------
        UnknownPoolError
            If there is no such segment (never made, or freed) or segments are
            not exported by fd here.
        """
        if not self.exports_segments:
            raise UnknownPoolError("this pool's segments are mapped through the pool, not by fd")
        with self._lock:  # a segment is unregistered under the lock before it is freed
            seg = self._segments.get(segment_id)
            if seg is None:
                raise UnknownPoolError(f"segment {segment_id} is not in this pool (freed, or never made)")
            return self.memory.export_fd(seg.base), seg.size

    # -- the retire protocol (owner's side) ----------------------------------------------

    def retire(self) -> int:
        """Retire every segment there is now; return :attr:`retire_below` (publish it to peers).

        Retired segments take no new buffers and are freed once no buffer
        lives in them and no peer maps them (see the module notes). Segments
        already free of both go at once.
        """
        with self._lock:
            if self._closed:
                raise PoolClosedError("the segmented resource is closed")
            self.retire_below = self._source.next_id
            self._retire_all()
        self._collect()
        return self.retire_below

    def note_claims(self, segment_ids: list[int], connection: Hashable) -> None:
        """A peer claimed leases on buffers in these segments (one id per lease).

        ``connection`` names the peer: its worker address (the broker's importer).
        """
        with self._lock:
            self._ledger.claimed((i for i in segment_ids if i in self._segments), connection)

    def forget_claims(self, segment_ids: list[int], connection: Hashable) -> None:
        """Leases noted for a peer at their grant ended without the peer holding them (one id per lease)."""
        with self._lock:
            self._ledger.unclaimed(segment_ids, connection)
        self._collect()

    def note_released(self, releases: list[tuple[int, int]], connection: Hashable) -> None:
        """A peer unmapped segments: ``(segment id, leases it had claimed on it in all)`` pairs."""
        with self._lock:
            self._ledger.released(releases, connection)
        self._collect()

    def drop_connection(self, connection: Hashable) -> None:
        """A peer is gone (its process exited, or it left the registry and cannot be watched): it maps nothing
        any more."""
        with self._lock:
            self._ledger.drop_peer(connection)
        self._collect()

    @property
    def retiring(self) -> int:
        """Retired segments not freed yet."""
        with self._lock:
            return sum(seg.retiring for seg in self._segments)

    def close(self, free_segments: bool = False) -> None:
        """Close the resource and the upstream pool. Idempotent.

        Segments no peer maps and no buffer lives in are freed; the rest are
        kept until the process exits, unless ``free_segments`` is true, which
        is only safe when no other process imported them. Buffers still alive
        here must not be used after; freeing them takes their bytes out of
        :attr:`attributes`' used bytes, and gives nothing back.
        """
        with self._lock:
            if self._closed:
                return
            self._retire_all()
        self._collect(force=free_segments)
        with self._lock:
            self._closed = True
            self.reclaimer.close()  # an allocation waiting for reclaimed spares ends
            segments = self._segments.clear()
            for seg in segments:
                self._kept.add(seg)
            self._arena.close()
        if segments:
            keep_until_exit(seg.buffer for seg in segments)
            logger.info("closing with %d segment(s) a peer may still map: kept until this process exits", len(segments))
        if self.memory is not self.upstream:
            self.memory.close()
        self.upstream.close()

    @property
    def reclaim(self) -> tuple[int, ...]:
        """Ids of the segments reclaimed one by one and not freed yet, ascending (the row's ``reclaim``)."""
        with self._lock:
            return tuple(sorted(self.reclaimer.reclaimed()))

    # -- internals -----------------------------------------------------------------------

    def _freed_after_close(self, ptr: int) -> None:
        """A buffer freed after :meth:`close`: its segment stays kept (nothing is reused), its bytes leave
        ``used``. Nothing for a segment freed at close (``free_segments``) or a buffer counted freed already."""
        with self._lock:
            found = self._kept.locate(ptr)
            if found is None:
                return
            seg, offset = found
            if seg.own:
                nbytes = seg.size if seg.live else 0
            else:
                assert seg.arena is not None
                nbytes = seg.arena.size_of(offset) or 0
                if nbytes:
                    seg.arena.free(offset)
            if nbytes:
                seg.live -= 1
                self._segments.count_freed(nbytes)

    def _retire_all(self) -> None:
        """Mark every segment retiring: new buffers go to new segments (call with ``_lock`` held)."""
        for seg in self._segments:
            seg.retiring = True

    def _collect(self, force: bool = False) -> None:
        """Free retiring segments no buffer lives in and no peer maps."""
        with self._lock:
            if self._closed:
                return
            self._arena.reap_retiring()

            def free(s: Segment) -> bool:
                return s.retiring and (force or (s.live == 0 and not self._ledger.mapped(s.id)))

            singles = [self._source.unregister(s) for s in self._segments if free(s)]
        if not singles:
            return
        if self._home is not None:
            self._home.sync()  # frees queued on any stream have run
        for s in singles:
            self._source.free(s)
        self.reclaimer.notify_freed()
        logger.info("freed %d retired segment(s)", len(singles))
