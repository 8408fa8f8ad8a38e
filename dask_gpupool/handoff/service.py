"""Everything dask_gpupool keeps in one worker process, as a plain class: the parts, their lifecycle, the registry.

:class:`PoolService` owns the worker's parts and hands none of their work on:
callers hold the part that does it.

- :attr:`~PoolService.pool` (:class:`~dask_gpupool.memory.pool.Pool`):
  allocation (``pool.allocate``), exports' descriptors, stats;
- :attr:`~PoolService.routes` (:class:`~dask_gpupool.handoff.routes.Routes`):
  how each value goes to the worker that asked (``routes.plan``);
- :attr:`~PoolService.exports` (:class:`~dask_gpupool.handoff.exporter.Exports`):
  the export side of each handoff (``exports.export_ipc``, ``exports.settle``),
  under the leases of :attr:`~PoolService.leases`
  (:class:`~dask_gpupool.handoff.leases.LeaseTable`);
- :attr:`~PoolService.importer` (:class:`~dask_gpupool.handoff.importer.Importer`):
  the import side (``importer.import_handoff``, ``importer.copies``), with its
  links to exporters, peers' pools mapped here and lease releases;
- :attr:`~PoolService.forwarder` (:class:`~dask_gpupool.handoff.forwarding.Forwarder`):
  passes on values imported here;
- :attr:`~PoolService.broker` (:class:`~dask_gpupool.transport.broker.FdBroker`)
  and :attr:`~PoolService.copier` (:class:`~dask_gpupool.transport.stream.CopyServer`):
  serve the pool to peers.

What is its own: joining the scheduler's registry (:meth:`PoolService.join`,
:meth:`PoolService.apply_registry`) and publishing its row, the handoff
counters (:meth:`PoolService.handoff_stats`), and the teardown order
(:meth:`PoolService.close`). Its parts are made by
:func:`~dask_gpupool.handoff.startup.start_service`. The worker plugin is a
thin adapter that makes one on setup and closes it on teardown; tests drive
it without a cluster.

Threads: making and :meth:`PoolService.close` run on the worker's event
loop; allocation and mapping peers' pools block and run in task threads (or
an executor). The handoff calls (routes, exports, importer) run where Dask
serializes: the event loop or its offload thread; the only blocking call
among them is mapping a peer's pool the first time (one broker round trip,
bounded by ``broker-timeout``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from dask_gpupool.config import PoolOptions
from dask_gpupool.handoff.exporter import Exports, ExportSide
from dask_gpupool.handoff.forwarding import Forwarder
from dask_gpupool.handoff.importer import Importer
from dask_gpupool.handoff.leases import LeaseTable
from dask_gpupool.handoff.registry import RegistryView
from dask_gpupool.handoff.routes import Routes
from dask_gpupool.handoff.stats import HandoffStats
from dask_gpupool.memory.lifetime import QUARANTINE, keep_until_exit
from dask_gpupool.memory.pool import Pool
from dask_gpupool.memory.topology import LocalDevices
from dask_gpupool.transport.broker import FdBroker
from dask_gpupool.transport.staging import STAGING, hold_slots, let_go_slots
from dask_gpupool.transport.stream import CopyServer
from dask_gpupool.wire.registry import MAX_RECLAIM, Membership, PoolRecord, RegistryUpdate

__all__ = ["PoolService"]

logger = logging.getLogger(__name__)


class PoolService:
    """One worker's parts, owned and closed in order, and its place in the scheduler's registry.

    Callers use the parts themselves (``service.routes.plan(...)``,
    ``service.exports.export_ipc(...)``, ``service.importer.import_handoff(...)``);
    the service makes, wires and closes them.

    Attributes
    ----------
    options : PoolOptions
    pool : Pool
        This worker's own pool (owned; closed by :meth:`close`).
    broker : FdBroker
        Serves ``pool``'s fd to same-host peers (owned; closed by :meth:`close`).
    importer : Importer
        The import side: links to exporters, peers' pools mapped here, lease
        releases, copies (owned; closed by :meth:`close`).
    registry : RegistryView
        This worker's copy of the scheduler's registry.
    record : PoolRecord
        This pool's registry row.
    devices : LocalDevices
        The GPUs this process sees.
    leases : LeaseTable
        Buffers of this pool handed to peers, kept alive for them.
    handoffs : HandoffStats
        Counters of handoffs in and out.
    copier : CopyServer or None
        Serves this worker's copies over the pipelined copy path (owned;
        closed by :meth:`close`); ``None`` when that path is off or the
        worker does not listen on ``tcp``.
    routes : Routes
        Decides how each value goes to the worker that asked (:mod:`~dask_gpupool.handoff.routes`).
    forwarder : Forwarder
        Passes on values imported here (:mod:`~dask_gpupool.handoff.forwarding`).
    exports : Exports
        Makes the export side of each handoff (:mod:`~dask_gpupool.handoff.exporter`).
    on_close : callable or None
        Called with the service when it closes, once it takes no new handoffs
        (:func:`~dask_gpupool.handoff.startup.start_service` sets it to take the
        service out of the process's live ones, :mod:`~dask_gpupool.handoff.registry`).
    """

    options: PoolOptions
    pool: Pool
    broker: FdBroker
    importer: Importer
    registry: RegistryView
    record: PoolRecord
    devices: LocalDevices
    leases: LeaseTable
    handoffs: HandoffStats
    copier: CopyServer | None
    routes: Routes
    forwarder: Forwarder
    exports: Exports
    on_close: Callable[[PoolService], None] | None
    _closed: bool

    def __init__(
        self,
        options: PoolOptions,
        pool: Pool,
        broker: FdBroker,
        record: PoolRecord,
        devices: LocalDevices,
        leases: LeaseTable | None = None,
        copier: CopyServer | None = None,
        registry: RegistryView | None = None,
        on_close: Callable[[PoolService], None] | None = None,
    ):
        self.options = options
        self.pool = pool
        self.broker = broker
        self.record = record
        #: What metrics call this worker: its Dask name once the plugin sets it (stable across restarts).
        self.name = record.worker
        self.devices = devices
        self.registry = registry if registry is not None else RegistryView()
        self.leases = leases if leases is not None else LeaseTable(options.lease_timeout)
        self.handoffs = HandoffStats()
        #: What allocates into this pool besides the task's own calls, and why (``{"cupy": reason}``; set by the
        #: worker plugin; shown by ``stats()["routing"]``).
        self.routing: dict[str, str] = {}
        #: This worker's registry key, from its Membership (:meth:`join`): its registry messages carry it.
        self.registry_key: bytes | None = None
        self.copier = copier
        self.routes = Routes(options, pool, record, self.registry, self.handoffs, copier, pinned=self.leases.nbytes_of)
        self.exports = Exports(
            options, pool, record.worker, self.leases, self.handoffs, self.routes, copier, left=self._importer_left
        )
        self.importer = importer = Importer(
            options, pool, record.worker, record.host, self.registry, devices, self.handoffs, self.exports.take_back
        )
        self.forwarder = Forwarder(
            pool, record.worker, self.registry, self.routes, importer.links, importer.releaser, self.handoffs
        )
        handler = getattr(broker, "handler", None)
        if isinstance(handler, ExportSide):
            handler.on_transfer_failed = self._transfer_failed
            handler.refuses = self.routes.is_unreachable
        self.on_close = on_close
        self._closed = False
        hold_slots()  # the process's staging slots are kept while a service of this process is open

    def _transfer_failed(self, importer: str) -> None:
        """``importer`` says a transfer failed after it claimed its leases: copies to it for ``lease-timeout``."""
        self.routes.mark_unreachable(importer, self.options.lease_timeout)
        logger.warning(
            "pool %s: a transfer to %s failed after its claims; its handoffs go as copies for %.0f s",
            self.pool.uuid,
            importer,
            self.options.lease_timeout,
        )

    # -- registry --------------------------------------------------------------------

    def join(self, membership: Membership) -> None:
        """Take the scheduler's answer to our registration: the registry and the cluster's token.

        From now on the broker serves peers presenting the token, and links
        present it. A new token (the scheduler restarted) drops the links
        made with the old one.
        """
        links = self.importer.links
        old, links.token = links.token, membership.token
        self.registry_key = membership.key
        self.broker.token = membership.token
        if self.copier is not None:
            self.copier.token = membership.token
        if old is not None and old != membership.token:
            links.drop()
        self.apply_registry(membership.snapshot)

    def apply_registry(self, update: RegistryUpdate) -> None:
        """Apply a registry change; a peer that left gives back its leases once its process is gone, and its
        mappings go.

        A peer that retired segments (its row's ``retire_below`` grew, or its
        ``reclaim`` changed) gets back those mapped here that no import uses
        (the rest go with their last import).
        """
        gone = [r for r in (self.registry.get(p) for p in update.removed) if r is not None]
        self.registry.apply(update)
        for record in update.added:
            mapped = self.importer.mapped.get(record.pool)
            if mapped is not None and (
                record.retire_below > mapped.retire_below or not mapped.reclaim.issuperset(record.reclaim)
            ):
                self.importer.unmap_retired(mapped, record)
        for record in gone:
            if record.pool == self.pool.uuid:
                continue
            self._importer_left(record)
            self.importer.exporter_left(record)
            self.routes.forget(record.worker)

    def _importer_left(self, record: PoolRecord) -> None:
        """``record``'s worker left the registry: its leases, and the segments it maps, are released when its
        process exits (the broker watches it; at once if it is gone). Leaving is not dying: the scheduler removes
        workers whose process lives on. Any thread."""
        self.broker.importer_left(record.worker, record.pid if record.host == self.record.host else 0)

    def retire_segments(self) -> PoolRecord | None:
        """Give memory back: retire this pool's segments (:meth:`SegmentedResource.retire`), or trim a
        host pool's free pages (:meth:`SharedHostMemoryResource.trim`); return the row to publish.

        ``None`` when the pool has no segments. The caller re-registers the
        returned row so that peers learn the new ``retire_below``.
        """
        host = self.pool.shared_host
        if host is not None:  # a host pool: its free pages go back to the OS at once
            host.trim()
        segmented = self.pool.segmented
        if segmented is None:
            return None
        segmented.retire()
        return self.refresh_row()

    def refresh_row(self) -> PoolRecord:
        """This worker's row with the segments' retire state as it is now (``retire_below``, ``reclaim``).

        Call it where the row is sent (the worker's event loop), so that rows
        go out in the order they were made and never carry an older state
        than one sent before.
        """
        segmented = self.pool.segmented
        if segmented is not None:
            self.record = self.routes.record = dataclasses.replace(
                self.record, retire_below=segmented.retire_below, reclaim=segmented.reclaim[-MAX_RECLAIM:]
            )
        return self.record

    def reclaim_through(self, publish: Callable[[], None]) -> None:
        """Let a full pool take back large buffers' spare segments that peers still map.

        ``publish()`` must make :meth:`refresh_row`'s row known to the peers,
        through the scheduler, without blocking: it is called from the
        allocating thread. Peers unmap those segments as retiring ones and
        release them; a pool allocation with ``wait`` waits up to
        ``broker-timeout`` for that (:meth:`Reclaim.through
        <dask_gpupool.memory.reclaim.Reclaim.through>`).
        """
        segmented = self.pool.segmented
        if segmented is not None:
            segmented.reclaimer.through(publish, self.options.broker_timeout)

    def handoff_stats(self) -> dict[str, Any]:
        """Counters for :func:`dask_gpupool.stats`."""
        segmented = self.pool.segmented
        return {
            **self.handoffs.to_msg(),
            "pool_bytes": self.pool.stats().used,
            "leases": len(self.leases),
            "lease_bytes": self.leases.nbytes,
            "lease_bytes_by_peer": self.leases.bytes_by_importer(),
            "leases_unclaimed": self.leases.unclaimed,
            "leases_in_doubt": self.leases.doubtful,
            "leases_abandoned": self.leases.abandoned_total,
            **self.importer.stats(),
            "pulls": 0 if self.copier is None else self.copier.transfers,
            "segments": 0 if segmented is None else segmented.segments,
            "segments_retiring": 0 if segmented is None else segmented.retiring,
            "staging_bytes": STAGING.nbytes,
            # this process's, as staging_bytes: device memory of UCX transfers that did not complete, kept out of reuse
            "ucx_quarantined": QUARANTINE.count,
            "ucx_quarantined_bytes": QUARANTINE.nbytes,
            "routing": dict(self.routing),
        }

    # -- lifecycle -------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop the broker, end leases, unmap peers' pools, close this pool. Idempotent.

        Order matters: no peer can fetch the fd once the broker is closed;
        releases queued here are sent before the links close; mapped pools are
        closed after (and only after) their buffers.
        """
        if self._closed:
            return
        self._closed = True
        segmented = self.pool.segmented
        if segmented is not None:
            segmented.reclaimer.through(None, 0.0)  # drops the plugin's callback (and the worker it holds)
        self.routes.closed = True  # same-host handoffs go as copies from here on
        self.importer.closed = True  # no new mappings or links from here on
        if self.on_close is not None:
            self.on_close(self)
        if isinstance(self.broker.handler, ExportSide):
            self.broker.handler.closing = True
        self.broker.close()
        if self.copier is not None:
            self.copier.close()  # waits for the pulls in flight: their leases end with them
        if self.pool.kind == "host":
            self.pool.resource.keep_pages()  # leased buffers go now; peers' mappings of the memfd keep their pages
            self.leases.clear()  # nothing is reused here
        else:
            held = keep_until_exit(self.leases.detach())
            if held:
                logger.warning(
                    "pool %s: closed with %d lease(s) still held by peers; their memory is kept until "
                    "this process exits",
                    self.pool.uuid,
                    held,
                )
        self.importer.close()
        let_go_slots()  # the process's pinned staging and vkgdr landing slots go with its last pool
        self.pool.close()
        logger.info("pool %s: closed", self.pool.uuid)
