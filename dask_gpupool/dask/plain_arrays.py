"""Arrays outside every pool in a ``get_data`` reply: staged into the pool and handed over, or counted copies.

A NumPy or CuPy array that a task made with its library's own allocator (or
RMM's) is not pool memory. Asked for by a same-host worker over TCP or TLS,
one of the stage threshold or more (:meth:`Routes.stage_threshold
<dask_gpupool.handoff.routes.Routes.stage_threshold>`) is copied into this
worker's pool here (device to device for CuPy on a ``device`` pool, a memcpy
for NumPy on a ``host`` pool) and handed over under the requester's lease
(fallback ``staged-in-pool``, ``pool_staged_bytes``): :func:`stage`. Every
other such array goes through distributed's own serializer and is counted
(:func:`plain`: ``copied_out_bytes``, the receiving worker's ``copied_bytes``
(:func:`sent_as_copy`) and, to a same-host worker, the fallback
``small`` or ``not-in-pool``: :meth:`Request.count_plain_fallback
<dask_gpupool.dask.context.Request.count_plain_fallback>`). The
staged copy is owned by the lease (the exporter's ``Exported`` holds the
array over it) and goes back to the pool when the requester lets go; until
then this worker's managed memory counts it
(:func:`~dask_gpupool.dask.spilling.count_staged`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from dask_gpupool.dask.context import Request
from dask_gpupool.dask.views import as_array, c_strides, described
from dask_gpupool.errors import PoolExhaustedError
from dask_gpupool.wire.handoff import COPIED_KEY, HEADER_KEY, ArrayMeta

if TYPE_CHECKING:
    from dask_gpupool.handoff.service import PoolService

__all__ = ["POOL_FULL", "plain", "received_copy", "sent_as_copy", "stage", "warn_once"]

logger = logging.getLogger(__name__)

#: What :func:`stage` returns when the pool has no room for the copy (the array goes in the comm's frames).
POOL_FULL: tuple[dict[str, Any], list[Any]] = ({}, [])

_streams_lock = threading.Lock()
#: GPU ordinal -> the non-blocking stream staging copies that wait for a task's event run on (one per process).
_staging_streams: dict[int, Any] = {}


def _staging_stream(device: int | None) -> Any:
    """The cuda.core non-blocking stream of this process for staging copies on GPU ``device``, made on first use.

    Owned by this module for the process's lifetime (one per GPU). The caller has made ``device`` current in this
    thread (:func:`_default_stream_idle` does, just before).
    """
    from dask_gpupool.memory.topology import current_gpu

    ordinal = 0 if device is None else device
    with _streams_lock:
        stream = _staging_streams.get(ordinal)
        if stream is None:
            from cuda.core import StreamOptions

            stream = _staging_streams[ordinal] = current_gpu(ordinal).create_stream(
                options=StreamOptions(nonblocking=True)
            )
    return stream


def plain(
    request: Request | None, arr: Any, module: str, previous: Any, context: Any
) -> tuple[dict[str, Any], list[Any]]:
    """An array over no pool Buffer, in ``request``'s reply (``None``: not a ``get_data`` reply): staged into the
    pool and handed over, or distributed's serializer ``previous(arr, context)`` (counted)."""
    if request is None:  # spilling, a task graph, a client: distributed's serializer, nothing to count
        return previous(arr, context)
    staged = stage(request, arr, module)
    if staged is POOL_FULL:  # no room to stage it: Dask's own way, counted as such
        request.service.handoffs.fallback(str(request.requester), "pool-full", request.service.record.worker)
    elif staged is not None:
        return staged
    else:
        request.count_plain_fallback(int(arr.nbytes))
    return sent_as_copy(request, int(arr.nbytes), previous(arr, context))


def sent_as_copy(
    request: Request, nbytes: int, serialized: tuple[dict[str, Any], list[Any]]
) -> tuple[dict[str, Any], list[Any]]:
    """``serialized`` (distributed's own header and frames of a value of ``nbytes`` bytes in ``request``'s reply),
    counted in ``copied_out_bytes`` here and marked so that the receiving worker counts it in ``copied_bytes``
    (:data:`~dask_gpupool.wire.handoff.COPIED_KEY`)."""
    request.service.handoffs.add(copied_out_bytes=nbytes)
    header, frames = serialized
    header[COPIED_KEY] = nbytes
    return header, frames


