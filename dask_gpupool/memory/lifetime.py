"""Memory that must outlive its owner's use of it: kept until the process exits, or until a peer's process does.

Below both :mod:`dask_gpupool.memory.pool` and :mod:`dask_gpupool.memory.segments`,
which hand closed memory here; and below the UCX paths of :mod:`dask_gpupool.dask`,
which park here the device memory of transfers that ended without success
(:class:`Quarantine`).
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Iterable
from typing import Any

__all__ = ["KEPT_UNTIL_EXIT", "QUARANTINE", "Quarantine", "keep_until_exit", "open_pidfd"]

logger = logging.getLogger(__name__)

#: Memory of closed CUDA pools that peers may still map: kept, never freed, until the process exits (so truly per
#: process).
KEPT_UNTIL_EXIT: list[Any] = []


def keep_until_exit(items: Any) -> int:
    """Keep ``items`` (Buffers, or objects holding them) alive until the process exits; return how many.

    Freeing memory that a peer still maps is undefined (same GPU: the peer
    reads what comes next; other GPU: CUDA_ERROR_CONTAINED). The driver keeps
    importers' mappings valid past the exporter's *exit*, so a closing CUDA
    pool hands what peers may map here instead of freeing it.
    """
    before = len(KEPT_UNTIL_EXIT)
    KEPT_UNTIL_EXIT.extend(items)
    return len(KEPT_UNTIL_EXIT) - before


def open_pidfd(pid: int) -> int | None:
    """A pidfd of process ``pid`` (readable once it exits), owned by the caller, who closes it; ``None`` where the
    process cannot be watched (no pidfds here, another pid namespace).

    Raises
    ------
    ProcessLookupError
        When the process has exited already.
    """
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise
    except (AttributeError, OSError) as e:
        logger.debug("gpupool: cannot watch pid %d: %s", pid, e)
        return None


class Quarantine:
    """Memory a transfer that ended without success may still reach: kept out of reuse until that cannot happen.

    A UCX transfer of device frames that did not end in success (a
    ``get_data`` reply cancelled or failed before the requester's ``"OK"``; a
    comm read that raised) may still be running inside UCX: the requester's
    ``cuda_ipc`` read of the frames sent, or UCX's write into the frames
    received. distributed-ucxx drops its UCX request when its coroutine is
    cancelled (UCX cancels it only when it is deallocated, and a copy a peer
    already queued runs on), so nothing in this process learns when that is
    over. Memory given back to a free list or a pool then could be written by
    the next user while the peer still reads it (wrong bytes for a requester
    whose read completes), or be written by UCX under the next user.

    So the objects that own that memory (a staging block, a pool buffer, a
    receive-pool block, or a frame that keeps one alive) are *parked* here:
    the quarantine holds a reference to each, so none of them gives its
    memory back.

    Ownership: the quarantine owns its references to the parked owners and the
    pidfd of each process it watches. An entry parked for a process (the
    peer that may still read) is let go once that process has exited, the
    only point after which its reads cannot run: its pidfd is readable
    (:meth:`sweep`, run by :meth:`park`, :attr:`count` and :attr:`nbytes`;
    the owners then give their memory back as they would have, and the pidfd
    is closed). An entry with no process to watch (none given, this process
    itself, a pidfd that cannot be opened) is kept until this process exits.
    Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: pid -> its pidfd, for the processes an entry waits for.
        self._pidfds: dict[int, int] = {}
        #: (pid, or None for this process's life; owners; their bytes).
        self._entries: list[tuple[int | None, list[Any], int]] = []
        self._warned = False

    def park(self, owners: Iterable[Any], pid: int | None, what: str) -> bool:
        """Keep ``owners`` alive until process ``pid`` exits (``None``: until this one does); ``what`` for the log.

        Returns whether they were kept: not when there are none, or when
        ``pid`` names a process that has exited already (it reads nothing
        any more). Each owner's ``nbytes`` (0 without one) is counted in
        :attr:`nbytes`. The first park is logged at WARNING, later ones at
        DEBUG.
        """
        owners = list(owners)
        if not owners:
            return False
        nbytes = sum(int(getattr(owner, "nbytes", 0) or 0) for owner in owners)
        watched: int | None = None
        if pid is not None and pid > 0 and pid != os.getpid():
            opened = self._watch(pid)
            if opened is False:
                logger.debug("gpupool: %s: process %d has exited; %d bytes given back", what, pid, nbytes)
                return False
            watched = pid if opened else None
        with self._lock:
            self._entries.append((watched, owners, nbytes))
            first, self._warned = not self._warned, True
        until = f"process {watched} exits" if watched is not None else "this process exits"
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "gpupool: %s: %d bytes of device memory UCX may still read or write are kept out of reuse until %s%s",
            what,
            nbytes,
            until,
            "; further ones are counted in dask_gpupool.stats() (ucx_quarantined_bytes) without a warning"
            if first
            else "",
        )
        self.sweep()
        return True

    def _watch(self, pid: int) -> bool | None:
        """Open (or reuse) a pidfd of ``pid``: ``True`` watched, ``False`` gone already, ``None`` cannot be watched."""
        with self._lock:
            if pid in self._pidfds:
                return True
        try:
            pidfd = open_pidfd(pid)
        except ProcessLookupError:
            return False
        if pidfd is None:
            return None
        with self._lock:
            if pid in self._pidfds:  # another thread opened one meanwhile
                os.close(pidfd)
            else:
                self._pidfds[pid] = pidfd
        return True

    def sweep(self) -> int:
        """Let go of the entries whose process has exited, and close its pidfd; returns how many owners went."""
        with self._lock:
            if not self._pidfds:
                return 0
            poller = select.poll()
            for pidfd in self._pidfds.values():
                poller.register(pidfd, select.POLLIN)
            ready = {fd for fd, _ in poller.poll(0)}
            exited = {pid for pid, pidfd in self._pidfds.items() if pidfd in ready}
            if not exited:
                return 0
            gone = [e for e in self._entries if e[0] in exited]
            self._entries = [e for e in self._entries if e[0] not in exited]
            for pid in exited:
                os.close(self._pidfds.pop(pid))
        released = sum(len(owners) for _, owners, _ in gone)
        logger.info(
            "gpupool: %d bytes of device memory kept from UCX transfers that did not complete given back: process(es) "
            "%s exited",
            sum(n for _, _, n in gone),
            ", ".join(str(pid) for pid in sorted(exited)),
        )
        gone.clear()  # the owners go here, outside the lock (their finalizers may free memory)
        return released

    @property
    def count(self) -> int:
        """Owners kept now (after a :meth:`sweep`)."""
        self.sweep()
        with self._lock:
            return sum(len(owners) for _, owners, _ in self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes the owners kept now hold (after a :meth:`sweep`)."""
        self.sweep()
        with self._lock:
            return sum(n for _, _, n in self._entries)


#: This process's quarantine of device memory that UCX transfers which did not complete may still reach: truly per
#: process, since an entry may be kept for the process's life, past the pool service that parked it.
QUARANTINE = Quarantine()
