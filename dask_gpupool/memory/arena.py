"""A first-fit sub-allocator over one contiguous range of offsets.

Used by the ``host`` pool to carve buffers out of its shared memfd. RMM is
the sub-allocator for CUDA memory, but it needs a CUDA runtime, and the
``host`` pool exists for hosts without one; no maintained pure-Python arena
allocator exists, so this one is kept small and tested on its own.

Offsets only: the arena never touches memory. Thread-safe.
"""

from __future__ import annotations

import bisect
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
    """

    capacity: int
    alignment: int
    used: int
    used_high: int
    extent: int
    _free_offsets: list[int]
    _free_sizes: dict[int, int]
    _live: dict[int, int]
    _lock: threading.Lock

    def __init__(self, capacity: int, alignment: int = 256) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.capacity = capacity - capacity % alignment
        self.alignment = alignment
        self.used = self.used_high = self.extent = 0
        self._free_offsets = [0] if self.capacity else []
        self._free_sizes = {0: self.capacity} if self.capacity else {}
        self._live = {}
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> int:
        """Reserve ``nbytes`` (at least one alignment unit) and return its offset.

        Raises
        ------
        PoolExhaustedError
            If no free range is large enough.
        """
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        size = max(self.alignment, -(-nbytes // self.alignment) * self.alignment)
        with self._lock:
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

        Raises
        ------
        ValueError
            If nothing is allocated at ``offset``.
        """
        with self._lock:
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

    def each_free(self, fn: Any) -> int:
        """Call ``fn(offset, size)`` for every free range, with allocation blocked meanwhile; the free bytes.

        No range can be handed out while ``fn`` runs on it (the host pool
        gives free pages back to the OS this way).
        """
        with self._lock:
            for offset in self._free_offsets:
                fn(offset, self._free_sizes[offset])
            return self.capacity - self.used

    def size_of(self, offset: int) -> int | None:
        """Size of the live allocation at ``offset``, or ``None``."""
        with self._lock:
            return self._live.get(offset)

    @property
    def live(self) -> int:
        """Number of live allocations."""
        return len(self._live)
