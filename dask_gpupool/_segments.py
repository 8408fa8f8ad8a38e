"""Segments: large IPC allocations that peers map once, with buffers placed inside.

Importing a CUDA allocation costs time linear in its size (≈1.1 ms per GiB on
one H200, ≈7.7 ms per GiB across two; ``shared/GPU.md``), so a handoff that
imports each buffer anew is slower than UCXX at GiB sizes. A ``device`` pool
with ``gpupool.segment-size`` set therefore takes *segments* from its
IPC-enabled cuda.core pool and places buffers inside them
(:class:`SegmentedResource`). A buffer's descriptor is then its segment's IPC
payload and an offset: a peer imports each segment once and keeps it mapped
(:class:`~dask_gpupool._mapping.MappedPool`), and a later handoff from the
same segment is pointer arithmetic and a lease.

Ownership and lifetime
----------------------
- The resource owns its segments. A segment is never freed while the pool
  lives, so a peer may keep it mapped between handoffs. Peers drop their
  mappings only when the pool leaves the registry, which happens after it
  closed, so :meth:`close` does not free segments either: it hands them to
  :func:`~dask_gpupool._pool.keep_until_exit` (the driver keeps importers'
  mappings valid past the exporter's exit, never past an explicit free).
  Like the CUDA pool below it, which never returns memory to the OS, the
  segments stay reserved up to the high-water mark.
- Buffers are placed with :class:`~dask_gpupool._arena.Arena` (first fit,
  coalescing), the allocator the ``host`` pool already uses and tests: one
  arena per segment. Freeing is stream-ordered, like CUDA's own pools and
  RMM's: a range freed on the GPU's default stream (the *home* stream, where
  allocations without a stream are made) is reused at once, since later work
  on that stream runs after the work queued before the free; an allocation
  for another stream first makes that stream wait for the home stream. A
  range freed on any other stream is reused only once an event recorded
  there completed. (Measured on an H200: recording an event per free cost
  1.6 µs of a 13.8 µs free + allocate pair; ``benchmarks/suballocator.py``.)
- A buffer larger than the segment size gets a segment of its own (rounded
  up to 2 MiB), reused by later buffers that fit.
"""

from __future__ import annotations

import bisect
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cuda.core import MemoryResource

from dask_gpupool._arena import Arena
from dask_gpupool._errors import PoolClosedError, PoolExhaustedError
from dask_gpupool._pool import keep_until_exit

if TYPE_CHECKING:
    from cuda.core import Buffer

__all__ = ["Segment", "SegmentStats", "SegmentedResource"]

logger = logging.getLogger(__name__)

#: Granularity of segment sizes (CUDA's large-page size).
SEGMENT_ALIGNMENT = 2 << 20
#: Alignment of buffers inside a segment (CuPy and cudaMalloc give 256 bytes; 512 keeps vector loads happy).
BUFFER_ALIGNMENT = 512


@dataclass
class Segment:
    """One upstream allocation that buffers are placed in.

    Attributes
    ----------
    buffer : cuda.core.Buffer
        The upstream allocation; owned by the :class:`SegmentedResource`.
    base : int
        Its device address.
    size : int
        Its size in bytes.
    payload : bytes
        Its IPC payload (what a peer imports), computed once.
    arena : Arena
        Where buffers are placed inside it.
    """

    buffer: Any
    base: int
    size: int
    payload: bytes
    arena: Arena


