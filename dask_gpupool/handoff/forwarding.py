"""Passing on a value this worker imported (:class:`Forwarder`): the next worker maps the exporter's memory.

When B hands on to C a value it imported from A, B's serializer asks the
:class:`Forwarder`: A grants C a lease of its own over B's link
(:meth:`PeerLink.forward <dask_gpupool.transport.link.PeerLink.forward>`),
and C gets A's descriptor, so the memory lives until C lets go, whatever B
does. When the requester is A itself, A grants the lease in its own name
and takes its own buffer back
(:meth:`Exports.take_back <dask_gpupool.handoff.exporter.Exports.take_back>`):
nothing is mapped or copied. A forwarded lease nobody claimed ends when B's reply ends
(:meth:`Forwarder.settle_forwarded`) or B dies. The decision is
:meth:`Routes.forward_route <dask_gpupool.handoff.routes.Routes.forward_route>`.
The :class:`~dask_gpupool.handoff.service.PoolService` owns one.
"""

from __future__ import annotations

import logging

from dask_gpupool.errors import GPUPoolError
from dask_gpupool.handoff.imported import Origin, Releaser
from dask_gpupool.handoff.links import ExporterLinks
from dask_gpupool.handoff.registry import RegistryView
from dask_gpupool.handoff.routes import Routes
from dask_gpupool.handoff.stats import HandoffStats
from dask_gpupool.memory.pool import Pool
from dask_gpupool.wire.handoff import ArrayMeta, HandoffHeader

__all__ = ["Forwarder"]

logger = logging.getLogger(__name__)


class Forwarder:
    """Passes on values one worker imported, through its links to their exporters.

    Parameters
    ----------
    pool : Pool
        This worker's own pool (warnings name it).
    worker : str
        This worker's address (counters name it).
    registry : RegistryView
        This worker's copy of the registry (read only here).
    routes : Routes
        This worker's routing decisions.
    links : ExporterLinks
        The importer's links, which reach the exporters.
    releaser : Releaser
        The importer's releases: a settle that could not be sent goes with them once the exporter is reached again.
    handoffs : HandoffStats
        The worker's counters (forwards, fallbacks).
    """

    pool: Pool
    worker: str
    registry: RegistryView
    routes: Routes
    links: ExporterLinks
    releaser: Releaser
    handoffs: HandoffStats

    def __init__(
        self,
        pool: Pool,
        worker: str,
        registry: RegistryView,
        routes: Routes,
        links: ExporterLinks,
        releaser: Releaser,
        handoffs: HandoffStats,
    ) -> None:
        self.pool = pool
        self.worker = worker
        self.registry = registry
        self.routes = routes
        self.links = links
        self.releaser = releaser
        self.handoffs = handoffs

    def forward(
        self, origin: Origin, requester: str | None, scheme: str, array: ArrayMeta | None
    ) -> HandoffHeader | None:
        """Pass on a value this worker imported: the requester maps the exporter's memory itself.

        The exporter grants the requester a lease of its own through this
        worker's link (:meth:`PeerLink.forward <dask_gpupool.transport.link.PeerLink.forward>`),
        so the memory lives until the requester lets go, whatever this worker
        does. Decided as for the exporter's own buffers
        (:func:`~dask_gpupool.handoff.routes.route` with the exporter's row).
        Returns the header, or ``None`` to copy (a same-host fallback is counted).
        """
        decision, owner = self.routes.forward_route(origin, requester, scheme)
        if decision.reason is not None:
            peer = decision.row.worker if decision.row is not None else str(requester)
            detail = "the exporter left" if owner is None else ""
            self.handoffs.fallback(peer, decision.reason, self.worker, detail)
            return None
        if decision.row is None or owner is None:
            return None  # another host or a client: an expected copy
        try:
            lease, _segment = self.links.link(owner).forward(origin.lease, decision.row.worker)
        except GPUPoolError as e:
            self.handoffs.fallback(decision.row.worker, "forward-refused", self.worker, str(e))
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

    def settle_forwarded(self, forwarded: list[tuple[str, int]], requester: str | None) -> None:
        """The reply that carried these ``(exporter, lease)`` forwards ended: the exporters end unclaimed ones.

        An exporter that cannot be reached now is told once a link to it
        opens again (:meth:`Releaser.settle_later
        <dask_gpupool.handoff.imported.Releaser.settle_later>`): until then it
        keeps the leases, and their memory.
        """
        by_exporter: dict[str, list[int]] = {}
        for exporter, lease in forwarded:
            by_exporter.setdefault(exporter, []).append(lease)
        for exporter, leases in by_exporter.items():
            owner = self.registry.worker_row(exporter)
            if owner is None:
                continue  # it left: its leases went with it
            try:
                self.links.link(owner).settle_forwarded(leases)
            except GPUPoolError as e:
                logger.warning(
                    "pool %s: could not tell %s that %d forwarded lease(s) for %s may end (%s); told once it is "
                    "reached again",
                    self.pool.uuid,
                    exporter,
                    len(leases),
                    requester,
                    e,
                )
                self.releaser.settle_later(owner.broker, leases)
