"""Dask serializers that hand pool memory over in place between same-host workers.

Registered for cuda.core ``Buffer`` and for NumPy and CuPy arrays (the latter
only those made over pool buffers with :func:`as_array`; every other array
keeps distributed's own serializer, which these registrations delegate to).

**Which path.** A value goes as an IPC descriptor only when it is being sent
in answer to a worker's ``get_data`` (the plugin wraps that handler, so the
requesting worker is known: :data:`_REQUEST`), the requester is a registered
worker on the same host in another process, the comm is TCP, TLS or UCX, the
memory lies in this worker's pool, and the requester can reach it (see
:meth:`PoolService.plan`). Everything else - other hosts, a client's gather,
the scheduler relaying one, spilling to disk, UCX comms, the same process -
gets a host copy in the frames, which a receiving worker lands in its own
pool so that it can be handed on again. Copies to a worker over ``tcp`` from
``gpupool.copy-stream-threshold`` up are not put in the frames: the receiver
pulls them from the sender's copy server, chunked and pipelined
(:mod:`dask_gpupool.transport.stream`).

**UCX comms.** Device ``Buffer`` objects and CuPy arrays also have
serializers of distributed's ``"cuda"`` family, which only comms that carry
device frames ask for (UCX). Pool memory asked for by a same-host worker that
can map it goes as an IPC descriptor there too; otherwise as device frames
that the comm moves GPU to GPU, never as a host copy. Device frames of pool
memory are first copied into ``cuMemAlloc`` memory, which UCX can send
through ``cuda_ipc`` (:class:`~dask_gpupool.memory.ucx_staging.UcxStaging`); other CuPy arrays go as
distributed's own frames. Counted in ``device_frames_out_bytes``,
``device_staged_bytes`` and ``device_frames_bytes``.

**Sub-header.** ``{"gpupool": HandoffHeader.to_msg()}``: msgpack-safe, never
pickled. Dask's own framing around it is unchanged.

**Failure.** ``loads`` never lets a bare CUDA error out: an import that fails
falls back to fetching a host copy from the exporter; only when the data is
gone does it raise :class:`~dask_gpupool.DataLostError` naming pool and worker.
"""

from __future__ import annotations

import bisect
import contextvars
import logging
import threading
import traceback
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cuda.core import Buffer
from distributed.protocol import dask_deserialize, dask_serialize

from dask_gpupool.errors import DataLostError, PoolUnavailableError, ProtocolError
from dask_gpupool.handoff.active import active_service
from dask_gpupool.memory.buffers import buffer_kind, copy_to_host, host_buffer
from dask_gpupool.memory.ucx_staging import UcxStaging
from dask_gpupool.wire.messages import ArrayMeta, HandoffHeader

if TYPE_CHECKING:
    from distributed import Worker

    from dask_gpupool.handoff.service import PoolService

__all__ = ["as_array", "install_get_data_hook"]

KEY = "gpupool"

logger = logging.getLogger(__name__)


# -- who asked: the get_data context ---------------------------------------------------


@dataclass(frozen=True)
class _Request:
    requester: str | None
    scheme: str
    service: PoolService
    #: Leases granted for this reply; settled (the unclaimed ones ended) when it ends.
    granted: list[int] = field(default_factory=list)


#: Set while a worker answers ``get_data``; Dask's offload thread inherits it.
_REQUEST: contextvars.ContextVar[_Request | None] = contextvars.ContextVar("gpupool_request", default=None)


