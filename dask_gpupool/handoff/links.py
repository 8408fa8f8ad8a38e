"""The importer's hold on each exporter: the link to its broker, with the lease claims sent over it
(:class:`ExporterLinks`), and its pool mapped into this process, once (:class:`MappedPools`).

One :class:`~dask_gpupool.transport.link.PeerLink` per exporter's broker, opened on first use and again after it
broke: a new link first resyncs the leases still held from that exporter (the live set of
:class:`~dask_gpupool.handoff.held.HeldLeases`). Every link presents the cluster's membership token.
:meth:`ExporterLinks.claim` claims leases over a link and waits for the exporter's answer.

A peer's pool is mapped at most once per process and kept by a strong reference in :class:`MappedPools`, keyed by
pool UUID. Both rules come from measurements on the project's H200s (the team's GPU notes, outside this
repository): importing the same CUDA pool twice returns the same driver pool but each wrapper destroys it on close,
and cuda.core's own registry holds only weak references. One mapping is a
:class:`~dask_gpupool.handoff.mapped_pool.MappedPool`; every CUDA import and every close of an imported object runs
under :data:`~dask_gpupool.handoff.mapped_pool.IMPORT_LOCK`.

A peer's *pinned* pool is imported at most once per process, ever: on the H100 and H200 machines (driver 580,
cuda-core 1.2.2) a pinned pool imported, closed and imported again in the same process hands out buffers whose first
read kills the process (SIGSEGV on the CPU, and from the GPU), while the first import reads fine
(``scripts/probes/pinned_workers.py``). So :meth:`MappedPools.unmap` parks a pinned mapping instead of closing it,
and the next :meth:`MappedPools.map` of that pool takes it back; :meth:`MappedPools.close_all` closes parked
mappings with the rest.

The :class:`~dask_gpupool.handoff.importer.Importer` owns one of each.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable

from dask_gpupool.config import PoolOptions
from dask_gpupool.errors import DataLostError, GPUPoolError, NotAMemberError, PoolClosedError, UnknownPoolError
from dask_gpupool.handoff.held import HeldLeases
from dask_gpupool.handoff.mapped_pool import IMPORT_LOCK, MappedPool
from dask_gpupool.memory.pool import Pool
from dask_gpupool.memory.topology import LocalDevices
from dask_gpupool.transport.link import PeerLink
from dask_gpupool.wire.registry import PoolRecord

__all__ = [
    "IMPORT_LOCK",
    "ExporterLinks",
    "MappedPool",
    "MappedPools",
]

logger = logging.getLogger(__name__)


# -- links to exporters' brokers ---------------------------------------------------------------------------------------


class ExporterLinks:
    """One worker's connections to exporters' brokers, one per broker, and its claims over them.

    Parameters
    ----------
    options : PoolOptions
        ``broker-timeout`` bounds every exchange on a link.
    pool : Pool
        This worker's own pool (errors name it).
    worker : str
        This worker's address (links present it).
    held : HeldLeases
        The importer's leases: a new link resyncs its live set, claimed leases are added to it.

    Attributes
    ----------
    token : bytes or None
        The cluster's membership token, which links present (set by the service's ``join``).
    """

    options: PoolOptions
    pool: Pool
    worker: str
    held: HeldLeases
    token: bytes | None
    _links: dict[str, PeerLink]
    _links_lock: threading.Lock

    def __init__(self, options: PoolOptions, pool: Pool, worker: str, held: HeldLeases) -> None:
        self.options = options
        self.pool = pool
        self.worker = worker
        self.held = held
        self.token = None
        self._links = {}
        self._links_lock = threading.Lock()
        self._opening: dict[str, threading.Lock] = {}

    def link(self, record: PoolRecord) -> PeerLink:
        """This worker's connection to ``record``'s broker, opened on first use (or after it broke).

        One thread at a time opens a link to one exporter (the others wait
        for it, ``broker-timeout`` each when the exporter does not answer):
        two resyncs of one importer in flight at once could reach the
        exporter in either order, and the older one, applied last, would end
        leases claimed since.
        """
        with self._links_lock:
            link = self._links.get(record.broker)
            if link is not None and link.alive:
                return link
            opening = self._opening.setdefault(record.broker, threading.Lock())
        with opening:
            return self._open(record)

    def _open(self, record: PoolRecord) -> PeerLink:
        with self._links_lock:
            link = self._links.get(record.broker)
            if link is not None and link.alive:  # another thread opened it meanwhile
                return link
        if self.token is None:
            raise NotAMemberError(f"pool {self.pool.uuid}: not registered with the scheduler yet (no cluster token)")
        # A link opened again after one broke first resyncs the leases still held from this exporter.
        live, epoch = self.held.snapshot(record.broker)
        link = PeerLink(
            record.broker,
            self.options.broker_timeout,
            self.token,
            self.worker,
            live,
            expected_pid=record.pid,
            epoch=epoch,
        )
        self.held.resynced(record.broker, epoch)  # answered (the constructor raises otherwise)
        with self._links_lock:
            old = self._links.get(record.broker)
            if old is not None and old.alive:
                link.close()
                return old
            self._links[record.broker] = link
        return link

    def get(self, broker: str) -> PeerLink | None:
        """The link to ``broker`` if one was opened (alive or not); opens none."""
        with self._links_lock:
            return self._links.get(broker)

    def claim(self, record: PoolRecord, link: PeerLink, leases: list[int]) -> None:
        """Claim ``leases`` of ``record``'s pool and wait for the exporter's answer. Blocking.

        Returns once every lease is held (and in the live set that a resync
        sends). A broken link is opened again once.

        Raises
        ------
        DataLostError
            If the exporter refused a lease (it ended) or cannot be reached.
        """
        for attempt in (0, 1):
            epoch = self.held.epoch(record.broker)
            try:
                refused = link.claim(leases, functools.partial(self.held.hold, record.broker, epoch=epoch))
            except GPUPoolError as e:
                if attempt:
                    _tell_failed(link)
                    raise DataLostError(f"claiming leases {leases} of worker {record.worker}: {e}") from e
                try:
                    link = self.link(record)
                except GPUPoolError as e2:
                    raise DataLostError(f"claiming leases {leases} of worker {record.worker}: {e2}") from e2
                continue
            if not refused:
                return
            if attempt:
                # For example a claim that outlasted broker-timeout (an exporter waiting for its GPU): the
                # reopened link's resync ended the leases. Dask retries the transfer; copies, not the same wait.
                _tell_failed(link)
                raise DataLostError(
                    f"worker {record.worker} refused lease(s) {refused} on pool {record.pool}: they ended "
                    "(the reply that carried them failed, or they were not granted to this worker)"
                )
            leases = refused  # once more: a resync on another link may have raced the claim
            link = self.link(record)

    def drop(self) -> int:
        """Close every link (the cluster's token changed: new links present the new one); return how many."""
        with self._links_lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
        return len(links)

    def close(self, broker: str) -> None:
        """Close and forget the link to ``broker``, if any (its exporter left)."""
        with self._links_lock:
            link = self._links.pop(broker, None)
            self._opening.pop(broker, None)
        if link is not None:
            link.close()

    @property
    def alive(self) -> int:
        """How many links are alive."""
        return sum(link.alive for link in list(self._links.values()))


def _tell_failed(link: PeerLink) -> None:
    """Tell the exporter that a transfer failed (it sends copies for a while), if the link still works."""
    try:
        link.transfer_failed()
    except (GPUPoolError, OSError):
        logger.debug("telling %s that a transfer failed did not work", link.address, exc_info=True)


# -- peers' pools mapped here, once each -------------------------------------------------------------------------------


# IMPORT_LOCK and MappedPool are defined in handoff/mapped_pool.py and stay importable from here.


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
