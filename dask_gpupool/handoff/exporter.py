"""The exporter's side of a handoff: what each ``get_data`` reply carries, and what the worker's broker answers.

:class:`Exports` makes what a reply carries for a value of this worker's pool, as
:class:`~dask_gpupool.handoff.routes.Routes` decided: an IPC descriptor under a lease (:meth:`Exports.export_ipc`)
or stream leases for the pipelined copy (:meth:`Exports.export_stream`); it ends the leases a reply left unclaimed
(:meth:`Exports.settle`) and takes back a value of this pool that a peer passed back (:meth:`Exports.take_back`).
It runs where Dask serializes: the event loop or its offload thread.

:class:`ExportSide` is the worker's :class:`~dask_gpupool.transport.broker_handler.BrokerHandler`, on the broker's
thread (``copy_out`` on a helper thread of its loop): it hands out the pool's fd and VMM segment fds, records claims
and releases on the leases (:class:`~dask_gpupool.handoff.leases.LeaseTable`), keeps the retire ledger of segments
told (:meth:`~dask_gpupool.memory.segments.SegmentedResource.note_claims`), and makes host copies of leased buffers
into memfds for importers that could not map them. :class:`Exported` is what an IPC lease keeps alive. The
:class:`~dask_gpupool.handoff.service.PoolService` owns one of each.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from cuda.core import Buffer

from dask_gpupool import tuning
from dask_gpupool.config import PoolOptions
from dask_gpupool.errors import BrokerRefusedError, DataLostError, GPUPoolError, NotAMemberError, UnknownPoolError
from dask_gpupool.handoff.leases import LeaseTable
from dask_gpupool.handoff.registry import RegistryView
from dask_gpupool.handoff.routes import Routes
from dask_gpupool.handoff.stats import HandoffStats
from dask_gpupool.memory.buffers import buffer_kind, copy_to_host
from dask_gpupool.memory.pool import Pool
from dask_gpupool.memory.topology import current_gpu
from dask_gpupool.transport.stream import CopyServer, Staged, lanes
from dask_gpupool.wire.broker import HandleReply
from dask_gpupool.wire.handoff import ArrayMeta, HandoffHeader
from dask_gpupool.wire.registry import PoolRecord

__all__ = ["ExportSide", "Exported", "Exports", "make_current"]

logger = logging.getLogger(__name__)


def make_current(pool: Pool) -> Callable[[], None]:
    """A function that makes ``pool``'s GPU current in the calling thread (nothing for host pools)."""

    def make_current() -> None:
        if pool.device is not None:
            current_gpu(pool.device)

    return make_current


class Exported:
    """What an IPC lease keeps alive: the value handed over (``holder``) and the pool buffer under it, whose writes
    had finished when the descriptor went out."""

    __slots__ = ("buf", "holder")

    def __init__(self, holder: Any, buf: Buffer) -> None:
        self.holder, self.buf = holder, buf


