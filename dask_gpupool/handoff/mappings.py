"""The importer's side: peers' pools mapped into this process, once each (:class:`MappedPools`).

A peer's pool is mapped at most once per process and kept by a strong
reference in :class:`MappedPools`, keyed by pool UUID. Both rules come from
measurements on the project's H200s (the team's GPU notes, outside this
repository): importing the same CUDA pool twice returns
the same driver pool but each wrapper destroys it on close, and cuda.core's
own registry holds only weak references. One mapping is a
:class:`~dask_gpupool.handoff.mapped_pool.MappedPool`; every CUDA import and
every close of an imported object runs under
:data:`~dask_gpupool.handoff.mapped_pool.IMPORT_LOCK`.

A peer's *pinned* pool is imported at most once per process, ever: on the
H100 and H200 machines (driver 580, cuda-core 1.2.2) a pinned pool imported,
closed and imported again in the same process hands out buffers whose first
read kills the process (SIGSEGV on the CPU, and from the GPU), while the
first import reads fine (``scripts/probes/pinned_workers.py``). So
:meth:`MappedPools.unmap` parks a pinned mapping instead of closing it, and
the next :meth:`MappedPools.map` of that pool takes it back;
:meth:`MappedPools.close_all` closes parked mappings with the rest.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from dask_gpupool.errors import PoolClosedError, UnknownPoolError
from dask_gpupool.handoff.mapped_pool import IMPORT_LOCK, MappedPool
from dask_gpupool.memory.topology import LocalDevices
from dask_gpupool.wire.registry import PoolRecord

# IMPORT_LOCK and MappedPool are defined in handoff/mapped_pool.py and stay importable from here.
__all__ = ["IMPORT_LOCK", "MappedPool", "MappedPools"]

logger = logging.getLogger(__name__)


class MappedPools:
    """The cache of mapped peer pools of one process: at most one per UUID.

    Parameters
    ----------
    devices : LocalDevices
        The GPUs this process sees.
    own_device : int or None
        This process's GPU (granted access to mapped pools).
    """

    devices: LocalDevices
    own_device: int | None
    _pools: dict[str, MappedPool]
    _parked: dict[str, MappedPool]
    _closed: bool

    #: Kinds whose mapping is parked rather than closed by :meth:`unmap` (see the module notes).
    NEVER_REIMPORT = frozenset({"pinned"})

    def __init__(self, devices: LocalDevices, own_device: int | None) -> None:
        self.devices = devices
        self.own_device = own_device
        self._pools = {}
        self._parked = {}
        self._closed = False

    def get(self, pool: str) -> MappedPool | None:
        """The mapping of ``pool`` if it is mapped already."""
        return self._pools.get(pool)

    def map(self, record: PoolRecord, fetch_fd: Callable[[], int]) -> MappedPool:
        """Return the mapping of ``record``'s pool, mapping it on first use.

        Parameters
        ----------
        record : PoolRecord
            The pool to map.
        fetch_fd : callable
            Returns the pool's fd, owned by the caller of ``fetch_fd``; called
            only when the pool is not mapped yet, outside the import lock
            (it talks to the peer). This method closes the fd it receives.

        Raises
        ------
        PoolClosedError
            After :meth:`close_all`.
        """
        mapped = self._pools.get(record.pool)
        if mapped is not None:
            return mapped
        if self._closed:
            raise PoolClosedError("the mapped-pool cache is closed")
        with IMPORT_LOCK:
            parked = self._parked.pop(record.pool, None)
            if parked is not None:
                self._pools[record.pool] = parked
                return parked
        fd = fetch_fd()
        try:
            with IMPORT_LOCK:
                if self._closed:  # closed while the fd was fetched: a mapping made now would never be closed
                    raise PoolClosedError("the mapped-pool cache is closed")
                mapped = self._pools.get(record.pool)
                if mapped is None:
                    mapped = MappedPool.open(record, fd, self.devices, self.own_device)
                    self._pools[record.pool] = mapped
                    logger.info(
                        "pool %s: mapped %s pool of %s (pid %d)", record.pool, record.kind, record.worker, record.pid
                    )
        finally:
            os.close(fd)
        return mapped

    def unmap(self, pool: str) -> None:
        """Close and forget the mapping of ``pool`` (its imported buffers must be released).

        A pinned pool's mapping is parked instead (kept open, not counted) and
        reused by the next :meth:`map` of that pool: it must not be imported
        twice in one process.
        """
        with IMPORT_LOCK:
            mapped = self._pools.pop(pool, None)
            if mapped is not None and mapped.record.kind in self.NEVER_REIMPORT:
                self._parked[pool] = mapped
                return
        if mapped is None:
            raise UnknownPoolError(f"pool {pool} is not mapped here")
        mapped.close()

    def forget(self, pool: str) -> None:
        """Close the mapping of a pool whose owner has left, parked or not. No error if unknown.

        The owner's pool UUID is never seen again, so closing cannot lead to a re-import.
        """
        with IMPORT_LOCK:
            mapped = self._pools.pop(pool, None) or self._parked.pop(pool, None)
        if mapped is not None:
            mapped.close()

    @property
    def parked(self) -> int:
        """How many pinned mappings :meth:`unmap` parked."""
        return len(self._parked)

    def __len__(self) -> int:
        return len(self._pools)

    def __contains__(self, pool: object) -> bool:
        return pool in self._pools

    def close_all(self) -> None:
        """Close every mapping; later :meth:`map` calls fail. Idempotent."""
        with IMPORT_LOCK:
            self._closed = True
            pools = [*self._pools.values(), *self._parked.values()]
            self._pools, self._parked = {}, {}
        for mapped in pools:
            try:
                mapped.close()
            except Exception:
                logger.exception("pool %s: closing its mapping failed", mapped.record.pool)
