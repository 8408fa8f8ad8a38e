"""Every object distributed splits into device frames (the ``"cuda"`` family), handed over frame by frame over TCP.

distributed knows how to split an ``rmm.DeviceBuffer``, a Numba device
array, a cuDF object or any type with a ``cuda_serialize`` registration into
a header and device frames, but over TCP or TLS it sends them with its
``"dask"`` serializer: device → host → comm → host → device. For a same-host
worker asking over TCP or TLS, the
worker's ``get_data`` hook puts this module's serialization family,
:data:`FAMILY`, in front of Dask's (:func:`serializers_for`). It serializes
a value with distributed's own ``cuda_serialize`` and sends **each device
frame as a CuPy array through this package's CuPy serializer**: a frame in
this worker's pool is handed over in place; one outside it, from the stage
threshold up (:func:`dask_gpupool.handoff.routes.stage_threshold_of`), is copied into the pool on the GPU and
handed over (fallback ``staged-in-pool``); a smaller one goes through the
comm (fallback ``small``). Host frames (an object may mix both) go as they
are. The consumer turns each frame back into device memory (the imported
memory itself, or the copy) and rebuilds the object with distributed's own
``cuda_deserialize``. So any type with a ``"cuda"`` serializer gains, with no
serializer per type and no change to Dask's registrations. Types the family
does not take (pool ``Buffer`` s and CuPy and NumPy arrays, which have their
own path in :mod:`~dask_gpupool.dask.dask_family`; types with no ``cuda_serialize``; a
type that cannot be found again by its name) go to Dask's next family, as
without the plugin. Every other requester (other hosts, clients, spilling, UCX comms)
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
  deserializer may read device memory (a cuDF column's may), and nothing may
  be read before the exporter acknowledged the lease: so the deserializer
  runs in a fill after the message's claims, off the event loop, and the
  message holds a placeholder until then
  (:func:`~dask_gpupool.handoff.deferred.make_later`). A deserializer that
  refuses CuPy frames (it wants ``rmm.DeviceBuffer`` frames, as UCX gives them
  when RMM is installed) is given copies in ``rmm.DeviceBuffer`` s, logged
  once per type.

Errors: a sender that cannot send an object this way (a device frame that is
not contiguous) sends it through Dask's next family; a receiver that cannot
rebuild it (a malformed header, a type it cannot import) raises
:class:`~dask_gpupool.errors.DataLostError`, so that Dask fetches it again.

Ownership: a frame handed over is the producer's memory under a lease, kept
alive by the CuPy array over it, and so by whatever the deserializer built
over that array.

Registered by :func:`~dask_gpupool.dask.registration.register_serializers` (a :class:`FramesFamily` given the
``"dask"`` family's CuPy serializers); :func:`serializers_for` names it for a reply.

Wire format: Dask's header for a family, ``{"sub-header": {FRAMES_KEY: {"header": <cuda header>,
"parts": [...]}}, "type": <module:qualname>, "compression": (False, ...)}``, one part per frame,
``{"device": <CuPy serializer header>, "frames": n}`` or ``{"host": True}``; msgpack-safe. The type travels
by name, not pickled (distributed's own ``"cuda"`` family pickles it), and the consumer imports it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cuda.core import Buffer
from distributed.protocol.cuda import cuda_deserialize, cuda_serialize

from dask_gpupool.dask.context import REQUEST
from dask_gpupool.errors import DataLostError, GPUPoolError, ProtocolError
from dask_gpupool.handoff.deferred import fill_later, make_later
from dask_gpupool.handoff.routes import TCP_SCHEMES

if TYPE_CHECKING:
    from dask_gpupool.dask.context import Request

__all__ = ["FAMILY", "FRAMES_KEY", "FramesFamily", "serializers_for"]

#: The serialization family's name (``header["serializer"]``).
FAMILY = "gpupool-frames"
#: The sub-header key that holds the frames' parts.
FRAMES_KEY = "gpupool-frames"

logger = logging.getLogger(__name__)

#: Types whose deserializer refused CuPy frames once: they get ``rmm.DeviceBuffer`` copies at once.
_WANTS_RMM: set[type] = set()
#: Types sent through Dask's serializer after this family failed on one (logged once each).
_DECLINED: set[type] = set()


def serializers_for(request: Request) -> list[str] | None:
    """The serializer families for a ``get_data`` reply: :data:`FAMILY` first when the requester can map device frames.

    That is a same-host worker that could map this worker's ``device`` pool
    (the reason a plain value would be a same-host copy is ``not-in-pool``),
    asking over TCP or TLS. ``None``
    leaves Dask's default (``"dask"``, then ``"pickle"``).
    """
    if not _wanted(request):
        return None
    return [FAMILY, "dask", "pickle"]


def _wanted(request: Request | None) -> bool:
    """Whether this reply goes to a same-host worker that can map device frames: both pools are ``device`` pools."""
    if not (
        request is not None
        and request.plain_reason == "not-in-pool"
        and request.scheme in TCP_SCHEMES
        and request.service.pool.kind == "device"
        and request.requester is not None
    ):
        return False
    row = request.service.registry.worker_row(request.requester)
    # after a failed transfer to it (peer-unreachable), Dask's serializer, so that the retry can succeed
    return row is not None and row.kind == "device" and not request.service.routes.is_unreachable(row.worker)


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
    """What this package's own serializers hand over (:mod:`~dask_gpupool.dask.dask_family`): pool ``Buffer`` s and
    CuPy and NumPy arrays. (``Buffer`` has a ``cuda_serialize`` of ours too, for UCX comms.)"""
    if isinstance(x, Buffer):
        return True
    for module in ("cupy", "numpy"):
        mod = sys.modules.get(module)
        if mod is not None and isinstance(x, mod.ndarray):
            return True
    return False


class FramesFamily:
    """The family's serializer (:meth:`dumps`) and deserializer (:meth:`loads`), registered under :data:`FAMILY`.

    Parameters
    ----------
    cupy_serializer : callable
        ``cupy_serializer(deserialize)``: the ``"dask"`` family's CuPy serializer (``False``) or deserializer
        (``True``) that each device frame goes through, registered first
        (:func:`~dask_gpupool.dask.registration.cupy_dask_serializer`). Called only for objects with device
        frames.
    """

    def __init__(self, cupy_serializer: Callable[[bool], Any]) -> None:
        self._cupy_serializer = cupy_serializer

    def dumps(self, x: Any) -> tuple[dict[str, Any], list[Any]]:
        """The family's serializer: ``x`` frame by frame, or ``NotImplementedError`` (Dask's next family).

        An object this cannot send (a device frame that is not contiguous, a
        failure while staging a frame) goes to Dask's next family, logged once
        per type; leases granted for its earlier frames end at once (their
        headers are never sent, so no reply's "OK" may claim them).
        """
        request = REQUEST.get()
        if not _wanted(request) or _own_path(x):
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
        granted = len(request.granted) if request is not None else 0
        forwarded = len(request.forwarded) if request is not None else 0
        try:
            sub, frames = _dumps_frames(x, cuda_dumps, self._cupy_serializer)
        except Exception as e:
            if request is not None:  # the headers of the frames handed over so far are never sent
                request.revoke_since(granted, forwarded)
            if typ not in _DECLINED:
                _DECLINED.add(typ)
                logger.warning("gpupool: %s goes through Dask's serializer: %s: %s", name, type(e).__name__, e)
            raise NotImplementedError(name) from None
        return {"sub-header": sub, "type": name, "compression": (False,) * len(frames)}, frames

    def loads(self, header: dict[str, Any], frames: list[Any]) -> Any:
        """The family's deserializer: the object :meth:`dumps` sent, rebuilt over its frames.

        Raises
        ------
        DataLostError
            For a malformed header, a type or deserializer this process lacks, or
            frames that cannot be mapped: a ``ConnectionError``, so that Dask
            fetches the value again (or recomputes it) rather than leave the
            dependent task waiting.
        """
        try:
            try:
                name, sub = header["type"], header["sub-header"]
                body = sub[FRAMES_KEY]
                parts, cuda_header = body["parts"], body["header"]
            except (KeyError, TypeError, IndexError) as e:
                raise ProtocolError(f"device object header: missing field {e}") from None
            typ = _type_from_name(str(name))
            try:
                cuda_loads = cuda_deserialize.dispatch(typ)
            except TypeError:
                raise ProtocolError(f"device object header: no cuda deserializer for {name} here") from None
            return _loads_frames(typ, cuda_header, parts, frames, cuda_loads, self._cupy_serializer)
        except DataLostError:
            raise
        except Exception as e:
            raise DataLostError(f"a device object could not be received: {type(e).__name__}: {e}") from e


def _dumps_frames(
    x: Any, cuda_dumps: Callable[[Any], Any], cupy_serializer: Callable[[bool], Any]
) -> tuple[dict[str, Any], list[Any]]:
    """``x`` as its ``"cuda"`` header plus each device frame through the CuPy serializer ``cupy_serializer(False)``
    (see the module notes)."""
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
            dumps_cupy = cupy_serializer(False)
        header, part_frames = dumps_cupy(_raw_bytes(cupy, frame))
        parts.append({"device": header, "frames": len(part_frames)})
        out.extend(part_frames)
    return {FRAMES_KEY: {"header": sub, "parts": parts}}, out


def _raw_bytes(cupy: Any, frame: Any) -> Any:
    """A 1-D ``uint8`` CuPy array over ``frame``'s memory in memory order (no copy); ``ValueError`` when the frame
    is not one contiguous range (C or Fortran order)."""
    arr = cupy.asarray(frame)
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        raise ValueError(f"a device frame of shape {arr.shape} and strides {arr.strides} is not contiguous")
    if arr.nbytes == 0:
        return cupy.empty(0, dtype=cupy.uint8)
    return cupy.ndarray((int(arr.nbytes),), dtype=cupy.uint8, memptr=arr.data)


def _part_frames(part: Any) -> tuple[bool, int]:
    """``(on the device, frames)`` of one part of the header; :class:`ProtocolError` when it is neither kind."""
    if isinstance(part, dict) and len(part) == 1 and part.get("host") is True:
        return False, 1
    if (
        isinstance(part, dict)
        and len(part) == 2
        and isinstance(part.get("device"), dict)
        and type(part.get("frames")) is int
        and part["frames"] >= 0
    ):
        return True, part["frames"]
    raise ProtocolError(f"device object header: malformed part {part!r:.200}")


def _check_parts(parts: Any, nframes: int) -> list[tuple[bool, int]]:
    """Each part's :func:`_part_frames`; :class:`ProtocolError` unless they account for exactly ``nframes`` frames.
    (msgpack gives lists back as tuples.)"""
    if not isinstance(parts, list | tuple):
        raise ProtocolError(f"device object header: parts is a {type(parts).__name__}, not a list")
    kinds = [_part_frames(part) for part in parts]
    total = sum(n for _, n in kinds)
    if total != nframes:
        raise ProtocolError(f"device object header: {nframes} frames do not match its parts ({total})")
    return kinds


def _loads_frames(
    typ: type,
    cuda_header: Any,
    parts: Any,
    frames: list[Any],
    cuda_loads: Callable[..., Any],
    cupy_serializer: Callable[[bool], Any],
) -> Any:
    """Rebuild an object :func:`_dumps_frames` sent: each part back in device memory (through the CuPy deserializer
    ``cupy_serializer(True)``), then ``cuda_loads``.

    RMM's and Numba's deserializers read nothing, so they run here and the
    claims (and the copies into ``rmm.DeviceBuffer`` s) wait with the
    message's others. Any other may read its frames: it runs in a fill after
    the claims, off the event loop (:func:`~dask_gpupool.handoff.deferred.make_later`).
    """
    kinds = _check_parts(parts, len(frames))
    if not any(on_device for on_device, _ in kinds):
        return cuda_loads(cuda_header, list(frames))
    rmm = sys.modules.get("rmm")
    if rmm is not None and issubclass(typ, rmm.DeviceBuffer):
        return cuda_loads(cuda_header, _device_frames(parts, kinds, frames, _as_rmm_buffer, cupy_serializer))
    numba_cuda = sys.modules.get("numba.cuda")
    if numba_cuda is not None and issubclass(typ, numba_cuda.devicearray.DeviceNDArray):
        return cuda_loads(cuda_header, _device_frames(parts, kinds, frames, None, cupy_serializer))
    device_frames = _device_frames(parts, kinds, frames, None, cupy_serializer)
    return make_later(lambda: _rebuild(typ, cuda_header, device_frames, cuda_loads), device_frames.clear)


def _rebuild(typ: type, cuda_header: Any, device_frames: list[Any], cuda_loads: Callable[..., Any]) -> Any:
    """``cuda_loads`` over the frames, once their claims ran; with ``rmm.DeviceBuffer`` copies for a deserializer
    that refuses CuPy frames (as UCX gives frames when RMM is installed), logged once per type."""
    try:
        if typ not in _WANTS_RMM:
            try:
                return cuda_loads(cuda_header, device_frames)
            except (TypeError, AssertionError, ValueError, AttributeError) as e:
                if isinstance(e, GPUPoolError) or importlib.util.find_spec("rmm") is None:
                    raise
                logger.info(
                    "gpupool: the cuda deserializer of %s refused CuPy frames (%s: %s); it gets rmm.DeviceBuffer "
                    "copies",
                    typ.__name__,
                    type(e).__name__,
                    e,
                )
        obj = cuda_loads(cuda_header, _rmm_copies(device_frames))
        _WANTS_RMM.add(typ)
        return obj
    finally:
        device_frames.clear()  # the imports (and their leases) go with the caller's references, not ours


def _rmm_copies(frames: list[Any]) -> list[Any]:
    """Each device frame copied into a new ``rmm.DeviceBuffer`` on the GPU (:func:`_as_rmm_buffer`), finished when
    this returns: it runs in a fill, or with no collector open, where those copies run at once."""
    return [_as_rmm_buffer(f) if hasattr(f, "__cuda_array_interface__") else f for f in frames]


def _device_frames(
    parts: Any,
    kinds: list[tuple[bool, int]],
    frames: list[Any],
    to_frame: Callable[[Any], Any] | None,
    cupy_serializer: Callable[[bool], Any],
) -> list[Any]:
    """Each part of ``frames`` as its frame: host frames as they are, device parts as CuPy arrays (``to_frame``'d)."""
    loads_cupy = cupy_serializer(True)
    out: list[Any] = []
    i = 0
    for part, (on_device, n) in zip(parts, kinds, strict=True):
        if not on_device:
            out.append(frames[i])
            i += 1
            continue
        arr = loads_cupy(part["device"], list(frames[i : i + n]))
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
