"""The one module that reaches into distributed's worker internals, and why each is needed.

- ``worker.handlers["get_data"]`` is wrapped so that serializers know who asked
  for a value (:data:`REQUEST`): only a same-host worker gets an IPC descriptor.
- ``comm.allow_offload`` is cleared for replies that are all descriptors, so
  they are serialized on the event loop instead of Dask's offload thread.
- ``worker.state.tasks`` and ``worker.data`` are read (never written) to decide
  that.
- ``worker.rpc.connect`` is wrapped so that the comms a worker reads values
  from run the copies deserializers left (streamed pulls, memfd copies) in a
  thread after the read, not on the event loop
  (:mod:`dask_gpupool.handoff.deferred`).
- ``worker.handlers[LEASE_QUERY_OP]`` answers an exporter whose reply failed
  which of its leases this worker holds (leases claimed by the reply).
- ``worker.monitor.get_process_memory`` is wrapped so that the process memory
  Dask reads leaves out the peer pool pages a worker maps.

Over UCX comms, the device memory of a reply that ended without the requester's
"OK", and the receive-pool blocks of a read that raised, are kept out of reuse
(:data:`~dask_gpupool.memory.lifetime.QUARANTINE`): UCX may still read or write
them (:meth:`Request.settle_frames`, :data:`READ_BLOCKS`).

Each is put back as it was by the matching ``undo``/restore path when the
plugin is removed.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dask_gpupool.dask.views import described, pool_buffer_of
from dask_gpupool.errors import DataLostError
from dask_gpupool.handoff.deferred import SENDER, abandon_all, collecting, resolve, run_fills
from dask_gpupool.handoff.routing import TCP_SCHEMES, UCX_SCHEMES
from dask_gpupool.memory.lifetime import QUARANTINE
from dask_gpupool.memory.peer_resident import peer_resident_bytes
from dask_gpupool.wire.broker_leases import MAX_LEASES_PER_MESSAGE
from dask_gpupool.wire.handoff import LEASE_QUERY_OP, LeaseQuery, LeaseQueryReply

if TYPE_CHECKING:
    from distributed import Worker

    from dask_gpupool.dask.task_events import TaskEvents
    from dask_gpupool.handoff.service import PoolService

__all__ = [
    "READ_BLOCKS",
    "REQUEST",
    "ReadBlocks",
    "Request",
    "clear_tracebacks",
    "count_own_memory_only",
    "fill_after_read",
    "install_get_data_hook",
    "install_lease_query_handler",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    """The ``get_data`` request a worker is answering: who asked, over which comm, and what it was granted."""

    requester: str | None
    scheme: str
    service: PoolService
    #: Leases granted for this reply; settled (the unclaimed ones ended) when it ends.
    granted: list[int] = field(default_factory=list)
    #: ``(exporter, lease)`` of imported values passed on in this reply; settled at their exporters.
    forwarded: list[tuple[str, int]] = field(default_factory=list)
    #: Why a value outside every pool in this reply is a same-host copy (``None``: it is not one).
    plain_reason: str | None = None
    #: Where the GPU work that made each of this worker's task results ends (``None``: not recorded here).
    task_events: TaskEvents | None = None
    #: The device frames this reply sends over a UCX comm (:meth:`sending`): they keep the memory the requester's
    #: UCX reads alive (staging memory, pool memory, CuPy arrays) until the reply ends (:meth:`settle_frames`).
    device_frames: list[Any] = field(default_factory=list)
    #: The requester's process (its registry row's pid, when the row is of this host; else ``None``), looked up when
    #: the first device frame is noted: a requester that died may have left the registry by the time its reply fails.
    reader_pid: int | None = None

    def sending(self, frames: list[Any]) -> None:
        """Note the device frames (those with ``__cuda_array_interface__``) among ``frames``, which a serializer
        gives this reply, if it goes over a UCX comm. Over TCP or TLS nothing is noted: the comm copies the bytes
        into the socket before the reply ends."""
        if self.scheme not in UCX_SCHEMES:
            return
        device = [f for f in frames if hasattr(f, "__cuda_array_interface__")]
        if device and not self.device_frames:
            row = None if self.requester is None else self.service.registry.worker_row(self.requester)
            pid = row.pid if row is not None and row.host == self.service.record.host else None
            object.__setattr__(self, "reader_pid", pid)  # once, before the reply's first device frame (frozen)
        self.device_frames.extend(device)

    def settle_frames(self, ok: bool) -> None:
        """The reply ended (``ok``: with the requester's "OK"): let go of its device frames, or park them.

        Ownership: until here the request holds each device frame it sent, and so what the frame keeps alive (a
        :class:`~dask_gpupool.memory.ucx_staging.UcxStaging` block, a pool buffer, a CuPy array). With the "OK"
        the requester has received every frame (its read returned before it answered), so they are dropped and
        their memory goes back to its free list or pool as usual. Without it (the reply was cancelled while
        distributed-ucxx waited for its send, or failed), the requester's UCX may still be reading them (its
        ``cuda_ipc`` copy of this process's memory), and a requester whose read completes uses what it read:
        the frames are parked in :data:`~dask_gpupool.memory.lifetime.QUARANTINE` until the requester's process
        exits (:attr:`reader_pid`), or for this process's life when that cannot be watched (a requester without
        a row, of another host, or in this process). Nothing of this holds them afterwards.
        """
        frames, self.device_frames[:] = list(self.device_frames), []
        if ok or not frames:
            return
        what = f"a reply to {self.requester} ended without its OK over {self.scheme}"
        QUARANTINE.park(frames, self.reader_pid, what)

    def task_event(self, value: Any) -> Any | None:
        """The event after which no GPU work of the task that made ``value`` writes it, if ``value`` is a task
        result of this worker whose event was recorded (:class:`TaskEvents`); else ``None``."""
        return None if self.task_events is None else self.task_events.event_of(value)

    def revoke_since(self, granted: int, forwarded: int) -> None:
        """End the leases granted (and forwarded) for this reply after the first ``granted`` (``forwarded``):
        their headers will not be sent (a serializer gave up on the value and Dask tries its next family)."""
        revoked, self.granted[granted:] = self.granted[granted:], []
        passed_on, self.forwarded[forwarded:] = self.forwarded[forwarded:], []
        if revoked:
            self.service.exports.revoke(revoked, self.requester)
        if passed_on:
            self.service.forwarder.settle_forwarded(passed_on, self.requester)

    def count_plain_fallback(self, nbytes: int) -> None:
        """Count a value of ``nbytes`` outside every pool sent in this reply as a same-host fallback, if it is one.

        Over TCP or TLS, one below the pool's stage threshold (if it stages) is counted ``small`` rather than
        ``not-in-pool``: the comm is its best path (a small NumPy array on a ``device`` pool too, which is never
        staged). An empty value copies nothing and is not counted.
        """
        if self.plain_reason is None or not nbytes:
            return
        reason = self.plain_reason
        if reason == "not-in-pool" and self.scheme in TCP_SCHEMES:
            reason = "small" if nbytes < self.service.routes.stage_threshold(self.requester, self.scheme) else reason
        self.service.handoffs.fallback(str(self.requester), reason, self.service.record.worker)

    def count_copy(self, reason: str, nbytes: int) -> None:
        """Count a value of ``nbytes`` that this reply sends as a copy for ``reason`` (a reason of
        :data:`~dask_gpupool.handoff.stats.FALLBACK_REASONS`), as a same-host fallback if it is one: ``reason`` to a
        same-host peer that could map this worker's pool, else the reason every value of this reply is a copy. An
        empty value is not counted."""
        if self.plain_reason is None or not nbytes:
            return
        why = reason if self.plain_reason == "not-in-pool" else self.plain_reason
        self.service.handoffs.fallback(str(self.requester), why, self.service.record.worker)


#: Set while a worker writes its reply to ``get_data``; Dask's offload thread inherits it.
REQUEST: contextvars.ContextVar[Request | None] = contextvars.ContextVar("gpupool_request", default=None)


@dataclass
class ReadBlocks:
    """The receive-pool blocks given to one comm read of this worker while it runs (:func:`fill_after_read`).

    Ownership: while ``open``, ``blocks`` holds each block the receive pool gave the read
    (:meth:`ReceivePool.device_array <dask_gpupool.dask.ucx_receive.ReceivePool.device_array>`). When the read
    returns, every receive into them completed: the blocks are dropped here (the message's frames own them). When
    it raises, UCX may still write into them, so they are parked in
    :data:`~dask_gpupool.memory.lifetime.QUARANTINE` for this process's life (nothing here learns when UCX is done
    with them), never given back to the pool. Either way the collector is closed and emptied then.
    """

    open: bool = True
    blocks: list[Any] = field(default_factory=list)


#: Set while a comm read of this worker runs (:func:`fill_after_read`): the receive pool gives its blocks only to
#: such reads, whose end it is told of (any other read's frames come from distributed-ucxx's own ``device_array``).
READ_BLOCKS: contextvars.ContextVar[ReadBlocks | None] = contextvars.ContextVar("gpupool_read_blocks", default=None)


def install_get_data_hook(
    worker: Worker,
    service: PoolService,
    serializers: Callable[[Request], list[str] | None] | None = None,
    task_events: TaskEvents | None = None,
) -> Any:
    """Wrap ``worker``'s ``get_data`` handler so serializers know the requester.

    ``serializers(request)``, when given, names the serializer families for
    a reply (``None``: Dask's default); the worker plugin passes
    :func:`dask_gpupool.dask.device_objects.serializers_for`, so that
    same-host workers get device objects frame by frame. ``task_events``,
    when given, goes in every :class:`Request` (staging orders its copy after
    the task that made the array, :mod:`dask_gpupool.dask.task_events`).

    When every value asked for will go as an IPC descriptor, the reply is
    serialized on the event loop rather than in Dask's offload thread: Dask
    offloads any message whose ``sizeof`` passes ``distributed.comm.offload``
    (10 MiB), and a handoff's values are that large although what is
    serialized is a descriptor of a few hundred bytes. The thread hop cost
    about 0.5 ms per transfer, more than the rest of a handoff. So are a few
    CuPy arrays that a ``device`` pool stages and hands over (a device copy
    the export waits for). Over a UCX comm the same holds for a reply of a
    few device values (pool memory or CuPy arrays) that go as device frames:
    serializing them only enqueues GPU work that the comm's own synchronize
    waits for. Only that
    comm's ``allow_offload`` changes, for that reply, and the check runs only
    for replies Dask would offload (by the keys' recorded sizes).

    When the reply fails (the requester died), the frames of the exception's
    traceback are cleared: Dask logs the failure with its traceback and keeps
    the record in the worker's log deque (``distributed.admin.log-length``
    records), whose frames would otherwise keep the values of the reply, and
    with them pool memory, alive. Over a UCX comm, the device frames of a
    reply that ended without the requester's "OK" (failed, or cancelled while
    distributed-ucxx waits for its send) are parked instead
    (:meth:`Request.settle_frames`). Returns the original handler (to put back
    on teardown).
    """
    from distributed.comm import parse_address

    original = worker.handlers["get_data"]

    async def get_data(comm: Any, keys: Any = (), who: str | None = None, **kwargs: Any) -> Any:
        try:
            scheme = parse_address(comm.peer_address)[0]
        except Exception:
            scheme = ""
        request = Request(
            who, scheme, service, plain_reason=service.routes.plain_copy_reason(who), task_events=task_events
        )
        restore_write = _request_while_writing(comm, request)
        inline = getattr(comm, "allow_offload", False) and _inline_reply(worker, service, keys, who, scheme)
        if inline:
            comm.allow_offload = False
        if serializers is not None and kwargs.get("serializers") is None:
            families = serializers(request)
            if families is not None:
                kwargs["serializers"] = families
        start = time.perf_counter()
        ok = False
        try:
            result = await original(comm, keys=keys, who=who, **kwargs)
            ok = True  # Dask returns normally only once it has read the requester's "OK"
            return result
        except BaseException as e:
            # Dask logs a failed reply (requester gone) with its traceback, and the worker's log deque keeps
            # that record: the frames would keep the reply's values, and so pool memory, alive (also those of
            # its context: distributed-ucxx raises CommClosedError while handling UCX's error in its send).
            clear_tracebacks(e)
            raise
        finally:
            restore_write()
            request.settle_frames(ok)  # over UCX: what the requester may still read is kept out of reuse
            service.handoffs.timed("reply", time.perf_counter() - start)
            if inline:
                comm.allow_offload = True
            # The requester acknowledges a reply ("OK") only after its broker claims were answered, and a failed
            # reply is never used: either way such a lease still unclaimed now never will be. A lease claimed
            # by the reply is claimed with the "OK"; if the reply failed, the requester is asked.
            if request.granted:
                doubt = service.exports.settle(request.granted, who, ok)
                if doubt and who is not None:
                    _ask_later(worker, service, who, doubt)
            if request.forwarded:
                service.forwarder.settle_forwarded(request.forwarded, who)

    get_data.__wrapped__ = original  # type: ignore[attr-defined]
    worker.handlers["get_data"] = get_data
    return original


def _request_while_writing(comm: Any, request: Request) -> Callable[[], None]:
    """Set :data:`REQUEST` to ``request`` only while ``comm`` writes (the reply); returns what puts ``comm`` back.

    Not for the whole handler: Dask's ``get_data`` reads the keys from ``worker.data`` first, and unspilling one
    may evict others to disk, serialized right there. A value spilled under the request would go to disk as a
    descriptor under a lease of the requester's, which nobody claims, instead of its bytes.
    """
    own = "write" in vars(comm)
    write = comm.write

    async def write_reply(*args: Any, **kwargs: Any) -> Any:
        token = REQUEST.set(request)
        try:
            return await write(*args, **kwargs)
        finally:
            REQUEST.reset(token)

    comm.write = write_reply

    def restore() -> None:
        if own:
            comm.write = write
        else:
            del comm.write

    return restore


def install_lease_query_handler(worker: Worker, service: PoolService | None) -> None:
    """Answer exporters' :class:`~dask_gpupool.wire.handoff.LeaseQuery` on ``worker`` (``None``: remove ours).

    The handler (``worker.handlers[LEASE_QUERY_OP]``) parses the query (a
    malformed one is a :class:`~dask_gpupool.errors.ProtocolError` reply, and
    nothing changes) and answers from the service's releaser.
    """
    current = worker.handlers.get(LEASE_QUERY_OP)
    if service is None:
        if getattr(current, "__gpupool__", False):
            del worker.handlers[LEASE_QUERY_OP]
        return

    def lease_query(exporter: Any = None, leases: Any = None) -> dict[str, Any]:
        query = LeaseQuery.from_msg({"exporter": exporter, "leases": leases})
        return service.importer.answer_lease_query(query).to_msg()

    lease_query.__gpupool__ = True  # type: ignore[attr-defined]
    worker.handlers[LEASE_QUERY_OP] = lease_query


#: Seconds between an exporter's tries to ask an importer about leases in doubt, at first and at most.
_ASK_BACKOFF = (0.05, 5.0)

#: The running :func:`_ask` tasks (the event loop keeps only weak references to tasks).
_ASKING: set[asyncio.Future[None]] = set()


def _ask_later(worker: Worker, service: PoolService, who: str, leases: list[int]) -> None:
    """Ask ``who`` which of ``leases`` (claimed by a reply that failed) it holds, until it answers.

    Runs as a task on the worker's event loop, over Dask's own comm
    (:data:`~dask_gpupool.wire.handoff.LEASE_QUERY_OP`). While ``who`` cannot
    be reached the leases are kept (it may be stalled, with the memory
    mapped) and it is asked again with backoff; the loop ends once no lease
    is in doubt any more (answered, released, or ended because ``who``
    died or left), or the service closed.
    """
    task = asyncio.ensure_future(_ask(worker, service, who, leases))
    _ASKING.add(task)
    task.add_done_callback(_ASKING.discard)


async def _ask(worker: Worker, service: PoolService, who: str, leases: list[int]) -> None:
    delay, most = _ASK_BACKOFF
    while not service.closed:
        pending = service.leases.in_doubt(leases, who)
        if not pending:
            return
        try:
            for i in range(0, len(pending), MAX_LEASES_PER_MESSAGE):
                chunk = pending[i : i + MAX_LEASES_PER_MESSAGE]
                query = LeaseQuery(service.record.broker, tuple(chunk))
                raw = await getattr(worker.rpc(who), LEASE_QUERY_OP)(**query.to_msg())
                service.exports.resolve(chunk, who, list(LeaseQueryReply.from_msg(raw).held))
            continue
        except Exception as e:  # unreachable, closing, or a bad answer: keep the leases, ask again
            n = len(pending)
            logger.info("asking %s about %d lease(s) of a failed reply: %s; again in %.2fs", who, n, e, delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, most)


#: Comms (address schemes) that synchronize the GPU before they send a device frame: distributed-ucxx's ``write``
#: calls ``ucxx._cuda_context.synchronize_default_stream``, cuda.core's ``Device(0).sync()`` (distributed-ucxx
#: 0.52, which serves both schemes; without it distributed 2026.8 has no ``ucx`` comm). Over them pool memory goes
#: as device frames (or descriptors) whose serializing only enqueues GPU work (:mod:`dask_gpupool.dask.device_frames`),
#: on a worker whose GPU is :data:`SYNCHRONIZED_DEVICE`.
SYNCHRONIZING_SCHEMES = frozenset({"ucx", "ucxx"})

#: The one GPU (ordinal in the worker's process) that distributed-ucxx synchronizes, before it sends device frames
#: and in its ``read`` before it receives into them: ``synchronize_default_stream``'s default, which it never
#: overrides. dask-cuda's workers each see their GPU as 0; a worker on another ordinal (``gpupool.device``) waits
#: for its own staging copies and gets no receive pool.
SYNCHRONIZED_DEVICE = 0

#: The most bytes a reply may stage on the event loop (pool memory for UCX, or CuPy arrays into the pool over TCP):
#: above it a new allocation (``cuMemAlloc``, a new segment) could hold the loop for milliseconds, so Dask's offload
#: thread does it.
INLINE_STAGING_LIMIT = 256 << 20
#: The most values a reply may serialize on the event loop when it stages any (each costs 0.1-0.3 ms in a busy
#: worker).
INLINE_MAX_VALUES = 8


def _inline_reply(worker: Worker, service: PoolService, keys: Any, who: str | None, scheme: str) -> bool:
    """Whether to serialize a reply on the event loop: Dask would offload it, and all of it is descriptors, or
    (over UCX) device memory that goes as descriptors or device frames (:func:`_all_device_frames`)."""
    if not _offloaded(worker, keys):
        return False
    if scheme in SYNCHRONIZING_SCHEMES and _all_device_frames(worker, keys):
        return True
    return _all_handed_over(worker, service, keys, who, scheme)


def _all_device_frames(worker: Worker, keys: Any) -> bool:
    """Whether every key is in memory (not spilled) and device memory whose serializing for a UCX comm only
    enqueues GPU work: at most :data:`INLINE_MAX_VALUES` values, each device pool memory (this worker's or
    imported) or a CuPy array, with at most :data:`INLINE_STAGING_LIMIT` bytes of pool memory.

    Over a UCX comm such a value goes as an IPC descriptor or as device frames: pool memory staged by a copy that
    the comm's own synchronize waits for (no wait here), a CuPy array as distributed's frames (a contiguous copy
    at most, enqueued). That is cheaper than the hop to Dask's offload thread (about 0.5 ms).
    """
    values = _values_in_memory(worker, keys) if keys and len(keys) <= INLINE_MAX_VALUES else None
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


def _values_in_memory(worker: Worker, keys: Any) -> list[Any] | None:
    """The values of ``keys`` in ``worker``'s memory, or ``None`` if one is not there (spilled ones count as not
    there: looking at a SpillBuffer's in-memory part unspills nothing)."""
    data = getattr(worker.data, "fast", worker.data)
    try:
        return [data[key] for key in keys]
    except KeyError:
        return None


