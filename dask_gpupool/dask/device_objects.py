"""Objects distributed splits into device frames (the ``"cuda"`` family): handed over frame by frame over TCP.

distributed knows how to split an ``rmm.DeviceBuffer`` or a Numba device
array into a header and device frames (``cuda_serialize``), but over TCP or
TLS it sends them with its ``"dask"`` serializer: device → host → comm →
host → device. For a same-host worker asking over TCP or TLS, this module
serializes such an object with distributed's ``cuda_serialize`` instead, and
sends **each device frame as a CuPy array through this package's CuPy
serializer**: a frame in this worker's pool is handed over in place; one
outside it, from ``gpupool.stage-threshold`` bytes up, is copied into the
pool on the GPU and handed over (fallback ``staged-in-pool``); a smaller one
goes through the comm (fallback ``small``). Host frames (an object may mix
both) go as they are. The consumer turns each frame back into device memory
(the imported memory itself, or the copy) and rebuilds the object with
distributed's own ``cuda_deserialize``. So any type with a ``"cuda"``
serializer gains, without a serializer per type.

Ownership: a frame handed over is the producer's memory under a lease, kept
alive by the CuPy array over it; a Numba array rebuilt over it holds that
array (zero-copy), while an ``rmm.DeviceBuffer`` owns its memory by design,
so the consumer copies the frame into a new one on the GPU (device to
device, never through the host; after the lease is claimed) and lets the
lease go with the imported array.

Used only with ``gpupool.device-objects: true`` (off by default: its GPU tests
pass on two H200s, its workload, ``rmm_objects`` in ``benchmarks/workloads.py``,
is not measured yet).
Registered for ``rmm.DeviceBuffer`` and Numba's ``DeviceNDArray`` when those
modules are first used, after distributed's own registrations, which stay
the path for every other requester (other hosts, clients, spilling). cuDF
objects, which distributed serializes the same way, are not wrapped here:
cuDF could not be installed where this was tested (docs/performance.md).

Sub-header: ``{"gpupool-frames": {"header": <cuda header>, "parts": [...]}}``,
one part per frame, ``{"device": <CuPy serializer header>, "frames": n}`` or
``{"host": True}``; msgpack-safe, never pickled.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from distributed.protocol import dask_deserialize, dask_serialize

from dask_gpupool.dask.worker_internals import REQUEST

__all__ = ["FRAMES_KEY", "catch_up", "register_device_objects"]

FRAMES_KEY = "gpupool-frames"

logger = logging.getLogger(__name__)


def _wanted() -> bool:
    """Whether the reply being serialized goes to a same-host worker that could map this worker's device pool."""
    request = REQUEST.get()
    return (
        request is not None
        and request.service.options.device_objects
        and request.plain_reason == "not-in-pool"
        and request.scheme in ("tcp", "tls")
        and request.service.pool.kind == "device"
    )


def _dumps_frames(x: Any, cuda_dumps: Any) -> tuple[dict[str, Any], list[Any]]:
    """``x`` as its ``"cuda"`` header plus each device frame through the CuPy serializer (see the module notes)."""
    import cupy

    from dask_gpupool.dask.serializers import register_cupy

    register_cupy()
    dumps_cupy = dask_serialize.dispatch(cupy.ndarray)
    sub, frames = cuda_dumps(x)
    parts: list[dict[str, Any]] = []
    out: list[Any] = []
    for frame in frames:
        if not hasattr(frame, "__cuda_array_interface__"):
            parts.append({"host": True})
            out.append(frame)
            continue
        arr = cupy.asarray(frame).view("u1").ravel()  # a view: the frame's own memory, no copy
        header, part_frames = dumps_cupy(arr)
        parts.append({"device": header, "frames": len(part_frames)})
        out.extend(part_frames)
    return {FRAMES_KEY: {"header": sub, "parts": parts}}, out


def _loads_frames(header: dict[str, Any], frames: list[Any], cuda_loads: Any, to_frame: Any) -> Any:
    """Rebuild an object :func:`_dumps_frames` sent: each part back in device memory, then ``cuda_loads``."""
    import cupy

    from dask_gpupool.dask.serializers import register_cupy

    register_cupy()
    loads_cupy = dask_deserialize.dispatch(cupy.ndarray)
    body = header[FRAMES_KEY]
    device_frames: list[Any] = []
    i = 0
    for part in body["parts"]:
        if part.get("host"):
            device_frames.append(frames[i])
            i += 1
            continue
        n = int(part["frames"])
        arr = loads_cupy(part["device"], frames[i : i + n])
        i += n
        device_frames.append(to_frame(arr))
    return cuda_loads(body["header"], device_frames)


