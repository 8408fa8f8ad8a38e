"""Own segments: a buffer larger than the segment size gets a segment of its own, kept for reuse.

A :class:`~dask_gpupool.memory.segments.SegmentedResource` places buffers up
to its segment size with the arena; a larger buffer gets a segment of
its own (:class:`OwnSegments`), rounded up to 2 MiB, at offset 0. When the
buffer is freed the segment is kept as a *spare* and reused by a later
buffer that fits it (at most twice as small), so repeated large results map
once: a peer that mapped the segment for the first buffer finds it mapped
for the next. A retiring spare takes no new buffer. When the upstream pool is
full, the resource frees the idle spares no peer maps (:meth:`OwnSegments.idle`)
and tries the allocation once more; then it *reclaims* the idle spares peers
still map: retires them one by one and publishes their ids (the registry
row's ``reclaim``), peers unmap them as retiring segments, and the allocation
waits for their releases (:class:`~dask_gpupool.memory.reclaim.Reclaim`).

A spare's reuse is stream-ordered: its last buffer's free records an event
on the freeing stream (or the GPU's default stream), and the next buffer's
stream waits for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask_gpupool.memory.segment_table import SEGMENT_ALIGNMENT

if TYPE_CHECKING:
    from dask_gpupool.memory.home_stream import HomeStream
    from dask_gpupool.memory.segment_table import Segment, SegmentTable

__all__ = ["OwnSegments"]


class OwnSegments:
    """Buffers larger than the segment size, each alone in a segment that is kept as a spare when it is freed.

    Parameters
    ----------
    segments : SegmentTable
        The resource's segments and byte counts, read and changed under ``lock``.
    lock : threading.RLock
        The resource's lock (not held when calling ``new_segment``).
    new_segment : callable
        ``new_segment(size, own=True, stream=stream)`` takes ``size`` bytes
        from the resource's upstream and registers them as a segment holding
        one buffer, counted as used
        (:meth:`~dask_gpupool.memory.segment_source.SegmentSource.new`);
        raises :class:`~dask_gpupool.errors.PoolExhaustedError` when the
        upstream is full.
    home : HomeStream or None
        The GPU's default stream (``None`` for host memory: no events).

    Notes
    -----
    Owns no memory: segments, spares included, are the resource's, which
    frees them (:meth:`idle` only picks); a buffer is its caller's until
    :meth:`free`. A spare owns the event of its last buffer's free
    (``Segment.free_event``) until it is reused or freed. Thread-safe: every
    method but :meth:`idle` takes ``lock``.
    """

    _segments: SegmentTable
    _lock: threading.RLock
    _new_segment: Callable[..., Segment]
    _home: HomeStream | None

    def __init__(
        self,
        segments: SegmentTable,
        lock: threading.RLock,
        new_segment: Callable[..., Segment],
        home: HomeStream | None,
    ) -> None:
        self._segments = segments
        self._lock = lock
        self._new_segment = new_segment
        self._home = home

    def allocate(self, size: int, stream: Any) -> int:
        """The address of a buffer of ``size`` bytes in a spare or a new segment, usable on ``stream``.

        The smallest spare of ``size`` to twice ``size`` (rounded up to
        2 MiB) is reused, else a new segment is made. Owned by the caller.

        Raises
        ------
        PoolExhaustedError
            When no spare fits and the upstream has no room for a new segment.
        """
        need = -(-size // SEGMENT_ALIGNMENT) * SEGMENT_ALIGNMENT
        with self._lock:
            spares = [s for s in self._segments if s.own and not (s.live or s.retiring) and need <= s.size <= 2 * need]
            seg = min(spares, key=lambda s: s.size) if spares else None
            if seg is not None:
                seg.live = 1
                event, seg.free_event = seg.free_event, None
                self._segments.count_used(seg.size)
        if seg is not None:
            if event is not None:
                stream.wait(event)
                event.close()
            return seg.base
        seg = self._new_segment(need, own=True, stream=stream)
        return seg.base

    def free(self, seg: Segment, stream: Any) -> None:
        """``seg``'s buffer is freed: keep ``seg`` as a spare, reusable once the work queued on ``stream`` is done."""
        event = None
        if self._home is not None:
            home = self._home()
            event = (stream if stream is not None else home).record()
        with self._lock:
            seg.live, seg.free_event = 0, event
            self._segments.count_freed(seg.size)

    def idle(self, mapped: Callable[[int], bool]) -> list[Segment]:
        """The spares no buffer lives in and that no peer maps (``mapped(segment id)`` false); ``lock`` held."""
        return [s for s in self._segments if s.own and not s.live and not mapped(s.id)]
