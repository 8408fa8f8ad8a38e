"""Segments of ``cuMemAlloc`` memory shared by legacy IPC handles: memory UCX can send GPU to GPU as it is.

Why
---
UCX 1.21's ``cuda_ipc`` transport exports ``cuMemAlloc`` memory (legacy IPC
handles, ``cuIpcGetMemHandle``) and, through fabric handles only, pool and
VMM memory. Fabric handles need an IMEX channel, which the project's GPU
machines do not have (``CUDA_ERROR_NOT_PERMITTED``,
``scripts/probes/handle_types.py``). So a worker whose pool lives in VMM
segments copies every value it sends to another host over UCX into
``cuMemAlloc`` memory first (:mod:`dask_gpupool.memory.ucx_staging`): about
0.15 ms a value of host time (``docs/performance.md``). Segments made of
``cuMemAlloc`` memory need no such copy.

They keep the lease guarantee: an importer's mapping of legacy IPC memory
kept the memory after the exporter's SIGKILL, on the same GPU (one H100) and
from the other GPU (two H200s), also after another process allocated and
wrote 8 GiB, as VMM memory does (``scripts/probes/handle_types.py``,
``docs/design.md`` "Pool memory to another host over UCX"). Pool memory
(``cuMemPoolExportPointer``) does not across GPUs: ``CUDA_ERROR_CONTAINED``.

``gpupool.segment-memory: auto`` makes them on workers that listen over UCX
(:meth:`~dask_gpupool.memory.pool.Pool.create`'s ``prefer_legacy``): there,
with distributed-ucxx receiving into an RMM pool
(:mod:`dask_gpupool.dask.ucx_receive`), other-"host" pool arrays of 8 KiB to
4 MiB took 0.75-0.85x of UCXX alone's time on one H100, every pair at or
below in four clusters of five (one pair of eight above at 64 KiB in the
fifth), where VMM segments and the staging copy took 0.80-0.96x with one to
three pairs of eight above in each of five. Over TCP ``auto`` stays VMM (the
same speed there, and the segments every two-GPU test ran with); ``legacy``
sets them anywhere. Single imports of 8 and 16 GiB segments completed on one
H100.

Ownership
---------
- :class:`LegacyMemoryResource` owns each allocation; :meth:`~LegacyMemoryResource.deallocate`
  frees it with ``cuMemFree``. Freeing memory a peer has open is undefined
  by CUDA's reference, so the retire protocol decides when (as for every
  segment); UCX's own cache of opened handles checks buffer ids and opens
  again when an address was reused.
- A segment's payload is its 64-byte IPC handle (:func:`legacy_payload`),
  carried in the buffer descriptor: no fd passes through the broker.
- :class:`LegacyMapping` owns the importer's ``cuIpcOpenMemHandle`` mapping;
  :meth:`LegacyMapping.close` closes it (``cuIpcCloseMemHandle``). CUDA maps a
  handle once per context: opened again in the same context it returns the
  same address, so this process keeps one mapping per segment
  (:class:`~dask_gpupool.handoff.mapped_pool.MappedPool`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from dask_gpupool.errors import GPUPoolError, PeerAccessError, ProtocolError
from dask_gpupool.memory.driver_segments import SegmentMapping, SegmentMemory, check, driver
from dask_gpupool.memory.topology import current_gpu

if TYPE_CHECKING:
    from cuda.core import Buffer

__all__ = ["HANDLE_BYTES", "LegacyMapping", "LegacyMemoryResource", "legacy_payload", "legacy_supported"]

logger = logging.getLogger(__name__)

#: Bytes of a ``CUipcMemHandle``: the segment payload in a buffer descriptor.
HANDLE_BYTES = 64

#: Allocations are rounded up to this (``cuMemAlloc`` aligns to at least 256 bytes; 2 MiB keeps segments whole pages).
ALIGNMENT = 2 << 20


def legacy_supported(ordinal: int) -> bool:
    """Whether GPU ``ordinal`` shares ``cuMemAlloc`` memory by IPC handle: unified addressing and IPC support,
    which CUDA's reference says to test with ``CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED``."""
    d = driver()
    attr = d.CUdevice_attribute
    for a in (attr.CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, attr.CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED):
        err, value = d.cuDeviceGetAttribute(a, ordinal)
        if err != d.CUresult.CUDA_SUCCESS or not value:
            return False
    return True


