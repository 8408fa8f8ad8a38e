"""A buffer imported from a peer, to its release: its memory resource (:class:`ImportedMemoryResource`), and the
:class:`Releaser` that sends the lease releases in batches from a thread of its own.

The Buffer handed to Dask and user code is ``Buffer.from_handle(ptr, size, mr=ImportedMemoryResource(...))``: when
it is closed or garbage-collected, ``deallocate`` closes the underlying import under the process's import lock and
queues the lease release. The releaser's thread waits for the GPU work recorded with it (what was queued on the
legacy default stream: the exporter never reuses memory a kernel here still reads), then sends it over the
exporter's :class:`~dask_gpupool.transport.link.PeerLink`, off the hot path. Which leases are held, and which were
released, is kept by :class:`~dask_gpupool.handoff.held.HeldLeases`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cuda.core import MemoryResource

from dask_gpupool.errors import GPUPoolError
from dask_gpupool.handoff.held import HeldLeases
from dask_gpupool.handoff.mapped_pool import IMPORT_LOCK
from dask_gpupool.memory.topology import current_gpu, sleeping_event
from dask_gpupool.transport.link import LinkFactory
from dask_gpupool.wire.handoff import BufferDescriptor

if TYPE_CHECKING:
    from cuda.core import Buffer

    from dask_gpupool.handoff.mapped_pool import MappedPool

__all__ = [
    "ImportedMemoryResource",
    "Origin",
    "Releaser",
]

logger = logging.getLogger(__name__)


# -- an imported buffer's memory resource ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Origin:
    """Where an imported buffer's memory lives: what passing it on needs.

    Attributes
    ----------
    exporter : str
        The worker whose pool holds the memory.
    desc : BufferDescriptor
        The descriptor this import was made from (pool, segment, offset, size).
    lease : int
        This worker's lease on it, held while the import is open.
    """

    exporter: str
    desc: BufferDescriptor
    lease: int


class ImportedMemoryResource(MemoryResource):
    """The memory resource of one buffer imported from a peer's pool.

    Parameters
    ----------
    raw : cuda.core.Buffer
        The import itself, shared with other users of the same allocation in
        this process (:meth:`MappedPool.acquire`); the last one closes it.
    key : object
        Its key for :meth:`MappedPool.unshare`.
    mapped : MappedPool
        The mapping ``raw`` came from (kept alive while the buffer lives).
    on_close : callable
        Called with the cuda.core Event to wait for (or ``None``) and the
        ``(id, claims)`` of a retiring segment unmapped with it (or ``None``)
        once the import is closed; queues the lease (and segment) release.
    origin : Origin, optional
        The exporter, descriptor and lease of the import (for passing the
        value on: :meth:`~dask_gpupool.handoff.forwarding.Forwarder.forward`).

    Notes
    -----
    The Buffer built over this resource is the only owner of ``raw``;
    closing it (or losing the last reference) runs :meth:`deallocate` once.
    """

    mapped: MappedPool
    origin: Origin | None
    _key: Any
    _open: bool
    _on_close: Callable[[Any, Any], None]
    _device_accessible: bool
    _host_accessible: bool
    _device_id: int

    def __init__(
        self,
        raw: Buffer,
        key: Any,
        mapped: MappedPool,
        on_close: Callable[[Any, Any], None],
        origin: Origin | None = None,
    ) -> None:
        self.mapped = mapped
        self.origin = origin
        self._key = key
        self._open = True
        self._on_close = on_close
        self._device_accessible = bool(raw.is_device_accessible)
        self._host_accessible = bool(raw.is_host_accessible)
        # The GPU that uses the import: this process's own GPU (granted access to the pool), not the
        # pool's resident GPU. Array libraries run on it; CuPy would otherwise enable context peer
        # access to the owner's GPU for every kernel, which breaks imports across GPUs (seen on two H200s;
        # docs/design.md, "Handoff", across GPUs).
        self._device_id = int(mapped.device) if mapped.device is not None else int(raw.device_id)

    def allocate(self, size: int, *, stream: Any = None) -> Buffer:
        raise TypeError("an imported buffer's resource cannot allocate")

    def deallocate(self, ptr: Any, size: int, *, stream: Any = None) -> None:
        if not self._open:
            return
        self._open = False
        event = segment = None
        try:
            with IMPORT_LOCK:
                raw, segment = self.mapped.unshare(self._key)
                if self.mapped.device is not None and self._device_accessible:
                    dev = current_gpu(self.mapped.device)
                    if raw is not None:
                        raw.close(dev.default_stream)
                    # Work queued here on blocking streams (CuPy's default) must finish before the
                    # exporter may reuse the memory: the releaser waits for this event.
                    event = sleeping_event(dev.default_stream)
                elif raw is not None:
                    raw.close()
        except Exception:
            logger.exception("closing an import from pool %s failed", self.mapped.record.pool)
        finally:
            self._on_close(event, segment)

    @property
    def is_device_accessible(self) -> bool:
        return self._device_accessible

    @property
    def is_host_accessible(self) -> bool:
        return self._host_accessible

    @property
    def device_id(self) -> int:
        return self._device_id


# -- the releases, sent from a thread of their own ---------------------------------------------------------------------


class Releaser:
    """Sends lease releases in batches from its own thread.

    :meth:`put` is called from ``ImportedMemoryResource.deallocate`` (any
    thread, often the garbage collector's); the thread waits for the GPU work
    recorded with each release to finish, then drops the lease from the live
    set (``held``) and sends one
    :class:`~dask_gpupool.wire.broker_leases.LeaseRelease` (and one
    :class:`~dask_gpupool.wire.broker_leases.SegmentRelease` for unmapped retiring
    segments) per exporter.

    When a send fails (the exporter stalled past ``broker-timeout``, its
    socket buffer full), nothing is dropped: the exporter keeps the leases,
    and this thread opens the link again with backoff. The new link starts
    with a :class:`~dask_gpupool.wire.broker_leases.Resync` of the live set, which
    ends every lease released meanwhile; segment releases are sent again.
    It gives up on an exporter only when ``links`` says it left the cluster.

    Parameters
    ----------
    links : LinkFactory
        Opens (or returns) the link to an exporter, by broker address.
    held : HeldLeases
        The importer's leases: released ones leave its live set.
    """

    sent: int
    segments_sent: int
    resyncs: int
    held: HeldLeases
    _pending: list[tuple[str, int, Any, tuple[tuple[int, int], ...], bool]]
    _retry: dict[str, _Releases]
    _cond: threading.Condition
    _closed: bool
    _thread: threading.Thread

    def __init__(self, links: LinkFactory, held: HeldLeases) -> None:
        self.sent = self.segments_sent = self.resyncs = 0
        self.held = held
        self._links = links
        self._pending = []
        self._retry = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="gpupool-releaser", daemon=True)
        self._thread.start()

    def put(
        self,
        exporter: str,
        lease: int,
        event: Any = None,
        segments: tuple[tuple[int, int], ...] = (),
        unmapped: bool = False,
    ) -> None:
        """Queue a release; ``event`` (a cuda.core Event or ``None``) must complete first.

        ``lease`` 0 releases no lease; ``segments`` are ``(id, claims)`` of
        segment imports closed before ``event`` was recorded. ``unmapped``:
        the lease was never mapped here (its import failed), so its segment
        was never counted here, and the exporter takes back the claim it
        noted (:class:`~dask_gpupool.wire.broker_leases.LeaseRelease`).
        From now until the release was written to the exporter, ``lease`` is
        refused to a header naming it again (:meth:`HeldLeases.begin
        <dask_gpupool.handoff.held.HeldLeases.begin>`).
        """
        if lease:
            self.held.releasing(exporter, lease)
        with self._cond:
            self._pending.append((exporter, lease, event, segments, unmapped))
            self._cond.notify()

    def answer(self, exporter: str, leases: tuple[int, ...] | list[int]) -> list[int]:
        """Which of ``leases`` (of a reply that failed at ``exporter``) are held here; the others are refused for
        good (:meth:`HeldLeases.answer <dask_gpupool.handoff.held.HeldLeases.answer>`). Those held and released
        here already are released again."""
        held, again = self.held.answer(exporter, leases)
        if again:
            with self._cond:
                self._pending.extend((exporter, lease, None, (), False) for lease in again)
                self._cond.notify()
        return held

    def forget(self, exporter: str) -> None:
        """``exporter`` left the cluster: nothing to release there any more."""
        with self._cond:
            self._retry.pop(exporter, None)
        self.held.forget(exporter)

    def settle_later(self, exporter: str, leases: list[int]) -> None:
        """Tell ``exporter`` once it can be reached again that the replies carrying these forwarded leases ended.

        For a :class:`~dask_gpupool.wire.broker_leases.ForwardSettle` that
        could not be sent when the reply ended (the link was down): sent
        after the new link's resync, as releases are, so that the leases
        nobody claimed end while this worker lives. Dropped if ``exporter``
        leaves the cluster (:meth:`forget`).
        """
        with self._cond:
            self._retry.setdefault(exporter, _Releases()).settled.extend(leases)
            self._cond.notify()

    def _run(self) -> None:
        backoff = 0.05
        while True:
            with self._cond:
                if not self._pending and not self._closed:
                    self._cond.wait(backoff if self._retry else None)
                if not self._pending and self._closed:
                    return
                batch, self._pending = self._pending, []
            self._send(batch)
            if self._retry_failed():
                backoff = 0.05
            else:
                backoff = min(backoff * 2, 2.0)

    def _send(self, batch: list[tuple[str, int, Any, tuple[tuple[int, int], ...], bool]]) -> None:
        by_exporter: dict[str, _Releases] = {}
        markers = []
        for exporter, lease, event, segments, unmapped in batch:
            if not exporter:  # flush(): done once everything before it was handled
                markers.append(event)
                continue
            if event is not None:
                try:
                    event.sync()
                    event.close()
                except Exception:  # the GPU work failed; the memory is no longer ours to guard
                    logger.exception("waiting for GPU work before releasing lease %d failed", lease)
            entry = by_exporter.setdefault(exporter, _Releases())
            if lease:
                (entry.unmapped if unmapped else entry.leases).append(lease)
            entry.segments.extend(segments)
        for exporter, entry in by_exporter.items():
            # unmapped leases stay live until their release was written (_deliver). Not covered: the link breaking
            # after the write, and the new link's resync read before the old link's release; the claim then stays
            # until this worker leaves.
            self.held.released(exporter, entry.leases)
        for exporter, entry in by_exporter.items():
            if not entry:
                continue
            with self._cond:
                retry = self._retry.get(exporter)
                if retry is not None:  # the link is down: sent after the new link's resync
                    retry.extend(entry)
                    continue
            self._deliver(exporter, entry)
        for marker in markers:
            marker.sync()

    def _deliver(self, exporter: str, entry: _Releases) -> bool:
        try:
            link = self._links(exporter)
            if link is None:  # the exporter left: its leases went with it
                self.forget(exporter)
                return True
            if entry.unmapped:
                link.release(entry.unmapped, unmapped=True)
                self.sent += len(entry.unmapped)
                self.held.released(exporter, entry.unmapped, unmapped=True)
            if entry.leases:
                link.release(entry.leases)
                self.sent += len(entry.leases)
            if entry.segments:
                link.release_segments(entry.segments)
                self.segments_sent += len(entry.segments)
            if entry.settled:
                link.settle_forwarded(entry.settled)
            self.held.settled(exporter, entry.leases + entry.unmapped)
            return True
        except Exception as e:
            # A GPUPoolError is the link failing (the link turns OSError into PeerLostError). Anything else is a
            # fault of ours: logged with its traceback, and retried the same way, for raised out of here it would
            # end this thread, and every later release would stay queued (the exporter keeping that memory until
            # this process exits).
            (logger.info if isinstance(e, GPUPoolError) else logger.exception)(
                "releasing %d lease(s), %d segment(s), settling %d forwarded at %s failed (%s); retrying",
                len(entry.leases) + len(entry.unmapped),
                len(entry.segments),
                len(entry.settled),
                exporter,
                e,
            )
            with self._cond:
                # sent again once a new link is open: its resync ends the leases it does not list only if they
                # were claimed by then, and a lease claimed later (an answer) must still be released
                self._retry.setdefault(exporter, _Releases()).extend(entry)
            return False

    def _retry_failed(self) -> bool:
        """Open broken links again (they resync on opening) and resend the releases; whether all went."""
        with self._cond:
            retry, self._retry = self._retry, {}
        ok = True
        for exporter, entry in retry.items():
            if not self._deliver(exporter, entry):
                ok = False
            else:
                self.resyncs += 1
        return ok

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until everything queued so far has been handled (tests, teardown)."""
        done = threading.Event()
        with self._cond:
            self._pending.append(("", 0, _SetOnSync(done), (), False))
            self._cond.notify()
        done.wait(timeout)

    def close(self) -> None:
        """Send what is queued, then stop the thread. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)


class _Releases:
    """What one exporter is told in one go: leases released (used here), leases never mapped here, segments, and
    leases forwarded in replies that ended (:meth:`Releaser.settle_later`)."""

    __slots__ = ("leases", "segments", "settled", "unmapped")

    def __init__(self) -> None:
        self.leases: list[int] = []
        self.unmapped: list[int] = []
        self.segments: list[tuple[int, int]] = []
        self.settled: list[int] = []

    def extend(self, other: _Releases) -> None:
        self.leases.extend(other.leases)
        self.unmapped.extend(other.unmapped)
        self.segments.extend(other.segments)
        self.settled.extend(other.settled)

    def __bool__(self) -> bool:
        return bool(self.leases or self.unmapped or self.segments or self.settled)


class _SetOnSync:
    """A stand-in event whose ``sync`` marks a :meth:`Releaser.flush` done."""

    def __init__(self, done: threading.Event) -> None:
        self._done = done

    def sync(self) -> None:
        self._done.set()

    def close(self) -> None:
        pass
