"""How a value of this worker's pool goes to the worker that asked for it: the pure decision, and this worker's.

:func:`route` looks only at what it is given: this worker's registry row, the requester's row (if the registry has
one), the comm's scheme and a few facts about the buffer and the pool. It answers a :class:`Route`: hand the buffer
over (the requester's row, no reason), an expected copy (another host, a client: no row, no reason), or a copy a
same-host peer could have been spared (a reason from :data:`~dask_gpupool.handoff.stats.FALLBACK_REASONS`, which
:meth:`Routes.plan` counts and warns about once). ``tests/handoff/test_routing.py`` pins the decisions, one row each.

:class:`Routes` gathers the facts for one worker (its registry row and registry view, whether its service and pool
are open, the bytes a requester would import) and keeps the one piece of state only routing reads: peers whose last
transfer failed get copies for ``lease-timeout`` seconds (:meth:`Routes.mark_unreachable`, which
:meth:`Exports.settle <dask_gpupool.handoff.exporter.Exports.settle>` calls). :meth:`Routes.plan` counts and warns
about the fallbacks it decides. The :class:`~dask_gpupool.handoff.service.PoolService` owns one; the serializers ask
it directly. Importing this module loads no worker stack (the Dask adapters read its schemes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from dask_gpupool import tuning
from dask_gpupool.wire.registry import PoolRecord

if TYPE_CHECKING:
    from cuda.core import Buffer

    from dask_gpupool.config import PoolOptions
    from dask_gpupool.handoff.imported import Origin
    from dask_gpupool.handoff.registry import RegistryView
    from dask_gpupool.handoff.stats import HandoffStats
    from dask_gpupool.memory.pool import Pool
    from dask_gpupool.transport.stream import CopyServer

__all__ = [
    "HANDOFF_SCHEMES",
    "PEER_SHARE",
    "TCP_SCHEMES",
    "UCX_SCHEMES",
    "Route",
    "Routes",
    "handoff_threshold_of",
    "host_of",
    "plain_copy_reason",
    "route",
    "stage_threshold_of",
]


# -- the pure decision -------------------------------------------------------------------------------------------------


#: Comms whose frames go through host memory (Dask's TCP, and TLS over it); UCX carries device frames itself.
TCP_SCHEMES = ("tcp", "tls")
#: Comms over UCX (distributed-ucxx serves both), which carry device frames GPU to GPU.
UCX_SCHEMES = ("ucx", "ucxx")
#: Comms over which a same-host worker gets IPC descriptors: the bytes of a descriptor travel in
#: Dask's frames, so any comm that carries frames between processes would do; these are the ones tested.
HANDOFF_SCHEMES = (*TCP_SCHEMES, *UCX_SCHEMES)


def stage_threshold_of(kind: str, over_tcp: bool) -> int:
    """The smallest plain array a pool of ``kind`` stages for a same-host worker asking over TCP or TLS
    (``over_tcp``) or UCX; 0: never.

    :data:`~dask_gpupool.tuning.STAGE_THRESHOLD` for ``device`` pools over TCP or TLS,
    :data:`~dask_gpupool.tuning.HOST_STAGE_THRESHOLD` for ``host`` pools (NumPy arrays) over TCP or TLS. Never over UCX:
    UCX copies the array GPU to GPU itself, and staging from 4 MiB was 0.97-1.02x of that on seven ``dask.array``
    workloads, 0.92x on one (one H100, 2026-11-24). Never on ``pinned`` pools (not measured).
    """
    if not over_tcp:
        return 0
    return tuning.STAGE_THRESHOLD if kind == "device" else tuning.HOST_STAGE_THRESHOLD if kind == "host" else 0


def handoff_threshold_of(kind: str) -> int:
    """The smallest buffer of a pool of ``kind`` handed over to a same-host worker over TCP or TLS; 0: every size.

    :data:`~dask_gpupool.tuning.HOST_HANDOFF_THRESHOLD` for ``host`` pools. Every size on ``device`` pools, to a worker
    on the same GPU or another: handed over 1.83-2.02 ms from 1 KiB to 1 MiB against 2.18-2.54 copied on one H100
    (2026-11-23), 1.65-1.81 against 1.79-2.64 across two H200s (2026-11-24). Every size on ``pinned`` pools (not
    measured).
    """
    return tuning.HOST_HANDOFF_THRESHOLD if kind == "host" else 0


class Route(NamedTuple):
    """The decision: ``row`` is the requester's registry row when it gets the buffer handed over."""

    row: PoolRecord | None
    reason: str | None


