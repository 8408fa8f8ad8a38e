"""The exporter's side of a handoff: leases that keep exported memory alive.

When a worker hands a buffer of its pool to a same-host peer as an IPC
descriptor, it first *grants a lease*: the :class:`LeaseTable` keeps a strong
reference to the buffer (or the array that holds it), independent of
``worker.data``. Dask releasing the key, the Active Memory Manager dropping
this replica, or a retire therefore cannot free memory a peer maps: the
buffer goes back to the pool only when its last lease is released.

Why this is not optional: a peer that reads an allocation its owner freed
reads whatever reuses the memory (same GPU), or kills its own CUDA context
with ``CUDA_ERROR_CONTAINED`` (other GPU), see ``shared/GPU.md``.

A lease ends when

- the importer releases it (a :class:`~dask_gpupool._messages.LeaseRelease`
  on its broker connection, after it closed its import);
- the importer's broker connection closes (it exited or died) while the lease
  is claimed on it;
- the importer leaves the cluster (the registry drops its pool);
- it was never claimed within ``lease_timeout`` seconds (the message was lost,
  or the requester dropped it before importing).

Threads: grants happen where Dask serializes (event loop or its offload
thread), claims and releases on the broker's thread; one lock guards the
table. Dropping the last reference frees the buffer in the calling thread,
so :class:`LeaseTable` calls ``on_drop`` (which makes the pool's device
current) first.
"""

from __future__ import annotations

import itertools
import logging
import random
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
        Sent in the handoff header; positive.
    holder : object
        The strong reference: the exported Buffer or the array over it.
    nbytes : int
        Bytes of the buffer.
    importer : str
        Address of the worker it was granted to.
    granted : float
        ``time.monotonic()`` at grant.
    connection : int or None
        The broker connection that claimed it; ``None`` until claimed.
    segment : int
        Id of the segment the buffer lies in (0: none); a claim tells the
        segment which connection maps it (:mod:`dask_gpupool._segments`).
    """

    id: int
    holder: Any = field(repr=False)
    nbytes: int
    importer: str
    granted: float
    connection: int | None = None
    segment: int = 0


class LeaseTable:
    """All live leases of one exporter.

    Parameters
    ----------
    timeout : float
        Seconds a granted lease may stay unclaimed before :meth:`expire` ends it.
    on_drop : callable, optional
        Called (no arguments) right before the table lets go of holders, in the
        same thread, so that freeing GPU memory finds its device current.
    """

    timeout: float
    granted_total: int
    released_total: int
    expired_total: int
    _leases: dict[int, Lease]
    _ids: Iterable[int]
    _lock: threading.Lock
    _on_drop: Callable[[], None]

    def __init__(self, timeout: float, on_drop: Callable[[], None] | None = None) -> None:
        self.timeout = timeout
        self.granted_total = self.released_total = self.expired_total = 0
        self._leases = {}
        # Random start: a stale id from an earlier process is unlikely to name a live lease.
        self._ids = itertools.count(random.randrange(1, 1 << 40))
        self._lock = threading.Lock()
        self._on_drop = on_drop or (lambda: None)

    def grant(self, holder: Any, nbytes: int, importer: str, segment: int = 0) -> int:
        """Keep ``holder`` alive for ``importer``; return the lease id."""
        with self._lock:
            lease_id = next(self._ids)  # type: ignore[call-overload]
            self._leases[lease_id] = Lease(lease_id, holder, nbytes, importer, time.monotonic(), None, segment)
            self.granted_total += 1
        return lease_id

    def claim(self, lease_ids: Iterable[int], connection: int, segments: list[int] | None = None) -> int:
        """Tie leases to the broker connection they were claimed on; return how many were live.

        The segment ids of the claimed leases that have one are appended to ``segments``.
        """
        n = 0
        with self._lock:
            for i in lease_ids:
                lease = self._leases.get(i)
                if lease is not None and lease.connection is None:
                    lease.connection = connection
                    n += 1
                    if lease.segment and segments is not None:
                        segments.append(lease.segment)
        return n

    def holder(self, lease_id: int) -> Any | None:
        """The object a live lease keeps alive, or ``None`` (for the copy fallback)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            return None if lease is None else lease.holder

    def release(self, lease_ids: Iterable[int], connection: int | None = None) -> int:
        """End these leases; return how many ended.

        With ``connection`` (a release that came over a broker connection),
        only leases claimed on that connection end: an importer releases its
        own imports, never another's, and a lease nobody claimed yet cannot be
        ended under the importer about to map it. Unknown ids are ignored.
        """
        with self._lock:
            ids = [
                i
                for i in lease_ids
                if i in self._leases and (connection is None or self._leases[i].connection == connection)
            ]
            gone = [self._leases.pop(i) for i in ids]
        return self._drop(gone, "released")

    def release_connection(self, connection: int) -> int:
        """End every lease claimed on ``connection`` (it closed)."""
        with self._lock:
            ids = [i for i, lease in self._leases.items() if lease.connection == connection]
            gone = [self._leases.pop(i) for i in ids]
        return self._drop(gone, "released")

    def release_importer(self, importer: str) -> int:
        """End every lease granted to ``importer`` (it left the cluster)."""
        with self._lock:
            ids = [i for i, lease in self._leases.items() if lease.importer == importer]
            gone = [self._leases.pop(i) for i in ids]
        return self._drop(gone, "released")

    def expire(self, now: float | None = None) -> int:
        """End leases granted more than ``timeout`` seconds ago and never claimed."""
        now = time.monotonic() if now is None else now
        with self._lock:
            ids = [
                i
                for i, lease in self._leases.items()
                if lease.connection is None and now - lease.granted > self.timeout
            ]
            gone = [self._leases.pop(i) for i in ids]
        if gone:
            logger.warning(
                "%d lease(s) granted to %s expired unclaimed after %.0f s",
                len(gone),
                sorted({lease.importer for lease in gone}),
                self.timeout,
            )
        return self._drop(gone, "expired")

    def clear(self) -> int:
        """End every lease (teardown)."""
        with self._lock:
            gone, self._leases = list(self._leases.values()), {}
        return self._drop(gone, "released")

    def detach(self) -> list[Any]:
        """Empty the table *without* freeing: return the holders of every live lease (teardown).

        For pools whose memory a peer must never see freed under it (CUDA
        pools): the caller keeps the holders until the process exits.
        """
        with self._lock:
            gone, self._leases = list(self._leases.values()), {}
            self.released_total += len(gone)
        return [lease.holder for lease in gone]

    def _drop(self, gone: list[Lease], how: str) -> int:
        if not gone:
            return 0
        with self._lock:
            if how == "expired":
                self.expired_total += len(gone)
            else:
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

    def importers(self) -> dict[str, int]:
        """Live leases per importer."""
        with self._lock:
            out: dict[str, int] = {}
            for lease in self._leases.values():
                out[lease.importer] = out.get(lease.importer, 0) + 1
            return out