def install_get_data_hook(worker: Worker, service: PoolService) -> Any:
    """Wrap ``worker``'s ``get_data`` handler so serializers know the requester.

    When every value asked for will go as an IPC descriptor, the reply is
    serialized on the event loop rather than in Dask's offload thread: Dask
    offloads any message whose ``sizeof`` passes ``distributed.comm.offload``
    (10 MiB), and a handoff's values are that large although what is
    serialized is a descriptor of a few hundred bytes. The thread hop cost
    about 0.5 ms per transfer, more than the rest of a handoff. Only that
    comm's ``allow_offload`` changes, for that reply, and the check runs only
    for replies Dask would offload (by the keys' recorded sizes).

    When the reply fails (the requester died), the frames of the exception's
    traceback are cleared: Dask logs the failure with its traceback and keeps
    the record in the worker's log deque (``distributed.admin.log-length``
    records), whose frames would otherwise keep the values of the reply, and
    with them pool memory, alive. Returns the original handler (to put back
    on teardown).
    """
    from distributed.comm import parse_address

    original = worker.handlers["get_data"]

    async def get_data(comm: Any, keys: Any = (), who: str | None = None, **kwargs: Any) -> Any:
        try:
            scheme = parse_address(comm.peer_address)[0]
        except Exception:
            scheme = ""
        token = _REQUEST.set(_Request(who, scheme, service))
        inline = getattr(comm, "allow_offload", False) and _inline_reply(worker, service, keys, who, scheme)
        if inline:
            comm.allow_offload = False
        request = _REQUEST.get()
        try:
            return await original(comm, keys=keys, who=who, **kwargs)
        except BaseException as e:
            # Dask logs a failed reply (requester gone) with its traceback, and the worker's log deque keeps
            # that record: the frames would keep the reply's values, and so pool memory, alive.
            traceback.clear_frames(e.__traceback__)
            raise
        finally:
            _REQUEST.reset(token)
            if inline:
                comm.allow_offload = True
            # The requester acknowledges a reply ("OK") only after its claims were answered, and a failed
            # reply is never used: either way a lease still unclaimed now never will be.
            if request is not None and request.granted:
                service.settle(request.granted, who)

    get_data.__wrapped__ = original  # type: ignore[attr-defined]
    worker.handlers["get_data"] = get_data
    return original


def _inline_reply(worker: Worker, service: PoolService, keys: Any, who: str | None, scheme: str) -> bool:
    """Whether to serialize a reply on the event loop: Dask would offload it, and all of it is descriptors."""
    return _offloaded(worker, keys) and _all_handed_over(worker, service, keys, who, scheme)


def _offloaded(worker: Worker, keys: Any) -> bool:
    """Whether Dask would offload serializing the reply: its values' recorded size passes the threshold.

    (Dask's own test is ``sizeof`` of the whole message; the recorded ``nbytes`` of the
    keys is that, less a few hundred bytes.) Below it nothing is to be gained, so the
    handoff check is not done twice on the common path of small values.
    """
    from distributed.comm import utils

    threshold = utils.OFFLOAD_THRESHOLD
    if not threshold:
        return False
    tasks = worker.state.tasks
    return sum((ts.nbytes or 0) for k in keys if (ts := tasks.get(k)) is not None) > threshold


def _all_handed_over(worker: Worker, service: PoolService, keys: Any, who: str | None, scheme: str) -> bool:
    """Whether every key is in memory (not spilled) and will go to ``who`` as an IPC descriptor."""
    data = getattr(worker.data, "fast", worker.data)  # a SpillBuffer's in-memory part: no unspilling
    if not keys or who is None:
        return False
    for key in keys:
        try:
            value = data[key]
        except KeyError:
            return False
        buf = pool_buffer_of(value)
        if buf is None:
            return False
        row, reason = service.route(who, scheme, buf)
        if row is None or reason is not None:
            return False
    return True


def pool_buffer_of(value: Any) -> Buffer | None:
    """The Buffer a value would be handed over from: itself, or the pool buffer an array views."""
    if isinstance(value, Buffer):
        return value
    if not _VIEWS:
        return None
    module = type(value).__module__.split(".", 1)[0]
    if module == "numpy":
        return _viewed_buffer(value, int(value.__array_interface__["data"][0]))
    if module == "cupy":
        return _viewed_buffer(value, int(value.data.ptr))
    return None


