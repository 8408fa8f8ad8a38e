"""Who is where: the pool registry, keyed by pool UUID (the scheduler's table and workers' cached views), and the
pool services alive in this process.

:class:`PoolRegistry` is the scheduler's table (plain, no Dask in it): every change returns the
:class:`RegistryUpdate` to broadcast. :class:`RegistryView` is a worker's copy, kept current by those broadcasts so
that code on the hot path (the serializers) reads it without waiting on the scheduler.

The process's live services (:func:`active_service`, :func:`active_services`): deserializers run without a worker
at hand (Dask calls them with a header and frames only), so they find the process's service here. A process
normally runs one worker with the plugin (Nanny, dask-cuda); with several, the most recent one is used. Truly per
process: what it lists are the services of this process. :func:`~dask_gpupool.handoff.startup.start_service` adds
each service it makes (:func:`add_active`) and has the service remove itself when it closes
(:attr:`PoolService.on_close <dask_gpupool.handoff.service.PoolService.on_close>`, :func:`remove_active`); this
module imports neither (the service is only named for type checkers).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from dask_gpupool.wire.registry import PoolRecord, RegistryUpdate

if TYPE_CHECKING:
    from dask_gpupool.handoff.service import PoolService

__all__ = [
    "PoolRegistry",
    "RegistryView",
    "active_service",
    "active_services",
    "add_active",
    "remove_active",
]


class PoolRegistry:
    """The scheduler's table of pools, one row per pool UUID.

    Attributes
    ----------
    version : int
        Bumped by every change.
    """

    version: int
    _records: dict[str, PoolRecord]

    def __init__(self) -> None:
        self.version = 0
        self._records = {}

    def add(self, record: PoolRecord) -> RegistryUpdate:
        """Insert or replace ``record``; return the change to broadcast."""
        self.version += 1
        self._records[record.pool] = record
        return RegistryUpdate(self.version, added=(record,))

    def remove(self, pools: list[str]) -> RegistryUpdate | None:
        """Drop these pools; return the change, or ``None`` if none was registered."""
        gone = tuple(p for p in pools if self._records.pop(p, None) is not None)
        if not gone:
            return None
        self.version += 1
        return RegistryUpdate(self.version, removed=gone)

    def remove_worker(self, worker: str) -> RegistryUpdate | None:
        """Drop every pool owned by ``worker``."""
        return self.remove([r.pool for r in self._records.values() if r.worker == worker])

    def get(self, pool: str) -> PoolRecord | None:
        """The row of ``pool``, if registered."""
        return self._records.get(pool)

    def owners(self) -> set[str]:
        """Addresses of the workers that own a row."""
        return {r.worker for r in self._records.values()}

    def snapshot(self) -> RegistryUpdate:
        """The whole table as one update."""
        return RegistryUpdate(self.version, added=tuple(self._records.values()), snapshot=True)

    def records(self) -> list[PoolRecord]:
        return list(self._records.values())

    def __len__(self) -> int:
        return len(self._records)


class RegistryView:
    """A worker's cached copy of the registry.

    Updates may arrive out of order with respect to the snapshot a worker
    gets when it registers; each row and each removal remembers the version
    that brought it, so an older snapshot can neither revive a removed pool
    nor drop a newer one. Thread-safe: updates arrive on the event loop,
    reads come from task threads.
    """

    version: int
    _records: dict[str, PoolRecord]
    _added_at: dict[str, int]
    _removed_at: dict[str, int]
    _lock: threading.Lock

    def __init__(self) -> None:
        self.version = 0
        self._records = {}
        self._added_at = {}
        self._removed_at = {}
        self._by_worker: dict[str, str] = {}
        self._lock = threading.Lock()

    def apply(self, update: RegistryUpdate) -> None:
        with self._lock:
            v = update.version
            for r in update.added:
                if self._removed_at.get(r.pool, -1) >= v:
                    continue
                if self._added_at.get(r.pool, -1) <= v:
                    self._records[r.pool] = r
                    self._by_worker[r.worker] = r.pool
                    self._added_at[r.pool] = v
                    self._removed_at.pop(r.pool, None)
            for pool in update.removed:
                self._drop(pool, v)
            if update.snapshot:
                present = {r.pool for r in update.added}
                for pool in [p for p, at in self._added_at.items() if p not in present and at <= v]:
                    self._drop(pool, v)
            self.version = max(self.version, v)

    def _drop(self, pool: str, version: int) -> None:
        if self._added_at.get(pool, -1) <= version:
            gone = self._records.pop(pool, None)
            if gone is not None and self._by_worker.get(gone.worker) == pool:
                del self._by_worker[gone.worker]
            self._added_at.pop(pool, None)
            self._removed_at[pool] = version

    def get(self, pool: str) -> PoolRecord | None:
        return self._records.get(pool)

    def worker_row(self, worker: str) -> PoolRecord | None:
        """The row of the pool owned by the worker at address ``worker``, if registered (no scan)."""
        pool = self._by_worker.get(worker)
        return None if pool is None else self._records.get(pool)

    def records(self) -> list[PoolRecord]:
        with self._lock:
            return list(self._records.values())

    def __len__(self) -> int:
        return len(self._records)


# -- the pool services alive in this process ---------------------------------------------------------------------------


_ACTIVE: list[PoolService] = []
_ACTIVE_LOCK = threading.Lock()


def add_active(service: PoolService) -> None:
    """Record ``service`` as alive in this process."""
    with _ACTIVE_LOCK:
        _ACTIVE.append(service)


def remove_active(service: PoolService) -> None:
    """Forget ``service`` (it is closing). Idempotent."""
    with _ACTIVE_LOCK:
        if service in _ACTIVE:
            _ACTIVE.remove(service)


def active_service() -> PoolService | None:
    """The live pool service of this process (the worker's), if any.

    Deserialization has no worker at hand; a process runs one worker with the
    plugin (Nanny, dask-cuda), and with several the most recent one is used.
    """
    with _ACTIVE_LOCK:
        return _ACTIVE[-1] if _ACTIVE else None


def active_services() -> list[PoolService]:
    """Every live pool service of this process (one per worker running the plugin here)."""
    with _ACTIVE_LOCK:
        return [s for s in _ACTIVE if not s.closed]
