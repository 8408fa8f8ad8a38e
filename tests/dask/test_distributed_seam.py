"""What the Dask seam (``dask_gpupool/dask/distributed_seam/``: ``workers.py``, ``scheduler.py``) patches, reads and
calls of distributed (and distributed-ucxx) is still there, as it is used.

One test per patch: each fails when a distributed release renames, re-signs or moves the handler, method,
attribute or module global the seam replaces or wraps (so the seam is revisited before a cluster breaks), and
the last one keeps every other library module off distributed's internals.
"""

from __future__ import annotations

import inspect
import pathlib
import re
from types import SimpleNamespace
from typing import Any

import pytest
from distributed.core import ConnectionPool, Server
from distributed.scheduler import Scheduler
from distributed.worker import Worker

from dask_gpupool.dask.distributed_seam import scheduler as scheduler_seam
from dask_gpupool.dask.distributed_seam import workers as seam

ROOT = pathlib.Path(__file__).parent.parent.parent
#: The modules that may use distributed's internals: the seam's.
SEAMS = tuple(
    p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "dask_gpupool/dask/distributed_seam").glob("*.py"))
)


def params(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_get_data_is_a_handler_of_that_name_taking_comm_keys_who_and_serializers():
    """``wrap_get_data`` replaces ``worker.handlers["get_data"]``, calls it as ``(comm, keys=, who=, **kwargs)`` and
    sets ``kwargs["serializers"]``."""
    assert params(Worker.get_data) == ["self", "comm", "keys", "who", "serializers"]
    assert '"get_data": self.get_data' in inspect.getsource(Worker.__init__)


def test_a_reply_is_written_by_comm_write_whose_offload_is_the_comms_allow_offload():
    """The reply's ``comm.write`` is wrapped per reply; ``comm.allow_offload`` decides Dask's offload thread."""
    from distributed.comm import utils
    from distributed.comm.core import Comm
    from distributed.comm.tcp import TCP

    assert params(TCP.write) == ["self", "msg", "serializers", "on_error"]
    assert "self.allow_offload = " in inspect.getsource(Comm.__init__)
    assert "allow_offload=self.allow_offload" in inspect.getsource(TCP.write)
    assert "OFFLOAD_THRESHOLD and allow_offload" in inspect.getsource(utils.to_frames)
    assert isinstance(Comm.peer_address, property) and callable(Comm.abort)


def test_a_workers_values_and_recorded_sizes_are_where_the_store_reads_them():
    """``DaskWorkerStore`` reads ``worker.data``'s ``fast`` part, ``worker.state.tasks[key].nbytes`` and
    ``distributed.comm.utils.OFFLOAD_THRESHOLD``."""
    import zict
    from distributed.comm import utils
    from distributed.spill import SpillBuffer
    from distributed.worker_state_machine import TaskState, WorkerState

    assert issubclass(SpillBuffer, zict.Buffer) and "self.fast = " in inspect.getsource(zict.Buffer.__init__)
    assert "nbytes" in TaskState.__dataclass_fields__
    assert "self.tasks = " in inspect.getsource(WorkerState.__init__)
    assert isinstance(utils.OFFLOAD_THRESHOLD, int)


def test_comm_reads_come_from_the_workers_connection_pool():
    """``fill_after_read`` wraps ``worker.rpc.connect`` (called ``(addr, timeout)``) and each comm's ``read``, and its
    ``write``: a worker fetches with ``get_data_from_worker``, which writes ``{"op": "get_data", "keys": ...}`` on a
    comm of ``rpc.connect`` and reads the reply (``{"status": "OK", "data": {key: value}}``) from it."""
    from distributed.comm.tcp import TCP
    from distributed.worker import get_data_from_worker

    assert params(ConnectionPool.connect) == ["self", "addr", "timeout"]
    assert "self.rpc = ConnectionPool(" in inspect.getsource(Server.__init__)
    assert params(TCP.read) == ["self", "deserializers"]
    source = inspect.getsource(get_data_from_worker)
    assert "await rpc.connect(worker)" in source and 'op="get_data"' in source and "keys=keys" in source
    assert "get_data_from_worker(" in inspect.getsource(Worker.gather_dep)
    assert 'msg = {"status": "OK", "data": {k: to_serialize(v) for k, v in data.items()}}' in inspect.getsource(
        Worker.get_data
    )


def test_a_failed_fetch_of_an_os_error_is_fetched_again_and_a_scheduler_plugin_can_err_its_dependents():
    """Dask fetches again after an ``OSError`` (``DataLostError``) and marks the key failed, never to be retried,
    after anything else (dask/distributed#6705); ``err_waiting_on`` reads ``scheduler.tasks`` and ``TaskState``,
    calls ``Scheduler.handle_task_erred`` as the ``task-erred`` stream handler (``worker``, ``run_id`` and
    ``error_message``'s fields) and sends the workers' ``free-keys``."""
    from distributed.core import error_message
    from distributed.scheduler import SchedulerState, TaskState
    from distributed.worker_state_machine import WorkerState

    from dask_gpupool.errors import DataLostError

    assert issubclass(DataLostError, OSError)
    assert "except OSError:" in inspect.getsource(Worker.gather_dep)
    assert "GatherDepNetworkFailureEvent" in inspect.getsource(Worker.gather_dep)
    assert '"error",' in inspect.getsource(WorkerState._handle_gather_dep_failure)  # the key errs, never retried
    assert '"task-erred": self.handle_task_erred' in inspect.getsource(Scheduler.__init__)
    assert params(Scheduler.handle_task_erred) == ["self", "key", "stimulus_id", "msg"]
    assert {"worker", "stimulus_id", "key", "run_id"} <= set(params(Scheduler.stimulus_task_erred))
    assert {"exception", "traceback", "exception_text", "traceback_text"} <= set(error_message(ValueError("x")))
    assert "self.tasks = " in inspect.getsource(SchedulerState.__init__)
    for slot in ("state", "who_has", "dependents", "processing_on", "run_id", "key"):
        assert hasattr(TaskState, slot), slot  # a slot or a property
    assert "self.stream_comms" in inspect.getsource(Scheduler.__init__)
    assert '"free-keys": self._handle_remote_stimulus(FreeKeysEvent)' in inspect.getsource(Worker.__init__)
    error = {k: v for k, v in error_message(DataLostError("lost")).items() if k != "status"}
    assert scheduler_seam.err_waiting_on(SimpleNamespace(tasks={}), "x", "w", "h", error) == []


def test_process_memory_is_sampled_by_the_monitors_get_process_memory():
    """``count_own_memory_only`` wraps ``worker.monitor.get_process_memory`` (no arguments, bytes)."""
    from distributed.system_monitor import SystemMonitor

    assert params(SystemMonitor.get_process_memory) == ["self"]
    assert "self.monitor = SystemMonitor(" in inspect.getsource(Server.__init__)
    assert "get_process_memory()" in inspect.getsource(SystemMonitor.update)


def test_servers_keep_their_handlers_in_dicts_by_op():
    """``set_handlers`` and ``set_stream_handlers`` add to ``server.handlers`` and ``server.stream_handlers``."""
    source = inspect.getsource(Server.__init__)
    assert "self.handlers = " in source and "self.stream_handlers = " in source
    server: Any = SimpleNamespace(handlers={"a": print}, stream_handlers={})
    seam.set_handlers(server, {"op": len})
    seam.set_stream_handlers(server, {"stream-op": len})
    assert server.handlers == {"a": print, "op": len} and server.stream_handlers == {"stream-op": len}
    seam.set_handlers(server, {"op": len}, remove=True)
    seam.set_stream_handlers(server, {"stream-op": len}, replaced_by=str)
    assert server.handlers == {"a": print} and server.stream_handlers == {"stream-op": str}


def test_worker_plugins_are_listed_on_the_scheduler_and_added_by_the_workers_ops():
    """``list_worker_plugin`` writes ``scheduler.worker_plugins``; ``plugin_message`` names the workers'
    ``plugin-add`` (``plugin``, ``name``) and ``plugin-remove`` (``name``) handlers, sent with ``broadcast``."""
    assert "self.worker_plugins = " in inspect.getsource(Scheduler.__init__)
    worker_init = inspect.getsource(Worker.__init__)
    assert '"plugin-add": self.plugin_add' in worker_init and '"plugin-remove": self.plugin_remove' in worker_init
    assert params(Worker.plugin_add)[:3] == ["self", "plugin", "name"] and params(Worker.plugin_remove) == [
        "self",
        "name",
    ]
    assert {"msg", "workers"} <= set(params(Scheduler.broadcast))
    add = scheduler_seam.plugin_message("gpupool", b"pickled")
    assert add == {"op": "plugin-add", "plugin": b"pickled", "name": "gpupool"}
    assert scheduler_seam.plugin_message("gpupool", None) == {"op": "plugin-remove", "name": "gpupool"}


def _application(handler: type) -> Any:
    """A server's HTTP application as distributed makes it (``RoutingApplication``), with ``/metrics`` served by
    ``handler``."""
    from distributed.http.routing import RoutingApplication

    return RoutingApplication([(r"/metrics", handler, {"dask_server": None})])


def test_metrics_are_served_by_a_route_of_the_servers_http_application():
    """``scope_metrics`` finds Dask's ``/metrics`` route in ``server.http_application`` (tornado's
    ``wildcard_router.rules``) and adds a subclass of its handler in front; the handler knows its server as
    ``self.server`` and serves the process's one Prometheus registry in ``get``."""
    pytest.importorskip("prometheus_client")
    from distributed.http.utils import RequestHandler
    from distributed.http.worker.prometheus import routes
    from distributed.http.worker.prometheus.core import PrometheusHandler

    from dask_gpupool.ops import metrics

    assert [r[0] for r in routes] == ["/metrics"] and routes[0][1] is PrometheusHandler
    assert "self.server = dask_server" in inspect.getsource(RequestHandler.initialize)
    assert "generate_latest()" in inspect.getsource(PrometheusHandler.get)
    from distributed.node import ServerNode

    assert "self.http_application = RoutingApplication(" in inspect.getsource(ServerNode.start_http_server)
    from tornado import httputil

    app = _application(PrometheusHandler)
    request = httputil.HTTPServerRequest(
        start_line=httputil.RequestStartLine("GET", "/metrics", "HTTP/1.1"),
        headers=httputil.HTTPHeaders({"Host": "localhost"}),
    )
    assert app.find_handler(request).handler_class is PrometheusHandler
    server = SimpleNamespace(http_application=app, address="tcp://127.0.0.1:1")
    assert seam.scope_metrics(server, "worker")
    chosen = app.find_handler(request)
    assert chosen.handler_class.__name__ == "GPUPoolScopedPrometheusHandler"
    assert issubclass(chosen.handler_class, PrometheusHandler) and chosen.handler_kwargs == {"dask_server": None}
    assert seam.scope_metrics(server, "worker")  # once per server
    assert app.find_handler(request).handler_class is chosen.handler_class
    with metrics.serving("worker", "tcp://127.0.0.1:1"):
        assert metrics._SERVING.get() == ("worker", "tcp://127.0.0.1:1")
    assert metrics._SERVING.get() is None


def test_the_dashboards_menu_is_the_plots_list_of_its_template_variables():
    """``serve_page`` adds "GPU Pool" to ``template_variables(scheduler)["plots"]`` (dicts with ``url`` and ``name``),
    memoized per scheduler, so that every page rendered afterwards shows it."""
    pytest.importorskip("bokeh")
    from distributed.dashboard import scheduler as dashboard

    assert params(dashboard.template_variables) == ["scheduler"]

    class FakeScheduler:  # what it reads of a scheduler; memoized by it (hashable)
        jupyter = False

    scheduler = FakeScheduler()
    plots = dashboard.template_variables(scheduler)["plots"]
    assert plots and all({"url", "name"} <= set(p) for p in plots)
    assert dashboard.template_variables(scheduler)["plots"] is plots  # memoized: the list every page shares
    assert "template_variables=template_variables(scheduler)" in inspect.getsource(dashboard.connect)


def test_serializer_families_are_a_table_of_dumps_loads_and_whether_dumps_takes_a_context():
    """``count_pickled_copies`` and ``ensure_first`` read ``families[name]`` as ``(dumps, loads, takes_context)`` and
    register wrappers with ``register_serialization_family(name, dumps, loads)``; theirs are in place.
    ``registered_family`` reads its keys: the package's ``gpupool-frames`` family is one once registered."""
    import distributed.protocol.cuda  # noqa: F401  (registers the "cuda" family)
    from distributed.protocol.serialize import families, register_serialization_family

    assert params(register_serialization_family) == ["name", "dumps", "loads"]
    for name in ("dask", "pickle", "cuda"):
        dumps, loads, takes_context = families[name]
        assert callable(dumps) and callable(loads) and isinstance(takes_context, bool), name
    assert getattr(families["pickle"][0], "__gpupool__", False)
    assert all(getattr(families[name][1], "__gpupool_cupy__", False) for name in ("dask", "cuda"))
    assert "gpupool-frames" in families and seam.registered_family("gpupool-frames")
    assert not seam.registered_family("no-such-family")


def test_distributeds_numpy_serializers_are_the_ones_ours_are_given():
    """Ours are registered in front of distributed's NumPy serializers, which take a ``context``."""
    import numpy as np
    from distributed.protocol import dask_serialize
    from distributed.protocol import numpy as distributed_numpy

    assert "context" in params(distributed_numpy.serialize_numpy_ndarray)
    assert params(distributed_numpy.deserialize_numpy_ndarray) == ["header", "frames"]
    assert dask_serialize.dispatch(np.ndarray).__name__ == "serialize_numpy"


def test_buffers_are_pickled_through_copyreg():
    """``pickle_buffers_as_copies`` puts ours in ``copyreg.dispatch_table`` for cuda.core ``Buffer``."""
    import copyreg

    from cuda.core import Buffer

    from dask_gpupool.dask.dask_family import reduce_buffer

    assert copyreg.dispatch_table[Buffer] is reduce_buffer


def test_distributed_ucxx_receives_device_frames_through_its_module_global_device_array():
    """``point_device_array`` replaces the comm module's ``device_array``, which its ``read`` calls per frame."""
    module = pytest.importorskip("distributed_ucxx.ucxx")
    assert hasattr(module, "device_array") and hasattr(module, "init_once") and hasattr(module.UCXX, "read")
    assert "device_array(" in inspect.getsource(module)  # called per frame, looked up as the module global


def _code_lines(path: pathlib.Path) -> dict[int, str]:
    """Each line of ``path`` as its code tokens joined, without strings (docstrings) or comments."""
    import io
    import tokenize

    lines: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type in (tokenize.NAME, tokenize.OP, tokenize.NUMBER):
            lines[token.start[0]] = lines.get(token.start[0], "") + token.string
    return lines


def test_a_failed_preload_plugin_setup_or_handler_is_logged_with_the_wording_and_loggers_the_filter_reads():
    """``seam.OneLine`` recognises distributed's records of a failed preload or plugin by their logger and their
    wording (``preload``, ``plugin``)."""
    import distributed.core
    import distributed.preloading
    import distributed.worker

    records = {
        "distributed.preloading": (distributed.preloading, "Failed to start preload"),
        "distributed.worker": (distributed.worker, "Worker plugin %s failed to setup"),
        "distributed.core": (distributed.core, "Exception while handling op %s"),
    }
    assert set(records) == set(seam.FAILURE_LOGGERS)
    for name, (module, wording) in records.items():
        assert module.logger.name == name
        assert f'logger.exception("{wording}' in inspect.getsource(module), (name, wording)


def test_no_other_library_module_patches_distributed():
    """Outside the seam's modules (and the test helpers in ``testing/``), no module
    replaces a handler, a comm method, a module global of distributed-ucxx, a serializer family or a route, nor lists a
    worker plugin."""
    patches = re.compile(
        r"\.(stream_)?handlers\[[^]]*\]=(?!=)|handlers\.update\("
        r"|\.(write|read|connect|get_process_memory|allow_offload|device_array)=(?!=)"
        r"|copyreg\.|families\[|importfamilies\b|\.families\b|add_handlers\(|worker_plugins|template_variables"
    )
    found = []
    for path in sorted((ROOT / "dask_gpupool").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative in SEAMS or relative.startswith("dask_gpupool/testing/"):
            continue
        found += [f"{relative}:{n}: {code}" for n, code in _code_lines(path).items() if patches.search(code)]
    assert not found, "\n".join(found)
    seam_code = "\n".join(line for s in SEAMS for line in _code_lines(ROOT / s).values())
    for patched in ("handlers[", "stream_handlers[", ".write=", ".read=", ".connect=", "get_process_memory="):
        assert patched in seam_code, patched  # the patterns still find what the seam does
    for patched in ("worker_plugins", "add_handlers(", "template_variables", "importfamilies"):
        assert patched in seam_code, patched
