"""The scheduler plugin: the pool registry, and the installer of the worker twin.

``client.register_plugin(GPUPool(...))`` (or ``--preload dask_gpupool``) is
all a user does: :meth:`GPUPool.start` adds the handlers and registers
:class:`~dask_gpupool.dask.worker_plugin.GPUPoolWorkerPlugin` on every worker,
present and future.

The registry itself, and the handlers that change it, are
:class:`~dask_gpupool.dask.registry_handlers.RegistryHandlers`, which this
plugin installs on the scheduler. Only a worker changes the registry, and only
its own row, over its own batched stream (the ops of :mod:`dask_gpupool.core`),
in a handshake that hands it the cluster's token before it is published: so
no peer hands a worker anything, nor maps its pool, before it holds the token.
Rows leave with their worker (``remove_worker``). Clients get the read-only
``gpupool_pools`` RPC (and the ``/gpupool`` page); ``gpupool_register`` and
``gpupool_unregister`` called over RPC are refused. Refused messages are
logged (WARNING) and counted in :attr:`GPUPool.rejected`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from distributed import SchedulerPlugin
from distributed.protocol import Serialized, deserialize
from distributed.protocol.pickle import dumps, loads

from dask_gpupool.config import PoolOptions
from dask_gpupool.core import JOINED_OP, PLUGIN_NAME, REGISTER_OP, UNREGISTER_OP, UPDATE_OP
from dask_gpupool.dask.registry_handlers import RegistryHandlers
from dask_gpupool.errors import GPUPoolError
from dask_gpupool.ops import dashboard as _dashboard
from dask_gpupool.ops import metrics as _metrics
from dask_gpupool.ops.dashboard import STATS_OP

if TYPE_CHECKING:
    import collections

    from distributed import Scheduler

    from dask_gpupool.handoff.registry import PoolRegistry

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
        After how long an unclaimed lease is logged, and how long a peer whose
        transfer failed gets copies (``gpupool.lease-timeout``); no timer ends a lease.
    peer_gpu_handoff : bool or "auto", optional
        Zero-copy handoffs to workers on another GPU (``gpupool.peer-gpu-handoff``).
    segment_size : int or str, optional
        Segments of ``device`` pools, e.g. ``"1 GiB"``; 0 for none (``gpupool.segment-size``).
    suballocator : {"auto", "rmm", "arena"}, optional
        What places buffers inside segments (``gpupool.suballocator``).
    segment_memory : {"auto", "vmm", "legacy", "pool"}, optional
        What segments are made of (``gpupool.segment-memory``): ``vmm`` and
        ``legacy`` memory stay readable by peers after their owner died;
        ``legacy`` (``cuMemAlloc``) also goes over UCX without a staging copy.
    import_limit : int or str, optional
        Largest CUDA allocation handed over zero-copy (``gpupool.import-limit``).
    cupy_allocator : bool or "auto", optional
        Route CuPy's allocations through the pool (``gpupool.cupy-allocator``; ``auto``: CuPy keeps its allocator).
    ucx_handoff_threshold : int or str, optional
        Smallest value handed over zero-copy on UCX comms (``gpupool.ucx-handoff-threshold``).
    ucx_staging_threshold : int or str, optional
        Smallest pool value staged before it goes to UCX as a device frame
        (``gpupool.ucx-staging-threshold``).
    ucx_host_frame_threshold : int or str, optional
        CuPy arrays and pool Buffers below this size in a reply over UCX go as one host frame
        (``gpupool.ucx-host-frame-threshold``).
    ucx_receive_pool : bool, int, str or "auto", optional
        Most device memory of the RMM pool distributed-ucxx receives device frames into
        (``gpupool.ucx-receive-pool``; ``auto``: 1 GiB where RMM's resource is RMM's default).
    copy_chunk_size, copy_stream_threshold : int or str, optional
        The pipelined copy path's chunk, and the smallest copy it carries
        (``gpupool.copy-chunk-size``, ``gpupool.copy-stream-threshold``).
    copy_streams : int, optional
        Connections one copy is pulled over (``gpupool.copy-streams``).
    stage_threshold : int or str, optional
        Smallest array outside the pool copied into it and handed over to a
        same-host worker (``gpupool.stage-threshold``; 0: never).
    handoff_threshold : int or str, optional
        Smallest pool buffer handed over to a same-host worker over TCP;
        smaller ones are copied (``gpupool.handoff-threshold``; 0: none).
    device_objects : bool, optional
        Send every object with a ``"cuda"`` serializer (``rmm.DeviceBuffer``,
        Numba and cuDF objects) frame by frame through the pool
        (``gpupool.device-objects``).
    rmm_allocator : bool or "auto", optional
        Make RMM (and CuPy through it) allocate from the pool
        (``gpupool.rmm-allocator``; ``auto``: RMM keeps its resource).
    peer_gpu_copy : bool, optional
        Copy a value handed over from another GPU into this worker's pool on
        arrival, device to device (``gpupool.peer-gpu-copy``).
    handoff_ordering : {"sync", "event", "device"}, optional
        Wait for the task's event (else the GPU) before a descriptor goes out,
        wait for it before acknowledging the consumer's claim, or synchronize
        the whole GPU before every descriptor (``gpupool.handoff-ordering``).
    lease_claims : {"reply", "broker"}, optional
        Hold a lease once the descriptor is deserialized, or claim it over the
        exporter's broker first (``gpupool.lease-claims``).
    tcp_landing : {"auto", "pinned", "vkgdr"}, optional
        Where values pulled from another host over TCP land before the pool
        (``gpupool.tcp-landing``).
    switch_interval : str or float, optional
        The workers' Python thread switch interval while the plugin runs
        (``gpupool.switch-interval``).

    Attributes
    ----------
    registry : PoolRegistry
        The registry (on the scheduler, once started): published rows only.
    rejected : collections.Counter
        Registry messages refused, by reason: ``"rpc"`` (``gpupool_register``
        or ``gpupool_unregister`` called over RPC), ``"client"`` (sent on a
        client's stream), ``"not-a-worker"``, ``"malformed"``,
        ``"another-worker"`` (the row or pool is another worker's),
        ``"row-changed"`` (an update changing more than ``retire_below``),
        ``"not-its-row"`` (no such row of this worker) and ``"not-its-key"``
        (a message naming a worker without that worker's registry key: sent
        by another worker that put this one's address in it). Each is logged once
        per message as a WARNING.

    Raises
    ------
    ConfigError
        For a bad option value, or options given that conflict (such as
        ``rmm_allocator=True`` with ``cupy_allocator=True``): the values given
        are checked here, each on its own and against each other, so a typo
        fails at once. This process's own ``gpupool.*`` config is not read
        here: options left out are read by each worker from its own dask
        config when it sets its pool up, where the whole is checked again
        (a failure there names the worker).

    Notes
    -----
    The plugin holds the cluster's membership token, made where the plugin
    lives (never pickled: a copy sent to the scheduler makes its own). Each
    worker gets it in its :class:`~dask_gpupool.wire.registry.Membership`,
    sent over that worker's own stream only, and brokers serve only peers
    presenting it (docs/security.md). Every handler runs on the scheduler's
    event loop.

    Registrations on one scheduler run one at a time, in the order the
    scheduler received them (two clients registering at the same moment, or
    workers started with ``--preload dask_gpupool`` together): each one's whole
    start (handlers, the worker plugin on every worker, the wait for the
    workers to join) runs while no other's does, and distributed lists it
    before the next one starts. So the later of two registrations replaces the
    earlier one everywhere, as registering again does; an idempotent one
    (``--preload``) that finds a plugin listed once its turn comes does nothing.
    """

    name = PLUGIN_NAME
    overrides: dict[str, Any]
    #: ``True``: install only if the scheduler lists no ``GPUPool`` yet (distributed's ``idempotent``; ``--preload``).
    idempotent: bool
    _registry_handlers: RegistryHandlers

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
        segment_memory: str | None = None,
        import_limit: int | str | None = None,
        cupy_allocator: bool | str | None = None,
        ucx_handoff_threshold: int | str | None = None,
        ucx_staging_threshold: int | str | None = None,
        ucx_host_frame_threshold: int | str | None = None,
        ucx_receive_pool: bool | int | str | None = None,
        copy_chunk_size: int | str | None = None,
        copy_stream_threshold: int | str | None = None,
        copy_streams: int | None = None,
        stage_threshold: int | str | None = None,
        handoff_threshold: int | str | None = None,
        device_objects: bool | None = None,
        rmm_allocator: bool | str | None = None,
        peer_gpu_copy: bool | None = None,
        handoff_ordering: str | None = None,
        lease_claims: str | None = None,
        tcp_landing: str | None = None,
        switch_interval: str | float | None = None,
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
                segment_memory=segment_memory,
                import_limit=import_limit,
                cupy_allocator=cupy_allocator,
                ucx_handoff_threshold=ucx_handoff_threshold,
                ucx_staging_threshold=ucx_staging_threshold,
                ucx_host_frame_threshold=ucx_host_frame_threshold,
                ucx_receive_pool=ucx_receive_pool,
                copy_chunk_size=copy_chunk_size,
                copy_stream_threshold=copy_stream_threshold,
                copy_streams=copy_streams,
                stage_threshold=stage_threshold,
                handoff_threshold=handoff_threshold,
                device_objects=device_objects,
                rmm_allocator=rmm_allocator,
                peer_gpu_copy=peer_gpu_copy,
                handoff_ordering=handoff_ordering,
                lease_claims=lease_claims,
                tcp_landing=tcp_landing,
                switch_interval=switch_interval,
            ).items()
            if v is not None
        }
        # Fail early on a bad value given here, or on values given that conflict; not on this process's own
        # config (a client's, or the scheduler's), which no worker reads: each worker checks the whole, the
        # overrides over its own config, and a failure there names the worker.
        PoolOptions.from_overrides(**self.overrides)
        self.idempotent = False
        self._fresh_state()

    def _fresh_state(self) -> None:
        self._registry_handlers = RegistryHandlers()  # the registry, and a token of its own

    def __getstate__(self) -> dict[str, Any]:
        return {"overrides": self.overrides, "idempotent": self.idempotent}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.overrides = state["overrides"]
        self.idempotent = bool(state.get("idempotent", False))
        self._fresh_state()

    @property
    def registry(self) -> PoolRegistry:
        """The registry (published rows only)."""
        return self._registry_handlers.registry

    @property
    def worker_stats(self) -> dict[str, dict[str, Any]]:
        """Each worker's last statistics push, for the /gpupool page."""
        return self._registry_handlers.worker_stats

    @property
    def rejected(self) -> collections.Counter[str]:
        """Registry messages refused, by reason."""
        return self._registry_handlers.rejected

    @property
    def _scheduler(self) -> Scheduler | None:
        return self._registry_handlers.scheduler

    def snapshot(self) -> dict[str, Any]:
        """What the /gpupool page shows (:meth:`RegistryHandlers.snapshot`)."""
        return self._registry_handlers.snapshot()

    @property
    def _handlers(self) -> dict[str, Any]:
        """RPC handlers: any comm reaches them, so they only read (or refuse)."""
        h = self._registry_handlers
        return {
            "gpupool_pools": h.handle_pools,
            "gpupool_register": h.refuse_register_rpc,
            "gpupool_unregister": h.refuse_unregister_rpc,
        }

    @property
    def _stream_handlers(self) -> dict[str, Any]:
        """Batched-stream handlers: each checks that a worker sent it about its own row (``_source``)."""
        h = self._registry_handlers
        return {
            REGISTER_OP: h.handle_register,
            JOINED_OP: h.handle_joined,
            UPDATE_OP: h.handle_update,
            UNREGISTER_OP: h.handle_unregister,
            STATS_OP: h.handle_stats,
        }

    async def start(self, scheduler: Scheduler) -> None:
        """Install the registry's handlers and the worker plugin on every worker; wait for the workers to join.

        One registration at a time per scheduler (:func:`_registrations`): distributed lists a plugin
        (``Scheduler.add_plugin``) as soon as its ``start`` returns, with nothing in between that could let another
        registration run, so the one that starts next finds this one listed and replaces it (its handlers, its
        worker plugin on every worker). Two starts at once instead left the scheduler listing one plugin while the
        other's handlers served the registry (so dead workers' rows stayed), and the workers running the pools of
        both, in whichever order each got the two plugins.
        """
        if self._scheduler is scheduler:
            # A plugin that a preload registered (and so started) is started again by distributed once
            # the preloads are done: once is enough.
            return
        registrations = _registrations(scheduler)
        if registrations.locked():
            logger.info("gpupool: another GPUPool registration is under way; this one %s waits for it", self.overrides)
        async with registrations:
            listed = scheduler.plugins.get(PLUGIN_NAME)
            if self.idempotent and isinstance(listed, GPUPool):
                # Installed by a registration that ran while this one waited; distributed keeps it listed
                # (idempotent add_plugin), as it would have, had this one come after it.
                return
            if isinstance(listed, GPUPool) and listed.overrides != self.overrides:
                logger.info("gpupool: GPUPool %s replaces the running GPUPool %s", self.overrides, listed.overrides)
            await self._start(scheduler)

    async def _start(self, scheduler: Scheduler) -> None:
        from dask_gpupool.dask.worker_plugin import GPUPoolWorkerPlugin  # the class, pickled for workers

        self._registry_handlers.serve(scheduler)
        scheduler.handlers.update(self._handlers)
        # Never removed: an unknown op would end that worker's whole stream (see _drop).
        scheduler.stream_handlers.update(self._stream_handlers)
        _metrics.register_scheduler(self._registry_handlers.pools_by_kind, scheduler)
        _dashboard.install(scheduler, self.snapshot)
        worker_plugin = dumps(GPUPoolWorkerPlugin(self.overrides))
        try:
            responses = await scheduler.register_worker_plugin(None, worker_plugin, PLUGIN_NAME, idempotent=False)
        except Exception:
            # The broadcast itself failed (a worker died while its plugin-add was under way: distributed raises
            # its CommClosedError). Undone as a failed setup is: left in place, this plugin's handlers served a
            # registry that no listed plugin owns, which no remove_worker reaches, and new workers installed it.
            await self._undo(scheduler)
            raise
        failed = {w: r for w, r in responses.items() if r.get("status") == "error"}
        if failed:
            await self._undo(scheduler)
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
        await self._registry_handlers.wait_until_joined(list(responses))
        # Workers that left meanwhile: distributed tells only listed plugins (remove_worker), and this one is listed
        # only once start returns (nothing runs in between, so every later departure reaches remove_worker).
        self._registry_handlers.drop_departed()
        logger.info("gpupool: registry started, worker plugin installed on %d worker(s)", len(responses))

    async def _undo(self, scheduler: Scheduler) -> None:
        """A failed registration: its worker plugin unregistered (from every worker), its handlers removed, and a
        plugin it was replacing delisted."""
        try:
            await scheduler.unregister_worker_plugin(None, PLUGIN_NAME)
        except Exception:  # a worker that cannot be reached (the one that died): the others are told
            logger.warning("gpupool: removing the worker plugin of a failed registration failed", exc_info=True)
        self._remove_handlers()
        self._registry_handlers.scheduler = None
        replaced = scheduler.plugins.get(PLUGIN_NAME)
        if isinstance(replaced, GPUPool) and replaced is not self:
            # Registered again over a running plugin: its worker plugins were replaced by ours and are gone
            # with them, and its handlers by ours. Listed still, it would make every later idempotent
            # registration (``--preload dask_gpupool``) a no-op on a cluster with no pools.
            scheduler.remove_plugin(name=PLUGIN_NAME)
            await replaced.close()

    async def close(self) -> None:
        self._remove_handlers()

    def _remove_handlers(self) -> None:
        if self._scheduler is not None:
            for op, handler in self._handlers.items():
                if self._scheduler.handlers.get(op) == handler:
                    del self._scheduler.handlers[op]
            for op, handler in self._stream_handlers.items():
                if self._scheduler.stream_handlers.get(op) == handler:
                    self._scheduler.stream_handlers[op] = _drop

    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str, **kwargs: Any) -> None:
        """Rows (published or pending) leave with their worker (:meth:`RegistryHandlers.remove_worker`)."""
        self._registry_handlers.remove_worker(worker)


def _registrations(scheduler: Scheduler) -> asyncio.Lock:
    """The lock that runs ``scheduler``'s ``GPUPool`` registrations one at a time, in the order they came (FIFO)."""
    lock = getattr(scheduler, "_gpupool_registrations", None)
    if not isinstance(lock, asyncio.Lock):
        lock = asyncio.Lock()
        scheduler._gpupool_registrations = lock  # type: ignore[attr-defined]
    return lock


def _drop(**msg: Any) -> None:
    """Stands in for a stream handler after the plugin closed: late messages are dropped."""
