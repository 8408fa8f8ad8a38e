"""Starting one worker's service (:func:`start_service`): its pool, broker, copy server and registry row.

The pool first, then its broker (which serves the pool's fd to same-host
peers) and its copy server (the pipelined copy path); a part that cannot be
made closes those made before it (:func:`start_parts`). The registry row
describes the result. :func:`start_service` wraps the parts in a
:class:`~dask_gpupool.handoff.service.PoolService` and lists it among the
process's live services (:mod:`~dask_gpupool.handoff.registry`), until it closes.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

from dask_gpupool import tuning
from dask_gpupool.config import PoolOptions
from dask_gpupool.handoff.exporter import ExportSide, make_current
from dask_gpupool.handoff.leases import LeaseTable
from dask_gpupool.handoff.registry import RegistryView, add_active, remove_active
from dask_gpupool.handoff.service import PoolService
from dask_gpupool.memory.pool import Pool
from dask_gpupool.memory.topology import LocalDevices, host_identity, local_devices
from dask_gpupool.transport.broker import FdBroker
from dask_gpupool.transport.stream import CopyServer
from dask_gpupool.wire.registry import PoolRecord

__all__ = ["Parts", "start_parts", "start_service"]

logger = logging.getLogger(__name__)


class Parts(NamedTuple):
    """What :func:`start_parts` made, in the order :class:`~dask_gpupool.handoff.service.PoolService` takes it."""

    pool: Pool
    broker: FdBroker
    record: PoolRecord
    devices: LocalDevices
    leases: LeaseTable
    copier: CopyServer | None
    registry: RegistryView


def start_service(
    options: PoolOptions, worker_address: str, devices: LocalDevices | None = None, *, prefer_legacy: bool = False
) -> PoolService:
    """Make the pool, start its broker (:func:`start_parts`) and wrap them in a service, listed as live in this
    process (:func:`~dask_gpupool.handoff.registry.add_active`) until it closes.

    ``prefer_legacy``: ``segment-memory: auto`` makes segments of legacy IPC memory where the GPU allows
    (:meth:`~dask_gpupool.memory.pool.Pool.create`); the worker plugin asks for it on workers that listen over UCX.

    Raises
    ------
    ConfigError
        If ``options`` cannot be honoured on this host.
    """
    parts = start_parts(options, worker_address, devices, prefer_legacy=prefer_legacy)
    service = PoolService(
        options,
        parts.pool,
        parts.broker,
        parts.record,
        parts.devices,
        parts.leases,
        parts.copier,
        parts.registry,
        on_close=remove_active,
    )
    add_active(service)
    return service


def start_parts(
    options: PoolOptions, worker_address: str, devices: LocalDevices | None = None, *, prefer_legacy: bool = False
) -> Parts:
    """Make the pool and start its broker (and copy server); describe them in the pool's registry row.

    ``prefer_legacy``: as :meth:`~dask_gpupool.memory.pool.Pool.create` takes it.

    Raises
    ------
    ConfigError
        If ``options`` cannot be honoured on this host.
    """
    devices = local_devices() if devices is None else devices
    pool = Pool.create(options, devices, prefer_legacy=prefer_legacy)
    leases = LeaseTable(options.lease_timeout, on_drop=make_current(pool))
    registry = RegistryView()
    host, hostname = host_identity(options.host_id)
    try:
        broker = FdBroker(
            ExportSide(pool, leases, registry, host), options.broker_dir, options.broker_timeout, pool.uuid
        )
    except BaseException:
        pool.close()
        raise
    try:
        copier = _copy_server(options, pool, leases, worker_address)
    except BaseException:
        broker.close()
        pool.close()
        raise
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
        peers=pool.peers,
        segment_memory=pool.segment_memory,
        copier="" if copier is None else copier.address,
    )
    logger.info(
        "pool %s: %s pool of %d bytes on %s, broker %s",
        pool.uuid,
        pool.kind,
        pool.max_size,
        pool.device_uuid or "host memory",
        broker.address,
    )
    return Parts(pool, broker, record, devices, leases, copier, registry)


def _copy_server(options: PoolOptions, pool: Pool, leases: LeaseTable, worker_address: str) -> CopyServer | None:
    """The worker's copy server, listening on the worker's interface; ``None`` when the worker is not on ``tcp``."""
    if not worker_address.startswith("tcp://"):
        return None
    from distributed.comm import get_address_host

    return CopyServer(
        pool.uuid,
        leases,
        get_address_host(worker_address),
        options.broker_timeout,
        tuning.COPY_CHUNK_SIZE,
    )
