"""Dask serializers that hand pool memory over in place between same-host workers.

Registered for cuda.core ``Buffer`` and for NumPy and CuPy arrays (the latter
only those made over pool buffers with :func:`as_array`; every other array
keeps distributed's own serializer, which these registrations delegate to).

**Which path.** A value goes as an IPC descriptor only when it is being sent
in answer to a worker's ``get_data`` (the plugin wraps that handler, so the
requesting worker is known: :data:`REQUEST`), the requester is a registered
worker on the same host in another process, the comm is TCP, TLS or UCX, the
memory lies in this worker's pool, and the requester can reach it (see
:meth:`Routes.plan <dask_gpupool.handoff.routes.Routes.plan>`). Everything else - other hosts, a client's gather,
the scheduler relaying one, spilling to disk, the same process -
gets a host copy in the frames, which a receiving worker lands in its own
pool so that it can be handed on again. Copies to a worker over ``tcp`` from
:data:`~dask_gpupool.tuning.COPY_STREAM_THRESHOLD` up are not put in the frames: the receiver
pulls them from the sender's copy server, chunked and pipelined
(:mod:`dask_gpupool.transport.stream`).

**UCX comms** ask first for distributed's ``"cuda"`` family: device Buffers
and CuPy arrays get the serializers of :mod:`dask_gpupool.dask.device_frames`
there (handed over, or device frames; never a host copy).

**Sub-header.** ``{"gpupool": HandoffHeader.to_msg()}``: msgpack-safe, never
pickled. Dask's own framing around it is unchanged.

**Failure.** ``loads`` never lets a bare CUDA error out: an import that fails
falls back to fetching a host copy from the exporter; only when the data is
gone does it raise :class:`~dask_gpupool.DataLostError` naming pool and worker.
"""

from __future__ import annotations

import copyreg
import logging
from typing import Any

from cuda.core import Buffer
from distributed.protocol import dask_deserialize, dask_serialize

from dask_gpupool.dask.plain_arrays import plain, received_copy, sent_as_copy
from dask_gpupool.dask.views import VIEWS, as_array, c_strides, described, read_only, viewed_buffer
from dask_gpupool.dask.worker_internals import REQUEST, Request, clear_tracebacks
from dask_gpupool.errors import DataLostError, PoolUnavailableError, ProtocolError
from dask_gpupool.handoff.active import active_service, active_services
from dask_gpupool.handoff.deferred import SENDER
from dask_gpupool.memory.buffers import buffer_kind, copy_to_host, host_buffer
from dask_gpupool.wire.handoff import HEADER_KEY, ArrayMeta, HandoffHeader

__all__ = ["KEY", "deserialize_buffer", "hand_over", "loads_array", "register_cupy"]

KEY = HEADER_KEY

logger = logging.getLogger(__name__)


# -- who asked: the get_data context ---------------------------------------------------


# -- which pool buffer an array lies in ---------------------------------------------------


# -- array views over Buffers ------------------------------------------------------------


# -- the serializers -----------------------------------------------------------------


def _dumps(
    holder: Any,
    buf: Buffer,
    ipc_meta: ArrayMeta | None,
    copy_meta: ArrayMeta | None,
    host_frame: Any,
    span: tuple[int, int] | None,
    value: Any = None,
) -> tuple[dict[str, Any], list[Any]]:
    """Hand ``buf`` over (IPC) when the request allows it, else copy.

    A copy is streamed (:mod:`dask_gpupool.transport.stream`) when ``span``,
    the ``(offset, nbytes)`` of ``buf`` that holds the value contiguously, is
    given and the request allows it; otherwise ``host_frame()`` gives the
    bytes for Dask's frames. ``value``: what Dask is serializing (an array
    over ``buf``; default ``holder``), for its task's event
    (:func:`hand_over`).
    """
    request = REQUEST.get()
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


