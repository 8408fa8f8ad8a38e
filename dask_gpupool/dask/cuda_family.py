"""Serializers of distributed's ``"cuda"`` family: what comms that carry device frames (UCX) get.

Pool memory asked for by a same-host worker that can map it goes as an IPC
descriptor, as over TCP, at every size. Otherwise
device frames that the comm moves GPU to GPU: pool memory is first copied
into memory UCX can export (:mod:`dask_gpupool.memory.ucx_staging`), except
below :data:`~dask_gpupool.tuning.UCX_STAGING_THRESHOLD`, where it goes as it is for UCX's own
small-message protocol. The staging copy is not waited for when the comm is
distributed-ucxx's, which synchronizes the GPU before it sends device frames
(the staging memory keeps the pool memory alive meanwhile). Other CuPy arrays
go as distributed's own frames, which UCX copies GPU to GPU.

The one exception to "device frames": a CuPy array (pool memory or not) or a
pool Buffer under :data:`~dask_gpupool.tuning.UCX_HOST_FRAME_THRESHOLD` (8 KiB) that is not
handed over goes to a worker running the plugin as one host frame
(:mod:`dask_gpupool.dask.ucx_host_frames`).

Registered by :func:`~dask_gpupool.dask.registration.register_serializers` (Buffers) and
:func:`~dask_gpupool.dask.registration.register_cupy` (:func:`cupy_serializers`). Each serializer Dask calls
here reads :data:`~dask_gpupool.dask.context.REQUEST` once and passes the request on; each deserializer reads
:data:`~dask_gpupool.handoff.deferred.SENDER` and the active service once.

Counted in ``device_frames_out_bytes``, ``device_staged_bytes``,
``device_frames_bytes``, ``host_frames_out_bytes`` and ``host_frames_bytes``.

Ownership of what a reply sends: each device frame keeps its memory alive (a
:class:`_DeviceFrame` its owner: the staging block or the pool buffer; a CuPy
array its memory), and the reply's :class:`~dask_gpupool.dask.context.Request`
holds every device frame these serializers give it (:func:`_noted`) until the
reply ends. Then they are dropped when the requester's "OK" came, and parked
otherwise (:meth:`~dask_gpupool.dask.context.Request.settle_frames`):
the requester's UCX may still be reading them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cuda.core import Buffer

from dask_gpupool import tuning
from dask_gpupool.dask.context import (
    REQUEST,
    SYNCHRONIZED_DEVICE,
    SYNCHRONIZING_SCHEMES,
    Request,
    clear_tracebacks,
)
from dask_gpupool.dask.dask_family import KEY, buffer_from_header, data_lost, hand_over, loads_array
from dask_gpupool.dask.plain_arrays import warn_once
from dask_gpupool.dask.ucx_host_frames import (
    HOST_FRAME_KEY,
    buffer_from_host_frame,
    cupy_from_host_frame,
    host_frame,
    host_frame_reply,
)
from dask_gpupool.dask.views import VIEWS, c_strides, device_of, viewed_buffer
from dask_gpupool.errors import DataLostError, ProtocolError
from dask_gpupool.handoff.deferred import SENDER
from dask_gpupool.handoff.registry import active_service
from dask_gpupool.memory.buffers import copy_to_host
from dask_gpupool.memory.ucx_staging import UcxStaging
from dask_gpupool.wire.handoff import ArrayMeta

if TYPE_CHECKING:
    from dask_gpupool.handoff.service import PoolService

__all__ = ["cupy_serializers", "deserialize_buffer", "serialize_buffer", "staged_cupy_header"]

logger = logging.getLogger(__name__)


class _DeviceFrame:
    """A range of device memory as a frame that a UCX comm sends GPU to GPU.

    distributed-ucxx sends a frame from device memory when it has
    ``__cuda_array_interface__`` (and takes its size from ``nbytes``). The
    frame keeps ``owner`` alive until the comm lets go of it.
    """

    def __init__(self, ptr: int, nbytes: int, owner: Any) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
            "stream": None,  # written on the legacy default stream and synchronized before the comm sees it
        }
        self.nbytes = nbytes
        self.owner = owner


def serialize_buffer(buf: Buffer) -> tuple[dict[str, Any], list[Any]]:
    """The ``"cuda"`` serializer of a device ``Buffer`` (comms that carry device frames: UCX); its device frames noted
    in the reply (:func:`_noted`)."""
    request = REQUEST.get()
    return _noted(request, _cuda_serialize_pool_buffer(request, buf))


def deserialize_buffer(header: dict[str, Any], frames: list[Any]) -> Buffer:
    """The ``"cuda"`` family's deserializer of a Buffer (:func:`_cuda_deserialize_buffer`); every failure, a
    malformed header included, raised as :func:`_frame_lost`. The caller owns the Buffer returned."""
    try:
        return _cuda_deserialize_buffer(header, frames)
    except DataLostError:
        raise
    except Exception as e:
        raise _frame_lost(e, SENDER.get()) from e


def cuda_dumps_cupy(x: Any, previous: Any) -> tuple[dict[str, Any], list[Any]]:
    """A CuPy array for a comm that carries device frames (:func:`_dumps_cupy`); its device frames noted in the reply
    (:func:`_noted`). ``previous(x)``: distributed's own ``"cuda"`` serializer of CuPy arrays."""
    request = REQUEST.get()
    return _noted(request, _dumps_cupy(request, x, previous))


