"""A worker's own pool: one IPC-enabled memory resource of one of three kinds.

- ``device``: a :class:`~dask_gpupool.memory.segments.SegmentedResource`
  that places buffers in segments of VMM or legacy IPC memory; a buffer is
  its segment and an offset (made by :mod:`dask_gpupool.memory.device_pool`,
  loaded only for this kind).
- ``pinned``: cuda.core ``PinnedMemoryResource(ipc_enabled=True)``: the CUDA
  pool's fd, and a 64-byte pointer export per buffer.
- ``host``: :class:`~dask_gpupool.memory.host.SharedHostMemoryResource`: a
  memfd, and an offset per buffer.

The :class:`Pool` owns its resource and the resource owns its allocation
handle (the fd the broker hands to peers); :meth:`Pool.close` closes both.
Peers' pools are mapped by :mod:`dask_gpupool.handoff.links`, never here.
"""

from __future__ import annotations

import gc
import logging
import operator
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dask_gpupool.config import PoolOptions
from dask_gpupool.errors import ConfigError, PoolClosedError, PoolExhaustedError, UnknownPoolError
from dask_gpupool.memory.host import SharedHostMemoryResource
from dask_gpupool.memory.topology import LocalDevices, current_gpu, host_memory
from dask_gpupool.wire.handoff import BufferDescriptor

if TYPE_CHECKING:
    from cuda.core import Buffer

    from dask_gpupool.memory.segments import SegmentedResource

