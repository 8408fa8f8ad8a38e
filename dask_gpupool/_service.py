"""Everything dask_gpupool keeps in one worker process, as a plain class.

:class:`PoolService` owns the worker's :class:`~dask_gpupool._pool.Pool`,
its :class:`~dask_gpupool._broker.FdBroker`, the cache of peers' pools it
mapped (:class:`~dask_gpupool._mapping.MappedPools`) and its copy of the
registry (:class:`~dask_gpupool._registry.RegistryView`). The worker plugin
is a thin adapter that makes one on setup and closes it on teardown; tests
drive it without a cluster.

Threads: :meth:`start` and :meth:`close` run on the worker's event loop;
:meth:`allocate`, :meth:`map_peer` and :meth:`import_buffer` block and run in
task threads (or an executor), never on the event loop.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from dask_gpupool._broker import FdBroker, request_pool_fd
from dask_gpupool._config import PoolOptions
from dask_gpupool._errors import PeerAccessError, PoolClosedError, ProtocolError, UnknownPoolError
from dask_gpupool._mapping import MappedPool, MappedPools
from dask_gpupool._messages import BufferDescriptor, HandleReply, PoolRecord
from dask_gpupool._pool import Pool, PoolStats
from dask_gpupool._registry import RegistryView
from dask_gpupool._topology import LocalDevices, host_identity, local_devices

if TYPE_CHECKING:
    from cuda.core import Buffer

__all__ = ["PoolService"]

logger = logging.getLogger(__name__)


class PoolService:
    """One worker's pool, broker, mapped peer pools and registry view.

    Attributes
    ----------
    options : PoolOptions
    pool : Pool
        This worker's own pool (owned; closed by :meth:`close`).
    broker : FdBroker
        Serves ``pool``'s fd to same-host peers (owned; closed by :meth:`close`).
    mapped : MappedPools
        Peers' pools mapped here (owned; closed by :meth:`close`).
    registry : RegistryView
        This worker's copy of the scheduler's registry.
    record : PoolRecord
        This pool's registry row.
    devices : LocalDevices
        The GPUs this process sees.
    """

    options: PoolOptions
    pool: Pool
    broker: FdBroker
    mapped: MappedPools
    registry: RegistryView
    record: PoolRecord
    devices: LocalDevices
    _closed: bool

    def __init__(self, options: PoolOptions, pool: Pool, broker: FdBroker, record: PoolRecord, devices: LocalDevices):
        self.options = options
        self.pool = pool
        self.broker = broker
        self.record = record
        self.devices = devices
        self.mapped = MappedPools(devices, pool.device if pool.kind != "host" else _own_device(options, devices))
        self.registry = RegistryView()
        self._closed = False

    @classmethod
    def start(cls, options: PoolOptions, worker_address: str, devices: LocalDevices | None = None) -> PoolService:
        """Make the pool and start its broker.

        Raises
        ------
        ConfigError
            If ``options`` cannot be honoured on this host.
        """
        devices = local_devices() if devices is None else devices
        pool = Pool.create(options, devices)
        try:
            broker = FdBroker(_lookup_for(pool), options.broker_dir, options.broker_timeout, pool.uuid)
        except BaseException:
            pool.close()
            raise
        host, hostname = host_identity(options.host_id)
        record = PoolRecord(
            pool=pool.uuid,
            worker=worker_address,
            pid=os.getpid(),
            host=host,
            hostname=hostname,
            kind=pool.kind,
            device=pool.device_uuid,
            max_size=pool.max_size,
            broker=broker.address,
            devices=devices.uuids,
        )
        logger.info(
            "pool %s: %s pool of %d bytes on %s, broker %s",
            pool.uuid,
            pool.kind,
            pool.max_size,
            pool.device_uuid or "host memory",
            broker.address,
        )
        return cls(options, pool, broker, record, devices)

    # -- this worker's pool --------------------------------------------------------

    def allocate(self, nbytes: int, stream: Any = None) -> Buffer:
        """A buffer of ``nbytes`` from this worker's pool (see :meth:`Pool.allocate`)."""
        return self.pool.allocate(nbytes, stream)

    def export(self, buf: Buffer) -> BufferDescriptor:
        """Describe a buffer of this worker's pool for a peer (see :meth:`Pool.export`)."""
        return self.pool.export(buf)

    def stats(self) -> PoolStats:
        return self.pool.stats()

    # -- peers' pools ----------------------------------------------------------------

    def map_peer(self, pool: str) -> MappedPool:
        """Map a same-host peer's pool into this process, once. Blocking.

        Raises
        ------
        UnknownPoolError
            If ``pool`` is not in this worker's copy of the registry.
        PeerAccessError
            If the pool is this worker's own, lives on another host, or its
            memory cannot be reached from here.
        PeerLostError
            If the owner's broker cannot be reached.
        """
        if self._closed:
            raise PoolClosedError(f"pool service of {self.record.worker} is closed")
        mapped = self.mapped.get(pool)
        if mapped is not None:
            return mapped
        record = self.registry.get(pool)
        if record is None:
            raise UnknownPoolError(f"pool {pool} is not registered (known: {len(self.registry)} pools)")
        if record.pool == self.pool.uuid:
            raise PeerAccessError(f"pool {pool} is this worker's own; use it directly")
        if record.host != self.record.host:
            raise PeerAccessError(
                f"pool {pool} of {record.worker} is on host {record.host!r}, this worker on {self.record.host!r}"
            )

        def fetch() -> int:
            reply, fd = request_pool_fd(record.broker, pool, self.options.broker_timeout)
            if reply.kind != record.kind:
                os.close(fd)
                raise ProtocolError(f"pool {pool}: broker says kind {reply.kind!r}, registry {record.kind!r}")
            return fd

        return self.mapped.map(record, fetch)

    def import_buffer(self, desc: BufferDescriptor) -> Buffer:
        """Map a peer's buffer (mapping its pool first if needed). No copy; the caller owns the Buffer."""
        return self.map_peer(desc.pool).import_buffer(desc)

    # -- lifecycle -------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop the broker, unmap peers' pools, close this pool. Idempotent.

        Order matters: no peer can fetch the fd once the broker is closed, and
        mapped pools are closed after (and only after) their buffers.
        """
        if self._closed:
            return
        self._closed = True
        self.broker.close()
        self.mapped.close_all()
        self.pool.close()
        logger.info("pool %s: closed", self.pool.uuid)


def _lookup_for(pool: Pool) -> Any:
    def lookup(requested: str) -> tuple[int, HandleReply] | None:
        if requested != pool.uuid or pool.closed:
            return None
        return pool.allocation_handle(), HandleReply(pool.uuid, pool.kind, pool.max_size)

    return lookup


def _own_device(options: PoolOptions, devices: LocalDevices) -> int | None:
    """The GPU a ``host``-pool worker would use for CUDA pools it maps, if any."""
    if not devices:
        return None
    try:
        return devices.resolve(options.device)
    except Exception:
        return None
