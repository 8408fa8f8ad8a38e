"""The importer's links to exporters' brokers, and the lease claims sent over them (:class:`ExporterLinks`).

One :class:`~dask_gpupool.transport.link.PeerLink` per exporter's broker,
opened on first use and again after it broke: a new link first resyncs the
leases still held from that exporter (the live set of
:class:`~dask_gpupool.handoff.held.HeldLeases`). Every link presents the
cluster's membership token. :meth:`ExporterLinks.claim` claims leases over a
link and waits for the exporter's answer. The
:class:`~dask_gpupool.handoff.importer.Importer` owns one.
"""

from __future__ import annotations

import functools
import logging
import threading

from dask_gpupool.config import PoolOptions
from dask_gpupool.errors import DataLostError, GPUPoolError, NotAMemberError
from dask_gpupool.handoff.held import HeldLeases
from dask_gpupool.memory.pool import Pool
from dask_gpupool.transport.link import PeerLink
from dask_gpupool.wire.registry import PoolRecord

__all__ = ["ExporterLinks"]

logger = logging.getLogger(__name__)


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
