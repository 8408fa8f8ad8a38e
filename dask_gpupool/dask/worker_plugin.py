"""The worker plugin: a thin adapter that gives a worker its :class:`PoolService`.

Installed by the scheduler plugin (:class:`~dask_gpupool.GPUPool`) on every
worker, present and future. On setup it makes the pool and broker, wraps the
worker's ``get_data`` handler so that the serializers know which worker asked
(:func:`~dask_gpupool.dask.distributed_seam.workers.wrap_get_data`, over
:class:`~dask_gpupool.dask.replies.Replies`) and registers the pool over the
worker's own batched stream (:class:`~dask_gpupool.dask.registry_member.RegistryMember`,
which describes the handshake). Teardown undoes all of it. What it patches of
distributed's worker is in :mod:`~dask_gpupool.dask.distributed_seam`; what it
decides, in :mod:`~dask_gpupool.dask.worker_setup`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import weakref
from typing import TYPE_CHECKING, Any

from distributed import WorkerPlugin
from distributed.core import Status
from tornado.ioloop import PeriodicCallback

from dask_gpupool.config import PoolOptions
from dask_gpupool.core import PLUGIN_NAME
from dask_gpupool.dask import comms, spilling
from dask_gpupool.dask import ucx_receive as _receive
from dask_gpupool.dask import worker_setup as decide
from dask_gpupool.dask.distributed_seam import workers as seam
from dask_gpupool.dask.frames_family import serializers_for
from dask_gpupool.dask.registry_member import RegistryMember
from dask_gpupool.dask.replies import Replies, lease_query_handler
from dask_gpupool.dask.task_events import TaskEvents
from dask_gpupool.errors import PoolUnavailableError
from dask_gpupool.handoff.routes import TCP_SCHEMES, UCX_SCHEMES, stage_threshold_of
from dask_gpupool.handoff.service import PoolService
from dask_gpupool.handoff.startup import start_service
from dask_gpupool.memory.lifetime import maps_peer_pages
from dask_gpupool.ops import metrics as _metrics
from dask_gpupool.ops.dashboard import STATS_INTERVAL, STATS_OP
from dask_gpupool.wire.handoff import LEASE_QUERY_OP

if TYPE_CHECKING:
    from collections.abc import Callable

    from distributed import Worker

__all__ = ["PLUGIN_NAME", "GPUPoolWorkerPlugin", "refuse_pool", "service_of"]

logger = logging.getLogger(__name__)

#: Workers refused a pool before they joined (:func:`refuse_pool`), and why.
_refused: weakref.WeakKeyDictionary[Worker, str] = weakref.WeakKeyDictionary()


def refuse_pool(worker: Worker, why: str) -> None:
    """``worker`` gets no pool from any registration; ``why`` (``"ConfigError: ..."``) is its failure.

    For ``--preload dask_gpupool`` with a bad ``--gpupool-<key>`` argument, which has logged ``why`` already: the
    worker plugin's setup then makes nothing, logs nothing and raises nothing (a registration does not fail for
    it, nor wait for it to join), and reports ``why`` as :meth:`GPUPoolWorkerPlugin.setup` reports a failure.
    """
    _refused[worker] = why


class GPUPoolWorkerPlugin(WorkerPlugin):
    """Worker twin of :class:`~dask_gpupool.GPUPool`; not meant to be registered by hand.

    Parameters
    ----------
    overrides : dict
        Options given to ``GPUPool(...)``; every option left out is read from
        the worker's own ``dask.config`` at setup.
    registration : str, optional
        The id of the registration that sent it
        (:attr:`~dask_gpupool.dask.registry_handlers.RegistryHandlers.registration`).
        Its setup sets nothing up when the scheduler's handlers serve another
        one by then: a worker that did not answer the install in time (stopped,
        its event loop blocked) may get it after the registration was replaced
        or removed. ``None``: not checked.
    """

    name = PLUGIN_NAME
    overrides: dict[str, Any]
    registration: str | None
    service: PoolService | None
    #: Why :meth:`setup` failed (``"ConfigError: ..."``), or ``None``.
    failure: str | None
    #: :meth:`teardown` has begun (Dask removed this plugin, possibly while :meth:`setup` still waited).
    _torn_down: bool
    _store: seam.DaskWorkerStore | None
    _member: RegistryMember | None
    _get_data: Any
    _handlers: dict[str, Any]
    _push: PeriodicCallback | None
    #: Keeps peers' pages and its pool's free pages out of this process's resident memory
    #: (:func:`.spilling.borrowed_pages_check`): every ``memory_monitor_interval``, and as each task ends.
    _pages: PeriodicCallback | None
    _pages_check: Callable[[], None] | None
    #: ``(comm module, pool, previous device_array)`` while distributed-ucxx receives into the receive pool.
    _receive: tuple[Any, _receive.ReceivePool, Any] | None
    #: Events after the kernels of each CuPy task result large enough to be staged (device pools with CuPy and a
    #: stage threshold), for staging copies.
    _task_events: TaskEvents | None

    def __init__(self, overrides: dict[str, Any] | None = None, registration: str | None = None) -> None:
        self.overrides = dict(overrides or {})
        self.registration = registration
        self.service = None
        self.failure = None
        self._torn_down = False
        self._store = None
        self._member = None
        self._get_data = None
        self._handlers = {}
        self._push = None
        self._pages = None
        self._pages_check = None
        self._receive = None
        self._task_events = None

    async def setup(self, worker: Worker) -> None:
        """Make the pool and join the registry; on failure, remember why (see :func:`service_of`) and raise."""
        seam.one_line_failures()  # distributed logs a gpupool error raised here in one line, not with its traceback
        refused = _refused.get(worker)
        if refused is not None:  # logged when it was refused (refuse_pool)
            self._fail(worker, refused)
            return
        try:
            await self._setup(worker)
        except BaseException as e:
            # Dask logs the exception: in one line for a GPUPoolError (seam.OneLine), with its traceback otherwise
            self._fail(worker, f"{type(e).__name__}: {e}")
            raise

    def _fail(self, worker: Worker, why: str) -> None:
        """No pool here, because of ``why``: what stats(), info and the /gpupool page show for this worker, so the
        rest of the cluster can still be asked (the scheduler waits for no join of this worker's)."""
        self.failure = why
        stream = getattr(worker, "batched_stream", None)
        if stream is not None and not stream.closed():
            with contextlib.suppress(Exception):
                stream.send({"op": STATS_OP, "stats": {"error": why}})

    async def _setup(self, worker: Worker) -> None:
        if self._torn_down:  # removed before its setup ran (see below)
            return
        options = PoolOptions.from_config(**self.overrides)
        scheme = decide.listen_scheme(worker)
        # An unknown scheme gets TCP's thresholds (staging only ever uses the pool's own memory), not UCX's choices.
        over_tcp, over_ucx = scheme is None or scheme in TCP_SCHEMES, scheme in UCX_SCHEMES
        # Over UCX, segments of legacy IPC memory go to other hosts as they are (no staging copy).
        service = start_service(options, worker.address, prefer_legacy=over_ucx)
        service.name = str(worker.name)
        pool = service.pool
        service.routing["segment-memory"] = decide.segment_memory_line(
            options, pool.kind, pool.segment_memory, over_ucx
        )
        try:
            decide.check_row(service.record, worker.address)
            # An op the scheduler does not know would end this worker's stream: ask first, read-only.
            serving = await worker.scheduler.gpupool_registration()
            if serving is None:  # Dask answers an unknown handler with None
                raise PoolUnavailableError(
                    f"pool {service.pool.uuid}: the scheduler has no gpupool registry; "
                    "register dask_gpupool.GPUPool() or preload dask_gpupool on the scheduler"
                )
        except BaseException:
            service.close()
            raise
        if self._torn_down:
            # Removed while it asked the scheduler (the one await here): Dask's plugin_add removes the plugin of
            # that name, tearing it down, whether or not its setup has ended, and sets up the new one (two installs
            # at once: a worker joining while a registration is broadcast). The new one is this worker's; this
            # one's pool goes, having touched nothing else (set up after this, it ran unlisted, its broker
            # serving, its stream handlers in place of the new plugin's).
            service.close()
            logger.info("gpupool: worker plugin removed while it set up (another replaced it); its pool closed")
            return
        if self.registration is not None and serving != self.registration:
            # Sent by a registration that was replaced or removed before this worker answered (it was stopped, or its
            # event loop blocked): its pool would serve beside the registry of another. The scheduler sends this
            # worker the plugin registered now, if any, once it has this answer (plugin_installs.settle).
            service.close()
            logger.info("gpupool: worker plugin of a registration replaced or removed since it was sent; no pool")
            return
        self._store = seam.DaskWorkerStore(worker)
        member = self._member = RegistryMember(service, lambda: getattr(worker, "batched_stream", None))
        seam.set_stream_handlers(worker, member.stream_handlers)
        gpu_pool = service.pool.kind in ("device", "pinned")
        has_cupy = importlib.util.find_spec("cupy") is not None
        # Requests come over the comm this worker listens on: smaller results always go through it. Over UCX
        # nothing is staged, so no events for that reason.
        stage_threshold = stage_threshold_of(service.pool.kind, over_tcp)
        service.routing["staging"] = decide.staging_line(service.pool.kind, has_cupy, over_tcp)
        if service.pool.kind == "device" and has_cupy:
            # results large enough to be staged, and pool memory (exported after its task's event only)
            self._task_events = TaskEvents(
                decide.default_stream_recorder(service.pool.device),
                wanted=decide.wants_event(service, stage_threshold),
            )
        replies = Replies(service, self._store, worker.rpc, serializers_for, self._task_events)
        self._get_data = seam.wrap_get_data(worker, replies)
        self._handlers = {LEASE_QUERY_OP: lease_query_handler(service), comms.BIND_OP: comms.bind_handler(service)}
        seam.set_handlers(worker, self._handlers)
        seam.count_own_memory_only(worker)
        spilling.count_once(worker.data, service)  # borrowed values cost nothing here; lent ones spill last
        fetches = comms.FailedFetches(member.report_lost)  # a key failing from one worker again and again
        seam.fill_after_read(worker, comms.counted(functools.partial(comms.bind, service), fetches))
        self.service = service
        if gpu_pool and has_cupy:
            # CuPy's serializers at setup rather than lazily inside Dask's first dispatch: registered lazily,
            # a dask-cuda worker can be left with no CuPy deserializer (``No dispatch for cupy.ndarray``).
            from dask_gpupool.dask.registration import register_cupy

            try:
                register_cupy()
            except Exception:  # the lazy registration retries on the first CuPy array
                logger.warning("gpupool: registering CuPy's serializers failed; retried on first use", exc_info=True)
        self._install_receive(over_ucx, service)
        # A full pool reclaims large buffers' spares that peers map: its changed row goes out on this worker's
        # stream (the scheduler takes row changes only from their worker), from the event loop.
        service.reclaim_through(lambda: worker.loop.add_callback(member.send_row))
        if _metrics.register():  # on the worker's /metrics (when prometheus_client is installed)
            seam.scope_metrics(worker, "worker")
        self._push = PeriodicCallback(member.push_stats, STATS_INTERVAL * 1000)
        self._push.start()
        host = service.pool.shared_host
        pages = spilling.borrowed_pages_check(worker.memory_manager, None if host is None else host.trim)
        if pages is not None and service.pool.kind == "host":  # peers' host pools mapped here, its own free pages
            self._pages = PeriodicCallback(pages, worker.memory_manager.memory_monitor_interval * 1000)
            self._pages.start()
            self._pages_check = pages
        member.push_stats()
        # Last, with nothing after it that can fail: the answer arrives on this stream (RegistryMember.on_membership).
        member.register()

    def _install_receive(self, over_ucx: bool, service: PoolService) -> None:
        """distributed-ucxx receives device frames into an RMM pool (:mod:`~dask_gpupool.dask.ucx_receive`); why in
        stats()."""
        module = _receive.comm_module() if over_ucx else None
        resource = None
        if module is not None and service.pool.kind == "device":
            resource = _receive.current_resource(service.pool.device or 0)
        ceiling, why = _receive.decide(service.pool.kind, module is not None, resource, service.pool.device or 0)
        current = seam.device_array(module) if module is not None else None
        if isinstance(getattr(current, "__self__", None), _receive.ReceivePool):
            ceiling, why = 0, "off: another worker of this process installed its receive pool"
        if ceiling and module is not None:
            import rmm

            pool = _receive.ReceivePool(rmm, ceiling, service.handoffs, current)
            self._receive = (module, pool, seam.point_device_array(module, pool.device_array))
        service.routing["ucx-receive"] = why

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        """Record where a task's CuPy result's kernels end when it is stored; forget it when it leaves memory.

        Runs in Dask's state machine on the event loop, for every key; only a
        result just computed here (``executing`` -> ``memory``) is looked at.
        As a task ends, before the next one starts, past the memory threshold the
        peers' pages it read leave this process's resident memory: a chain of reads
        would pile them up between two periodic checks, and the nanny's own check
        (as often) would restart the worker for memory that is not its own.
        """
        if start == "executing" and self._pages_check is not None and maps_peer_pages():
            self._pages_check()  # a psutil read (~18 us): only where peers' pages can pile up
        events = self._task_events
        if events is None:
            return
        if start == "executing" and finish == "memory":
            store = self._store
            if store is None:
                return
            try:
                value = store.stored(key)  # its in-memory part, without unspilling
            except KeyError:
                return
            try:
                events.stored(key, value)
            except Exception:  # no event: the staging copy is ordered after the default stream, as without one
                logger.debug("gpupool: recording the event of %s failed", key, exc_info=True)
        elif start == "memory":
            events.released(key)

    async def teardown(self, worker: Worker) -> None:
        self._torn_down = True  # a setup still waiting on the scheduler ends without installing anything
        if self._receive is not None:
            seam.restore_device_array(*self._receive)
            self._receive = None
        if self._push is not None:
            self._push.stop()
            self._push = None
        self._pages_check = None
        if self._pages is not None:
            self._pages.stop()
            self._pages = None
        if self._task_events is not None:
            self._task_events.clear()
            self._task_events = None
        member, self._member = self._member, None
        if member is not None:
            # Not deleted: a message already in flight would hit an unknown op, and an
            # unknown op ends the worker's whole scheduler stream. Late messages are dropped.
            seam.set_stream_handlers(worker, member.stream_handlers, replaced_by=_drop_update)
            member.close()
        seam.count_own_memory_only(worker, undo=True)
        spilling.count_plainly(worker.data)
        seam.fill_after_read(worker, undo=True)
        seam.set_handlers(worker, self._handlers, remove=True)
        self._handlers = {}
        original, self._get_data = self._get_data, None
        seam.unwrap_get_data(worker, original)
        service, self.service = self.service, None
        self._store = None
        if service is None:
            return
        if worker.status == Status.running and member is not None:
            # The plugin goes while the worker stays: take the row out. A closing worker sends nothing; the
            # scheduler drops its rows when it leaves.
            member.unregister()
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
    failure = getattr(plugin, "failure", None)
    if service is None and failure is not None:
        raise PoolUnavailableError(f"worker {worker.address} has no gpupool pool: its set-up failed: {failure}")
    if service is None:
        raise PoolUnavailableError(
            f"worker {worker.address} has no gpupool pool; register dask_gpupool.GPUPool() "
            "or start the scheduler with --preload dask_gpupool"
        )
    return service
