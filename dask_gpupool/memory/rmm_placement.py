"""RMM placement inside segments: one ``rmm.mr.PoolMemoryResource`` per generation of segments.

The placement of ``suballocator="rmm"``, the default when RMM is installed
(:mod:`dask_gpupool.memory.arena_placement` is the other one).
Buffers up to the segment size come from an ``rmm.mr.PoolMemoryResource``
whose upstream is an ``rmm.mr.CallbackMemoryResource`` taking segments from the
owner (:class:`~dask_gpupool.memory.segments.SegmentedResource`). RMM's pool is
stream-ordered (a block freed on one stream is reused on another only after
an event), coalescing, and never places a block across two upstream
allocations, which is what makes "a buffer lies in one segment" hold. The
callback refuses sizes over the segment size, and RMM then asks again for
half, so segments are between half the segment size and the segment size.
Measured on an H200, one free + allocate pair: RMM 5.2 µs, the in-tree arena
below 12.2 µs (``benchmarks/suballocator.py``). RMM is optional: without it
(hosts without CUDA) the arena places buffers.

:class:`RmmPlacement` holds the current :class:`Generation` and the retired
ones: retiring starts a new RMM pool, and a retired one is dropped once all
its segments may go (:mod:`dask_gpupool.memory.retire`).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask_gpupool.memory.segment_table import SEGMENT_ALIGNMENT

if TYPE_CHECKING:
    from dask_gpupool.errors import PoolExhaustedError
    from dask_gpupool.memory.home_stream import HomeStream
    from dask_gpupool.memory.segment_table import Segment, SegmentTable

__all__ = ["RMM_ALIGNMENT", "Generation", "RmmPlacement", "RmmStreams", "rmm_available"]

#: RMM's allocation alignment (``rmm::CUDA_ALLOCATION_ALIGNMENT``), for the used-bytes count.
RMM_ALIGNMENT = 256

#: ``.depth``: how many garbage collections run on this thread now (:func:`collecting`).
_collections = threading.local()


def _count_collections(phase: str, info: dict[str, Any]) -> None:
    depth = getattr(_collections, "depth", 0) + (1 if phase == "start" else -1)
    _collections.depth = max(depth, 0)  # a "stop" without its "start" (registered mid-collection)


gc.callbacks.append(_count_collections)


def collecting() -> bool:
    """Whether the garbage collector runs on this thread now (its finalizers are what calls us)."""
    return getattr(_collections, "depth", 0) > 0


def rmm_available() -> bool:
    """Whether ``rmm.mr`` imports here (it needs the CUDA runtime)."""
    try:
        import rmm.mr  # noqa: F401
    except Exception:
        return False
    return True


class Generation:
    """One RMM pool and the segments its upstream callback took from the owner.

    Parameters
    ----------
    initial : int
        Size of the RMM pool's first segment.
    segment_size : int
        The largest segment the callback takes (RMM then asks for half).
    new_segment : callable
        ``new_segment(nbytes, generation=self)`` takes a segment from the
        owner's upstream and registers it; raises ``MemoryError`` when the
        upstream is full
        (:meth:`~dask_gpupool.memory.segment_source.SegmentSource.new`).
    release_segment : callable
        ``release_segment(ptr)`` frees the segment at ``ptr``, unless it is
        unregistered already, as at close
        (:meth:`~dask_gpupool.memory.segment_source.SegmentSource.release`).
    inside : threading.local, optional
        Its ``rmm`` attribute is true on a thread while RMM runs the upstream
        callback there, with the RMM pool's mutex held
        (:class:`RmmPlacement` defers frees meanwhile).

    Notes
    -----
    The owner (:class:`~dask_gpupool.memory.segments.SegmentedResource`)
    retires a generation as a whole (:mod:`dask_gpupool.memory.retire`):
    dropping :attr:`pool` makes RMM give every segment back through the
    callback's free, which the owner turns into freeing the segment.
    """

    def __init__(
        self,
        initial: int,
        segment_size: int,
        new_segment: Callable[..., Segment],
        release_segment: Callable[[int], None],
        inside: threading.local | None = None,
    ) -> None:
        import rmm.mr

        self.segments: list[Segment] = []
        self._segment_size = segment_size
        self._new_segment = new_segment
        self._release_segment = release_segment
        self._inside = threading.local() if inside is None else inside
        self.upstream = rmm.mr.CallbackMemoryResource(self._take, self._give)
        self.pool: Any = rmm.mr.PoolMemoryResource(self.upstream, initial, None)

    def _take(self, nbytes: int, _stream: Any) -> int:
        # Called by RMM with its lock held: never call back into RMM from here.
        if nbytes > self._segment_size:
            raise MemoryError(f"segments are at most {self._segment_size} bytes")  # RMM asks for half
        outer = getattr(self._inside, "rmm", False)
        self._inside.rmm = True  # a collection here runs finalizers on this thread: their frees must not enter RMM
        try:
            seg = self._new_segment(nbytes, generation=self)
        finally:
            self._inside.rmm = outer
        self.segments.append(seg)
        return seg.base

    def _give(self, ptr: int, _nbytes: int, _stream: Any) -> None:
        # Called when the RMM pool is destroyed: only once every segment may be freed, or at close.
        self._release_segment(ptr)


class RmmStreams:
    """RMM ``Stream`` wrappers of cuda.core streams, by handle (at most 64 kept)."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}

    def get(self, stream: Any) -> Any:
        """The RMM stream over ``stream`` (a cuda.core Stream)."""
        handle = int(stream.handle)
        rs = self._streams.get(handle)
        if rs is None:
            from rmm.pylibrmm.stream import Stream

            if len(self._streams) > 64:
                self._streams.clear()
            rs = self._streams[handle] = Stream(stream)
        return rs


