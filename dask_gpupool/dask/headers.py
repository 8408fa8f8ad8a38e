"""What the ``"dask"`` and ``"cuda"`` families share: a value handed over as a handoff header, and what a received
header becomes.

A value handed over goes as ``{KEY: HandoffHeader.to_msg()}`` (:data:`KEY`): msgpack-safe, never pickled; Dask's own
framing around it is unchanged. :func:`hand_over` makes the header of a zero-copy handoff (an export under a lease,
or an import passed on as its exporter's memory); :func:`receive` turns a received header and its frames back into
a Buffer of this process (an import, a streamed pull, or a copy landed in the pool), and :func:`loads_array` and
:func:`buffer_from_header` are the deserializers both families use for such headers.

**Failure.** A deserializer never lets a bare CUDA error out: an import that fails falls back to fetching a host copy
from the exporter; only when the data is gone does it raise :class:`~dask_gpupool.DataLostError` naming the worker
(:func:`data_lost`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cuda.core import Buffer

from dask_gpupool.dask.context import Request, clear_tracebacks
from dask_gpupool.dask.plain_arrays import received_copy
from dask_gpupool.dask.views import as_array, read_only
from dask_gpupool.errors import DataLostError, NotAMemberError, PoolUnavailableError, ProtocolError
from dask_gpupool.handoff.active import active_service
from dask_gpupool.handoff.deferred import SENDER
from dask_gpupool.memory.buffers import host_buffer
from dask_gpupool.wire.handoff import HEADER_KEY, ArrayMeta, HandoffHeader

if TYPE_CHECKING:
    from dask_gpupool.handoff.service import PoolService

__all__ = ["KEY", "buffer_from_header", "data_lost", "hand_over", "loads_array", "receive"]

#: The sub-header key of a handed-over (or copied) value: ``{KEY: HandoffHeader.to_msg()}``.
KEY = HEADER_KEY


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
    <dask_gpupool.dask.context.Request.task_event>`).
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


def receive(header: HandoffHeader, frames: list[Any], need: str, service: PoolService | None) -> Buffer:
    """The Buffer a header and its frames describe, in this process.

    ``need``: ``"host"`` or ``"device"`` when the value must be readable there
    (a NumPy or CuPy array), else ``"any"``. A ``copy`` comes with one frame of
    exactly ``nbytes`` bytes (:class:`ProtocolError` otherwise). Callers raise
    its failures as :func:`data_lost`. ``service``: this process's (``None``: a client).

    An ``ipc`` or ``stream`` header is taken only inside a read of a comm this worker bound to the member that
    answers on it (:data:`~dask_gpupool.handoff.deferred.SENDER`, :mod:`~dask_gpupool.dask.binding`): one that
    arrives any other way (scattered by a client, in any other message) is refused with
    :class:`~dask_gpupool.errors.NotAMemberError` before anything is mapped or pulled.
    """
    if header.path in ("ipc", "stream"):
        what = "handoff" if header.path == "ipc" else "streamed copy"
        if service is None:
            raise PoolUnavailableError(
                f"a {what} from {header.exporter} reached a process without a gpupool pool; "
                "it should have been sent as a copy"
            )
        sender = SENDER.get()
        if sender is None:
            raise NotAMemberError(
                f"a {what} header naming {header.exporter} came outside a member's get_data reply; not taken"
            )
        if header.path == "ipc":
            return service.importer.import_handoff(header, sender)
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


def buffer_from_header(header: dict[str, Any], frames: list[Any]) -> Buffer:
    """The Buffer a ``{KEY: HandoffHeader}`` header and its frames describe (the caller owns it); every failure, a
    malformed header included, raised as :func:`data_lost`."""
    raw = header.get(KEY)
    try:
        return receive(HandoffHeader.from_msg(raw), frames, "any", active_service())
    except DataLostError:
        raise
    except Exception as e:
        raise data_lost(raw, e) from e


def loads_array(header: dict[str, Any], frames: list[Any], previous: Any) -> Any:
    """The NumPy or CuPy array a ``{KEY: HandoffHeader}`` header and its frames describe (over a Buffer the array
    owns), or ``previous(header, frames)`` for any other header (distributed's own deserializer); every failure of
    ours raised as :func:`data_lost`."""
    service = active_service()
    if KEY not in header:
        received_copy(header, service)
        return previous(header, frames)
    try:
        h = HandoffHeader.from_msg(header[KEY])
        meta = h.array
        if meta is None:
            raise ProtocolError("handoff header of an array carries no array shape")
        buf = receive(h, frames, "device" if meta.module == "cupy" else "host", service)
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