def route(
    own: PoolRecord,
    requester: str | None,
    row: PoolRecord | None,
    scheme: str,
    *,
    pool_open: bool,
    owned: bool,
    unreachable: bool = False,
    nbytes: int = 0,
    handoff_threshold: int = 0,
) -> Route:
    """Decide how a buffer of this worker's pool goes to ``requester``.

    Parameters
    ----------
    own : PoolRecord
        This worker's row (its host, pid, pool kind, GPU and the GPUs granted access).
    requester : str or None
        The address of the worker that asked (``None``: not a worker's ``get_data``).
    row : PoolRecord or None
        The requester's row in this worker's registry view, if it has one.
    scheme : str
        The comm's scheme (``"tcp"``, ``"ucxx"``, ...).
    pool_open : bool
        This worker's service and pool are not closing.
    owned : bool
        The buffer lies in this worker's pool.
    unreachable : bool
        A recent transfer to the requester failed (it gets copies for a while).
    nbytes : int
        Bytes of the value.
    handoff_threshold : int
        Over TCP or TLS, a value under this many bytes is copied instead
        (``small``: the comm moves it faster than a handoff's lease claim); 0: never.

    Returns
    -------
    Route
        ``(row, None)``: hand over; ``(None, None)``: an expected copy;
        ``(row or None, reason)``: a same-host copy, for ``reason``.
    """
    if row is None:
        if requester is not None and pool_open and owned and host_of(requester) == host_of(own.worker):
            return Route(None, "unknown-requester")  # a worker here with no pool, or no row yet
        return Route(None, None)
    if row.host != own.host:
        return Route(None, None)
    if row.pid == own.pid:
        reason = "same-process"
    elif scheme not in HANDOFF_SCHEMES:
        reason = "comm"
    elif not pool_open:
        reason = "pool-closed"
    elif not owned:
        reason = "not-in-pool"
    elif unreachable:
        reason = "peer-unreachable"
    elif own.kind == "device" and own.device not in row.devices:
        reason = "no-access"
    elif own.kind == "device" and row.device not in (own.device, *own.peers):
        reason = "other-gpu"
    elif own.kind == "pinned" and not row.devices:
        reason = "no-access"
    elif nbytes < handoff_threshold and scheme in TCP_SCHEMES:
        reason = "small"
    else:
        return Route(row, None)
    return Route(row, reason)


def plain_copy_reason(own: PoolRecord, requester: str | None, row: PoolRecord | None) -> str | None:
    """Why a value outside every pool, sent to ``requester``, is a same-host copy; ``None`` when it is not one.

    ``"not-in-pool"`` for a worker of this host in another process,
    ``"unknown-requester"`` for a worker at this host's address with no row,
    ``None`` for another host, this process, or a request that is not a worker's.
    """
    if row is None:
        if requester is not None and host_of(requester) == host_of(own.worker):
            return "unknown-requester"
        return None
    if row.host != own.host or row.pid == own.pid:
        return None
    return "not-in-pool"


def host_of(address: str) -> str:
    """The host part of a Dask address (``tcp://10.0.0.1:8786`` -> ``10.0.0.1``); ``""`` if it has none."""
    from distributed.comm import get_address_host

    try:
        return str(get_address_host(address))
    except Exception:
        return ""


# -- this worker's routes ----------------------------------------------------------------------------------------------


#: The share of this pool's ``max_size`` one peer's live leases may hold: a value that would take that peer past it
#: goes as a copy (``peer-share``), unless the peer holds nothing yet (one value of any size is handed over). So a
#: consumer that stalls, or keeps what it was handed, leaves the rest of the pool to this worker's own tasks.
PEER_SHARE = 0.5


