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
``gpupool_pools`` RPC (and the ``/gpupool`` page), workers the read-only
``gpupool_registration`` (which registration the handlers serve); ``gpupool_register`` and
``gpupool_unregister`` called over RPC are refused. Refused messages are
logged (WARNING) and counted in :attr:`GPUPool.rejected`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from distributed import SchedulerPlugin
from distributed.core import Status
from distributed.protocol.pickle import dumps
from tornado.ioloop import PeriodicCallback

from dask_gpupool.config import PoolOptions
from dask_gpupool.core import JOINED_OP, PLUGIN_NAME, REGISTER_OP, UNREGISTER_OP, UPDATE_OP
from dask_gpupool.dask import plugin_installs as installs
from dask_gpupool.dask.comms import LOST_OP
from dask_gpupool.dask.distributed_seam import scheduler as scheduler_seam
from dask_gpupool.dask.distributed_seam import workers as seam
from dask_gpupool.dask.registry_handlers import RegistryHandlers, answer_timeout
from dask_gpupool.errors import GPUPoolError
from dask_gpupool.ops import metrics as _metrics
from dask_gpupool.ops.dashboard import STATS_OP

if TYPE_CHECKING:
    import collections

    from distributed import Scheduler

    from dask_gpupool.handoff.registry import PoolRegistry

__all__ = ["GPUPool"]

logger = logging.getLogger(__name__)

