"""Shared host memory as a cuda.core memory resource, for hosts without a GPU.

:class:`SharedHostMemoryResource` is the ``host`` pool kind. It follows the
protocol of cuda.core's IPC-enabled pools so that the rest of dask_gpupool
treats every kind alike:

- the owner makes one memfd of ``max_size`` bytes (sparse: pages are backed
  when first touched), maps it, and carves :class:`~cuda.core.Buffer` objects
  out of it with an :class:`~dask_gpupool.memory.arena.Arena`;
- :attr:`~SharedHostMemoryResource.allocation_handle` is that memfd's file
  descriptor, the equivalent of a CUDA pool's shareable handle; it crosses to
  a peer over the fd broker (SCM_RIGHTS);
- a peer calls :meth:`~SharedHostMemoryResource.from_allocation_handle` to
  map the whole pool once (a *mapped* resource, which cannot allocate), then
  :meth:`~SharedHostMemoryResource.import_buffer` with an offset and size for
  each buffer: no copy, the peer reads the owner's pages.

Works with no NVIDIA driver at all: buffers are host pointers handed to
``Buffer.from_handle``.

Memory goes back to the OS: a freed buffer's whole pages (from 64 KiB) are removed from the memfd at once
(``madvise(MADV_REMOVE)``, a hole punched in the file), so neither the owner nor any peer that mapped them keeps them
resident, except those in the pool's first :attr:`~SharedHostMemoryResource.keep_resident` bytes
(:data:`dask_gpupool.tuning.HOST_KEEP_RESIDENT`): first fit places the next buffers there, and a page given back costs
its next write a fault that allocates and zeroes it (ten times the copy itself, measured), while a kept page stays
mapped, without faults, in the owner and every peer that read it. :meth:`~SharedHostMemoryResource.trim` gives back
every free range, small and kept ones included. A page is removed only while no buffer uses it: before its range goes
back to the arena, or with allocation blocked; and never after :meth:`~SharedHostMemoryResource.keep_pages`, once the
pool is closed, or while the interpreter exits: then buffers a peer still maps are freed without their leases ending;
nor in a process forked from the owner (a task's ``multiprocessing`` child), whose copies of the owner's buffers and
arena are not the owner's: its frees and trims leave the memfd alone, and it cannot allocate. The pool's ``reserved``
bytes are the memfd's resident pages (``st_blocks``).

Trust boundary: the memfd is sealed once sized (``F_SEAL_SHRINK``, ``F_SEAL_GROW``, ``F_SEAL_SEAL``), so no process that
receives the fd can ``ftruncate`` it, which would make every mapper's reads past the new end SIGBUS. Peers can still
write the pool's bytes (they map it read-write, as CUDA IPC peers do). A mapped resource checks that every imported
range lies inside the mapping, so a malformed descriptor cannot reach memory outside the peer's pool; it cannot check
that the owner still considers the range live.

Each resource is noted in :mod:`dask_gpupool.memory.lifetime` while it is mapped (a peer's as mapped, the owner's with
its resident bytes), so that a worker does not count the owner's pages as its own.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import operator
import os
import sys
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from cuda.core import Buffer, MemoryResource

from dask_gpupool import tuning
from dask_gpupool.errors import PoolClosedError, PoolUnavailableError, ProtocolError
from dask_gpupool.memory import lifetime as peer_resident
from dask_gpupool.memory.arena import Arena

__all__ = ["HostOnlyResource", "HostPoolAttributes", "SharedHostMemoryResource"]

logger = logging.getLogger(__name__)

#: Freed buffers from this size up give their whole pages back at once (smaller ones at :meth:`trim`).
_GIVE_BACK_MIN = 64 << 10

#: Seals added to the pool's memfd once it is sized: its size is fixed for good.
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


@dataclass(frozen=True)
class HostPoolAttributes:
    """Statistics of a :class:`SharedHostMemoryResource`, named like cuda.core's.

    Attributes
    ----------
    used_mem_current, used_mem_high : int
        Bytes in live allocations, now and at most.
    reserved_mem_current, reserved_mem_high : int
        Bytes of the memfd resident in memory (its ``st_blocks``), now and
        at most as last read.
    """

    used_mem_current: int
    used_mem_high: int
    reserved_mem_current: int
    reserved_mem_high: int


class HostOnlyResource(MemoryResource):
    """Base of memory resources that hand out plain host memory (no GPU, no driver needed)."""

    @property
    def is_device_accessible(self) -> bool:
        return False

    @property
    def is_host_accessible(self) -> bool:
        return True

    @property
    def device_id(self) -> int:
        return -1


class SharedHostMemoryResource(HostOnlyResource):
    """A memfd-backed pool of host memory shareable with same-host processes.

    Parameters
    ----------
    max_size : int
        Size of the pool in bytes.
    keep_resident : int, optional
        Freed buffers keep their pages in the pool's first ``keep_resident`` bytes (at most ``max_size``); pages
        beyond go back to the OS at once. By default :data:`dask_gpupool.tuning.HOST_KEEP_RESIDENT`; 0: every freed
        page goes back.

    Notes
    -----
    The memfd is sealed against resizing (``F_SEAL_SHRINK | F_SEAL_GROW |
    F_SEAL_SEAL``) before it is mapped or shared: a peer that receives it
    cannot ``ftruncate`` it under other mappers.

    Ownership: the resource owns its memfd and its mapping. ``close()`` closes
    the fd at once and unmaps the memory when the last buffer of the pool is
    freed (closing never pulls memory out from under a live buffer). Buffers
    from :meth:`allocate` or :meth:`import_buffer` keep the resource alive.
    Only the process that made the pool allocates from it and gives its pages
    back: a forked child inherits a copy of the arena that the owner's
    allocations no longer follow.

    Thread-safe: ``_lock`` (re-entrant) orders allocation, frees, trims and
    close, so a close never unmaps the memory under an allocation under way;
    a buffer that the garbage collector frees inside one of these calls, on
    the thread holding the lock, is freed without waiting for it (the arena
    defers it to the end of its own call).
    """

    _fd: int
    _mmap: mmap.mmap | None
    _base: int
    _size: int
    _arena: Arena | None
    _uuid: uuid.UUID | None
    _mapped: bool
    _closed: bool
    _imports: int
    _reserved_high: int
    _keep_pages: bool
    _keep_below: int
    _pid: int
    _lock: threading.RLock

    def __init__(self, max_size: int, keep_resident: int | None = None) -> None:
        if max_size <= 0:
            raise ValueError(f"max_size must be positive, got {max_size}")
        keep = tuning.HOST_KEEP_RESIDENT if keep_resident is None else operator.index(keep_resident)
        if keep < 0:
            raise ValueError(f"keep_resident must not be negative, got {keep}")
        fd = os.memfd_create("dask-gpupool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, max_size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            self._init_mapping(fd, max_size, mapped=False)
        except BaseException:
            os.close(fd)
            raise
        self._arena = Arena(max_size)
        self._uuid = uuid.uuid4()
        self._keep_below = min(keep, max_size)

    def _init_mapping(self, fd: int, size: int, *, mapped: bool) -> None:
        self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        view = ctypes.c_char.from_buffer(self._mmap)
        self._base = ctypes.addressof(view)
        del view  # release the export, or the mmap could never be closed
        self._fd = fd
        self._size = size
        self._mapped = mapped
        self._closed = False
        self._imports = 0
        self._reserved_high = 0
        self._keep_pages = False
        self._keep_below = 0
        self._pid = os.getpid()  # the owner's process: a forked child's copy neither allocates nor gives back pages
        self._lock = threading.RLock()
        if mapped:
            peer_resident.mapped(self._base, size)
        else:
            peer_resident.owned(self._base, self._resident)

    @classmethod
    def from_allocation_handle(cls, alloc_handle: int) -> SharedHostMemoryResource:
        """Map a peer's pool from its memfd.

        Parameters
        ----------
        alloc_handle : int
            The peer pool's file descriptor, as received from its broker. The
            caller keeps ownership and closes it; the mapping does not need it.

        Returns
        -------
        SharedHostMemoryResource
            A mapped resource: it imports buffers and cannot allocate.

        Raises
        ------
        ProtocolError
            If the fd is not a pool this process can map for reading and
            writing (empty, or sealed against writes).
        """
        size = os.fstat(alloc_handle).st_size
        if size <= 0:
            raise ProtocolError(f"fd {alloc_handle} is not a shared memory pool (size {size})")
        self = cls.__new__(cls)
        fd = os.dup(alloc_handle)
        try:
            self._init_mapping(fd, size, mapped=True)
        except (OSError, ValueError) as e:  # e.g. a memfd sealed against writes
            raise ProtocolError(f"fd {alloc_handle} cannot be mapped as a shared memory pool: {e}") from e
        finally:
            os.close(fd)  # the mapping stays valid without it
        self._fd = -1
        self._arena = None
        self._uuid = None
        return self

    # -- the cuda.core MemoryResource interface --------------------------------

    def allocate(self, size: int, *, stream: Any = None) -> Buffer:
        """Carve a buffer of ``size`` bytes out of the pool (no stream needed).

        Raises
        ------
        PoolClosedError
            After :meth:`close`.
        PoolUnavailableError
            In a process forked from the pool's owner.
        PoolExhaustedError
            When the pool has no free range that large.
        TypeError, ValueError
            If ``size`` is not an integer, or negative.
        """
        size = operator.index(size)
        with self._lock:  # close waits: it must not unmap the memory between the check and the buffer
            if self._closed:
                raise PoolClosedError("host pool is closed")
            if self._arena is None:
                raise TypeError("a mapped host pool cannot allocate; import buffers instead")
            if os.getpid() != self._pid:
                raise PoolUnavailableError(
                    f"this host pool belongs to process {self._pid}: a process forked from it cannot allocate"
                )
            offset = self._arena.allocate(size)
            try:
                return Buffer.from_handle(self._base + offset, size, mr=self)
            except BaseException:
                self._arena.free(offset)
                raise

    def deallocate(self, ptr: Any, size: int, *, stream: Any = None) -> None:
        """Return a buffer's range to the pool (called by ``Buffer.close``), its whole pages to the OS."""
        offset = int(ptr) - self._base
        with self._lock:
            if self._arena is not None:
                held = self._arena.size_of(offset)
                # Not once the pool is closed or the interpreter exits: buffers a peer still maps (leases
                # kept until exit) are freed then, and a hole punched under the peer would read as zeros.
                # Nor in a forked child: its buffers are copies, the memfd's pages the owner's.
                keep = self._closed or self._keep_pages or sys.is_finalizing() or os.getpid() != self._pid
                if held is not None and held >= _GIVE_BACK_MIN and not keep:
                    # still this buffer's: no one else in this pool uses it; pages in the kept range stay resident
                    start = max(offset, self._keep_below)
                    if start < offset + held:
                        self._give_back(start, offset + held - start)
                self._arena.free(offset)
                last = self._arena.live == 0
            else:
                self._imports -= 1
                last = self._imports == 0
            if self._closed and last:
                self._release()

    # -- pool interface shared with cuda.core's IPC pools ------------------------

    @property
    def allocation_handle(self) -> int:
        """The memfd of this pool; owned by the resource, closed by :meth:`close`."""
        if self._mapped:
            raise TypeError("a mapped host pool has no allocation handle")
        if self._closed:
            raise PoolClosedError("host pool is closed")
        return self._fd

    @property
    def uuid(self) -> uuid.UUID | None:
        return self._uuid

    @property
    def is_mapped(self) -> bool:
        return self._mapped

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def size(self) -> int:
        """Bytes of the whole pool (its ``max_size``)."""
        return self._size

    @property
    def keep_resident(self) -> int:
        """Bytes at the start of the pool whose pages freed buffers keep (resident until :meth:`trim`); 0 on a
        mapped resource."""
        return self._keep_below

    def in_kept_range(self, buf: Buffer) -> bool:
        """Whether all of ``buf`` lies in the pool's first :attr:`keep_resident` bytes (its pages stay resident
        when it is freed, so the next buffer there is written without page faults)."""
        return self.offset_of(buf) + buf.size <= self._keep_below

    def keep_pages(self) -> None:
        """From now on freed buffers keep their pages: the caller frees buffers that peers may still map.

        The pool service calls this before it drops the leases still open at
        teardown (the peers' mappings keep the memfd's pages; a hole punched
        under them would read as zeros).
        """
        with self._lock:
            self._keep_pages = True

    def trim(self) -> int:
        """Give every free page of the pool back to the OS (the kept range's too); return the pool's resident bytes
        after.

        Allocation waits meanwhile. Only the owner trims (a mapped resource, and
        a process forked from the owner, return 0).
        """
        with self._lock:
            if self._arena is None or self._closed or os.getpid() != self._pid:
                return 0
            self._arena.each_free(self._give_back)
        return self.attributes.reserved_mem_current

    def _give_back(self, offset: int, size: int) -> None:
        """Remove the whole pages inside ``[offset, offset + size)`` from the memfd (they read as zeros after)."""
        page = mmap.PAGESIZE
        start = -(-offset // page) * page
        end = (offset + size) // page * page
        if end > start and self._mmap is not None:
            self._mmap.madvise(mmap.MADV_REMOVE, start, end - start)

    def _resident(self) -> int:
        """Bytes of the memfd backed by memory now (0 once its fd is closed).

        Under the lock: a close on another thread must not close the fd (and
        its number be reused) between the check and the ``fstat``.
        """
        with self._lock:
            if self._fd < 0:
                return 0
            resident = os.fstat(self._fd).st_blocks * 512
            self._reserved_high = max(self._reserved_high, resident)
            return resident

    @property
    def attributes(self) -> HostPoolAttributes:
        a = self._arena
        if a is None:
            return HostPoolAttributes(0, 0, 0, 0)
        resident = self._resident()
        return HostPoolAttributes(a.used, a.used_high, resident, self._reserved_high)

    def offset_of(self, buf: Buffer) -> int:
        """Offset of ``buf`` inside this pool."""
        offset = int(buf.handle) - self._base
        if not 0 <= offset <= self._size - buf.size:
            raise ValueError(f"{buf!r} does not lie in this host pool")
        return offset

    def import_buffer(self, offset: int, size: int) -> Buffer:
        """Map ``size`` bytes at ``offset`` of a peer's pool as a Buffer (no copy).

        Raises
        ------
        ProtocolError
            If the range does not lie inside the pool.
        PoolClosedError
            After :meth:`close`.
        """
        if not self._mapped:
            raise TypeError("import_buffer needs a mapped pool (from_allocation_handle)")
        if isinstance(offset, bool) or not isinstance(offset, int) or not isinstance(size, int):
            raise ProtocolError("offset and size must be integers")
        if offset < 0 or size < 0 or offset + size > self._size:
            raise ProtocolError(f"range [{offset}, {offset}+{size}) lies outside the pool of {self._size} bytes")
        with self._lock:
            if self._closed:
                raise PoolClosedError("mapped host pool is closed")
            self._imports += 1
        return Buffer.from_handle(self._base + offset, size, mr=self)

    def memoryview(self, buf: Buffer) -> memoryview:
        """A writable memoryview of ``buf``'s bytes (no copy); keep ``buf`` alive while using it."""
        if self._mmap is None:
            raise PoolClosedError("host pool memory is unmapped")
        offset = int(buf.handle) - self._base
        return memoryview(self._mmap)[offset : offset + buf.size]

    def close(self) -> None:
        """Close the pool: no new buffers; memory goes when the last buffer does. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            live = self._arena.live if self._arena is not None else self._imports
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            if live == 0:
                self._release()

    def _release(self) -> None:
        mm, self._mmap = self._mmap, None
        if mm is not None and self._mapped:
            peer_resident.unmapped(self._base)
        elif mm is not None:
            peer_resident.disowned(self._base)
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a memoryview still exports it; unmapped when that goes
                logger.debug("host pool %s: mapping still exported, left to the garbage collector", self._uuid)

    def __repr__(self) -> str:
        role = "mapped" if self._mapped else "owner"
        return f"<SharedHostMemoryResource {role} uuid={self._uuid} size={self._size} closed={self._closed}>"