def cuda_loads_cupy(header: dict[str, Any], frames: list[Any], previous: Any) -> Any:
    """The ``"cuda"`` deserializer of CuPy arrays: a handed-over array, a host frame copied to the GPU, or
    ``previous(header, frames)`` (distributed's own, counted)."""
    if KEY in header:
        return loads_array(header, frames, previous)
    if HOST_FRAME_KEY in header:
        try:
            return cupy_from_host_frame(header, frames, active_service())
        except Exception as e:  # malformed, or no GPU memory for the copy: Dask fetches again (_frame_lost)
            raise _frame_lost(e, SENDER.get()) from e
    arr = previous(header, frames)
    _count_device_frames(active_service(), int(arr.nbytes), staged=False, out=False)
    return arr


def cupy_serializers(
    previous_dumps: Any, previous_loads: Any
) -> tuple[Callable[[Any], tuple[dict[str, Any], list[Any]]], Callable[[dict[str, Any], list[Any]], Any]]:
    """The ``"cuda"`` serializer and deserializer of CuPy arrays over distributed's own (``previous_dumps(x)``,
    ``previous_loads(header, frames)``), for :func:`~dask_gpupool.dask.registration.register_cupy`."""

    def cuda_dumps(x: Any) -> tuple[dict[str, Any], list[Any]]:
        return cuda_dumps_cupy(x, previous_dumps)

    def cuda_loads(header: dict[str, Any], frames: list[Any]) -> Any:
        return cuda_loads_cupy(header, frames, previous_loads)

    return cuda_dumps, cuda_loads


def _hand_over_on_device_comm(
    request: Request | None, holder: Any, buf: Buffer, meta: ArrayMeta | None, value: Any = None
) -> dict[str, Any] | None:
    """The header of a zero-copy handoff when a same-host worker asked for ``buf`` over a UCX comm (``request``),
    else ``None``.

    ``value``: what Dask serializes (an array over ``buf``), for its task's event (:func:`hand_over`).

    At every size. Counts the fallback reason when a same-host peer could not have it zero-copy.
    """
    if request is None:
        return None
    header = hand_over(request, holder, buf, meta, value)
    return None if header is None else {KEY: header.to_msg()}


def _service(request: Request | None) -> PoolService | None:
    """The service of the ``get_data`` reply being serialized (``request``), else this process's active one."""
    return request.service if request is not None else active_service()