#: Seconds between two looks at whether distributed still lists the plugin (:meth:`GPUPool._check_listed`).
_WATCH_INTERVAL = 0.5


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
    segment_memory : {"auto", "vmm", "legacy"}, optional
        What the segments of ``device`` pools are made of (``gpupool.segment-memory``): ``vmm`` and
        ``legacy`` memory stay readable by peers after their owner died;
        ``legacy`` (``cuMemAlloc``) also goes over UCX without a staging copy.
    handoff_ordering : {"sync", "device"}, optional
        Wait for the task's event (else the GPU) before a descriptor goes out,
        or synchronize the whole GPU before every descriptor
        (``gpupool.handoff-ordering``).

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
        For a bad option value, or options given that conflict: the values given
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
    earlier one everywhere, as registering again does, and delists it, under
    whatever name it was listed (``register_plugin(GPUPool(...), name="pools")``
    over ``"gpupool"``): the scheduler lists one ``GPUPool`` at most. An
    idempotent one (``--preload``) that finds a ``GPUPool`` listed, under any
    name, once its turn comes does nothing, and is not left listed.

    A registration waits for the workers at most ``distributed.comm.timeouts.connect`` (their answers to the plugin
    install, then their joining the registry, together). A worker that does not answer by then (stopped, its event
    loop blocked) is named in a WARNING and the registration goes on without it; no later registration waits for it
    either. Once it answers, it gets the worker plugin registered then (the one it was sent, which joins it to the
    registry like a worker joining the cluster, or else the current one, or the removal of the one it holds): a
    worker plugin of a registration replaced or removed meanwhile makes no pool (it carries its registration's id,
    and the scheduler answers which one its handlers serve).

    ``client.unregister_scheduler_plugin("gpupool")`` undoes a registration: distributed only delists the plugin, and
    the plugin, which looks every half second whether it is still listed, then stops serving (its stream handlers
    drop late messages) and unregisters its worker plugin from every worker, whose pools close once their leases
    end. A later registration starts from a clean state.
    """

    name = PLUGIN_NAME
    overrides: dict[str, Any]
    #: ``True``: install only if the scheduler lists no ``GPUPool`` yet (distributed's ``idempotent``; ``--preload``).
    idempotent: bool
    _registry_handlers: RegistryHandlers
    _worker_plugin: bytes | None
    _watch: PeriodicCallback | None
    _delisting: asyncio.Future[None] | None

    def __init__(
        self,
        kind: str | None = None,
        device: int | str | None = None,
        max_size: int | float | str | None = None,
        host_id: str | None = None,
        broker_dir: str | None = None,
        broker_timeout: str | float | None = None,
        lease_timeout: str | float | None = None,
        segment_memory: str | None = None,
        handoff_ordering: str | None = None,
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
                segment_memory=segment_memory,
                handoff_ordering=handoff_ordering,
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
        self._worker_plugin = None  # the pickled worker plugin this registration sent
        self._watch = None  # sees distributed delist this plugin (_check_listed)
        self._delisting = None

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
            "gpupool_registration": h.handle_registration,
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
            LOST_OP: h.handle_lost,
        }

    async def start(self, scheduler: Scheduler) -> None:
        """Install the registry's handlers and the worker plugin on every worker; wait for the workers to join.

        One registration at a time per scheduler (:func:`~.plugin_installs.registrations`): distributed lists a plugin
        (``Scheduler.add_plugin``) as soon as its ``start`` returns, with nothing in between that could let another
        registration run, so the one that starts next finds this one listed and replaces it (its handlers, its
        worker plugin on every worker). Two starts at once instead left the scheduler listing one plugin while the
        other's handlers served the registry (so dead workers' rows stayed), and the workers running the pools of
        both, in whichever order each got the two plugins.
        """
        seam.one_line_failures()  # distributed logs a gpupool error raised here in one line, not with its traceback
        if self._scheduler is scheduler:
            # A plugin that a preload registered (and so started) is started again by distributed once
            # the preloads are done: once is enough.
            return
        turns = installs.registrations(scheduler)
        if turns.locked():
            logger.info("gpupool: another GPUPool registration is under way; this one %s waits for it", self.overrides)
        async with turns:
            listed = [plugin for plugin in _listed(scheduler).values() if plugin is not self]
            if self.idempotent and listed:
                # Installed by a registration that ran while this one waited, or listed under a name of its own
                # (distributed looked under this one's name only). Distributed keeps a plugin listed under this
                # one's name (idempotent add_plugin), as it would have, had this one come after it; under another
                # name, it lists this one too once start returns: delisted right after, so one GPUPool stays listed.
                asyncio.get_running_loop().call_soon(self._delist_unstarted, scheduler)
                return
            for running in listed:
                if running.overrides != self.overrides:
                    logger.info(
                        "gpupool: GPUPool %s replaces the running GPUPool %s", self.overrides, running.overrides
                    )
            await self._start(scheduler)

    async def _start(self, scheduler: Scheduler) -> None:
        from dask_gpupool.dask.worker_plugin import GPUPoolWorkerPlugin  # the class, pickled for workers

        deadline = time.monotonic() + answer_timeout()
        self._registry_handlers.serve(scheduler)
        seam.set_handlers(scheduler, self._handlers)
        # Never removed: an unknown op would end that worker's whole stream (see _drop).
        seam.set_stream_handlers(scheduler, self._stream_handlers)
        if _metrics.register_scheduler(self._registry_handlers.pools_by_kind):
            seam.scope_metrics(scheduler, "scheduler")
        scheduler_seam.serve_page(scheduler, self.snapshot)
        worker_plugin = dumps(GPUPoolWorkerPlugin(self.overrides, self._registry_handlers.registration))
        self._worker_plugin = worker_plugin
        responses, late = await installs.install(scheduler, worker_plugin, deadline)
        broken = {w: r for w, r in sorted(responses.items()) if isinstance(r, BaseException)}
        if broken:
            # A worker died while its plugin-add was under way (distributed's CommClosedError). Undone as a failed
            # setup is: left in place, this plugin's handlers served a registry that no listed plugin owns, which no
            # remove_worker reaches, and new workers installed it.
            await self._undo(scheduler)
            worker, exc = next(iter(broken.items()))
            # Not re-raised as it is: Dask takes a CommClosedError out of a handler for the caller's own connection
            # closing, aborts it unanswered, and the caller saw a CommClosedError naming its link to the scheduler.
            raise GPUPoolError(
                f"gpupool: {worker} left while it installed the worker plugin ({type(exc).__name__}: {exc}); "
                "the registration is undone"
            ) from exc
        failed = {w: r for w, r in responses.items() if r.get("status") == "error"}
        if failed:
            await self._undo(scheduler)
            worker, response = next(iter(failed.items()))
            exc = installs.setup_error(worker, response)
            logger.error(
                "gpupool: setup failed on %d worker(s), e.g. %s: %s: %s; the registration is undone",
                len(failed),
                worker,
                type(exc).__name__,
                exc,
            )
            seam.said(exc)  # said here, with the workers: distributed's record of it is left out
            raise exc
        if late:
            logger.warning(
                "gpupool: %d worker(s) did not answer the plugin install (within %.3g s, or one sent before): %s; "
                "registering without them: each gets the plugin registered when it answers, and joins then",
                len(late),
                answer_timeout(),
                ", ".join(sorted(late)),
            )
        await self._registry_handlers.wait_until_joined(list(responses), deadline)
        # Workers that left meanwhile: distributed tells only listed plugins (remove_worker), and this one is listed
        # only once start returns (nothing runs in between, so every later departure reaches remove_worker).
        self._registry_handlers.drop_departed()
        self._watch = PeriodicCallback(lambda: self._check_listed(scheduler), _WATCH_INTERVAL * 1000)
        self._watch.start()
        await self._delist_replaced(scheduler)
        logger.info("gpupool: registry started, worker plugin installed on %d worker(s)", len(responses))

    async def _undo(self, scheduler: Scheduler) -> None:
        """A failed registration: its worker plugin unregistered (from every worker), its handlers removed, and a
        plugin it was replacing delisted."""
        await installs.uninstall(scheduler, self._worker_plugin)
        self._remove_handlers()
        self._registry_handlers.scheduler = None
        # Registered again over a running plugin: its worker plugins were replaced by ours and are gone with them,
        # and its handlers by ours. Listed still, it would make every later idempotent registration
        # (``--preload dask_gpupool``) a no-op on a cluster with no pools.
        await self._delist_replaced(scheduler)

    async def _delist_replaced(self, scheduler: Scheduler) -> None:
        """Every other ``GPUPool`` listed, under any name (the one this registration replaced), closed and delisted
        (``Scheduler.remove_plugin``): distributed then lists this one only, so that unregistering its name tears
        everything down. A replaced one left listed under a name other than this one's (``register_plugin(...,
        name="pools")`` over ``"gpupool"``) served nothing, yet its listing kept this one's watch from tearing
        down once this one was unregistered, and unregistering it would have torn down this one's pools."""
        for name, replaced in _listed(scheduler).items():
            if replaced is not self:
                await replaced.close()  # its watch stopped; its handlers, already ours, left in place
                scheduler.remove_plugin(name=name)

    def _delist_unstarted(self, scheduler: Scheduler) -> None:
        """An idempotent registration that found a ``GPUPool`` listed and did nothing: delisted, wherever distributed
        listed it after its ``start`` returned (a name that no plugin held)."""
        if self._scheduler is None:
            for name in [name for name, plugin in scheduler.plugins.items() if plugin is self]:
                scheduler.remove_plugin(name=name)

    def _check_listed(self, scheduler: Scheduler) -> None:
        """The watch (a periodic callback from the end of :meth:`start`, when distributed lists this plugin): once
        distributed no longer lists it (``client.unregister_scheduler_plugin``), stop serving (:meth:`_delisted`).

        Distributed's ``Scheduler.remove_plugin`` only deletes the plugin from ``scheduler.plugins``: it calls no
        ``close`` and tells the plugin nothing, so its handlers served on and every worker kept its pool. Looking
        at ``scheduler.plugins`` changes nothing of distributed's; wrapping ``remove_plugin`` would replace a
        method of the scheduler for every plugin, and miss any other way a plugin is delisted.
        """
        if any(plugin is self for plugin in scheduler.plugins.values()):
            return  # listed, under "gpupool" or the name given to register_plugin (distributed lists it under that)
        self._stop_watch()
        if scheduler.status != Status.running or _listed(scheduler):
            return  # closing, or registered again: the new one replaced this one's handlers and worker plugin
        self._delisting = asyncio.ensure_future(self._delisted(scheduler))

    async def _delisted(self, scheduler: Scheduler) -> None:
        """Delisted by ``client.unregister_scheduler_plugin``: no handler of this plugin serves from now on (late
        stream messages are dropped), and its worker plugin is unregistered from every worker. In turn with
        registrations (:func:`~.plugin_installs.registrations`), so that one made meanwhile is left as it is."""
        async with installs.registrations(scheduler):
            if _listed(scheduler):
                return  # registered again meanwhile, under any name: the new one replaced all of this one
            await self.close()
            await installs.uninstall(scheduler, self._worker_plugin)
            self._registry_handlers.scheduler = None
            logger.info(
                "gpupool: GPUPool %s unregistered from the scheduler; its worker plugin removed", self.overrides
            )

    async def close(self) -> None:
        self._stop_watch()
        self._remove_handlers()
        scheduler = self._scheduler
        if scheduler is not None and scheduler_seam.page_source(scheduler) == self.snapshot:
            # The /gpupool page and the scheduler's gauge showed this registry: now none.
            scheduler_seam.serve_page(scheduler, _no_registry)
            if _metrics.register_scheduler(dict):
                seam.scope_metrics(scheduler, "scheduler")

    def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    def _remove_handlers(self) -> None:
        if self._scheduler is not None:
            seam.set_handlers(self._scheduler, self._handlers, remove=True)
            seam.set_stream_handlers(self._scheduler, self._stream_handlers, replaced_by=_drop)

    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str, **kwargs: Any) -> None:
        """Rows (published or pending) leave with their worker (:meth:`RegistryHandlers.remove_worker`); a plugin
        install or removal it never answered (stopped until ``worker-ttl`` removed it) is given up."""
        self._registry_handlers.remove_worker(worker)
        outstanding = installs.unanswered(scheduler).pop(worker, None)
        if outstanding is not None:
            outstanding.cancel()


def _listed(scheduler: Scheduler) -> dict[str, GPUPool]:
    """The ``GPUPool`` distributed lists on ``scheduler``, by name: at most one, under ``"gpupool"`` or the name given
    to ``register_plugin`` (two only while a registration under another name takes over, before it delists the one it
    replaced)."""
    return {name: plugin for name, plugin in scheduler.plugins.items() if isinstance(plugin, GPUPool)}


def _drop(**msg: Any) -> None:
    """Stands in for a stream handler after the plugin closed: late messages are dropped."""


def _no_registry() -> dict[str, Any]:
    """What the /gpupool page shows once the plugin is unregistered: no pools."""
    return {"pools": [], "workers": {}, "rejected": {}}
