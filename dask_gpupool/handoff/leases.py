"""The exporter's side of a handoff: leases that keep exported memory alive.

When a worker hands a buffer of its pool to a same-host peer as an IPC
descriptor, it first *grants a lease*: the :class:`LeaseTable` keeps a strong
reference to the buffer (or the array that holds it), independent of
``worker.data``. Dask releasing the key, the Active Memory Manager dropping
this replica, or a retire therefore cannot free memory a peer maps: the
buffer goes back to the pool only when its lease ends.

Why this is not optional: a peer that reads an allocation its owner freed
reads whatever reuses the memory (same GPU), or kills its own CUDA context
with ``CUDA_ERROR_CONTAINED`` (other GPU), see ``docs/reliability.md``.

**A lease ends only when its importer is known to be done with it.** That is
when

- the importer releases it (a :class:`~dask_gpupool.wire.broker_leases.LeaseRelease`
  from that worker, after it closed its import), or leaves it out of a
  :class:`~dask_gpupool.wire.broker_leases.Resync` after a broken link;
- the importer is known dead: its process exited (the broker watches it with
  a pidfd from its first connection, or from when it left the registry by its
  row's pid). Leaving the registry is not dying: the scheduler removes
  workers whose process lives on (``worker-ttl`` after a stall), and their
  tasks still read what they imported. Only an importer whose process cannot
  be watched (another pid namespace, no pidfds) is released when it leaves;
- it was never claimed and the ``get_data`` reply that carried it has
  ended (:meth:`LeaseTable.settle` for a stream lease no pull
  claimed, :meth:`LeaseTable.settle_forwarded` for a lease another worker
  forwarded): the importer sends its ``"OK"`` only after its claims were
  acknowledged, so a lease still unclaimed then will never be used; a reply
  that failed is never used either, because a claim that arrives after the
  lease ended is refused and the importer never hands out memory whose claim
  was refused. A lease claimed by the reply (below) ends unheld only once
  its importer said it does not hold it (:meth:`LeaseTable.resolve`).

Two ways to claim:

- by the reply (the leases of this worker's own buffers, ``claim="reply"``
  in their header, their memory written before the export): the importer
  holds the lease from the moment it deserializes the header
  (:meth:`HeldLeases.hold_here <dask_gpupool.handoff.held.HeldLeases.hold_here>`),
  with no round trip. The exporter learns it from the reply: Dask's
  ``"OK"``, which the importer sends only after deserializing, marks the
  reply's leases claimed (:meth:`LeaseTable.settle` with ``ok``). When the
  reply failed instead, the exporter cannot tell whether the importer got
  the leases, so it ends none of them on its own: they are *in doubt* until
  the importer answers a query (Dask's own comm,
  :class:`~dask_gpupool.wire.handoff.LeaseQuery`). The importer answers which
  it holds and, atomically, refuses for good the others
  (:meth:`HeldLeases.answer <dask_gpupool.handoff.held.HeldLeases.answer>`),
  so a header deserialized later can no longer hold them
  (:meth:`LeaseTable.resolve`). An importer that never answers keeps them until
  it dies or leaves, as for any lease.
- over the broker: the importer claims over the exporter's broker and waits
  for the answer before it reads (a round trip per reply and exporter). So
  are leases another worker forwarded (:meth:`LeaseTable.forward`), and
  leases of the first kind that the importer receives while a resync of its
  link to this worker is open.

No timer ends a lease, and a broker connection closing does not either (a
link can break while its importer lives: an exporter stalled past
``broker-timeout``). Unclaimed leases are therefore bounded by Dask's
in-flight ``get_data`` replies (``distributed.worker.connections.outgoing``
per worker); ``lease-timeout`` only logs leases that stay unclaimed that long.

Lease ids are random 62-bit numbers, scoped to their importer: a claim or a
release names leases, and only those granted to the worker on the other end
of that connection are affected.

Threads: grants happen where Dask serializes (event loop or its offload
thread), claims and releases on the broker's thread; one lock guards the
table. Dropping the last reference frees the buffer in the calling thread,
so :class:`LeaseTable` calls ``on_drop`` (which makes the pool's device
current) first.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Lease", "LeaseTable"]

logger = logging.getLogger(__name__)


@dataclass
class Lease:
    """One exported buffer, kept alive for one importer.

    Attributes
    ----------
    id : int
        Sent in the handoff header; positive, random.
    holder : object
        The strong reference: the exported Buffer or the array over it.
    nbytes : int
        Bytes of the buffer.
    importer : str
        Address of the worker it was granted to; only that worker may claim
        or release it.
    granted : float
        ``time.monotonic()`` at grant.
    claimed : bool
        The importer acknowledged it (IPC leases over the broker; stream
        leases once the copy server started the pull).
    connection : int or None
        The copy-server connection pulling a stream lease; ``None`` for IPC leases.
    segment : int
        Id of the segment the buffer lies in (0: none); a claim tells the
        segment which importer maps it (:mod:`dask_gpupool.memory.segments`).
    warned : bool
        Logged once as unclaimed for longer than ``timeout``.
    forwarder : str
        The worker that asked for this lease on the importer's behalf
        (:meth:`LeaseTable.forward`: it passed on a value it had imported);
        ``""`` for leases granted by this worker's own serializers.
    by_reply : bool
        Claimed by the reply (the IPC leases of this worker's own buffers):
        the importer holds it once it deserialized the header; its segment
        was noted at the grant, and is forgotten if the lease ends unheld.
    in_doubt : bool
        A ``by_reply`` lease whose reply failed: kept until the importer
        says whether it holds it (:meth:`LeaseTable.resolve`).
    unmapped : bool
        The importer asked for a copy instead of mapping it
        (:meth:`LeaseTable.copied_instead`): its segment claim was taken back.
    """

    id: int
    holder: Any = field(repr=False)
    nbytes: int
    importer: str
    granted: float
    claimed: bool = False
    connection: int | None = None
    segment: int = 0
    warned: bool = False
    forwarder: str = ""
    by_reply: bool = False
    in_doubt: bool = False
    unmapped: bool = False


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
            while True:
                lease_id = secrets.randbits(62) + 1
                if lease_id not in self._leases:
                    break
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
            while True:
                new_id = secrets.randbits(62) + 1
                if new_id not in self._leases:
                    break
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

    def importers(self) -> dict[str, int]:
        """Live leases per importer."""
        with self._lock:
            out: dict[str, int] = {}
            for lease in self._leases.values():
                out[lease.importer] = out.get(lease.importer, 0) + 1
            return out
