"""Which leases of its exporters an importer holds, is importing or has released (:class:`HeldLeases`).

Kept per exporter (by broker address): the live set that a resync of a new
link sends, the epochs of its resync snapshots, the imports open and the
releases not written yet (a header naming such a lease again is refused),
the releases written, and the leases refused in answer to an exporter's
query. The :class:`~dask_gpupool.handoff.importer.Importer` begins imports
and holds the leases claimed by their reply;
:class:`~dask_gpupool.handoff.links.ExporterLinks` snapshots the live set for
resyncs and holds the leases claimed over the broker; the
:class:`~dask_gpupool.handoff.imported.Releaser` moves leases out of it as
their releases go. Thread-safe: one lock, held only inside these methods.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

__all__ = ["REFUSED_EXPORTERS", "REFUSED_KEPT", "HeldLeases"]

#: Refused lease ids kept in all, and released ones (held here or not) per exporter (:meth:`HeldLeases.answer`).
REFUSED_KEPT = 65536
#: Exporters whose refusals are kept (a query may name any string of up to 4 KiB).
REFUSED_EXPORTERS = 1024


class _Ledger:
    """What the importer knows of one exporter's leases (read and changed under the lock of :class:`HeldLeases`).

    ``live``: held here, claimed over the broker and acknowledged, or held by the reply that carried it.
    ``open``: imports begun (``False``), and leases whose release is queued but not written yet (``True``).
    ``done``: releases written (or leases held and released here), and whether each was held here; the last
    :data:`REFUSED_KEPT`, oldest first. ``epoch``: the newest resync snapshot's number; ``resyncing``: the
    epochs of snapshots whose resync was not answered yet.
    """

    __slots__ = ("done", "epoch", "live", "open", "resyncing")

    def __init__(self) -> None:
        self.live: set[int] = set()
        self.open: dict[int, bool] = {}
        self.done: dict[int, bool] = {}
        self.epoch = 0
        self.resyncing: set[int] = set()


class HeldLeases:
    """The importer's leases, per exporter: held, open, released, refused.

    A lease is held in one of two ways. Claimed by its reply (``claim="reply"``
    in its header), it is held here without asking the exporter
    (:meth:`hold_here`); when such a reply failed at the exporter, it asks
    which of its leases this worker holds (:meth:`answer`): the others are
    refused for good from then on, so a header of that reply deserialized
    later cannot hold them. Claimed over the exporter's broker (a forwarded
    lease, or one received while a resync of that exporter is open), it is
    held once the exporter acknowledged it (:meth:`hold`).
    """

    _ledgers: dict[str, _Ledger]
    _refused: dict[str, dict[int, None]]
    _lock: threading.Lock

    def __init__(self) -> None:
        self._ledgers = {}
        self._refused = {}
        self._refused_total = 0
        self._lock = threading.Lock()

    def _ledger(self, exporter: str) -> _Ledger:
        """``exporter``'s ledger, made on first use. Called under the lock."""
        ledger = self._ledgers.get(exporter)
        if ledger is None:
            ledger = self._ledgers[exporter] = _Ledger()
        return ledger

    # -- claims and resyncs -------------------------------------------------------

    def epoch(self, exporter: str) -> int:
        """A number that changes whenever a resync of ``exporter`` snapshots the live set."""
        with self._lock:
            ledger = self._ledgers.get(exporter)
            return 0 if ledger is None else ledger.epoch

    def hold(self, exporter: str, leases: list[int], *, epoch: int) -> bool:
        """Add leases claimed over the broker to the live set, unless a resync snapshot was taken since ``epoch``."""
        with self._lock:
            ledger = self._ledger(exporter)
            if ledger.epoch != epoch:
                return False
            ledger.live.update(leases)
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
        with self._lock:
            ledger = self._ledger(exporter)
            ledger.epoch = max(ledger.epoch + 1, time.monotonic_ns())
            ledger.resyncing.add(ledger.epoch)
            return sorted(ledger.live), ledger.epoch

    def resynced(self, exporter: str, epoch: int) -> None:
        """The resync of snapshot ``epoch`` was answered by the exporter.

        Resyncs of earlier snapshots that are still open (one on another
        thread, or one whose answer never came: the exporter may read it
        later) close with it: the exporter ignores a resync older than the
        newest it answered (:meth:`ExportSide.resync
        <dask_gpupool.handoff.exporter.ExportSide.resync>`). A resync that
        failed stays open until a later one is answered.
        """
        with self._lock:
            ledger = self._ledgers.get(exporter)
            if ledger is not None:
                ledger.resyncing.difference_update([e for e in ledger.resyncing if e <= epoch])

    # -- imports ------------------------------------------------------------------

    def begin(self, exporter: str, lease: int) -> bool:
        """Start an import of ``lease`` of ``exporter``; ``False`` when one is open here, or was released.

        A lease keeps memory alive for one import. A header naming it again
        (a member replaying a descriptor it sent before) would be claimed
        again, which the exporter answers as held, and its import's release
        would end the lease while the first import still maps the memory. So
        a lease is imported here once: from :meth:`begin` until its release
        was queued (:meth:`releasing`) it is open; then it is releasing until
        that release was written to the exporter (:meth:`settled`), whether
        it was ever held here or not (a claim that failed on a broken link
        may have reached the exporter, which then counts it claimed until
        that release arrives); then it is kept among the done ones (answered
        as held by :meth:`answer` if it was held here), at most
        :data:`REFUSED_KEPT` per exporter, forgotten when the exporter leaves
        (:meth:`forget`). An import that ends without a release says so with
        :meth:`end_import`.
        """
        with self._lock:
            ledger = self._ledger(exporter)
            if lease in ledger.open or lease in ledger.live or lease in ledger.done:
                return False
            ledger.open[lease] = False
            return True

    def end_import(self, exporter: str, lease: int) -> None:
        """The import of ``lease`` that :meth:`begin` started ended without a release (it failed before it held
        anything, or its release was queued already: then this changes nothing, and the lease stays refused until
        that release was written)."""
        with self._lock:
            ledger = self._ledgers.get(exporter)
            if ledger is not None and ledger.open.get(lease) is False:
                del ledger.open[lease]

    def hold_here(self, exporter: str, lease: int) -> bool | None:
        """Hold a lease claimed by its reply: ``True`` held; ``False`` refused (:meth:`answer` said this
        worker does not hold it, and the exporter ends it); ``None``: a resync of ``exporter`` is open, so the
        caller claims over the broker instead."""
        with self._lock:
            if lease in self._refused.get(exporter, ()):
                return False
            ledger = self._ledger(exporter)
            if ledger.resyncing:
                return None
            ledger.live.add(lease)
            return True

    def holds(self, exporter: str, lease: int) -> bool:
        """Whether ``lease`` of ``exporter`` is held here (claimed and acknowledged, or held by its reply)."""
        with self._lock:
            ledger = self._ledgers.get(exporter)
            return ledger is not None and lease in ledger.live

    def live(self, exporter: str | None = None) -> int:
        """Leases held (of one exporter, or all)."""
        with self._lock:
            if exporter is not None:
                ledger = self._ledgers.get(exporter)
                return 0 if ledger is None else len(ledger.live)
            return sum(len(ledger.live) for ledger in self._ledgers.values())

    # -- an exporter's query --------------------------------------------------------

    def answer(self, exporter: str, leases: Iterable[int]) -> tuple[list[int], list[int]]:
        """Which of ``leases`` (of a reply that failed at ``exporter``) are held here; refuse the others for good.

        Returns the held ones, and those of them released here already: the
        caller sends their releases again, so that they end even if the
        exporter counts them claimed only from this answer on (a first
        release may have gone before it, or wait for a broken link).

        A lease held here and released since counts as held: its release
        (sent, queued behind a broken link, or resynced) ends it at the
        exporter, and its segment was counted here, so the exporter must not
        take the segment's claim back as it does for a lease never held.
        Refusals are kept for the last :data:`REFUSED_KEPT` leases in all
        (the least recently asked exporter's oldest go first), releases for
        as many per exporter: a header is deserialized within a reply's
        lifetime, long before that many later replies failed.
        """
        with self._lock:
            ledger = self._ledgers.get(exporter) or _Ledger()  # an exporter never imported from gets no ledger
            refused = self._refused.pop(exporter, {})
            held: list[int] = []
            again: list[int] = []
            for lease in leases:
                if lease in ledger.live:
                    held.append(lease)
                elif ledger.done.get(lease):
                    held.append(lease)
                    again.append(lease)
                elif lease not in refused:
                    refused[lease] = None
                    self._refused_total += 1
            if refused:
                self._refused[exporter] = refused  # the most recently asked exporter last: the others go first
            self._bound_refused()
            return held, again

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

    # -- releases (the releaser's) ----------------------------------------------------

    def releasing(self, exporter: str, lease: int) -> None:
        """The release of ``lease`` was queued: refused to a header naming it until it was written (:meth:`begin`)."""
        with self._lock:
            self._ledger(exporter).open[lease] = True

    def released(self, exporter: str, leases: list[int], *, unmapped: bool = False) -> None:
        """Take ``leases``, whose GPU work is done, out of the live set: about to be released.

        Those held here are answered as held from now on (:meth:`answer`).
        ``unmapped`` leases (never mapped here) are taken out only once their
        release was written: a resync on a link reopened before that must
        keep them, or it would end them without taking their segment claims
        back.
        """
        with self._lock:
            ledger = self._ledgers.get(exporter)
            if ledger is None:
                return
            if not unmapped:
                for lease in leases:
                    if lease in ledger.live:
                        ledger.done[lease] = True
                _bound(ledger.done)
            ledger.live.difference_update(leases)

    def settled(self, exporter: str, leases: list[int]) -> None:
        """The releases of ``leases`` were written to ``exporter``: releasing no more, kept as done (held here if
        they were kept as such already), at most :data:`REFUSED_KEPT` per exporter."""
        with self._lock:
            ledger = self._ledgers.get(exporter)
            if ledger is None:
                return
            for lease in leases:
                if ledger.open.get(lease):
                    del ledger.open[lease]
                    ledger.done.setdefault(lease, False)
            _bound(ledger.done)

    def forget(self, exporter: str) -> None:
        """``exporter`` left the cluster: its leases went with it."""
        with self._lock:
            self._ledgers.pop(exporter, None)
            self._refused_total -= len(self._refused.pop(exporter, {}))


def _bound(ids: dict[int, bool]) -> None:
    """Keep the last :data:`REFUSED_KEPT` ids (insertion order)."""
    while len(ids) > REFUSED_KEPT:
        del ids[next(iter(ids))]
