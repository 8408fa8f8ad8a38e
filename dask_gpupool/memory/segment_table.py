"""The segments a :class:`~dask_gpupool.memory.segments.SegmentedResource` holds, and their records.

:class:`Segment` is one upstream allocation that buffers are placed in;
:class:`SegmentTable` finds one by address (a buffer's pointer) and by id (a
descriptor's segment number), and counts the bytes in segments and in the
buffers placed in them (:class:`SegmentStats`). Neither locks: the resource
and its placements call them under the resource's lock.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dask_gpupool.memory.arena import Arena

__all__ = ["SEGMENT_ALIGNMENT", "Segment", "SegmentStats", "SegmentTable"]

#: Granularity of segment sizes (CUDA's large-page size).
SEGMENT_ALIGNMENT = 2 << 20


@dataclass(eq=False)
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
    id : int
        Its number in this resource (1, 2, ...), sent in descriptors.
    arena : Arena or None
        Where buffers are placed inside it (``None`` for an own segment).
    own : bool
        Holds one buffer larger than the segment size, at offset 0.
    live : int
        Buffers alive in it.
    retiring : bool
        Freed once no buffer lives in it and no peer maps it (the resource's
        :class:`~dask_gpupool.memory.retire.RetireLedger` says which peers may).
    free_event : object
        Own segments: the event of its last buffer's free (reuse waits for it).
    """

    buffer: Any
    base: int
    size: int
    payload: bytes
    id: int
    arena: Arena | None = None
    own: bool = False
    live: int = 0
    retiring: bool = False
    free_event: Any = None


@dataclass(frozen=True)
class SegmentStats:
    """Statistics named like cuda.core's pool attributes (see :meth:`SegmentedResource.attributes`)."""

    used_mem_current: int
    used_mem_high: int
    reserved_mem_current: int
    reserved_mem_high: int


class SegmentTable:
    """Segments sorted by base address, and by id. Owns nothing: the resource frees segments.

    Attributes
    ----------
    used : int
        Bytes in buffers placed in the segments (as the placements count them).
    used_high : int
        Largest ``used`` seen.
    reserved_high : int
        Largest :attr:`reserved` seen.
    """

    __slots__ = ("_bases", "_by_id", "_segments", "reserved_high", "used", "used_high")

    used: int
    used_high: int
    reserved_high: int

    def __init__(self) -> None:
        self._segments: list[Segment] = []
        self._bases: list[int] = []
        self._by_id: dict[int, Segment] = {}
        self.used = self.used_high = self.reserved_high = 0

    def add(self, seg: Segment) -> None:
        """Register ``seg``."""
        i = bisect.bisect_left(self._bases, seg.base)
        self._bases.insert(i, seg.base)
        self._segments.insert(i, seg)
        self._by_id[seg.id] = seg
        self.reserved_high = max(self.reserved_high, self.reserved)

    def count_used(self, nbytes: int) -> None:
        """A buffer of ``nbytes`` (as placed) now lives in a segment."""
        self.used += nbytes
        self.used_high = max(self.used_high, self.used)

    def count_freed(self, nbytes: int) -> None:
        """A buffer of ``nbytes`` (as placed) was freed."""
        self.used -= nbytes

    def stats(self) -> SegmentStats:
        """Bytes in buffers and in segments, now and at most."""
        return SegmentStats(self.used, self.used_high, self.reserved, self.reserved_high)

    def remove(self, seg: Segment) -> Segment:
        """Take ``seg`` out; return it."""
        i = bisect.bisect_left(self._bases, seg.base)
        del self._segments[i], self._bases[i], self._by_id[seg.id]
        return seg

    def locate(self, ptr: int) -> tuple[Segment, int] | None:
        """The segment holding address ``ptr`` and the offset inside it, or ``None``."""
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i >= 0:
            seg = self._segments[i]
            if ptr < seg.base + seg.size:
                return seg, ptr - seg.base
        return None

    def get(self, segment_id: int) -> Segment | None:
        """The segment numbered ``segment_id``, or ``None`` (never made, or freed)."""
        return self._by_id.get(segment_id)

    def __contains__(self, segment_id: object) -> bool:
        return segment_id in self._by_id

    def __iter__(self) -> Iterator[Segment]:
        """A snapshot, by address: the caller may remove segments while it iterates."""
        return iter(list(self._segments))

    def __len__(self) -> int:
        return len(self._segments)

    @property
    def reserved(self) -> int:
        """Bytes in all segments."""
        return sum(s.size for s in self._segments)

    def clear(self) -> list[Segment]:
        """Take every segment out (the byte counts stay); return them."""
        segments = self._segments
        self._segments, self._bases, self._by_id = [], [], {}
        return segments
