"""A worker's own pool: one IPC-enabled memory resource of one of three kinds.

- ``device``: a :class:`SegmentedResource` that places buffers in segments of
  :class:`~dask_gpupool.memory.vmm.VmmMemoryResource` (one fd per segment) or
  :class:`~dask_gpupool.memory.legacy.LegacyMemoryResource` (one IPC handle per
  segment) memory; a buffer is its segment and an offset. The IPC-enabled
  cuda.core ``DeviceMemoryResource`` under it names the pool (UUID, the fd
  peers open first).
- ``pinned``: cuda.core ``PinnedMemoryResource(ipc_enabled=True)``: the CUDA
  pool's fd, and a 64-byte pointer export per buffer.
- ``host``: :class:`~dask_gpupool.memory.host.SharedHostMemoryResource`: a
  memfd, and an offset per buffer.

The :class:`Pool` owns its resource and the resource owns its allocation
handle (the fd the broker hands to peers); :meth:`Pool.close` closes both.
Peers' pools are mapped by :mod:`dask_gpupool.handoff.mappings`, never here.
"""

from __future__ import annotations

import logging
import operator
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dask_gpupool.config import PoolOptions
from dask_gpupool.errors import ConfigError, PoolClosedError, PoolExhaustedError, UnknownPoolError
from dask_gpupool.memory.host import SharedHostMemoryResource
from dask_gpupool.memory.segments import SEGMENT_SIZE, SegmentedResource
from dask_gpupool.memory.topology import LocalDevices, current_gpu, device_memory, host_memory
from dask_gpupool.wire.handoff import BufferDescriptor

if TYPE_CHECKING:
    from cuda.core import Buffer

__all__ = ["Pool", "PoolStats", "grant_peers", "ipc_payload", "segment_memory_of"]

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


def _no_payload(buf: Buffer) -> bytes:
    """VMM segments carry no payload: peers fetch the segment's fd by id."""
    return b""


def _segment_payload(made_of: str) -> Any:
    """How a segment made of ``made_of`` (:func:`_segment_memory`'s) is named to peers in descriptors."""
    if made_of == "legacy":
        from dask_gpupool.memory.legacy import legacy_payload

        return legacy_payload
    return _no_payload


#: What each segment memory needs of the GPU, for the errors of :func:`_segment_memory`.
_NEEDS = {"vmm": "export virtual memory as POSIX fds", "legacy": "share memory by IPC handles"}


def _supported(made_of: str, ordinal: int) -> bool:
    """Whether GPU ``ordinal`` can make segments of ``made_of`` (``"vmm"`` or ``"legacy"``) memory."""
    if made_of == "legacy":
        from dask_gpupool.memory.legacy import legacy_supported

        return legacy_supported(ordinal)
    from dask_gpupool.memory.vmm import vmm_supported

    return vmm_supported(ordinal)


def segment_memory_of(
    options: PoolOptions, ordinal: int, supported: Callable[[str], bool], prefer_legacy: bool = False
) -> str:
    """What a ``device`` pool's segments on GPU ``ordinal`` are made of: ``"vmm"`` or ``"legacy"``.

    ``supported(made_of)`` says whether the GPU can make segments of that memory (:func:`_supported`; asked only
    as far as needed). ``segment-memory: auto`` is ``legacy`` when ``prefer_legacy`` (a worker that listens over
    UCX, which sends legacy IPC memory GPU to GPU as it is) and the GPU shares memory by IPC handles, else ``vmm``
    when it exports virtual memory as POSIX fds, else ``legacy``.

    Raises
    ------
    ConfigError
        For ``segment-memory: vmm`` on a GPU without VMM fd export, or ``legacy`` on one without IPC handles; and for
        any value on a GPU with neither, whose memory no other process can map: there the worker takes a ``pinned``
        or ``host`` pool (``gpupool.kind``), whose buffers other processes map without segments.
    """
    wanted = options.segment_memory
    if wanted == "auto":
        order = ("legacy", "vmm") if prefer_legacy else ("vmm", "legacy")
    else:
        order = (wanted, "legacy" if wanted == "vmm" else "vmm")
    made_of = next((m for m in order if supported(m)), None)
    if made_of is None:
        raise ConfigError(
            f"gpupool.kind={options.kind!r}: GPU {ordinal} can neither {_NEEDS['vmm']} nor {_NEEDS['legacy']}, "
            "so no other process can map a device pool's memory; valid here: gpupool.kind 'pinned' or 'host'"
        )
    if wanted not in ("auto", made_of):
        raise ConfigError(
            f"gpupool.segment-memory={wanted!r}: GPU {ordinal} cannot {_NEEDS[wanted]}; "
            f"valid here: {made_of!r} (or 'auto')"
        )
    return made_of


def _segment_memory(options: PoolOptions, ordinal: int, size: int, prefer_legacy: bool = False) -> tuple[str, Any]:
    """What a ``device`` pool's segments are made of (:func:`segment_memory_of`) and the resource they come from:
    a :class:`~dask_gpupool.memory.vmm.VmmMemoryResource` or a
    :class:`~dask_gpupool.memory.legacy.LegacyMemoryResource` of ``size`` bytes, owned by the caller.

    Raises
    ------
    ConfigError
        As :func:`segment_memory_of`.
    """
    made_of = segment_memory_of(options, ordinal, lambda m: _supported(m, ordinal), prefer_legacy)
    if made_of == "legacy":
        from dask_gpupool.memory.legacy import LegacyMemoryResource

        return made_of, LegacyMemoryResource(ordinal, size)
    from dask_gpupool.memory.vmm import VmmMemoryResource

    return made_of, VmmMemoryResource(ordinal, size)


