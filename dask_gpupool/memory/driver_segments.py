"""What the two kinds of segment memory made by the CUDA driver share: bounded bookkeeping, and a peer's mapping.

Segments of VMM memory (:mod:`dask_gpupool.memory.vmm`) and of legacy IPC
memory (:mod:`dask_gpupool.memory.legacy`) are each one driver allocation per
segment, which outlives its maker for the peers that map it. The two differ
in how memory is made, named to peers and mapped; this module holds the rest:
:class:`SegmentMemory`, a cuda.core ``MemoryResource`` that keeps the live
allocations and their byte count under ``max_size``, and
:class:`SegmentMapping`, the importer's side, which quacks like the imported
``Buffer`` it replaces for segments.

Ownership: a :class:`SegmentMemory` owns each allocation until its Buffer is
closed (``deallocate``); a :class:`SegmentMapping` owns the importer's own
reference, given up by :meth:`SegmentMapping.close`.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, ClassVar

from cuda.core import MemoryResource

from dask_gpupool.errors import GPUPoolError, PoolClosedError, PoolExhaustedError

if TYPE_CHECKING:
    from cuda.core import Buffer

__all__ = ["SegmentMapping", "SegmentMemory", "check", "driver"]


def driver() -> Any:
    """``cuda.bindings.driver``, imported on first use (the package imports without CUDA)."""
    from cuda.bindings import driver

    return driver


def check(err: Any, what: str, exc: type[GPUPoolError] = GPUPoolError) -> None:
    """Raise ``exc`` (:class:`PoolExhaustedError` when out of memory) unless ``err`` is ``CUDA_SUCCESS``."""
    d = driver()
    if err != d.CUresult.CUDA_SUCCESS:
        if err == d.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            raise PoolExhaustedError(f"{what}: the GPU is out of memory ({err!r})")
        raise exc(f"{what} failed: {err!r}")


class SegmentMemory(MemoryResource):
    """Device memory of GPU ``device`` made one driver allocation at a time, at most ``max_size`` bytes at once.

    Subclasses make and free the memory; this class counts it. An allocation
    reserves its bytes first (:meth:`_reserve`), is recorded once made
    (:meth:`_made`, which returns the caller's Buffer) and is taken out when
    freed (:meth:`_taken`).

    Parameters
    ----------
    device : int
        Ordinal of the GPU the memory lives on.
    max_size : int
        Bytes this resource may hold at once; more raises
        :class:`PoolExhaustedError`.
    """

    #: Named in errors: "the VMM resource is closed".
    what = "segment memory"
    #: Peers map an allocation by a POSIX fd the broker passes (its ``export_fd``), not by a handle carried in the
    #: descriptor.
    exports_fds: ClassVar[bool] = False

    max_size: int
    _device: int
    _live: dict[int, tuple[Any, int]]
    _used: int
    _used_high: int
    _closed: bool
    _lock: threading.Lock

    def __init__(self, device: int, max_size: int) -> None:
        self._device = device
        self.max_size = max_size
        self._live = {}  # address -> (the driver's handle or None, size)
        self._used = self._used_high = 0
        self._closed = False
        self._lock = threading.Lock()

    def _reserve(self, nbytes: int) -> None:
        """Count ``nbytes`` as used before they are made (:meth:`_unreserve` if the driver then fails).

        Raises
        ------
        PoolExhaustedError
            Over ``max_size``.
        PoolClosedError
            After :meth:`close`.
        """
        with self._lock:
            if self._closed:
                raise PoolClosedError(f"the {self.what} resource is closed")
            if self._used + nbytes > self.max_size:
                raise PoolExhaustedError(
                    f"cannot allocate {nbytes} bytes: {self._used} of {self.max_size} bytes in use"
                )
            self._used += nbytes

    def _unreserve(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes

    def _made(self, ptr: int, handle: Any, nbytes: int) -> Buffer:
        """Record the allocation at ``ptr``; the Buffer that owns it (closing it calls :meth:`deallocate`)."""
        from cuda.core import Buffer

        with self._lock:
            self._live[ptr] = (handle, nbytes)
            self._used_high = max(self._used_high, self._used)
        return Buffer.from_handle(ptr, nbytes, mr=self)

    def _taken(self, ptr: int) -> tuple[Any, int] | None:
        """Take the allocation at ``ptr`` out of the books: its ``(handle, size)``, ``None`` if freed already."""
        with self._lock:
            entry = self._live.pop(int(ptr), None)
            if entry is not None:
                self._used -= entry[1]
            return entry

    @property
    def used(self) -> int:
        """Bytes in live allocations."""
        return self._used

    @property
    def is_device_accessible(self) -> bool:
        return True

    @property
    def is_host_accessible(self) -> bool:
        return False

    @property
    def device_id(self) -> int:
        return self._device

    def close(self) -> None:
        """Stop allocating. Live allocations stay until their Buffers free them. Idempotent."""
        with self._lock:
            self._closed = True


class SegmentMapping:
    """A peer's segment mapped into this process: the importer's own reference to its memory.

    Quacks like the imported :class:`cuda.core.Buffer` it replaces for
    segments: ``handle`` (the address), ``size``, ``device_id``, the
    accessibility flags and ``close(stream)``. Subclasses undo their mapping
    in :meth:`_unmap`.

    Attributes
    ----------
    handle : int
        The address the memory is mapped at in this process.
    size : int
        Bytes mapped.
    device_id : int
        This process's GPU, which the mapping is for.
    """

    handle: int
    size: int
    device_id: int
    is_device_accessible: bool = True
    is_host_accessible: bool = False
    _closed: bool

    def __init__(self, ptr: int, size: int, device: int) -> None:
        self.handle = ptr
        self.size = size
        self.device_id = device
        self._closed = False

    def close(self, stream: Any = None) -> None:
        """Undo the mapping once the work queued on ``stream`` is done. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if stream is not None:
            stream.sync()
        self._unmap()

    def _unmap(self) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.size} bytes at {self.handle:#x}>"
