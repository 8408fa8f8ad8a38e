"""The ``"dask"``-family serializers of cuda.core Buffers and NumPy and CuPy arrays, and the count of pickled copies.

Registered for cuda.core ``Buffer`` and for NumPy and CuPy arrays (the latter
only those made over pool buffers with :func:`~dask_gpupool.dask.views.as_array`;
every other array keeps distributed's own serializer, which these delegate
to) by :func:`~dask_gpupool.dask.registration.register_serializers`.

**Which path.** A value goes as an IPC descriptor only when it is being sent
in answer to a worker's ``get_data`` (the worker's ``get_data`` is wrapped, so
the requesting worker is known: :data:`~dask_gpupool.dask.context.REQUEST`,
read once by each serializer Dask calls here and passed on), the requester is
a registered worker on the same host in another process, the comm is TCP, TLS
or UCX, the memory lies in this worker's pool, and the requester can reach it
(see :meth:`PoolService.plan`). Everything else - other hosts, a client's
gather, the scheduler relaying one, spilling to disk, the same process - gets
a host copy in the frames, which a receiving worker lands in its own pool so
that it can be handed on again. Copies to a worker over ``tcp`` from
:data:`~dask_gpupool.tuning.COPY_STREAM_THRESHOLD` up are not put in the
frames: the receiver pulls them from the sender's copy server, chunked and
pipelined (:mod:`dask_gpupool.transport.stream`).

**UCX comms** ask first for distributed's ``"cuda"`` family: device Buffers
and CuPy arrays get the serializers of :mod:`dask_gpupool.dask.cuda_family`
there (handed over, or device frames; never a host copy).

**Sub-header** and **failure**: :mod:`dask_gpupool.dask.headers`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from cuda.core import Buffer

from dask_gpupool.dask.context import REQUEST, Request
from dask_gpupool.dask.headers import KEY, hand_over, loads_array
from dask_gpupool.dask.plain_arrays import plain, sent_as_copy
from dask_gpupool.dask.views import VIEWS, c_strides, described, viewed_buffer
from dask_gpupool.handoff.active import active_services
from dask_gpupool.memory.buffers import buffer_kind, copy_to_host, host_buffer
from dask_gpupool.wire.handoff import ArrayMeta, HandoffHeader

__all__ = ["array_serializers", "count_pickled", "reduce_buffer", "serialize_buffer"]

logger = logging.getLogger(__name__)

Serialized = tuple[dict[str, Any], list[Any]]


def serialize_buffer(buf: Buffer, context: Any = None) -> Serialized:
    """The ``"dask"`` serializer of a cuda.core ``Buffer``: handed over, streamed, or a host copy in the frames."""
    return _dumps(REQUEST.get(), buf, buf, None, None, lambda: copy_to_host(buf, 0, buf.size), (0, int(buf.size)))


def array_serializers(
    module: str, pointer: Callable[[Any], int], previous_dumps: Any, previous_loads: Any
) -> tuple[Callable[..., Serialized], Callable[[dict[str, Any], list[Any]], Any]]:
    """The ``"dask"`` serializer and deserializer of ``module``'s arrays (``"numpy"`` or ``"cupy"``).

    ``pointer(x)`` is the address of ``x``'s data; ``previous_dumps(x, context)`` and ``previous_loads(header,
    frames)`` are distributed's own, which every array over no pool buffer (and every header without :data:`KEY`)
    goes to.
    """

    def serialize(x: Any, context: Any = None) -> Serialized:
        request = REQUEST.get()
        if not VIEWS:  # no array over a pool buffer in this process: staged, or distributed's serializer
            return plain(request, x, module, previous_dumps, context)
        return _dumps_array(request, x, module, pointer(x), previous_dumps, context)

    def deserialize(header: dict[str, Any], frames: list[Any]) -> Any:
        return loads_array(header, frames, previous_loads)

    serialize.__name__ = serialize.__qualname__ = f"serialize_{module}"
    deserialize.__name__ = deserialize.__qualname__ = f"deserialize_{module}"
    return serialize, deserialize


def count_pickled(request: Request | None, serialized: Serialized) -> Serialized:
    """What distributed's ``"pickle"`` family made of a value (``serialized``), counted when it goes in ``request``'s
    reply (``None``: not a ``get_data`` reply); the family is wrapped for it
    (:func:`~dask_gpupool.dask.distributed_seam.workers.count_pickled_copies`).

    An object none of the ``"dask"`` serializers knows is pickled, and the arrays in it (pool memory or not) go
    as out-of-band frames: a copy between same-host workers that no serializer of ours sees
    (:meth:`Request.count_copy <dask_gpupool.dask.context.Request.count_copy>`, ``pickled``: pool memory
    or not, the bytes go in the frames; a value with no buffer in it is not counted), in ``copied_out_bytes`` here
    and in the receiving worker's ``copied_bytes`` (:func:`~dask_gpupool.dask.plain_arrays.sent_as_copy`). The
    frames on the wire are unchanged.
    """
    header, frames = serialized
    if request is not None and len(frames) > 1:
        nbytes = sum(memoryview(f).nbytes for f in frames[1:])
        request.count_copy("pickled", nbytes)
        return sent_as_copy(request, nbytes, (header, frames))
    return header, frames


def _dumps(
    request: Request | None,
    holder: Any,
    buf: Buffer,
    ipc_meta: ArrayMeta | None,
    copy_meta: ArrayMeta | None,
    host_frame: Any,
    span: tuple[int, int] | None,
    value: Any = None,
) -> tuple[dict[str, Any], list[Any]]:
    """Hand ``buf`` over (IPC) when ``request`` (the ``get_data`` reply, or ``None``) allows it, else copy.

    A copy is streamed (:mod:`dask_gpupool.transport.stream`) when ``span``,
    the ``(offset, nbytes)`` of ``buf`` that holds the value contiguously, is
    given and the request allows it; otherwise ``host_frame()`` gives the
    bytes for Dask's frames. ``value``: what Dask is serializing (an array
    over ``buf``; default ``holder``), for its task's event
    (:func:`hand_over`).
    """
    service = request.service if request is not None else None
    if service is not None and request is not None:
        handed = hand_over(request, holder, buf, ipc_meta, value)
        if handed is not None:
            return {KEY: handed.to_msg()}, []
        if span is not None:
            row = service.routes.stream_route(request.requester, request.scheme, span[1])
            if row is not None:
                header = service.exports.export_stream(holder, buf, span[0], span[1], row, copy_meta)
                request.granted.extend((header.lease, *header.lanes))
                return {KEY: header.to_msg()}, []
    frame = host_frame()
    nbytes = memoryview(frame).nbytes
    if service is not None:
        service.handoffs.add(copied_out_bytes=nbytes)
    exporter = service.record.worker if service is not None else ""
    header = HandoffHeader("copy", buffer_kind(buf), nbytes, exporter=exporter, array=copy_meta)
    return {KEY: header.to_msg()}, [frame]


def _dumps_array(
    request: Request | None, arr: Any, module: str, ptr: int, previous: Any, context: Any
) -> tuple[dict[str, Any], list[Any]]:
    """Hand an array over a pool buffer over (or copy it) in ``request``'s reply; any other array goes to
    :func:`~dask_gpupool.dask.plain_arrays.plain`.

    So does one whose dtype an array header does not describe (a structured dtype: :func:`~dask_gpupool.dask.views.
    described`), copied: the header's ``dtype.str`` would lose its fields.
    """
    buf = viewed_buffer(arr, ptr)
    if buf is None:
        return plain(request, arr, module, previous, context)
    if not described(arr):
        if request is None:
            return previous(arr, context)
        request.count_copy("structured-dtype", int(arr.nbytes))
        return sent_as_copy(request, int(arr.nbytes), previous(arr, context))
    shape, strides = tuple(arr.shape), tuple(arr.strides)

    def host_frame() -> Any:
        if module == "cupy":
            import cupy

            return memoryview(cupy.asnumpy(cupy.ascontiguousarray(arr))).cast("B")
        import numpy as np

        contiguous: Any = np.ascontiguousarray(arr)
        return memoryview(contiguous).cast("B")

    offset = ptr - int(buf.handle)
    ipc_meta = ArrayMeta(module, shape, strides, arr.dtype.str, offset)
    copy_meta = ArrayMeta(module, shape, c_strides(shape, arr.dtype), arr.dtype.str, 0)
    span = (offset, int(arr.nbytes)) if arr.flags.c_contiguous else None
    return _dumps(request, buf, buf, ipc_meta, copy_meta, host_frame, span, arr)


def reduce_buffer(buf: Buffer) -> Any:
    """Pickle a Buffer of a gpupool pool (this worker's own, or mapped from a peer) as a host copy of its bytes.

    User code that pickles a value (``pickle.dumps``, a task argument, ``client.run``'s result) must not get a
    descriptor of pool memory, which would outlive the lease that keeps it: cuda.core's own ``__reduce__``
    exports an IPC descriptor (and fails on the resources of ``host`` pools). Other Buffers keep it. Registered
    with ``copyreg`` (:func:`~dask_gpupool.dask.registration.register_serializers`).
    """
    resource = buf.memory_resource
    ours = type(resource).__module__.startswith("dask_gpupool.") or any(s.pool.owns(buf) for s in active_services())
    if not ours:
        return buf.__reduce__()
    return host_buffer, (copy_to_host(buf, 0, int(buf.size)),)
