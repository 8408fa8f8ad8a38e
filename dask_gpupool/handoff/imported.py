"""The memory resource of a buffer imported from a peer (:class:`ImportedMemoryResource`).

The Buffer handed to Dask and user code is
``Buffer.from_handle(ptr, size, mr=ImportedMemoryResource(...))``: when it is
closed or garbage-collected, ``deallocate`` closes the underlying import
under the process's import lock and queues the lease release, which the
:class:`~dask_gpupool.handoff.releaser.Releaser` sends after the GPU finished
the work queued on the legacy default stream (so the exporter never reuses
memory a kernel here still reads).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cuda.core import MemoryResource

from dask_gpupool.handoff.mapped_pool import IMPORT_LOCK
from dask_gpupool.memory.topology import current_gpu, sleeping_event
from dask_gpupool.wire.handoff import BufferDescriptor

if TYPE_CHECKING:
    from cuda.core import Buffer

    from dask_gpupool.handoff.mapped_pool import MappedPool

__all__ = ["ImportedMemoryResource", "Origin"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Origin:
    """Where an imported buffer's memory lives: what passing it on needs.

    Attributes
    ----------
    exporter : str
        The worker whose pool holds the memory.
    desc : BufferDescriptor
        The descriptor this import was made from (pool, segment, offset, size).
    lease : int
        This worker's lease on it, held while the import is open.
    """

    exporter: str
    desc: BufferDescriptor
    lease: int


class ImportedMemoryResource(MemoryResource):
    """The memory resource of one buffer imported from a peer's pool.

    Parameters
    ----------
    raw : cuda.core.Buffer
        The import itself, shared with other users of the same allocation in
        this process (:meth:`MappedPool.acquire`); the last one closes it.
    key : object
        Its key for :meth:`MappedPool.unshare`.
    mapped : MappedPool
        The mapping ``raw`` came from (kept alive while the buffer lives).
    on_close : callable
        Called with the cuda.core Event to wait for (or ``None``) and the
        ``(id, claims)`` of a retiring segment unmapped with it (or ``None``)
        once the import is closed; queues the lease (and segment) release.
    origin : Origin, optional
        The exporter, descriptor and lease of the import (for passing the
        value on: :meth:`~dask_gpupool.handoff.forwarding.Forwarder.forward`).

    Notes
    -----
    The Buffer built over this resource is the only owner of ``raw``;
    closing it (or losing the last reference) runs :meth:`deallocate` once.
    """

    mapped: MappedPool
    origin: Origin | None
    _key: Any
    _open: bool
    _on_close: Callable[[Any, Any], None]
    _device_accessible: bool
    _host_accessible: bool
    _device_id: int

    def __init__(
        self,
        raw: Buffer,
        key: Any,
        mapped: MappedPool,
        on_close: Callable[[Any, Any], None],
        origin: Origin | None = None,
    ) -> None:
        self.mapped = mapped
        self.origin = origin
        self._key = key
        self._open = True
        self._on_close = on_close
        self._device_accessible = bool(raw.is_device_accessible)
        self._host_accessible = bool(raw.is_host_accessible)
        # The GPU that uses the import: this process's own GPU (granted access to the pool), not the
        # pool's resident GPU. Array libraries run on it; CuPy would otherwise enable context peer
        # access to the owner's GPU for every kernel, which breaks imports across GPUs (seen on two H200s;
        # docs/design.md, "Handoff", across GPUs).
        self._device_id = int(mapped.device) if mapped.device is not None else int(raw.device_id)

    def allocate(self, size: int, *, stream: Any = None) -> Buffer:
        raise TypeError("an imported buffer's resource cannot allocate")

    def deallocate(self, ptr: Any, size: int, *, stream: Any = None) -> None:
        if not self._open:
            return
        self._open = False
        event = segment = None
        try:
            with IMPORT_LOCK:
                raw, segment = self.mapped.unshare(self._key)
                if self.mapped.device is not None and self._device_accessible:
                    dev = current_gpu(self.mapped.device)
                    if raw is not None:
                        raw.close(dev.default_stream)
                    # Work queued here on blocking streams (CuPy's default) must finish before the
                    # exporter may reuse the memory: the releaser waits for this event.
                    event = sleeping_event(dev.default_stream)
                elif raw is not None:
                    raw.close()
        except Exception:
            logger.exception("closing an import from pool %s failed", self.mapped.record.pool)
        finally:
            self._on_close(event, segment)

    @property
    def is_device_accessible(self) -> bool:
        return self._device_accessible

    @property
    def is_host_accessible(self) -> bool:
        return self._host_accessible

    @property
    def device_id(self) -> int:
        return self._device_id
