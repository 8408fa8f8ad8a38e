"""Peers' ``host`` pools mapped into this process, and how much of them is resident here (:func:`peer_resident_bytes`).

The kernel counts a shared page in the ``rss`` (``RssShmem``) of every
process that touched it, so after a handoff the producer's pages appear in
the consumer's resident memory too. They belong to the producer, which counts
them already: a worker subtracts them from its own figure.

The record of mappings is truly per process: it lists the mappings of peers'
pools in this process's address space (added by
:meth:`SharedHostMemoryResource.from_allocation_handle
<dask_gpupool.memory.host.SharedHostMemoryResource.from_allocation_handle>`,
removed when the mapping is unmapped), which is what ``/proc/self/smaps`` is
read for.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

__all__ = ["drop_peer_pages", "mapped", "peer_resident_bytes", "unmapped"]

#: ``madvise`` advice that drops a range from this process's page tables (``<sys/mman.h>``).
MADV_DONTNEED = 4

#: This process's mappings of peers' pools: mapping start address -> size.
_peer_mappings: dict[int, int] = {}
_lock = threading.Lock()
#: libc's ``madvise``, loaded on first use.
_madvise: Any = None
#: (valid until, bytes, this process's shared resident bytes then): the last figure of peer_resident_bytes().
_peer_resident_cache: tuple[float, int, int] = (float("-inf"), 0, 0)
#: A cached figure is read again once the process's shared resident bytes moved by this much: pages of peers' pools
#: read in, or dropped, since.
SHMEM_MOVED = 32 << 20


def mapped(base: int, size: int) -> None:
    """A peer's pool is mapped in this process at ``base``."""
    with _lock:
        _peer_mappings[base] = size


def unmapped(base: int) -> None:
    """The peer's pool mapped at ``base`` is unmapped. Unknown addresses are ignored."""
    with _lock:
        _peer_mappings.pop(base, None)


def peer_resident_bytes(max_age: float = 1.0) -> int:
    """Bytes of peer pools resident in this process: memory it maps but does not own.

    Their ``Rss`` in ``/proc/self/smaps``, summed over this process's
    mappings of peer pools; what to subtract from the process's ``rss`` for
    the memory it owns.

    Parameters
    ----------
    max_age : float
        Seconds a figure is reused, at least. Reading ``smaps`` walks every
        mapping of the process (about 20 ms for a Python process with a
        256 MiB peer mapping, on the CI machine), while Dask samples process
        memory every 100 ms: a figure is also reused for 50 times what its read
        took, so this costs at most 2% of one core. Unless the process's shared
        resident bytes (``RssShmem``, cheap to read) moved by :data:`SHMEM_MOVED`
        since: then it is read again.

    Returns
    -------
    int
        0 at once when no peer pool is mapped, or where ``smaps`` cannot be read.
    """
    global _peer_resident_cache
    with _lock:
        starts = set(_peer_mappings)
    if not starts:
        return 0
    now = time.monotonic()
    until, cached, shmem_then = _peer_resident_cache
    shmem = _shared_resident()
    if now < until and max_age > 0 and abs(shmem - shmem_then) < SHMEM_MOVED:
        return cached
    total = 0
    try:
        with open("/proc/self/smaps") as f:
            counting = False
            for line in f:
                if counting and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
                    counting = False
                elif not line[:1].isupper():  # a mapping's header line ("start-end perms ..."), not a field
                    counting = int(line.split("-", 1)[0], 16) in starts
    except (OSError, ValueError):
        return 0
    took = time.monotonic() - now
    _peer_resident_cache = (now + max(max_age, 50 * took), total, shmem)
    return total


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
    global _peer_resident_cache, _madvise
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
        _peer_resident_cache = (float("-inf"), 0, 0)
    return total
