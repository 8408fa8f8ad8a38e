"""Where the GPU work that made a task's CuPy result ends: an event recorded when Dask stores the result.

Staging a plain CuPy array into the pool for a same-host worker
(:func:`~dask_gpupool.dask.plain_arrays.stage`) must not copy it before the
kernels that wrote it have finished. Copied on the device's default stream,
the copy also waits for every kernel queued there since, by the tasks the
worker runs meanwhile: 5.6 ms median behind queued matrix products against
5-28 µs idle (``scripts/probes/stage_steps.py``, ``docs/performance.md``). So
the worker plugin records an event on the device's default stream when a
task's CuPy result is stored (its ``transition`` hook, on the event loop,
right after the task returned; the default stream follows every blocking
stream's earlier work, CuPy's default included), and the staging copy runs on
a stream of its own that waits for that event only. A task result over pool
memory (a pool Buffer, an array over one)
gets one too, whatever its size: its export waits for that event rather than
for the whole GPU (``gpupool.handoff-ordering: sync``,
:meth:`Exports._order <dask_gpupool.handoff.exporter.Exports._order>`).

Ownership: the table holds a weak reference to each result (never keeping
it, or its device memory, alive) and a reference to its event, dropped when
the key leaves the worker's memory, the result is collected, or the table is
cleared; the event itself is freed when its last holder lets go (a staging
copy may still wait on it).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["TaskEvents", "is_cupy_array"]


def is_cupy_array(value: Any) -> bool:
    """Whether ``value`` is a CuPy array (checked without importing CuPy)."""
    return type(value).__module__.partition(".")[0] == "cupy" and hasattr(value, "__cuda_array_interface__")


class TaskEvents:
    """The event after which no GPU work of the task that made it writes each stored CuPy result.

    Parameters
    ----------
    record : callable
        ``record()`` returns a new event that marks the device's default
        stream now (cuda.core ``Stream.record``); it is called on the event
        loop when a result is stored. The table owns what it returns until
        the entry ends.
    wanted : callable, optional
        Which results get an event; default :func:`is_cupy_array`.

    Notes
    -----
    Entries are found by the result's identity (``id`` checked against the weak
    reference), so a result that was replaced (spilled and read back, a
    recomputed key) has no entry, and the caller orders its copy as before.
    Stored and dropped on the event loop; looked up from serializers, which
    may run in Dask's offload thread: a lock guards the maps.
    """

    def __init__(self, record: Callable[[], Any], wanted: Callable[[Any], bool] = is_cupy_array) -> None:
        self._record = record
        self._wanted = wanted
        self._lock = threading.Lock()
        self._by_id: dict[int, tuple[weakref.ref[Any], str, Any]] = {}
        self._by_key: dict[str, int] = {}

    def stored(self, key: str, value: Any) -> None:
        """Mark ``value``, the result of task ``key`` just stored, if it is a CuPy array (else nothing)."""
        if not self._wanted(value):
            return
        ident = id(value)
        try:
            ref = weakref.ref(value, lambda dead: self._collected(ident, dead))
        except TypeError:  # not weakly referenceable: no entry, the copy is ordered as before
            return
        event = self._record()
        with self._lock:
            self._pop_key(key)
            self._pop_id(ident)
            self._by_id[ident] = (ref, key, event)
            self._by_key[key] = ident

    def released(self, key: str) -> None:
        """Forget ``key``'s result (it left the worker's memory)."""
        with self._lock:
            self._pop_key(key)

    def event_of(self, value: Any) -> Any | None:
        """The event after which the task that made ``value`` writes it no more, or ``None`` when unknown."""
        with self._lock:
            entry = self._by_id.get(id(value))
        if entry is None or entry[0]() is not value:
            return None
        return entry[2]

    def clear(self) -> None:
        """Forget every entry (the plugin is torn down)."""
        with self._lock:
            self._by_id.clear()
            self._by_key.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)

    def _collected(self, ident: int, dead: weakref.ref[Any]) -> None:
        with self._lock:
            entry = self._by_id.get(ident)
            if entry is not None and entry[0] is dead:
                del self._by_id[ident]
                if self._by_key.get(entry[1]) == ident:
                    del self._by_key[entry[1]]

    def _pop_key(self, key: str) -> None:  # lock held
        ident = self._by_key.pop(key, None)
        if ident is not None:
            entry = self._by_id.get(ident)
            if entry is not None and entry[1] == key:
                del self._by_id[ident]

    def _pop_id(self, ident: int) -> None:  # lock held
        entry = self._by_id.pop(ident, None)
        if entry is not None and self._by_key.get(entry[1]) == ident:
            del self._by_key[entry[1]]
