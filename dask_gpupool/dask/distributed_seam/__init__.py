"""The Dask seam: every patch of distributed's (and distributed-ucxx's) internals, in one place, each with why.

Every other module of the package uses public API only (plugins, ``Dispatch.register``,
``register_serialization_family``, ``Server.rpc``, ``prometheus_client.REGISTRY``);
``tests/dask/test_distributed_seam.py`` has a test per patch that fails when distributed changes what is patched,
and one that fails when a module outside this package patches distributed. Two modules, by process:

- :mod:`~dask_gpupool.dask.distributed_seam.workers`: in workers and every server, and at import in any process;
- :mod:`~dask_gpupool.dask.distributed_seam.scheduler`: on the scheduler.

The patches (``PATCH``: replaced or wrapped; ``READ``: only read; ``CALL``: a method that is no public API), each
with the public API that is missing:

``workers.wrap_get_data``
    PATCH ``worker.handlers["get_data"]``, the reply's ``comm.write`` and ``comm.allow_offload``: no hook around a
    ``get_data`` reply, serializers are not told who asked, no per-message offload choice.
``workers.DaskWorkerStore``
    READ ``worker.data``'s in-memory part, ``worker.state.tasks``, ``distributed.comm.utils.OFFLOAD_THRESHOLD``: no
    API reads a value without unspilling it, or tells whether a message will be offloaded.
``workers.fill_after_read``
    PATCH ``worker.rpc.connect`` and the ``read`` and ``write`` of each comm it opens: no hook runs on a new comm,
    nor after a read before Dask sees the message, and nothing tells a read which request it answers.
``workers.count_own_memory_only``
    PATCH ``worker.monitor.get_process_memory``: no way to discount the pages of peers' pools a process maps.
``workers.set_handlers``, ``workers.set_stream_handlers``
    PATCH ``server.handlers`` and ``server.stream_handlers``: plugins have no API to add a handler.
``workers.point_device_array``, ``workers.restore_device_array``, ``workers.device_array``
    PATCH (and READ) distributed-ucxx's module global ``device_array``: no option for where device frames are
    received.
``workers.scope_metrics``
    PATCH the ``/metrics`` route of ``server.http_application``: a collector is not told which server is scraped.
``workers.OneLine``
    READ the loggers and wording of distributed's records of a failed preload, plugin setup or handler: no API shapes
    how distributed logs a plugin's exception (a :class:`~dask_gpupool.errors.GPUPoolError` is made one line).
``workers.pickle_buffers_as_copies``
    PATCH ``copyreg`` for cuda.core ``Buffer``: its own ``__reduce__`` exports an IPC descriptor that would outlive
    the lease keeping the memory.
``workers.count_pickled_copies``, ``workers.ensure_first``, ``workers.registered_family``
    READ ``distributed.protocol.serialize.families`` (and wrap the ``"pickle"``, ``"dask"`` and ``"cuda"`` families
    with ``register_serialization_family``): no hook counts what a family copies or runs on a module's import, and
    no API tells whether a family is registered.
``scheduler.list_worker_plugin``, ``scheduler.listed_worker_plugin``, ``scheduler.plugin_message``
    PATCH (and READ) ``scheduler.worker_plugins``, and send the workers' ``plugin-add`` and ``plugin-remove`` ops:
    ``Scheduler.register_worker_plugin`` lists and broadcasts in one call, waiting for every worker.
``scheduler.err_waiting_on``
    READ ``scheduler.tasks``; CALL ``Scheduler.handle_task_erred`` and send the workers' ``free-keys``: no public
    API lets a plugin fail a task (dask/distributed#6705).
``scheduler.serve_page``
    PATCH the scheduler's ``http_application`` routes and the dashboard's menu (``template_variables``' ``plots``):
    ``distributed.scheduler.http.routes`` is read only at start.
"""