class Exports:
    """The exports one worker makes for its handoffs, and the leases they grant.

    Parameters
    ----------
    options : PoolOptions
    pool : Pool
        This worker's own pool.
    worker : str
        This worker's address (the exporter named in headers).
    leases : LeaseTable
        This worker's leases: each export grants one (or one per lane).
    handoffs : HandoffStats
        The worker's counters (exports, copies, timings).
    routes : Routes
        This worker's routing decisions (peers whose reply failed).
    copier : CopyServer or None
        The copy server stream leases are pulled from (``None``: that path is off).
    left : callable or None
        Called with the row of an importer that left the registry before its IPC lease was granted (its route was
        decided before): the service watches it again, so that the lease ends when its process exits, or at once if
        it has already (its removal ended only what it held then). ``None``: nothing.
    """

    options: PoolOptions
    pool: Pool
    worker: str
    leases: LeaseTable
    handoffs: HandoffStats
    routes: Routes
    copier: CopyServer | None
    left: Callable[[PoolRecord], None] | None

    def __init__(
        self,
        options: PoolOptions,
        pool: Pool,
        worker: str,
        leases: LeaseTable,
        handoffs: HandoffStats,
        routes: Routes,
        copier: CopyServer | None,
        left: Callable[[PoolRecord], None] | None = None,
    ) -> None:
        self.options = options
        self.pool = pool
        self.worker = worker
        self.leases = leases
        self.handoffs = handoffs
        self.routes = routes
        self.copier = copier
        self.left = left

    def export_ipc(
        self,
        holder: Any,
        buf: Buffer,
        row: PoolRecord,
        array: ArrayMeta | None,
        *,
        written_on: Any = None,
        written_by: Any = None,
    ) -> HandoffHeader:
        """Grant ``row``'s worker a lease on ``buf`` and describe it.

        ``holder`` (``buf`` or an object that keeps it alive) stays referenced by the lease until the importer
        releases it. The GPU work that wrote ``buf`` has finished before the descriptor goes out (:meth:`_order`), so
        the importer holds the lease once it has deserialized the header (``claim="reply"``), and the reply's "OK"
        tells this worker (:meth:`settle`). ``written_on`` (a CuPy stream): the caller wrote ``buf`` itself on that
        stream (a staged copy), so only that stream's work counts. ``written_by`` (a cuda.core event, owned by the
        caller's :class:`~dask_gpupool.dask.task_events.TaskEvents`): ``holder`` is a task result of this worker,
        and no GPU work of its task comes after that event, so only the event counts (not with ``device``).
        """
        start = time.perf_counter()
        desc = self.pool.export(buf)
        self._order(written_on, written_by)
        lease = self.leases.grant(Exported(holder, buf), buf.size, row.worker, desc.segment, by_reply=True)
        if self.left is not None and self.routes.registry.worker_row(row.worker) is None:
            # It left after its route was decided (a reply outlasting the wait for the GPU above): granted after the
            # removal released its leases, this one would wait for ever for a process that may be gone.
            self.left(row)
        if desc.segment:
            # noted now: the importer's release of the segment may come before this worker reads the "OK"
            segmented = self.pool.segmented
            if segmented is not None:
                segmented.note_claims([desc.segment], row.worker)
        self.handoffs.add(exports=1)
        self.handoffs.timed("export", time.perf_counter() - start)
        return HandoffHeader(
            "ipc",
            self.pool.kind,
            buf.size,
            exporter=self.worker,
            desc=desc,
            lease=lease,
            array=array,
            claim="reply",
        )

    def _order(self, written_on: Any, written_by: Any = None) -> None:
        """Finish the GPU work that may still write an exported buffer.

        What may still write it: the work queued on ``written_on`` (a staged copy's stream) when given; else, for a
        task result whose event is known (``written_by``, recorded on the legacy default stream when Dask stored it:
        it follows every blocking stream's earlier work, CuPy's default included), the work before that event; else
        every kernel of the process on the pool's GPU.

        ``sync``: that work is finished here (``written_on`` synchronized, ``written_by`` waited for, or the whole GPU
        synchronized). ``device``: the same, but always the whole GPU for a value the caller did not write itself, so
        that work a task left on a non-blocking stream is covered too. Host pools have nothing to order.
        """
        device = self.pool.device
        if device is None and written_on is None:
            return
        if written_on is not None:
            written_on.synchronize()
        elif written_by is not None and self.options.handoff_ordering == "sync":
            waiting = time.perf_counter()
            if device is not None:
                current_gpu(device)  # the event's context current in this thread (an offload thread may not be)
            written_by.sync()
            self.handoffs.timed("export-task-wait", time.perf_counter() - waiting)
        else:
            current_gpu(device).sync()

    def settle(self, leases: list[int], requester: str | None, ok: bool = False) -> list[int]:
        """The ``get_data`` reply that carried ``leases`` to ``requester`` ended (``ok``: its "OK" was read).

        A lease of :meth:`export_ipc` is claimed by the reply: claimed when ``ok``, and in doubt otherwise (the caller
        asks the importer, :meth:`resolve`). A stream lease that no pull claimed by now will never be used: it ends. A
        reply whose leases were left unclaimed failed at the importer (or never reached it): for ``lease-timeout``
        seconds its handoffs go as copies instead (fallback ``peer-unreachable``), so that Dask's retry of the transfer
        succeeds. Returns the leases in doubt.
        """
        n, doubt = self.leases.settle(leases, ok)
        if n:
            self._unreachable(requester, n)
        return doubt

    def revoke(self, leases: list[int], requester: str | None) -> int:
        """End ``leases`` at once: granted for a reply, their headers will not be sent. Returns how many ended.

        Segments noted at the grant of reply-claimed ones are taken back.
        """
        n, segments = self.leases.revoke(leases)
        if requester:
            self.pool.forget_claims(segments, requester)
        return n

    def resolve(self, leases: list[int], requester: str, held: list[int]) -> int:
        """``requester`` answered which of the in-doubt ``leases`` it holds: end the others; return how many ended."""
        n, segments = self.leases.resolve(leases, requester, held)
        self.pool.forget_claims(segments, requester)
        if n:
            self._unreachable(requester, n)
        return n

    def _unreachable(self, requester: str | None, n: int) -> None:
        """``n`` leases sent to ``requester`` were never held: its handoffs go as copies for ``lease-timeout``."""
        if not requester:
            return
        self.routes.mark_unreachable(requester, self.options.lease_timeout)
        logger.warning(
            "pool %s: %d lease(s) sent to %s were never claimed (its transfer failed); its handoffs go "
            "as copies for %.0f s",
            self.pool.uuid,
            n,
            requester,
            self.options.lease_timeout,
        )

    def take_back(self, header: HandoffHeader) -> Buffer:
        """A value of this worker's pool that a peer passed back (:meth:`Forwarder.forward
        <dask_gpupool.handoff.forwarding.Forwarder.forward>` on the peer): the pool buffer itself.

        The lease the peer asked for in this worker's name kept the buffer alive until here; it ends now
        (:meth:`LeaseTable.take <dask_gpupool.handoff.leases.LeaseTable.take>`), and the caller's reference keeps the
        buffer alive from then on. Nothing is mapped or copied (counted in ``returns``).

        Raises
        ------
        DataLostError
            If the lease has ended (the peer died, or settled it first):
            distributed then fetches the value again.
        """
        held = self.leases.take(header.lease, self.worker)
        if not isinstance(held, Exported):
            raise DataLostError(f"lease {header.lease} on this worker's pool {self.pool.uuid} has ended")
        self.handoffs.add(returns=1, zero_copy_bytes=int(held.buf.size))
        return held.buf

    def export_stream(
        self, holder: Any, buf: Buffer, offset: int, nbytes: int, row: PoolRecord, array: ArrayMeta | None
    ) -> HandoffHeader:
        """Grant ``row``'s worker a stream lease on ``nbytes`` of ``buf`` from ``offset``, to pull.

        ``holder`` stays referenced by the lease until the copy server has copied the last chunk out (or the lease
        expires unpulled). Pending GPU work is finished first, as for :meth:`export_ipc`.
        """
        assert self.copier is not None
        if buf.is_device_accessible:
            current_gpu(int(buf.device_id) if int(buf.device_id) >= 0 else (self.pool.device or 0)).sync()
        parts = lanes(nbytes, tuning.COPY_CHUNK_SIZE, tuning.COPY_STREAMS)
        leases = [self.leases.grant(Staged(holder, buf, offset + off, n), n, row.worker) for off, n in parts]
        self.handoffs.add(copied_out_bytes=nbytes, streamed_out_bytes=nbytes)
        return HandoffHeader(
            "stream",
            buffer_kind(buf),
            nbytes,
            exporter=self.worker,
            lease=leases[0],
            array=array,
            address=self.copier.address,
            lanes=tuple(leases[1:]),
        )