def ipc_payload(buf: Buffer) -> bytes:
    """The 64 bytes of ``cuMemPoolExportPointer`` data that identify ``buf`` in its pool.

    cuda.core exposes them only through the descriptor's pickle protocol
    (``__reduce__`` returns ``(constructor, (payload, size))``); this is the
    one place that relies on it.
    """
    _, (payload, _size) = buf.ipc_descriptor.__reduce__()
    return bytes(payload)


def grant_peers(resource: Any, ordinal: int, devices: LocalDevices) -> tuple[str, ...]:
    """Grant every other visible GPU with peer access to GPU ``ordinal`` access to ``resource``.

    Done in the owner's process, before any import: on two H200s (driver 580)
    a peer that mapped this pool's buffers across GPUs while it was still
    growing, and had been granted access only in its own process, lost its
    CUDA context (``CUDA_ERROR_LAUNCH_FAILED`` during an import); with access
    granted here first, the same handoffs read the right bytes
    (``scripts/probes/two_gpu_handoff.py``, ``docs/gpu-checks.md``).

    Returns the UUIDs of the GPUs granted access. A GPU that cannot reach
    ``ordinal`` (no peer access) is left out; so is every GPU when granting
    fails, which is logged: buffers then go to those GPUs as copies.
    """
    from cuda.core import Device

    others = [i for i in range(len(devices.uuids)) if i != ordinal and Device(i).can_access_peer(ordinal)]
    if not others:
        return ()
    try:
        resource.peer_accessible_by = set(others)
    except Exception as e:
        logger.warning("GPU %d: granting GPUs %s access to the pool failed (%s); they get copies", ordinal, others, e)
        return ()
    return tuple(devices.uuids[i] for i in others)


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
        pool (see :func:`grant_peers`); only workers on these GPUs (or on the
        pool's own) are handed its buffers zero-copy.
    resource : cuda.core.MemoryResource
        The memory resource; owned by the pool.
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
        them GPU to GPU with no staging copy; :func:`segment_memory_of`).

        Raises
        ------
        ConfigError
            For a kind this host cannot provide (a ``device`` pool on a GPU
            that can make neither VMM nor legacy IPC segments:
            :func:`segment_memory_of`), a device it does not see, or a
            ``max_size`` larger than the memory behind the pool.
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
            if not dev.properties.memory_pools_supported:
                raise ConfigError(f"gpupool.kind='device': GPU {ordinal} does not support memory pools")
            size = options.max_size.resolve(device_memory(ordinal), f"GPU {ordinal} ({devices.uuids[ordinal]})")
            from cuda.core import DeviceMemoryResource, DeviceMemoryResourceOptions

            resource = DeviceMemoryResource(dev, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=size))
            try:
                made_of, memory = _segment_memory(options, ordinal, size, prefer_legacy)
                peers = grant_peers(resource, ordinal, devices)
            except BaseException:
                resource.close()
                raise
            resource = SegmentedResource(resource, min(SEGMENT_SIZE, size), ordinal, _segment_payload(made_of), memory)
            return cls(kind, resource, size, ordinal, devices.uuids[ordinal], peers, segment_memory=made_of)
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

    @property
    def segmented(self) -> SegmentedResource | None:
        """The pool's :class:`SegmentedResource` (buffers in segments, and their retire ledger), if any."""
        return self.resource if isinstance(self.resource, SegmentedResource) else None

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

    @property
    def shared_host(self) -> SharedHostMemoryResource | None:
        """The ``host`` pool's memfd resource, if this is one."""
        return self.resource if isinstance(self.resource, SharedHostMemoryResource) else None

    def allocation_handle(self) -> int:
        """The pool's shareable fd. Owned by the pool: callers must not close it."""
        if getattr(self, "_closed", False):
            raise PoolClosedError(f"pool {self.uuid} is closed")
        return int(self.resource.allocation_handle)

    def allocate(self, nbytes: int, stream: Any = None) -> Buffer:
        """A buffer of ``nbytes`` from this pool, owned by the caller.

        CUDA kinds allocate stream-ordered on ``stream``, by default the
        device's default stream (which orders the memory with all blocking
        streams, CuPy's included). The buffer goes back to the pool when it is
        closed or garbage-collected.

        Raises
        ------
        PoolExhaustedError
            When the pool cannot hold ``nbytes`` more.
        PoolClosedError
            After :meth:`close`.
        TypeError, ValueError
            If ``nbytes`` is not an integer (NumPy integers are), or negative.
        """
        nbytes = operator.index(nbytes)  # a Python int: NumPy's int64 wraps around when rounded up near 2**63
        if nbytes < 0:
            raise ValueError(f"pool {self.uuid} ({self.kind}): cannot allocate {nbytes} bytes")
        if self._closed:
            raise PoolClosedError(f"pool {self.uuid} is closed")
        try:
            if self.kind == "host":
                return self.resource.allocate(nbytes)
            dev = current_gpu(self.device)
            return self.resource.allocate(nbytes, stream=stream if stream is not None else dev.default_stream)
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
