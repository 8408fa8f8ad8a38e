"""The Dask seam in workers and every server: what the package patches and reads of distributed's (and
distributed-ucxx's) internals there, each with the public API it stands in for.

Part of :mod:`~dask_gpupool.dask.distributed_seam` (which lists every patch), under its rules: each ``PATCH`` names
the public API that is missing, ``READ`` marks internals only read, and ``tests/dask/test_distributed_seam.py``
fails when distributed changes what is used. Sections: a worker's ``get_data`` and values, its comm reads, memory
monitor and handlers (put back by each ``undo`` path when its plugin is removed); every server's handlers,
``/metrics`` and log records of a failed preload or plugin; and, in any process at import
(:mod:`~dask_gpupool.dask.registration`), serializer families and ``copyreg``.
"""

from __future__ import annotations

import copyreg
import inspect
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cuda.core import Buffer
from distributed.comm import parse_address

from dask_gpupool.dask import dask_family
from dask_gpupool.dask.comms import read_then_fill, requests_noted
from dask_gpupool.dask.context import REQUEST, Request, clear_tracebacks
from dask_gpupool.dask.plain_arrays import received_copy
from dask_gpupool.errors import GPUPoolError
from dask_gpupool.handoff.registry import active_service
from dask_gpupool.memory.lifetime import peer_resident_bytes
from dask_gpupool.ops import metrics

if TYPE_CHECKING:
    from distributed import Worker

    from dask_gpupool.dask.replies import Replies

__all__ = [
    "DaskWorkerStore",
    "OneLine",
    "count_own_memory_only",
    "count_pickled_copies",
    "device_array",
    "ensure_first",
    "fill_after_read",
    "one_line_failures",
    "pickle_buffers_as_copies",
    "point_device_array",
    "registered_family",
    "restore_device_array",
    "said",
    "scope_metrics",
    "set_handlers",
    "set_stream_handlers",
    "unwrap_get_data",
    "wrap_get_data",
]

logger = logging.getLogger(__name__)

# -- worker: get_data ---------------------------------------------------------------------------------------------


def wrap_get_data(worker: Worker, replies: Replies) -> Any:
    """Wrap ``worker``'s ``get_data`` handler so that serializers know the requester; returns Dask's (to put back).

    PATCH ``worker.handlers["get_data"]``: no hook around a ``get_data`` reply, and serializers are not told who
    asked (:mod:`~dask_gpupool.dask.context`). PATCH the reply's ``comm.write``: :data:`~dask_gpupool.dask.context.
    REQUEST` is set only while it runs, since Dask reads the keys first and unspilling one may evict others to disk,
    serialized right there (a descriptor on disk, under a lease nobody claims). PATCH ``comm.allow_offload`` (no
    per-message API): cleared for a reply serialized on the event loop (:meth:`Replies.inline
    <dask_gpupool.dask.replies.Replies.inline>`). A failed reply's traceback frames are cleared: Dask logs it and
    keeps the record, whose frames would keep the reply's values, and so pool memory, alive.
    """
    original = worker.handlers["get_data"]

    async def get_data(comm: Any, keys: Any = (), who: str | None = None, **kwargs: Any) -> Any:
        try:
            scheme = parse_address(comm.peer_address)[0]
        except Exception:
            scheme = ""
        request, inline = replies.open(keys, who, comm, scheme, getattr(comm, "allow_offload", False))
        restore_write = _request_while_writing(comm, request)
        if inline:
            comm.allow_offload = False
        if kwargs.get("serializers") is None:
            families = replies.serializers(request)
            if families is not None:
                kwargs["serializers"] = families
        start = time.perf_counter()
        ok = False
        try:
            result = await original(comm, keys=keys, who=who, **kwargs)
            ok = True  # Dask returns normally only once it has read the requester's "OK"
            return result
        except BaseException as e:
            clear_tracebacks(e)  # also those of its context: distributed-ucxx raises while handling UCX's error
            raise
        finally:
            restore_write()
            if inline:
                comm.allow_offload = True
            replies.close(request, ok, start)

    get_data.__wrapped__ = original  # type: ignore[attr-defined]
    worker.handlers["get_data"] = get_data
    return original


def unwrap_get_data(worker: Worker, original: Callable[..., Any] | None) -> None:
    """Put Dask's ``get_data`` handler (``original``: :func:`wrap_get_data`'s) back, if ours is still there."""
    current = worker.handlers.get("get_data")
    if original is not None and getattr(current, "__wrapped__", None) is original:
        worker.handlers["get_data"] = current.__wrapped__  # type: ignore[union-attr]


