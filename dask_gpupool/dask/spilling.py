"""What Dask's spilling counts and spills of pool values: each value's memory is counted once, by its owner.

A value a worker imported from a peer's pool under a lease (*borrowed*: an array or Buffer over an
:class:`~dask_gpupool.handoff.imported.ImportedMemoryResource` with an origin) costs that worker nothing: its memory
is the exporter's, which counts it. Spilling it would read every shared page into the borrower and free nothing,
since the exporter keeps the memory for as long as the lease lives. So a borrowed value weighs 0 in the worker's
managed memory and is never evicted. A value of this worker's pool that peers' leases keep alive (*lent*) frees
nothing when spilled either: it is counted (once, here) and evicted only once no lease holds it; values that free
memory go first. A lent value Dask forgets here is still counted until its last lease ends, and so is a copy of a plain
array this worker staged into its pool for a peer (:func:`count_staged`): no key holds it, and the peer borrows it.

The mechanism is the worker's ``data=`` mapping, as dask-cuda's: Dask's :class:`~distributed.spill.SpillBuffer` (and
dask-cuda's ``DeviceHostFile``) is a :class:`zict.Buffer` whose ``fast`` part, a :class:`zict.LRU`, decides what is
weighed and what goes to ``slow`` (disk, or host for device values). :func:`count_once` puts a
:class:`CountOnceLRU` there (public zict API: ``Buffer.fast``, ``Buffer.weight``, the LRU's constructor, ``n``,
``offset``, ``on_evict``); :func:`count_plainly` puts a plain LRU back. Nothing is copied: the values stay where they
are. The scheduler still sees each value's real size (``sizeof``), for what it costs to move it to another host.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zict
from zict.common import nodefault

from dask_gpupool.dask.views import pool_buffer_of
from dask_gpupool.handoff.imported import ImportedMemoryResource
from dask_gpupool.handoff.registry import active_service
from dask_gpupool.memory.lifetime import drop_peer_pages

if TYPE_CHECKING:
    from distributed.worker_memory import WorkerMemoryManager

    from dask_gpupool.handoff.service import PoolService

__all__ = [
    "CountOnceLRU",
    "borrowed",
    "borrowed_pages_check",
    "count_once",
    "count_plainly",
    "count_staged",
    "spill_parts",
]

#: The part of each worker's ``data`` that counts the copies its pool service stages (:func:`count_staged`), by
#: service; set by :func:`count_once`, taken out by :func:`count_plainly`.
_staged_counters: weakref.WeakKeyDictionary[Any, CountOnceLRU] = weakref.WeakKeyDictionary()


def borrowed(value: Any) -> bool:
    """Whether ``value`` (an array or Buffer) lies in a peer's pool, imported here under a lease."""
    buf = pool_buffer_of(value)
    if buf is None:
        return False
    resource = buf.memory_resource
    return isinstance(resource, ImportedMemoryResource) and resource.origin is not None


