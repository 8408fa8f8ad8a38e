"""What a serializer or deserializer is told about the message it is part of, and the ContextVars that tell it.

Dask calls a serializer as ``dumps(x)`` or ``dumps(x, context=...)`` and a deserializer as ``loads(header,
frames)``; distributed-ucxx asks for a receive buffer as ``device_array(n)``; ``prometheus_client`` calls a
collector as ``collect()``. None of these signatures carries who asked for a value, which comm read a frame
belongs to, or which server is scraped (the ``context`` of the ``"dask"`` and ``"pickle"`` families names the
peer's listening address, not the worker that asked in ``get_data``; the ``"cuda"`` family has no ``context``). So
these, and only these, are ContextVars, each set by the one caller that owns what it names and read once, at the
entry point Dask or UCX calls, which passes it on as a parameter:

- :data:`REQUEST` (here): the ``get_data`` reply being written (:class:`Request`), set by the ``get_data`` wrapper
  only while the reply's ``comm.write`` runs (:mod:`~dask_gpupool.dask.distributed_seam`); read by the registered
  serializers of the ``"dask"``, ``"cuda"``, ``"pickle"`` and ``gpupool-frames`` families.
- :data:`READ_BLOCKS` (here): the receive-pool blocks of the comm read being run (:class:`ReadBlocks`, owned by
  that read, :mod:`~dask_gpupool.dask.comms`); read by distributed-ucxx's ``device_array``
  (:meth:`ReceivePool.device_array <dask_gpupool.dask.ucx_receive.ReceivePool.device_array>`).
- :data:`~dask_gpupool.handoff.deferred.SENDER`: the worker whose message is being read; read by deserializers
  (a lease claimed by the reply, a host frame's landing buffer, the worker a lost value came from).
- ``_PENDING`` (:mod:`dask_gpupool.handoff.deferred`): the fills and claims a comm read collects; read by
  deserializers that leave a copy, a claim or a value to run after the read.
- ``_SERVING`` (:mod:`dask_gpupool.ops.metrics`): which server's ``/metrics`` is answered; read by the collectors.

Everything else a serializer decides with is passed to it: the serializer Dask calls reads the ContextVar once
and hands the :class:`Request` (or ``None``) to every helper. Deserializers find the worker's service with
:func:`~dask_gpupool.handoff.registry.active_service` (process-wide: a deserializer also runs in reads no wrapper
sees, such as a handler's).
"""

from __future__ import annotations

import contextvars
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dask_gpupool.handoff.routes import TCP_SCHEMES, UCX_SCHEMES
from dask_gpupool.memory.lifetime import QUARANTINE

if TYPE_CHECKING:
    from dask_gpupool.dask.task_events import TaskEvents
    from dask_gpupool.handoff.service import PoolService

__all__ = [
    "READ_BLOCKS",
    "REQUEST",
    "SYNCHRONIZED_DEVICE",
    "SYNCHRONIZING_SCHEMES",
    "ReadBlocks",
    "Request",
    "clear_tracebacks",
]


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
    """The receive-pool blocks given to one comm read of this worker while it runs
    (:func:`~dask_gpupool.dask.comms.read_then_fill`).

    Ownership: while ``open``, ``blocks`` holds each block the receive pool gave the read
    (:meth:`ReceivePool.device_array <dask_gpupool.dask.ucx_receive.ReceivePool.device_array>`). When the read
    returns, every receive into them completed: the blocks are dropped here (the message's frames own them). When
    it raises, UCX may still write into them, so they are parked in
    :data:`~dask_gpupool.memory.lifetime.QUARANTINE` for this process's life (nothing here learns when UCX is done
    with them), never given back to the pool. Either way the collector is closed and emptied then.
    """

    open: bool = True
    blocks: list[Any] = field(default_factory=list)


#: Set while a comm read of this worker runs (:func:`~dask_gpupool.dask.comms.read_then_fill`): the receive pool
#: gives its blocks only to such reads, whose end it is told of (any other read's frames come from distributed-ucxx's
#: own ``device_array``).
READ_BLOCKS: contextvars.ContextVar[ReadBlocks | None] = contextvars.ContextVar("gpupool_read_blocks", default=None)


#: Comms (address schemes) that synchronize the GPU before they send a device frame: distributed-ucxx's ``write``
#: calls ``ucxx._cuda_context.synchronize_default_stream``, cuda.core's ``Device(0).sync()`` (distributed-ucxx
#: 0.52, which serves both schemes; without it distributed 2026.8 has no ``ucx`` comm). Over them pool memory goes
#: as device frames (or descriptors) whose serializing only enqueues GPU work (:mod:`dask_gpupool.dask.cuda_family`),
#: on a worker whose GPU is :data:`SYNCHRONIZED_DEVICE`.
SYNCHRONIZING_SCHEMES = frozenset({"ucx", "ucxx"})

#: The one GPU (ordinal in the worker's process) that distributed-ucxx synchronizes, before it sends device frames
#: and in its ``read`` before it receives into them: ``synchronize_default_stream``'s default, which it never
#: overrides. dask-cuda's workers each see their GPU as 0; a worker on another ordinal (``gpupool.device``) waits
#: for its own staging copies and gets no receive pool.
SYNCHRONIZED_DEVICE = 0


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