def _offloaded(worker: Worker, keys: Any) -> bool:
    """Whether Dask would offload serializing the reply: its values' recorded size passes the threshold.

    (Dask's own test is ``sizeof`` of the whole message; the recorded ``nbytes`` of the
    keys is that, less a few hundred bytes.) Below it nothing is to be gained, so the
    handoff check is not done twice on the common path of small values.
    """
    from distributed.comm import utils

    threshold = utils.OFFLOAD_THRESHOLD
    if not threshold:
        return False
    tasks = worker.state.tasks
    return sum((ts.nbytes or 0) for k in keys if (ts := tasks.get(k)) is not None) > threshold


def _all_handed_over(worker: Worker, service: PoolService, keys: Any, who: str | None, scheme: str) -> bool:
    """Whether every key is in memory (not spilled) and will go to ``who`` as an IPC descriptor (or forward).

    Counted as such too: a CuPy array outside the pool that a ``device`` pool stages for ``who``
    (:func:`_staged_on_device`), at most :data:`INLINE_MAX_VALUES` values and :data:`INLINE_STAGING_LIMIT` bytes
    of them in a reply: its copy is a device-to-device copy the export waits for, as distributed-ucxx's own
    synchronize waits for the GPU on the event loop.
    """
    values = _values_in_memory(worker, keys) if keys and who is not None else None
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
            service.routes.forward_route(origin, who, scheme)[0] if origin else service.routes.route(who, scheme, buf)
        )
        if row is None or reason is not None:
            return False
    return True


