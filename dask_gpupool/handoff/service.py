"""Everything dask_gpupool keeps in one worker process, as a plain class.

:class:`PoolService` owns the worker's :class:`~dask_gpupool.memory.pool.Pool`,
its :class:`~dask_gpupool.transport.broker.FdBroker` and copy server, the
leases it granted (:class:`~dask_gpupool.handoff.leases.LeaseTable`), its copy
of the registry (:class:`~dask_gpupool.handoff.registry.RegistryView`), its
handoff counters, and its :class:`~dask_gpupool.handoff.importer.Importer`
(links to exporters, peers' pools mapped here, lease releases). It makes the
export of each handoff through its :class:`~dask_gpupool.handoff.exports.Exports`
(:meth:`export_ipc`, :meth:`export_stream`) as its
:class:`~dask_gpupool.handoff.routes.Routes` decides (:meth:`plan`), and
passes on values imported here through its
:class:`~dask_gpupool.handoff.forwarding.Forwarder`; the import side is the
importer's. Its parts are made by
:func:`~dask_gpupool.handoff.startup.start_parts`. The worker plugin is a
thin adapter that makes one on setup and closes it on teardown; tests drive
it without a cluster.

Threads: :meth:`start` and :meth:`close` run on the worker's event loop;
:meth:`allocate`, :meth:`map_peer` and :meth:`import_buffer` block and run in
task threads (or an executor). The handoff methods (:meth:`plan`,
:meth:`export_ipc`, :meth:`import_handoff`, :meth:`receive_copy`) run where
Dask serializes: the event loop or its offload thread; the only blocking
call among them is mapping a peer's pool the first time (one broker round
trip, bounded by ``broker-timeout``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask_gpupool.config import PoolOptions
from dask_gpupool.errors import PoolClosedError
from dask_gpupool.handoff import active
from dask_gpupool.handoff.exporter import ExportSide
from dask_gpupool.handoff.exports import Exports
from dask_gpupool.handoff.forwarding import Forwarder
from dask_gpupool.handoff.imported import Origin
from dask_gpupool.handoff.importer import Importer
from dask_gpupool.handoff.leases import LeaseTable
from dask_gpupool.handoff.mapped_pool import MappedPool
from dask_gpupool.handoff.mappings import MappedPools
from dask_gpupool.handoff.registry import RegistryView
from dask_gpupool.handoff.releaser import Releaser
from dask_gpupool.handoff.routes import Routes
from dask_gpupool.handoff.routing import Route
from dask_gpupool.handoff.startup import start_parts
from dask_gpupool.handoff.stats import HandoffStats
from dask_gpupool.memory.lifetime import QUARANTINE, keep_until_exit
from dask_gpupool.memory.pool import Pool, PoolStats
from dask_gpupool.memory.topology import LocalDevices
from dask_gpupool.transport.broker import FdBroker
from dask_gpupool.transport.link import PeerLink
from dask_gpupool.transport.staging import STAGING
from dask_gpupool.transport.stream import CopyServer
from dask_gpupool.transport.vkgdr_staging import VKGDR
from dask_gpupool.wire.handoff import ArrayMeta, BufferDescriptor, HandoffHeader, LeaseQuery, LeaseQueryReply
from dask_gpupool.wire.registry import MAX_RECLAIM, Membership, PoolRecord, RegistryUpdate

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
    leases : LeaseTable
        Buffers of this pool handed to peers, kept alive for them.
    handoffs : HandoffStats
        Counters of handoffs in and out.
    releaser : Releaser
        Sends lease releases for buffers imported here (owned; stopped by :meth:`close`).
    copier : CopyServer or None
        Serves this worker's copies over the pipelined copy path (owned;
        closed by :meth:`close`); ``None`` when that path is off or the
        worker does not listen on ``tcp``.
    routes : Routes
        Decides how each value goes to the worker that asked (:mod:`~dask_gpupool.handoff.routes`).
    forwarder : Forwarder
        Passes on values imported here (:mod:`~dask_gpupool.handoff.forwarding`).
    exports : Exports
        Makes the export side of each handoff (:mod:`~dask_gpupool.handoff.exports`).
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
        self.importer = Importer(options, pool, record.worker, record.host, self.registry, devices, self.handoffs)
        self.copier = copier
        self.routes = Routes(options, pool, record, self.registry, self.handoffs, copier)
        self.forwarder = Forwarder(
            pool, record.worker, self.registry, self.routes, self.importer, self.handoffs, self.leases
        )
        self.exports = Exports(
            options, pool, record.worker, self.leases, self.handoffs, self.routes, copier, left=self._importer_left
        )
        handler = getattr(broker, "handler", None)
        if isinstance(handler, ExportSide):
            handler.on_transfer_failed = self._transfer_failed
            handler.refuses = self.routes.is_unreachable
        self._closed = False
        active.add(self)

    def _transfer_failed(self, importer: str) -> None:
        """``importer`` says a transfer failed after it claimed its leases: copies to it for ``lease-timeout``."""
        self.routes.mark_unreachable(importer, self.options.lease_timeout)
        logger.warning(
            "pool %s: a transfer to %s failed after its claims; its handoffs go as copies for %.0f s",
            self.pool.uuid,
            importer,
            self.options.lease_timeout,
        )

    @classmethod
    def start(
        cls,
        options: PoolOptions,
        worker_address: str,
        devices: LocalDevices | None = None,
        *,
        prefer_legacy: bool = False,
    ) -> PoolService:
        """Make the pool and start its broker (:func:`~dask_gpupool.handoff.startup.start_parts`).

        ``prefer_legacy``: ``segment-memory: auto`` makes segments of legacy IPC memory where the GPU allows
        (:meth:`~dask_gpupool.memory.pool.Pool.create`); the worker plugin asks for it on workers that listen over UCX.

        Raises
        ------
        ConfigError
            If ``options`` cannot be honoured on this host.
        """
        parts = start_parts(options, worker_address, devices, prefer_legacy=prefer_legacy)
        return cls(
            options, parts.pool, parts.broker, parts.record, parts.devices, parts.leases, parts.copier, parts.registry
        )

    # -- this worker's pool --------------------------------------------------------

    def allocate(self, nbytes: int, stream: Any = None, *, wait: bool = False) -> Buffer:
        """A buffer of ``nbytes`` from this worker's pool (see :meth:`Pool.allocate`)."""
        return self.pool.allocate(nbytes, stream, wait=wait)

    def export(self, buf: Buffer) -> BufferDescriptor:
        """Describe a buffer of this worker's pool for a peer (see :meth:`Pool.export`)."""
        return self.pool.export(buf)

    def stats(self) -> PoolStats:
        return self.pool.stats()

    # -- the importer's side (handoff/importer.py) -------------------------------------

    @property
    def mapped(self) -> MappedPools:
        """Peers' pools mapped here (the importer's)."""
        return self.importer.mapped

    @property
    def releaser(self) -> Releaser:
        """The importer's lease releases."""
        return self.importer.releaser

    @property
    def token(self) -> bytes | None:
        """The cluster's membership token, from the scheduler (:meth:`join`)."""
        return self.importer.token

    def map_peer(self, pool: str) -> MappedPool:
        """:meth:`Importer.map_peer <dask_gpupool.handoff.importer.Importer.map_peer>`."""
        return self.importer.map_peer(pool)

    def import_buffer(self, desc: BufferDescriptor) -> Buffer:
        """:meth:`Importer.import_buffer <dask_gpupool.handoff.importer.Importer.import_buffer>`."""
        return self.importer.import_buffer(desc)

    def link(self, record: PoolRecord) -> PeerLink:
        """:meth:`Importer.link <dask_gpupool.handoff.importer.Importer.link>`."""
        return self.importer.link(record)

    def import_handoff(self, header: HandoffHeader) -> Buffer:
        """:meth:`Importer.import_handoff <dask_gpupool.handoff.importer.Importer.import_handoff>`, or
        :meth:`Forwarder.take_back <dask_gpupool.handoff.forwarding.Forwarder.take_back>` for a value of this
        worker's own pool that came back."""
        if header.exporter == self.record.worker:
            return self.forwarder.take_back(header)
        return self.importer.import_handoff(header)

    def receive_copy(self, kind: str, data: Any, sender: str, need: str = "any") -> Buffer:
        """:meth:`Importer.receive_copy <dask_gpupool.handoff.importer.Importer.receive_copy>`."""
        return self.importer.receive_copy(kind, data, sender, need)

    def pull_copy(self, header: HandoffHeader, need: str = "any") -> Buffer:
        """:meth:`Importer.pull_copy <dask_gpupool.handoff.importer.Importer.pull_copy>`."""
        return self.importer.pull_copy(header, need)

    # -- handoffs: the exporter's side (decisions: handoff/routes.py) --------------------

    def plan(self, requester: str | None, scheme: str, buf: Buffer) -> tuple[PoolRecord | None, str | None]:
        """:meth:`Routes.plan <dask_gpupool.handoff.routes.Routes.plan>`."""
        return self.routes.plan(requester, scheme, buf)

    def route(self, requester: str | None, scheme: str, buf: Buffer) -> Route:
        """:meth:`Routes.route <dask_gpupool.handoff.routes.Routes.route>`."""
        return self.routes.route(requester, scheme, buf)

    def stage_route(self, requester: str | None, scheme: str, nbytes: int) -> PoolRecord | None:
        """:meth:`Routes.stage_route <dask_gpupool.handoff.routes.Routes.stage_route>`."""
        return self.routes.stage_route(requester, scheme, nbytes)

    def stage_threshold(self, requester: str | None, scheme: str) -> int:
        """:meth:`Routes.stage_threshold <dask_gpupool.handoff.routes.Routes.stage_threshold>`."""
        return self.routes.stage_threshold(requester, scheme)

    def plain_copy_reason(self, requester: str | None) -> str | None:
        """:meth:`Routes.plain_copy_reason <dask_gpupool.handoff.routes.Routes.plain_copy_reason>`."""
        return self.routes.plain_copy_reason(requester)

    def export_ipc(
        self,
        holder: Any,
        buf: Buffer,
        row: PoolRecord,
        array: ArrayMeta | None,
        *,
        written_on: Any = None,
        written_by: Any = None,
    ) -> HandoffHeader:
        """:meth:`Exports.export_ipc <dask_gpupool.handoff.exports.Exports.export_ipc>`."""
        return self.exports.export_ipc(holder, buf, row, array, written_on=written_on, written_by=written_by)

    def export_stream(
        self, holder: Any, buf: Buffer, offset: int, nbytes: int, row: PoolRecord, array: ArrayMeta | None
    ) -> HandoffHeader:
        """:meth:`Exports.export_stream <dask_gpupool.handoff.exports.Exports.export_stream>`."""
        return self.exports.export_stream(holder, buf, offset, nbytes, row, array)

    def settle(self, leases: list[int], requester: str | None, ok: bool = False) -> list[int]:
        """:meth:`Exports.settle <dask_gpupool.handoff.exports.Exports.settle>`."""
        return self.exports.settle(leases, requester, ok)

    def revoke(self, leases: list[int], requester: str | None) -> int:
        """:meth:`Exports.revoke <dask_gpupool.handoff.exports.Exports.revoke>`."""
        return self.exports.revoke(leases, requester)

    def in_doubt(self, leases: list[int], requester: str) -> list[int]:
        """Those of ``leases`` still in doubt (:meth:`~dask_gpupool.handoff.leases.LeaseTable.in_doubt`)."""
        return self.leases.in_doubt(leases, requester)

    def resolve(self, leases: list[int], requester: str, held: list[int]) -> int:
        """:meth:`Exports.resolve <dask_gpupool.handoff.exports.Exports.resolve>`."""
        return self.exports.resolve(leases, requester, held)

    def answer_lease_query(self, query: LeaseQuery) -> LeaseQueryReply:
        """An exporter asks which of the leases it sent in a failed reply this worker holds.

        Answered by :meth:`HeldLeases.answer <dask_gpupool.handoff.held.HeldLeases.answer>`: the
        leases not held are refused for good, atomically with the answer.

        Raises
        ------
        PoolClosedError
            If this service is closed: its imports may still be closing, so no answer is safe.
        """
        if self.closed:
            raise PoolClosedError(f"pool service of {self.record.worker} is closed")
        # refusals are kept even for an exporter this worker's registry does not know yet: its row may come
        # before a header of that reply is deserialized (HeldLeases bounds the refusals and the exporters kept)
        return LeaseQueryReply(tuple(self.importer.releaser.answer(query.exporter, query.leases)))

    def forward(
        self, origin: Origin, requester: str | None, scheme: str, array: ArrayMeta | None
    ) -> HandoffHeader | None:
        """:meth:`Forwarder.forward <dask_gpupool.handoff.forwarding.Forwarder.forward>`."""
        return self.forwarder.forward(origin, requester, scheme, array)

    def forward_route(self, origin: Origin, requester: str | None, scheme: str) -> tuple[Route, PoolRecord | None]:
        """:meth:`Routes.forward_route <dask_gpupool.handoff.routes.Routes.forward_route>`."""
        return self.routes.forward_route(origin, requester, scheme)

    def settle_forwarded(self, forwarded: list[tuple[str, int]], requester: str | None) -> None:
        """:meth:`Forwarder.settle_forwarded <dask_gpupool.handoff.forwarding.Forwarder.settle_forwarded>`."""
        self.forwarder.settle_forwarded(forwarded, requester)

    def stream_route(self, requester: str | None, scheme: str, nbytes: int) -> PoolRecord | None:
        """:meth:`Routes.stream_route <dask_gpupool.handoff.routes.Routes.stream_route>`."""
        return self.routes.stream_route(requester, scheme, nbytes)

    # -- registry --------------------------------------------------------------------

    def join(self, membership: Membership) -> None:
        """Take the scheduler's answer to our registration: the registry and the cluster's token.

        From now on the broker serves peers presenting the token, and links
        present it. A new token (the scheduler restarted) drops the links
        made with the old one.
        """
        old, self.importer.token = self.importer.token, membership.token
        self.registry_key = membership.key
        self.broker.token = membership.token
        if self.copier is not None:
            self.copier.token = membership.token
        if old is not None and old != membership.token:
            self.importer.drop_links()
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
            mapped = self.mapped.get(record.pool)
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
        release them; an allocation of :meth:`allocate` with ``wait`` waits
        up to ``broker-timeout`` for that
        (:meth:`Reclaim.through <dask_gpupool.memory.reclaim.Reclaim.through>`).
        """
        segmented = self.pool.segmented
        if segmented is not None:
            segmented.reclaimer.through(publish, self.options.broker_timeout)

    def handoff_stats(self) -> dict[str, Any]:
        """Counters for :func:`dask_gpupool.stats`."""
        segmented = self.pool.segmented
        return {
            **self.handoffs.to_msg(),
            "leases": len(self.leases),
            "lease_bytes": self.leases.nbytes,
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
        active.remove(self)
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
        if not active.active_services():
            STAGING.clear()  # the process's pinned staging slots go with its last pool
            VKGDR.clear()  # and its vkgdr landing slots
        self.pool.close()
        logger.info("pool %s: closed", self.pool.uuid)
