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
0.15 ms a value, which made pool arrays of 8 KiB to 4 MiB 1.1x slower to
another "host" than UCXX alone (``docs/performance.md``). Segments made of
``cuMemAlloc`` memory need no such copy.

They keep the lease guarantee: an importer's mapping of legacy IPC memory
kept the memory after the exporter's SIGKILL, on the same GPU (one H100) and
from the other GPU (two H200s), also after another process allocated and
wrote 8 GiB, as VMM memory does (``scripts/probes/handle_types.py``,
``docs/design.md`` "Pool memory to another host over UCX"). Pool memory
(``cuMemPoolExportPointer``) does not across GPUs: ``CUDA_ERROR_CONTAINED``.

Opt in with ``gpupool.segment-memory: legacy``; the default stays VMM.

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
import threading
from typing import TYPE_CHECKING, Any

from cuda.core import MemoryResource

from dask_gpupool.errors import GPUPoolError, PeerAccessError, PoolClosedError, PoolExhaustedError
from dask_gpupool.memory.topology import current_gpu

if TYPE_CHECKING:
    from cuda.core import Buffer

__all__ = ["HANDLE_BYTES", "LegacyMapping", "LegacyMemoryResource", "legacy_payload", "legacy_supported"]

logger = logging.getLogger(__name__)

#: Bytes of a ``CUipcMemHandle``: the segment payload in a buffer descriptor.
HANDLE_BYTES = 64

#: Allocations are rounded up to this (``cuMemAlloc`` aligns to at least 256 bytes; 2 MiB keeps segments whole pages).
ALIGNMENT = 2 << 20


def _driver() -> Any:
    from cuda.bindings import driver

    return driver


def _check(err: Any, what: str, exc: type[GPUPoolError] = GPUPoolError) -> None:
    driver = _driver()
    if err != driver.CUresult.CUDA_SUCCESS:
        if err == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            raise PoolExhaustedError(f"{what}: the GPU is out of memory ({err!r})")
        raise exc(f"{what} failed: {err!r}")


def legacy_supported(ordinal: int) -> bool:
    """Whether GPU ``ordinal`` shares ``cuMemAlloc`` memory by IPC handle: unified addressing and IPC support,
    which CUDA's reference says to test with ``CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED``."""
    driver = _driver()
    attr = driver.CUdevice_attribute
    for a in (attr.CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, attr.CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED):
        err, value = driver.cuDeviceGetAttribute(a, ordinal)
        if err != driver.CUresult.CUDA_SUCCESS or not value:
            return False
    return True


def legacy_payload(buf: Buffer) -> bytes:
    """The 64-byte IPC handle of the ``cuMemAlloc`` allocation ``buf`` starts (a segment of this process).

    Raises
    ------
    GPUPoolError
        If the driver refuses (memory not from ``cuMemAlloc``, or imported).
    """
    driver = _driver()
    err, handle = driver.cuIpcGetMemHandle(int(buf.handle))
    _check(err, "cuIpcGetMemHandle")
    payload = bytes(handle.reserved)
    if len(payload) != HANDLE_BYTES:  # pragma: no cover - the driver's struct is 64 bytes
        raise GPUPoolError(f"cuIpcGetMemHandle returned {len(payload)} bytes, expected {HANDLE_BYTES}")
    return payload