def hand_over(
    request: Request, holder: Any, buf: Buffer, meta: ArrayMeta | None, value: Any = None
) -> HandoffHeader | None:
    """The header of a zero-copy handoff of ``buf`` to ``request``'s requester, or ``None`` to copy.

    A buffer of this worker's pool is exported under a lease
    (:meth:`Exports.export_ipc <dask_gpupool.handoff.exports.Exports.export_ipc>`);
    one this worker imported is passed on as its exporter's memory
    (:meth:`Forwarder.forward <dask_gpupool.handoff.forwarding.Forwarder.forward>`:
    its resource knows its origin). The lease goes in ``request`` to be
    settled when the reply ends. A same-host fallback is counted. When
    ``value`` (what Dask serializes: an array over ``buf``; default
    ``holder``) is a task result of this worker whose event is known, the
    export waits for that event only (:meth:`Request.task_event
    <dask_gpupool.dask.worker_internals.Request.task_event>`).
    """
    service = request.service
    origin = getattr(buf.memory_resource, "origin", None)
    if origin is not None:
        header = service.forwarder.forward(origin, request.requester, request.scheme, meta)
        if header is not None:
            request.forwarded.append((header.exporter, header.lease))
        return header
    row, _reason = service.routes.plan(request.requester, request.scheme, buf)
    if row is None:
        return None
    written_by = request.task_event(holder if value is None else value)
    header = service.exports.export_ipc(holder, buf, row, meta, written_by=written_by)
    request.granted.append(header.lease)
    return header


def data_lost(raw_header: Any, e: Exception) -> DataLostError:
    """The :class:`DataLostError` every failure to receive a handed-over value is raised as.

    :class:`DataLostError` is a ``ConnectionError``. Dask 2026.8 leaves a
    task waiting forever when a deserializer raises anything else (its
    ``gather_dep`` turns other errors into a failed dependency that is never
    retried), while for an ``OSError`` it treats the transfer as failed and
    fetches the key again, from the same worker or another, or has it
    recomputed. The exporter then sends this worker copies
    (:meth:`Exports.settle <dask_gpupool.handoff.exports.Exports.settle>`), so the retry succeeds.
    """
    exporter = raw_header.get("exporter", "?") if isinstance(raw_header, dict) else "?"
    return DataLostError(f"a value from worker {exporter} could not be received: {type(e).__name__}: {e}")


def _receive(header: HandoffHeader, frames: list[Any], need: str) -> Buffer:
    """The Buffer a header and its frames describe, in this process.

    ``need``: ``"host"`` or ``"device"`` when the value must be readable there
    (a NumPy or CuPy array), else ``"any"``. A ``copy`` comes with one frame of
    exactly ``nbytes`` bytes (:class:`ProtocolError` otherwise). Callers raise
    its failures as :func:`data_lost`.
    """
    service = active_service()
    if header.path == "ipc":
        if service is None:
            raise PoolUnavailableError(
                f"a handoff from {header.exporter} reached a process without a gpupool pool; "
                "it should have been sent as a copy"
            )
        return service.importer.import_handoff(header, SENDER.get())
    if header.path == "stream":
        if service is None:
            raise PoolUnavailableError(
                f"a streamed copy from {header.exporter} reached a process without a gpupool pool; "
                "it should have been sent in the frames"
            )
        return service.importer.copies.pull_copy(header, need)
    data = frames[0] if frames else b""
    if len(frames) > 1 or memoryview(data).nbytes != header.nbytes:
        # distributed merges split frames before a deserializer runs: anything else is a malformed message, and the
        # bytes it holds are not the value (a Buffer of another size, silently)
        raise ProtocolError(
            f"a copy of {header.nbytes} bytes from {header.exporter} came with {len(frames)} frame(s) of "
            f"{[memoryview(f).nbytes for f in frames]} bytes"
        )
    if service is not None:
        return service.importer.copies.receive_copy(header.kind, data, header.exporter, need)
    return host_buffer(bytearray(data))  # a client: host memory it owns


@dask_serialize.register(Buffer)
def _serialize_buffer(buf: Buffer, context: Any = None) -> tuple[dict[str, Any], list[Any]]:
    return _dumps(buf, buf, None, None, lambda: copy_to_host(buf, 0, buf.size), (0, int(buf.size)))


