"""Every object distributed splits into device frames (the ``"cuda"`` family), handed over frame by frame over TCP.

distributed knows how to split an ``rmm.DeviceBuffer``, a Numba device
array, a cuDF object or any type with a ``cuda_serialize`` registration into
a header and device frames, but over TCP or TLS it sends them with its
``"dask"`` serializer: device → host → comm → host → device. For a same-host
worker asking over TCP or TLS (and ``gpupool.device-objects`` on), the
worker's ``get_data`` hook puts this module's serialization family,
:data:`FAMILY`, in front of Dask's (:func:`serializers_for`). It serializes
a value with distributed's own ``cuda_serialize`` and sends **each device
frame as a CuPy array through this package's CuPy serializer**: a frame in
this worker's pool is handed over in place; one outside it, from
``gpupool.stage-threshold`` bytes up, is copied into the pool on the GPU and
handed over (fallback ``staged-in-pool``); a smaller one goes through the
comm (fallback ``small``). Host frames (an object may mix both) go as they
are. The consumer turns each frame back into device memory (the imported
memory itself, or the copy) and rebuilds the object with distributed's own
``cuda_deserialize``. So any type with a ``"cuda"`` serializer gains, with no
serializer per type and no change to Dask's registrations. Types the family
does not take (CuPy and NumPy arrays, which have their own path in
:mod:`~dask_gpupool.dask.serializers`; types with no ``cuda_serialize``; a
type that cannot be found again by its name) go to Dask's next family, as
before. Every other requester (other hosts, clients, spilling, UCX comms)
never sees the family.

What the consumer's deserializer gets, by type:

- ``rmm.DeviceBuffer`` owns its memory by design (and distributed's
  deserializer asserts it got one), so each frame is copied into a new one on
  the GPU (device to device, never through the host), after the lease is
  claimed; the lease ends with the imported array.
- Numba device arrays map the frame (zero-copy); their deserializer reads no
  device memory, so the claim waits with the message's others
  (:mod:`~dask_gpupool.handoff.deferred`).
- Every other type (cuDF's, a user's) maps the frames too, but its
  deserializer may read device memory (a cuDF column may), and nothing may
  be read before the exporter acknowledged the lease (and, with
  ``gpupool.handoff-ordering: event``, before the producer's kernels
  finished): so the object's claims run first, in one round trip per
  exporter, on the thread that deserializes. A deserializer that refuses
  CuPy frames (it wants ``rmm.DeviceBuffer`` frames, as UCX gives them when
  RMM is installed) is given copies in ``rmm.DeviceBuffer`` s, logged once
  per type.

Ownership: a frame handed over is the producer's memory under a lease, kept
alive by the CuPy array over it, and so by whatever the deserializer built
over that array.

Wire format: Dask's header for a family, ``{"sub-header": {FRAMES_KEY: {"header": <cuda header>, "parts":
[...]}}, "type": <module:qualname>}``, one part per frame, ``{"device": <CuPy serializer header>, "frames": n}``
or ``{"host": True}``; msgpack-safe. The type travels by name, not pickled (distributed's own ``"cuda"``
family pickles it), and the consumer imports it.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distributed.protocol.cuda import cuda_deserialize, cuda_serialize
from distributed.protocol.serialize import families, register_serialization_family

from dask_gpupool.dask.worker_internals import REQUEST
from dask_gpupool.errors import ProtocolError
from dask_gpupool.handoff.deferred import abandon_all, collecting, fill_later, run_fills

if TYPE_CHECKING:
    from dask_gpupool.dask.worker_internals import Request

__all__ = ["FAMILY", "FRAMES_KEY", "register_device_objects", "serializers_for"]

#: The serialization family's name (``header["serializer"]``).
FAMILY = "gpupool-frames"
#: The sub-header key that holds the frames' parts.
FRAMES_KEY = "gpupool-frames"

logger = logging.getLogger(__name__)

#: Types whose deserializer refused CuPy frames once: they get ``rmm.DeviceBuffer`` copies at once.
_WANTS_RMM: set[type] = set()


def serializers_for(request: Request) -> list[str] | None:
    """The serializer families for a ``get_data`` reply: :data:`FAMILY` first when the requester can map device frames.

    That is a same-host worker that could map this worker's ``device`` pool
    (the reason a plain value would be a same-host copy is ``not-in-pool``),
    asking over TCP or TLS, with ``gpupool.device-objects`` on. ``None``
    leaves Dask's default (``"dask"``, then ``"pickle"``).
    """
    if not _wanted(request):
        return None
    return [FAMILY, "dask", "pickle"]


def _wanted(request: Request | None) -> bool:
    return (
        request is not None
        and request.service.options.device_objects
        and request.plain_reason == "not-in-pool"
        and request.scheme in ("tcp", "tls")
        and request.service.pool.kind == "device"
    )


def _type_name(typ: type) -> str:
    return f"{typ.__module__}:{typ.__qualname__}"


def _type_from_name(name: str) -> type:
    """The type :func:`_type_name` named, imported. Raises :class:`ProtocolError` for anything else."""
    module, sep, qualname = name.partition(":")
    if not sep or not module or not qualname:
        raise ProtocolError(f"device object header: type name {name!r} is not <module>:<qualname>")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ProtocolError(f"device object header: type {name!r} cannot be imported here: {e}") from e
    if not isinstance(obj, type):
        raise ProtocolError(f"device object header: {name!r} is not a type")
    return obj


def _own_path(x: Any) -> bool:
    """CuPy and NumPy arrays: their serializers (:mod:`~dask_gpupool.dask.serializers`) hand them over themselves."""
    for module in ("cupy", "numpy"):
        mod = sys.modules.get(module)
        if mod is not None and isinstance(x, mod.ndarray):
            return True
    return False


def dumps(x: Any) -> tuple[dict[str, Any], list[Any]]:
    """The family's serializer: ``x`` frame by frame, or ``NotImplementedError`` (Dask's next family)."""
    if not _wanted(REQUEST.get()) or _own_path(x):
        raise NotImplementedError(type(x).__name__)
    typ = type(x)
    try:
        cuda_dumps = cuda_serialize.dispatch(typ)
    except TypeError:
        raise NotImplementedError(typ.__name__) from None
    name = _type_name(typ)
    try:
        found = _type_from_name(name)
    except ProtocolError:
        found = None
    if found is not typ:  # a type defined in __main__ or a function: Dask's pickle carries those
        raise NotImplementedError(name)
    sub, frames = _dumps_frames(x, cuda_dumps)
    return {"sub-header": sub, "type": name}, frames


def loads(header: dict[str, Any], frames: list[Any]) -> Any:
    """The family's deserializer: the object :func:`dumps` sent, rebuilt over its frames."""
    try:
        name, sub = header["type"], header["sub-header"]
        body = sub[FRAMES_KEY]
        parts, cuda_header = body["parts"], body["header"]
    except (KeyError, TypeError) as e:
        raise ProtocolError(f"device object header: missing field {e}") from None
    typ = _type_from_name(str(name))
    try:
        cuda_loads = cuda_deserialize.dispatch(typ)
    except TypeError:
        raise ProtocolError(f"device object header: no cuda deserializer for {name} here") from None
    return _loads_frames(typ, cuda_header, parts, frames, cuda_loads)