def _unstaged(request: Request | None, nbytes: int, buf: Any) -> bool:
    """Whether pool memory of ``nbytes`` in ``buf`` goes to UCX as it is in ``request``'s reply: below
    :data:`~dask_gpupool.tuning.UCX_STAGING_THRESHOLD`, or at any size when ``buf`` is in this worker's own segments
    of legacy IPC memory, which UCX's ``cuda_ipc`` exports itself (``gpupool.segment-memory: legacy``; memory
    imported from a peer cannot be exported again)."""
    service = _service(request)
    if service is None:
        return False
    if nbytes < tuning.UCX_STAGING_THRESHOLD:
        return True
    return service.pool.segment_memory == "legacy" and service.pool.owns(buf)


def _comm_synchronizes(request: Request | None) -> bool:
    """Whether the comm of ``request``'s reply synchronizes the worker's GPU before it sends device frames, so that
    a staging copy need not be waited for here (anything else, or no reply: it must be). distributed-ucxx
    synchronizes device 0 of the process: a worker on another ordinal waits itself."""
    return (
        request is not None
        and request.scheme in SYNCHRONIZING_SCHEMES
        and (request.service.pool.device or 0) == SYNCHRONIZED_DEVICE
    )


def _count_device_frames(service: PoolService | None, nbytes: int, *, staged: bool, out: bool) -> None:
    """Count device frames of ``nbytes`` sent (``out``) or received in ``service``'s stats (``None``: nothing)."""
    if service is None:
        return
    if out:
        service.handoffs.add(device_frames_out_bytes=nbytes, device_staged_bytes=nbytes if staged else 0)
    else:
        service.handoffs.add(device_frames_bytes=nbytes)


def _timed_stage(request: Request | None, start: float, staged: UcxStaging, copied: float | None = None) -> None:
    """Time the staging of ``request``'s reply for its service's stats (``timings``): ``device-stage`` from ``start``
    to ``copied`` (or now), ``device-stage-alloc`` when the staging memory was newly allocated, ``device-serialize``
    from ``copied`` to now (distributed's serializer of the staged array)."""
    if request is None:
        return
    now = time.perf_counter()
    handoffs = request.service.handoffs
    handoffs.timed("device-stage", (copied if copied is not None else now) - start)
    if staged.alloc_s:
        handoffs.timed("device-stage-alloc", staged.alloc_s)
    if copied is not None:
        handoffs.timed("device-serialize", now - copied)


def _noted(request: Request | None, serialized: tuple[dict[str, Any], list[Any]]) -> tuple[dict[str, Any], list[Any]]:
    """``serialized`` (a header and frames for ``request``'s reply), its device frames noted in the reply
    (:meth:`~dask_gpupool.dask.context.Request.sending`), which holds them until it ends."""
    if request is not None:
        request.sending(serialized[1])
    return serialized


def _cuda_serialize_pool_buffer(request: Request | None, buf: Buffer) -> tuple[dict[str, Any], list[Any]]:
    """A device ``Buffer`` for comms that carry device frames (the ``"cuda"`` family: UCX), in ``request``'s reply.

    To a same-host worker that can map it: an IPC descriptor, as over TCP.
    Otherwise one device frame, copied first into memory UCX can send GPU to
    GPU (:class:`~dask_gpupool.memory.ucx_staging.UcxStaging`; counted in ``device_frames_out_bytes`` and
    ``device_staged_bytes``), never a host copy; except under
    :data:`~dask_gpupool.tuning.UCX_HOST_FRAME_THRESHOLD` to a worker running the plugin,
    where it goes as one host frame (UCX's eager protocol would bounce it
    through the host too) and lands in the receiver's pool. Host memory,
    and empty buffers, go on to the ``"dask"`` family (a host frame).
    """
    if not buf.is_device_accessible or buf.is_host_accessible or not buf.size:
        raise NotImplementedError("host memory goes in a host frame")
    nbytes = int(buf.size)
    handed = _hand_over_on_device_comm(request, buf, buf, None)
    if handed is not None:
        return handed, []
    service = host_frame_reply(request, nbytes)
    if service is not None:  # one host frame, copied by the driver on the legacy default stream
        frame = copy_to_host(buf, 0, nbytes)
        service.handoffs.add(host_frames_out_bytes=nbytes)
        return {HOST_FRAME_KEY: True, "nbytes": nbytes}, [frame]
    if _unstaged(request, nbytes, buf):  # UCX moves it as it is (small, or legacy IPC memory)
        _count_device_frames(_service(request), nbytes, staged=False, out=True)
        return {"nbytes": nbytes}, [_DeviceFrame(int(buf.handle), nbytes, buf)]
    start = time.perf_counter()
    try:
        wait = not _comm_synchronizes(request)
        staged = UcxStaging.copy_of(int(buf.handle), nbytes, device_of(buf), source=buf, wait=wait)
    except Exception as e:  # no device memory for the copy: the pool memory itself (UCX's slow path, still right)
        _staging_failed(e)
        _count_device_frames(_service(request), nbytes, staged=False, out=True)
        return {"nbytes": nbytes}, [_DeviceFrame(int(buf.handle), nbytes, buf)]
    _count_device_frames(_service(request), nbytes, staged=True, out=True)
    _timed_stage(request, start, staged)
    return {"nbytes": nbytes}, [_DeviceFrame(staged.ptr, nbytes, staged)]


