"""The Dask seam on the scheduler: what the scheduler plugin patches, reads and calls of distributed's scheduler,
each with the public API it stands in for.

Part of :mod:`~dask_gpupool.dask.distributed_seam` (which lists every patch), under its rules: each ``PATCH`` names
the public API that is missing, ``READ`` marks internals only read, ``CALL`` a method of the scheduler's that is no
public API; and ``tests/dask/test_distributed_seam.py`` fails when distributed changes what is used here. Sections:
the worker plugin (listed for new workers, the message that installs it), tasks erred for a plugin
(:mod:`~dask_gpupool.dask.comms`), the ``/gpupool`` page.
"""

from __future__ import annotations

import logging
import sys
import time
import weakref
from typing import TYPE_CHECKING, Any

from dask_gpupool.ops import dashboard

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = [
    "err_waiting_on",
    "list_worker_plugin",
    "listed_worker_plugin",
    "page_source",
    "plugin_message",
    "serve_page",
]

logger = logging.getLogger(__name__)

# -- the worker plugin ------------------------------------------------------------------------------------------------


def list_worker_plugin(scheduler: Scheduler, name: str, pickled: bytes | None) -> None:
    """List ``pickled`` as what new workers get under ``name`` (``None``: delist it).

    PATCH ``scheduler.worker_plugins``: ``Scheduler.register_worker_plugin`` lists and broadcasts in one call, and its
    broadcast waits for every worker (one that never answers holds it); callers send :func:`plugin_message` to each
    worker with ``Scheduler.broadcast`` instead.
    """
    if pickled is None:
        scheduler.worker_plugins.pop(name, None)
    else:
        scheduler.worker_plugins[name] = pickled


def listed_worker_plugin(scheduler: Scheduler, name: str) -> Any:
    """What new workers get under ``name`` (READ ``scheduler.worker_plugins``), or ``None``."""
    return scheduler.worker_plugins.get(name)


def plugin_message(name: str, pickled: bytes | None) -> dict[str, Any]:
    """The message that installs ``pickled`` under ``name`` on a worker (``None``: removes the plugin of that name):
    the workers' ``plugin-add`` and ``plugin-remove`` handlers."""
    if pickled is None:
        return {"op": "plugin-remove", "name": name}
    return {"op": "plugin-add", "plugin": pickled, "name": name}


# -- tasks erred ------------------------------------------------------------------------------------------------------


def err_waiting_on(scheduler: Scheduler, key: Any, worker: str, holder: str, error: dict[str, Any]) -> list[Any]:
    """Err the tasks processing on ``worker`` that wait for ``key``, in memory on ``holder``, with ``error`` (the
    fields of ``distributed.core.error_message``), as ``worker``'s own ``task-erred`` of each would; then send
    ``worker`` ``free-keys`` for them, so that it lets them (and ``key``, needed by them only) go. Returns their keys;
    none when ``key`` is no longer in memory on ``holder``.

    READ ``scheduler.tasks`` and its ``TaskState`` (``state``, ``who_has``, ``dependents``, ``processing_on``,
    ``run_id``); CALL ``Scheduler.handle_task_erred`` (the ``task-erred`` stream handler); the ``free-keys`` op is the
    worker's own stream handler, sent as the scheduler sends it. No public API lets a plugin fail a task, and a
    dependency that fails to arrive otherwise than with an ``OSError`` leaves its dependent waiting for good
    (dask/distributed#6705).
    """
    try:
        ts = scheduler.tasks.get(key)
    except TypeError:  # an unhashable key, from a message
        return []
    if ts is None or ts.state != "memory" or holder not in {ws.address for ws in ts.who_has or ()}:
        return []
    waiting = [
        d for d in ts.dependents if d.state == "processing" and getattr(d.processing_on, "address", None) == worker
    ]
    stimulus_id = f"gpupool-lost-{time.time()}"
    for d in waiting:
        scheduler.handle_task_erred(key=d.key, stimulus_id=stimulus_id, worker=worker, run_id=d.run_id, **error)
    stream = scheduler.stream_comms.get(worker)
    if waiting and stream is not None:
        stream.send({"op": "free-keys", "keys": [d.key for d in waiting], "stimulus_id": stimulus_id})
    return [d.key for d in waiting]


# -- the /gpupool page ------------------------------------------------------------------------------------------------


#: The /gpupool page's source per scheduler (the routes are added once per scheduler; a later call swaps the source).
_pages: weakref.WeakKeyDictionary[Any, dict[str, dashboard.Source]] = weakref.WeakKeyDictionary()


def serve_page(scheduler: Scheduler, source: dashboard.Source) -> bool:
    """Serve ``/gpupool`` and ``/gpupool.json`` on the scheduler's HTTP server from ``source`` (a later call replaces
    the source), linked from the dashboard's menu; ``False`` when it runs no HTTP server.

    PATCH the scheduler's ``http_application`` routes (``distributed.scheduler.http.routes`` is read at start,
    before a plugin is registered) and the dashboard's "More..." menu, the ``plots`` list of
    ``distributed.dashboard.scheduler.template_variables(scheduler)`` (memoized, shared by every page); the menu is
    left as it is without Bokeh, or where a future Dask lays it out differently.
    """
    app = getattr(scheduler, "http_application", None)
    if app is None:
        return False
    holder = _pages.get(scheduler)
    if holder is None:
        holder = _pages[scheduler] = {"source": source}
        app.add_handlers(".*$", dashboard.routes(holder))
        if "distributed.dashboard.scheduler" in sys.modules:  # a Bokeh dashboard (importing it would need Bokeh)
            try:
                from distributed.dashboard.scheduler import template_variables

                plots = template_variables(scheduler)["plots"]
                if not any(p.get("url") == "gpupool" for p in plots):
                    plots.append({"url": "gpupool", "name": "GPU Pool"})
                    plots.sort(key=lambda p: p["name"])
            except Exception:  # a dashboard laid out differently: the page still serves at /gpupool
                logger.debug("could not add /gpupool to the dashboard's menu", exc_info=True)
    holder["source"] = source
    return True


def page_source(scheduler: Scheduler) -> dashboard.Source | None:
    """What ``scheduler``'s /gpupool page shows now (:func:`serve_page`), or ``None``."""
    holder = _pages.get(scheduler)
    return None if holder is None else holder["source"]
