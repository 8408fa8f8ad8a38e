"""What this process keeps of memory beyond its owner's use, and what it maps of peers' memory.

Memory that must outlive its owner's use of it: kept until the process exits (:func:`keep_until_exit`), or until a
peer's process does (:class:`Quarantine`). Below both :mod:`dask_gpupool.memory.pool` and
:mod:`dask_gpupool.memory.segments`, which hand closed memory here; and below the UCX paths of
:mod:`dask_gpupool.dask`, which park here the device memory of transfers that ended without success.

Peers' ``host`` pools mapped into this process, and how much of them is resident here
(:func:`peer_resident_bytes`). The kernel counts a shared page in the ``rss`` (``RssShmem``) of every process that
touched it, so after a handoff the producer's pages appear in the consumer's resident memory too. They belong to the
producer, which counts them already: a worker subtracts them from its own figure. The record of mappings is truly
per process: it lists the mappings of peers' pools in this process's address space (added by
:meth:`SharedHostMemoryResource.from_allocation_handle
<dask_gpupool.memory.host.SharedHostMemoryResource.from_allocation_handle>`, removed when the mapping is unmapped),
and this process's own pools, whose pages are in its ``RssShmem`` too.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "KEPT_UNTIL_EXIT",
    "QUARANTINE",
    "Quarantine",
    "disowned",
    "drop_peer_pages",
    "keep_until_exit",
    "mapped",
    "maps_peer_pages",
    "open_pidfd",
    "owned",
    "peer_resident_bytes",
    "unmapped",
]

logger = logging.getLogger(__name__)


# -- memory kept until the process exits, or a peer's does -------------------------------------------------------------


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


# -- peers' host pools mapped here, and their pages resident here ------------------------------------------------------


#: ``madvise`` advice that drops a range from this process's page tables (``<sys/mman.h>``).
MADV_DONTNEED = 4

#: This process's mappings of peers' pools: mapping start address -> size.
_peer_mappings: dict[int, int] = {}
#: This process's own pools: mapping start address -> (a weak reference to) the method giving the bytes of the pool
#: resident in memory.
_own_pools: dict[int, weakref.WeakMethod[Callable[[], int]]] = {}
_lock = threading.Lock()
#: This process's resident shared memory that is neither its own pools' nor peers' (a driver's, a task's), as
#: measured while no page of a peer's pool was resident here (:func:`_calibrate`).
_other_shared = 0
#: libc's ``madvise``, loaded on first use.
_madvise: Any = None


def mapped(base: int, size: int) -> None:
    """A peer's pool is mapped in this process at ``base``."""
    with _lock:
        first = not _peer_mappings
        _peer_mappings[base] = size
    if first:  # no page of a peer's pool is resident here yet
        _calibrate()


def unmapped(base: int) -> None:
    """The peer's pool mapped at ``base`` is unmapped. Unknown addresses are ignored."""
    with _lock:
        _peer_mappings.pop(base, None)


def owned(base: int, resident: Callable[[], int]) -> None:
    """This process's own pool is mapped at ``base``; ``resident()``, a bound method of the pool, gives its bytes
    resident in memory (the memfd's allocated pages), all of them in this process's page tables: the owner wrote
    them. Held by a weak reference, until :func:`disowned`: a pool dropped unclosed is not kept alive here."""
    with _lock:
        _own_pools[base] = weakref.WeakMethod(resident)


def disowned(base: int) -> None:
    """This process's own pool mapped at ``base`` is unmapped. Unknown addresses are ignored."""
    with _lock:
        _own_pools.pop(base, None)


def maps_peer_pages() -> bool:
    """Whether this process maps any peer's ``host`` pool (whose pages :func:`drop_peer_pages` would drop); a dict
    read, cheap enough for every task."""
    return bool(_peer_mappings)


def peer_resident_bytes() -> int:
    """Bytes of peer pools resident in this process: memory it maps but does not own.

    This process's resident shared memory (``RssShmem`` of ``/proc/self/status``) less its own pools' resident
    bytes (each memfd's ``st_blocks``) and less the shared memory of other kinds resident when no peer page was
    (measured when the first peer pool is mapped, and again each time the peers' pages are dropped), at most the
    size of the peers' mappings: what to subtract from the process's ``rss`` for the memory it owns. Two reads of
    about 20 µs each, fresh at every call. Reading each mapping's ``Rss`` in ``/proc/self/smaps`` instead walks
    every mapping of the process: 25-40 ms on the event loop of a worker of a 2-vCPU host, every time Dask samples
    its memory after a handoff. Shared memory of other kinds mapped between those measurements (a task's
    ``multiprocessing.shared_memory`` block) counts as peers' until the next.

    Returns
    -------
    int
        0 at once when no peer pool is mapped, or where ``/proc/self/status`` cannot be read.
    """
    with _lock:
        if not _peer_mappings:
            return 0
        mapped_size = sum(_peer_mappings.values())
    return min(max(_unaccounted() - _other_shared, 0), mapped_size)


def _unaccounted() -> int:
    """This process's resident shared memory less its own pools' resident bytes. Called without :data:`_lock`
    (each pool's method takes the pool's lock, which a pool holds when it calls :func:`disowned`)."""
    with _lock:
        own = list(_own_pools.values())
    shared = _shared_resident()
    for ref in own:
        resident = ref()
        if resident is not None:
            shared -= resident()
    return shared


def _calibrate() -> None:
    """Measure :data:`_other_shared`, while no page of a peer's pool is resident here."""
    global _other_shared
    _other_shared = max(_unaccounted(), 0)


def _shared_resident() -> int:
    """This process's resident shared memory (``RssShmem`` of ``/proc/self/status``, bytes; 0 where unreadable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssShmem:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def drop_peer_pages() -> int:
    """Drop every page of peers' pools from this process's page tables (``madvise(MADV_DONTNEED)``); returns the
    bytes of the mappings advised.

    The memory stays: these are shared mappings of a peer's memfd, whose pages its owner keeps (and counts), and a
    later read here faults the same pages back in, with the same contents, copying nothing. Only this process's
    resident figure goes down, so that a peer's memory does not make it look over its limit (the nanny reads the
    process's ``rss``). Under the lock that :func:`unmapped` takes before its mapping goes: no range advised here
    can be unmapped (and its addresses reused) meanwhile.
    """
    global _madvise
    with _lock:
        if not _peer_mappings:
            return 0
        if _madvise is None:
            _madvise = ctypes.CDLL(None, use_errno=True).madvise
            _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        total = 0
        for base, size in _peer_mappings.items():
            if _madvise(base, size, MADV_DONTNEED) == 0:
                total += size
    _calibrate()
    return total
