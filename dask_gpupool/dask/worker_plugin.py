"""The worker plugin: a thin adapter that gives a worker its :class:`PoolService`.

Installed by the scheduler plugin (:class:`~dask_gpupool.GPUPool`) on every
worker, present and future. On setup it makes the pool and broker, wraps the
worker's ``get_data`` handler so that the serializers know which worker asked
(:func:`~dask_gpupool.dask.serializers.install_get_data_hook`) and registers the
pool over the worker's own batched stream (:mod:`dask_gpupool.core`).
Teardown undoes all of it.

The registration handshake, all on the worker's stream, in order:

1. ``gpupool-register`` (this worker's row) goes to the scheduler at the end
   of setup. Setup does not wait for the answer: a worker joining a running
   cluster sets its plugins up before it reads its stream.
2. ``gpupool-membership`` comes back (:meth:`GPUPoolWorkerPlugin._on_membership`,
   event loop): the broker, copy server and links take the token at once, and
   ``gpupool-joined`` goes back. Until then the broker refuses everyone.
3. The scheduler publishes the row; peers learn it from ``gpupool-registry``.
   This worker applies its snapshot and the updates it held only when its own
   row comes back that way (:meth:`GPUPoolWorkerPlugin._on_registry_update`).
   Until then its registry view is empty, so it hands its peers copies only;
   and peers, which learn its row only from that publication, hand it
   nothing zero-copy before it holds the token and the registry.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from cuda.core import Buffer
from dask.utils import format_bytes
from distributed import WorkerPlugin
from distributed.core import Status
from tornado.ioloop import PeriodicCallback

from dask_gpupool import tuning
from dask_gpupool.config import PoolOptions
from dask_gpupool.core import (
    JOINED_OP,
    MEMBERSHIP_OP,
    PLUGIN_NAME,
    REGISTER_OP,
    REGISTRY_OP,
    UNREGISTER_OP,
    UPDATE_OP,
)
from dask_gpupool.dask import failure_logs
from dask_gpupool.dask import ucx_receive as _receive
from dask_gpupool.dask.device_objects import serializers_for
from dask_gpupool.dask.task_events import TaskEvents, is_cupy_array
from dask_gpupool.dask.views import pool_buffer_of
from dask_gpupool.dask.worker_internals import (
    count_own_memory_only,
    fill_after_read,
    install_get_data_hook,
    install_lease_query_handler,
)
from dask_gpupool.errors import PoolUnavailableError, ProtocolError
from dask_gpupool.handoff.routing import TCP_SCHEMES, UCX_SCHEMES
from dask_gpupool.handoff.service import PoolService
from dask_gpupool.memory.topology import current_gpu, sleeping_event
from dask_gpupool.ops import metrics as _metrics
from dask_gpupool.ops.dashboard import STATS_INTERVAL, STATS_OP
from dask_gpupool.wire.registry import Membership, PoolRecord, RegistryUpdate

if TYPE_CHECKING:
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
    _worker: Worker | None
    _held: list[RegistryUpdate] | None
    _get_data: Any
    _push: PeriodicCallback | None
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
        self._worker = None
        self._held = None  # registry updates held until this worker's own row is published
        self._get_data = None
        self._push = None
        self._receive = None
        self._task_events = None

    async def setup(self, worker: Worker) -> None:
        """Make the pool and join the registry; on failure, remember why (see :func:`service_of`) and raise."""
        failure_logs.install()  # distributed logs a gpupool error raised here in one line, not with its traceback
        refused = _refused.get(worker)
        if refused is not None:  # logged when it was refused (refuse_pool)
            self._fail(worker, refused)
            return
        try:
            await self._setup(worker)
        except BaseException as e:
            # Dask logs the exception: in one line for a GPUPoolError (failure_logs), with its traceback otherwise
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
        scheme = _listen_scheme(worker)
        # An unknown scheme gets TCP's thresholds (staging only ever uses the pool's own memory), not UCX's choices.
        over_tcp, over_ucx = scheme is None or scheme in TCP_SCHEMES, scheme in UCX_SCHEMES
        # Over UCX, segments of legacy IPC memory go to other hosts as they are (no staging copy).
        service = PoolService.start(options, worker.address, prefer_legacy=over_ucx)
        service.name = str(worker.name)
        pool = service.pool
        service.routing["segment-memory"] = _segment_memory_line(options, pool.kind, pool.segment_memory, over_ucx)
        try:
            _check_row(service.record, worker.address)
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
            # worker the plugin registered now, if any, once it has this answer (scheduler_plugin._settle).
            service.close()
            logger.info("gpupool: worker plugin of a registration replaced or removed since it was sent; no pool")
            return
        self._worker = worker
        self._held = []
        worker.stream_handlers[REGISTRY_OP] = self._on_registry_update
        worker.stream_handlers[MEMBERSHIP_OP] = self._on_membership
        gpu_pool = service.pool.kind in ("device", "pinned")
        has_cupy = importlib.util.find_spec("cupy") is not None
        # Requests come over the comm this worker listens on: smaller results always go through it. Over UCX
        # nothing is staged, so no events for that reason.
        stage_threshold = tuning.stage_threshold(service.pool.kind, over_tcp)
        service.routing["staging"] = _staging_line(service.pool.kind, has_cupy, over_tcp)
        if service.pool.kind == "device" and has_cupy:
            # results large enough to be staged, and pool memory (exported after its task's event only)
            self._task_events = TaskEvents(
                _default_stream_recorder(service.pool.device), wanted=_wants_event(service, stage_threshold)
            )
        self._get_data = install_get_data_hook(worker, service, serializers_for, self._task_events)
        install_lease_query_handler(worker, service)
        count_own_memory_only(worker)
        fill_after_read(worker)
        self.service = service
        if gpu_pool and has_cupy:
            # CuPy's serializers at setup rather than lazily inside Dask's first dispatch: a dask-cuda
            # worker was seen with no CuPy deserializer after the lazy path (docs/gpu-checks.md).
            from dask_gpupool.dask.serializers import register_cupy

            try:
                register_cupy()
            except Exception:  # the lazy registration retries on the first CuPy array
                logger.warning("gpupool: registering CuPy's serializers failed; retried on first use", exc_info=True)
        self._install_receive(over_ucx, service)
        # A full pool reclaims large buffers' spares that peers map: its changed row goes out on this worker's
        # stream (the scheduler takes row changes only from their worker), from the event loop.
        service.reclaim_through(lambda: worker.loop.add_callback(self._send_row, worker, service))
        _metrics.register(worker)  # on the worker's /metrics (when prometheus_client is installed)
        self._push = PeriodicCallback(lambda: self._push_stats(worker), STATS_INTERVAL * 1000)
        self._push.start()
        self._push_stats(worker)
        # Last, with nothing after it that can fail: the answer arrives on this stream (_on_membership).
        worker.batched_stream.send({"op": REGISTER_OP, "record": service.record.to_msg()})

    def _install_receive(self, over_ucx: bool, service: PoolService) -> None:
        """distributed-ucxx receives device frames into an RMM pool (:mod:`~dask_gpupool.dask.ucx_receive`); why in
        stats()."""
        module = _receive.comm_module() if over_ucx else None
        resource = None
        if module is not None and service.pool.kind == "device":
            resource = _receive.current_resource(service.pool.device or 0)
        ceiling, why = _receive.decide(service.pool.kind, module is not None, resource, service.pool.device or 0)
        if module is not None and isinstance(getattr(module.device_array, "__self__", None), _receive.ReceivePool):
            ceiling, why = 0, "off: another worker of this process installed its receive pool"
        if ceiling and module is not None:
            import rmm

            pool = _receive.ReceivePool(rmm, ceiling, service.handoffs, module.device_array)
            self._receive = (module, pool, _receive.install(module, pool))
        service.routing["ucx-receive"] = why

    @staticmethod
    def _send_row(worker: Worker, service: PoolService) -> None:
        """Send this worker's registry row as it is now (its ``reclaim``) to the scheduler, if the stream is open."""
        stream = getattr(worker, "batched_stream", None)
        key = service.registry_key
        if stream is not None and not stream.closed() and not service.closed and key is not None:
            # no key yet: not joined, and the row gpupool-joined sends is refreshed then
            stream.send({"op": UPDATE_OP, "record": service.refresh_row().to_msg(), "key": key})

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

    def _on_membership(self, **msg: Any) -> None:
        """The scheduler's answer to this worker's registration (its stream; event loop).

        The token goes to the broker, copy server and links at once (peers
        may connect as soon as the row is published); the registry snapshot
        is held until this worker's own row comes back published
        (:meth:`_on_registry_update`). Then ``gpupool-joined`` tells the
        scheduler to publish the row. A malformed message is logged, not
        raised: an exception here would end the worker's stream.
        """
        service, worker = self.service, self._worker
        if service is None or service.closed or worker is None:
            return
        try:
            membership = Membership.from_msg(msg)
        except ProtocolError:
            logger.error("pool %s: malformed membership from the scheduler", service.pool.uuid, exc_info=True)
            return
        service.join(Membership(RegistryUpdate(0), membership.token, membership.key))
        self._hold([membership.snapshot])
        # This worker's own row, as it is now: a registration another worker sent in this one's name (which
        # brought this Membership too) had a row of its own making, and that row is never published.
        row = service.refresh_row()
        worker.batched_stream.send({"op": JOINED_OP, "record": row.to_msg(), "key": membership.key})

    def _on_registry_update(self, **msg: Any) -> None:
        """A registry change pushed by the scheduler (this worker's stream; event loop); a malformed one is logged."""
        service = self.service
        if service is None:
            return
        try:
            update = RegistryUpdate.from_msg(msg)
        except ProtocolError:
            logger.error("pool %s: malformed registry update from the scheduler", service.pool.uuid, exc_info=True)
            return
        self._hold([update])

    def _hold(self, updates: list[RegistryUpdate]) -> None:
        """Apply ``updates``, or hold them while this worker's own row is not published yet.

        Held updates are applied together, in arrival order (the view sorts
        out their versions), with the one that publishes this worker's row.
        """
        service = self.service
        if service is None:
            return
        if self._held is not None:
            self._held.extend(updates)
            if not any(r.pool == service.pool.uuid for u in updates if not u.snapshot for r in u.added):
                return
            updates, self._held = self._held, None
        for update in updates:
            service.apply_registry(update)

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        """Record where a task's CuPy result's kernels end when it is stored; forget it when it leaves memory.

        Runs in Dask's state machine on the event loop, for every key; only a
        result just computed here (``executing`` -> ``memory``) is looked at.
        """
        events = self._task_events
        if events is None:
            return
        if start == "executing" and finish == "memory":
            worker = self._worker
            if worker is None:
                return
            data = worker.data  # its in-memory part, without unspilling: dask-cuda's device buffer, a SpillBuffer's
            for part in ("device_buffer", "fast"):
                data = getattr(data, part, data)
            try:
                value = data[key]
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
            _receive.uninstall(*self._receive)
            self._receive = None
        if self._push is not None:
            self._push.stop()
            self._push = None
        if self._task_events is not None:
            self._task_events.clear()
            self._task_events = None
        for op, handler in ((REGISTRY_OP, self._on_registry_update), (MEMBERSHIP_OP, self._on_membership)):
            if worker.stream_handlers.get(op) == handler:
                # Not deleted: a message already in flight would hit an unknown op, and an
                # unknown op ends the worker's whole scheduler stream. Late messages are dropped.
                worker.stream_handlers[op] = _drop_update
        count_own_memory_only(worker, undo=True)
        fill_after_read(worker, undo=True)
        install_lease_query_handler(worker, None)
        original = self._get_data
        self._get_data = None
        if callable(original) and getattr(worker.handlers.get("get_data"), "__wrapped__", None) is original:
            worker.handlers["get_data"] = cast("Callable[..., Any]", original)
        service, self.service = self.service, None
        self._worker, self._held = None, None
        if service is None:
            return
        stream = getattr(worker, "batched_stream", None)
        key = service.registry_key
        if worker.status == Status.running and stream is not None and not stream.closed() and key is not None:
            # The plugin goes while the worker stays: take the row out, over this worker's own stream
            # (ahead of any later registration on it). A closing worker sends nothing; the scheduler
            # drops its rows when it leaves.
            with contextlib.suppress(Exception):
                stream.send({"op": UNREGISTER_OP, "pool": service.pool.uuid, "key": key})
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


