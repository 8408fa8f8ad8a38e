"""CUDA virtual memory segments: memory that outlives the process that made it, for peers that map it.

Why
---
A pool allocation (``cuMemPoolExportPointer``) imported on *another* GPU stops
being readable when its exporter's process dies: the importer's next kernel on
it fails with ``CUDA_ERROR_CONTAINED`` and that process's CUDA context is dead
for good. Measured on two H200s (driver 580.159.04) by
``benchmarks/exporter_death.py``: after the exporter's SIGKILL the same-GPU
importer still read the right bytes (even after another process filled the
GPU), the cross-GPU importer got ``CUDA_ERROR_CONTAINED``. A 10-minute chaos run
with SIGKILLs hit the same on a live cluster. No lease can prevent it: the owner
is gone, and Dask keeps the consumer's replica.

Memory made with the virtual memory management API (``cuMemCreate`` with a
POSIX file-descriptor handle type) is reference counted by the driver: an
importer that called ``cuMemImportFromShareableHandle`` and ``cuMemMap`` holds
its own reference, so the physical memory stays until the *last* process
unmaps and releases it, whoever made it. The same benchmark read the right
bytes after the exporter's SIGKILL on one GPU and across two.

So ``device`` pools take their segments (:mod:`dask_gpupool.memory.segments`) from a
:class:`VmmMemoryResource`; peers fetch a segment's fd from the owner's broker
by segment id (``HandleRequest(pool, segment)``) and map it with
:class:`VmmMapping`.

Ownership
---------
- :class:`VmmMemoryResource` owns each allocation's handle, its address range
  and the mapping; :meth:`VmmMemoryResource.deallocate` unmaps and releases
  them. Freeing while a peer maps the memory is *memory-safe* (the peer's
  reference keeps the pages), but the bytes then stay in use on the GPU until
  the peer lets go: the retire protocol still decides when to free.
- :meth:`VmmMemoryResource.export_fd` returns a new fd that the **caller
  closes** (the broker, right after sending it).
- :class:`VmmMapping` owns the importer's handle, range and mapping;
  :meth:`VmmMapping.open` borrows the fd it is given (the caller closes it).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from dask_gpupool.errors import PeerAccessError
from dask_gpupool.memory.driver_segments import SegmentMapping, SegmentMemory
from dask_gpupool.memory.driver_segments import check as _check
from dask_gpupool.memory.driver_segments import driver as _driver

if TYPE_CHECKING:
    from cuda.core import Buffer

__all__ = ["VmmMapping", "VmmMemoryResource", "vmm_supported"]

logger = logging.getLogger(__name__)


def _prop(ordinal: int) -> Any:
    driver = _driver()
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    prop.requestedHandleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def _access(ordinal: int) -> Any:
    driver = _driver()
    acc = driver.CUmemAccessDesc()
    acc.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    acc.location.id = ordinal
    acc.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return acc


def vmm_supported(ordinal: int) -> bool:
    """Whether GPU ``ordinal`` makes VMM memory exportable as a POSIX fd (all recent Linux drivers do)."""
    driver = _driver()
    attr = driver.CUdevice_attribute
    for a in (
        attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
    ):
        err, value = driver.cuDeviceGetAttribute(a, ordinal)
        if err != driver.CUresult.CUDA_SUCCESS or not value:
            return False
    return True


def granularity(ordinal: int) -> int:
    """The smallest size step of a VMM allocation on GPU ``ordinal`` (2 MiB on current GPUs)."""
    driver = _driver()
    err, gran = driver.cuMemGetAllocationGranularity(
        _prop(ordinal), driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    )
    _check(err, "cuMemGetAllocationGranularity")
    return int(gran)


def _map(handle: Any, size: int, ordinal: int) -> int:
    """Reserve a range, map ``handle`` there and give GPU ``ordinal`` access; the address (undone on error)."""
    driver = _driver()
    err, ptr = driver.cuMemAddressReserve(size, 0, 0, 0)
    _check(err, "cuMemAddressReserve")
    try:
        (err,) = driver.cuMemMap(ptr, size, 0, handle, 0)
        _check(err, "cuMemMap")
        try:
            (err,) = driver.cuMemSetAccess(ptr, size, [_access(ordinal)], 1)
            _check(err, f"cuMemSetAccess for GPU {ordinal}", PeerAccessError)
        except BaseException:
            driver.cuMemUnmap(ptr, size)
            raise
    except BaseException:
        driver.cuMemAddressFree(ptr, size)
        raise
    return int(ptr)


def _unmap(ptr: int, size: int, handle: Any) -> None:
    """Undo :func:`_map` and drop this process's reference to the memory (errors logged)."""
    driver = _driver()
    for what, call in (
        ("cuMemUnmap", lambda: driver.cuMemUnmap(ptr, size)),
        ("cuMemAddressFree", lambda: driver.cuMemAddressFree(ptr, size)),
        ("cuMemRelease", lambda: driver.cuMemRelease(handle)),
    ):
        (err,) = call()
        if err != driver.CUresult.CUDA_SUCCESS:
            logger.error("%s of %d bytes at %#x failed: %r", what, size, ptr, err)