def _staged_on_device(service: PoolService, value: Any, who: str | None, scheme: str) -> bool:
    """Whether ``value`` is a CuPy array that this worker's ``device`` pool would copy into itself and hand to ``who``
    (:func:`~dask_gpupool.dask.plain_arrays.stage`; it may still decline, for a full pool, and send the array)."""
    if who is None or service.pool.kind != "device" or type(value).__module__.split(".", 1)[0] != "cupy":
        return False
    if not getattr(value, "size", 0) or service.routes.plain_copy_reason(who) != "not-in-pool":
        return False
    return service.routes.stage_route(who, scheme, int(value.nbytes)) is not None


def fill_after_read(worker: Worker, *, undo: bool = False) -> None:
    """Make the comms ``worker`` connects with run deferred copies in a thread once a read returns.

    Dask deserializes a small message on the event loop, and a handoff header
    is small even when the copy it names is gigabytes: the importer returns
    the landing buffer at once and leaves the copy in the collector this
    wrapper opens around ``comm.read`` (:func:`~dask_gpupool.handoff.deferred.collecting`).
    The wrapper runs the copies with ``asyncio.to_thread`` before it returns
    the message, so the values are complete when Dask stores them and the
    event loop keeps serving heartbeats and other transfers meanwhile. Values
    a deserializer left to the fills (placeholders of
    :func:`~dask_gpupool.handoff.deferred.make_later`) are put in their place
    then.

    A copy that fails is raised as :class:`~dask_gpupool.errors.DataLostError`
    (a ``ConnectionError``: Dask fetches the key again or recomputes it) and the
    comm is aborted, since the sender still waits for this reader's "OK". The
    same holds for a ``DataLostError`` a deserializer raised. The read runs
    with a :class:`ReadBlocks` collector open (:data:`READ_BLOCKS`): the UCX
    receive pool's blocks of a read that raises are parked, never given back.
    ``undo=True``
    puts Dask's ``connect`` back (comms already wrapped keep a wrapper that
    does nothing without collected copies).
    """
    rpc = getattr(worker, "rpc", None)
    current = getattr(rpc, "connect", None)
    if rpc is None or current is None:
        return
    if undo:
        if getattr(current, "__wrapped__", None) is not None:
            del rpc.connect  # the class's method again
        return
    if getattr(current, "__wrapped__", None) is not None:
        return  # already wrapped

    async def connect(addr: str, timeout: float | None = None) -> Any:
        comm = await current(addr, timeout)
        if not getattr(comm, "_gpupool_fills", False):
            comm.read = _read_then_fill(comm, comm.read, addr)
            comm._gpupool_fills = True
        return comm

    connect.__wrapped__ = current  # type: ignore[attr-defined]
    rpc.connect = connect


