"""Arena placement inside segments: first fit, one arena per segment, with stream-ordered frees.

The one placement of a :class:`~dask_gpupool.memory.segments.SegmentedResource`
for buffers up to its segment size. Each segment the resource makes for it
carries an :class:`~dask_gpupool.memory.arena.Arena` (first fit, offsets
only), and :class:`ArenaPlacement` places a buffer in the first segment with
room, or in a new segment.

Frees are stream-ordered here, since the arena knows no streams, the way
RMM's stream-ordered pool orders them:

- A range freed on the GPU's default stream (the resource's
  :class:`~dask_gpupool.memory.home_stream.HomeStream`) is reused at once.
  Each such free records the placement's *home event* on the default stream
  (one event, recorded again at every free there, so that it always marks the
  latest one, which follows every earlier one). An allocation on another
  stream makes that stream wait for the home event: for the frees queued on
  the default stream so far, not for the kernels queued there besides (a
  staging copy on a stream of its own, :func:`~dask_gpupool.dask.plain_arrays.stage`,
  does not wait for the tasks queued on the default stream after the one it
  copies from).
- A range freed on another stream is pending until an event recorded there
  completed. Pending ranges are reaped on every allocation and free, and
  waited for when no segment has room, or when a retiring segment must go.

A new segment is of the segment size, or smaller when the upstream is short
of that (down to what the buffer needs), as RMM's pool asks its upstream for
less.

The ordering is tested on the CPU with stand-in streams and events (host
memory has none), and on a GPU with cuda.core's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask_gpupool.errors import PoolExhaustedError
from dask_gpupool.memory.segment_table import SEGMENT_ALIGNMENT

if TYPE_CHECKING:
    from dask_gpupool.memory.home_stream import HomeStream
    from dask_gpupool.memory.segment_table import Segment, SegmentTable

__all__ = ["BUFFER_ALIGNMENT", "ArenaPlacement"]

#: Alignment of buffers inside a segment (CuPy and cudaMalloc give 256 bytes; 512 keeps vector loads happy).
BUFFER_ALIGNMENT = 512


class ArenaPlacement:
    """Buffers up to the segment size, placed by first fit in the arenas of a resource's segments.

    Parameters
    ----------
    segments : SegmentTable
        The resource's segments and byte counts, read and changed under ``lock``.
    lock : threading.RLock
        The resource's lock (``new_segment`` takes it again).
    new_segment : callable
        ``new_segment(size, stream=stream)`` takes ``size`` bytes from the
        resource's upstream and registers them as a segment with an arena
        (:meth:`~dask_gpupool.memory.segment_source.SegmentSource.new`);
        raises :class:`~dask_gpupool.errors.PoolExhaustedError` when the
        upstream is full.
    segment_size : int
        Size of the segments it asks for.
    home : HomeStream or None
        The GPU's default stream (``None`` for host memory: no streams). Any
        callable with its ``handle`` and ``sync()`` will do, returning a
        stream with cuda.core's ``handle``, ``record(event=None)`` and
        ``wait(event)``, whose events have ``is_done``, ``sync()`` and
        ``close()``.

    Notes
    -----
    Owns no memory: segments are the resource's, and a buffer's range is its
    caller's until :meth:`free`. Owns the events of pending frees, closed
    when reaped, and the home event, closed by :meth:`close`. Thread-safe:
    every method takes ``lock`` (``reap`` and ``reap_retiring`` expect it
    held). The home event is recorded and waited for under ``lock``: an
    allocation that takes a range after its free was appended waits for a
    record at or after that free.
    """

    segment_size: int
    _segments: SegmentTable
    _lock: threading.RLock
    _new_segment: Callable[..., Segment]
    _home: HomeStream | None
    _pending: list[tuple[Segment, int, Any]]
    _home_freed: Any
    _closed: bool

    def __init__(
        self,
        segments: SegmentTable,
        lock: threading.RLock,
        new_segment: Callable[..., Segment],
        segment_size: int,
        home: HomeStream | None,
    ) -> None:
        self.segment_size = segment_size
        self._segments = segments
        self._lock = lock
        self._new_segment = new_segment
        self._home = home
        self._pending = []
        self._home_freed = None  # the home event: recorded on the home stream at its latest free
        self._closed = False

    def allocate(self, size: int, stream: Any) -> int:
        """The address of a new range of ``size`` bytes, usable on ``stream``; owned by the caller.

        On a stream other than the home stream, ``stream`` first waits for the
        home event (the frees queued on the home stream so far; see the module
        notes), not for the rest of the home stream's work.

        Raises
        ------
        PoolExhaustedError
            When no segment has room and the upstream no room for another.
        """
        away = self._away(stream)
        with self._lock:
            self.reap(wait=False)
            seg, offset = self._place(size, stream)
            arena = seg.arena
            assert arena is not None
            seg.live += 1
            nbytes = arena.size_of(offset) or 0
            self._segments.count_used(nbytes)
            if away and self._home_freed is not None:
                try:
                    stream.wait(self._home_freed)  # ranges freed on the home stream are reused at once there
                except BaseException:
                    arena.free(offset)
                    seg.live -= 1
                    self._segments.count_freed(nbytes)
                    raise
        return seg.base + offset

    def free(self, seg: Segment, offset: int, stream: Any) -> bool:
        """Give the range at ``offset`` in ``seg`` back once the work queued on ``stream`` before now is done.

        ``None``: the home stream. There the range is reused at once, after
        the home event is recorded again; on another stream it is pending
        until an event recorded there now completed. Returns whether it was
        taken back: ``False`` after :meth:`close`.
        """
        home = self._home
        event = None
        if home is not None:
            home_stream = home()  # makes the GPU current in this thread (maybe the garbage collector's)
            if stream is not None and int(stream.handle) != home.handle:
                event = stream.record()
        with self._lock:
            if self._closed:
                if event is not None:
                    event.close()
                return False
            if home is not None and event is None:
                self._home_freed = home_stream.record(self._home_freed)
            self._pending.append((seg, offset, event))
            self.reap(wait=False)
        return True

    def reap(self, *, wait: bool) -> None:
        """Give back the pending ranges whose frees completed; with ``wait``, all of them (``lock`` held).

        The list is taken out first: a free that the garbage collector runs
        meanwhile on this thread (a finalizer; the lock is re-entrant) adds to
        a fresh one, and a reap it runs never sees the ranges given back here.
        """
        pending, self._pending = self._pending, []
        keep: list[tuple[Segment, int, Any]] = []
        done = 0
        try:
            for seg, offset, event in pending:
                if event is not None and not wait and not event.is_done:
                    keep.append((seg, offset, event))
                else:
                    if event is not None:
                        if wait:
                            event.sync()
                        event.close()
                    assert seg.arena is not None
                    size = seg.arena.free(offset)
                    seg.live -= 1
                    self._segments.count_freed(size)
                done += 1
        finally:
            self._pending[:0] = keep + pending[done:]  # not done yet (or an error stopped the loop): still pending

    def reap_retiring(self) -> None:
        """Wait for the pending frees if one is in a retiring segment, so that it may go (``lock`` held)."""
        if self._pending and any(seg.retiring for seg, _, _ in self._pending):
            self.reap(wait=True)

    def close(self) -> None:
        """Count the pending frees as done (``lock`` held): the resource is closing, its segments go or are kept,
        and nothing is placed in them again."""
        self._closed = True
        if self._home_freed is not None:
            self._home_freed.close()
            self._home_freed = None
        pending, self._pending = self._pending, []
        for seg, offset, event in pending:
            if event is not None:
                event.close()
            assert seg.arena is not None
            seg.live -= 1
            self._segments.count_freed(seg.arena.free(offset))

    # -- internals -----------------------------------------------------------------------

    def _away(self, stream: Any) -> bool:
        """Whether ``stream`` is a stream other than the home stream (never for host memory)."""
        home = self._home
        if home is None or stream is None:
            return False
        if home.handle is None:
            home()  # looks the stream up
        return int(stream.handle) != home.handle

    def _place(self, size: int, stream: Any) -> tuple[Segment, int]:
        for wait in (False, True):
            for seg in self._segments:
                if seg.arena is None or seg.retiring:
                    continue
                try:
                    return seg, seg.arena.allocate(size)
                except PoolExhaustedError:
                    continue
            if wait or not self._pending:
                break
            self.reap(wait=True)  # frees still in flight may make room
        return self._in_new_segment(size, stream)

    def _in_new_segment(self, size: int, stream: Any) -> tuple[Segment, int]:
        """``size`` bytes at the start of a new segment: of the segment size, else half of it, a quarter, ... down to
        ``size`` rounded up to 2 MiB, the first the upstream has room for (as RMM's pool asks its upstream for less),
        so that a pool short of a whole segment still places what fits."""
        need = max(SEGMENT_ALIGNMENT, -(-size // SEGMENT_ALIGNMENT) * SEGMENT_ALIGNMENT)
        want = max(need, self.segment_size)
        while True:
            try:
                seg = self._new_segment(want, stream=stream)
            except PoolExhaustedError:
                if want <= need:
                    raise
                want = max(need, want // 2 // SEGMENT_ALIGNMENT * SEGMENT_ALIGNMENT)
                continue
            assert seg.arena is not None
            return seg, seg.arena.allocate(size)
