"""Everything dask_gpupool keeps in one worker process, as a plain class.

:class:`PoolService` owns the worker's :class:`~dask_gpupool.memory.pool.Pool`,
its :class:`~dask_gpupool.transport.broker.FdBroker` and copy server, the
leases it granted (:class:`~dask_gpupool.handoff.leases.LeaseTable`), its copy
of the registry (:class:`~dask_gpupool.handoff.registry.RegistryView`), its
handoff counters, and its :class:`~dask_gpupool.handoff.importer.Importer`
(links to exporters, peers' pools mapped here, lease releases). It decides and
makes the export of each handoff (:meth:`plan`, :meth:`export_ipc`,
:meth:`export_stream`); the import side is the importer's. The worker plugin
is a thin adapter that makes one on setup and closes it on teardown; tests
drive it without a cluster.

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
import os
import time
from typing import TYPE_CHECKING, Any

from dask_gpupool.config import PoolOptions
from dask_gpupool.errors import GPUPoolError
from dask_gpupool.handoff import active
from dask_gpupool.handoff.exporter import Exported, ExportSide, make_current
from dask_gpupool.handoff.imported import Origin
from dask_gpupool.handoff.importer import Importer
from dask_gpupool.handoff.leases import LeaseTable
from dask_gpupool.handoff.mappings import MappedPool, MappedPools
from dask_gpupool.handoff.registry import RegistryView
from dask_gpupool.handoff.releaser import Releaser
from dask_gpupool.handoff.routing import Route, plain_copy_reason, route
from dask_gpupool.handoff.stats import HandoffStats
from dask_gpupool.memory.buffers import buffer_kind
from dask_gpupool.memory.lifetime import keep_until_exit
from dask_gpupool.memory.pool import Pool, PoolStats
from dask_gpupool.memory.topology import LocalDevices, current_gpu, host_identity, local_devices
from dask_gpupool.transport.broker import FdBroker
from dask_gpupool.transport.link import PeerLink
from dask_gpupool.transport.staging import STAGING
from dask_gpupool.transport.stream import CopyServer, Staged, lanes
from dask_gpupool.wire.handoff import ArrayMeta, BufferDescriptor, HandoffHeader
from dask_gpupool.wire.registry import Membership, PoolRecord, RegistryUpdate

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
        self.importer = Importer(options, pool, record.worker, record.host, self.registry, devices, self.handoffs)
        self._unreachable: dict[str, float] = {}  # peer -> until when its handoffs go as copies
        self.copier = copier
        self._closed = False
        active.add(self)

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
        )
        logger.info(
            "pool %s: %s pool of %d bytes on %s, broker %s",
            pool.uuid,
            pool.kind,
            pool.max_size,
            pool.device_uuid or "host memory",
            broker.address,
        )
        return cls(options, pool, broker, record, devices, leases, copier, registry)

    # -- this worker's pool --------------------------------------------------------

    def allocate(self, nbytes: int, stream: Any = None) -> Buffer:
        """A buffer of ``nbytes`` from this worker's pool (see :meth:`Pool.allocate`)."""
        return self.pool.allocate(nbytes, stream)

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
        """:meth:`Importer.import_handoff <dask_gpupool.handoff.importer.Importer.import_handoff>`."""
        return self.importer.import_handoff(header)

    def receive_copy(self, kind: str, data: Any, sender: str, need: str = "any") -> Buffer:
        """:meth:`Importer.receive_copy <dask_gpupool.handoff.importer.Importer.receive_copy>`."""
        return self.importer.receive_copy(kind, data, sender, need)

    def pull_copy(self, header: HandoffHeader, need: str = "any") -> Buffer:
        """:meth:`Importer.pull_copy <dask_gpupool.handoff.importer.Importer.pull_copy>`."""
        return self.importer.pull_copy(header, need)

    # -- handoffs: the exporter's side -------------------------------------------------

    def plan(self, requester: str | None, scheme: str, buf: Buffer) -> tuple[PoolRecord | None, str | None]:
        """Decide how ``buf`` goes to ``requester``: ``(its row, None)`` to hand it over,
        ``(None, reason)`` to copy. ``reason`` is ``None`` for expected copies (another
        host, a client) and a fallback reason (counted, warned once) for a same-host
        peer that could have had it zero-copy.
        """
        row, reason = self.route(requester, scheme, buf)
        if reason is not None:
            self.handoffs.fallback(row.worker if row is not None else str(requester), reason, self.record.worker)
            return None, reason
        return row, None

    def route(self, requester: str | None, scheme: str, buf: Buffer) -> Route:
        """:meth:`plan`'s decision without counting it (:func:`~dask_gpupool.handoff.routing.route`)."""
        owned = self.pool.owns(buf)
        size = self.pool.import_size(buf) if owned and self.pool.kind == "device" else 0
        return self._route(self.record, requester, scheme, owned, size, self.pool.vmm)

    def _route(
        self, own: PoolRecord, requester: str | None, scheme: str, owned: bool, import_size: int, vmm: bool
    ) -> Route:
        """:func:`~dask_gpupool.handoff.routing.route` for memory of ``own``'s pool, with this worker's state."""
        row = self.registry.worker_row(requester) if requester else None
        return route(
            own,
            requester,
            row,
            scheme,
            pool_open=not (self._closed or self.pool.closed),
            owned=owned,
            unreachable=row is not None and self._is_unreachable(row.worker),
            import_size=import_size,
            import_limit=self.options.effective_import_limit(vmm),
        )

    def stage_route(self, requester: str | None, scheme: str, nbytes: int) -> PoolRecord | None:
        """The requester's row when an array of ``nbytes`` outside the pool should be staged into it and handed over.

        That is: ``nbytes`` is at least ``gpupool.stage-threshold`` and a new
        buffer of that size in this pool would be handed over (decided by
        :func:`~dask_gpupool.handoff.routing.route`, without counting).
        """
        threshold = self.options.effective_stage_threshold(self.pool.kind)
        if not threshold or nbytes < threshold or scheme not in ("tcp", "tls"):
            return None
        size = nbytes if self.pool.kind == "device" else 0
        decision = self._route(self.record, requester, scheme, True, size, self.pool.vmm)
        return decision.row if decision.reason is None else None

    def plain_copy_reason(self, requester: str | None) -> str | None:
        """Why a value outside every pool sent to ``requester`` is a same-host copy (``None``: it is not one).

        :func:`~dask_gpupool.handoff.routing.plain_copy_reason`; the get_data hook asks once per reply.
        """
        row = self.registry.worker_row(requester) if requester else None
        return plain_copy_reason(self.record, requester, row)

    def export_ipc(self, holder: Any, buf: Buffer, row: PoolRecord, array: ArrayMeta | None) -> HandoffHeader:
        """Grant ``row``'s worker a lease on ``buf`` and describe it.

        ``holder`` (``buf`` or an object that keeps it alive) stays referenced
        by the lease until the importer releases it. Pending GPU work is
        finished first (``ready="synced"``), so the importer may read at once.
        """
        desc = self.pool.export(buf)
        if self.pool.device is not None:
            current_gpu(self.pool.device).sync()
        lease = self.leases.grant(Exported(holder, buf), buf.size, row.worker, desc.segment)
        self.handoffs.add(exports=1)
        return HandoffHeader(
            "ipc", self.pool.kind, buf.size, exporter=self.record.worker, desc=desc, lease=lease, array=array
        )

    def forward(
        self, origin: Origin, requester: str | None, scheme: str, array: ArrayMeta | None
    ) -> HandoffHeader | None:
        """Pass on a value this worker imported: the requester maps the exporter's memory itself.

        The exporter grants the requester a lease of its own through this
        worker's link (:meth:`PeerLink.forward <dask_gpupool.transport.link.PeerLink.forward>`),
        so the memory lives until the requester lets go, whatever this worker
        does. Decided as for the exporter's own buffers
        (:func:`~dask_gpupool.handoff.routing.route` with the exporter's row).
        Returns the header, or ``None`` to copy (a same-host fallback is counted).
        """
        decision, owner = self.forward_route(origin, requester, scheme)
        if decision.reason is not None:
            peer = decision.row.worker if decision.row is not None else str(requester)
            detail = "the exporter left" if owner is None else ""
            self.handoffs.fallback(peer, decision.reason, self.record.worker, detail)
            return None
        if decision.row is None or owner is None:
            return None  # another host or a client: an expected copy
        try:
            lease, _segment = self.importer.link(owner).forward(origin.lease, decision.row.worker)
        except GPUPoolError as e:
            self.handoffs.fallback(decision.row.worker, "forward-refused", self.record.worker, str(e))
            return None
        self.handoffs.add(forwards=1)
        return HandoffHeader(
            "ipc",
            owner.kind,
            origin.desc.size,
            exporter=owner.worker,
            desc=origin.desc,
            lease=lease,
            array=array,
        )

    def forward_route(self, origin: Origin, requester: str | None, scheme: str) -> tuple[Route, PoolRecord | None]:
        """:meth:`forward`'s decision without counting it, and the exporter's row (``None``: it left)."""
        owner = self.registry.get(origin.desc.pool)
        row = self.registry.worker_row(requester) if requester else None
        if owner is None or owner.worker != origin.exporter:
            same_host = row is not None and row.host == self.record.host
            return Route(row, "forward-refused" if same_host else None), None
        vmm = owner.kind == "device" and self.pool.vmm
        return self._route(owner, requester, scheme, True, origin.desc.size, vmm), owner

    def settle_forwarded(self, forwarded: list[tuple[str, int]], requester: str | None) -> None:
        """The reply that carried these ``(exporter, lease)`` forwards ended: the exporters end unclaimed ones."""
        by_exporter: dict[str, list[int]] = {}
        for exporter, lease in forwarded:
            by_exporter.setdefault(exporter, []).append(lease)
        for exporter, leases in by_exporter.items():
            owner = self.registry.worker_row(exporter)
            if owner is None:
                continue  # it left: its leases went with it
            try:
                self.importer.link(owner).settle_forwarded(leases)
            except GPUPoolError as e:
                logger.warning(
                    "pool %s: could not tell %s that %d forwarded lease(s) for %s may end: %s",
                    self.pool.uuid,
                    exporter,
                    len(leases),
                    requester,
                    e,
                )

    def stream_route(self, requester: str | None, scheme: str, nbytes: int) -> PoolRecord | None:
        """The requester's row when a copy of ``nbytes`` to it goes over the pipelined copy path, else ``None``.

        That is: a worker of this cluster in another process, over a ``tcp``
        comm, at least ``copy-stream-threshold`` bytes, with this worker's
        copy server running.
        """
        if self.copier is None or scheme != "tcp" or nbytes < max(self.options.copy_stream_threshold, 1):
            return None
        row = self.registry.worker_row(requester) if requester else None
        if row is None or (row.host == self.record.host and row.pid == self.record.pid):
            return None
        if self._is_unreachable(row.worker):
            return None
        return row

    def _is_unreachable(self, worker: str) -> bool:
        until = self._unreachable.get(worker)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        self._unreachable.pop(worker, None)
        return False

    def settle(self, leases: list[int], requester: str | None) -> int:
        """The ``get_data`` reply that carried ``leases`` to ``requester`` ended: end the unclaimed ones.

        An importer claims (and waits for the answer) before it acknowledges
        a reply, so a lease unclaimed now will never be used. A reply whose
        leases were left unclaimed failed at the importer (or never reached
        it): for ``lease-timeout`` seconds its handoffs go as copies instead
        (fallback ``peer-unreachable``), so that Dask's retry of the transfer
        succeeds. Returns how many leases ended.
        """
        n = self.leases.settle(leases)
        if n and requester:
            self._unreachable[requester] = time.monotonic() + self.options.lease_timeout
            logger.warning(
                "pool %s: %d lease(s) sent to %s were never claimed (its transfer failed); its handoffs go "
                "as copies for %.0f s",
                self.pool.uuid,
                n,
                requester,
                self.options.lease_timeout,
            )
        return n

    def export_stream(
        self, holder: Any, buf: Buffer, offset: int, nbytes: int, row: PoolRecord, array: ArrayMeta | None
    ) -> HandoffHeader:
        """Grant ``row``'s worker a stream lease on ``nbytes`` of ``buf`` from ``offset``, to pull.

        ``holder`` stays referenced by the lease until the copy server has
        copied the last chunk out (or the lease expires unpulled). Pending
        GPU work is finished first, as for :meth:`export_ipc`.
        """
        assert self.copier is not None
        if buf.is_device_accessible:
            current_gpu(int(buf.device_id) if int(buf.device_id) >= 0 else (self.pool.device or 0)).sync()
        parts = lanes(nbytes, self.options.copy_chunk_size, self.options.copy_streams)
        leases = [self.leases.grant(Staged(holder, buf, offset + off, n), n, row.worker) for off, n in parts]
        self.handoffs.add(copied_out_bytes=nbytes, streamed_out_bytes=nbytes)
        return HandoffHeader(
            "stream",
            buffer_kind(buf),
            nbytes,
            exporter=self.record.worker,
            lease=leases[0],
            array=array,
            address=self.copier.address,
            lanes=tuple(leases[1:]),
        )

    # -- handoffs: the importer's side -------------------------------------------------

    # -- registry --------------------------------------------------------------------

    def join(self, membership: Membership) -> None:
        """Take the scheduler's answer to our registration: the registry and the cluster's token.

        From now on the broker serves peers presenting the token, and links
        present it. A new token (the scheduler restarted) drops the links
        made with the old one.
        """
        old, self.importer.token = self.importer.token, membership.token
        self.broker.token = membership.token
        if self.copier is not None:
            self.copier.token = membership.token
        if old is not None and old != membership.token:
            self.importer.drop_links()
        self.apply_registry(membership.snapshot)

    def apply_registry(self, update: RegistryUpdate) -> None:
        """Apply a registry change; a peer that left gives back its leases and its mappings go.

        A peer that retired segments (its row's ``retire_below`` grew) gets
        back those mapped here that no import uses (the rest go with their
        last import).
        """
        gone = [r for r in (self.registry.get(p) for p in update.removed) if r is not None]
        self.registry.apply(update)
        for record in update.added:
            mapped = self.mapped.get(record.pool)
            if mapped is not None and record.retire_below > mapped.retire_below:
                self.importer.unmap_retired(mapped, record)
        for record in gone:
            if record.pool == self.pool.uuid:
                continue
            n = self.leases.release_importer(record.worker)
            if n:
                logger.info("pool %s: released %d lease(s) of %s, which left", self.pool.uuid, n, record.worker)
            segmented = self.pool.segmented
            if segmented is not None:  # it closed its mappings before it left (PoolService.close)
                segmented.drop_connection(record.worker)
            self.importer.exporter_left(record)
            self._unreachable.pop(record.worker, None)

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
        below = segmented.retire()
        self.record = dataclasses.replace(self.record, retire_below=below)
        return self.record

    def handoff_stats(self) -> dict[str, Any]:
        """Counters for :func:`dask_gpupool.stats`."""
        segmented = self.pool.segmented
        return {
            **self.handoffs.to_msg(),
            "leases": len(self.leases),
            "lease_bytes": self.leases.nbytes,
            "leases_unclaimed": self.leases.unclaimed,
            "leases_abandoned": self.leases.abandoned_total,
            **self.importer.stats(),
            "pulls": 0 if self.copier is None else self.copier.transfers,
            "segments": 0 if segmented is None else segmented.segments,
            "segments_retiring": 0 if segmented is None else segmented.retiring,
            "staging_bytes": STAGING.nbytes,
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
        self.pool.close()
        logger.info("pool %s: closed", self.pool.uuid)


def _copy_server(options: PoolOptions, pool: Pool, leases: LeaseTable, worker_address: str) -> CopyServer | None:
    """The worker's copy server, listening on the worker's interface; ``None`` when off or not ``tcp``."""
    if not options.copy_chunk_size or not worker_address.startswith("tcp://"):
        return None
    from distributed.comm import get_address_host

    return CopyServer(
        pool.uuid,
        leases,
        get_address_host(worker_address),
        options.broker_timeout,
        options.copy_chunk_size,
    )