def _wrap(typ: type, to_frame: Any) -> None:
    """Put the frame-by-frame path in front of distributed's ``"dask"`` serializer of ``typ``."""
    from distributed.protocol.cuda import cuda_deserialize, cuda_serialize

    previous_dumps = dask_serialize.dispatch(typ)
    previous_loads = dask_deserialize.dispatch(typ)
    cuda_dumps = cuda_serialize.dispatch(typ)
    cuda_loads = cuda_deserialize.dispatch(typ)

    def serialize(x: Any) -> tuple[dict[str, Any], list[Any]]:
        if _wanted():
            return _dumps_frames(x, cuda_dumps)
        return previous_dumps(x)

    def deserialize(header: dict[str, Any], frames: list[Any]) -> Any:
        if FRAMES_KEY in header:
            return _loads_frames(header, frames, cuda_loads, to_frame)
        return previous_loads(header, frames)

    dask_serialize.register(typ)(serialize)
    dask_deserialize.register(typ)(deserialize)


def _as_rmm_buffer(arr: Any) -> Any:
    """A new ``rmm.DeviceBuffer`` that will hold ``arr``'s bytes (copied on the GPU: RMM buffers own their memory).

    The copy is a fill (:func:`~dask_gpupool.handoff.deferred.fill_later`):
    inside a worker's comm read it runs after the message's lease claims,
    since ``arr`` may be a peer's memory not to be read before its lease is
    acknowledged, and before Dask sees the value; elsewhere at once. It is
    finished (the GPU synchronized) when the fill returns: ``arr`` may be
    the producer's memory under a lease that ends when ``arr`` goes, and the
    producer may then reuse it.
    """
    import cupy
    import rmm

    from dask_gpupool.handoff.deferred import fill_later

    nbytes = int(arr.nbytes)
    buf = rmm.DeviceBuffer(size=nbytes)

    def copy() -> None:
        if nbytes:
            buf.copy_from_device(arr)
        cupy.cuda.runtime.deviceSynchronize()

    fill_later(copy, lambda: None)  # nothing to give back: buf is the caller's, arr's lease ends with arr
    return buf


def _register_rmm() -> None:
    import cupy  # noqa: F401  (the frames travel as CuPy arrays: without CuPy, distributed's path stays)
    import rmm
    from distributed.protocol import rmm as _distributed_rmm  # noqa: F401  (its registrations first)

    _wrap(rmm.DeviceBuffer, _as_rmm_buffer)


def _register_numba() -> None:
    import cupy  # noqa: F401  (as for rmm)
    import numba.cuda
    from distributed.protocol import numba as _distributed_numba  # noqa: F401  (its registrations first)

    _wrap(numba.cuda.devicearray.DeviceNDArray, lambda arr: arr)  # Numba maps a CuPy array's memory, no copy


#: Registrations waiting for their module's first use, by module name.
_pending: dict[str, Any] = {}


def _register_lazily(module: str, register: Any) -> None:
    """``register()`` at the first dispatch of a ``module`` type, or now if distributed's hook for it already ran."""

    def once() -> None:
        if _pending.pop(module, None) is None:
            return
        try:
            register()
        except ImportError:  # distributed's own serializers need what is missing: they stay as they are
            logger.debug("gpupool: no frame-by-frame serializer for %s", module, exc_info=True)
        catch_up()  # registering numba's imported distributed's rmm module

    _pending[module] = once
    if f"distributed.protocol.{module}" in sys.modules:  # distributed registered its serializers already
        once()
        return
    # Replaces distributed's lazy hooks for these modules with ours, which run theirs first.
    dask_serialize.register_lazy(module)(once)
    dask_deserialize.register_lazy(module)(once)


def catch_up() -> None:
    """Wrap now every type whose distributed serializers were registered other than through the lazy hook.

    distributed's CuPy and Numba serializer modules import its RMM one
    directly, which registers ``rmm.DeviceBuffer``'s serializers without
    dispatching: the hook above would then never run, and distributed's
    serializer would stay in front (seen on two H200s: every
    ``rmm.DeviceBuffer`` went through the host). Called after each
    registration that may have imported one (:func:`register_cupy
    <dask_gpupool.dask.serializers.register_cupy>`, and here).
    """
    for module, once in list(_pending.items()):
        if f"distributed.protocol.{module}" in sys.modules:
            once()


def register_device_objects() -> None:
    """Register the frame-by-frame path for ``rmm.DeviceBuffer`` and Numba device arrays, at their first use."""
    _register_lazily("rmm", _register_rmm)
    _register_lazily("numba", _register_numba)