__all__ = ["Pool", "PoolStats", "ipc_payload"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolStats:
    """Byte counts of a pool, read from the pool's own attributes.

    Attributes
    ----------
    used, used_high : int
        Bytes in live allocations, now and at most.
    reserved, reserved_high : int
        Bytes of memory backing the pool, now and at most.
    max_size : int
        The pool's upper bound.
    """

    used: int
    used_high: int
    reserved: int
    reserved_high: int
    max_size: int

    def to_msg(self) -> dict[str, int]:
        return {
            "used": self.used,
            "used_high": self.used_high,
            "reserved": self.reserved,
            "reserved_high": self.reserved_high,
            "max_size": self.max_size,
        }


def ipc_payload(buf: Buffer) -> bytes:
    """The 64 bytes of ``cuMemPoolExportPointer`` data that identify ``buf`` in its pool.

    cuda.core exposes them only through the descriptor's pickle protocol
    (``__reduce__`` returns ``(constructor, (payload, size))``); this is the
    one place that relies on it.
    """
    _, (payload, _size) = buf.ipc_descriptor.__reduce__()
    return bytes(payload)


class Pool:
    """The IPC-enabled pool a worker allocates from and shares.

    Build with :meth:`create`. Allocation is thread-safe (task threads call
    :meth:`allocate`); :meth:`close` runs once, on teardown.

    Attributes
    ----------
    kind : str
        ``"device"``, ``"pinned"`` or ``"host"``.
    uuid : str
        The pool's UUID: its key in the scheduler's registry.
    max_size : int
        Upper bound in bytes.
    device : int or None
        Ordinal (in this process) of the GPU that holds or made the pool.
    device_uuid : str or None
        UUID of that GPU.
    peers : tuple of str
        UUIDs of the other GPUs this process granted access to a ``device``
        pool (see :func:`~dask_gpupool.memory.device_pool.grant_peers`); only workers on these GPUs (or on the
        pool's own) are handed its buffers zero-copy.
    resource : cuda.core.MemoryResource
        The memory resource; owned by the pool.
    segmented : SegmentedResource or None
        ``resource`` when it places buffers in segments (a ``device`` pool),
        with their retire ledger; else ``None``.
    shared_host : SharedHostMemoryResource or None
        ``resource`` when it is a ``host`` pool's memfd; else ``None``.
    """

    kind: str
    uuid: str
    max_size: int
    device: int | None
    device_uuid: str | None
    peers: tuple[str, ...]
    #: What a ``device`` pool's segments are made of: ``"vmm"`` or ``"legacy"`` (``cuMemAlloc``, shared by IPC
    #: handle); ``"pool"`` for ``pinned`` and ``host`` pools, whose buffers peers map without segments. Peers learn
    #: it from the registry row.
    segment_memory: str
    resource: Any
    segmented: SegmentedResource | None
    shared_host: SharedHostMemoryResource | None
    _closed: bool
    _lock: threading.Lock

    def __init__(
        self,
        kind: str,
        resource: Any,
        max_size: int,
        device: int | None,
        device_uuid: str | None,
        peers: tuple[str, ...] = (),
        segment_memory: str = "pool",
    ):
        self.kind = kind
        self.segment_memory = segment_memory
        self.resource = resource
        self.segmented = resource if segment_memory != "pool" else None
        self.shared_host = resource if isinstance(resource, SharedHostMemoryResource) else None
        self.max_size = max_size
        self.device = device
        self.device_uuid = device_uuid
        self.peers = peers
        self.allocation_handle()  # exporting the handle is what gives a CUDA pool its UUID
        self.uuid = str(resource.uuid)
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def create(cls, options: PoolOptions, devices: LocalDevices, *, prefer_legacy: bool = False) -> Pool:
        """Make the pool ``options`` describe, on this process's devices.

        ``prefer_legacy``: ``segment-memory: auto`` makes segments of legacy IPC
        memory where the GPU allows (the worker listens over UCX, which sends
        them GPU to GPU with no staging copy; :func:`~dask_gpupool.memory.device_pool.segment_memory_of`).

        Raises
        ------
        ConfigError
            For a kind this host cannot provide (a ``device`` pool on a GPU
            that can make neither VMM nor legacy IPC segments:
            :func:`~dask_gpupool.memory.device_pool.segment_memory_of`), a
            device it does not see, or a ``max_size`` larger than the memory
            behind the pool.
        """
        kind = options.kind
        if kind == "auto":
            kind = "device" if devices else "host"
        if kind == "host":
            size = options.max_size.resolve(host_memory(), "host memory")
            return cls("host", SharedHostMemoryResource(size), size, None, None)
        if not devices:
            raise ConfigError(
                f"gpupool.kind={kind!r} needs a CUDA device and this process sees none; valid here: 'host' (or 'auto')"
            )
        ordinal = devices.resolve(options.device)
        dev = current_gpu(ordinal)
        if kind == "device":
            from dask_gpupool.memory.device_pool import device_resource

            segmented, size, made_of, peers = device_resource(options, devices, ordinal, dev, prefer_legacy)
            return cls(kind, segmented, size, ordinal, devices.uuids[ordinal], peers, segment_memory=made_of)
        else:
            if not dev.properties.host_numa_memory_pools_supported:
                raise ConfigError(
                    f"gpupool.kind='pinned': GPU {ordinal} does not support IPC host memory pools; "
                    "valid here: 'device' or 'host'"
                )
            size = options.max_size.resolve(host_memory(), "host memory")
            from cuda.core import PinnedMemoryResource, PinnedMemoryResourceOptions

            resource = PinnedMemoryResource(PinnedMemoryResourceOptions(ipc_enabled=True, max_size=size))
        try:
            return cls(kind, resource, size, ordinal, devices.uuids[ordinal])
        except BaseException:
            resource.close()
            raise

    def segment_fd(self, segment: int) -> tuple[int, int]:
        """A new fd of one of this pool's VMM segments and its size; the **caller closes the fd**.

        Raises
        ------
        UnknownPoolError
            If the pool has no such segment (or no segments exported by fd).
        """
        if self._closed:
            raise PoolClosedError(f"pool {self.uuid} is closed")
        segmented = self.segmented
        if segmented is None:
            raise UnknownPoolError(f"pool {self.uuid} has no segments")
        fd, size = segmented.segment_fd(segment)
        return int(fd), int(size)

    def forget_claims(self, segments: list[int], importer: str) -> None:
        """Take back retire-ledger claims of ``importer`` on ``segments`` (one per lease; 0 entries are skipped):
        leases noted for it that it never mapped. Makes the pool's GPU current first in the calling thread, since
        that may free a retired segment. Nothing for pools without segments."""
        segments = [s for s in segments if s]
        segmented = self.segmented
        if not segments or segmented is None:
            return
        if self.device is not None:
            current_gpu(self.device)
        segmented.forget_claims(segments, importer)

    def allocation_handle(self) -> int:
        """The pool's shareable fd. Owned by the pool: callers must not close it."""
        if getattr(self, "_closed", False):
            raise PoolClosedError(f"pool {self.uuid} is closed")
        return int(self.resource.allocation_handle)

    def allocate(self, nbytes: int, stream: Any = None, *, wait: bool = False) -> Buffer:
        """A buffer of ``nbytes`` from this pool, owned by the caller.

        CUDA kinds allocate stream-ordered on ``stream``, by default the
        device's default stream (which orders the memory with all blocking
        streams, CuPy's included). The buffer goes back to the pool when it is
        closed or garbage-collected.

        ``wait`` (a task's own allocation): a full pool may wait for peers to
        release large buffers' spares it reclaims (up to the timeout its
        owner set: :meth:`Reclaim.through <dask_gpupool.memory.reclaim.Reclaim.through>`),
        then collects garbage once (``gc.collect()``, in the caller's thread)
        and tries once more: buffers that only reference cycles hold go back
        to the pool first, such as those of a task that failed (distributed
        keeps its frames in a cycle: docs/operations.rst). Without ``wait`` it
        fails at once and the caller takes its fallback.

        Raises
        ------
        PoolExhaustedError
            When the pool cannot hold ``nbytes`` more.
        PoolClosedError
            After :meth:`close`.
        TypeError, ValueError
            If ``nbytes`` is not an integer (NumPy integers are), or negative.
        """
        if not wait:
            return self._allocate(nbytes, stream, False)
        try:
            return self._allocate(nbytes, stream, True)
        except PoolExhaustedError:
            used = self.stats().used
        # 0: nothing unreachable, or a collection already runs in another thread (the retry raises as before)
        if gc.collect():
            logger.debug("pool %s: full; a garbage collection gave %d bytes back", self.uuid, used - self.stats().used)
        return self._allocate(nbytes, stream, False)  # without a second wait for reclaimed spares

    def _allocate(self, nbytes: int, stream: Any, wait: bool) -> Buffer:
        """:meth:`allocate` once; ``wait``: a full segmented pool waits for the spares it reclaims."""
        nbytes = operator.index(nbytes)  # a Python int: NumPy's int64 wraps around when rounded up near 2**63
        if nbytes < 0:
            raise ValueError(f"pool {self.uuid} ({self.kind}): cannot allocate {nbytes} bytes")
        if self._closed:
            raise PoolClosedError(f"pool {self.uuid} is closed")
        try:
            if self.kind == "host":
                return self.resource.allocate(nbytes)
            dev = current_gpu(self.device)
            stream = stream if stream is not None else dev.default_stream
            if self.segmented is not None:
                return self.segmented.allocate(nbytes, stream=stream, wait=wait)
            return self.resource.allocate(nbytes, stream=stream)
        except PoolExhaustedError as e:  # the host arena's or the segments': name the pool
            raise PoolExhaustedError(f"pool {self.uuid} ({self.kind}) {e}") from None
        except Exception as e:
            if "OUT_OF_MEMORY" in str(e):
                stats = self.stats()
                raise PoolExhaustedError(
                    f"pool {self.uuid} ({self.kind}) cannot allocate {nbytes} bytes: "
                    f"{stats.used} of {self.max_size} bytes in use"
                ) from e
            raise

    def owns(self, buf: Buffer) -> bool:
        """Whether ``buf`` was allocated from this pool."""
        return buf.memory_resource is self.resource

    def export(self, buf: Buffer) -> BufferDescriptor:
        """Describe ``buf`` so that a peer that mapped this pool can map it.

        The descriptor does not keep ``buf`` alive: the caller must (leases do).
        """
        if not self.owns(buf):
            raise ValueError(f"{buf!r} does not belong to pool {self.uuid}")
        if self.kind == "host":
            return BufferDescriptor(self.uuid, buf.size, b"", self.resource.offset_of(buf))
        segmented = self.segmented
        if segmented is not None:  # the segment and the offset inside it
            segment, offset = segmented.locate(int(buf.handle))
            return BufferDescriptor(self.uuid, buf.size, segment.payload, offset, segment.size, segment.id)
        return BufferDescriptor(self.uuid, buf.size, ipc_payload(buf), 0)

    def stats(self) -> PoolStats:
        """Used and reserved bytes, now and at most, from the pool's attributes."""
        a = self.resource.attributes
        return PoolStats(
            int(a.used_mem_current),
            int(a.used_mem_high),
            int(a.reserved_mem_current),
            int(a.reserved_mem_high),
            self.max_size,
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the resource (and with it the shareable fd). Idempotent.

        Buffers still alive keep their memory until they are freed (cuda.core
        defers destroying the pool; the host pool defers unmapping).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        logger.debug("pool %s (%s): closing", self.uuid, self.kind)
        self.resource.close()

    def __repr__(self) -> str:
        return f"<Pool {self.kind} {self.uuid} max_size={self.max_size} device={self.device_uuid}>"