def legacy_payload(buf: Buffer) -> bytes:
    """The 64-byte IPC handle of the ``cuMemAlloc`` allocation ``buf`` starts (a segment of this process).

    Raises
    ------
    GPUPoolError
        If the driver refuses (memory not from ``cuMemAlloc``, or imported).
    """
    err, handle = driver().cuIpcGetMemHandle(int(buf.handle))
    check(err, "cuIpcGetMemHandle")
    payload = bytes(handle.reserved)
    if len(payload) != HANDLE_BYTES:  # pragma: no cover - the driver's struct is 64 bytes
        raise GPUPoolError(f"cuIpcGetMemHandle returned {len(payload)} bytes, expected {HANDLE_BYTES}")
    return payload


class LegacyMemoryResource(SegmentMemory):
    """Device memory from ``cuMemAlloc``, shareable by legacy IPC handles, bounded by ``max_size``.

    Allocation is not stream-ordered (new memory has no pending work); a free
    waits for the work queued on its stream first, then calls ``cuMemFree``.
    Parameters and bookkeeping: :class:`~dask_gpupool.memory.driver_segments.SegmentMemory`.
    """

    what = "legacy IPC"

    @staticmethod
    def round(size: int) -> int:
        """``size`` rounded up to :data:`ALIGNMENT`."""
        return -(-max(size, 1) // ALIGNMENT) * ALIGNMENT

    def allocate(self, size: int, *, stream: Any = None) -> Buffer:
        """New memory of ``size`` bytes (rounded up to :data:`ALIGNMENT`), owned by the caller's Buffer.

        Raises :class:`PoolExhaustedError` over ``max_size`` or when the GPU has no memory left, and
        :class:`PoolClosedError` after :meth:`close`.
        """
        nbytes = self.round(size)
        self._reserve(nbytes)  # given back below if the driver fails
        try:
            current_gpu(self._device)
            err, ptr = driver().cuMemAlloc(nbytes)
            check(err, f"cuMemAlloc of {nbytes} bytes")
        except BaseException:
            self._unreserve(nbytes)
            raise
        return self._made(int(ptr), None, nbytes)

    def deallocate(self, ptr: Any, size: int, *, stream: Any = None) -> None:
        """Free the allocation at ``ptr`` once the work queued on ``stream`` is done."""
        entry = self._taken(ptr)
        if entry is None:
            return  # freed already (close)
        if stream is not None:
            stream.sync()
        current_gpu(self._device)
        d = driver()
        (err,) = d.cuMemFree(int(ptr))
        if err != d.CUresult.CUDA_SUCCESS:
            logger.error("cuMemFree of %d bytes at %#x failed: %r", entry[1], int(ptr), err)


class LegacyMapping(SegmentMapping):
    """A peer's ``cuMemAlloc`` segment opened in this process by its IPC handle.

    Quacks like the imported :class:`cuda.core.Buffer` it replaces for
    segments (:class:`~dask_gpupool.memory.driver_segments.SegmentMapping`).
    """

    @classmethod
    def open(cls, payload: bytes, size: int, device: int) -> LegacyMapping:
        """Open the segment whose IPC handle is ``payload`` (64 bytes) in GPU ``device``'s current context.

        Peer access to the memory's GPU is enabled as needed
        (``CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS``). Call with GPU ``device``
        current in this thread.

        Raises
        ------
        ValueError
            If ``payload`` is not 64 bytes.
        PeerAccessError
            If the driver refuses to open the handle (no peer access, a
            handle of this process, freed memory).
        ProtocolError
            If the allocation the handle names is smaller than ``size`` (the
            extent a descriptor said): the mapping is closed again, so no
            buffer past its end is ever made.
        """
        if len(payload) != HANDLE_BYTES:
            raise ValueError(f"an IPC handle is {HANDLE_BYTES} bytes, got {len(payload)}")
        d = driver()
        handle = d.CUipcMemHandle()
        handle.reserved = payload
        err, ptr = d.cuIpcOpenMemHandle(handle, d.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        check(err, "cuIpcOpenMemHandle", PeerAccessError)
        mapping = cls(int(ptr), size, device)
        err, base, mapped = d.cuMemGetAddressRange(ptr)  # the allocation's own bounds, not the descriptor's
        if err != d.CUresult.CUDA_SUCCESS or int(base) != int(ptr) or int(mapped) < size:
            mapping.close()
            raise ProtocolError(
                f"an IPC handle of a {int(mapped)}-byte allocation given for a segment of {size} bytes ({err!r})"
            )
        return mapping

    def _unmap(self) -> None:
        """Close the mapping (``cuIpcCloseMemHandle``; errors logged)."""
        d = driver()
        (err,) = d.cuIpcCloseMemHandle(self.handle)
        if err != d.CUresult.CUDA_SUCCESS:
            logger.error("cuIpcCloseMemHandle of %d bytes at %#x failed: %r", self.size, self.handle, err)