class ExportSide:
    """The :class:`~dask_gpupool.transport.broker_handler.BrokerHandler` of a worker: its pool's fd and its leases.

    Runs on the broker's thread. Importers are worker addresses, accepted (:meth:`identify`) only when this worker's
    copy of the registry has a row for that worker on this host whose pid is the connecting process's.

    Attributes
    ----------
    on_transfer_failed : callable or None
        Called (broker's thread) with an importer that reported a failed transfer
        (:class:`~dask_gpupool.wire.broker_leases.TransferFailed`); the service sets it to send that importer copies
        for a while. ``None``: nothing is done.
    refuses : callable or None
        Whether to refuse a forward to a worker (broker's thread): the service sets it to the workers whose transfers
        go as copies for now, so that a forwarder's retry sends a copy too. ``None``: no worker is refused.
    closing : bool
        Set when the broker closes every connection: peers did not unmap anything.
    """

    on_transfer_failed: Callable[[str], None] | None
    refuses: Callable[[str], bool] | None

    def __init__(self, pool: Pool, leases: LeaseTable, registry: RegistryView, host: str) -> None:
        self._pool = pool
        self._leases = leases
        self._registry = registry
        self._host = host
        self.on_transfer_failed = None
        self.refuses = None
        self.closing = False  # the broker closes every connection: peers did not unmap anything
        self._resync_epochs: dict[str, int] = {}  # per importer, the newest resync applied

    def thread_started(self) -> None:
        make_current(self._pool)()

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

    def release(self, leases: Iterable[int], importer: str, unmapped: bool = False) -> None:
        if unmapped:  # its import failed: the segment claims noted for these leases go back first
            leases = list(leases)
            self._pool.forget_claims([self._leases.copied_instead(lease, importer) for lease in leases], importer)
        self._leases.release(leases, importer)

    def transfer_failed(self, importer: str) -> None:
        if self.on_transfer_failed is not None:
            self.on_transfer_failed(importer)

    def resync(self, leases: set[int], importer: str, epoch: int = 0) -> int:
        if epoch:
            if epoch <= self._resync_epochs.get(importer, 0):
                # an older snapshot than one applied (sent on a link that broke, read late): applying it would end
                # leases the importer claimed since
                logger.info("pool %s: ignored a stale resync (epoch %d) from %s", self._pool.uuid, epoch, importer)
                return 0
            self._resync_epochs[importer] = epoch
        n = self._leases.resync(importer, leases)
        if n:
            logger.info("pool %s: %s resynced; ended %d lease(s) it had released", self._pool.uuid, importer, n)
        return n

    def segments_released(self, segments: tuple[tuple[int, int], ...], importer: str) -> None:
        segmented = self._pool.segmented
        if segmented is not None:
            segmented.note_released(list(segments), importer)

    def forward(self, lease: int, importer: str, to: str) -> tuple[int, int]:
        row = self._registry.worker_row(to)
        if row is None or row.host != self._host or to == importer:
            raise NotAMemberError(f"lease {lease}: {to!r} is not another worker of this host in the registry")
        if self.refuses is not None and self.refuses(to):
            # a transfer to it failed (peer-unreachable): the forwarder sends a copy, so that Dask's retry succeeds
            raise BrokerRefusedError(f"lease {lease}: transfers to {to} go as copies for now")
        granted = self._leases.forward(lease, importer, to)
        if granted is None:
            raise DataLostError(f"lease {lease} on pool {self._pool.uuid} is not a claimed IPC lease of {importer}")
        return granted

    def settle_forwarded(self, leases: Iterable[int], importer: str) -> None:
        n = self._leases.settle_forwarded(leases, importer)
        if n:
            logger.info("pool %s: %d lease(s) %s forwarded were never claimed; ended", self._pool.uuid, n, importer)

    def importer_exited(self, importer: str) -> None:
        self._resync_epochs.pop(importer, None)  # nothing more to order for this process
        n = self._leases.release_importer(importer)
        if n:
            logger.info("pool %s: importer %s exited; released its %d lease(s)", self._pool.uuid, importer, n)
        segmented = self._pool.segmented
        if segmented is not None and not self.closing:
            segmented.drop_connection(importer)

    def copy_out(self, lease: int, importer: str) -> tuple[int, int]:
        """A host copy of ``importer``'s leased buffer ``lease`` in a new memfd: ``(memfd, size)``.

        The memfd is the **caller's** (the broker closes it once sent); it is closed here when the copy into it fails.
        The lease stays: its importer releases it.

        Raises
        ------
        DataLostError
            The lease has ended (or is another worker's), or the copy failed
            (a CUDA error).
        BrokerRefusedError
            No memfd can be made now (``EMFILE``, ``ENFILE``, ``ENOMEM``): this
            request is refused; nothing was made, and the connection serves on.
        """
        holder = self._leases.holder_for(lease, importer)
        if holder is None:
            raise DataLostError(f"lease {lease} on pool {self._pool.uuid} has ended (or is not {importer}'s)")
        # it could not map it: it never will for this lease
        self._pool.forget_claims([self._leases.copied_instead(lease, importer)], importer)
        if isinstance(holder, Staged):  # a stream lease: its span of the buffer
            buf, offset, n = holder.buf, holder.offset, holder.nbytes
        else:
            buf, offset, n = holder.buf, 0, int(holder.buf.size)
        try:
            fd = os.memfd_create("dask-gpupool-copy", os.MFD_CLOEXEC)
        except OSError as e:  # EMFILE, ENFILE, ENOMEM: this request is refused, the connection keeps serving
            raise BrokerRefusedError(
                f"lease {lease}: no host copy of pool {self._pool.uuid} can be made now: {e}"
            ) from e
        try:
            if n:
                os.ftruncate(fd, n)
                with mmap.mmap(fd, n) as m:
                    copy_to_host(buf, offset, n, out=m)
        except BaseException as e:
            os.close(fd)
            if isinstance(e, Exception) and not isinstance(e, GPUPoolError):  # a CUDA error: an ErrorReply
                raise DataLostError(f"lease {lease}: the copy out of pool {self._pool.uuid} failed: {e}") from e
            raise
        return fd, n

    def tick(self) -> None:
        self._leases.overdue()
