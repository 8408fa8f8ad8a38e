"""A first-fit sub-allocator over one contiguous range of offsets.

The one placement allocator of every pool kind: the ``host`` pool carves
buffers out of its shared memfd with it, and a ``device`` pool places buffers
in each of its segments with one
(:mod:`dask_gpupool.memory.arena_placement`). It needs no CUDA runtime, so it
runs and is tested on hosts without one; no maintained pure-Python arena
allocator exists, so this one is kept small and tested on its own.

Offsets only: the arena never touches memory. Thread-safe, and safe to free
into from a finalizer that the garbage collector runs inside one of its own
calls (:meth:`Arena.free` then defers the free to the end of that call).
"""

from __future__ import annotations

import bisect
import operator
import threading
from typing import Any

from dask_gpupool.errors import PoolExhaustedError

__all__ = ["Arena"]


class Arena:
    """First-fit allocation with coalescing of free neighbours.

    Parameters
    ----------
    capacity : int
        Size of the range ``[0, capacity)``.
    alignment : int
        Every offset and size is a multiple of this (a power of two).

    Attributes
    ----------
    capacity : int
    alignment : int
    used : int
        Bytes in live allocations (after rounding up to ``alignment``).
    used_high : int
        Largest ``used`` seen.
    extent : int
        End of the highest byte ever handed out: memory below it has been
        touched and, like an IPC pool, is not given back.

    Notes
    -----
    A Buffer over an arena range is often freed by the garbage collector
    (it sat in a reference cycle), which runs finalizers in whatever thread
    allocates at that moment: also inside this arena's own calls, on the
    thread that holds its lock. The lock is re-entrant, and a free that
    comes in while a call of this arena is under way on the same thread is
    deferred: the range stays live (and counted) until that call ends, which
    frees it. Before, such a free waited for the lock its own thread held,
    for ever.
    """

    capacity: int
    alignment: int
    used: int
    used_high: int
    extent: int
    _free_offsets: list[int]
    _free_sizes: dict[int, int]
    _live: dict[int, int]
    _lock: threading.RLock
    _busy: bool
    _deferred: list[int]

    def __init__(self, capacity: int, alignment: int = 256) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.capacity = capacity - capacity % alignment
        self.alignment = alignment
        self.used = self.used_high = self.extent = 0
        self._free_offsets = [0] if self.capacity else []
        self._free_sizes = {0: self.capacity} if self.capacity else {}
        self._live = {}
        self._lock = threading.RLock()
        self._busy = False  # a call is changing the free lists (on the thread holding the lock)
        self._deferred = []  # offsets freed while it did: freed when it ends

    def allocate(self, nbytes: int) -> int:
        """Reserve ``nbytes`` (at least one alignment unit) and return its offset.

        Raises
        ------
        TypeError
            If ``nbytes`` is not an integer (a float, a string; NumPy integers are).
        ValueError
            If ``nbytes`` is negative.
        PoolExhaustedError
            If no free range is large enough.
        """
        nbytes = operator.index(nbytes)  # a Python int: NumPy's int64 wrapped around when rounded up near 2**63
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        size = max(self.alignment, -(-nbytes // self.alignment) * self.alignment)
        with self._lock:
            self._busy = True
            try:
                for i, offset in enumerate(self._free_offsets):
                    free = self._free_sizes[offset]
                    if free < size:
                        continue
                    del self._free_sizes[offset]
                    if free == size:
                        del self._free_offsets[i]
                    else:
                        self._free_offsets[i] = offset + size
                        self._free_sizes[offset + size] = free - size
                    self._live[offset] = size
                    self.used += size
                    self.used_high = max(self.used_high, self.used)
                    self.extent = max(self.extent, offset + size)
                    return offset
            finally:
                self._done()
        free = self.capacity - self.used
        if size > self.capacity:
            why = f"more than the whole pool ({self.capacity} bytes)"
        elif size > free:
            why = f"{free} of {self.capacity} bytes free"
        else:
            why = f"{free} of {self.capacity} bytes free, but no free range of {size} bytes (fragmented)"
        raise PoolExhaustedError(f"cannot allocate {nbytes} bytes: {why}")

    def free(self, offset: int) -> int:
        """Release the allocation at ``offset``; return its (rounded) size.

        Called while a call of this arena is under way on this thread (a
        finalizer the garbage collector ran inside it), the range is freed
        when that call ends.

        Raises
        ------
        ValueError
            If nothing is allocated at ``offset``.
        """
        with self._lock:
            if self._busy:  # re-entered from a finalizer: the free lists are being changed
                size = self._live.get(offset)
                if size is None or offset in self._deferred:
                    raise ValueError(f"no allocation at offset {offset}")
                self._deferred.append(offset)
                return size
            self._busy = True
            try:
                return self._free(offset)
            finally:
                self._done()

    def _free(self, offset: int) -> int:
        """:meth:`free` with ``_lock`` held and ``_busy`` set."""
        try:
            size = self._live.pop(offset)
        except KeyError:
            raise ValueError(f"no allocation at offset {offset}") from None
        self.used -= size
        i = bisect.bisect_left(self._free_offsets, offset)
        end = offset + size
        if i < len(self._free_offsets) and self._free_offsets[i] == end:  # merge right
            size += self._free_sizes.pop(end)
            del self._free_offsets[i]
        if i > 0:  # merge left
            left = self._free_offsets[i - 1]
            if left + self._free_sizes[left] == offset:
                self._free_sizes[left] += size
                return end - offset
        self._free_offsets.insert(i, offset)
        self._free_sizes[offset] = size
        return end - offset

    def _done(self) -> None:
        """End a call that changed the free lists (``_lock`` held): free what was freed meanwhile."""
        try:
            while self._deferred:  # a finalizer run by one of these frees defers its own: freed here too
                self._free(self._deferred.pop())
        finally:
            self._busy = False

    def each_free(self, fn: Any) -> int:
        """Call ``fn(offset, size)`` for every free range, with allocation blocked meanwhile; the free bytes.

        No range can be handed out while ``fn`` runs on it (the host pool
        gives free pages back to the OS this way); ranges freed meanwhile on
        this thread are freed after.
        """
        with self._lock:
            self._busy = True
            try:
                for offset in list(self._free_offsets):
                    fn(offset, self._free_sizes[offset])
                return self.capacity - self.used
            finally:
                self._done()

    def size_of(self, offset: int) -> int | None:
        """Size of the live allocation at ``offset``, or ``None``."""
        with self._lock:
            return self._live.get(offset)

    @property
    def live(self) -> int:
        """Number of live allocations."""
        return len(self._live)