def _dumps_frames(x: Any, cuda_dumps: Callable[[Any], Any]) -> tuple[dict[str, Any], list[Any]]:
    """``x`` as its ``"cuda"`` header plus each device frame through the CuPy serializer (see the module notes)."""
    sub, frames = cuda_dumps(x)
    parts: list[dict[str, Any]] = []
    out: list[Any] = []
    dumps_cupy = None
    for frame in frames:
        if not hasattr(frame, "__cuda_array_interface__"):
            parts.append({"host": True})
            out.append(frame)
            continue
        import cupy

        if dumps_cupy is None:
            dumps_cupy = _cupy_serializer(cupy, deserialize=False)
        arr = cupy.asarray(frame).view("u1").ravel()  # a view: the frame's own memory, no copy
        header, part_frames = dumps_cupy(arr)
        parts.append({"device": header, "frames": len(part_frames)})
        out.extend(part_frames)
    return {FRAMES_KEY: {"header": sub, "parts": parts}}, out


def _cupy_serializer(cupy: Any, *, deserialize: bool) -> Any:
    from distributed.protocol import dask_deserialize, dask_serialize

    from dask_gpupool.dask.serializers import register_cupy

    register_cupy()
    return (dask_deserialize if deserialize else dask_serialize).dispatch(cupy.ndarray)