@dask_deserialize.register(Buffer)
def deserialize_buffer(header: dict[str, Any], frames: list[Any]) -> Buffer:
    raw = header.get(KEY)
    try:
        return _receive(HandoffHeader.from_msg(raw), frames, "any")
    except DataLostError:
        raise
    except Exception as e:
        raise data_lost(raw, e) from e


def _dumps_array(arr: Any, module: str, ptr: int, previous: Any, context: Any) -> tuple[dict[str, Any], list[Any]]:
    """Hand an array over a pool buffer over (or copy it); any other array goes to ``previous(arr, context)``.

    So does one whose dtype an array header does not describe (a structured dtype: :func:`~dask_gpupool.dask.views.
    described`), copied: the header's ``dtype.str`` would lose its fields.
    """
    buf = viewed_buffer(arr, ptr)
    if buf is None:
        return plain(arr, module, previous, context)
    if not described(arr):
        request = REQUEST.get()
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
    return _dumps(buf, buf, ipc_meta, copy_meta, host_frame, span, arr)


def loads_array(header: dict[str, Any], frames: list[Any], previous: Any) -> Any:
    if KEY not in header:
        received_copy(header)
        return previous(header, frames)
    try:
        h = HandoffHeader.from_msg(header[KEY])
        meta = h.array
        if meta is None:
            raise ProtocolError("handoff header of an array carries no array shape")
        buf = _receive(h, frames, "device" if meta.module == "cupy" else "host")
        return _array_over(h, meta, buf)  # an array that does not fit the buffer is lost too
    except DataLostError:
        raise
    except Exception as e:
        buf = None
        clear_tracebacks(e)  # an import goes now (its lease with it), not with the traceback
        raise data_lost(header[KEY], e) from e


def _array_over(h: HandoffHeader, meta: ArrayMeta, buf: Buffer) -> Any:
    """The NumPy or CuPy array ``meta`` describes over ``buf`` (owned by the array from then on)."""
    if meta.module == "numpy" or buf.is_device_accessible:
        arr = as_array(buf, meta.shape, meta.dtype, meta.strides, meta.offset, like=meta.module)
        if h.path == "ipc" and meta.module == "numpy" and arr.flags.writeable:
            # the producer's memory, shared (an import's view is read-only already; this is a value of this worker's
            # own pool that came back): tasks must not write their inputs, nor make them writable again
            return read_only(arr)
        return arr
    # A CuPy array that landed in host memory (a client, or a host pool without a GPU).
    host = as_array(buf, meta.shape, meta.dtype, meta.strides, meta.offset, like="numpy")
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy.asarray(host)
    except Exception:
        pass
    return read_only(host) if h.path == "ipc" and host.flags.writeable else host  # the producer's memory, as above


def _with_context(fn: Any) -> Any:
    """``fn`` as ``f(x, context)``, whether or not it takes ``context`` (decided once, not per call:
    ``inspect.signature`` cost 15 µs per array, eight times distributed's own NumPy serializer)."""
    from dask.utils import has_keyword

    if has_keyword(fn, "context"):
        return lambda x, context: fn(x, context=context)
    return lambda x, context: fn(x)


def _register_numpy() -> None:
    import numpy as np
    from distributed.protocol import numpy as _distributed_numpy  # noqa: F401  (its registrations first)

    previous_dumps = _with_context(dask_serialize.dispatch(np.ndarray))
    previous_loads = dask_deserialize.dispatch(np.ndarray)

    def serialize_numpy(x: Any, context: Any = None) -> tuple[dict[str, Any], list[Any]]:
        if not VIEWS:  # no array over a pool buffer in this process: staged, or distributed's serializer
            return plain(x, "numpy", previous_dumps, context)
        return _dumps_array(x, "numpy", int(x.__array_interface__["data"][0]), previous_dumps, context)

    def deserialize_numpy(header: dict[str, Any], frames: list[Any]) -> Any:
        return loads_array(header, frames, previous_loads)

    dask_serialize.register(np.ndarray)(serialize_numpy)
    dask_deserialize.register(np.ndarray)(deserialize_numpy)


