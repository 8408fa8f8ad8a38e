"""One peer's pool mapped into this process: :class:`MappedPool`, and the process's import lock.

A :class:`MappedPool` opens a peer's pool from the fd its broker sent
(granting this process's GPU access), imports the peer's buffers, shares one
import of an allocation between the handoffs that use it, and keeps the
peer's segments mapped until the owner retires them. The cache of mappings,
at most one per pool UUID, is :class:`~dask_gpupool.handoff.links.MappedPools`.

Every CUDA import and every close of an imported object runs under
:data:`IMPORT_LOCK`, one lock per process: with cuda-core 1.2.0 several
threads importing at once can deadlock (NVIDIA/cuda-python#2840).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask_gpupool.errors import PeerAccessError, PoolClosedError, ProtocolError
from dask_gpupool.memory.host import SharedHostMemoryResource
from dask_gpupool.memory.topology import LocalDevices, current_gpu, sleeping_event
from dask_gpupool.wire.handoff import BufferDescriptor
from dask_gpupool.wire.registry import PoolRecord

if TYPE_CHECKING:
    from cuda.core import Buffer

__all__ = ["IMPORT_LOCK", "MappedPool"]

logger = logging.getLogger(__name__)

#: Serializes every CUDA IPC import and every close of an imported object. Truly per process: the driver's imports
#: are the process's, whichever service made them.
IMPORT_LOCK = threading.RLock()

#: The size field of an :meth:`MappedPool.acquire` key that names a segment (kept mapped) rather than an import.
_SEGMENT = -1


def _grant_access(resource: Any, ordinal: int) -> None:
    """Give GPU ``ordinal`` read-write access to an imported pool (cuMemPoolSetAccess)."""
    from cuda.bindings import driver

    desc = driver.CUmemAccessDesc()
    desc.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = ordinal
    desc.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    (err,) = driver.cuMemPoolSetAccess(resource.handle, [desc], 1)
    # ALREADY_MAPPED: the pool is accessible from that GPU already.
    if err not in (driver.CUresult.CUDA_SUCCESS, driver.CUresult.CUDA_ERROR_ALREADY_MAPPED):
        raise PeerAccessError(f"cuMemPoolSetAccess for GPU {ordinal} failed: {err!r}")


class MappedPool:
    """A peer's pool mapped into this process; imports that peer's buffers.

    Build with :meth:`open`. The mapped resource is owned by this object and
    closed by :meth:`close`, which the cache calls after every buffer imported
    from the pool has been released.

    Attributes
    ----------
    record : PoolRecord
        The registry row of the peer's pool.
    imports : int
        Handed-over buffers from this pool still alive here.
    orphaned : bool
        The owner has left; the mapping is closed when ``imports`` drops to 0.
    segments : int
        Segments of the peer's pool imported here (kept mapped until the
        owner retires them, or :meth:`close`).
    retire_below : int
        The owner's ``retire_below`` as last seen: segments with a smaller id
        are unmapped once no buffer imported from them is alive here.
    reclaim : frozenset of int
        Every id the owner's ``reclaim`` named so far: segments retired one by
        one, unmapped like those below ``retire_below``.
    resource : object
        The mapped memory resource (cuda.core or shared host memory).
    device : int or None
        Ordinal of this process's GPU that imported buffers are used on.
    """

    record: PoolRecord
    resource: Any
    device: int | None
    imports: int
    orphaned: bool
    retire_below: int
    reclaim: frozenset[int]
    _shared: dict[tuple[bytes, int, int], list[Any]]
    _segments: dict[int, list[Any]]
    _closed: bool

    def __init__(self, record: PoolRecord, resource: Any, device: int | None) -> None:
        self.record = record
        self.resource = resource
        self.device = device
        self.imports = 0  # live imports handed out through the handoff path (changed under IMPORT_LOCK)
        self.orphaned = False  # the owner left; close when the last import goes
        self.retire_below = record.retire_below
        self.reclaim = frozenset(record.reclaim)
        self._shared = {}
        self._segments = {}  # segment id -> [import, users, segment id, leases claimed on it in all]
        self._released: set[int] = set()  # retired segments unmapped here whose (id, claims) went to the owner
        self._closed = False

    @property
    def segments(self) -> int:
        return len(self._segments)

    @classmethod
    def open(cls, record: PoolRecord, fd: int, devices: LocalDevices, own_device: int | None) -> MappedPool:
        """Map the pool whose shareable handle is ``fd``.

        Parameters
        ----------
        record : PoolRecord
            The pool's registry row (kind, device UUID).
        fd : int
            The pool's handle as received from the owner's broker. Borrowed:
            the caller closes it (cuda.core duplicates what it keeps).
        devices : LocalDevices
            The GPUs this process sees, to find the pool's GPU by UUID.
        own_device : int or None
            This process's GPU, which is granted access to the pool.

        Raises
        ------
        PeerAccessError
            If this process cannot reach the pool's memory.

        Notes
        -----
        Call with :data:`IMPORT_LOCK` held.
        """
        if record.kind == "host":
            return cls(record, SharedHostMemoryResource.from_allocation_handle(fd), own_device)
        if own_device is None:
            raise PeerAccessError(f"pool {record.pool} is a {record.kind} pool and this process has no GPU")
        own = current_gpu(own_device)
        if record.kind == "pinned":
            from cuda.core import PinnedMemoryResource

            # Host memory: the CPU can read it as soon as it is imported; grant our GPU access too
            # so kernels can use the pointer directly.
            pinned = PinnedMemoryResource.from_allocation_handle(fd)
            try:
                _grant_access(pinned, own_device)
            except BaseException:
                pinned.close()
                raise
            return cls(record, pinned, own_device)
        from cuda.core import DeviceMemoryResource

        owner = devices.ordinal_of(record.device)
        if owner is not None and owner != own_device and not own.can_access_peer(owner):
            raise PeerAccessError(
                f"pool {record.pool} lives on GPU {record.device}, which GPU {devices.uuids[own_device]} "
                "cannot access (no peer access)"
            )
        resource = DeviceMemoryResource.from_allocation_handle(owner if owner is not None else own_device, fd)
        try:
            if owner is None:
                # The pool's GPU is not visible here: grant access to ours directly.
                _grant_access(resource, own_device)
            elif owner != own_device:
                resource.peer_accessible_by = {own_device}
        except BaseException:
            resource.close()
            raise
        return cls(record, resource, own_device)

    def import_buffer(self, desc: BufferDescriptor) -> Buffer:
        """Map one of the peer's buffers of a ``host`` or ``pinned`` pool (no copy). The caller owns the Buffer.

        A ``device`` pool's buffers lie in segments, mapped once each by
        :meth:`acquire`: a descriptor of one is refused here.

        Raises
        ------
        ProtocolError
            If the descriptor does not fit this pool's kind or size, or names
            a ``device`` pool.
        PoolClosedError
            After :meth:`close`.
        """
        if self._closed:
            raise PoolClosedError(f"mapping of pool {self.record.pool} is closed")
        if desc.pool != self.record.pool:
            raise ProtocolError(f"descriptor of pool {desc.pool} given to mapping of {self.record.pool}")
        if desc.size > self.record.max_size:
            raise ProtocolError(f"descriptor size {desc.size} exceeds pool {self.record.pool}'s max_size")
        if self.record.kind == "host":
            if desc.payload:
                raise ProtocolError("host pool descriptors carry no payload")
            return self.resource.import_buffer(desc.offset, desc.size)
        if self.record.kind == "device":
            raise ProtocolError(
                f"pool {self.record.pool} is a device pool: its buffers are mapped by segment (acquire), not one by one"
            )
        if len(desc.payload) != BufferDescriptor.PAYLOAD_BYTES or desc.offset or desc.extent:
            raise ProtocolError(f"{self.record.kind} pool descriptors carry a 64-byte payload and no offset")
        return self._import(desc.payload, desc.size)

    def _import(self, payload: bytes, size: int) -> Buffer:
        from cuda.core import Buffer

        dev = current_gpu(self.device)
        ipc_desc = _ipc_descriptor(payload, size)
        with IMPORT_LOCK:
            return Buffer.from_ipc_descriptor(self.resource, ipc_desc, stream=dev.default_stream)

    def acquire(
        self, desc: BufferDescriptor, claimed: bool = True, segment_fd: Callable[[], int] | None = None
    ) -> tuple[tuple[Any, int, int], Any, int]:
        """Import ``desc``'s buffer, or share the live import of the same allocation.

        One allocation is imported at most once per process at a time: a
        second import of an allocation already mapped here, closed on its own,
        would unmap the memory under the first (Dask can fetch one key twice,
        e.g. after the AMM dropped a replica). A segment (``desc.extent``) is
        imported on first use and kept mapped until the owner retires it
        (:meth:`retire`) or :meth:`close`; a VMM segment (no payload) is
        mapped from the fd ``segment_fd()`` returns (fetched from the owner's
        broker, outside the import lock; closed here). ``claimed``: the caller
        claims a lease for this import (counted per segment for
        ``SegmentRelease``). Returns a key for :meth:`unshare`, the import,
        and the buffer's address.

        Raises
        ------
        ProtocolError
            If the descriptor does not fit this pool, or lies past the end of
            a segment already mapped here (whose bounds are its mapping's,
            whatever extent the descriptor says).
        """
        if desc.extent:
            return self._acquire_segment(desc, claimed, segment_fd)
        with IMPORT_LOCK:
            key = (desc.payload, desc.offset, desc.size)
            entry = self._shared.get(key)
            if entry is not None:
                entry[1] += 1
                self.imports += 1
                return key, entry[0], int(entry[0].handle)
            raw = self.import_buffer(desc)
            self._shared[key] = [raw, 1]
            self.imports += 1
            return key, raw, int(raw.handle)

    def _acquire_segment(
        self, desc: BufferDescriptor, claimed: bool, segment_fd: Callable[[], int] | None
    ) -> tuple[tuple[Any, int, int], Any, int]:
        vmm = not desc.payload
        legacy = self.record.segment_memory == "legacy"
        if self.record.kind != "device" or len(desc.payload) not in (0, BufferDescriptor.PAYLOAD_BYTES):
            raise ProtocolError(f"segment descriptor given to a {self.record.kind} pool mapping")
        if desc.extent > self.record.max_size or desc.offset + desc.size > desc.extent:
            raise ProtocolError(f"segment of {desc.extent} bytes does not fit pool {self.record.pool}")
        if legacy and (vmm or self.device is None):
            raise ProtocolError(
                f"segment {desc.segment} of pool {self.record.pool}: legacy IPC memory needs its 64-byte handle "
                "and a GPU here"
            )
        if vmm and (segment_fd is None or self.device is None):
            raise ProtocolError(f"segment {desc.segment} of pool {self.record.pool}: no way to fetch and map it")
        for attempt in (0, 1):
            fresh = None
            with IMPORT_LOCK:
                if self._closed:
                    raise PoolClosedError(f"mapping of pool {self.record.pool} is closed")
                if desc.segment in self._released:
                    raise PeerAccessError(
                        f"segment {desc.segment} of pool {self.record.pool} was retired, unmapped and released "
                        "here: it is not mapped again (the release settled this process's claims on it)"
                    )
                seg = self._segments.get(desc.segment)
                if seg is None and legacy:
                    seg = self._segments[desc.segment] = [self._open_legacy(desc), 0, desc.segment, 0]
                elif seg is None and not vmm:
                    seg = self._segments[desc.segment] = [self._import(desc.payload, desc.extent), 0, desc.segment, 0]
                if seg is not None:
                    if desc.offset + desc.size > int(seg[0].size):  # its mapping's bounds, not the descriptor's
                        raise ProtocolError(
                            f"buffer of {desc.size} bytes at offset {desc.offset} lies past the end of segment "
                            f"{desc.segment} of pool {self.record.pool} ({int(seg[0].size)} bytes mapped here)"
                        )
                    seg[1] += 1
                    seg[3] += int(claimed)
                    self.imports += 1
                    return (desc.segment, 0, _SEGMENT), seg[0], int(seg[0].handle) + desc.offset
            if attempt:
                break
            assert segment_fd is not None and self.device is not None
            fd = segment_fd()  # a broker round trip: not under the import lock
            try:
                from dask_gpupool.memory.vmm import VmmMapping

                current_gpu(self.device)
                fresh = VmmMapping.open(fd, desc.extent, self.device)
            finally:
                os.close(fd)
            with IMPORT_LOCK:
                if not self._closed and desc.segment not in self._segments and desc.segment not in self._released:
                    self._segments[desc.segment] = [fresh, 0, desc.segment, 0]
                    fresh = None
            if fresh is not None:  # another thread mapped it meanwhile, or the mapping closed
                fresh.close()
        raise PoolClosedError(f"mapping of pool {self.record.pool} is closed")

    def _open_legacy(self, desc: BufferDescriptor) -> Any:
        """Open a segment of legacy IPC memory by the handle in ``desc`` (call with :data:`IMPORT_LOCK` held)."""
        from dask_gpupool.memory.legacy import LegacyMapping

        assert self.device is not None
        current_gpu(self.device)
        return LegacyMapping.open(desc.payload, desc.extent, self.device)

    def unshare(self, key: tuple[Any, int, int]) -> tuple[Buffer | None, tuple[int, int] | None]:
        """Drop one user of a shared import; return the import to close when it was the last.

        Segments stay mapped, unless retiring and this was their last user:
        then the segment's import is returned with its ``(id, claims)`` for a
        ``SegmentRelease``, sent once the import is closed.
        """
        with IMPORT_LOCK:
            self.imports -= 1
            if key[2] == _SEGMENT:
                seg = self._segments[key[0]]
                seg[1] -= 1
                if seg[1] or not self._retiring(seg[2]):
                    return None, None
                del self._segments[key[0]]
                if seg[3]:
                    self._released.add(seg[2])
                return seg[0], ((seg[2], seg[3]) if seg[3] else None)
            entry = self._shared[key]
            entry[1] -= 1
            if entry[1] > 0:
                return None, None
            del self._shared[key]
            raw: Buffer = entry[0]
            return raw, None

    def retire(self, below: int, reclaim: tuple[int, ...] = ()) -> tuple[list[Buffer], list[tuple[int, int]]]:
        """The owner retires segments with ids below ``below``, and those in ``reclaim``: take those no import uses.

        Returns their imports (the caller closes them, then sends the
        ``(id, claims)`` pairs in a ``SegmentRelease``); the others go when
        their last user does (:meth:`unshare`).
        """
        with IMPORT_LOCK:
            self.retire_below = max(self.retire_below, below)
            # accumulated: a later (or reordered) row that no longer names a segment still mapped here must not
            # keep it mapped for good (segment ids are never reused)
            self.reclaim |= frozenset(reclaim)
            gone = [k for k, seg in self._segments.items() if not seg[1] and self._retiring(seg[2])]
            segs = [self._segments.pop(k) for k in gone]
            self._released.update(seg[2] for seg in segs if seg[3])
        return [seg[0] for seg in segs], [(seg[2], seg[3]) for seg in segs if seg[3]]

    def has_released(self, segment_id: int) -> bool:
        """Whether segment ``segment_id`` was unmapped here after its owner retired it, and released with its
        claims: it is not mapped here again (its values come as copies), so this process's count of claims on it
        never restarts where the owner's ledger goes on."""
        with IMPORT_LOCK:
            return segment_id in self._released

    def unclaim(self, key: tuple[Any, int, int]) -> None:
        """Take back the claim :meth:`acquire` counted for ``key``'s segment: the owner never acknowledged it
        (refused, or not answered). A release then names only claims the owner counted."""
        if key[2] != _SEGMENT:
            return
        with IMPORT_LOCK:
            seg = self._segments.get(key[0])
            if seg is not None and seg[3] > 0:
                seg[3] -= 1

    def _retiring(self, segment_id: int) -> bool:
        """Whether the owner retired segment ``segment_id`` (below ``retire_below``, or reclaimed)."""
        return 0 < segment_id < self.retire_below or segment_id in self.reclaim

    def close_segment_imports(self, raws: list[Buffer]) -> Any:
        """Close segment imports :meth:`retire` or :meth:`unshare` handed out; return the event to wait for."""
        if not raws:
            return None
        with IMPORT_LOCK:
            if self.device is None:
                for raw in raws:
                    raw.close()
                return None
            dev = current_gpu(self.device)
            for raw in raws:
                raw.close(dev.default_stream)
            return sleeping_event(dev.default_stream)

    def release(self, buf: Buffer) -> None:
        """Close a buffer imported from this pool, under the import lock."""
        with IMPORT_LOCK:
            buf.close()

    def close(self) -> None:
        """Close the mapped resource. Idempotent; call after imported buffers are released."""
        if self._closed:
            return
        self._closed = True
        with IMPORT_LOCK:
            segments, self._segments = list(self._segments.values()), {}
            if self.device is not None:
                dev = current_gpu(self.device)
                for raw, *_ in segments:
                    try:
                        raw.close(dev.default_stream)
                    except Exception:
                        logger.exception("pool %s: closing a segment import failed", self.record.pool)
                # Frees of imports (segments here, buffers just before when the last handoff closed the
                # mapping) are stream-ordered: let them finish before the imported pool goes. Without this, a
                # closed mapping can keep one /dev/nvidiactl fd now and then.
                dev.default_stream.sync()
            self.resource.close()


def _ipc_descriptor(payload: bytes, size: int) -> Any:
    # cuda.core 1.2 does not export IPCBufferDescriptor; its pickle constructor
    # is the supported way back from (payload, size).
    from cuda.core._memory._ipc import IPCBufferDescriptor

    return IPCBufferDescriptor._init(payload, size)
