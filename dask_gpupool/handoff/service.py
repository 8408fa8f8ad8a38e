"""Everything dask_gpupool keeps in one worker process, as a plain class.

:class:`PoolService` owns the worker's :class:`~dask_gpupool.memory.pool.Pool`,
its :class:`~dask_gpupool.transport.broker.FdBroker`, the cache of peers' pools it
mapped (:class:`~dask_gpupool.handoff.importer.MappedPools`), its copy of the
registry (:class:`~dask_gpupool.handoff.registry.RegistryView`), the leases it
granted (:class:`~dask_gpupool.handoff.leases.LeaseTable`), its links to exporters
(:class:`~dask_gpupool.transport.link.PeerLink`) and its handoff counters. The worker
plugin is a thin adapter that makes one on setup and closes it on teardown;
tests drive it without a cluster.

Threads: :meth:`start` and :meth:`close` run on the worker's event loop;
:meth:`allocate`, :meth:`map_peer` and :meth:`import_buffer` block and run in
task threads (or an executor). The handoff methods (:meth:`plan`,
:meth:`export_ipc`, :meth:`import_handoff`, :meth:`receive_copy`) run where
Dask serializes: the event loop or its offload thread; the only blocking
call among them is mapping a peer's pool the first time (one broker round
trip, bounded by ``broker-timeout``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from dask_gpupool.config import PoolOptions
from dask_gpupool.errors import (
    DataLostError,
    GPUPoolError,
    NotAMemberError,
    PeerAccessError,
    PoolClosedError,
    PoolExhaustedError,
    ProtocolError,
    UnknownPoolError,
)
from dask_gpupool.handoff import active
from dask_gpupool.handoff.imported import ImportedMemoryResource
from dask_gpupool.handoff.importer import IMPORT_LOCK, MappedPool, MappedPools
from dask_gpupool.handoff.leases import LeaseTable
from dask_gpupool.handoff.registry import RegistryView
from dask_gpupool.handoff.releaser import Releaser
from dask_gpupool.handoff.routing import Route, route
from dask_gpupool.handoff.stats import HandoffStats
from dask_gpupool.memory.buffers import buffer_kind, copy_from_host, copy_to_host, host_buffer
from dask_gpupool.memory.lifetime import keep_until_exit
from dask_gpupool.memory.pool import Pool, PoolStats
from dask_gpupool.memory.topology import LocalDevices, current_gpu, host_identity, local_devices
from dask_gpupool.transport.broker import FdBroker
from dask_gpupool.transport.link import PeerLink
from dask_gpupool.transport.stream import STAGING, CopyServer, Staged, lanes, pull
from dask_gpupool.wire.broker import HandleReply
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
    mapped: MappedPools
    registry: RegistryView
    record: PoolRecord
    devices: LocalDevices
    leases: LeaseTable
    handoffs: HandoffStats
    releaser: Releaser
    copier: CopyServer | None
    _links: dict[str, PeerLink]
    _links_lock: threading.Lock
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
        self.mapped = MappedPools(devices, pool.device if pool.kind != "host" else _own_device(options, devices))
        self.registry = registry if registry is not None else RegistryView()
        self.leases = leases if leases is not None else LeaseTable(options.lease_timeout)
        self.handoffs = HandoffStats()
        self.releaser = Releaser(self._link_to)
        self._unreachable: dict[str, float] = {}  # peer -> until when its handoffs go as copies
        self.copier = copier
        self.token: bytes | None = None  # the cluster's membership token, from the scheduler (join)
        self._links = {}
        self._links_lock = threading.Lock()
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
        leases = LeaseTable(options.lease_timeout, on_drop=_make_current(pool))
        registry = RegistryView()
        host, hostname = host_identity(options.host_id)
        try:
            broker = FdBroker(
                _ExportSide(pool, leases, registry, host), options.broker_dir, options.broker_timeout, pool.uuid
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
            reply, fd = self.link(record).request_pool_fd(pool)
            if reply.kind != record.kind:
                os.close(fd)
                raise ProtocolError(f"pool {pool}: broker says kind {reply.kind!r}, registry {record.kind!r}")
            return fd

        return self.mapped.map(record, fetch)

    def import_buffer(self, desc: BufferDescriptor) -> Buffer:
        """Map a peer's buffer (mapping its pool first if needed). No copy, no lease; the caller owns the Buffer.

        A buffer inside a segment is a view of the segment's mapping, which
        stays mapped after the view is closed (like every segment import).
        """
        mapped = self.map_peer(desc.pool)
        if not desc.extent:
            return mapped.import_buffer(desc)
        key, raw, ptr = mapped.acquire(desc, claimed=False, segment_fd=self._segment_fetcher(mapped.record, desc))
        return _view(ImportedMemoryResource(raw, key, mapped, lambda event, segment: None), mapped, ptr, desc.size)

    def _segment_fetcher(self, record: PoolRecord, desc: BufferDescriptor) -> Callable[[], int]:
        """What fetches the fd of ``desc``'s VMM segment from its owner's broker (the caller closes the fd)."""

        def fetch() -> int:
            reply, fd = self.link(record).request_segment_fd(desc.pool, desc.segment)
            if reply.size < desc.extent:
                os.close(fd)
                raise ProtocolError(
                    f"pool {desc.pool}: segment {desc.segment} has {reply.size} bytes, the descriptor {desc.extent}"
                )
            return fd

        return fetch

    def link(self, record: PoolRecord) -> PeerLink:
        """This worker's connection to ``record``'s broker, opened on first use (or after it broke)."""
        with self._links_lock:
            link = self._links.get(record.broker)
            if link is not None and link.alive:
                return link
        if self.token is None:
            raise NotAMemberError(f"pool {self.pool.uuid}: not registered with the scheduler yet (no cluster token)")
        # A link opened again after one broke first resyncs the leases still held from this exporter.
        live = self.releaser.snapshot(record.broker)
        link = PeerLink(
            record.broker, self.options.broker_timeout, self.token, self.record.worker, live, expected_pid=record.pid
        )
        with self._links_lock:
            old = self._links.get(record.broker)
            if old is not None and old.alive:
                link.close()
                return old
            self._links[record.broker] = link
        return link

    def _link_to(self, broker: str) -> PeerLink | None:
        """The live link to the exporter whose broker is ``broker`` (the releaser's :data:`LinkFactory`)."""
        record = next((r for r in self.registry.records() if r.broker == broker), None)
        if record is None or self._closed:
            return None
        return self.link(record)

    def _claim(self, record: PoolRecord, link: PeerLink, leases: list[int]) -> None:
        """Claim ``leases`` of ``record``'s pool and wait for the exporter's answer. Blocking.

        Returns once every lease is held (and in the live set that a resync
        sends). A broken link is opened again once.

        Raises
        ------
        DataLostError
            If the exporter refused a lease (it ended) or cannot be reached.
        """
        for attempt in (0, 1):
            epoch = self.releaser.epoch(record.broker)
            try:
                refused = link.claim(leases, functools.partial(self.releaser.hold, record.broker, epoch=epoch))
            except GPUPoolError as e:
                if attempt:
                    raise DataLostError(f"claiming leases {leases} of worker {record.worker}: {e}") from e
                try:
                    link = self.link(record)
                except GPUPoolError as e2:
                    raise DataLostError(f"claiming leases {leases} of worker {record.worker}: {e2}") from e2
                continue
            if not refused:
                return
            if attempt:
                raise DataLostError(
                    f"worker {record.worker} refused lease(s) {refused} on pool {record.pool}: they ended "
                    "(the reply that carried them failed, or they were not granted to this worker)"
                )
            leases = refused  # once more: a resync on another link may have raced the claim
            link = self.link(record)

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
        row = self.registry.worker_row(requester) if requester else None
        owned = self.pool.owns(buf)
        return route(
            self.record,
            requester,
            row,
            scheme,
            pool_open=not (self._closed or self.pool.closed),
            owned=owned,
            unreachable=row is not None and self._is_unreachable(row.worker),
            import_size=self.pool.import_size(buf) if owned and self.pool.kind == "device" else 0,
            import_limit=self.options.effective_import_limit(self.pool.vmm),
        )

    def export_ipc(self, holder: Any, buf: Buffer, row: PoolRecord, array: ArrayMeta | None) -> HandoffHeader:
        """Grant ``row``'s worker a lease on ``buf`` and describe it.

        ``holder`` (``buf`` or an object that keeps it alive) stays referenced
        by the lease until the importer releases it. Pending GPU work is
        finished first (``ready="synced"``), so the importer may read at once.
        """
        desc = self.pool.export(buf)
        if self.pool.device is not None:
            current_gpu(self.pool.device).sync()
        lease = self.leases.grant(_Exported(holder, buf), buf.size, row.worker, desc.segment)
        self.handoffs.add(exports=1)
        return HandoffHeader(
            "ipc", self.pool.kind, buf.size, exporter=self.record.worker, desc=desc, lease=lease, array=array
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

    def import_handoff(self, header: HandoffHeader) -> Buffer:
        """Map a handed-over buffer; fall back to a host copy from the exporter if that fails.

        Returns a Buffer owned by the caller: closing it (or dropping the last
        reference) closes the import and releases the lease.

        Raises
        ------
        DataLostError
            If neither the import nor the copy can be had: names pool and worker.
        """
        desc = header.desc
        assert desc is not None and header.path == "ipc"
        record = self.registry.get(desc.pool)
        if record is not None and record.pid == os.getpid():
            raise ProtocolError(f"handoff header: pool {desc.pool} is this process's own; it is never handed over")
        if record is None or record.worker != header.exporter:
            raise DataLostError(
                f"pool {desc.pool} of worker {header.exporter} is not registered (its worker left?); "
                f"lease {header.lease} cannot be read"
            )
        try:
            link = self.link(record)
        except GPUPoolError as e:
            raise DataLostError(f"pool {desc.pool} of worker {record.worker}: {e}") from e
        try:
            mapped = self.map_peer(desc.pool)
            key, raw, ptr = mapped.acquire(desc, segment_fd=self._segment_fetcher(record, desc))
        except Exception as e:  # GPUPoolError, CUDA errors: the copy path still works
            self.handoffs.fallback(record.worker, "import-failed", self.record.worker, f"{type(e).__name__}: {e}")
            return self.fetch_copy(header, record, link)
        lease = header.lease
        broker = record.broker

        def closed(event: Any, segment: tuple[int, int] | None) -> None:
            self.releaser.put(broker, lease, event, (segment,) if segment else ())
            if mapped.orphaned and mapped.imports == 0:
                self.mapped.forget(mapped.record.pool)

        buf = _view(ImportedMemoryResource(raw, key, mapped, closed), mapped, ptr, desc.size)
        try:
            # Nothing is read from the memory before the exporter acknowledged the lease: a refused
            # lease has ended, and its memory may already hold another buffer.
            self._claim(record, link, [lease])
        except BaseException:
            buf.close()
            raise
        self.handoffs.add(imports=1, zero_copy_bytes=desc.size)
        logger.debug(
            "lease %d of %s: mapped %d bytes at %#x (GPU %s)",
            lease,
            record.worker,
            desc.size,
            ptr,
            mapped.device,
        )
        return buf

    def fetch_copy(self, header: HandoffHeader, record: PoolRecord, link: PeerLink) -> Buffer:
        """Ask the exporter for a host copy of a leased buffer and land it in this pool."""
        try:
            self._claim(record, link, [header.lease])  # ours now: only this worker may release it
            reply, fd = self.link(record).fetch_copy(header.lease)
        except GPUPoolError as e:
            raise DataLostError(
                f"lease {header.lease} on pool {record.pool} of worker {record.worker} cannot be read: {e}"
            ) from e
        try:
            with mmap.mmap(fd, reply.size, prot=mmap.PROT_READ) if reply.size else contextlib.nullcontext(b"") as m:
                buf = self.receive_copy(header.kind, memoryview(m), record.worker)
        finally:
            os.close(fd)
        self.releaser.put(record.broker, header.lease)
        return buf

    def receive_copy(self, kind: str, data: Any, sender: str, need: str = "any") -> Buffer:
        """Land a host copy in this worker's pool (so it can be handed on zero-copy).

        Parameters
        ----------
        kind : str
            Where the data lived at the sender.
        data : bytes-like
            The bytes.
        sender : str
            The sender's address (for stats and warnings).
        need : {"any", "host", "device"}
            Where the value must be readable (a NumPy array needs host memory,
            a CuPy array GPU-accessible memory). A pool that does not fit is
            passed over for memory outside it.

        When the pool is full the bytes go to memory outside it (GPU memory for
        ``device`` pools, host memory otherwise), counted as fallback
        ``receiver-pool-full``.
        """
        view = memoryview(data).cast("B")
        n = view.nbytes
        buf = self._landing(n, sender, need)
        copy_from_host(buf, view)
        self.handoffs.add(copied_bytes=n)
        return buf

    def pull_copy(self, header: HandoffHeader, need: str = "any") -> Buffer:
        """Pull a ``stream`` handoff from the exporter's copy server into this worker's pool. Blocking.

        Lands like :meth:`receive_copy`. Returns a Buffer owned by the caller.

        Raises
        ------
        DataLostError
            If the exporter left, refused (lease ended) or the transfer broke;
            names lease, pool and worker.
        """
        assert header.path == "stream"
        record = self.registry.worker_row(header.exporter)
        if record is None:
            raise DataLostError(
                f"worker {header.exporter} is not registered (it left?); lease {header.lease} cannot be pulled"
            )
        if self.token is None:
            raise NotAMemberError(f"pool {self.pool.uuid}: not registered with the scheduler yet (no cluster token)")
        buf = self._landing(header.nbytes, header.exporter, need)
        try:
            leases = [header.lease, *header.lanes]
            pull(header.address, record.pool, leases, self.token, buf, self.options.broker_timeout)
        except BaseException:
            buf.close()
            raise
        self.handoffs.add(copied_bytes=header.nbytes, streamed_bytes=header.nbytes)
        return buf

    def _landing(self, n: int, sender: str, need: str) -> Buffer:
        """Memory for a copy of ``n`` bytes: this pool if it fits ``need`` and has room, else outside it."""
        fits = (
            need == "any"
            or (need == "host" and self.pool.kind != "device")
            or (need == "device" and self.pool.kind != "host")
        )
        if not fits:
            return _outside_pool(self.pool, n, need)
        try:
            return self.pool.allocate(n)
        except PoolExhaustedError as e:
            self.handoffs.fallback(sender, "receiver-pool-full", self.record.worker, str(e))
            return _outside_pool(self.pool, n, need)

    # -- registry --------------------------------------------------------------------

    def join(self, membership: Membership) -> None:
        """Take the scheduler's answer to our registration: the registry and the cluster's token.

        From now on the broker serves peers presenting the token, and links
        present it. A new token (the scheduler restarted) drops the links
        made with the old one.
        """
        old, self.token = self.token, membership.token
        self.broker.token = membership.token
        if self.copier is not None:
            self.copier.token = membership.token
        if old is not None and old != membership.token:
            with self._links_lock:
                links, self._links = list(self._links.values()), {}
            for link in links:
                link.close()
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
                self._unmap_retired(mapped, record)
        for record in gone:
            if record.pool == self.pool.uuid:
                continue
            n = self.leases.release_importer(record.worker)
            if n:
                logger.info("pool %s: released %d lease(s) of %s, which left", self.pool.uuid, n, record.worker)
            segmented = self.pool.segmented
            if segmented is not None:  # it closed its mappings before it left (PoolService.close)
                segmented.drop_connection(record.worker)
            with self._links_lock:
                link = self._links.pop(record.broker, None)
            if link is not None:
                link.close()
            self.releaser.forget(record.broker)
            self._unreachable.pop(record.worker, None)
            mapped = self.mapped.get(record.pool)
            if mapped is not None:
                with IMPORT_LOCK:
                    mapped.orphaned = True
                    idle = mapped.imports == 0
                if idle:
                    self.mapped.forget(record.pool)

    def _unmap_retired(self, mapped: MappedPool, record: PoolRecord) -> None:
        raws, released = mapped.retire(record.retire_below)
        try:
            event = mapped.close_segment_imports(raws)
        except Exception:
            logger.exception("pool %s: closing retired segment imports failed", record.pool)
            return
        with self._links_lock:
            link = self._links.get(record.broker)
        if released and link is not None:
            self.releaser.put(record.broker, 0, event, tuple(released))
        elif event is not None:
            event.close()
        if raws:
            logger.info("pool %s: unmapped %d retired segment(s) of %s", record.pool, len(raws), record.worker)

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
            "imports_held": self.releaser.live(),
            "resyncs": self.releaser.resyncs,
            "mapped_pools": len(self.mapped),
            "links": sum(link.alive for link in self._links.values()),
            "pulls": 0 if self.copier is None else self.copier.transfers,
            "segments": 0 if segmented is None else segmented.segments,
            "segments_retiring": 0 if segmented is None else segmented.retiring,
            "segments_released": self.releaser.segments_sent,
            "staging_bytes": STAGING.nbytes,
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
        active.remove(self)
        if isinstance(self.broker.handler, _ExportSide):
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
        self.releaser.close()
        # Mappings before links: an exporter frees a retired segment once the connection that mapped
        # it closes, so the segment imports here must be closed by then.
        self.mapped.close_all()
        with self._links_lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
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


def _outside_pool(pool: Pool, nbytes: int, need: str = "any") -> Buffer:
    """Memory for a copy that does not go to the pool: the device's default pool or host memory."""
    device = pool.device if pool.device is not None else (0 if local_devices() else None)
    if device is not None and (need == "device" or (need == "any" and pool.kind == "device")):
        dev = current_gpu(device)
        return dev.memory_resource.allocate(nbytes, stream=dev.default_stream)
    return host_buffer(bytearray(nbytes))


def _make_current(pool: Pool) -> Any:
    def make_current() -> None:
        if pool.device is not None:
            current_gpu(pool.device)

    return make_current


class _Exported:
    """What an IPC lease keeps alive: the value handed over (``holder``) and the pool buffer under it."""

    __slots__ = ("buf", "holder")

    def __init__(self, holder: Any, buf: Buffer) -> None:
        self.holder, self.buf = holder, buf


class _ExportSide:
    """The :class:`~dask_gpupool.transport.broker.BrokerHandler` of a worker: its pool's fd and its leases.

    Runs on the broker's thread. Importers are worker addresses, accepted
    (:meth:`identify`) only when this worker's copy of the registry has a row
    for that worker on this host whose pid is the connecting process's.
    """

    def __init__(self, pool: Pool, leases: LeaseTable, registry: RegistryView, host: str) -> None:
        self._pool = pool
        self._leases = leases
        self._registry = registry
        self._host = host
        self.closing = False  # the broker closes every connection: peers did not unmap anything

    def thread_started(self) -> None:
        _make_current(self._pool)()

    def identify(self, importer: str, pid: int) -> bool:
        row = self._registry.worker_row(importer)
        # pid 0: the peer lives in another pid namespace; the token and the registry row must do.
        return row is not None and row.host == self._host and (pid == 0 or row.pid == pid)

    def pool_handle(self, pool: str) -> tuple[int, HandleReply] | None:
        if pool != self._pool.uuid or self._pool.closed:
            return None
        return self._pool.allocation_handle(), HandleReply(self._pool.uuid, self._pool.kind, self._pool.max_size)

    def segment_handle(self, pool: str, segment: int, importer: str) -> tuple[int, HandleReply]:
        if pool != self._pool.uuid:
            raise UnknownPoolError(f"pool {pool} is not served by this broker")
        fd, size = self._pool.segment_fd(segment)
        return fd, HandleReply(self._pool.uuid, self._pool.kind, size, segment)

    def claim(self, leases: Iterable[int], importer: str) -> list[int]:
        segments: list[int] = []
        refused = self._leases.claim(leases, importer, segments)
        if segments:
            self._pool.resource.note_claims(segments, importer)
        return refused

    def release(self, leases: Iterable[int], importer: str) -> None:
        self._leases.release(leases, importer)

    def resync(self, leases: set[int], importer: str) -> int:
        n = self._leases.resync(importer, leases)
        if n:
            logger.info("pool %s: %s resynced; ended %d lease(s) it had released", self._pool.uuid, importer, n)
        return n

    def segments_released(self, segments: tuple[tuple[int, int], ...], importer: str) -> None:
        segmented = self._pool.segmented
        if segmented is not None:
            segmented.note_released(list(segments), importer)

    def importer_exited(self, importer: str) -> None:
        n = self._leases.release_importer(importer)
        if n:
            logger.info("pool %s: importer %s exited; released its %d lease(s)", self._pool.uuid, importer, n)
        segmented = self._pool.segmented
        if segmented is not None and not self.closing:
            segmented.drop_connection(importer)

    def copy_out(self, lease: int, importer: str) -> tuple[int, int]:
        holder = self._leases.holder_for(lease, importer)
        if holder is None:
            raise DataLostError(f"lease {lease} on pool {self._pool.uuid} has ended (or is not {importer}'s)")
        if isinstance(holder, Staged):  # a stream lease: its span of the buffer
            buf, offset, n = holder.buf, holder.offset, holder.nbytes
        else:
            buf, offset, n = holder.buf, 0, int(holder.buf.size)
        fd = os.memfd_create("dask-gpupool-copy", os.MFD_CLOEXEC)
        try:
            if n:
                os.ftruncate(fd, n)
                with mmap.mmap(fd, n) as m:
                    copy_to_host(buf, offset, n, out=m)
        except BaseException:
            os.close(fd)
            raise
        return fd, n

    def tick(self) -> None:
        self._leases.overdue()


def _own_device(options: PoolOptions, devices: LocalDevices) -> int | None:
    """The GPU a ``host``-pool worker would use for CUDA pools it maps, if any."""
    if not devices:
        return None
    try:
        return devices.resolve(options.device)
    except Exception:
        return None


def _view(resource: ImportedMemoryResource, mapped: MappedPool, ptr: int, size: int) -> Buffer:
    """The Buffer over an import (``resource`` runs its close); stream-ordered on the importer's GPU."""
    from cuda.core import Buffer

    if resource.is_device_accessible and mapped.device is not None:
        dev = current_gpu(mapped.device)
        return Buffer.from_handle(ptr, size, mr=resource, stream=dev.default_stream)
    return Buffer.from_handle(ptr, size, mr=resource)
