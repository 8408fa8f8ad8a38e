"""The worker plugin: a thin adapter that gives a worker its :class:`PoolService`.

Installed by the scheduler plugin (:class:`~dask_gpupool.GPUPool`) on every
worker, present and future. On setup it makes the pool and broker, registers
the pool with the scheduler, takes the registry snapshot from the reply,
subscribes to registry updates (stream op ``gpupool-registry``) and wraps the
worker's ``get_data`` handler so that the serializers know which worker asked
(:func:`~dask_gpupool._serialize.install_get_data_hook`). Teardown undoes all
of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from distributed import WorkerPlugin
from distributed.core import Status
from tornado.ioloop import PeriodicCallback

from dask_gpupool import _metrics
from dask_gpupool._config import PoolOptions
from dask_gpupool._dashboard import STATS_INTERVAL, STATS_OP
from dask_gpupool._errors import PoolUnavailableError
from dask_gpupool._messages import Membership, RegistryUpdate
from dask_gpupool._serialize import install_get_data_hook
from dask_gpupool._service import PoolService

if TYPE_CHECKING:
    from distributed import Worker

__all__ = ["PLUGIN_NAME", "GPUPoolWorkerPlugin", "service_of"]

logger = logging.getLogger(__name__)

PLUGIN_NAME = "gpupool"
STREAM_OP = "gpupool-registry"


class GPUPoolWorkerPlugin(WorkerPlugin):
    """Worker twin of :class:`~dask_gpupool.GPUPool`; not meant to be registered by hand.

    Parameters
    ----------
    overrides : dict
        Options given to ``GPUPool(...)``; every option left out is read from
        the worker's own ``dask.config`` at setup.
    """

    name = PLUGIN_NAME
    overrides: dict[str, Any]
    service: PoolService | None
    _get_data: Any
    _push: PeriodicCallback | None
    _cupy_previous: Any

    def __init__(self, overrides: dict[str, Any] | None = None) -> None:
        self.overrides = dict(overrides or {})
        self.service = None
        self._get_data = None
        self._push = None
        self._cupy_previous = None

    async def setup(self, worker: Worker) -> None:
        options = PoolOptions.from_config(**self.overrides)
        service = PoolService.start(options, worker.address)
        try:
            worker.stream_handlers[STREAM_OP] = self._on_registry_update
            reply = await worker.scheduler.gpupool_register(record=service.record.to_msg())
            if reply is None:  # Dask answers an unknown handler with None
                raise PoolUnavailableError(
                    f"pool {service.pool.uuid}: the scheduler has no gpupool registry; "
                    "register dask_gpupool.GPUPool() or preload dask_gpupool on the scheduler"
                )
            service.join(Membership.from_msg(reply))
        except BaseException:
            worker.stream_handlers.pop(STREAM_OP, None)
            service.close()
            raise
        self._get_data = install_get_data_hook(worker, service)
        self.service = service
        gpu_pool = service.pool.kind in ("device", "pinned")
        if gpu_pool and importlib.util.find_spec("cupy") is not None:
            # CuPy's serializers at setup rather than lazily inside Dask's first dispatch: a dask-cuda
            # worker was seen with no CuPy deserializer after the lazy path (docs/gpu-checks.md).
            from dask_gpupool._serialize import register_cupy

            try:
                register_cupy()
            except Exception:  # the lazy registration retries on the first CuPy array
                logger.warning("gpupool: registering CuPy's serializers failed; retried on first use", exc_info=True)
        if gpu_pool and options.cupy_allocator:
            from dask_gpupool import _cupy

            self._cupy_previous = _cupy.install(service)
        _metrics.register()  # on the worker's /metrics (when prometheus_client is installed)
        self._push = PeriodicCallback(lambda: self._push_stats(worker), STATS_INTERVAL * 1000)
        self._push.start()
        self._push_stats(worker)

    def _push_stats(self, worker: Worker) -> None:
        """Send this worker's pool and handoff stats to the scheduler (the /gpupool page)."""
        service = self.service
        stream = getattr(worker, "batched_stream", None)
        if service is None or service.closed or stream is None or stream.closed():
            return
        try:
            stats = {**service.handoff_stats(), **service.stats().to_msg()}
            stream.send({"op": STATS_OP, "stats": stats})
        except Exception:  # a closing stream; the next push or the teardown settles it
            logger.debug("gpupool: stats push failed", exc_info=True)

    def _on_registry_update(self, **msg: Any) -> None:
        if self.service is not None:
            self.service.apply_registry(RegistryUpdate.from_msg(msg))

    async def teardown(self, worker: Worker) -> None:
        if self._cupy_previous is not None:
            from dask_gpupool import _cupy

            _cupy.uninstall(self._cupy_previous)
            self._cupy_previous = None
        if self._push is not None:
            self._push.stop()
            self._push = None
        if worker.stream_handlers.get(STREAM_OP) == self._on_registry_update:
            # Not deleted: an update already in flight would hit an unknown op, and an
            # unknown op ends the worker's whole scheduler stream. Late updates are dropped.
            worker.stream_handlers[STREAM_OP] = _drop_update
        original = self._get_data
        self._get_data = None
        if callable(original) and getattr(worker.handlers.get("get_data"), "__wrapped__", None) is original:
            worker.handlers["get_data"] = cast("Callable[..., Any]", original)
        service, self.service = self.service, None
        if service is None:
            return
        if worker.status == Status.running:
            # The plugin goes while the worker stays: take the row out now. A closing
            # worker needs no call; the scheduler drops its rows when it leaves.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    worker.scheduler.gpupool_unregister(pool=service.pool.uuid), service.options.broker_timeout
                )
        service.close()


def _drop_update(**msg: Any) -> None:
    pass


def service_of(worker: Worker) -> PoolService:
    """The :class:`PoolService` of ``worker``.

    Raises
    ------
    PoolUnavailableError
        If the worker does not run the gpupool plugin.
    """
    plugin = worker.plugins.get(PLUGIN_NAME)
    service = getattr(plugin, "service", None)
    if service is None:
        raise PoolUnavailableError(
            f"worker {worker.address} has no gpupool pool; register dask_gpupool.GPUPool() "
            "or start the scheduler with --preload dask_gpupool"
        )
    return service