def _frame_lost(e: Exception, sender: str | None) -> DataLostError:
    """The :class:`DataLostError` a failure to receive a value of the ``"cuda"`` family is raised as, as the
    ``"dask"`` family's (:func:`~dask_gpupool.dask.dask_family.data_lost`), naming the worker whose reply is read
    (``sender``: :data:`~dask_gpupool.handoff.deferred.SENDER`) when known. ``e``'s tracebacks are cleared first:
    a landing buffer or an import goes now, not with the traceback Dask logs."""
    clear_tracebacks(e)
    return data_lost({"exporter": sender or "?"}, e)


def _cuda_deserialize_buffer(header: dict[str, Any], frames: list[Any]) -> Buffer:
    """A handed-over Buffer, the device frame a comm received (a ``Buffer`` that keeps the frame alive), or a
    host frame copied into a new buffer of this worker's pool (owned by the caller)."""
    if KEY in header:
        return buffer_from_header(header, frames)
    if HOST_FRAME_KEY in header:
        return buffer_from_host_frame(header, frames, active_service(), SENDER.get())
    try:
        (frame,) = frames
        nbytes = int(header["nbytes"])
        size = _frame_nbytes(frame)
        if size != nbytes:  # the frame's own size bounds the Buffer, whatever the header says
            raise ValueError(f"a device frame of {size} bytes")
        ptr = int(frame.__cuda_array_interface__["data"][0])
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"malformed device-frame header {header!r}: {e}") from e
    _count_device_frames(active_service(), nbytes, staged=False, out=False)
    return Buffer.from_handle(ptr, nbytes, owner=frame)


def _frame_nbytes(frame: Any) -> int:
    """Bytes of a received device frame, from its ``__cuda_array_interface__`` (shape and item size; an
    ``rmm.DeviceBuffer``, a CuPy array or a :class:`_DeviceFrame`)."""
    cai = frame.__cuda_array_interface__
    count = 1
    for extent in cai["shape"]:
        count *= int(extent)
    return count * int(cai["typestr"][2:])