def _request_while_writing(comm: Any, request: Request) -> Callable[[], None]:
    """Set :data:`REQUEST` only while ``comm`` writes; returns what puts ``comm.write`` back."""
    own, write = "write" in vars(comm), comm.write

    async def write_reply(*args: Any, **kwargs: Any) -> Any:
        token = REQUEST.set(request)
        try:
            return await write(*args, **kwargs)
        finally:
            REQUEST.reset(token)

    comm.write = write_reply

    def restore() -> None:
        if own:
            comm.write = write
        else:
            del comm.write

    return restore


class DaskWorkerStore:
    """A worker's values, read without unspilling (READ ``worker.data``'s in-memory part, ``worker.state.tasks``,
    ``distributed.comm.utils.OFFLOAD_THRESHOLD``: no public API reads a value without unspilling it, or tells
    whether a message will be offloaded)."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    def values_in_memory(self, keys: Any) -> list[Any] | None:
        """The values of ``keys`` in memory, or ``None`` if one is not (spilled: a SpillBuffer's ``fast`` part)."""
        data = getattr(self._worker.data, "fast", self._worker.data)
        try:
            return [data[key] for key in keys]
        except KeyError:
            return None

    def stored(self, key: Any) -> Any:
        """The value of ``key`` in memory (dask-cuda's ``device_buffer``, a SpillBuffer's ``fast``), or ``KeyError``."""
        data = self._worker.data
        for part in ("device_buffer", "fast"):
            data = getattr(data, part, data)
        return data[key]

    def offloaded(self, keys: Any) -> bool:
        """Whether Dask would offload a reply of ``keys``: their recorded size (its ``sizeof``) passes the threshold."""
        from distributed.comm import utils

        threshold = utils.OFFLOAD_THRESHOLD
        if not threshold:
            return False
        tasks = self._worker.state.tasks
        return sum((ts.nbytes or 0) for k in keys if (ts := tasks.get(k)) is not None) > threshold


# -- worker: reads, memory, handlers ------------------------------------------------------------------------------


def fill_after_read(worker: Worker, bind: Callable[[Any, str], Any] | None = None, *, undo: bool = False) -> None:
    """Make each comm ``worker`` opens ``bind`` it (:mod:`~dask_gpupool.dask.comms`) and run deferred copies in a
    thread once a read returns (:func:`~dask_gpupool.dask.comms.read_then_fill`); ``undo=True`` puts Dask's
    ``connect`` back. PATCH ``worker.rpc.connect`` and each comm's ``read``: no hook runs on a new comm, nor after a
    read, before Dask sees the message (deserializers run inside it); and its ``write``, which notes the keys a
    ``get_data`` request asks for (:func:`~dask_gpupool.dask.comms.requests_noted`): nothing tells a read which
    request it answers. ``bind`` (``bind(comm, peer)``) runs each time Dask hands a comm out."""
    rpc = getattr(worker, "rpc", None)
    current = getattr(rpc, "connect", None)
    if rpc is None or current is None:
        return
    if undo:
        if getattr(current, "__wrapped__", None) is not None:
            del rpc.connect  # the class's method again
        return
    if getattr(current, "__wrapped__", None) is not None:
        return  # already wrapped

    async def connect(addr: str, timeout: float | None = None) -> Any:
        comm = await current(addr, timeout)
        bind is None or await bind(comm, addr)  # comms.bind: once per comm
        if not getattr(comm.read, "gpupool_fills", False):  # kept after undo: without copies it does nothing
            comm.read = read_then_fill(comm, comm.read, addr)
            comm.write = requests_noted(comm, comm.write)
        return comm

    connect.__wrapped__ = current  # type: ignore[attr-defined]
    rpc.connect = connect


def count_own_memory_only(worker: Worker, *, undo: bool = False) -> None:
    """Make the process memory Dask reads for ``worker`` leave out the pages of peer pools it maps
    (:func:`~dask_gpupool.memory.lifetime.peer_resident_bytes`); ``undo=True`` puts Dask's own method back.

    PATCH ``worker.monitor.get_process_memory``: Dask takes the process's ``rss`` (pause threshold, spilling, what
    the dashboard shows) with no way to discount pages the process maps but does not own (the kernel counts a shared
    page in every process that touched it). The nanny reads ``rss`` itself: see ``spilling.borrowed_pages_check``.
    """
    monitor = getattr(worker, "monitor", None)
    current = getattr(monitor, "get_process_memory", None)
    if monitor is None or current is None:
        return
    if undo:
        if getattr(current, "__wrapped__", None) is not None:
            monitor.get_process_memory = current.__wrapped__
        return
    if getattr(current, "__wrapped__", None) is not None:
        return  # already wrapped

    def get_process_memory() -> int:
        return max(current() - peer_resident_bytes(), 0)

    get_process_memory.__wrapped__ = current  # type: ignore[attr-defined]
    monitor.get_process_memory = get_process_memory


def set_handlers(server: Any, handlers: dict[str, Any], *, remove: bool = False) -> None:
    """Add ``handlers`` to ``server``'s (a worker's or the scheduler's) RPC handlers; ``remove=True`` removes each
    one still there. PATCH ``server.handlers``: plugins have no API to add an RPC handler."""
    for op, handler in handlers.items():
        if not remove:
            server.handlers[op] = handler
        elif server.handlers.get(op) == handler:
            del server.handlers[op]


def set_stream_handlers(server: Any, handlers: dict[str, Any], *, replaced_by: Any = None) -> None:
    """Put ``handlers`` in ``server``'s batched-stream handlers; with ``replaced_by``, put that in place of each one
    still there instead (never deleted: an unknown op ends the whole stream; late messages must be dropped).
    PATCH ``server.stream_handlers``: plugins have no API to add a stream handler."""
    for op, handler in handlers.items():
        if replaced_by is None:
            server.stream_handlers[op] = handler
        elif server.stream_handlers.get(op) == handler:
            server.stream_handlers[op] = replaced_by


def device_array(module: Any) -> Any:
    return module.device_array  # READ distributed-ucxx's module global (``module``: its comm module)


def point_device_array(module: Any, device_array: Callable[[int], Any]) -> Any:
    """Point ``module.device_array`` at ``device_array``; returns what was there. PATCH distributed-ucxx's module
    global: it receives every device frame into ``rmm.DeviceBuffer(size=n)`` of RMM's current resource, with no
    option (:mod:`~dask_gpupool.dask.ucx_receive`)."""
    previous = module.device_array
    module.device_array = device_array
    return previous


def restore_device_array(module: Any, owner: Any, previous: Any) -> None:
    """Put ``previous`` back as ``module.device_array`` if a method of ``owner`` is still the one there (a later
    installer's is left alone)."""
    if getattr(module.device_array, "__self__", None) is owner:
        module.device_array = previous


# -- /metrics --------------------------------------------------------------------------------------------------------

_scoped_lock = threading.Lock()
_scoped_apps: weakref.WeakSet[Any] = weakref.WeakSet()
_scoped_classes: dict[tuple[type, str], type] = {}


def scope_metrics(server: Any, role: str) -> bool:
    """Route ``server``'s own ``/metrics`` (``role``: ``"worker"`` or ``"scheduler"``) through a subclass of Dask's
    handler that tells the collectors which server asks (:func:`dask_gpupool.ops.metrics.serving`); once per server,
    ``False`` where it has none.

    PATCH the ``/metrics`` route of ``server.http_application``: Dask serves ``prometheus_client``'s one registry on
    every server of the process, and ``collect()`` is not told which one asks. Tornado tries handlers added later
    first, so the scoped route (Dask's path, arguments and behaviour) answers in place of Dask's, on this server only.
    """
    from tornado import routing, web

    app = getattr(server, "http_application", None)
    if app is None:
        return False
    with _scoped_lock:
        if app in _scoped_apps:
            return True
        routes = []
        for rule in getattr(getattr(app, "wildcard_router", None), "rules", []):
            matcher, target = rule.matcher, rule.target
            if (
                isinstance(matcher, routing.PathMatches)
                and matcher.regex.pattern.rstrip("$").endswith("/metrics")
                and isinstance(target, type)
                and issubclass(target, web.RequestHandler)
            ):
                routes.append((matcher.regex.pattern, _scoped(target, role), rule.target_kwargs))
        if not routes:
            return False
        app.add_handlers(".*$", routes)
        _scoped_apps.add(app)
    return True


def _scoped(base: type, role: str) -> type:
    """``base`` (Dask's ``/metrics`` handler) telling the collectors, while it serves, which server asks."""
    key = (base, role)
    if key not in _scoped_classes:

        class Scoped(base):
            async def get(self, *args: Any, **kwargs: Any) -> None:
                with metrics.serving(role, str(getattr(self.server, "address", None))):
                    result = super().get(*args, **kwargs)
                    if inspect.isawaitable(result):
                        await result

        Scoped.__name__ = Scoped.__qualname__ = f"GPUPoolScoped{base.__name__}"
        _scoped_classes[key] = Scoped
    return _scoped_classes[key]


# -- every server: distributed's records of a failed preload or plugin ---------------------------------------------

#: distributed's loggers that log a failed preload, plugin setup or handler with its traceback.
FAILURE_LOGGERS = ("distributed.preloading", "distributed.worker", "distributed.core")

#: Errors logged in a line of this package's own already: distributed's record of them is left out.
_SAID: weakref.WeakSet[BaseException] = weakref.WeakSet()


def said(error: BaseException) -> None:
    """``error`` has been logged in one line, before it is raised on: distributed's record of it is left out."""
    if isinstance(error, GPUPoolError):  # the ones the filter looks at (and weakly referable: builtins are not)
        _SAID.add(error)


class OneLine(logging.Filter):
    """A record of a :class:`GPUPoolError` from a preload or plugin, made one line (or left out: :func:`said`).

    distributed logs an exception that leaves a preload (``Failed to start preload``), a worker plugin's ``setup``
    (``Worker plugin gpupool failed to setup``) or a handler such as ``register_scheduler_plugin`` (``Exception while
    handling op``) with its traceback, on every process it reaches. A :class:`GPUPoolError`'s own text says what is
    wrong and what to do, so its record becomes ``<distributed's message>: ConfigError: ...``. Any other exception
    keeps its traceback: it is no failure this package expects. READ the wording of those records (``preload``,
    ``plugin``): no API shapes how distributed logs a plugin's exception.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, GPUPoolError):
            return True
        text = record.getMessage()
        if "preload" not in text and "plugin" not in text:
            return True  # another of distributed's records (a task's, a transfer's): as distributed logs it
        if error in _SAID:
            return False
        record.msg, record.args = f"{text}: {type(error).__name__}: {error}", ()
        record.exc_info, record.exc_text = None, None
        return True


def one_line_failures() -> None:
    """Put :class:`OneLine` on distributed's loggers of this process (:data:`FAILURE_LOGGERS`), once. Idempotent."""
    for name in FAILURE_LOGGERS:
        failures = logging.getLogger(name)
        if not any(isinstance(f, OneLine) for f in failures.filters):
            failures.addFilter(OneLine())


# -- serializers --------------------------------------------------------------------------------------------------


def pickle_buffers_as_copies() -> None:
    """PATCH ``copyreg`` for cuda.core ``Buffer``: its own ``__reduce__`` exports an IPC descriptor, which would
    outlive the lease that keeps the memory (:func:`~dask_gpupool.dask.dask_family.reduce_buffer`)."""
    copyreg.pickle(Buffer, dask_family.reduce_buffer)


def count_pickled_copies() -> None:
    """PATCH (READ ``distributed.protocol.serialize.families``): the ``"pickle"`` family wrapped so that what it sends
    in a reply, and receives, is counted (:func:`~dask_gpupool.dask.dask_family.count_pickled`); frames unchanged."""
    from distributed.protocol.serialize import families, register_serialization_family

    dumps, loads, _ = families["pickle"]
    if getattr(dumps, "__gpupool__", False):
        return

    def pickle_dumps(x: Any, context: Any = None) -> tuple[dict[str, Any], list[Any]]:
        return dask_family.count_pickled(REQUEST.get(), dumps(x, context=context))

    def pickle_loads(header: Any, frames: list[Any]) -> Any:
        received_copy(header, active_service())
        return loads(header, frames)

    pickle_dumps.__gpupool__ = True  # type: ignore[attr-defined]
    register_serialization_family("pickle", pickle_dumps, pickle_loads)


def registered_family(name: str) -> bool:
    """Whether a serialization family ``name`` is registered (READ ``distributed.protocol.serialize.families``: no
    public API tells)."""
    from distributed.protocol.serialize import families

    return name in families


def ensure_first(module: str, ensure: Callable[[], None]) -> None:
    """PATCH (READ ``distributed.protocol.serialize.families``): the ``"dask"`` and ``"cuda"`` families wrapped, with
    ``register_serialization_family``, to call ``ensure()`` first once ``module`` is imported (CuPy's registration,
    :func:`~dask_gpupool.dask.registration.register_cupy`: no hook runs on a module's import, and lazy hooks only
    while no serializer of the type is registered). Until then a call costs a ``sys.modules`` lookup."""
    from distributed.protocol.serialize import families, register_serialization_family

    for name in ("dask", "cuda"):
        dumps, loads, takes_context = families[name]
        if getattr(loads, "__gpupool_cupy__", False):
            continue

        def checked_dumps(x: Any, context: Any = None, dumps: Any = dumps, takes: bool = takes_context) -> Any:
            if sys.modules.get(module) is not None:  # imported (None: an import that is blocked)
                ensure()
            return dumps(x, context=context) if takes else dumps(x)

        def checked_loads(header: Any, frames: list[Any], loads: Any = loads) -> Any:
            if sys.modules.get(module) is not None:
                ensure()
            return loads(header, frames)

        checked_loads.__gpupool_cupy__ = True  # type: ignore[attr-defined]
        register_serialization_family(name, checked_dumps, checked_loads)
