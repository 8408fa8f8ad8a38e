"""Fault injection for the lease tests (``tests/handoff/test_leases.py``): stalls, hidden brokers, broken links."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

from dask_gpupool.dask.worker_plugin import service_of

if TYPE_CHECKING:
    from distributed import Worker


def block_imports(seconds: float) -> None:
    """client.run target: hold this process's import lock from a thread for ``seconds``.

    A handoff arriving meanwhile stops inside the import, after the exporter
    granted its lease and before this worker claims it: the window in which
    a stalled consumer used to lose its lease. The thread lets go by itself
    (the import may block this worker's event loop, so no later
    ``client.run`` could reach it).
    """
    from dask_gpupool.handoff.mapped_pool import IMPORT_LOCK

    held = threading.Event()

    def hold() -> None:
        with IMPORT_LOCK:
            held.set()
            threading.Event().wait(seconds)

    threading.Thread(target=hold, name="gpupool-test-block-imports", daemon=True).start()
    held.wait(10)


def hide_broker(dask_worker: Worker) -> str:
    """client.run target: move this worker's broker socket aside (peers can no longer open a link); return the path."""
    service = service_of(dask_worker)
    os.rename(service.broker.address, service.broker.address + ".hidden")
    return service.broker.address


def restore_broker(dask_worker: Worker) -> None:
    """client.run target: undo :func:`hide_broker`."""
    service = service_of(dask_worker)
    os.rename(service.broker.address + ".hidden", service.broker.address)


def close_links(dask_worker: Worker) -> int:
    """client.run target: close this worker's links to exporters (as if each broke); return how many."""
    return service_of(dask_worker).importer.drop_links()


def stop_copy_server(dask_worker: Worker) -> None:
    """client.run target: close this worker's copy server (pulls from it then fail)."""
    service = service_of(dask_worker)
    assert service.copier is not None
    service.copier.close()


def forget_pool(pool: str, dask_worker: Worker) -> None:
    """client.run target: drop ``pool`` from this worker's copy of the registry (a stale or lying view)."""
    from dask_gpupool.wire.registry import RegistryUpdate

    registry = service_of(dask_worker).registry
    registry.apply(RegistryUpdate(version=registry.version, removed=(pool,)))


def report_failed_transfer(exporter: str, dask_worker: Worker) -> bool:
    """client.run target: tell ``exporter``'s broker, over this worker's link, that a transfer failed after its
    claims (what a fill that fails does, :func:`~dask_gpupool.handoff.deferred.run_fills`); whether it was sent."""
    importer = service_of(dask_worker).importer
    row = importer.registry.worker_row(exporter)
    if row is None:
        return False
    importer.link(row).transfer_failed()
    return True