class CountOnceLRU(zict.LRU[Any, Any]):
    """The ``fast`` part of a :class:`zict.Buffer` that weighs a borrowed value 0 and never evicts it, and evicts a
    lent value only once no lease holds it.

    Parameters
    ----------
    like : zict.LRU
        The LRU it takes the place of: its values (kept, not copied), ``n``, ``offset`` and callbacks.
    weight : callable
        ``(key, value) -> bytes`` of a value this worker owns (Dask's ``sizeof``).
    service : PoolService, optional
        The worker's pool service, whose leases say what is lent; default: this process's
        (:func:`~dask_gpupool.handoff.registry.active_service`), read at each eviction.

    Notes
    -----
    When nothing can be evicted (every value borrowed or lent), :meth:`evict` returns a weight of -1 with the key
    ``None``: Dask's ``SpillBuffer.evict`` returns it, which its memory manager reads as "eviction failed, stop"
    (:class:`distributed.spill.ManualEvictProto`); eviction to the target stops there too.
    """

    def __init__(self, like: zict.LRU[Any, Any], weight: Callable[[Any, Any], float], service: Any = None) -> None:
        self.owned_weight = weight
        self.service = service
        super().__init__(
            like.n,
            like.d,
            on_evict=list(like.on_evict),
            on_cancel_evict=list(like.on_cancel_evict),
            weight=self._weight,
        )
        self.offset = like.offset
        #: Bytes of lent values Dask forgot here that a peer's lease still keeps (counted in ``offset``).
        self.lent_away = 0
        self._lent_lock = threading.Lock()
        #: Lent buffers counted in ``offset``, by ``id``: (a weak reference to the buffer, its bytes).
        self._counted: dict[int, tuple[weakref.ref[Any], float]] = {}

    def _weight(self, key: Any, value: Any) -> float:
        return 0 if borrowed(value) else self.owned_weight(key, value)

    def _service(self) -> PoolService | None:
        return self.service if self.service is not None else active_service()

    def _lent(self) -> set[int]:
        """``id()`` of the pool buffers peers' leases keep alive now."""
        service = self._service()
        if service is None or service.closed:
            return set()
        return {id(buf) for buf in service.leases.buffers()}

    def _first_candidate(self) -> Any:
        """The first key in eviction order (heavy ones first, then least recently used) whose eviction frees memory
        here, or ``nodefault``. A key weighing 0 (borrowed, or empty) frees nothing; nor does a lent one."""
        with self.lock:
            lent = self._lent()
            for key in itertools.chain(self.heavy, self.order):
                if not self.weights.get(key):
                    continue
                if lent and (buf := pool_buffer_of(self.d[key])) is not None and id(buf) in lent:
                    continue
                return key
        return nodefault

    def evict(self, key: Any = nodefault) -> tuple[Any, Any, float]:
        """Evict ``key``, or else the first key whose eviction frees memory here; ``(None, None, -1)`` if none."""
        if key is nodefault:
            key = self._first_candidate()
            if key is nodefault:
                if not self.d:
                    raise KeyError("evict(): dictionary is empty")
                return None, None, -1
        return super().evict(key)

    def evict_until_below_target(self, n: float | None = None) -> None:
        limit = self.n if n is None else n
        while self.total_weight + self.offset > limit and not self.closed:
            try:
                key, _, weight = self.evict()
            except KeyError:
                return  # emptied meanwhile (another thread)
            if key is None and weight == -1:
                return  # the rest is borrowed or lent: spilling it frees nothing

    def __setitem__(self, key: Any, value: Any) -> None:
        self.set_noevict(key, value)
        self.evict_until_below_target()

    def __delitem__(self, key: Any) -> None:
        buf = pool_buffer_of(self.d[key]) if key in self.d else None
        if buf is not None and id(buf) in self._lent():
            self._keep_counting(buf, self.weights.get(key, 0))
        super().__delitem__(key)

    def _keep_counting(self, buf: Any, nbytes: float) -> None:
        """Count ``nbytes`` of ``buf`` (lent) in ``offset`` until the buffer dies (its last lease ended) or it is
        stored here again (a value that came back: then its key weighs it)."""
        if not nbytes:
            return
        key = id(buf)

        def ended(ref: weakref.ref[Any]) -> None:
            self._stop_counting(key, ref)

        with self._lent_lock:
            if key in self._counted:
                return
            self._counted[key] = (weakref.ref(buf, ended), nbytes)
            self.lent_away += int(nbytes)
            self.offset += nbytes

    def _stop_counting(self, key: int, ref: weakref.ref[Any] | None = None) -> None:
        with self._lent_lock:
            entry = self._counted.get(key)
            if entry is None or (ref is not None and entry[0] is not ref):
                return
            del self._counted[key]
            self.lent_away -= int(entry[1])
            self.offset -= entry[1]

    def set_noevict(self, key: Any, value: Any) -> None:
        if self._counted:
            buf = pool_buffer_of(value)
            if buf is not None and (entry := self._counted.get(id(buf))) is not None and entry[0]() is buf:
                self._stop_counting(id(buf))
        super().set_noevict(key, value)


def spill_parts(data: Any) -> list[zict.Buffer[Any, Any]]:
    """The :class:`zict.Buffer` parts of a worker's ``data`` that spill: itself (Dask's ``SpillBuffer``), or
    dask-cuda's ``device_buffer`` (device to host) and ``host_buffer`` (host to disk); none for other mappings."""
    parts = [data, getattr(data, "device_buffer", None), getattr(data, "host_buffer", None)]
    return [p for p in parts if isinstance(p, zict.Buffer) and isinstance(p.fast, zict.LRU)]


def count_once(data: Any, service: PoolService | None = None) -> int:
    """Make ``data`` (a worker's ``data`` mapping) count and spill pool values once (:class:`CountOnceLRU`); returns
    how many parts it changed (0: a mapping it does not know, such as dask-cuda's ``ProxifyHostFile``). Idempotent."""
    changed = 0
    parts = spill_parts(data)
    for part in parts:
        with part.lock, part.fast.lock:
            if isinstance(part.fast, CountOnceLRU):
                part.fast.service = service
                continue
            fast = CountOnceLRU(part.fast, part.weight, service)
            _replace_fast(data, part, fast)
            part.weight = fast._weight
        changed += 1
    if service is not None and parts and service.pool.kind == "host":
        # A staged NumPy copy lies in host memory: the last part (Dask's SpillBuffer, dask-cuda's host buffer) counts
        # it. Copies staged into ``device`` pools are not counted here.
        if isinstance(parts[-1].fast, CountOnceLRU):
            _staged_counters[service] = parts[-1].fast
    return changed


