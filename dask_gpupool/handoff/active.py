"""The one home of process-wide handoff state: the pool services alive in this process.

Deserializers run without a worker at hand (Dask calls them with a header
and frames only), so they find the process's service here. A process
normally runs one worker with the plugin (Nanny, dask-cuda); with several,
the most recent one is used. Truly per process: what it lists are the
services of this process. :func:`~dask_gpupool.handoff.startup.start_service`
adds each service it makes and has the service remove itself when it closes
(:attr:`PoolService.on_close <dask_gpupool.handoff.service.PoolService.on_close>`);
this module imports neither (the service is only named for type checkers).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dask_gpupool.handoff.service import PoolService

__all__ = ["active_service", "active_services", "add", "remove"]

_ACTIVE: list[PoolService] = []
_ACTIVE_LOCK = threading.Lock()


def add(service: PoolService) -> None:
    """Record ``service`` as alive in this process."""
    with _ACTIVE_LOCK:
        _ACTIVE.append(service)


def remove(service: PoolService) -> None:
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