class RmmPlacement:
    """Buffers up to the segment size, placed by the RMM pool of the current generation.

    Parameters
    ----------
    segments : SegmentTable
        The resource's segments and byte counts, read and changed under ``lock``.
    lock : threading.RLock
        The resource's lock. RMM is never called with it held, except to make
        a generation's pool, which no other thread can call yet (its callback
        takes the first segment, and the lock again).
    home : HomeStream
        The GPU's default stream.
    segment_size : int
        The largest segment a generation's callback takes.
    new_segment, release_segment : callable
        For each :class:`Generation`'s callback (the resource's
        :class:`~dask_gpupool.memory.segment_source.SegmentSource`).
    exhausted : callable
        ``exhausted(size, error)``: the
        :class:`~dask_gpupool.errors.PoolExhaustedError` to raise when
        ``size`` bytes do not fit
        (:meth:`~dask_gpupool.memory.segment_source.SegmentSource.exhausted`).

    Attributes
    ----------
    generation : Generation or None
        Where new buffers go (made on the first allocation after a retire).
    retired : list of Generation
        Retired generations not dropped yet.
    on_retired_empty : callable or None
        Called (no arguments, no lock held) when a deferred free (see the
        notes) emptied a retiring segment: the resource collects it.

    Notes
    -----
    Owns its generations (their RMM pools) until :meth:`take_done` or
    :meth:`take_all` hands them to the resource, which drops each one's
    :attr:`Generation.pool` outside ``lock``. Segments are the resource's, and
    a buffer is its caller's until :meth:`free`. Thread-safe:
    :meth:`allocate` and :meth:`free` take ``lock`` but call RMM without it.

    RMM calls the upstream callback (Python: the segment source, the VMM
    driver calls) with its pool's mutex held, and a collection the garbage
    collector runs there frees the buffers of garbage cycles on that
    thread: a :meth:`free` into that same RMM pool would wait for the mutex
    its own thread holds, for ever. So a free that comes on a thread while
    RMM runs the callback there is deferred: done when the allocation that
    made RMM call back returned, or by the next free (the allocation may be
    RMM's own user's, ``gpupool.rmm-allocator``). So is any free that a
    garbage collection runs (:func:`collecting`): RMM's Cython wrapper of the
    callback allocates Python objects before it calls ours, and a collection
    there ran a finalizer that waited for RMM's mutex for ever (an H100,
    thirty-first session: the flag set inside our callback came too late).
    """

    generation: Generation | None
    retired: list[Generation]
    segment_size: int
    on_retired_empty: Callable[[], None] | None
    _segments: SegmentTable
    _lock: threading.RLock
    _home: HomeStream
    _new_segment: Callable[..., Segment]
    _release_segment: Callable[[int], None]
    _exhausted: Callable[[int, BaseException], PoolExhaustedError]
    _streams: RmmStreams
    _inside: threading.local
    _deferred: list[tuple[Segment, int, int, Any]]

    def __init__(
        self,
        segments: SegmentTable,
        lock: threading.RLock,
        home: HomeStream,
        segment_size: int,
        new_segment: Callable[..., Segment],
        release_segment: Callable[[int], None],
        exhausted: Callable[[int, BaseException], PoolExhaustedError],
    ) -> None:
        self.generation = None
        self.retired = []
        self.on_retired_empty = None
        self.segment_size = segment_size
        self._segments = segments
        self._lock = lock
        self._home = home
        self._new_segment = new_segment
        self._release_segment = release_segment
        self._exhausted = exhausted
        self._streams = RmmStreams()
        self._inside = threading.local()  # .rmm: RMM runs a generation's callback on this thread (its mutex held)
        self._deferred = []  # frees that came meanwhile (finalizers): (segment, ptr, size, stream)

    def allocate(self, size: int, stream: Any) -> int:
        """The address of a new buffer of ``size`` bytes, stream-ordered on ``stream``; owned by the caller.

        Raises
        ------
        PoolExhaustedError
            When RMM's pool is full and the upstream has no room for another segment.
        """
        gen = self.generation
        if gen is None:
            with self._lock:
                gen = self.generation
                if gen is None:
                    gen = self.generation = self._new_generation(size)
        try:
            ptr = int(gen.pool.allocate(max(size, 1), self._stream(stream)))  # RMM gives no address for 0
        except MemoryError as e:
            raise self._exhausted(size, e) from None
        finally:
            self._free_deferred()  # what finalizers freed while RMM called back
        with self._lock:
            seg, _ = self._segments.locate(ptr)  # type: ignore[misc]  # RMM placed it in a segment of ours
            seg.live += 1
            self._segments.count_used(-(-max(size, 1) // RMM_ALIGNMENT) * RMM_ALIGNMENT)
        return ptr

    def free(self, seg: Segment, ptr: int, size: int, stream: Any) -> None:
        """Give the buffer at ``ptr`` in ``seg`` back to RMM, stream-ordered on ``stream``.

        Deferred while RMM runs its upstream callback on this thread, and while the garbage collector runs here
        (see the class notes).
        """
        if getattr(self._inside, "rmm", False) or collecting():
            with self._lock:
                self._deferred.append((seg, ptr, size, stream))
            return
        self._give_back(seg, ptr, size, stream)
        self._free_deferred()

    def _give_back(self, seg: Segment, ptr: int, size: int, stream: Any) -> None:
        pool = seg.generation.pool
        if pool is not None:  # None: the resource closed meanwhile and dropped its RMM pools (the segment is kept)
            self._home()  # RMM records its free event on the GPU: make it current in this thread (maybe the GC's)
            pool.deallocate(ptr, max(size, 1), self._stream(stream))
        with self._lock:
            seg.live -= 1
            self._segments.count_freed(-(-max(size, 1) // RMM_ALIGNMENT) * RMM_ALIGNMENT)

    def _free_deferred(self) -> None:
        """Do the deferred frees (not inside RMM's callback on this thread); then :attr:`on_retired_empty`, if
        one of them was the last buffer of a retiring segment."""
        if not self._deferred or getattr(self._inside, "rmm", False) or collecting():
            return
        emptied = False
        while True:
            with self._lock:
                if not self._deferred:
                    break
                seg, ptr, size, stream = self._deferred.pop()
            self._give_back(seg, ptr, size, stream)
            emptied = emptied or (seg.retiring and seg.live == 0)
        if emptied and self.on_retired_empty is not None:
            self.on_retired_empty()

    def current(self) -> Any:
        """The RMM pool of the current generation, made now if there is none (``lock`` held)."""
        if self.generation is None:
            self.generation = self._new_generation(1)
        return self.generation.pool

    def retire(self) -> None:
        """Retire the current generation: new buffers go to a new RMM pool (``lock`` held)."""
        if self.generation is not None:
            self.retired.append(self.generation)
            self.generation = None

    def take_done(self, may_go: Callable[[Segment], bool]) -> list[Generation]:
        """Take out the retired generations all of whose segments ``may_go`` (``lock`` held); drop them after."""
        done = [g for g in self.retired if all(may_go(s) for s in g.segments)]
        for g in done:
            self.retired.remove(g)
        return done

    def take_all(self) -> list[Generation]:
        """Take out every retired generation (``lock`` held, at close)."""
        generations, self.retired = self.retired, []
        return generations

    def _stream(self, stream: Any) -> Any:
        return self._streams.get(stream if stream is not None else self._home())

    def _new_generation(self, size: int) -> Generation:
        """A new RMM pool whose first segment is the segment size, or less when the upstream is short."""
        initial = self.segment_size
        while True:
            try:
                return Generation(initial, self.segment_size, self._new_segment, self._release_segment, self._inside)
            except MemoryError as e:
                if initial <= max(SEGMENT_ALIGNMENT, size):
                    raise self._exhausted(size, e) from None
                initial = max(SEGMENT_ALIGNMENT, initial // 2 // SEGMENT_ALIGNMENT * SEGMENT_ALIGNMENT)
