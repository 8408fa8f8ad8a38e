"""A worker's ``get_data`` replies: who asked, whether to serialize on the event loop, and settling each reply.

:class:`Replies` is what the ``get_data`` wrapper
(:func:`~dask_gpupool.dask.distributed_seam.workers.wrap_get_data`) asks for each
reply: :meth:`Replies.open` makes its :class:`~dask_gpupool.dask.context.Request`
(the requester, the comm's scheme, why a plain value would be a copy, the
task events) and decides whether it is serialized on the event loop; the
serializers read the request while the reply is written
(:data:`~dask_gpupool.dask.context.REQUEST`); :meth:`Replies.close` settles
what the reply granted.

**On the event loop.** When every value asked for will go as an IPC
descriptor, the reply is serialized on the event loop rather than in Dask's
offload thread: Dask offloads any message whose ``sizeof`` passes
``distributed.comm.offload`` (10 MiB), and a handoff's values are that large
although what is serialized is a descriptor of a few hundred bytes. The
thread hop cost about 0.5 ms per transfer, more than the rest of a handoff.
So are a few CuPy arrays that a ``device`` pool stages and hands over (a
device copy the export waits for). Over a UCX comm the same holds for a reply
of a few device values (pool memory or CuPy arrays) that go as device frames:
serializing them only enqueues GPU work that the comm's own synchronize waits
for. Only that comm's ``allow_offload`` changes, for that reply, and the
check runs only for replies Dask would offload (by the keys' recorded sizes).

**Settling.** Over a UCX comm, the device frames of a reply that ended
without the requester's "OK" (failed, or cancelled while distributed-ucxx
waits for its send) are parked (:meth:`Request.settle_frames
<dask_gpupool.dask.context.Request.settle_frames>`). The requester
acknowledges a reply ("OK") only after its broker claims were answered, and a
failed reply is never used: either way a lease still unclaimed when the reply
ends never will be. A lease claimed by the reply is claimed with the "OK"; if
the reply failed, the requester is asked
(:data:`~dask_gpupool.wire.handoff.LEASE_QUERY_OP`, answered by
:func:`lease_query_handler`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from dask_gpupool.dask.comms import bound_worker, granted_to
from dask_gpupool.dask.context import SYNCHRONIZING_SCHEMES, Request
from dask_gpupool.dask.views import described, pool_buffer_of
from dask_gpupool.errors import NotAMemberError
from dask_gpupool.handoff.routes import host_of
from dask_gpupool.wire.broker import ErrorReply, raise_for_error
from dask_gpupool.wire.broker_leases import MAX_LEASES_PER_MESSAGE
from dask_gpupool.wire.handoff import LEASE_QUERY_OP, LeaseQuery, LeaseQueryReply

if TYPE_CHECKING:
    from dask_gpupool.dask.task_events import TaskEvents
    from dask_gpupool.handoff.service import PoolService

__all__ = ["INLINE_MAX_VALUES", "INLINE_STAGING_LIMIT", "Replies", "WorkerStore", "lease_query_handler"]

logger = logging.getLogger(__name__)


#: Seconds between an exporter's tries to ask an importer about leases in doubt, at first and at most.
_ASK_BACKOFF = (0.05, 5.0)

#: The running :meth:`Replies._ask` tasks (the event loop keeps only weak references to tasks).
_ASKING: set[asyncio.Future[None]] = set()


#: The most bytes a reply may stage on the event loop (pool memory for UCX, or CuPy arrays into the pool over TCP):
#: above it a new allocation (``cuMemAlloc``, a new segment) could hold the loop for milliseconds, so Dask's offload
#: thread does it.
INLINE_STAGING_LIMIT = 256 << 20
#: The most values a reply may serialize on the event loop when it stages any (each costs 0.1-0.3 ms in a busy
#: worker).
INLINE_MAX_VALUES = 8


class WorkerStore(Protocol):
    """What :class:`Replies` reads of a worker's stored values (:class:`~dask_gpupool.dask.distributed_seam.
    workers.DaskWorkerStore` reads it from distributed's ``Worker``)."""

    def values_in_memory(self, keys: Any) -> list[Any] | None:
        """The values of ``keys`` in memory, or ``None`` if one is not there (spilled ones count as not there)."""

    def offloaded(self, keys: Any) -> bool:
        """Whether Dask would serialize a reply of ``keys`` in its offload thread (their recorded size)."""


class Replies:
    """The ``get_data`` replies of one worker.

    Parameters
    ----------
    service : PoolService
        The worker's service: routes, exports and the settling of leases.
    store : WorkerStore
        The worker's stored values, for the event-loop decision.
    rpc : callable
        ``rpc(address)``: a Dask RPC to a peer (``worker.rpc``), for :data:`~dask_gpupool.wire.handoff.LEASE_QUERY_OP`.
    serializers : callable, optional
        ``serializers(request)`` names the serializer families for a reply (``None``: Dask's default); the worker
        plugin passes :func:`dask_gpupool.dask.frames_family.serializers_for`, so that same-host workers get device
        objects frame by frame.
    task_events : TaskEvents, optional
        Goes in every :class:`~dask_gpupool.dask.context.Request` (staging orders its copy after the task that made
        the array, :mod:`dask_gpupool.dask.task_events`).
    """

    def __init__(
        self,
        service: PoolService,
        store: WorkerStore,
        rpc: Callable[[str], Any],
        serializers: Callable[[Request], list[str] | None] | None = None,
        task_events: TaskEvents | None = None,
    ) -> None:
        self.service = service
        self._store = store
        self._rpc = rpc
        self._serializers = serializers
        self._task_events = task_events

    def open(self, keys: Any, who: str | None, comm: Any, scheme: str, offloads: bool) -> tuple[Request, bool]:
        """The request of a reply of ``keys`` to ``who`` over ``comm`` (of ``scheme``), and whether to serialize it
        on the event loop (``offloads``: the comm allows Dask's offload thread). Leases go to ``who`` only if
        ``comm`` is bound to it (:func:`~dask_gpupool.dask.comms.granted_to`); otherwise the reply is Dask's own,
        as to a client (a same-host worker's request counted as a fallback: :meth:`_not_granted`)."""
        service, asked_by, who = self.service, who, granted_to(comm, who)
        if who is None and asked_by is not None:
            self._not_granted(asked_by)
        request = Request(
            who, scheme, service, plain_reason=service.routes.plain_copy_reason(who), task_events=self._task_events
        )
        return request, offloads and self.inline(keys, who, scheme)

    def _not_granted(self, who: str) -> None:
        """Count a request naming ``who`` on a comm not bound to it, if ``who`` is of this host: ``unknown-requester``
        (no row: its pool set-up failed, or its row has not come yet) or ``unbound-comm``."""
        service = self.service
        row = service.registry.worker_row(who)
        if row is None and host_of(who) == host_of(service.record.worker):
            reason = "unknown-requester"
        elif row is not None and row.host == service.record.host and row.pid != service.record.pid:
            reason = "unbound-comm"
        else:
            return
        service.handoffs.fallback(who, reason, service.record.worker)

    def serializers(self, request: Request) -> list[str] | None:
        """The serializer families for the reply of ``request`` (``None``: Dask's default)."""
        return None if self._serializers is None else self._serializers(request)

    def close(self, request: Request, ok: bool, start: float) -> None:
        """The reply of ``request``, begun at ``start`` (:func:`time.perf_counter`), ended (``ok``: with the
        requester's "OK"): its device frames settled, its time counted (``reply``), its leases settled."""
        service, who = self.service, request.requester
        request.settle_frames(ok)  # over UCX: what the requester may still read is kept out of reuse
        service.handoffs.timed("reply", time.perf_counter() - start)
        if request.granted:
            doubt = service.exports.settle(request.granted, who, ok)
            if doubt and who is not None:
                self._ask_later(who, doubt)
        if request.forwarded:
            service.forwarder.settle_forwarded(request.forwarded, who)

    def inline(self, keys: Any, who: str | None, scheme: str) -> bool:
        """Whether to serialize a reply of ``keys`` to ``who`` on the event loop: Dask would offload it, and all of it
        is descriptors, or (over UCX) device memory that goes as descriptors or device frames
        (:meth:`_all_device_frames`)."""
        if not self._store.offloaded(keys):
            return False
        if scheme in SYNCHRONIZING_SCHEMES and self._all_device_frames(keys):
            return True
        return self._all_handed_over(keys, who, scheme)

    def _all_device_frames(self, keys: Any) -> bool:
        """Whether every key is in memory (not spilled) and device memory whose serializing for a UCX comm only
        enqueues GPU work: at most :data:`INLINE_MAX_VALUES` values, each device pool memory (this worker's or
        imported) or a CuPy array, with at most :data:`INLINE_STAGING_LIMIT` bytes of pool memory.

        Over a UCX comm such a value goes as an IPC descriptor or as device frames: pool memory staged by a copy that
        the comm's own synchronize waits for (no wait here), a CuPy array as distributed's frames (a contiguous copy
        at most, enqueued). That is cheaper than the hop to Dask's offload thread (about 0.5 ms).
        """
        values = self._store.values_in_memory(keys) if keys and len(keys) <= INLINE_MAX_VALUES else None
        if values is None:
            return False
        pool_bytes = 0
        for value in values:
            buf = pool_buffer_of(value)
            if buf is not None:
                if not buf.is_device_accessible or buf.is_host_accessible:
                    return False  # host pool memory goes as a host frame: a copy
                pool_bytes += int(getattr(value, "nbytes", buf.size))
                if pool_bytes > INLINE_STAGING_LIMIT:
                    return False
                continue
            if type(value).__module__.split(".", 1)[0] != "cupy" or not hasattr(value, "__cuda_array_interface__"):
                return False
        return True

    def _all_handed_over(self, keys: Any, who: str | None, scheme: str) -> bool:
        """Whether every key is in memory (not spilled) and will go to ``who`` as an IPC descriptor (or forward).

        Counted as such too: a CuPy array outside the pool that a ``device`` pool stages for ``who``
        (:func:`_staged_on_device`), at most :data:`INLINE_MAX_VALUES` values and :data:`INLINE_STAGING_LIMIT` bytes
        of them in a reply: its copy is a device-to-device copy the export waits for, as distributed-ucxx's own
        synchronize waits for the GPU on the event loop.
        """
        service = self.service
        values = self._store.values_in_memory(keys) if keys and who is not None else None
        if values is None:
            return False
        staged = 0
        for value in values:
            buf = pool_buffer_of(value)
            if buf is None:
                if len(values) > INLINE_MAX_VALUES or not _staged_on_device(service, value, who, scheme):
                    return False
                staged += int(value.nbytes)
                if staged > INLINE_STAGING_LIMIT:
                    return False
                continue
            if not described(value):  # a structured dtype: copied by distributed's serializer
                return False
            origin = getattr(buf.memory_resource, "origin", None)  # an import, passed on as its exporter's memory
            row, reason = (
                service.routes.forward_route(origin, who, scheme)[0]
                if origin
                else service.routes.route(who, scheme, buf)
            )
            if row is None or reason is not None:
                return False
        return True

    def _ask_later(self, who: str, leases: list[int]) -> None:
        """Ask ``who`` which of ``leases`` (claimed by a reply that failed) it holds, until it answers.

        Runs as a task on the worker's event loop, over Dask's own comm
        (:data:`~dask_gpupool.wire.handoff.LEASE_QUERY_OP`). While ``who`` cannot
        be reached the leases are kept (it may be stalled, with the memory
        mapped) and it is asked again with backoff; the loop ends once no lease
        is in doubt any more (answered, released, or ended because ``who``
        died or left), or the service closed.
        """
        task = asyncio.ensure_future(self._ask(who, leases))
        _ASKING.add(task)
        task.add_done_callback(_ASKING.discard)

    async def _ask(self, who: str, leases: list[int]) -> None:
        service = self.service
        delay, most = _ASK_BACKOFF
        while not service.closed:
            pending = service.leases.in_doubt(leases, who)
            if not pending:
                return
            try:
                for i in range(0, len(pending), MAX_LEASES_PER_MESSAGE):
                    chunk = pending[i : i + MAX_LEASES_PER_MESSAGE]
                    query = LeaseQuery(service.record.broker, tuple(chunk))
                    raw = await getattr(self._rpc(who), LEASE_QUERY_OP)(**query.to_msg())
                    if isinstance(raw, dict):
                        raise_for_error(raw, f"asking {who} about leases")
                    service.exports.resolve(chunk, who, list(LeaseQueryReply.from_msg(raw).held))
                continue
            except Exception as e:  # unreachable, closing, or a bad answer: keep the leases, ask again
                n = len(pending)
                logger.info("asking %s about %d lease(s) of a failed reply: %s; again in %.2fs", who, n, e, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, most)


def _staged_on_device(service: PoolService, value: Any, who: str | None, scheme: str) -> bool:
    """Whether ``value`` is a CuPy array that this worker's ``device`` pool would copy into itself and hand to ``who``
    (:func:`~dask_gpupool.dask.plain_arrays.stage`; it may still decline, for a full pool, and send the array)."""
    if who is None or service.pool.kind != "device" or type(value).__module__.split(".", 1)[0] != "cupy":
        return False
    if not getattr(value, "size", 0) or service.routes.plain_copy_reason(who) != "not-in-pool":
        return False
    return service.routes.stage_route(who, scheme, int(value.nbytes)) is not None


def lease_query_handler(service: PoolService) -> Callable[..., dict[str, Any]]:
    """The handler of :data:`~dask_gpupool.wire.handoff.LEASE_QUERY_OP` on a worker: it parses an exporter's
    :class:`~dask_gpupool.wire.handoff.LeaseQuery` (a malformed one is a
    :class:`~dask_gpupool.errors.ProtocolError` reply, and nothing changes) and answers from the service's releaser.

    Only a member asks, about its own leases: the comm must be bound to a worker
    (:mod:`~dask_gpupool.dask.comms`) whose registry row, when this worker has it, names the broker the query
    names; anything else is answered with :class:`~dask_gpupool.errors.NotAMemberError` and changes nothing."""

    def lease_query(comm: Any, exporter: Any = None, leases: Any = None) -> dict[str, Any]:
        query = LeaseQuery.from_msg({"exporter": exporter, "leases": leases})
        asker = bound_worker(comm)
        row = None if asker is None else service.registry.worker_row(asker)
        if asker is None or (row is not None and row.broker != query.exporter):
            refusal = NotAMemberError(f"a lease query about {query.exporter} from {asker or 'a process not bound'}")
            logger.info("gpupool: refused %s", refusal)
            return ErrorReply.of(refusal).to_msg()
        return service.importer.answer_lease_query(query).to_msg()

    return lease_query