def count_staged(service: PoolService, buf: Any, nbytes: int) -> None:
    """Count ``nbytes`` of ``buf``, a copy ``service`` staged into its ``host`` pool and lent to a peer, in its worker's
    managed memory (the ``offset`` of the :class:`CountOnceLRU` that :func:`count_once` put in its ``data``) until
    the buffer dies, its last lease ended. The copy is this worker's memory that no key of it holds and no peer
    counts (it borrows it); nothing is counted for a worker whose ``data`` counts plainly."""
    fast = _staged_counters.get(service)
    if fast is None:
        return
    with fast.lock:
        fast._keep_counting(buf, nbytes)


def _replace_fast(data: Any, part: zict.Buffer[Any, Any], fast: zict.LRU[Any, Any]) -> None:
    """``fast`` in place of ``part.fast`` (the same values: ``fast.d`` is the old one's), and of ``data.fast`` where
    that named the old one (dask-cuda's ``DeviceHostFile.fast``, its host buffer's, for the memory manager)."""
    old, part.fast = part.fast, fast
    if data is not part and getattr(data, "fast", None) is old:
        data.fast = fast


def count_plainly(data: Any) -> None:
    """Undo :func:`count_once` on ``data``: a plain :class:`zict.LRU` with the owned-value weight, values kept."""
    for part in spill_parts(data):
        for service, counter in list(_staged_counters.items()):
            if counter is part.fast:
                del _staged_counters[service]
        with part.lock, part.fast.lock:
            fast = part.fast
            if not isinstance(fast, CountOnceLRU):
                continue
            plain: zict.LRU[Any, Any] = zict.LRU(
                fast.n,
                fast.d,
                on_evict=list(fast.on_evict),
                on_cancel_evict=list(fast.on_cancel_evict),
                weight=fast.owned_weight,
            )
            plain.offset = fast.offset - fast.lent_away
            _replace_fast(data, part, plain)
            part.weight = fast.owned_weight


def borrowed_pages_check(
    memory: WorkerMemoryManager, trim: Callable[[], int] | None = None
) -> Callable[[], None] | None:
    """What keeps pool pages that no value of this worker uses out of its resident memory past the first threshold
    Dask acts on.

    A borrower that read a borrowed value has its pages in its ``rss`` (the kernel counts a shared page in every
    process that touched it), which the nanny compares with ``memory_limit`` to restart the worker: a worker
    holding more borrowed bytes than its limit would be killed for memory that is not its own, where plain Dask
    spills. And a ``host`` pool keeps the pages of freed buffers resident (the next buffer there is written without
    page faults): memory no value uses, which Dask's memory manager reads as this worker's and answers by spilling
    values to disk or pausing. Past ``memory_limit`` times the lowest of the ``target``, ``spill``, ``pause`` and
    ``terminate`` fractions, the check drops the pages of every peer pool mapped here from this process's page
    tables (:func:`~dask_gpupool.memory.lifetime.drop_peer_pages`: nothing copied or freed, a read faults them
    back) and gives this worker's pool's free pages back to the OS (``trim``).

    Parameters
    ----------
    memory : distributed.worker_memory.WorkerMemoryManager
        The worker's (``worker.memory_manager``): its ``memory_limit`` and fractions.
    trim : callable, optional
        Gives this worker's pool's free pages back (:meth:`SharedHostMemoryResource.trim
        <dask_gpupool.memory.host.SharedHostMemoryResource.trim>` of a ``host`` pool); ``None``: none to give.

    Returns
    -------
    callable or None
        ``check()``, to run every ``memory_monitor_interval``; ``None`` without a memory limit or any threshold.
    """
    import dask.config
    import psutil

    fractions = [memory.memory_target_fraction, memory.memory_spill_fraction, memory.memory_pause_fraction]
    fractions.append(dask.config.get("distributed.worker.memory.terminate"))
    fractions = [f for f in fractions if f]
    if not memory.memory_limit or not fractions:
        return None
    threshold = memory.memory_limit * min(fractions)
    process = psutil.Process()

    def check() -> None:
        # Advising ranges with few pages resident is cheap: no figure of the peers' pages is needed first.
        if process.memory_info().rss > threshold:
            drop_peer_pages()
            if trim is not None and process.memory_info().rss > threshold:
                trim()

    return check
