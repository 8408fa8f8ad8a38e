"""A full segmented pool's last resorts: free the idle spares, then reclaim the spares peers map (:class:`Reclaim`).

A buffer larger than the segment size gets a segment of its own, kept as a
*spare* when the buffer is freed (:mod:`dask_gpupool.memory.own_segments`).
When the upstream pool is full, :class:`Reclaim` first frees the idle spares
that no peer maps and the allocation is tried once more; then it *reclaims*
the idle spares peers still map: retires them one by one (they take no new
buffer), publishes their ids through the callback the pool's owner set
(the registry row's ``reclaim``), and peers unmap them as they do retiring
segments. An allocation that may wait (a task's own: ``wait``) waits for
their releases, up to the owner's timeout; any other fails at once (its
caller has a fallback) and later allocations find the memory back.

Ownership: frees nothing on its own terms: spares are the resource's
segments, taken from its :class:`~dask_gpupool.memory.segment_source.SegmentSource`
and freed through it. Shares the resource's lock and segment table.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask_gpupool.errors import PoolClosedError, PoolExhaustedError

if TYPE_CHECKING:
    from dask_gpupool.memory.home_stream import HomeStream
    from dask_gpupool.memory.own_segments import OwnSegments
    from dask_gpupool.memory.retire import RetireLedger
    from dask_gpupool.memory.segment_source import SegmentSource
    from dask_gpupool.memory.segment_table import SegmentTable

__all__ = ["Reclaim"]

logger = logging.getLogger(__name__)


class Reclaim:
    """How a full :class:`~dask_gpupool.memory.segments.SegmentedResource` gets room back from its spares.

    Parameters
    ----------
    segments : SegmentTable
        The resource's segments, read and changed under ``lock``.
    lock : threading.RLock
        The resource's lock.
    source : SegmentSource
        Where the resource's segments come from and go back to.
    own : OwnSegments
        The resource's placement of large buffers (it says which spares are idle).
    ledger : RetireLedger
        Which peers map which segments.
    home : HomeStream or None
        The GPU's default stream, synchronized before spares are freed (``None`` for host memory).
    retire_below : callable
        The resource's current ``retire_below``: segments below it were retired all at once, those above it that
        retire were reclaimed one by one.

    Attributes
    ----------
    publish : callable or None
        Set by :meth:`through`: makes peers see :meth:`reclaimed` (``None``: nothing is reclaimed).
    timeout : float
        Seconds an allocation that may wait waits for reclaimed spares.
    freed : threading.Condition
        Over ``lock``: notified when the resource freed segments (:meth:`notify_freed`).
    closed : bool
        The resource closed: waiting allocations end.
    """

    publish: Callable[[], None] | None
    timeout: float
    freed: threading.Condition
    closed: bool

    def __init__(
        self,
        segments: SegmentTable,
        lock: threading.RLock,
        source: SegmentSource,
        own: OwnSegments,
        ledger: RetireLedger,
        home: HomeStream | None,
        retire_below: Callable[[], int],
    ) -> None:
        self._segments = segments
        self._lock = lock
        self._source = source
        self._own = own
        self._ledger = ledger
        self._home = home
        self._retire_below = retire_below
        self.publish = None
        self.timeout = 0.0
        self.freed = threading.Condition(lock)
        self.closed = False

    def through(self, publish: Callable[[], None] | None, timeout: float) -> None:
        """Let a full pool reclaim large buffers' spare segments that peers still map (``None``: no more).

        ``publish()`` is called from the allocating thread, so it must not
        block, each time a full pool has reclaimed spares not freed yet; the
        caller makes peers see the resource's ``reclaim`` as it is when the
        row goes out (the registry row's ``reclaim``). Peers then unmap those
        segments as they do retiring ones, and their releases free them. An
        allocation that may wait (``wait``) waits up to ``timeout`` seconds
        for that, except on a thread running an event loop; others fail at
        once, and later allocations find the memory back.
        """
        with self._lock:
            self.publish, self.timeout = publish, timeout

    def close(self) -> None:
        """The resource closed (call with ``lock`` held): no more reclaims, waiting allocations end."""
        self.closed = True
        self.publish = None
        self.freed.notify_all()

    def notify_freed(self) -> None:
        """The resource freed segments: allocations waiting for reclaimed spares look again."""
        with self._lock:
            self.freed.notify_all()

    def reclaimed(self) -> set[int]:
        """Ids of spares retired one by one, not freed yet: own segments retiring at or above ``retire_below``.

        (A retire marks every segment below ``retire_below``; only a reclaim retires one above it.) Call with
        ``lock`` held.
        """
        below = self._retire_below()
        return {s.id for s in self._segments if s.own and s.retiring and s.id >= below}

    def when_full(
        self, place: Callable[[int, Any], int], size: int, stream: Any, full: PoolExhaustedError, wait: bool
    ) -> int:
        """The upstream is full: free idle spares, then reclaim those peers map, and place ``size`` again.

        ``wait``: the caller may wait up to :attr:`timeout` for peers to release the reclaimed spares (a task's
        own allocation), except on a thread running an event loop. Raises ``full`` when neither gives room in
        time.
        """
        if self.drop_spares():
            try:
                return place(size, stream)  # the upstream has the spares' memory back
            except PoolExhaustedError as again:
                full = again
        pending = self._reclaim_spares()
        if not pending or not wait or _on_event_loop():
            raise full
        deadline = time.monotonic() + self.timeout
        while True:
            with self._lock:
                left = {i for i in pending if self._segments.get(i) is not None}
                while left == pending and time.monotonic() < deadline and not self.closed:
                    self.freed.wait(deadline - time.monotonic())
                    left = {i for i in pending if self._segments.get(i) is not None}
                if self.closed:
                    raise PoolClosedError("the segmented resource closed while an allocation waited for room")
            if left == pending:  # nothing freed in time
                raise PoolExhaustedError(
                    f"{full}; {len(pending)} spare segment(s) that peers map are being reclaimed "
                    f"and were not released within {self.timeout:g} s"
                ) from full
            self.drop_spares()
            try:
                return place(size, stream)
            except PoolExhaustedError:
                if not left:
                    raise
                pending = left

    def _reclaim_spares(self) -> set[int]:
        """Retire the spares that no buffer uses but peers map; publish; return the reclaimed ids not freed yet."""
        with self._lock:
            if self.publish is None or self.closed:
                return set()
            fresh = [s for s in self._segments if s.own and not s.live and not s.retiring and self._ledger.mapped(s.id)]
            for s in fresh:
                s.retiring = True
            pending, publish = self.reclaimed(), self.publish
        if fresh:
            logger.info(
                "pool full: reclaiming %d large-buffer segment(s) that peers map, %d bytes",
                len(fresh),
                sum(s.size for s in fresh),
            )
        if pending:
            try:  # every time, not only for fresh ones: an earlier row may have been lost or refused
                publish()
            except Exception:  # the worker is shutting down, say: no waiting for releases that cannot come
                logger.warning("pool full: publishing the reclaimed segments failed", exc_info=True)
                return set()
        return pending

    def drop_spares(self) -> int:
        """Free own segments that hold no buffer and that no peer maps (a full pool's last resort); how many."""
        with self._lock:  # unregistered here, so that no allocation takes one meanwhile
            spares = [self._source.unregister(s) for s in self._own.idle(self._ledger.mapped)]
        if not spares:
            return 0
        if self._home is not None:
            self._home.sync()  # their last buffers' frees have run
        for s in spares:
            self._source.free(s)
        freed = sum(s.size for s in spares)
        logger.info("pool full: freed %d idle large-buffer segment(s), %d bytes", len(spares), freed)
        return len(spares)


def _on_event_loop() -> bool:
    """Whether this thread runs an asyncio event loop (a worker's, a broker's): it must not wait there."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