def _check_row(record: PoolRecord, address: str) -> None:
    """Check this worker's registry row as the scheduler will (:meth:`PoolRecord.from_msg`) before it is sent.

    A row the scheduler refuses would leave the worker without a pool, and ``register_plugin`` waiting out the
    connect timeout and returning with no error: the scheduler answers no refusal, since a registration may come
    from another worker in this one's name. A row Dask cannot even send (a broker under a temporary directory whose
    path is not UTF-8) broke the worker's stream to the scheduler, and the worker closed.

    Raises
    ------
    PoolUnavailableError
        Naming the worker and what in its row the scheduler would refuse; its setup fails with it.
    """
    try:
        PoolRecord.from_msg(record.to_msg())
    except ProtocolError as e:
        raise PoolUnavailableError(
            f"worker {address}: the scheduler would refuse this worker's pool registration: {e}"
        ) from None


def _listen_scheme(worker: Worker) -> str | None:
    """The scheme of the comm ``worker``'s peers reach it over (``"tcp"``, ``"ucxx"``, ...); ``None`` if unknown."""
    from distributed.comm import parse_address

    try:
        return str(parse_address(worker.address)[0])
    except Exception:
        return None


def _segment_memory_line(options: PoolOptions, kind: str, made_of: str, over_ucx: bool) -> str:
    """``stats()["routing"]["segment-memory"]``: what a ``kind`` pool's segments are made of (``made_of``), and why."""
    if kind != "device":
        return f"none: a {kind} pool has no segments"
    if options.segment_memory != "auto":
        return f"{made_of} (gpupool.segment-memory)"
    if made_of == "legacy" and over_ucx:
        return "legacy (auto): this worker listens over UCX, which sends legacy IPC memory with no staging copy"
    if made_of == "legacy":
        return "legacy (auto): this GPU exports no virtual memory as POSIX fds"
    why = "this GPU shares no memory by IPC handle" if over_ucx else "this worker does not listen over UCX"
    return f"vmm (auto): {why}"