def _read_then_fill(comm: Any, read: Any, sender: str) -> Any:
    async def read_then_fill(deserializers: Any = None) -> Any:
        pending: list[Any] = []
        token = SENDER.set(sender)  # who answers on this comm: the worker this one connected to
        blocks = ReadBlocks()
        watched = READ_BLOCKS.set(blocks)  # the receive pool gives blocks to this read, and is told how it ended
        try:
            with collecting() as pending:
                msg = await read(deserializers)
        except BaseException as e:
            # UCX may still write into the receive-pool blocks of a read that did not complete: never given back
            QUARANTINE.park(blocks.blocks, None, f"a read from {sender} did not complete")
            abandon_all(pending)
            pending = []
            if isinstance(e, DataLostError):
                comm.abort()  # the sender waits for an "OK" that will not come
            # Dask logs the failure and keeps the record: no frame of it may keep imports (and so leases), or the
            # device frames a comm received (distributed-ucxx's read holds them), alive
            clear_tracebacks(e)
            raise
        finally:
            READ_BLOCKS.reset(watched)
            blocks.open = False
            blocks.blocks.clear()
            SENDER.reset(token)
        if not pending:
            return msg
        fills, laters = list(pending), list(getattr(pending, "laters", ()))
        pending = []

        def fill_then_resolve() -> Any:
            run_fills(fills)
            return resolve(msg, laters) if laters else msg  # values deserializers left to fills (device_objects)

        try:
            return await asyncio.to_thread(fill_then_resolve)
        except asyncio.CancelledError:
            comm.abort()  # the thread runs on with its fills (and ends or abandons them); nothing to clear here
            raise
        except BaseException as e:
            comm.abort()
            # Dask logs the failure and keeps the record: no frame of it may keep imports, and so leases, alive
            msg = None
            fills.clear()
            laters.clear()
            clear_tracebacks(e)
            if isinstance(e, DataLostError):
                raise
            raise DataLostError(
                f"a value from {comm.peer_address} could not be received: {type(e).__name__}: {e}"
            ) from e

    return read_then_fill


