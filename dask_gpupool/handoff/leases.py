"""The exporter's side of a handoff: the table of live leases that keep exported memory alive (:class:`LeaseTable`).

Each handoff of this worker's memory to a same-host peer grants a
:class:`~dask_gpupool.handoff.lease.Lease` in the table; the table ends it
only when its importer is known to be done with it
(:mod:`dask_gpupool.handoff.lease` says when that is, and the two ways a
lease is claimed). Dropping the last reference to a holder frees the memory
back into this worker's pool.

Threads: grants happen where Dask serializes (event loop or its offload
thread), claims and releases on the broker's thread; one lock guards the
table. Dropping the last reference frees the buffer in the calling thread,
so :class:`LeaseTable` calls ``on_drop`` (which makes the pool's device
current) first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from dask_gpupool.handoff.lease import Lease, new_lease_id

__all__ = ["LeaseTable"]

logger = logging.getLogger(__name__)


class LeaseTable:
    """All live leases of one exporter.

    Parameters
    ----------
    timeout : float
        Seconds after which a lease still unclaimed is logged (once) by
        :meth:`overdue`. It is not ended: see the module docstring.
    on_drop : callable, optional
        Called (no arguments) right before the table lets go of holders, in the
        same thread, so that freeing GPU memory finds its device current.
    """

    timeout: float
    granted_total: int
    released_total: int
    abandoned_total: int
    _leases: dict[int, Lease]
    _lock: threading.Lock
    _on_drop: Callable[[], None]

    def __init__(self, timeout: float, on_drop: Callable[[], None] | None = None) -> None:
        self.timeout = timeout
        self.granted_total = self.released_total = self.abandoned_total = 0
        self._leases = {}
        self._lock = threading.Lock()
        self._on_drop = on_drop or (lambda: None)

    def grant(self, holder: Any, nbytes: int, importer: str, segment: int = 0, *, by_reply: bool = False) -> int:
        """Keep ``holder`` alive for ``importer``; return the lease id (random, positive).

        ``by_reply``: the importer holds it from deserialization on, and the reply's end settles it
        (the IPC leases of this worker's own buffers).
        """
        with self._lock:
            lease_id = new_lease_id(self._leases)
            self._leases[lease_id] = Lease(
                lease_id, holder, nbytes, importer, time.monotonic(), segment=segment, by_reply=by_reply
            )
            self.granted_total += 1
        return lease_id

    def claim(self, lease_ids: Iterable[int], importer: str, segments: list[int] | None = None) -> list[int]:
        """``importer`` acknowledges these leases; return the ids refused (ended, or not its own).

        Claiming a lease twice is harmless. A lease in doubt that is claimed
        is held: it is in doubt no more. The segment ids of newly claimed
        leases that have one are appended to ``segments``.
        """
        refused = []
        with self._lock:
            for i in lease_ids:
                lease = self._leases.get(i)
                if lease is None or lease.importer != importer or lease.connection is not None:
                    refused.append(i)
                    continue
                lease.in_doubt = False  # held: nothing left to ask its importer (doubtful counts it no more)
                if not lease.claimed:
                    lease.claimed = True
                    if lease.segment and segments is not None and not lease.by_reply:  # by_reply: noted at grant
                        segments.append(lease.segment)
        return refused

    def forward(self, lease_id: int, forwarder: str, to: str) -> tuple[int, int] | None:
        """Grant ``to`` a lease on what ``forwarder``'s claimed IPC lease ``lease_id`` keeps alive.

        For a value ``forwarder`` imported and now passes on: ``to`` maps this
        worker's memory itself, under a lease of its own that lives on when
        ``forwarder`` lets go. Until ``to`` claims it, ``forwarder`` may end it
        (:meth:`settle_forwarded`), and it ends if ``forwarder`` dies
        (:meth:`release_importer`). Returns ``(new lease id, its segment)``, or
        ``None`` when ``lease_id`` is not a live, claimed IPC lease of ``forwarder``.
        """
        with self._lock:
            source = self._leases.get(lease_id)
            if source is None or source.importer != forwarder or source.connection is not None:
                return None
            if not source.claimed:
                if not source.by_reply:
                    return None
                # Claimed by its reply, whose "OK" may not have been read yet: only a worker that deserialized the
                # header knows the id, and it asks to forward only an import it holds.
                source.claimed, source.in_doubt = True, False
            new_id = new_lease_id(self._leases)
            self._leases[new_id] = Lease(
                new_id,
                source.holder,
                source.nbytes,
                to,
                time.monotonic(),
                segment=source.segment,
                forwarder=forwarder,
            )
            self.granted_total += 1
        return new_id, source.segment

    def settle_forwarded(self, lease_ids: Iterable[int], forwarder: str) -> int:
        """The reply of ``forwarder`` that carried these forwarded leases ended: end the unclaimed ones."""
        with self._lock:
            gone = [
                self._leases.pop(i)
                for i in lease_ids
                if i in self._leases and self._leases[i].forwarder == forwarder and not self._leases[i].claimed
            ]
            self.abandoned_total += len(gone)
        return self._drop(gone)

    def claim_stream(self, lease_id: int, connection: int) -> bool:
        """Tie an unclaimed stream lease to the copy-server connection pulling it; whether it was free."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.claimed:
                return False
            lease.claimed, lease.connection = True, connection
            return True

    def holder(self, lease_id: int) -> Any | None:
        """The object a live lease keeps alive, or ``None``."""
        with self._lock:
            lease = self._leases.get(lease_id)
            return None if lease is None else lease.holder

    def holder_for(self, lease_id: int, importer: str) -> Any | None:
        """The object a live lease of ``importer`` keeps alive, or ``None`` (the broker's copy fallback)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            return None if lease is None or lease.importer != importer else lease.holder

    def release(self, lease_ids: Iterable[int], importer: str | None = None) -> int:
        """End these leases; return how many ended.

        With ``importer`` (a release that came from a peer), only that
        worker's leases end: an importer releases its own imports, never
        another's. Unknown ids are ignored.
        """
        with self._lock:
            gone = [
                self._leases.pop(i)
                for i in lease_ids
                if i in self._leases and (importer is None or self._leases[i].importer == importer)
            ]
        return self._drop(gone)

    def take(self, lease_id: int, importer: str) -> Any | None:
        """End ``importer``'s lease ``lease_id`` and hand its holder to the caller (``None``: no such live lease).

        For a value that came back to this worker (its own memory, leased in
        its own name): the caller's reference keeps the memory alive from now on.
        """
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.importer != importer:
                return None
            del self._leases[lease_id]
            self.released_total += 1
        return lease.holder

    def release_stream(self, lease_id: int, connection: int) -> int:
        """End a stream lease pulled over copy-server ``connection`` (done, or the pull failed)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            gone = [self._leases.pop(lease_id)] if lease is not None and lease.connection == connection else []
        return self._drop(gone)

    def release_importer(self, importer: str) -> int:
        """End every lease granted to ``importer``: its process is gone (or it left and cannot be watched).

        Leases it forwarded that nobody claimed end too: the reply that
        carried them died with it.
        """
        with self._lock:
            gone = [
                self._leases.pop(i)
                for i, lease in list(self._leases.items())
                if lease.importer == importer or (lease.forwarder == importer and not lease.claimed)
            ]
        return self._drop(gone)

    def resync(self, importer: str, live: Iterable[int]) -> int:
        """``importer`` still holds exactly ``live``: end its claimed leases not in it; return how many.

        Its unclaimed leases are left alone (their replies may still be on
        the way); leases in ``live`` that were not claimed yet count as claimed
        (and those in doubt are in doubt no more).
        """
        keep = set(live)
        with self._lock:
            gone = []
            for i, lease in list(self._leases.items()):
                if lease.importer != importer or lease.connection is not None:
                    continue
                if i in keep:
                    lease.claimed, lease.in_doubt = True, False
                elif lease.claimed:
                    gone.append(self._leases.pop(i))
        return self._drop(gone)

    def settle(self, lease_ids: Iterable[int], ok: bool = False) -> tuple[int, list[int]]:
        """The reply that carried these leases has ended (``ok``: the importer's ``"OK"`` was read).

        Leases claimed by the reply count as claimed when ``ok``; otherwise
        they are marked in doubt and kept (:meth:`resolve`). Others still
        unclaimed (stream leases no pull claimed) end. Returns how many ended and the ids
        now in doubt.
        """
        doubt: list[int] = []
        with self._lock:
            gone = []
            for i in lease_ids:
                lease = self._leases.get(i)
                if lease is None or lease.claimed:
                    continue
                if not lease.by_reply:
                    gone.append(self._leases.pop(i))
                elif ok:
                    lease.claimed = True
                else:
                    lease.in_doubt = True
                    doubt.append(i)
            self.abandoned_total += len(gone)
        return self._drop(gone), doubt

    def revoke(self, lease_ids: Iterable[int]) -> tuple[int, list[int]]:
        """End unclaimed leases whose headers were never sent; return how many ended and the segments of the
        ``by_reply`` ones (noted at their grant: the caller forgets them)."""
        segments: list[int] = []
        with self._lock:
            gone = []
            for i in lease_ids:
                lease = self._leases.get(i)
                if lease is None or lease.claimed:
                    continue
                gone.append(self._leases.pop(i))
                if lease.by_reply and lease.segment and not lease.unmapped:
                    segments.append(lease.segment)
            self.abandoned_total += len(gone)
        return self._drop(gone), segments

    def in_doubt(self, lease_ids: Iterable[int], importer: str) -> list[int]:
        """Those of ``lease_ids`` still in doubt (live, ``importer``'s, unclaimed, their reply failed)."""
        with self._lock:
            return [
                i
                for i in lease_ids
                if (lease := self._leases.get(i)) is not None
                and lease.in_doubt
                and not lease.claimed
                and lease.importer == importer
            ]

    def resolve(self, lease_ids: Iterable[int], importer: str, held: Iterable[int]) -> tuple[int, list[int]]:
        """``importer`` answered which of these in-doubt leases it holds: those are claimed, the others end.

        Only leases still in doubt are affected: one claimed meanwhile (over
        the broker, or by a resync that listed it) stays. The importer refused
        for good the ones it did not hold before it answered, so ending them
        is safe. Returns how many ended and the segment ids of the ended ones
        (noted at their grant; the caller forgets them).
        """
        keep = set(held)
        ended_segments: list[int] = []
        with self._lock:
            gone = []
            for i in lease_ids:
                lease = self._leases.get(i)
                if lease is None or not lease.in_doubt or lease.claimed or lease.importer != importer:
                    continue
                lease.in_doubt = False
                if i in keep:
                    lease.claimed = True
                else:
                    gone.append(self._leases.pop(i))
                    if lease.segment and not lease.unmapped:
                        ended_segments.append(lease.segment)
            self.abandoned_total += len(gone)
        return self._drop(gone), ended_segments

    def copied_instead(self, lease_id: int, importer: str) -> int:
        """``importer`` asks for a copy of its lease ``lease_id`` because it could not map it: the segment whose
        claim the retire ledger counts for it (once; 0: none), which the caller takes back, since the importer
        never mapped the segment for this lease and will not count it in a ``SegmentRelease``."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if (
                lease is None
                or lease.importer != importer
                or not lease.segment
                or lease.unmapped
                or not (lease.by_reply or lease.claimed)
            ):
                return 0
            lease.unmapped = True
            return lease.segment

    def overdue(self, now: float | None = None) -> int:
        """Log (once per lease) leases unclaimed for more than ``timeout`` seconds; return how many are."""
        now = time.monotonic() if now is None else now
        with self._lock:
            late = [
                lease for lease in self._leases.values() if not lease.claimed and now - lease.granted > self.timeout
            ]
            new = [lease for lease in late if not lease.warned]
            for lease in new:
                lease.warned = True
        if new:
            logger.warning(
                "%d lease(s) granted to %s unclaimed for more than %.0f s (kept until the importer claims them, "
                "its reply fails, or it dies)",
                len(new),
                sorted({lease.importer for lease in new}),
                self.timeout,
            )
        return len(late)

    def clear(self) -> int:
        """End every lease (teardown)."""
        with self._lock:
            gone, self._leases = list(self._leases.values()), {}
        return self._drop(gone)

    def detach(self) -> list[Any]:
        """Empty the table *without* freeing: return the holders of every live lease (teardown).

        For pools whose memory a peer must never see freed under it (CUDA
        pools): the caller keeps the holders until the process exits.
        """
        with self._lock:
            gone, self._leases = list(self._leases.values()), {}
            self.released_total += len(gone)
        return [lease.holder for lease in gone]

    def _drop(self, gone: list[Lease]) -> int:
        if not gone:
            return 0
        with self._lock:
            self.released_total += len(gone)
        self._on_drop()
        for lease in gone:
            lease.holder = None
        return len(gone)

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def nbytes(self) -> int:
        """Bytes kept alive by live leases."""
        with self._lock:
            return sum(lease.nbytes for lease in self._leases.values())

    @property
    def doubtful(self) -> int:
        """Live leases in doubt: claimed by a reply that failed, waiting for their importer's answer."""
        with self._lock:
            return sum(lease.in_doubt for lease in self._leases.values())

    @property
    def unclaimed(self) -> int:
        """Live leases not claimed yet."""
        with self._lock:
            return sum(not lease.claimed for lease in self._leases.values())

    def buffers(self) -> list[Any]:
        """The pool buffers live leases keep alive (their holder's ``buf``): this pool's memory lent to peers."""
        with self._lock:
            holders = [lease.holder for lease in self._leases.values()]
        return [buf for h in holders if (buf := getattr(h, "buf", None)) is not None]

    def bytes_by_importer(self) -> dict[str, int]:
        """Bytes live leases keep alive, per importer."""
        with self._lock:
            out: dict[str, int] = {}
            for lease in self._leases.values():
                out[lease.importer] = out.get(lease.importer, 0) + lease.nbytes
            return out

    def nbytes_of(self, importer: str) -> int:
        """Bytes live leases of ``importer`` keep alive."""
        with self._lock:
            return sum(lease.nbytes for lease in self._leases.values() if lease.importer == importer)

    def importers(self) -> dict[str, int]:
        """Live leases per importer."""
        with self._lock:
            out: dict[str, int] = {}
            for lease in self._leases.values():
                out[lease.importer] = out.get(lease.importer, 0) + 1
            return out
