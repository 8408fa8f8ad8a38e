"""The scheduler plugin: the pool registry, and the installer of the worker twin.

``client.register_plugin(GPUPool(...))`` (or ``--preload dask_gpupool``) is
all a user does: :meth:`GPUPool.start` adds the ``gpupool_*`` handlers and
registers :class:`~dask_gpupool._worker_plugin.GPUPoolWorkerPlugin` on every
worker, present and future. Workers register their pools through
``gpupool_register``; rows leave with their worker (``remove_worker``) and
every change is pushed to all workers over their batched streams.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING, Any

from distributed import SchedulerPlugin
from distributed.protocol import Serialized, deserialize
from distributed.protocol.pickle import dumps, loads

from dask_gpupool import _dashboard, _metrics
from dask_gpupool._config import PoolOptions
from dask_gpupool._dashboard import STATS_OP
from dask_gpupool._errors import GPUPoolError
from dask_gpupool._messages import TOKEN_BYTES, Membership, PoolRecord, RegistryUpdate
from dask_gpupool._registry import PoolRegistry
from dask_gpupool._worker_plugin import PLUGIN_NAME, STREAM_OP, GPUPoolWorkerPlugin

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["GPUPool"]

logger = logging.getLogger(__name__)


class GPUPool(SchedulerPlugin):
    """Give every worker an IPC-enabled memory pool shared with same-host peers.

    Register it once; it installs its worker twin on every worker::

        client.register_plugin(dask_gpupool.GPUPool())

    Parameters
    ----------
    kind : {"auto", "device", "pinned", "host"}, optional
        Pool kind (``gpupool.kind``).
    device : int or str, optional
        The worker's GPU: ordinal or UUID (``gpupool.device``).
    max_size : int, float or str, optional
        Pool bound: bytes, "8 GiB", "50%" or 0.5 (``gpupool.max-size``).
    host_id : str, optional
        Host identity override (``gpupool.host-id``).
    broker_dir : str, optional
        Parent of each broker's private directory (``gpupool.broker-dir``).
    broker_timeout : str or float, optional
        Broker timeout (``gpupool.broker-timeout``).
    lease_timeout : str or float, optional
        How long an unclaimed lease lives (``gpupool.lease-timeout``).
    peer_gpu_handoff : bool or "auto", optional
        Zero-copy handoffs to workers on another GPU (``gpupool.peer-gpu-handoff``).
    segment_size : int or str, optional
        Segments of ``device`` pools, e.g. ``"1 GiB"``; 0 for none (``gpupool.segment-size``).
    suballocator : {"auto", "rmm", "arena"}, optional
        What places buffers inside segments (``gpupool.suballocator``).
    import_limit : int or str, optional
        Largest CUDA allocation handed over zero-copy (``gpupool.import-limit``).
    cupy_allocator : bool, optional
        Route CuPy's allocations through the pool (``gpupool.cupy-allocator``).
    copy_chunk_size, copy_stream_threshold : int or str, optional
        The pipelined copy path's chunk, and the smallest copy it carries
        (``gpupool.copy-chunk-size``, ``gpupool.copy-stream-threshold``).
    copy_streams : int, optional
        Connections one copy is pulled over (``gpupool.copy-streams``).

    Options left out are read by each worker from its own dask config. Values
    are checked here, so a typo fails at once with :class:`ConfigError`.

    Attributes
    ----------
    registry : PoolRegistry
        The registry (on the scheduler, once started).

    Notes
    -----
    The plugin holds the cluster's membership token, made where the plugin
    lives (never pickled: a copy sent to the scheduler makes its own). Workers
    get it in the answer to their registration, over the scheduler comm, and
    their brokers serve only peers presenting it (docs/security.md).
    """

    name = PLUGIN_NAME
    overrides: dict[str, Any]
    registry: PoolRegistry
    worker_stats: dict[str, dict[str, Any]]
    _token: bytes
    _scheduler: Scheduler | None

    def __init__(
        self,
        kind: str | None = None,
        device: int | str | None = None,
        max_size: int | float | str | None = None,
        host_id: str | None = None,
        broker_dir: str | None = None,
        broker_timeout: str | float | None = None,
        lease_timeout: str | float | None = None,
        peer_gpu_handoff: bool | str | None = None,
        segment_size: int | str | None = None,
        suballocator: str | None = None,
        import_limit: int | str | None = None,
        cupy_allocator: bool | None = None,
        copy_chunk_size: int | str | None = None,
        copy_stream_threshold: int | str | None = None,
        copy_streams: int | None = None,
    ) -> None:
        self.overrides = {
            k: v
            for k, v in dict(
                kind=kind,
                device=device,
                max_size=max_size,
                host_id=host_id,
                broker_dir=broker_dir,
                broker_timeout=broker_timeout,
                lease_timeout=lease_timeout,
                peer_gpu_handoff=peer_gpu_handoff,
                segment_size=segment_size,
                suballocator=suballocator,
                import_limit=import_limit,
                cupy_allocator=cupy_allocator,
                copy_chunk_size=copy_chunk_size,
                copy_stream_threshold=copy_stream_threshold,
                copy_streams=copy_streams,
            ).items()
            if v is not None
        }
        PoolOptions.from_config(**self.overrides)  # fail early on bad values
        self.registry = PoolRegistry()
        self.worker_stats = {}
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._scheduler = None

    def __getstate__(self) -> dict[str, Any]:
        return {"overrides": self.overrides}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.overrides = state["overrides"]
        self.registry = PoolRegistry()
        self.worker_stats = {}
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._scheduler = None

    @property
    def _handlers(self) -> dict[str, Any]:
        return {
            "gpupool_register": self.handle_register,
            "gpupool_unregister": self.handle_unregister,
            "gpupool_pools": self.handle_pools,
        }

    async def start(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        scheduler.handlers.update(self._handlers)
        # Never removed: an unknown op would end that worker's whole stream (see _drop_stats).
        scheduler.stream_handlers[STATS_OP] = self.handle_stats
        _metrics.register_scheduler(self._pools_by_kind)
        _dashboard.install(scheduler, self.snapshot)
        worker_plugin = dumps(GPUPoolWorkerPlugin(self.overrides))
        responses = await scheduler.register_worker_plugin(None, worker_plugin, PLUGIN_NAME, idempotent=False)
        failed = {w: r for w, r in responses.items() if r.get("status") == "error"}
        if failed:
            await scheduler.unregister_worker_plugin(None, PLUGIN_NAME)
            self._remove_handlers()
            worker, response = next(iter(failed.items()))
            logger.error("gpupool: setup failed on %d worker(s), e.g. %s", len(failed), worker)
            exc = response.get("exception")
            if isinstance(exc, Serialized):  # replies to a broadcast arrive undeserialized
                exc = deserialize(exc.header, exc.frames)
            if isinstance(exc, bytes):  # ... and Dask pickles the exception inside (its own error transport)
                exc = loads(exc)
            if isinstance(exc, BaseException):
                raise exc
            raise GPUPoolError(f"gpupool setup failed on {worker}: {response.get('exception_text')}")
        logger.info("gpupool: registry started, worker plugin installed on %d worker(s)", len(responses))

    async def close(self) -> None:
        self._remove_handlers()

    def _remove_handlers(self) -> None:
        if self._scheduler is not None:
            for op, handler in self._handlers.items():
                if self._scheduler.handlers.get(op) == handler:
                    del self._scheduler.handlers[op]
            if self._scheduler.stream_handlers.get(STATS_OP) == self.handle_stats:
                self._scheduler.stream_handlers[STATS_OP] = _drop_stats

    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str, **kwargs: Any) -> None:
        self.worker_stats.pop(worker, None)
        self._broadcast(self.registry.remove_worker(worker))

    def handle_stats(self, worker: str, stats: dict[str, Any]) -> None:
        """A worker's periodic statistics push (its batched stream); kept for the /gpupool page."""
        if isinstance(stats, dict) and worker in self._scheduler_workers():
            self.worker_stats[worker] = stats

    def _scheduler_workers(self) -> Any:
        return self._scheduler.workers if self._scheduler is not None else {}

    def snapshot(self) -> dict[str, Any]:
        """What the /gpupool page shows: registry rows with their pools' bytes, and per-worker handoffs."""
        pools = []
        for r in sorted(self.registry.records(), key=lambda r: r.worker):
            s = self.worker_stats.get(r.worker, {})
            pools.append({**r.to_msg(), "used": s.get("used"), "reserved": s.get("reserved")})
        return {"pools": pools, "workers": dict(self.worker_stats)}

    # -- handlers (scheduler's event loop) ------------------------------------------

    def handle_register(self, record: dict[str, Any]) -> dict[str, Any]:
        """Add a worker's pool; answer with the whole registry and the cluster's token."""
        row = PoolRecord.from_msg(record)
        update = self.registry.add(row)
        logger.info("pool %s: registered (%s pool of %s on %s)", row.pool, row.kind, row.worker, row.hostname)
        self._broadcast(update, exclude=row.worker)
        return Membership(self.registry.snapshot(), self._token).to_msg()

    def handle_unregister(self, pool: str) -> None:
        self._broadcast(self.registry.remove([pool]))

    def _pools_by_kind(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.registry.records():
            counts[r.kind] = counts.get(r.kind, 0) + 1
        return counts

    def handle_pools(self) -> list[dict[str, Any]]:
        return [r.to_msg() for r in self.registry.records()]

    def _broadcast(self, update: RegistryUpdate | None, exclude: str | None = None) -> None:
        if update is None or self._scheduler is None:
            return
        msg = {"op": STREAM_OP, **update.to_msg()}
        # Only workers with a registered pool run the worker plugin and listen.
        workers = {r.worker for r in self.registry.records()} - {exclude}
        self._scheduler.send_all({}, {w: [msg] for w in workers if w in self._scheduler.workers})


def _drop_stats(**msg: Any) -> None:
    """Stands in for the stats handler after the plugin closed: late pushes are dropped."""