def received_copy(header: dict[str, Any], service: PoolService | None) -> None:
    """Count the bytes of a copy a peer sent in distributed's own frames (:func:`sent_as_copy`) in ``service``'s
    ``copied_bytes`` (this worker's); nothing for any other header, or without a service (a client)."""
    nbytes = header.get(COPIED_KEY)
    if type(nbytes) is int and nbytes > 0 and service is not None:
        service.handoffs.add(copied_bytes=nbytes)


def stage(request: Request, arr: Any, module: str) -> tuple[dict[str, Any], list[Any]] | None:
    """Copy ``arr`` into this worker's pool and hand the copy over, when a same-host worker asked over TCP or TLS
    (:meth:`Routes.stage_route <dask_gpupool.handoff.routes.Routes.stage_route>`).

    From the stage threshold up (:func:`dask_gpupool.handoff.routes.stage_threshold_of`), CuPy arrays on ``device``
    pools and NumPy arrays on ``host`` pools: a memcpy or a device-to-device copy here replaces the host copy, the
    comm's bytes and the receiver's copy.
    The lease keeps the staged copy alive until the receiver lets go.
    A NumPy array is staged only into the pool's kept range
    (:attr:`SharedHostMemoryResource.keep_resident <dask_gpupool.memory.host.SharedHostMemoryResource.keep_resident>`,
    pages written without faults): a larger one, or one whose buffer
    lands past it, goes Dask's way. It is copied in C order, or in Fortran
    order when it is Fortran-contiguous (a transposed chunk), on the thread
    that serializes the reply (the event loop, or Dask's offload thread from
    ``distributed.comm.offload``).
    A C- or Fortran-contiguous CuPy array is copied with one ``cuMemcpyAsync``
    (under load a CuPy view and copy kernel cost about 0.13 ms more,
    ``scripts/probes/stage_steps.py``); any other layout through CuPy.
    A CuPy array that a task of this worker made (``request.task_events``)
    is copied, while the device's default stream still has work queued, on
    a stream of its own after the event recorded when Dask stored it; any
    other, or with the default stream idle, on the default stream, after
    everything queued there. Returns :data:`POOL_FULL` when the pool has no room, and ``None`` (the caller
    sends the array as before in both cases) when the request does not allow it, the array's
    dtype is not one an array header describes (a structured dtype), or the
    allocation or the copy failed (logged once).
    """
    if request.plain_reason != "not-in-pool":
        return None
    service = request.service
    if (module == "numpy") != (service.pool.kind == "host") or arr.dtype.hasobject or arr.size == 0:
        return None
    if not described(arr):  # a structured dtype: the header's dtype.str would lose its fields
        return None
    nbytes = int(arr.nbytes)
    host = service.pool.shared_host
    if host is not None and nbytes > host.keep_resident:  # it would be written into pages given back: see below
        return None
    row = service.routes.stage_route(request.requester, request.scheme, nbytes)
    if row is None:
        return None
    start = time.perf_counter()
    # A CuPy task result of this worker: the copy waits for the event recorded when Dask stored it, on a stream of
    # its own, not for the kernels queued on the default stream since (dask/task_events.py).
    # Only while the default stream still has work queued: with it idle the default stream's copy waits for
    # nothing, and the side stream measured 0.2 ms slower (benchmarks/staged_behind_tasks.py, docs/performance.md).
    event = None
    if module == "cupy" and request.task_events is not None and service.pool.kind == "device":
        event = request.task_events.event_of(arr)
    side = None
    if event is not None:
        try:
            if not _default_stream_idle(service.pool.device):
                side = _staging_stream(service.pool.device)
                side.wait(event)
        except Exception as e:  # the copy goes on the default stream, as for arrays without an event
            _side_stream_failed(e)
            side = None
    allocating = time.perf_counter()
    try:
        if side is not None:
            # stream-ordered on the staging stream, which waits for the frees queued on the default stream, not for
            # its kernels (memory/arena_placement.py)
            buf = service.pool.allocate(nbytes, side)
        else:
            buf = service.pool.allocate(nbytes)
    except PoolExhaustedError:
        return POOL_FULL
    except Exception as e:  # sent as before: staging is a shortcut, its failure must not fail the reply
        _stage_failed(e)
        return None
    service.handoffs.timed("stage-alloc", time.perf_counter() - allocating)
    if host is not None and not host.in_kept_range(buf):
        # A host pool's pages past its kept range were given back: each 4 KiB written costs a fault that allocates
        # and zeroes it, which made the copy ten times slower than into resident pages (tuning.HOST_KEEP_RESIDENT)
        # and the staged handoff slower than Dask's own path.
        buf.close()
        return None
    stream = None
    holder: Any = buf
    try:
        if module == "cupy":
            import cupy

            with cupy.cuda.Device(buf.device_id):
                if side is not None:
                    stream = cupy.cuda.ExternalStream(int(side.handle), buf.device_id)
                else:
                    stream = cupy.cuda.get_current_stream()  # ordered after the task that made arr (legacy default)
                strides = _contiguous_strides(arr)
                if strides is not None:  # one driver copy of its bytes: no CuPy view, no copy kernel
                    from dask_gpupool.transport.staging import memcpy  # the worker stack: not loaded by clients

                    memcpy(int(buf.handle), int(arr.data.ptr), nbytes, int(stream.ptr))
                else:
                    holder = out = as_array(buf, tuple(arr.shape), arr.dtype, like=module)
                    with stream:
                        out[...] = arr
                    strides = tuple(out.strides)
        else:
            # C order, or Fortran order for a Fortran-contiguous array (a chunk's transpose): a straight copy either way
            fortran = not arr.flags.c_contiguous and arr.flags.f_contiguous
            shape = tuple(arr.shape)
            holder = out = as_array(buf, shape[::-1] if fortran else shape, arr.dtype, like=module)
            if fortran:
                out = out.T
            out[...] = arr
            strides = tuple(out.strides)
    except Exception as e:
        buf.close()
        _stage_failed(e)
        return None
    except BaseException:
        buf.close()
        raise
    if side is None:
        service.handoffs.timed("stage", time.perf_counter() - start)  # the wait for the copy is the export's
    else:
        service.handoffs.timed("stage-after-task", time.perf_counter() - start)
    meta = ArrayMeta(module, tuple(arr.shape), strides, arr.dtype.str, 0)
    header = service.exports.export_ipc(holder, buf, row, meta, written_on=stream)  # ordered after the copy
    request.granted.append(header.lease)
    from dask_gpupool.dask.spilling import count_staged  # the worker stack: not loaded by clients

    count_staged(service, buf, nbytes)  # this worker's memory, lent: counted here until the lease ends
    service.handoffs.add(pool_staged_bytes=nbytes)
    service.handoffs.fallback(row.worker, "staged-in-pool", service.record.worker)
    return {HEADER_KEY: header.to_msg()}, []