class LegacyMemoryResource(MemoryResource):
    """Device memory from ``cuMemAlloc``, shareable by legacy IPC handles, bounded by ``max_size``.

    Allocation is not stream-ordered (new memory has no pending work); a free
    waits for the work queued on its stream first, then calls ``cuMemFree``.

    Parameters
    ----------
    device : int
        Ordinal of the GPU the memory lives on (current in the calling thread).
    max_size : int
        Bytes this resource may hold at once; more raises
        :class:`PoolExhaustedError`.
    """

    max_size: int
    _device: int
    _live: dict[int, int]
    _used: int
    _used_high: int
    _closed: bool
    _lock: threading.Lock

    def __init__(self, device: int, max_size: int) -> None:
        self._device = device
        self.max_size = max_size
        self._live = {}  # address -> size
        self._used = self._used_high = 0
        self._closed = False
        self._lock = threading.Lock()

    @staticmethod
    def round(size: int) -> int:
        """``size`` rounded up to :data:`ALIGNMENT`."""
        return -(-max(size, 1) // ALIGNMENT) * ALIGNMENT

    def allocate(self, size: int, *, stream: Any = None) -> Buffer:
        """New memory of ``size`` bytes (rounded up to :data:`ALIGNMENT`), owned by the caller's Buffer.

        Raises
        ------
        PoolExhaustedError
            Over ``max_size``, or when the GPU has no memory left.
        PoolClosedError
            After :meth:`close`.
        """
        from cuda.core import Buffer

        driver = _driver()
        nbytes = self.round(size)
        with self._lock:
            if self._closed:
                raise PoolClosedError("the legacy IPC resource is closed")
            if self._used + nbytes > self.max_size:
                raise PoolExhaustedError(
                    f"cannot allocate {nbytes} bytes: {self._used} of {self.max_size} bytes in use"
                )
            self._used += nbytes  # reserved now, given back below if the driver fails
        try:
            current_gpu(self._device)
            err, ptr = driver.cuMemAlloc(nbytes)
            _check(err, f"cuMemAlloc of {nbytes} bytes")
        except BaseException:
            with self._lock:
                self._used -= nbytes
            raise
        with self._lock:
            self._live[int(ptr)] = nbytes
            self._used_high = max(self._used_high, self._used)
        return Buffer.from_handle(int(ptr), nbytes, mr=self)

    def deallocate(self, ptr: Any, size: int, *, stream: Any = None) -> None:
        """Free the allocation at ``ptr`` once the work queued on ``stream`` is done."""
        ptr = int(ptr)
        with self._lock:
            nbytes = self._live.pop(ptr, None)
            if nbytes is None:
                return  # freed already (close)
            self._used -= nbytes
        if stream is not None:
            stream.sync()
        current_gpu(self._device)
        (err,) = _driver().cuMemFree(ptr)
        if err != _driver().CUresult.CUDA_SUCCESS:
            logger.error("cuMemFree of %d bytes at %#x failed: %r", nbytes, ptr, err)

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


class LegacyMapping:
    """A peer's ``cuMemAlloc`` segment opened in this process by its IPC handle.

    Quacks like the imported :class:`cuda.core.Buffer` it replaces for
    segments: ``handle`` (the address), ``size``, ``device_id``, the
    accessibility flags and ``close(stream)``.

    Attributes
    ----------
    handle : int
        The address the memory is mapped at in this process.
    size : int
        Bytes of the segment.
    device_id : int
        This process's GPU, current when the handle was opened.
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
        """
        if len(payload) != HANDLE_BYTES:
            raise ValueError(f"an IPC handle is {HANDLE_BYTES} bytes, got {len(payload)}")
        driver = _driver()
        handle = driver.CUipcMemHandle()
        handle.reserved = payload
        err, ptr = driver.cuIpcOpenMemHandle(handle, driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        _check(err, "cuIpcOpenMemHandle", PeerAccessError)
        return cls(int(ptr), size, device)

    def close(self, stream: Any = None) -> None:
        """Close the mapping once the work queued on ``stream`` is done. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if stream is not None:
            stream.sync()
        (err,) = _driver().cuIpcCloseMemHandle(self.handle)
        if err != _driver().CUresult.CUDA_SUCCESS:
            logger.error("cuIpcCloseMemHandle of %d bytes at %#x failed: %r", self.size, self.handle, err)

    def __repr__(self) -> str:
        return f"<LegacyMapping {self.size} bytes at {self.handle:#x}>"