@dataclass(frozen=True)
class SegmentStats:
    """Statistics named like cuda.core's pool attributes (see :meth:`SegmentedResource.attributes`)."""

    used_mem_current: int
    used_mem_high: int
    reserved_mem_current: int
    reserved_mem_high: int


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
        Returns a segment Buffer's IPC payload (bytes).

    Notes
    -----
    Thread-safe: task threads allocate, any thread (the garbage collector's
    included) deallocates.
    """

    upstream: Any
    segment_size: int
    _device: int | None
    _payload_of: Any
    _segments: list[Segment]
    _bases: list[int]
    _pending: list[tuple[Segment, int, Any]]
    _used_high: int
    _reserved_high: int
    _closed: bool
    _lock: threading.RLock
    _home_handle: int | None

    def __init__(self, upstream: Any, segment_size: int, device: int | None, payload_of: Any) -> None:
        if segment_size <= 0:
            raise ValueError(f"segment_size must be positive, got {segment_size}")
        self.upstream = upstream
        self.segment_size = -(-segment_size // SEGMENT_ALIGNMENT) * SEGMENT_ALIGNMENT
        self._device = device
        self._payload_of = payload_of
        self._segments = []
        self._bases = []
        self._pending = []
        self._used_high = self._reserved_high = 0
        self._closed = False
        self._lock = threading.RLock()
        self._home_handle = None

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

        if self._device is not None:
            home = self._home()
            if stream is None:
                stream = home
            elif int(stream.handle) != self._home_handle:
                stream.wait(home)  # ranges freed on the home stream are reused at once
        with self._lock:
            if self._closed:
                raise PoolClosedError("the segmented resource is closed")
            self._reap(wait=False)
            seg, offset = self._place(size, stream)
            self._used_high = max(self._used_high, self._used())
        if stream is None:
            return Buffer.from_handle(seg.base + offset, size, mr=self)
        return Buffer.from_handle(seg.base + offset, size, mr=self, stream=stream)

    def deallocate(self, ptr: Any, size: int, *, stream: Any = None) -> None:
        """Give a buffer's range back once the work queued on ``stream`` before now is done."""
        seg, offset = self.locate(int(ptr))
        event = None
        if stream is not None and self._device is not None and int(stream.handle) != self._home_handle:
            self._home()
            event = stream.record()
        with self._lock:
            if self._closed:
                return
            self._pending.append((seg, offset, event))
            self._reap(wait=False)

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
            reserved = sum(s.size for s in self._segments)
            return SegmentStats(self._used(), self._used_high, reserved, self._reserved_high)

    def locate(self, ptr: int) -> tuple[Segment, int]:
        """The segment holding address ``ptr`` and the offset inside it.

        Raises
        ------
        ValueError
            If ``ptr`` is in no segment of this resource.
        """
        with self._lock:
            i = bisect.bisect_right(self._bases, ptr) - 1
            if i >= 0:
                seg = self._segments[i]
                if ptr < seg.base + seg.size:
                    return seg, ptr - seg.base
        raise ValueError(f"address {ptr:#x} is in no segment of this resource")

    @property
    def segments(self) -> int:
        """How many segments the resource holds."""
        return len(self._segments)

    def close(self, free_segments: bool = False) -> None:
        """Close the resource and the upstream pool. Idempotent.

        Segments are kept until the process exits (peers may still map them)
        unless ``free_segments`` is true, which is only safe when no other
        process ever imported them. Buffers still alive here must not be used
        after.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            segments, self._segments, self._bases, self._pending = self._segments, [], [], []
        if not free_segments:
            keep_until_exit(seg.buffer for seg in segments)
            segments = []
        for seg in segments:
            try:
                if self._device is not None:
                    from cuda.core import Device

                    dev = Device(self._device)
                    dev.set_current()
                    seg.buffer.close(dev.default_stream)
                else:
                    seg.buffer.close()
            except Exception:
                logger.exception("freeing a segment of %d bytes failed", seg.size)
        self.upstream.close()

    # -- internals -----------------------------------------------------------------------

    def _home(self) -> Any:
        """The GPU's default stream, with the GPU made current (device segments only)."""
        from cuda.core import Device

        dev = Device(self._device)
        dev.set_current()
        home = dev.default_stream
        if self._home_handle is None:
            self._home_handle = int(home.handle)
        return home

    # -- internals (under the lock) ----------------------------------------------------

    def _used(self) -> int:
        return sum(s.arena.used for s in self._segments)

    def _place(self, size: int, stream: Any) -> tuple[Segment, int]:
        for wait in (False, True):
            for seg in self._segments:
                try:
                    return seg, seg.arena.allocate(size)
                except PoolExhaustedError:
                    continue
            if not wait or not self._pending:
                break
            self._reap(wait=True)  # frees still in flight may make room
        seg = self._new_segment(size, stream)
        return seg, seg.arena.allocate(size)

    def _new_segment(self, size: int, stream: Any) -> Segment:
        want = max(self.segment_size, -(-size // SEGMENT_ALIGNMENT) * SEGMENT_ALIGNMENT)
        try:
            buf = self.upstream.allocate(want, stream=stream)
        except Exception as e:
            if not isinstance(e, PoolExhaustedError) and "OUT_OF_MEMORY" not in str(e):
                raise
            raise PoolExhaustedError(
                f"cannot allocate {size} bytes: no segment has room and a new segment of {want} bytes "
                f"does not fit ({self._used()} bytes in buffers, {sum(s.size for s in self._segments)} in "
                f"{len(self._segments)} segment(s)): {e}"
            ) from e
        seg = Segment(buf, int(buf.handle), want, self._payload_of(buf), Arena(want, BUFFER_ALIGNMENT))
        i = bisect.bisect_left(self._bases, seg.base)
        self._bases.insert(i, seg.base)
        self._segments.insert(i, seg)
        self._reserved_high = max(self._reserved_high, sum(s.size for s in self._segments))
        logger.debug("new segment of %d bytes at %#x (%d in all)", want, seg.base, len(self._segments))
        return seg

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
            seg.arena.free(offset)
        self._pending = keep
