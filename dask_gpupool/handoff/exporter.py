"""The exporter's side of the broker: what a worker answers the importers of its pool.

:class:`ExportSide` is the worker's
:class:`~dask_gpupool.transport.broker_handler.BrokerHandler`: it hands out its
pool's fd and VMM segment fds, records claims and releases on the leases the
:class:`~dask_gpupool.handoff.service.PoolService` granted
(:class:`~dask_gpupool.handoff.leases.LeaseTable`), keeps the retire ledger of
segments told (:meth:`~dask_gpupool.memory.segments.SegmentedResource.note_claims`),
and makes host copies of leased buffers into memfds for importers that could
not map them. :class:`Exported` is what an IPC lease keeps alive.

Threads: every method runs on the broker's thread, ``copy_out`` on a helper
thread of the broker's loop.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from dask_gpupool.errors import BrokerRefusedError, DataLostError, GPUPoolError, NotAMemberError, UnknownPoolError
from dask_gpupool.handoff.leases import LeaseTable
from dask_gpupool.handoff.registry import RegistryView
from dask_gpupool.memory.buffers import copy_to_host
from dask_gpupool.memory.pool import Pool
from dask_gpupool.memory.topology import current_gpu
from dask_gpupool.transport.stream import Staged
from dask_gpupool.wire.broker import HandleReply

if TYPE_CHECKING:
    from cuda.core import Buffer

__all__ = ["ExportSide", "Exported", "make_current"]

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


class ExportSide:
    """The :class:`~dask_gpupool.transport.broker_handler.BrokerHandler` of a worker: its pool's fd and its leases.

    Runs on the broker's thread. Importers are worker addresses, accepted
    (:meth:`identify`) only when this worker's copy of the registry has a row
    for that worker on this host whose pid is the connecting process's.

    Attributes
    ----------
    on_transfer_failed : callable or None
        Called (broker's thread) with an importer that reported a failed
        transfer (:class:`~dask_gpupool.wire.broker_leases.TransferFailed`);
        the :class:`~dask_gpupool.handoff.service.PoolService` sets it to send
        that importer copies for a while. ``None``: nothing is done.
    refuses : callable or None
        Whether to refuse a forward to a worker (broker's thread): the
        :class:`~dask_gpupool.handoff.service.PoolService` sets it to the
        workers whose transfers go as copies for now, so that a forwarder's
        retry sends a copy too. ``None``: no worker is refused.
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

        The memfd is the **caller's** (the broker closes it once sent); it is
        closed here when the copy into it fails. The lease stays: its
        importer releases it.

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
