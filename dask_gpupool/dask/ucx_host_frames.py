"""Small device values over UCX as one host frame, to workers that run the plugin.

A CuPy array (pool memory or not) or a pool Buffer under
:data:`~dask_gpupool.tuning.UCX_HOST_FRAME_THRESHOLD` (8 KiB) that is not handed
over goes to a worker running the plugin as one host frame, which is how UCX's
eager protocol moves device memory that small anyway, minus the comm's GPU
synchronizes and the receiver's ``cudaMalloc``. A Buffer lands in the
receiver's pool. Counted in ``host_frames_out_bytes`` and ``host_frames_bytes``.
Used by the ``"cuda"`` family (:mod:`dask_gpupool.dask.cuda_family`), which
passes each function the request, service and sender it read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cuda.core import Buffer

from dask_gpupool import tuning
from dask_gpupool.dask.context import SYNCHRONIZING_SCHEMES, Request
from dask_gpupool.errors import ProtocolError
from dask_gpupool.memory.buffers import copy_from_host
from dask_gpupool.memory.topology import current_gpu

if TYPE_CHECKING:
    from dask_gpupool.handoff.service import PoolService

__all__ = ["HOST_FRAME_KEY", "buffer_from_host_frame", "cupy_from_host_frame", "host_frame", "host_frame_reply"]

#: Header key of a value sent as one host frame (:data:`~dask_gpupool.tuning.UCX_HOST_FRAME_THRESHOLD`).
HOST_FRAME_KEY = "gpupool-host-frame"


def host_frame_reply(request: Request | None, nbytes: int) -> PoolService | None:
    """The service of ``request``'s reply (``None``: not a ``get_data`` reply), when a value of ``nbytes`` goes in
    it as one host frame: the reply is over UCX, the value is under
    :data:`~dask_gpupool.tuning.UCX_HOST_FRAME_THRESHOLD`, and the requester is a worker that runs the plugin (it
    has a registry row; only its deserializer reads the frame, so a client or the scheduler gets device frames).
    Else ``None``.

    UCX 1.21 sends device memory under 8 KiB eagerly through host bounce
    buffers itself, so below that the bytes take the same way; done by the
    plugin, the reply has no device frame, so distributed-ucxx synchronizes
    the GPU on neither side, and the receiver allocates nothing with
    ``cudaMalloc`` (:data:`~dask_gpupool.tuning.UCX_HOST_FRAME_THRESHOLD` has
    the figures). Under ``gpupool.handoff-ordering: device`` the whole GPU is
    synchronized here first, as distributed-ucxx does before device frames;
    otherwise the copy to the host is ordered after the work queued on the
    legacy default stream (the task's kernels).
    """
    if request is None or request.scheme not in SYNCHRONIZING_SCHEMES:
        return None
    service = request.service
    if nbytes >= tuning.UCX_HOST_FRAME_THRESHOLD:
        return None
    if request.requester is None or service.registry.worker_row(request.requester) is None:
        return None  # a client, the scheduler, a worker without the plugin: no deserializer for the host frame
    if service.options.handoff_ordering == "device":
        current_gpu(None).sync()  # the thread's GPU, as distributed-ucxx's own synchronize
    return service


def host_frame(request: Request | None, x: Any) -> tuple[dict[str, Any], list[Any]] | None:
    """CuPy array ``x`` as one host frame (a NumPy array this reply owns), when :func:`host_frame_reply` says so;
    else ``None``. Counted in ``host_frames_out_bytes`` here and ``host_frames_bytes`` on the receiver."""
    nbytes = int(x.nbytes)
    service = host_frame_reply(request, nbytes)
    if service is None:
        return None
    import cupy

    with cupy.cuda.Device(int(x.device.id)):
        host = x.get(stream=cupy.cuda.Stream.null, order="C")
    service.handoffs.add(host_frames_out_bytes=nbytes)
    return {HOST_FRAME_KEY: True, "shape": tuple(int(n) for n in x.shape), "dtype": x.dtype.str}, [host.data]


def buffer_from_host_frame(
    header: dict[str, Any], frames: list[Any], service: PoolService | None, sender: str | None
) -> Buffer:
    """A Buffer of ``service``'s pool (this worker's) holding a host frame's bytes from ``sender`` (the caller owns
    it); GPU memory outside the pool when the pool is full (fallback ``receiver-pool-full``), as for host copies.

    Raises
    ------
    ProtocolError
        If the header or frame is malformed, or this process has no pool (nothing is allocated then).
    """
    try:
        (frame,) = frames
        nbytes = int(header["nbytes"])
        if memoryview(frame).nbytes != nbytes:
            raise ValueError(f"a frame of {memoryview(frame).nbytes} bytes")
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"malformed host-frame header {header!r}: {e}") from e
    if service is None:
        raise ProtocolError("a host frame of a Buffer reached a process without a pool")
    buf = service.importer.copies.landing(nbytes, sender or "unknown sender")  # outside a full pool
    try:
        copy_from_host(buf, frame)
    except BaseException:
        buf.close()
        raise
    service.handoffs.add(host_frames_bytes=nbytes)
    return buf


def cupy_from_host_frame(header: dict[str, Any], frames: list[Any], service: PoolService | None) -> Any:
    """The CuPy array a :func:`host_frame` header and its frame describe, copied to this process's current GPU;
    counted in ``service``'s stats (``None``: not counted).

    Raises
    ------
    ProtocolError
        If the header or frame is malformed (nothing is allocated then).
    """
    import numpy

    try:
        (frame,) = frames
        dtype = numpy.dtype(header["dtype"])
        shape = tuple(int(n) for n in header["shape"])
        host = numpy.frombuffer(frame, dtype=dtype).reshape(shape)
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"malformed host-frame header {header!r}: {e}") from e
    import cupy

    if service is not None:
        service.handoffs.add(host_frames_bytes=host.nbytes)
    return cupy.asarray(host)
