"""The importing side of one worker: links to exporters, peers' pools mapped here, claims and releases.

:class:`Importer` turns a :class:`~dask_gpupool.wire.handoff.HandoffHeader` into
a Buffer of this process (:meth:`Importer.import_handoff`: map, claim, and on
failure a host copy) and owns what that needs: the links to exporters'
brokers (:class:`~dask_gpupool.handoff.links.ExporterLinks`), the peers'
pools mapped here (:class:`~dask_gpupool.handoff.links.MappedPools`), the
leases held here (:class:`~dask_gpupool.handoff.held.HeldLeases`) and their
releases (:class:`~dask_gpupool.handoff.imported.Releaser`), and the copies
that land here instead (:class:`~dask_gpupool.handoff.copies.Copies`, which
callers use directly). The :class:`~dask_gpupool.handoff.service.PoolService`
makes one and closes it; tests can drive one with a registry view and a pool
of their own.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask_gpupool.config import PoolOptions
from dask_gpupool.errors import (
    DataLostError,
    GPUPoolError,
    PeerAccessError,
    PoolClosedError,
    ProtocolError,
    UnknownPoolError,
)
from dask_gpupool.handoff.copies import Copies
from dask_gpupool.handoff.deferred import claim_later
from dask_gpupool.handoff.held import HeldLeases
from dask_gpupool.handoff.imported import ImportedMemoryResource, Origin, Releaser
from dask_gpupool.handoff.links import ExporterLinks, MappedPools
from dask_gpupool.handoff.mapped_pool import IMPORT_LOCK, MappedPool
from dask_gpupool.handoff.registry import RegistryView
from dask_gpupool.handoff.stats import HandoffStats
from dask_gpupool.memory.pool import Pool
from dask_gpupool.memory.topology import LocalDevices, current_gpu
from dask_gpupool.transport.link import PeerLink
from dask_gpupool.wire.handoff import BufferDescriptor, HandoffHeader, LeaseQuery, LeaseQueryReply
from dask_gpupool.wire.registry import PoolRecord

if TYPE_CHECKING:
    from cuda.core import Buffer

__all__ = ["Importer"]

logger = logging.getLogger(__name__)


class Importer:
    """What one worker holds to receive handed-over values.

    Parameters
    ----------
    options : PoolOptions
    pool : Pool
        This worker's own pool: copies land in it; it is never imported.
    worker : str
        This worker's address (links present it; counters and warnings name it).
    host : str
        This worker's host identity: only pools of the same host are mapped.
    registry : RegistryView
        This worker's copy of the registry (read only here).
    devices : LocalDevices
        The GPUs this process sees.
    handoffs : HandoffStats
        The worker's counters (imports, zero-copy and copied bytes, fallbacks).
    take_back : callable
        ``take_back(header)``: the buffer of a value of this worker's own pool that a
        peer passed back (:meth:`Exports.take_back <dask_gpupool.handoff.exporter.Exports.take_back>`).

    Attributes
    ----------
    mapped : MappedPools
        Peers' pools mapped here (owned; closed by :meth:`close`).
    held : HeldLeases
        The leases held here, imports open and releases done, per exporter.
    releaser : Releaser
        Sends lease releases for buffers imported here (owned; stopped by :meth:`close`).
    links : ExporterLinks
        The links to exporters' brokers, and claims over them (owned; closed by :meth:`close`).
    copies : Copies
        Lands the values that come as copies (:meth:`Copies.receive_copy
        <dask_gpupool.handoff.copies.Copies.receive_copy>`, :meth:`Copies.pull_copy
        <dask_gpupool.handoff.copies.Copies.pull_copy>`).
    closed : bool
    """

    options: PoolOptions
    pool: Pool
    worker: str
    host: str
    registry: RegistryView
    handoffs: HandoffStats
    mapped: MappedPools
    held: HeldLeases
    releaser: Releaser
    links: ExporterLinks
    copies: Copies
    take_back: Callable[[HandoffHeader], Buffer]
    closed: bool
    #: Bytes of peers' pools imported here under a lease and open now (borrowed: their exporter owns them).
    borrowed_bytes: int

    def __init__(
        self,
        options: PoolOptions,
        pool: Pool,
        worker: str,
        host: str,
        registry: RegistryView,
        devices: LocalDevices,
        handoffs: HandoffStats,
        take_back: Callable[[HandoffHeader], Buffer],
    ) -> None:
        self.options = options
        self.pool = pool
        self.worker = worker
        self.host = host
        self.registry = registry
        self.handoffs = handoffs
        self.mapped = MappedPools(devices, pool.device if pool.kind != "host" else _own_device(options, devices))
        self.held = HeldLeases()
        self.releaser = Releaser(self._link_to, self.held)  # asks self.links, made next, once a release is queued
        self.links = ExporterLinks(options, pool, worker, self.held)
        self.copies = Copies(options, pool, worker, registry, handoffs, self.links, self.releaser)
        self.take_back = take_back
        self.closed = False
        self.borrowed_bytes = 0

    def map_peer(self, pool: str) -> MappedPool:
        """Map a same-host peer's pool into this process, once. Blocking.

        Raises
        ------
        UnknownPoolError
            If ``pool`` is not in this worker's copy of the registry, or left
            it while it was being mapped (then it is unmapped once idle).
        PeerAccessError
            If the pool is this worker's own, lives on another host, or its
            memory cannot be reached from here.
        PeerLostError
            If the owner's broker cannot be reached.
        """
        if self.closed:
            raise PoolClosedError(f"pool service of {self.worker} is closed")
        mapped = self.mapped.get(pool)
        if mapped is not None:
            return mapped
        record = self.registry.get(pool)
        if record is None:
            raise UnknownPoolError(f"pool {pool} is not registered (known: {len(self.registry)} pools)")
        if record.pool == self.pool.uuid:
            raise PeerAccessError(f"pool {pool} is this worker's own; use it directly")
        if record.host != self.host:
            raise PeerAccessError(
                f"pool {pool} of {record.worker} is on host {record.host!r}, this worker on {self.host!r}"
            )

        def fetch() -> int:
            reply, fd = self.links.link(record).request_pool_fd(pool)
            if reply.kind != record.kind:
                os.close(fd)
                raise ProtocolError(f"pool {pool}: broker says kind {reply.kind!r}, registry {record.kind!r}")
            return fd

        mapped = self.mapped.map(record, fetch)
        if self.registry.get(pool) is None:
            # Its owner left while the fd was fetched: the removal (exporter_left) found nothing mapped, and
            # nothing else would ever unmap it. The row goes before exporter_left runs (apply_registry), so either
            # that finds this mapping or this check finds the row gone.
            self._orphan(mapped)
            raise UnknownPoolError(f"pool {pool} of {record.worker} left the registry while it was mapped here")
        return mapped

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
            reply, fd = self.links.link(record).request_segment_fd(desc.pool, desc.segment)
            if reply.size < desc.extent:
                os.close(fd)
                raise ProtocolError(
                    f"pool {desc.pool}: segment {desc.segment} has {reply.size} bytes, the descriptor {desc.extent}"
                )
            return fd

        return fetch

    def _claim(self, record: PoolRecord, link: PeerLink, leases: list[int]) -> None:
        """Claim ``leases`` of ``record``'s pool (:meth:`ExporterLinks.claim
        <dask_gpupool.handoff.links.ExporterLinks.claim>`), timed. Blocking."""
        start = time.perf_counter()
        self.links.claim(record, link, leases)
        self.handoffs.timed("claim", time.perf_counter() - start)

    def _link_to(self, broker: str) -> PeerLink | None:
        """The live link to the exporter whose broker is ``broker`` (the releaser's :data:`LinkFactory`)."""
        record = next((r for r in self.registry.records() if r.broker == broker), None)
        if record is None or self.closed:
            return None
        return self.links.link(record)

    def import_handoff(self, header: HandoffHeader, sender: str | None = None) -> Buffer:
        """Map a handed-over buffer; fall back to a host copy from the exporter if that fails.

        Returns a Buffer owned by the caller: closing it (or dropping the last
        reference) closes the import and releases the lease. A value of this
        worker's own pool that came back is taken back instead (:attr:`take_back`).

        ``sender``: the worker whose message is being read (the address this
        worker connected to), when the caller knows it
        (:data:`~dask_gpupool.handoff.deferred.SENDER`). A lease claimed by its
        reply (``claim="reply"``) is held here at once only when the header
        names that worker as its exporter; otherwise it is claimed over the
        exporter's broker, which refuses a lease it never granted (a lying or
        confused sender).

        Raises
        ------
        DataLostError
            If neither the import nor the copy can be had: names pool and worker.
        """
        desc = header.desc
        assert desc is not None and header.path == "ipc"
        if header.exporter == self.worker:
            return self.take_back(header)
        record = self.registry.get(desc.pool)
        if record is not None and record.pid == os.getpid():
            raise ProtocolError(f"handoff header: pool {desc.pool} is this process's own; it is never handed over")
        if record is None or record.worker != header.exporter:
            raise DataLostError(
                f"pool {desc.pool} of worker {header.exporter} is not registered (its worker left?); "
                f"lease {header.lease} cannot be read"
            )
        if not self.held.begin(record.broker, header.lease):
            # A header sent again (a member replaying a descriptor it sent before, for another key): claimed again
            # (the exporter answers a second claim as held), its import's release would end the lease while the
            # first import still maps the memory, which the exporter may then reuse.
            raise DataLostError(
                f"lease {header.lease} of worker {record.worker} is imported here already (or was released): "
                "a header naming it again is refused"
            )
        try:
            return self._import_leased(header, record, sender)
        except BaseException:
            self.held.end_import(record.broker, header.lease)  # its release, if any, was queued already
            raise

    def _import_leased(self, header: HandoffHeader, record: PoolRecord, sender: str | None) -> Buffer:
        """:meth:`import_handoff` of a lease :meth:`HeldLeases.begin <dask_gpupool.handoff.held.HeldLeases.begin>`
        admitted: map it and claim it, or fetch a host copy. The Buffer is the caller's."""
        desc = header.desc
        assert desc is not None
        try:
            link = self.links.link(record)
        except GPUPoolError as e:
            raise DataLostError(f"pool {desc.pool} of worker {record.worker}: {e}") from e
        lease = header.lease
        broker = record.broker
        # Claimed by the reply: held here at once, no round trip; the exporter learns it from the reply's
        # "OK" (or asks, if the reply failed there). Refused: the exporter was told this worker does not hold it.
        # None: a resync with the exporter is open, or the header names another worker than the one whose reply is
        # read (``sender``): the exporter's broker claims it (below), and refuses a lease it never granted.
        by_reply = header.claim == "reply" and sender == header.exporter
        held_here = self.held.hold_here(broker, lease) if by_reply else None
        if held_here is False:
            raise DataLostError(
                f"lease {lease} of worker {record.worker} was refused here: its reply failed at the exporter, "
                "which was told this worker does not hold it"
            )
        start = time.perf_counter()
        try:
            mapped = self.map_peer(desc.pool)
            key, raw, ptr = mapped.acquire(desc, segment_fd=self._segment_fetcher(record, desc))
        except Exception as e:  # GPUPoolError, CUDA errors: the copy path still works
            known = self.mapped.get(desc.pool)
            released = bool(desc.extent) and known is not None and known.has_released(desc.segment)
            why = f"{type(e).__name__}: {e}"
            if released:
                self.handoffs.fallback(record.worker, "retired-segment", self.worker, why)
            else:
                self.handoffs.fallback(record.worker, "import-failed", self.worker, why)
            try:
                return self.copies.fetch_copy(header, record, link)  # a held lease is claimed again, then released
            except BaseException:
                if held_here:  # held here, never mapped: give it back (twice is harmless)
                    self.releaser.put(broker, lease, unmapped=True)
                raise

        def closed(event: Any, segment: tuple[int, int] | None) -> None:
            self._borrow(-desc.size)
            self.releaser.put(broker, lease, event, (segment,) if segment else ())
            if mapped.orphaned and mapped.imports == 0:
                self.mapped.forget(mapped.record.pool)

        origin = Origin(record.worker, desc, lease)
        try:
            buf = _view(ImportedMemoryResource(raw, key, mapped, closed, origin), mapped, ptr, desc.size)
        except BaseException:
            if held_here:
                self.releaser.put(broker, lease)  # held, never used: give it back
            raise
        self._borrow(desc.size)
        self.handoffs.timed("import", time.perf_counter() - start)
        if not held_here:
            # Nothing is read from the memory before the exporter acknowledged the lease: a refused lease has
            # ended, and its memory may already hold another buffer. Inside a worker's comm read the claim waits
            # for the message's other claims and runs in a thread before Dask sees the message (deferred.py).

            def abandon() -> None:
                if not self.held.holds(broker, lease):  # not acknowledged: the exporter did not count it
                    mapped.unclaim(key)
                buf.close()

            claim_later(
                record.broker,
                lease,
                functools.partial(self._claim, record, link),
                abandon,
                lambda: self.links.link(record).transfer_failed(),  # the live link: the claim may have reopened it
            )
        self.handoffs.add(imports=1, zero_copy_bytes=desc.size)
        logger.debug(
            "lease %d of %s: mapped %d bytes at %#x (GPU %s)", lease, record.worker, desc.size, ptr, mapped.device
        )
        return buf

    # -- what the registry says --------------------------------------------------------

    def unmap_retired(self, mapped: MappedPool, record: PoolRecord) -> None:
        """Close the imports of ``record``'s retired (or reclaimed) segments that no buffer uses; tell the exporter."""
        raws, released = mapped.retire(record.retire_below, record.reclaim)
        try:
            event = mapped.close_segment_imports(raws)
        except Exception:
            logger.exception("pool %s: closing retired segment imports failed", record.pool)
            return
        link = self.links.get(record.broker)
        if released and link is not None:
            self.releaser.put(record.broker, 0, event, tuple(released))
        elif event is not None:
            event.close()
        if raws:
            logger.info("pool %s: unmapped %d retired segment(s) of %s", record.pool, len(raws), record.worker)

    def exporter_left(self, record: PoolRecord) -> None:
        """``record``'s worker left the cluster: close its link, forget its leases here, unmap its pool when idle."""
        self.links.close(record.broker)
        self.releaser.forget(record.broker)
        mapped = self.mapped.get(record.pool)
        if mapped is not None:
            self._orphan(mapped)

    def _orphan(self, mapped: MappedPool) -> None:
        """``mapped``'s owner left: unmap it now if no import uses it, else when its last import closes."""
        with IMPORT_LOCK:
            mapped.orphaned = True
            idle = mapped.imports == 0
        if idle:
            self.mapped.forget(mapped.record.pool)

    def answer_lease_query(self, query: LeaseQuery) -> LeaseQueryReply:
        """An exporter asks which of the leases it sent in a failed reply this worker holds.

        Answered by :meth:`Releaser.answer <dask_gpupool.handoff.imported.Releaser.answer>`: the
        leases not held are refused for good, atomically with the answer.

        Raises
        ------
        PoolClosedError
            If this worker's service is closed: its imports may still be closing, so no answer is safe.
        """
        if self.closed:
            raise PoolClosedError(f"pool service of {self.worker} is closed")
        # refusals are kept even for an exporter this worker's registry does not know yet: its row may come
        # before a header of that reply is deserialized (HeldLeases bounds the refusals and the exporters kept)
        return LeaseQueryReply(tuple(self.releaser.answer(query.exporter, query.leases)))

    # -- lifecycle ---------------------------------------------------------------------

    def _borrow(self, nbytes: int) -> None:
        with IMPORT_LOCK:  # closed from any thread (the Buffer's deallocation)
            self.borrowed_bytes += nbytes

    def stats(self) -> dict[str, int]:
        """The importer's part of :func:`dask_gpupool.stats`."""
        return {
            "borrowed_bytes": self.borrowed_bytes,
            "imports_held": self.held.live(),
            "resyncs": self.releaser.resyncs,
            "mapped_pools": len(self.mapped),
            "links": self.links.alive,
            "segments_released": self.releaser.segments_sent,
        }

    def close(self) -> None:
        """Send the releases queued here, unmap peers' pools, then close the links. Idempotent.

        Mappings before links: an exporter frees a retired segment once the
        connection that mapped it closes, so the segment imports here must be
        closed by then.
        """
        self.closed = True
        self.releaser.close()
        self.mapped.close_all()
        self.links.drop()


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
