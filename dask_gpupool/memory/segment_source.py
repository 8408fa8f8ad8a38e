"""Where a segmented resource's segments come from, and how they go back.

A segment is one allocation from the resource's segment memory (a
:class:`~dask_gpupool.memory.vmm.VmmMemoryResource` or
:class:`~dask_gpupool.memory.legacy.LegacyMemoryResource`; any cuda.core
memory resource in the host tests). :class:`SegmentSource`
takes one for a placement (the arena, or a large
buffer's own segment), numbers it and registers it in the resource's
:class:`~dask_gpupool.memory.segment_table.SegmentTable`; and gives a
segment back to that memory once it is unregistered, which happens only when
the retire protocol allows it (:mod:`dask_gpupool.memory.retire`), at close,
or when a full pool drops idle large-buffer segments no peer maps.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask_gpupool.errors import PoolExhaustedError
from dask_gpupool.memory.arena import Arena
from dask_gpupool.memory.arena_placement import BUFFER_ALIGNMENT
from dask_gpupool.memory.segment_table import Segment

if TYPE_CHECKING:
    from dask_gpupool.memory.home_stream import HomeStream
    from dask_gpupool.memory.retire import RetireLedger
    from dask_gpupool.memory.segment_table import SegmentTable

__all__ = ["SegmentSource"]

logger = logging.getLogger(__name__)


class SegmentSource:
    """Takes segments from ``memory`` into ``segments``, and gives unregistered ones back.

    Parameters
    ----------
    memory : cuda.core.MemoryResource
        Where segments come from. Owned by the resource, which closes it.
    payload_of : callable
        Returns a segment Buffer's IPC payload (bytes); ``b""`` for segments
        that peers fetch by id (VMM).
    segments : SegmentTable
        The resource's segments and byte counts, read and changed under ``lock``.
    lock : threading.RLock
        The resource's lock.
    ledger : RetireLedger
        Which peers may map a segment; a segment taken out of ``segments``
        is forgotten there.
    home : HomeStream or None
        The GPU's default stream (``None`` for host memory).

    Attributes
    ----------
    next_id : int
        The id the next segment gets (1, 2, ...): segments below it exist now
        or did.

    Notes
    -----
    A segment's Buffer is the resource's from :meth:`new` until
    :meth:`free` closes it; this class decides nothing about when.
    Thread-safe: it takes ``lock`` itself.
    """

    memory: Any
    next_id: int
    _payload_of: Callable[[Any], bytes]
    _segments: SegmentTable
    _lock: threading.RLock
    _ledger: RetireLedger
    _home: HomeStream | None

    def __init__(
        self,
        memory: Any,
        payload_of: Callable[[Any], bytes],
        segments: SegmentTable,
        lock: threading.RLock,
        ledger: RetireLedger,
        home: HomeStream | None,
    ) -> None:
        self.memory = memory
        self.next_id = 1
        self._payload_of = payload_of
        self._segments = segments
        self._lock = lock
        self._ledger = ledger
        self._home = home

    def new(self, size: int, *, own: bool = False, stream: Any = None) -> Segment:
        """Take ``size`` bytes from upstream and register them as a segment (any placement).

        ``own``: it holds one buffer larger than the segment size, counted as
        used; else it gets an arena.

        Raises
        ------
        PoolExhaustedError
            When the upstream has no room.
        """
        if stream is None and self._home is not None:
            stream = self._home()
        try:
            buf = self.memory.allocate(size, stream=stream)
        except Exception as e:
            if not isinstance(e, PoolExhaustedError) and "OUT_OF_MEMORY" not in str(e):
                raise
            raise self.exhausted(size, e) from None
        with self._lock:
            # VMM rounds up to its granularity: the segment is what was made
            seg = Segment(buf, int(buf.handle), max(size, int(buf.size)), self._payload_of(buf), self.next_id, own=own)
            self.next_id += 1
            if own:
                seg.live = 1
                self._segments.count_used(seg.size)  # as its free counts it: VMM may have rounded it up
            else:
                seg.arena = Arena(size, BUFFER_ALIGNMENT)
            self._segments.add(seg)  # counts the reserved high-water mark
        logger.debug("segment %d: %d bytes at %#x (%d in all)", seg.id, size, seg.base, len(self._segments))
        return seg

    def exhausted(self, size: int, e: BaseException) -> PoolExhaustedError:
        """The error for ``size`` bytes that fit in no segment nor upstream (``e``: the upstream's)."""
        with self._lock:
            reserved, n = self._segments.reserved, len(self._segments)
        return PoolExhaustedError(
            f"cannot allocate {size} bytes: no segment has room and a new segment does not fit "
            f"({self._segments.used} bytes in buffers, {reserved} in {n} segment(s)): {e}"
        )

    def unregister(self, seg: Segment) -> Segment:
        """Take ``seg`` out of the lookup tables (call with ``lock`` held); return it."""
        self._segments.remove(seg)
        self._ledger.forget(seg.id)
        return seg

    def free(self, seg: Segment) -> None:
        """Give an unregistered segment back to the upstream pool."""
        try:
            if self._home is not None:
                home = self._home()
                if seg.free_event is not None:
                    seg.free_event.close()
                seg.buffer.close(home)
            else:
                seg.buffer.close()
        except Exception:
            logger.exception("freeing segment %d (%d bytes) failed", seg.id, seg.size)
        logger.debug("segment %d: freed (%d bytes)", seg.id, seg.size)