#: "no", "registering" (a dispatch inside the registration re-enters it) or "yes".
_cupy_registered = "no"


def register_cupy() -> None:
    """Register the CuPy serializers now (a GPU worker's setup calls this when CuPy is installed).

    Otherwise they are registered lazily, on the first CuPy array Dask
    serializes or deserializes. A failed registration is not marked done: the
    next dispatch retries it and raises the error.
    """
    global _cupy_registered
    if _cupy_registered != "no":
        return
    _cupy_registered = "registering"
    try:
        _register_cupy_now()
    except BaseException:
        _cupy_registered = "no"
        raise
    _cupy_registered = "yes"


def _register_cupy_now() -> None:
    import cupy
    from distributed.protocol import cupy as _distributed_cupy  # noqa: F401  (its registrations first)

    previous_dumps = _with_context(dask_serialize.dispatch(cupy.ndarray))
    previous_loads = dask_deserialize.dispatch(cupy.ndarray)

    def serialize_cupy(x: Any, context: Any = None) -> tuple[dict[str, Any], list[Any]]:
        if not VIEWS:  # no array over a pool buffer in this process: staged, or distributed's serializer
            return plain(x, "cupy", previous_dumps, context)
        return _dumps_array(x, "cupy", int(x.data.ptr), previous_dumps, context)

    def deserialize_cupy(header: dict[str, Any], frames: list[Any]) -> Any:
        return loads_array(header, frames, previous_loads)

    dask_serialize.register(cupy.ndarray)(serialize_cupy)
    dask_deserialize.register(cupy.ndarray)(deserialize_cupy)

    from distributed.protocol.cuda import cuda_deserialize, cuda_serialize

    previous_cuda_dumps = cuda_serialize.dispatch(cupy.ndarray)
    previous_cuda_loads = cuda_deserialize.dispatch(cupy.ndarray)

    # device_frames imports this module: when it is the one being imported (``import cupy`` came first),
    # it is not complete yet here, so its functions are looked up at the first call.
    def cuda_dumps(x: Any) -> tuple[dict[str, Any], list[Any]]:
        from dask_gpupool.dask.device_frames import cuda_dumps_cupy

        return cuda_dumps_cupy(x, previous_cuda_dumps)

    def cuda_loads(header: dict[str, Any], frames: list[Any]) -> Any:
        from dask_gpupool.dask.device_frames import cuda_loads_cupy

        return cuda_loads_cupy(header, frames, previous_cuda_loads)

    cuda_serialize.register(cupy.ndarray)(cuda_dumps)
    cuda_deserialize.register(cupy.ndarray)(cuda_loads)


def _reduce_buffer(buf: Buffer) -> Any:
    """Pickle a Buffer of a gpupool pool (this worker's own, or mapped from a peer) as a host copy of its bytes.

    User code that pickles a value (``pickle.dumps``, a task argument, ``client.run``'s result) must not get a
    descriptor of pool memory, which would outlive the lease that keeps it: cuda.core's own ``__reduce__``
    exports an IPC descriptor (and fails on the resources of ``host`` pools). Other Buffers keep it.
    """
    resource = buf.memory_resource
    ours = type(resource).__module__.startswith("dask_gpupool.") or any(s.pool.owns(buf) for s in active_services())
    if not ours:
        return buf.__reduce__()
    return host_buffer, (copy_to_host(buf, 0, int(buf.size)),)