def _viewed_buffer(arr: Any, ptr: int) -> Buffer | None:
    """The live pool buffer holding all of array ``arr`` (data at ``ptr``), if any."""
    if not _VIEWS or arr.dtype.hasobject:
        return None
    low, high = _byte_bounds(ptr, tuple(arr.shape), tuple(arr.strides), arr.dtype.itemsize)
    return _VIEWS.find(low, high) if high > low else None


# -- which pool buffer an array lies in ---------------------------------------------------


class _ViewIndex:
    """Buffers that :func:`as_array` made arrays over, by address range (weakly held)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._entries: dict[int, tuple[int, weakref.ref[Buffer]]] = {}
        self._lock = threading.Lock()

    def add(self, buf: Buffer) -> None:
        start, size = int(buf.handle), int(buf.size)
        with self._lock:
            if start not in self._entries:
                bisect.insort(self._starts, start)
            self._entries[start] = (size, weakref.ref(buf, self._on_death(start)))

    def _on_death(self, start: int) -> Any:
        def callback(_ref: Any) -> None:
            self._remove(start)

        return callback

    def _remove(self, start: int) -> None:
        with self._lock:
            entry = self._entries.get(start)
            if entry is not None and entry[1]() is None:
                del self._entries[start]
                i = bisect.bisect_left(self._starts, start)
                if i < len(self._starts) and self._starts[i] == start:
                    del self._starts[i]

    def find(self, low: int, high: int) -> Buffer | None:
        """The live buffer holding ``[low, high)``, if any."""
        with self._lock:
            i = bisect.bisect_right(self._starts, low) - 1
            if i < 0:
                return None
            start = self._starts[i]
            size, ref = self._entries[start]
        buf = ref()
        if buf is None or buf.is_closed or high > start + size:
            return None
        return buf

    def __bool__(self) -> bool:
        return bool(self._starts)


_VIEWS = _ViewIndex()


def _byte_bounds(ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    low = high = ptr
    if any(n == 0 for n in shape):
        return ptr, ptr
    for n, st in zip(shape, strides, strict=True):
        if st < 0:
            low += (n - 1) * st
        else:
            high += (n - 1) * st
    return low, high + itemsize


# -- array views over Buffers ------------------------------------------------------------


def as_array(
    buf: Buffer,
    shape: int | tuple[int, ...],
    dtype: Any,
    strides: tuple[int, ...] | None = None,
    offset: int = 0,
    *,
    like: str | None = None,
) -> Any:
    """An array view over a pool ``Buffer`` (no copy), which hands over zero-copy too.

    Parameters
    ----------
    buf : cuda.core.Buffer
        Usually from :func:`dask_gpupool.allocate`. The array keeps it alive.
    shape, dtype, strides, offset
        As for ``numpy.ndarray``: strides in bytes (default C order), offset
        in bytes from the start of ``buf``.
    like : {"cupy", "numpy"}, optional
        The array type. Default: CuPy for GPU-accessible memory (``device``
        and ``pinned`` pools), NumPy for ``host`` pools. ``pinned`` memory can
        be viewed either way.

    Returns
    -------
    cupy.ndarray or numpy.ndarray
        A view: no copy, and the array keeps ``buf`` alive.

    Raises
    ------
    TypeError
        If ``buf`` is not a cuda.core ``Buffer``.
    ValueError
        For an object dtype, or an array that does not fit ``buf``.
    """
    import numpy as np

    if not isinstance(buf, Buffer):
        raise TypeError(
            f"as_array views a cuda.core Buffer (from dask_gpupool.allocate), not a {type(buf).__module__}."
            f"{type(buf).__qualname__}"
        )
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise ValueError(f"dtype {dt} holds Python objects, which cannot live in pool memory")
    if strides is None:
        strides = tuple(int(s) for s in np.empty((0,), dtype=dt).strides) if not shape else _c_strides(shape, dt)
    low, high = _byte_bounds(int(buf.handle) + offset, shape, strides, dt.itemsize)
    if low < int(buf.handle) or high > int(buf.handle) + buf.size:
        raise ValueError(f"an array of shape {shape}, strides {strides} at offset {offset} does not fit {buf!r}")
    if like is None:
        like = "cupy" if buf.is_device_accessible else "numpy"
    if like not in ("cupy", "numpy") or (like == "cupy" and not buf.is_device_accessible):
        raise ValueError(f"cannot view {buf!r} as a {like} array")
    if like == "numpy" and not buf.is_host_accessible:
        raise ValueError(f"{buf!r} is GPU memory: view it with like='cupy'")
    _VIEWS.add(buf)
    if like == "cupy":
        import cupy

        mem = cupy.cuda.UnownedMemory(int(buf.handle), buf.size, buf, device_id=_device_of(buf))
        return cupy.ndarray(shape, dt, cupy.cuda.MemoryPointer(mem, offset), strides=strides)
    import ctypes

    anchor = (ctypes.c_char * buf.size).from_address(int(buf.handle))
    anchor._buf = buf  # the array keeps the Buffer alive through it
    return np.ndarray(shape, dt, buffer=anchor, offset=offset, strides=strides)


def _c_strides(shape: tuple[int, ...], dt: Any) -> tuple[int, ...]:
    strides, step = [], dt.itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _device_of(buf: Buffer) -> int:
    dev = int(buf.device_id)
    if dev >= 0:
        return dev
    from cuda.core import Device

    return int(Device().device_id)


# -- the serializers -----------------------------------------------------------------


def _dumps(
    holder: Any,
    buf: Buffer,
    ipc_meta: ArrayMeta | None,
    copy_meta: ArrayMeta | None,
    host_frame: Any,
    span: tuple[int, int] | None,
) -> tuple[dict[str, Any], list[Any]]:
    """Hand ``buf`` over (IPC) when the request allows it, else copy.

    A copy is streamed (:mod:`dask_gpupool.transport.stream`) when ``span``, the
    ``(offset, nbytes)`` of ``buf`` that holds the value contiguously, is
    given and the request allows it; otherwise ``host_frame()`` gives the
    bytes for Dask's frames.
    """
    request = _REQUEST.get()
    service = request.service if request is not None else None
    if service is not None and request is not None:
        row, _reason = service.plan(request.requester, request.scheme, buf)
        if row is not None:
            header = service.export_ipc(holder, buf, row, ipc_meta)
            request.granted.append(header.lease)
            return {KEY: header.to_msg()}, []
        if span is not None:
            row = service.stream_route(request.requester, request.scheme, span[1])
            if row is not None:
                header = service.export_stream(holder, buf, span[0], span[1], row, copy_meta)
                request.granted.extend((header.lease, *header.lanes))
                return {KEY: header.to_msg()}, []
    frame = host_frame()
    nbytes = memoryview(frame).nbytes
    if service is not None:
        service.handoffs.add(copied_out_bytes=nbytes)
    exporter = service.record.worker if service is not None else ""
    header = HandoffHeader("copy", buffer_kind(buf), nbytes, exporter=exporter, array=copy_meta)
    return {KEY: header.to_msg()}, [frame]


def _lost(raw_header: Any, e: Exception) -> DataLostError:
    """The :class:`DataLostError` every failure to receive a handed-over value is raised as.

    :class:`DataLostError` is a ``ConnectionError``. Dask 2026.8 leaves a
    task waiting forever when a deserializer raises anything else (its
    ``gather_dep`` turns other errors into a failed dependency that is never
    retried), while for an ``OSError`` it treats the transfer as failed and
    fetches the key again, from the same worker or another, or has it
    recomputed. The exporter then sends this worker copies
    (:meth:`PoolService.settle`), so the retry succeeds.
    """
    exporter = raw_header.get("exporter", "?") if isinstance(raw_header, dict) else "?"
    return DataLostError(f"a value from worker {exporter} could not be received: {type(e).__name__}: {e}")


def _receive(header: HandoffHeader, frames: list[Any], need: str) -> Buffer:
    """The Buffer a header and its frames describe, in this process.

    ``need``: ``"host"`` or ``"device"`` when the value must be readable there
    (a NumPy or CuPy array), else ``"any"``. Callers raise its failures as :func:`_lost`.
    """
    service = active_service()
    if header.path == "ipc":
        if service is None:
            raise PoolUnavailableError(
                f"a handoff from {header.exporter} reached a process without a gpupool pool; "
                "it should have been sent as a copy"
            )
        return service.import_handoff(header)
    if header.path == "stream":
        if service is None:
            raise PoolUnavailableError(
                f"a streamed copy from {header.exporter} reached a process without a gpupool pool; "
                "it should have been sent in the frames"
            )
        return service.pull_copy(header, need)
    data = frames[0] if frames else b""
    if service is not None:
        return service.receive_copy(header.kind, data, header.exporter, need)
    return host_buffer(bytearray(data))  # a client: host memory it owns


@dask_serialize.register(Buffer)
def _serialize_buffer(buf: Buffer, context: Any = None) -> tuple[dict[str, Any], list[Any]]:
    return _dumps(buf, buf, None, None, lambda: copy_to_host(buf, 0, buf.size), (0, int(buf.size)))


@dask_deserialize.register(Buffer)
def _deserialize_buffer(header: dict[str, Any], frames: list[Any]) -> Buffer:
    raw = header.get(KEY)
    try:
        return _receive(HandoffHeader.from_msg(raw), frames, "any")
    except DataLostError:
        raise
    except Exception as e:
        raise _lost(raw, e) from e


def _dumps_array(arr: Any, module: str, ptr: int, previous: Any, context: Any) -> tuple[dict[str, Any], list[Any]]:
    """Hand an array over a pool buffer over (or copy it); any other array goes to ``previous(arr, context)``."""
    buf = _viewed_buffer(arr, ptr)
    if buf is None:
        return previous(arr, context)
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
    copy_meta = ArrayMeta(module, shape, _c_strides(shape, arr.dtype), arr.dtype.str, 0)
    span = (offset, int(arr.nbytes)) if arr.flags.c_contiguous else None
    return _dumps(buf, buf, ipc_meta, copy_meta, host_frame, span)


def _loads_array(header: dict[str, Any], frames: list[Any], previous: Any) -> Any:
    if KEY not in header:
        return previous(header, frames)
    try:
        h = HandoffHeader.from_msg(header[KEY])
        meta = h.array
        if meta is None:
            raise ProtocolError("handoff header of an array carries no array shape")
        buf = _receive(h, frames, "device" if meta.module == "cupy" else "host")
    except DataLostError:
        raise
    except Exception as e:
        raise _lost(header[KEY], e) from e
    if meta.module == "numpy" or buf.is_device_accessible:
        return as_array(buf, meta.shape, meta.dtype, meta.strides, meta.offset, like=meta.module)
    # A CuPy array that landed in host memory (a client, or a host pool without a GPU).
    host = as_array(buf, meta.shape, meta.dtype, meta.strides, meta.offset, like="numpy")
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy.asarray(host)
    except Exception:
        pass
    return host


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
        if not _VIEWS:  # no array over a pool buffer in this process: distributed's serializer, nothing else
            return previous_dumps(x, context)
        return _dumps_array(x, "numpy", int(x.__array_interface__["data"][0]), previous_dumps, context)

    def deserialize_numpy(header: dict[str, Any], frames: list[Any]) -> Any:
        return _loads_array(header, frames, previous_loads)

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
        if not _VIEWS:  # no array over a pool buffer in this process: distributed's serializer, nothing else
            return previous_dumps(x, context)
        return _dumps_array(x, "cupy", int(x.data.ptr), previous_dumps, context)

    def deserialize_cupy(header: dict[str, Any], frames: list[Any]) -> Any:
        return _loads_array(header, frames, previous_loads)

    dask_serialize.register(cupy.ndarray)(serialize_cupy)
    dask_deserialize.register(cupy.ndarray)(deserialize_cupy)

    from distributed.protocol.cuda import cuda_deserialize, cuda_serialize

    previous_cuda_dumps = cuda_serialize.dispatch(cupy.ndarray)
    previous_cuda_loads = cuda_deserialize.dispatch(cupy.ndarray)
    cuda_serialize.register(cupy.ndarray)(lambda x: _cuda_dumps_cupy(x, previous_cuda_dumps))
    cuda_deserialize.register(cupy.ndarray)(lambda h, f: _cuda_loads_cupy(h, f, previous_cuda_loads))


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


def _hand_over_on_device_comm(holder: Any, buf: Buffer, meta: ArrayMeta | None, nbytes: int) -> dict[str, Any] | None:
    """The header of a zero-copy handoff when a same-host worker asked for ``buf`` over a UCX comm, else ``None``.

    Not below ``gpupool.ucx-handoff-threshold`` bytes (``nbytes``, the value's
    size): UCX moves small device frames faster than a handoff. Counts the
    fallback reason when a same-host peer could not have it zero-copy.
    """
    request = _REQUEST.get()
    if request is None or nbytes < request.service.options.ucx_handoff_threshold:
        return None
    row, _reason = request.service.plan(request.requester, request.scheme, buf)
    if row is None:
        return None
    header = request.service.export_ipc(holder, buf, row, meta)
    request.granted.append(header.lease)
    return {KEY: header.to_msg()}


def _count_device_frames(nbytes: int, *, staged: bool, out: bool) -> None:
    request = _REQUEST.get() if out else None
    service = request.service if request is not None else active_service()
    if service is None:
        return
    if out:
        service.handoffs.add(device_frames_out_bytes=nbytes, device_staged_bytes=nbytes if staged else 0)
    else:
        service.handoffs.add(device_frames_bytes=nbytes)


def _cuda_serialize_buffer(buf: Buffer) -> tuple[dict[str, Any], list[Any]]:
    """A device ``Buffer`` for comms that carry device frames (the ``"cuda"`` family: UCX).

    To a same-host worker that can map it: an IPC descriptor, as over TCP.
    Otherwise one device frame, copied first into memory UCX can send GPU to
    GPU (:class:`~dask_gpupool.memory.ucx_staging.UcxStaging`; counted in ``device_frames_out_bytes`` and
    ``device_staged_bytes``), never a host copy. Host memory, and empty
    buffers, go on to the ``"dask"`` family (a host frame).
    """
    if not buf.is_device_accessible or buf.is_host_accessible or not buf.size:
        raise NotImplementedError("host memory goes in a host frame")
    nbytes = int(buf.size)
    handed = _hand_over_on_device_comm(buf, buf, None, nbytes)
    if handed is not None:
        return handed, []
    try:
        staged = UcxStaging.copy_of(int(buf.handle), nbytes, _device_of(buf))
    except Exception as e:  # no device memory for the copy: the pool memory itself (UCX's slow path, still right)
        _staging_failed(e)
        _count_device_frames(nbytes, staged=False, out=True)
        return {"nbytes": nbytes}, [_DeviceFrame(int(buf.handle), nbytes, buf)]
    _count_device_frames(nbytes, staged=True, out=True)
    return {"nbytes": nbytes}, [_DeviceFrame(staged.ptr, nbytes, staged)]


def _cuda_deserialize_buffer(header: dict[str, Any], frames: list[Any]) -> Buffer:
    """A handed-over Buffer, or the device frame a comm received (a ``Buffer`` that keeps the frame alive)."""
    if KEY in header:
        return _deserialize_buffer(header, frames)
    (frame,) = frames
    nbytes = int(header["nbytes"])
    ptr = int(frame.__cuda_array_interface__["data"][0])
    _count_device_frames(nbytes, staged=False, out=False)
    return Buffer.from_handle(ptr, nbytes, owner=frame)


def _cuda_dumps_cupy(x: Any, previous: Any) -> tuple[dict[str, Any], list[Any]]:
    """A CuPy array for a comm that carries device frames: handed over, staged or distributed's own frames.

    An array over pool memory (this worker's, or one it imported) goes to a
    same-host worker that can map it as an IPC descriptor; otherwise it is
    copied into :class:`~dask_gpupool.memory.ucx_staging.UcxStaging` memory (C order) and sent as distributed's
    device frames from there. Every other array is distributed's serializer
    untouched, only counted.
    """
    buf = _viewed_buffer(x, int(x.data.ptr)) if _VIEWS else None
    if buf is None:
        header, frames = previous(x)
        _count_device_frames(int(x.nbytes), staged=False, out=True)
        return header, frames
    import cupy

    meta = ArrayMeta("cupy", tuple(x.shape), tuple(x.strides), x.dtype.str, int(x.data.ptr) - int(buf.handle))
    nbytes = int(x.nbytes)
    handed = _hand_over_on_device_comm(buf, buf, meta, nbytes)
    if handed is not None:
        return handed, []
    try:
        staged = _stage_cupy(x)
    except Exception as e:  # no device memory for the copy: distributed's frames of the pool memory itself
        _staging_failed(e)
        header, frames = previous(x)
        _count_device_frames(nbytes, staged=False, out=True)
        return header, frames
    mem = cupy.cuda.UnownedMemory(staged.ptr, max(nbytes, 1), staged, device_id=x.device.id)
    header, frames = previous(cupy.ndarray(x.shape, x.dtype, cupy.cuda.MemoryPointer(mem, 0)))
    _count_device_frames(nbytes, staged=True, out=True)
    return header, frames


def _stage_cupy(x: Any) -> UcxStaging:
    """A C-ordered copy of CuPy array ``x`` in staging memory, complete when this returns."""
    import cupy

    nbytes, device = int(x.nbytes), int(x.device.id)
    if x.flags.c_contiguous:
        return UcxStaging.copy_of(int(x.data.ptr), nbytes, device)
    staged = UcxStaging(nbytes, device)
    with cupy.cuda.Device(device), cupy.cuda.Stream.null:
        mem = cupy.cuda.UnownedMemory(staged.ptr, max(nbytes, 1), staged, device_id=device)
        view = cupy.ndarray(x.shape, x.dtype, cupy.cuda.MemoryPointer(mem, 0))
        view[...] = x
        cupy.cuda.Stream.null.synchronize()
    return staged


_staging_warned = False


def _staging_failed(e: Exception) -> None:
    """Log (once per process) that pool memory goes to UCX unstaged, which UCX 1.21 moves through the host."""
    global _staging_warned
    if not _staging_warned:
        _staging_warned = True
        logger.warning(
            "gpupool: could not stage pool memory for UCX (%s: %s); sent as it is, which UCX moves through host "
            "memory (slow). Further cases are not logged.",
            type(e).__name__,
            e,
        )


def _cuda_loads_cupy(header: dict[str, Any], frames: list[Any], previous: Any) -> Any:
    if KEY in header:
        return _loads_array(header, frames, previous)
    arr = previous(header, frames)
    _count_device_frames(int(arr.nbytes), staged=False, out=False)
    return arr


def _register_cuda() -> None:
    from distributed.protocol.cuda import cuda_deserialize, cuda_serialize

    cuda_serialize.register(Buffer)(_cuda_serialize_buffer)
    cuda_deserialize.register(Buffer)(_cuda_deserialize_buffer)


def _register() -> None:
    _register_numpy()
    _register_sizeof()
    _register_cuda()
    import sys

    if sys.modules.get("cupy") is not None:  # imported already (None: an import that is blocked)
        register_cupy()
    else:
        # Replaces distributed's lazy hooks for CuPy with ours, which run theirs first.
        dask_serialize.register_lazy("cupy")(register_cupy)
        dask_deserialize.register_lazy("cupy")(register_cupy)


_register()
