"""The importer's lease releases: sent in batches from a thread of their own (:class:`Releaser`).

``ImportedMemoryResource.deallocate`` (:mod:`dask_gpupool.handoff.imported`)
queues each release; the thread waits for the GPU work recorded with it,
then sends it over the exporter's :class:`~dask_gpupool.transport.link.PeerLink`,
off the hot path.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from dask_gpupool.errors import GPUPoolError
from dask_gpupool.transport.link import LinkFactory

__all__ = ["REFUSED_EXPORTERS", "REFUSED_KEPT", "Releaser"]

logger = logging.getLogger(__name__)

#: Refused lease ids kept in all, and released ones per exporter (:meth:`Releaser.answer`).
REFUSED_KEPT = 65536
#: Exporters whose refusals are kept (a query may name any string of up to 4 KiB).
REFUSED_EXPORTERS = 1024


class Releaser:
    """Sends lease releases in batches from its own thread, and keeps the importer's live leases.

    :meth:`put` is called from ``ImportedMemoryResource.deallocate`` (any
    thread, often the garbage collector's); the thread waits for the GPU work
    recorded with each release to finish, then drops the lease from the live
    set and sends one :class:`~dask_gpupool.wire.broker_leases.LeaseRelease` (and one
    :class:`~dask_gpupool.wire.broker_leases.SegmentRelease` for unmapped retiring
    segments) per exporter.

    When a send fails (the exporter stalled past ``broker-timeout``, its
    socket buffer full), nothing is dropped: the exporter keeps the leases,
    and this thread opens the link again with backoff. The new link starts
    with a :class:`~dask_gpupool.wire.broker_leases.Resync` of the live set, which
    ends every lease released meanwhile; segment releases are sent again.
    It gives up on an exporter only when ``links`` says it left the cluster.

    Leases claimed by the reply (``claim="reply"`` in their header) are held
    here without asking the exporter (:meth:`hold_here`). When such a reply
    failed at the exporter, it asks which of its leases this worker holds
    (:meth:`answer`): the others are refused for good from then on, so a
    header of that reply deserialized later cannot hold them.

    Parameters
    ----------
    links : LinkFactory
        Opens (or returns) the link to an exporter, by broker address.
    """

    sent: int
    segments_sent: int
    resyncs: int
    _pending: list[tuple[str, int, Any, tuple[tuple[int, int], ...], bool]]
    _live: dict[str, set[int]]
    _epoch: dict[str, int]
    _retry: dict[str, _Releases]
    _resyncing: dict[str, set[int]]
    _importing: dict[str, set[int]]
    _releasing: dict[str, set[int]]
    _ended: dict[str, dict[int, None]]
    _refused: dict[str, dict[int, None]]
    _released: dict[str, dict[int, None]]
    _cond: threading.Condition
    _closed: bool
    _thread: threading.Thread

    def __init__(self, links: LinkFactory) -> None:
        self.sent = self.segments_sent = self.resyncs = 0
        self._links = links
        self._pending = []
        self._live = {}
        self._epoch = {}
        self._retry = {}
        self._resyncing = {}
        self._importing = {}
        self._releasing = {}
        self._ended = {}
        self._refused = {}
        self._refused_total = 0
        self._released = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="gpupool-releaser", daemon=True)
        self._thread.start()

    # -- the live set ------------------------------------------------------------

    def epoch(self, exporter: str) -> int:
        """A number that changes whenever a resync of ``exporter`` snapshots the live set."""
        with self._cond:
            return self._epoch.get(exporter, 0)

    def hold(self, exporter: str, leases: list[int], *, epoch: int) -> bool:
        """Add claimed leases to the live set, unless a resync snapshot was taken since ``epoch``."""
        with self._cond:
            if self._epoch.get(exporter, 0) != epoch:
                return False
            self._live.setdefault(exporter, set()).update(leases)
            return True

    def snapshot(self, exporter: str) -> tuple[list[int], int]:
        """The live leases of ``exporter`` for a resync, and the new epoch; claims in flight must be held again.

        Until :meth:`resynced` says that this epoch's resync was answered,
        :meth:`hold_here` holds nothing of ``exporter``: a lease held here
        after the snapshot, and claimed by its reply meanwhile, would be ended
        by the resync that does not list it.

        Epochs grow with the host's monotonic clock (nanoseconds), so that a
        process that takes over a worker address after another numbers its
        resyncs above the earlier process's (the exporter ignores a resync
        older than the newest it applied for that address).
        """
        with self._cond:
            epoch = self._epoch[exporter] = max(self._epoch.get(exporter, 0) + 1, time.monotonic_ns())
            self._resyncing.setdefault(exporter, set()).add(epoch)
            return sorted(self._live.get(exporter, ())), epoch

    def resynced(self, exporter: str, epoch: int) -> None:
        """The resync of snapshot ``epoch`` was answered by the exporter.

        Resyncs of earlier snapshots that are still open (one on another
        thread, or one whose answer never came: the exporter may read it
        later) close with it: the exporter ignores a resync older than the
        newest it answered (:meth:`ExportSide.resync
        <dask_gpupool.handoff.exporter.ExportSide.resync>`). A resync that
        failed stays open until a later one is answered.
        """
        with self._cond:
            open_ = self._resyncing.get(exporter)
            if open_ is None:
                return
            open_.difference_update([e for e in open_ if e <= epoch])
            if not open_:
                del self._resyncing[exporter]

    def begin(self, exporter: str, lease: int) -> bool:
        """Start an import of ``lease`` of ``exporter``; ``False`` when one is open here, or was released.

        A lease keeps memory alive for one import. A header naming it again
        (a member replaying a descriptor it sent before) would be claimed
        again, which the exporter answers as held, and its import's release
        would end the lease while the first import still maps the memory. So
        a lease is imported here once: from :meth:`begin` until its release
        was queued (:meth:`put`) it is open; then it is releasing until that
        release was written to the exporter (:meth:`_deliver`), whether it
        was ever held here or not (a claim that failed on a broken link may
        have reached the exporter, which then counts it claimed until that
        release arrives); then it is kept among the released ones (held
        here: :meth:`answer`) or the ended ones, at most :data:`REFUSED_KEPT`
        per exporter, forgotten when the exporter leaves (:meth:`forget`). An
        import that ends without a release says so with :meth:`end_import`.
        """
        with self._cond:
            if (
                lease in self._importing.get(exporter, ())
                or lease in self._releasing.get(exporter, ())
                or lease in self._live.get(exporter, ())
                or lease in self._released.get(exporter, ())
                or lease in self._ended.get(exporter, ())
            ):
                return False
            self._importing.setdefault(exporter, set()).add(lease)
            return True

    def end_import(self, exporter: str, lease: int) -> None:
        """The import of ``lease`` that :meth:`begin` started ended without a release (it failed before it held
        anything, or its release was queued already: then this changes nothing, and the lease stays refused until
        that release was written, :meth:`put`)."""
        with self._cond:
            self._end_import(exporter, lease)

    def _end_import(self, exporter: str, lease: int) -> None:
        """Called under the lock."""
        importing = self._importing.get(exporter)
        if importing is not None:
            importing.discard(lease)
            if not importing:
                del self._importing[exporter]

    def hold_here(self, exporter: str, lease: int) -> bool | None:
        """Hold a lease claimed by its reply: ``True`` held; ``False`` refused (:meth:`answer` said this
        worker does not hold it, and the exporter ends it); ``None``: a resync of ``exporter`` is open, so the
        caller claims over the broker instead."""
        with self._cond:
            if lease in self._refused.get(exporter, ()):
                return False
            if exporter in self._resyncing:
                return None
            self._live.setdefault(exporter, set()).add(lease)
            return True

    def answer(self, exporter: str, leases: tuple[int, ...] | list[int]) -> list[int]:
        """Which of ``leases`` (of a reply that failed at ``exporter``) are held here; refuse the others for good.

        A lease held here and released since counts as held: its release
        (sent, queued behind a broken link, or resynced) ends it at the
        exporter, and its segment was counted here, so the exporter must not
        take the segment's claim back as it does for a lease never held.
        Refusals are kept for the last :data:`REFUSED_KEPT` leases in all
        (the least recently asked exporter's oldest go first), releases for
        as many per exporter: a header is deserialized within a reply's
        lifetime, long before that many later replies failed.
        """
        with self._cond:
            live = self._live.get(exporter, set())
            released = self._released.get(exporter, {})
            refused = self._refused.pop(exporter, {})
            held = []
            for lease in leases:
                if lease in live:
                    held.append(lease)
                elif lease in released:
                    held.append(lease)
                    # released once; sent again, so that it ends even if the exporter counts it claimed only now
                    # (its first release may have gone before the answer, or be waiting for a broken link)
                    self._pending.append((exporter, lease, None, (), False))
                elif lease not in refused:
                    refused[lease] = None
                    self._refused_total += 1
            if refused:
                self._refused[exporter] = refused  # the most recently asked exporter last: the others go first
            self._bound_refused()
            self._cond.notify()
            return held

    def _bound_refused(self) -> None:
        """Keep at most :data:`REFUSED_KEPT` refusals in all, of at most :data:`REFUSED_EXPORTERS` exporters: the
        least recently asked exporter's go first, its oldest ids first. Called under the lock.

        Only a peer that floods this worker with queries (any peer may send one over Dask's comm) can evict the
        refusals of a real exporter asked before the flood; a header of that exporter's failed reply deserialized
        after that could then be held. Bounded memory is the trade-off taken.
        """
        while len(self._refused) > REFUSED_EXPORTERS:
            self._refused_total -= len(self._refused.pop(next(iter(self._refused))))
        while self._refused_total > REFUSED_KEPT:
            exporter = next(iter(self._refused))
            ids = self._refused[exporter]
            if ids:
                del ids[next(iter(ids))]
                self._refused_total -= 1
            if not ids:
                del self._refused[exporter]

    def holds(self, exporter: str, lease: int) -> bool:
        """Whether ``lease`` of ``exporter`` is held here (claimed and acknowledged, or held by its reply)."""
        with self._cond:
            return lease in self._live.get(exporter, ())

    def live(self, exporter: str | None = None) -> int:
        """Leases held (of one exporter, or all)."""
        with self._cond:
            if exporter is not None:
                return len(self._live.get(exporter, ()))
            return sum(len(v) for v in self._live.values())

    def forget(self, exporter: str) -> None:
        """``exporter`` left the cluster: nothing to release there any more."""
        with self._cond:
            self._live.pop(exporter, None)
            self._retry.pop(exporter, None)
            self._refused_total -= len(self._refused.pop(exporter, {}))
            self._released.pop(exporter, None)
            self._releasing.pop(exporter, None)
            self._ended.pop(exporter, None)

    # -- releases ------------------------------------------------------------------

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
        refused to a header naming it again (:meth:`begin`).
        """
        with self._cond:
            self._pending.append((exporter, lease, event, segments, unmapped))
            if lease:
                self._end_import(exporter, lease)
                self._releasing.setdefault(exporter, set()).add(lease)  # refused until written (begin, _settled)
            self._cond.notify()

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
        with self._cond:
            for exporter, entry in by_exporter.items():
                live = self._live.get(exporter)
                if live is not None:
                    released = self._released.setdefault(exporter, {})
                    for lease in entry.leases:  # held and used here: answered as held from now on (answer)
                        if lease in live:
                            released[lease] = None
                    _bound(released)
                    # unmapped leases stay live until their release was written: a resync on a link reopened
                    # before that must keep them, or it would end them without taking their segment claims back
                    # (_deliver). Not covered: the link breaking after the write, and the new link's resync read
                    # before the old link's release; the claim then stays until this worker leaves.
                    self._drop_live(exporter, entry.leases)
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
                with self._cond:
                    self._drop_live(exporter, entry.unmapped)
            if entry.leases:
                link.release(entry.leases)
                self.sent += len(entry.leases)
            if entry.segments:
                link.release_segments(entry.segments)
                self.segments_sent += len(entry.segments)
            if entry.settled:
                link.settle_forwarded(entry.settled)
            with self._cond:
                self._settled(exporter, entry.leases + entry.unmapped)
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

    def _settled(self, exporter: str, leases: list[int]) -> None:
        """The releases of ``leases`` were written to ``exporter``: releasing no more, kept as ended (unless kept as
        released already), at most :data:`REFUSED_KEPT` per exporter. Called under the lock."""
        releasing = self._releasing.get(exporter)
        if releasing is None:
            return
        released = self._released.get(exporter, {})
        ended = self._ended.setdefault(exporter, {})
        for lease in leases:
            if lease in releasing:
                releasing.discard(lease)
                if lease not in released:
                    ended[lease] = None
        _bound(ended)
        if not releasing:
            del self._releasing[exporter]
        if not ended:
            del self._ended[exporter]

    def _drop_live(self, exporter: str, leases: list[int]) -> None:
        """Take ``leases`` out of ``exporter``'s live set (dropped when empty). Called under the lock."""
        live = self._live.get(exporter)
        if live is not None:
            live.difference_update(leases)
            if not live:
                del self._live[exporter]

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


def _bound(ids: dict[int, None]) -> None:
    """Keep the last :data:`REFUSED_KEPT` ids (insertion order)."""
    while len(ids) > REFUSED_KEPT:
        del ids[next(iter(ids))]


class _SetOnSync:
    """A stand-in event whose ``sync`` marks a :meth:`Releaser.flush` done."""

    def __init__(self, done: threading.Event) -> None:
        self._done = done

    def sync(self) -> None:
        self._done.set()

    def close(self) -> None:
        pass