def _count_pickled() -> None:
    """Wrap distributed's ``"pickle"`` family so that what it sends in a ``get_data`` reply is counted.

    An object none of the ``"dask"`` serializers knows is pickled, and the arrays in it (pool memory or not) go
    as out-of-band frames: a copy between same-host workers that no serializer of ours sees
    (:meth:`Request.count_copy <dask_gpupool.dask.worker_internals.Request.count_copy>`, ``pickled``: pool memory
    or not, the bytes go in the frames; a value with no buffer in it is not counted), in ``copied_out_bytes`` here
    and in the receiving worker's ``copied_bytes`` (:func:`~dask_gpupool.dask.plain_arrays.sent_as_copy`). The
    frames on the wire are unchanged.
    """
    from distributed.protocol.serialize import families, register_serialization_family

    dumps, loads, _ = families["pickle"]
    if getattr(dumps, "__gpupool__", False):
        return

    def pickle_dumps(x: Any, context: Any = None) -> tuple[dict[str, Any], list[Any]]:
        header, frames = dumps(x, context=context)
        request = REQUEST.get()
        if request is not None and len(frames) > 1:
            nbytes = sum(memoryview(f).nbytes for f in frames[1:])
            request.count_copy("pickled", nbytes)
            return sent_as_copy(request, nbytes, (header, frames))
        return header, frames

    def pickle_loads(header: Any, frames: list[Any]) -> Any:
        received_copy(header)
        return loads(header, frames)

    pickle_dumps.__gpupool__ = True  # type: ignore[attr-defined]
    register_serialization_family("pickle", pickle_dumps, pickle_loads)


def _register_sizeof() -> None:
    from dask.sizeof import sizeof

    @sizeof.register(Buffer)
    def _sizeof_buffer(buf: Buffer) -> int:
        return int(buf.size)

    try:
        from dask_cuda.is_device_object import is_device_object
    except ImportError:
        return

    @is_device_object.register(Buffer)
    def _is_device_buffer(buf: Buffer) -> bool:
        return bool(buf.is_device_accessible and not buf.is_host_accessible)


# -- UCX comms: device frames -------------------------------------------------------


def _register() -> None:
    from dask_gpupool.dask.device_objects import register_device_objects

    _register_numpy()
    _register_sizeof()
    copyreg.pickle(Buffer, _reduce_buffer)
    _count_pickled()
    register_device_objects()
    import sys

    if sys.modules.get("cupy") is not None:  # imported already (None: an import that is blocked)
        register_cupy()
    else:
        # Replaces distributed's lazy hooks for CuPy with ours, which run theirs first.
        from distributed.protocol.cuda import cuda_deserialize, cuda_serialize

        for dispatch in (dask_serialize, dask_deserialize, cuda_serialize, cuda_deserialize):
            dispatch.register_lazy("cupy")(register_cupy)
        _register_cupy_when_seen()


def _register_cupy_when_seen() -> None:
    """Wrap distributed's ``"dask"`` and ``"cuda"`` families so that ours are CuPy's serializers once CuPy is imported.

    The lazy hooks (:func:`_register`) run only if CuPy's first dispatch finds no serializer registered for
    ``cupy.ndarray``. But importing ``distributed.protocol.cupy`` registers distributed's directly (a user's import,
    or distributed's own lazy hook of another family), and a dispatch then finds those and never runs ours: a
    client's read of a pool array's header then reached distributed's deserializer (``KeyError: 'shape'``). So each
    serialization and deserialization of these two families first registers ours when CuPy is imported and they
    are not yet (:func:`register_cupy`; a string compare otherwise).
    """
    import sys

    from distributed.protocol.serialize import families, register_serialization_family

    def ensure_cupy() -> None:
        if _cupy_registered == "no" and sys.modules.get("cupy") is not None:
            register_cupy()

    for name in ("dask", "cuda"):
        dumps, loads, takes_context = families[name]
        if getattr(loads, "__gpupool_cupy__", False):
            continue

        def checked_loads(header: Any, frames: list[Any], loads: Any = loads) -> Any:
            ensure_cupy()
            return loads(header, frames)

        if takes_context:

            def checked_dumps(x: Any, context: Any = None, dumps: Any = dumps) -> Any:
                ensure_cupy()
                return dumps(x, context=context)

        else:

            def checked_dumps(x: Any, dumps: Any = dumps) -> Any:  # type: ignore[misc]
                ensure_cupy()
                return dumps(x)

        checked_loads.__gpupool_cupy__ = True  # type: ignore[attr-defined]
        register_serialization_family(name, checked_dumps, checked_loads)


_register()