def clear_tracebacks(e: BaseException) -> None:
    """Clear the locals of the finished frames of ``e``'s tracebacks, its causes' and its contexts'."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        traceback.clear_frames(x.__traceback__)
        todo += [x.__cause__, x.__context__]


def count_own_memory_only(worker: Worker, *, undo: bool = False) -> None:
    """Make the process memory Dask reads for ``worker`` leave out the pages of peer pools it maps.

    Dask samples a worker's memory with ``worker.monitor.get_process_memory()``
    (the process's ``rss``): the figure behind the pause threshold, the spill
    decisions on process memory, and the memory the scheduler and dashboard
    show. The kernel counts a shared page in the ``rss`` of every process that
    touched it, so a ``host`` pool handoff would count the producer's memory
    twice: in the producer, which owns it, and in every consumer that read it
    (:func:`~dask_gpupool.memory.peer_resident.peer_resident_bytes`). The wrapper
    subtracts the latter. ``undo=True`` puts Dask's own method back.

    The nanny's terminate threshold reads ``rss`` itself, in another process:
    it still counts mapped peer pages (docs/cpu-users.md).
    """
    monitor = getattr(worker, "monitor", None)
    current = getattr(monitor, "get_process_memory", None)
    if monitor is None or current is None:
        return
    if undo:
        if getattr(current, "__wrapped__", None) is not None:
            monitor.get_process_memory = current.__wrapped__
        return
    if getattr(current, "__wrapped__", None) is not None:
        return  # already wrapped

    def get_process_memory() -> int:
        return max(current() - peer_resident_bytes(), 0)

    get_process_memory.__wrapped__ = current  # type: ignore[attr-defined]
    monitor.get_process_memory = get_process_memory