def _dumps_cupy(request: Request | None, x: Any, previous: Any) -> tuple[dict[str, Any], list[Any]]:
    """A CuPy array for a comm that carries device frames, in ``request``'s reply: handed over, or distributed's own
    frames.

    An array over pool memory (this worker's, or one it imported) goes to a
    same-host worker that can map it as an IPC descriptor; otherwise it is
    copied into :class:`~dask_gpupool.memory.ucx_staging.UcxStaging` memory (C order) and sent as distributed's
    device frames from there. Any other array goes as distributed's serializer makes it (UCX copies it GPU to
    GPU), only counted; small ones as one host frame (:func:`~dask_gpupool.dask.ucx_host_frames.host_frame`).
    """
    buf = viewed_buffer(x, int(x.data.ptr)) if VIEWS else None
    if buf is None:
        small = host_frame(request, x)
        if small is not None:
            header, frames = small
        else:
            header, frames = previous(x)
            _count_device_frames(_service(request), int(x.nbytes), staged=False, out=True)
        if request is not None:
            request.count_plain_fallback(int(x.nbytes))  # to a same-host peer: fallback not-in-pool
        return header, frames
    meta = ArrayMeta("cupy", tuple(x.shape), tuple(x.strides), x.dtype.str, int(x.data.ptr) - int(buf.handle))
    nbytes = int(x.nbytes)
    handed = _hand_over_on_device_comm(request, buf, buf, meta, x)
    if handed is not None:
        return handed, []
    small = host_frame(request, x)
    if small is not None:
        return small
    service = _service(request)
    if _unstaged(request, nbytes, buf):  # UCX moves it as it is (small, or legacy IPC memory)
        header, frames = previous(x)
        _count_device_frames(service, nbytes, staged=False, out=True)
        return header, frames
    start = time.perf_counter()
    try:
        staged = _stage_cupy(request, x)
    except Exception as e:  # no device memory for the copy: distributed's frames of the pool memory itself
        _staging_failed(e)
        header, frames = previous(x)
        _count_device_frames(service, nbytes, staged=False, out=True)
        return header, frames
    copied = time.perf_counter()
    header = staged_cupy_header(tuple(x.shape), x.dtype, staged.ptr)
    _count_device_frames(service, nbytes, staged=True, out=True)
    _timed_stage(request, start, staged, copied)
    return header, [_DeviceFrame(staged.ptr, nbytes, staged)]


def staged_cupy_header(shape: tuple[int, ...], dtype: Any, ptr: int) -> dict[str, Any]:
    """distributed's ``"cuda"`` header of a C-ordered CuPy array of ``shape`` and ``dtype`` at ``ptr``.

    What ``distributed.protocol.cupy.cuda_serialize_cupy_ndarray`` writes (the
    array's ``__cuda_array_interface__`` with its strides), built here without
    making a CuPy array over the staging memory: the receiver's
    ``cuda_deserialize_cupy_ndarray`` reads ``shape``, ``typestr`` and
    ``strides``. Saves distributed's serializer on a staged value (0.07-0.09 ms
    inside a worker, ``device-serialize``).
    """
    return {
        "shape": tuple(int(n) for n in shape),
        "typestr": dtype.str,
        "descr": [("", dtype.str)],
        "strides": c_strides(shape, dtype),
        "data": (int(ptr), False),
        "version": 3,
    }


def _stage_cupy(request: Request | None, x: Any) -> UcxStaging:
    """A C-ordered copy of CuPy array ``x`` in staging memory for ``request``'s reply, made on the legacy default
    stream.

    Complete when this returns, unless the reply's comm synchronizes the GPU
    before it sends (:func:`_comm_synchronizes`): then the staging memory
    keeps ``x`` alive until it is collected, in case the copy is still running.
    """
    import cupy

    nbytes, device = int(x.nbytes), int(x.device.id)
    wait = not _comm_synchronizes(request)
    if x.flags.c_contiguous:
        return UcxStaging.copy_of(int(x.data.ptr), nbytes, device, source=x, wait=wait)
    staged = UcxStaging(nbytes, device)
    with cupy.cuda.Device(device), cupy.cuda.Stream.null:
        mem = cupy.cuda.UnownedMemory(staged.ptr, max(nbytes, 1), staged, device_id=device)
        view = cupy.ndarray(x.shape, x.dtype, cupy.cuda.MemoryPointer(mem, 0))
        view[...] = x
        if wait:
            cupy.cuda.Stream.null.synchronize()
        else:
            staged.source = x
    return staged


def _staging_failed(e: Exception) -> None:
    """Log (once per process) that pool memory goes to UCX unstaged, which UCX 1.21 moves through the host."""
    warn_once("staging pool memory for UCX", e, "it is sent as it is, which UCX moves through host memory (slow)")