def _loads_frames(
    typ: type, cuda_header: Any, parts: list[dict[str, Any]], frames: list[Any], cuda_loads: Callable[..., Any]
) -> Any:
    """Rebuild an object :func:`_dumps_frames` sent: each part back in device memory, then ``cuda_loads``."""
    _check_parts(parts, len(frames))
    if not any("device" in p for p in parts):
        return cuda_loads(cuda_header, list(frames))
    rmm = sys.modules.get("rmm")
    if rmm is not None and issubclass(typ, rmm.DeviceBuffer):
        return cuda_loads(cuda_header, _device_frames(parts, frames, _as_rmm_buffer))  # reads nothing: fills wait
    numba_cuda = sys.modules.get("numba.cuda")
    if numba_cuda is not None and issubclass(typ, numba_cuda.devicearray.DeviceNDArray):
        return cuda_loads(cuda_header, _device_frames(parts, frames, None))  # reads nothing: claims wait
    # A deserializer that may read the frames: their claims (and copies) first, one round trip per exporter, here.
    wants_rmm = rmm is not None and typ in _WANTS_RMM
    device_frames = _now(lambda: _device_frames(parts, frames, _as_rmm_buffer if wants_rmm else None))
    try:
        return cuda_loads(cuda_header, device_frames)
    except (TypeError, AssertionError, ValueError, AttributeError) as e:
        if rmm is None or wants_rmm:
            raise
        logger.info(
            "gpupool: the cuda deserializer of %s refused CuPy frames (%s: %s); it gets rmm.DeviceBuffer copies",
            typ.__name__,
            type(e).__name__,
            e,
        )
        _WANTS_RMM.add(typ)
        on_gpu = [hasattr(f, "__cuda_array_interface__") for f in device_frames]
        copies = _now(lambda: [_as_rmm_buffer(f) if d else f for f, d in zip(device_frames, on_gpu, strict=True)])
        return cuda_loads(cuda_header, copies)


def _now(make: Callable[[], list[Any]]) -> list[Any]:
    """``make()``, with the claims and copies its deserializers leave (:mod:`~dask_gpupool.handoff.deferred`) run
    before it returns, on this thread, rather than after the message was read."""
    pending: list[Any] = []
    try:
        with collecting() as pending:
            out = make()
    except BaseException:
        abandon_all(pending)  # give back the leases mapped so far
        raise
    run_fills(pending)
    return out


def _check_parts(parts: Any, nframes: int) -> None:
    """Raise :class:`ProtocolError` unless ``parts`` is a list of ``{"host": True}`` and ``{"device": {...},
    "frames": n}`` that accounts for exactly ``nframes`` frames."""
    if not isinstance(parts, list):
        raise ProtocolError(f"device object header: parts is a {type(parts).__name__}, not a list")
    total = 0
    for part in parts:
        if isinstance(part, dict) and part.get("host") is True and len(part) == 1:
            total += 1
        elif (
            isinstance(part, dict)
            and isinstance(part.get("device"), dict)
            and type(part.get("frames")) is int
            and part["frames"] >= 0
        ):
            total += part["frames"]
        else:
            raise ProtocolError(f"device object header: malformed part {part!r:.200}")
    if total != nframes:
        raise ProtocolError(f"device object header: {nframes} frames do not match its parts ({total})")


def _device_frames(parts: list[dict[str, Any]], frames: list[Any], to_frame: Callable[[Any], Any] | None) -> list[Any]:
    """Each part of ``frames`` as its frame: host frames as they are, device parts as CuPy arrays (``to_frame``'d)."""
    import cupy

    loads_cupy = _cupy_serializer(cupy, deserialize=True)
    out: list[Any] = []
    i = 0
    for part in parts:
        if part.get("host"):
            out.append(frames[i])
            i += 1
            continue
        n = int(part["frames"])
        arr = loads_cupy(part["device"], frames[i : i + n])
        i += n
        out.append(arr if to_frame is None else to_frame(arr))
    return out


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

    nbytes = int(arr.nbytes)
    buf = rmm.DeviceBuffer(size=nbytes)

    def copy() -> None:
        if nbytes:
            buf.copy_from_device(arr)
        cupy.cuda.runtime.deviceSynchronize()

    fill_later(copy, lambda: None)  # nothing to give back: buf is the caller's, arr's lease ends with arr
    return buf


def register_device_objects() -> None:
    """Register :data:`FAMILY` with distributed (idempotent). Used only where :func:`serializers_for` names it."""
    if FAMILY not in families:
        register_serialization_family(FAMILY, dumps, loads)