class Routes:
    """How each value of one worker goes to the worker that asked: hand over, stage, stream, or copy.

    Parameters
    ----------
    options : PoolOptions
    pool : Pool
        This worker's own pool.
    record : PoolRecord
        This pool's registry row.
    registry : RegistryView
        This worker's copy of the registry (read only here).
    handoffs : HandoffStats
        The worker's counters (:meth:`plan` counts fallbacks).
    copier : CopyServer or None
        This worker's copy server (``None``: the pipelined copy path is off).
    pinned : callable, optional
        ``pinned(worker)``: the bytes this pool's live leases of ``worker`` hold
        (:meth:`LeaseTable.nbytes_of <dask_gpupool.handoff.leases.LeaseTable.nbytes_of>`), held against
        :data:`PEER_SHARE`; by default nothing is.
    stage_threshold_of, handoff_threshold_of, stream_threshold
        What values are held against: by default :func:`stage_threshold_of` (of a pool kind,
        over TCP or TLS or not), :func:`handoff_threshold_of` (of a pool kind) and
        :data:`dask_gpupool.tuning.COPY_STREAM_THRESHOLD`. Tests and benchmarks give others, to take a path at
        sizes the defaults route elsewhere (:func:`dask_gpupool.testing.faults.route_sizes`).

    Attributes
    ----------
    record : PoolRecord
        This pool's registry row (the service replaces it when it retires segments).
    closed : bool
        The service is closing (set by its ``close``): same-host handoffs become copies (``pool-closed``).
    """

    options: PoolOptions
    pool: Pool
    record: PoolRecord
    registry: RegistryView
    handoffs: HandoffStats
    copier: CopyServer | None
    stage_threshold_of: Callable[[str, bool], int]
    handoff_threshold_of: Callable[[str], int]
    stream_threshold: int
    pinned: Callable[[str], int] | None
    closed: bool
    _unreachable: dict[str, float]

    def __init__(
        self,
        options: PoolOptions,
        pool: Pool,
        record: PoolRecord,
        registry: RegistryView,
        handoffs: HandoffStats,
        copier: CopyServer | None,
        stage_threshold_of: Callable[[str, bool], int] = stage_threshold_of,
        handoff_threshold_of: Callable[[str], int] = handoff_threshold_of,
        stream_threshold: int = tuning.COPY_STREAM_THRESHOLD,
        pinned: Callable[[str], int] | None = None,
    ) -> None:
        self.options = options
        self.pool = pool
        self.record = record
        self.registry = registry
        self.handoffs = handoffs
        self.copier = copier
        self.stage_threshold_of = stage_threshold_of
        self.handoff_threshold_of = handoff_threshold_of
        self.stream_threshold = stream_threshold
        self.pinned = pinned
        self.closed = False
        self._unreachable = {}  # peer -> until when its handoffs go as copies

    def plan(self, requester: str | None, scheme: str, buf: Buffer) -> tuple[PoolRecord | None, str | None]:
        """Decide how ``buf`` goes to ``requester``: ``(its row, None)`` to hand it over,
        ``(None, reason)`` to copy. ``reason`` is ``None`` for expected copies (another
        host, a client) and a fallback reason (counted, warned once) for a same-host
        peer that could have had it zero-copy.
        """
        return self._counted(self.route(requester, scheme, buf), requester)

    def route(self, requester: str | None, scheme: str, buf: Buffer) -> Route:
        """:meth:`plan`'s decision without counting it (:func:`~dask_gpupool.handoff.routes.route`), a requester
        past its share of the pool copied (:meth:`over_share`)."""
        decision = self._route(self.record, requester, scheme, self.pool.owns(buf), int(buf.size))
        if decision.reason is None and decision.row is not None and self.over_share(decision.row.worker, buf.size):
            return Route(decision.row, "peer-share")
        return decision

    def over_share(self, worker: str, nbytes: int) -> bool:
        """Whether ``nbytes`` more leased to ``worker`` would take its live leases past :data:`PEER_SHARE` of the
        pool (never while it holds none)."""
        held = 0 if self.pinned is None else self.pinned(worker)
        return held > 0 and held + int(nbytes) > PEER_SHARE * self.record.max_size

    def _counted(self, decision: Route, requester: str | None) -> tuple[PoolRecord | None, str | None]:
        """``decision`` as :meth:`plan` returns it, its same-host fallback counted (and warned once)."""
        row, reason = decision
        if reason is not None:
            self.handoffs.fallback(row.worker if row is not None else str(requester), reason, self.record.worker)
            return None, reason
        return row, None

    def _route(
        self,
        own: PoolRecord,
        requester: str | None,
        scheme: str,
        owned: bool,
        nbytes: int = 0,
    ) -> Route:
        """:func:`~dask_gpupool.handoff.routes.route` for memory of ``own``'s pool, with this worker's state.

        ``nbytes`` (the value's size) is held against the handoff threshold of ``own``'s pool kind
        (:attr:`handoff_threshold_of`; this worker's pool when ``nbytes`` is given); 0 (staging, forwards) never
        is.
        """
        row = self.registry.worker_row(requester) if requester else None
        return route(
            own,
            requester,
            row,
            scheme,
            pool_open=not (self.closed or self.pool.closed),
            owned=owned,
            unreachable=row is not None and self.is_unreachable(row.worker),
            nbytes=nbytes,
            handoff_threshold=self.handoff_threshold_of(own.kind) if nbytes else 0,
        )

    def stage_route(self, requester: str | None, scheme: str, nbytes: int) -> PoolRecord | None:
        """The requester's row when an array of ``nbytes`` outside the pool should be staged into it and handed over.

        That is: the request is over TCP or TLS, ``nbytes`` is at least the stage threshold
        (:meth:`stage_threshold`) and a new buffer of that size in this pool would be handed over (decided by
        :func:`~dask_gpupool.handoff.routes.route`, without counting).
        """
        threshold = self.stage_threshold(requester, scheme)
        if not threshold or nbytes < threshold:
            return None
        decision = self._route(self.record, requester, scheme, True)
        if decision.reason is not None or decision.row is None or self.over_share(decision.row.worker, nbytes):
            return None
        return decision.row

    def stage_threshold(self, requester: str | None, scheme: str) -> int:
        """The smallest array outside this pool staged into it for ``requester`` asking over ``scheme``; 0: never
        (:attr:`stage_threshold_of`: by default :func:`stage_threshold_of`, nothing over UCX)."""
        return self.stage_threshold_of(self.record.kind, scheme in TCP_SCHEMES)

    def plain_copy_reason(self, requester: str | None) -> str | None:
        """Why a value outside every pool sent to ``requester`` is a same-host copy (``None``: it is not one).

        :func:`~dask_gpupool.handoff.routes.plain_copy_reason`; the get_data hook asks once per reply.
        """
        row = self.registry.worker_row(requester) if requester else None
        return plain_copy_reason(self.record, requester, row)

    def forward_route(self, origin: Origin, requester: str | None, scheme: str) -> tuple[Route, PoolRecord | None]:
        """:meth:`Forwarder.forward <dask_gpupool.handoff.forwarding.Forwarder.forward>`'s decision without
        counting it, and the exporter's row (``None``: it left). Back to the exporter itself: handed over (it takes
        its own buffer back)."""
        owner = self.registry.get(origin.desc.pool)
        row = self.registry.worker_row(requester) if requester else None
        if owner is None or owner.worker != origin.exporter:
            same_host = row is not None and row.host == self.record.host
            return Route(row, "forward-refused" if same_host else None), None
        if row is not None and row.worker == owner.worker and not self.closed and scheme in HANDOFF_SCHEMES:
            return Route(row, None), owner  # back to its exporter: its own memory, nothing to map
        return self._route(owner, requester, scheme, True), owner

    def stream_route(self, requester: str | None, scheme: str, nbytes: int) -> PoolRecord | None:
        """The requester's row when a copy of ``nbytes`` to it goes over the pipelined copy path, else ``None``.

        That is: a worker of this cluster in another process, over a ``tcp``
        comm, at least :attr:`stream_threshold` bytes, with this worker's
        copy server running.
        """
        if self.copier is None or scheme != "tcp" or nbytes < max(self.stream_threshold, 1):
            return None
        row = self.registry.worker_row(requester) if requester else None
        if row is None or (row.host == self.record.host and row.pid == self.record.pid):
            return None
        if self.is_unreachable(row.worker):
            return None
        return row

    def is_unreachable(self, worker: str) -> bool:
        """Whether transfers to ``worker`` go as copies for now (:meth:`mark_unreachable`)."""
        # Read only: a mark past its time is replaced by the next one (the broker's thread marks; this is read on
        # the event loop and the broker's thread), never popped here, where it could drop a newer mark.
        until = self._unreachable.get(worker)
        return until is not None and time.monotonic() < until

    def mark_unreachable(self, worker: str, seconds: float) -> None:
        """A transfer to ``worker`` failed: its handoffs go as copies for ``seconds`` (``peer-unreachable``)."""
        self._unreachable[worker] = time.monotonic() + seconds

    def forget(self, worker: str) -> None:
        """``worker`` left the cluster: drop what is known of it."""
        self._unreachable.pop(worker, None)
