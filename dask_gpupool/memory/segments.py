"""Segments: large IPC allocations that peers map once, with buffers placed inside.

Importing a CUDA allocation costs time linear in its size (≈1.1 ms per GiB on
one H200, ≈7.7 ms per GiB across two, as measured on the project's GPUs and
seen again in docs/performance.md's first run), so a handoff that
imports each buffer anew is slower than UCXX at GiB sizes. A ``device`` pool
with ``gpupool.segment-size`` set therefore takes *segments* from its
IPC-enabled cuda.core pool and places buffers inside them
(:class:`SegmentedResource`). A buffer's descriptor is then its segment's IPC
payload, the segment's id and an offset: a peer imports each segment once and
keeps it mapped (:class:`~dask_gpupool.handoff.mappings.MappedPool`), and a later
handoff from the same segment is pointer arithmetic and a lease.

Placement
---------
- **RMM** (``suballocator="rmm"``, the default when RMM is installed):
  :mod:`dask_gpupool.memory.rmm_placement`, one RMM pool per generation of
  segments.
- **Arena** (``suballocator="arena"``, and whenever RMM cannot be imported,
  as on hosts without CUDA): :class:`~dask_gpupool.memory.arena.Arena`, first fit,
  one per segment, with stream-ordered frees done here (a range freed on the
  GPU's default stream is reused at once; one freed on another stream once an
  event recorded there completed).
- A buffer larger than the segment size gets a segment of its own (rounded
  up to 2 MiB), kept when the buffer is freed and reused by a later buffer
  that fits it (at most twice as small), so repeated large results map once.
  When the upstream pool is full, such idle segments that no peer maps are
  freed and the allocation is tried once more.

Ownership, lifetime and retirement
----------------------------------
The resource owns its segments and never frees one a peer may map
(:mod:`dask_gpupool.memory.retire` describes the retire protocol and keeps its
ledger). :meth:`SegmentedResource.close` frees what the protocol allows and
hands the rest to :func:`~dask_gpupool.memory.lifetime.keep_until_exit`.
Segments of VMM memory (:mod:`dask_gpupool.memory.vmm`, the default) stay
readable by a peer that maps them even after they are freed here or this
process died (the peer holds its own reference); pool-memory segments do not
across GPUs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from cuda.core import MemoryResource

from dask_gpupool.errors import PoolClosedError, PoolExhaustedError, UnknownPoolError
from dask_gpupool.memory.arena import Arena
from dask_gpupool.memory.lifetime import keep_until_exit
from dask_gpupool.memory.retire import RetireLedger
from dask_gpupool.memory.rmm_placement import RMM_ALIGNMENT, Generation, RmmStreams, rmm_available
from dask_gpupool.memory.segment_table import Segment, SegmentStats, SegmentTable

if TYPE_CHECKING:
    from cuda.core import Buffer

__all__ = ["Segment", "SegmentStats", "SegmentedResource"]

logger = logging.getLogger(__name__)

#: Granularity of segment sizes (CUDA's large-page size).
SEGMENT_ALIGNMENT = 2 << 20
#: Alignment of buffers inside a segment (CuPy and cudaMalloc give 256 bytes; 512 keeps vector loads happy).
BUFFER_ALIGNMENT = 512


class SegmentedResource(MemoryResource):
    """Buffers placed inside large segments of an IPC-enabled upstream pool.

    Parameters
    ----------
    upstream : cuda.core.MemoryResource
        The IPC-enabled pool segments come from (owned from now on: closed by
        :meth:`close`).
    segment_size : int
        Size of an ordinary segment (rounded up to 2 MiB).
    device : int or None
        Ordinal of the GPU the upstream pool lives on (``None`` for host memory).
    payload_of : callable
        Returns a segment Buffer's IPC payload (bytes); ``b""`` for segments
        that peers fetch by id (VMM).
    suballocator : {"auto", "rmm", "arena"}
        What places buffers inside segments; ``"auto"``: RMM on a GPU when it
        imports, else the arena.
    memory : cuda.core.MemoryResource, optional
        Where segments come from, when not ``upstream`` itself: a
        :class:`~dask_gpupool.memory.vmm.VmmMemoryResource`, whose memory outlives
        this process for peers that map it (owned from now on). ``upstream``
        then only names the pool (UUID, shareable handle).

    Notes
    -----
    Thread-safe: task threads allocate, any thread (the garbage collector's
    included) deallocates. RMM is never called with ``_lock`` held (RMM calls
    back into :meth:`_new_segment` with its own lock held).
    """

    upstream: Any
    memory: Any
    segment_size: int
    suballocator: str
    retire_below: int
    _device: int | None
    _payload_of: Any
    _segments: SegmentTable
    _pending: list[tuple[Segment, int, Any]]
    _generation: Generation | None
    _retired_generations: list[Generation]
    _used: int
    _used_high: int
    _reserved_high: int
    _next_id: int
    _closed: bool
    _lock: threading.RLock
    _home_handle: int | None
    _home_stream: Any
    _dev: Any
    _rmm_streams: RmmStreams
    _ledger: RetireLedger

    def __init__(
        self,
        upstream: Any,
        segment_size: int,
        device: int | None,
        payload_of: Any,
        suballocator: str = "auto",
        memory: Any = None,
    ) -> None:
        if segment_size <= 0:
            raise ValueError(f"segment_size must be positive, got {segment_size}")
        if suballocator not in ("auto", "rmm", "arena"):
            raise ValueError(f"suballocator must be 'auto', 'rmm' or 'arena', got {suballocator!r}")
        if suballocator == "auto":
            suballocator = "rmm" if device is not None and rmm_available() else "arena"
        elif suballocator == "rmm" and (device is None or not rmm_available()):
            raise ValueError("suballocator='rmm' needs a GPU and the rmm package (pip install rmm-cu12 or rmm-cu13)")
        self.upstream = upstream
        self.memory = upstream if memory is None else memory
        self.segment_size = -(-segment_size // SEGMENT_ALIGNMENT) * SEGMENT_ALIGNMENT
        self.suballocator = suballocator
        self.retire_below = 0
        self._device = device
        self._payload_of = payload_of
        self._segments = SegmentTable()
        self._pending = []
        self._generation = None
        self._retired_generations = []
        self._used = self._used_high = self._reserved_high = 0
        self._next_id = 1
        self._closed = False
        self._lock = threading.RLock()
        self._home_handle = None
        self._home_stream = self._dev = None
        self._rmm_streams = RmmStreams()
        self._ledger = RetireLedger()

    # -- MemoryResource ----------------------------------------------------------------

    def allocate(self, size: int, *, stream: Any = None) -> Buffer:
        """A buffer of ``size`` bytes inside a segment, owned by the caller.

        Raises
        ------
        PoolExhaustedError
            When neither a segment nor the upstream pool has room.
        PoolClosedError
            After :meth:`close`.
        """
        from cuda.core import Buffer

        if self._closed:
            raise PoolClosedError("the segmented resource is closed")
        if self._device is not None:
            home = self._home()
            stream = home if stream is None else stream
        place = (
            self._allocate_own
            if size > self.segment_size
            else self._allocate_rmm
            if self.suballocator == "rmm"
            else self._allocate_arena
        )
        try:
            ptr = place(size, stream)
        except PoolExhaustedError:
            if not self._drop_spares():
                raise
            ptr = place(size, stream)  # the upstream has the spares' memory back
        if stream is None:
            return Buffer.from_handle(ptr, size, mr=self)
        return Buffer.from_handle(ptr, size, mr=self, stream=stream)

    def deallocate(self, ptr: Any, size: int, *, stream: Any = None) -> None:
        """Give a buffer's range back once the work queued on ``stream`` before now is done."""
        if self._closed:
            return
        seg, offset = self.locate(int(ptr))
        if seg.own:
            event = None
            if self._device is not None:
                home = self._home()
                event = (stream if stream is not None else home).record()
            with self._lock:
                seg.live, seg.free_event = 0, event
                self._used -= seg.size
            if seg.retiring:
                self._collect()
            return
        if self.suballocator == "rmm":
            self._home()  # RMM records its free event on the GPU: make it current in this thread (maybe the GC's)
            seg.generation.pool.deallocate(int(ptr), max(size, 1), self._rmm_stream(stream))
            with self._lock:
                seg.live -= 1
                self._used -= -(-max(size, 1) // RMM_ALIGNMENT) * RMM_ALIGNMENT
            if seg.retiring and seg.live == 0:
                self._collect()
            return
        event = None
        if stream is not None and self._device is not None and int(stream.handle) != self._home_handle:
            self._home()
            event = stream.record()
        with self._lock:
            if self._closed:
                return
            self._pending.append((seg, offset, event))
            self._reap(wait=False)
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
            self._reap(wait=False)
            reserved = self._segments.reserved
            return SegmentStats(self._used, self._used_high, reserved, self._reserved_high)

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
        """Whether peers map segments by fd (VMM) rather than through the pool's handle."""
        return self.memory is not self.upstream

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
            self.retire_below = self._next_id
            self._retire_all()
        self._collect()
        return self.retire_below

    def note_claims(self, segment_ids: list[int], connection: Hashable) -> None:
        """A peer claimed leases on buffers in these segments (one id per lease).

        ``connection`` names the peer: its worker address (the broker's importer).
        """
        with self._lock:
            self._ledger.claimed((i for i in segment_ids if i in self._segments), connection)

    def note_released(self, releases: list[tuple[int, int]], connection: Hashable) -> None:
        """A peer unmapped segments: ``(segment id, leases it had claimed on it in all)`` pairs."""
        with self._lock:
            self._ledger.released(releases, connection)
        self._collect()

    def drop_connection(self, connection: Hashable) -> None:
        """A peer is gone (its process exited, or it left the registry): it maps nothing any more."""
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
        here must not be used after.
        """
        with self._lock:
            if self._closed:
                return
            self._retire_all()
        self._collect(force=free_segments)
        with self._lock:
            self._closed = True
            segments, self._pending = self._segments.clear(), []
            generations, self._retired_generations = self._retired_generations, []
        for g in generations:
            g.pool = None  # RMM gives its blocks back through _give, which finds them unregistered: kept
        if segments:
            keep_until_exit(seg.buffer for seg in segments)
            logger.info("closing with %d segment(s) a peer may still map: kept until this process exits", len(segments))
        if self.memory is not self.upstream:
            self.memory.close()
        self.upstream.close()

    # -- internals -----------------------------------------------------------------------

    def _home(self) -> Any:
        """The GPU's default stream, with the GPU made current (device segments only)."""
        dev = self._dev
        if dev is None:
            from cuda.core import Device

            dev = self._dev = Device(self._device)
            dev.set_current()
            self._home_stream = dev.default_stream
            self._home_handle = int(self._home_stream.handle)
        else:
            dev.set_current()
        return self._home_stream

    def _rmm_stream(self, stream: Any) -> Any:
        return self._rmm_streams.get(stream if stream is not None else self._home())

    def _allocate_rmm(self, size: int, stream: Any) -> int:
        gen = self._generation
        if gen is None:
            with self._lock:
                gen = self._generation
                if gen is None:
                    gen = self._generation = self._new_generation(size)
        try:
            ptr = int(gen.pool.allocate(max(size, 1), self._rmm_stream(stream)))  # RMM gives no address for 0
        except MemoryError as e:
            raise self._exhausted(size, e) from None
        with self._lock:
            seg, _ = self._segments.locate(ptr)  # type: ignore[misc]  # RMM placed it in a segment of ours
            seg.live += 1
            self._used += -(-max(size, 1) // RMM_ALIGNMENT) * RMM_ALIGNMENT
            self._used_high = max(self._used_high, self._used)
        return ptr

    def _new_generation(self, size: int) -> Generation:
        """A new RMM pool whose first segment is the segment size, or less when the upstream is short."""
        initial = self.segment_size
        while True:
            try:
                return Generation(self, initial)
            except MemoryError as e:
                if initial <= max(SEGMENT_ALIGNMENT, size):
                    raise self._exhausted(size, e) from None
                initial = max(SEGMENT_ALIGNMENT, initial // 2 // SEGMENT_ALIGNMENT * SEGMENT_ALIGNMENT)

    def _allocate_arena(self, size: int, stream: Any) -> int:
        if self._device is not None and int(stream.handle) != self._home_handle:
            stream.wait(self._home())  # ranges freed on the home stream are reused at once
        with self._lock:
            self._reap(wait=False)
            seg, offset = self._place(size, stream)
            seg.live += 1
            self._used += seg.arena.size_of(offset) or 0  # type: ignore[union-attr]
            self._used_high = max(self._used_high, self._used)
        return seg.base + offset

    def _allocate_own(self, size: int, stream: Any) -> int:
        need = -(-size // SEGMENT_ALIGNMENT) * SEGMENT_ALIGNMENT
        with self._lock:
            spares = [s for s in self._segments if s.own and not (s.live or s.retiring) and need <= s.size <= 2 * need]
            seg = min(spares, key=lambda s: s.size) if spares else None
            if seg is not None:
                seg.live = 1
                event, seg.free_event = seg.free_event, None
                self._used += seg.size
                self._used_high = max(self._used_high, self._used)
        if seg is not None:
            if event is not None:
                stream.wait(event)
                event.close()
            return seg.base
        seg = self._new_segment(need, own=True, stream=stream)
        return seg.base

    def _new_segment(self, size: int, *, own: bool = False, generation: Any = None, stream: Any = None) -> Segment:
        """Take ``size`` bytes from upstream and register them as a segment (any placement)."""
        if stream is None and self._device is not None:
            stream = self._home()
        try:
            buf = self.memory.allocate(size, stream=stream)
        except Exception as e:
            if not isinstance(e, PoolExhaustedError) and "OUT_OF_MEMORY" not in str(e):
                raise
            if generation is not None:
                raise MemoryError(str(e)) from None  # RMM tries a smaller segment, then gives up
            raise self._exhausted(size, e) from None
        with self._lock:
            # VMM rounds up to its granularity: the segment is what was made
            seg = Segment(buf, int(buf.handle), max(size, int(buf.size)), self._payload_of(buf), self._next_id, own=own)
            self._next_id += 1
            if own:
                seg.live = 1
                self._used += size
                self._used_high = max(self._used_high, self._used)
            elif generation is not None:
                seg.generation = generation
            else:
                seg.arena = Arena(size, BUFFER_ALIGNMENT)
            self._segments.add(seg)
            self._reserved_high = max(self._reserved_high, self._segments.reserved)
        logger.debug("segment %d: %d bytes at %#x (%d in all)", seg.id, size, seg.base, len(self._segments))
        return seg

    def _drop_spares(self) -> int:
        """Free own segments that hold no buffer and that no peer maps (a full pool's last resort); how many."""
        with self._lock:  # unregistered here, so that no allocation takes one meanwhile
            spares = [
                self._unregister(s) for s in self._segments if s.own and not s.live and not self._ledger.mapped(s.id)
            ]
        if not spares:
            return 0
        if self._device is not None:
            self._home()
            self._dev.sync()  # their last buffers' frees have run
        for s in spares:
            self._free(s)
        freed = sum(s.size for s in spares)
        logger.info("pool full: freed %d idle large-buffer segment(s), %d bytes", len(spares), freed)
        return len(spares)

    def _retire_all(self) -> None:
        """Mark every segment retiring; new buffers go to a new RMM pool (call with ``_lock`` held)."""
        for seg in self._segments:
            seg.retiring = True
        if self._generation is not None:
            self._retired_generations.append(self._generation)
            self._generation = None

    def _exhausted(self, size: int, e: BaseException) -> PoolExhaustedError:
        with self._lock:
            reserved, n = self._segments.reserved, len(self._segments)
        return PoolExhaustedError(
            f"cannot allocate {size} bytes: no segment has room and a new segment does not fit "
            f"({self._used} bytes in buffers, {reserved} in {n} segment(s)): {e}"
        )

    def _release_segment(self, ptr: int) -> None:
        """Free the segment at ``ptr`` (RMM's ``_give``, or :meth:`_collect`): unregister it, free upstream."""
        with self._lock:
            found = self._segments.starting_at(ptr)
            if found is None:
                return  # unregistered already (close)
            seg = self._unregister(found)
        self._free(seg)

    def _unregister(self, seg: Segment) -> Segment:
        """Take ``seg`` out of the lookup tables (call with ``_lock`` held); return it."""
        self._segments.remove(seg)
        self._ledger.forget(seg.id)
        return seg

    def _free(self, seg: Segment) -> None:
        """Give an unregistered segment back to the upstream pool."""
        try:
            if self._device is not None:
                home = self._home()
                if seg.free_event is not None:
                    seg.free_event.close()
                seg.buffer.close(home)
            else:
                seg.buffer.close()
        except Exception:
            logger.exception("freeing segment %d (%d bytes) failed", seg.id, seg.size)
        logger.debug("segment %d: freed (%d bytes)", seg.id, seg.size)

    def _collect(self, force: bool = False) -> None:
        """Free retiring segments (and RMM generations) no buffer lives in and no peer maps."""
        with self._lock:
            if self._closed:
                return
            if self._pending and any(seg.retiring for seg, _, _ in self._pending):
                self._reap(wait=True)

            def free(s: Segment) -> bool:
                return s.retiring and (force or (s.live == 0 and not self._ledger.mapped(s.id)))

            singles = [self._unregister(s) for s in self._segments if s.generation is None and free(s)]
            done = [g for g in self._retired_generations if all(free(s) for s in g.segments)]
            for g in done:
                self._retired_generations.remove(g)
        if not singles and not done:
            return
        if self._device is not None:
            self._home()
            self._dev.sync()  # frees queued on any stream have run
        for s in singles:
            self._free(s)
        for g in done:
            pool, g.pool = g.pool, None
            del pool  # RMM releases its upstream blocks through _give
            g.segments.clear()
        logger.info("freed %d retired segment(s) and %d RMM pool(s)", len(singles), len(done))

    # -- internals (under the lock) ----------------------------------------------------

    def _place(self, size: int, stream: Any) -> tuple[Segment, int]:
        for wait in (False, True):
            for seg in self._segments:
                if seg.arena is None or seg.retiring:
                    continue
                try:
                    return seg, seg.arena.allocate(size)
                except PoolExhaustedError:
                    continue
            if not wait or not self._pending:
                break
            self._reap(wait=True)  # frees still in flight may make room
        seg = self._new_segment(self.segment_size, stream=stream)
        assert seg.arena is not None
        return seg, seg.arena.allocate(size)

    def _reap(self, *, wait: bool) -> None:
        keep = []
        for seg, offset, event in self._pending:
            if event is not None and not wait and not event.is_done:
                keep.append((seg, offset, event))
                continue
            if event is not None:
                if wait:
                    event.sync()
                event.close()
            assert seg.arena is not None
            size = seg.arena.free(offset)
            seg.live -= 1
            self._used -= size
        self._pending = keep