def _staging_line(kind: str, has_cupy: bool, over_tcp: bool) -> str:
    """``stats()["routing"]["staging"]``: whether plain CuPy results are staged into the pool, and why (not)
    (:func:`dask_gpupool.tuning.stage_threshold`)."""
    if kind != "device":
        return f"off: a {kind} pool stages no CuPy results"
    if not has_cupy:
        return "off: CuPy is not installed"
    threshold = tuning.stage_threshold(kind, over_tcp)
    if not threshold:
        return "off: over UCX, UCX copies plain CuPy arrays GPU to GPU"
    return f"on: plain CuPy results of {format_bytes(threshold)} or more are staged into the pool for same-host workers"


def _default_stream_recorder(device: int | None) -> Callable[[], Any]:
    """``record()`` for :class:`TaskEvents`: a new cuda.core event on GPU ``device``'s default stream, now.

    Its ``sync()`` sleeps rather than spins (:func:`~dask_gpupool.memory.topology.sleeping_event`): an export waits on
    it for as long as the task's kernels run.
    """

    def record() -> Any:
        return sleeping_event(current_gpu(device).default_stream)

    return record


def _wants_event(service: PoolService, stage_threshold: int) -> Callable[[Any], bool]:
    """Which stored task results get an event (:class:`TaskEvents`): CuPy arrays of ``stage_threshold`` bytes or
    more (staged after it; 0: none for that reason), and any over this worker's pool memory, whatever its size (a
    pool Buffer, an array over one): their export waits for that event rather than for the whole GPU
    (``gpupool.handoff-ordering: sync``)."""
    pool = service.pool

    def wanted(value: Any) -> bool:
        if isinstance(value, Buffer):
            return pool.owns(value)
        if not is_cupy_array(value):
            return False
        nbytes = int(value.nbytes)
        if stage_threshold and nbytes >= stage_threshold:
            return True
        return bool(nbytes) and pool_buffer_of(value) is not None

    return wanted