class VmmMemoryResource(SegmentMemory):
    """Device memory made with ``cuMemCreate``, exportable as POSIX fds, bounded by ``max_size``.

    Each allocation is its own physical allocation, mapped at a fresh address
    range and readable and writable by GPU ``device``. Allocation is not
    stream-ordered (new memory has no pending work); a free waits for the work
    queued on its stream first.

    Parameters
    ----------
    device : int
        Ordinal of the GPU the memory lives on (current in the calling thread).
    max_size : int
        Bytes this resource may hold at once; more raises
        :class:`PoolExhaustedError`.
    """

    what = "VMM"
    exports_fds = True

    _granularity: int

    def __init__(self, device: int, max_size: int) -> None:
        super().__init__(device, max_size)
        self._granularity = granularity(device)

    def round(self, size: int) -> int:
        """``size`` rounded up to this GPU's allocation granularity."""
        return -(-max(size, 1) // self._granularity) * self._granularity

    def allocate(self, size: int, *, stream: Any = None) -> Buffer:
        """New memory of ``size`` bytes (rounded up to the granularity), owned by the caller's Buffer.

        Raises
        ------
        PoolExhaustedError
            Over ``max_size``, or when the GPU has no memory left.
        PoolClosedError
            After :meth:`close`.
        """
        driver = _driver()
        nbytes = self.round(size)
        self._reserve(nbytes)  # given back below if the driver fails
        try:
            err, handle = driver.cuMemCreate(nbytes, _prop(self._device), 0)
            _check(err, f"cuMemCreate of {nbytes} bytes")
            try:
                ptr = _map(handle, nbytes, self._device)
            except BaseException:
                driver.cuMemRelease(handle)
                raise
        except BaseException:
            self._unreserve(nbytes)
            raise
        return self._made(ptr, handle, nbytes)

    def deallocate(self, ptr: Any, size: int, *, stream: Any = None) -> None:
        """Unmap and release the allocation at ``ptr`` once the work queued on ``stream`` is done.

        Peers that imported it keep its memory until they release their own
        reference (:class:`VmmMapping`).
        """
        entry = self._taken(ptr)
        if entry is None:
            return  # freed already (close)
        handle, nbytes = entry
        if stream is not None:
            stream.sync()
        _unmap(int(ptr), nbytes, handle)

    def export_fd(self, ptr: int) -> int:
        """A new POSIX fd for the allocation at ``ptr``; the **caller closes it**.

        Raises
        ------
        KeyError
            If ``ptr`` is not a live allocation of this resource.
        """
        driver = _driver()
        with self._lock:
            handle, _ = self._live[int(ptr)]
            err, fd = driver.cuMemExportToShareableHandle(
                handle, driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
            )
        _check(err, "cuMemExportToShareableHandle")
        return int(fd)


class VmmMapping(SegmentMapping):
    """A peer's VMM allocation mapped into this process (the importer's own reference to its memory).

    Quacks like the imported :class:`cuda.core.Buffer` it replaces for
    segments (:class:`~dask_gpupool.memory.driver_segments.SegmentMapping`).
    """

    _handle: Any

    def __init__(self, ptr: int, size: int, handle: Any, device: int) -> None:
        super().__init__(ptr, size, device)
        self._handle = handle

    @classmethod
    def open(cls, fd: int, size: int, device: int) -> VmmMapping:
        """Import the allocation ``fd`` names and map ``size`` bytes of it for GPU ``device``.

        ``fd`` is borrowed: the caller closes it (the driver keeps its own reference).

        Raises
        ------
        PeerAccessError
            If GPU ``device`` cannot be given access (no peer access to the memory's GPU).
        GPUPoolError
            If the driver refuses the import or the mapping.
        """
        driver = _driver()
        err, handle = driver.cuMemImportFromShareableHandle(
            fd, driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )
        _check(err, "cuMemImportFromShareableHandle")
        try:
            ptr = _map(handle, size, device)
        except BaseException:
            driver.cuMemRelease(handle)
            raise
        return cls(ptr, size, handle, device)

    def _unmap(self) -> None:
        """Unmap, and drop this process's reference to the memory."""
        _unmap(self.handle, self.size, self._handle)