def _contiguous_strides(arr: Any) -> tuple[int, ...] | None:
    """The strides of a copy of ``arr``'s bytes, when its elements are exactly ``nbytes`` bytes from ``data.ptr``
    in C or Fortran order (so one memcpy copies it); ``None`` for any other layout."""
    shape = tuple(arr.shape)
    if arr.flags.c_contiguous:
        return c_strides(shape, arr.dtype)
    if arr.flags.f_contiguous:
        return c_strides(shape[::-1], arr.dtype)[::-1]
    return None


def _default_stream_idle(device: int | None) -> bool:
    """Whether GPU ``device``'s default stream has finished all its work (``cuStreamQuery``); ``False`` if unsure."""
    from cuda.bindings import driver

    from dask_gpupool.memory.topology import current_gpu

    stream = current_gpu(device).default_stream
    (err,) = driver.cuStreamQuery(driver.CUstream(int(stream.handle)))
    return bool(err == driver.CUresult.CUDA_SUCCESS)


_warned_lock = threading.Lock()
_warned: set[str] = set()


def warn_once(what: str, e: Exception, instead: str, *, trace: bool = False) -> None:
    """Log a WARNING the first time ``what`` fails in this process: why (``e``), and what is done ``instead``.

    For shortcuts whose failure has a slower way round (staging, its stream): the reply goes on, and the log says
    once what it costs. ``trace`` adds the traceback.
    """
    with _warned_lock:
        if what in _warned:
            return
        _warned.add(what)
    logger.warning(
        "gpupool: %s failed (%s: %s); %s. Further cases are not logged.",
        what,
        type(e).__name__,
        e,
        instead,
        exc_info=trace,
    )


def _stage_failed(e: Exception) -> None:
    warn_once("staging an array into the pool", e, "it goes through distributed's serializer", trace=True)


def _side_stream_failed(e: Exception) -> None:
    warn_once(
        "ordering a staging copy after its task's event",
        e,
        "staging copies go on the default stream, after every kernel queued there",
    )
