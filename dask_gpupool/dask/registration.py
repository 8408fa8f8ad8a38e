"""What this package registers with distributed's serialization, in order, and CuPy's registration.

:func:`register_serializers` (``dask_gpupool`` calls it when imported; idempotent): cuda.core ``Buffer`` in the
``"dask"`` family (:mod:`~dask_gpupool.dask.dask_family`) and the ``"cuda"`` family
(:mod:`~dask_gpupool.dask.cuda_family`), NumPy's ``"dask"`` serializers in front of distributed's own, ``sizeof``
and dask-cuda's ``is_device_object`` of Buffers, the ``gpupool-frames`` family
(:mod:`~dask_gpupool.dask.frames_family`), and CuPy's serializers (:func:`register_cupy`, at once when CuPy is
imported, else on its first dispatch). All through Dask's public registration API (``Dispatch.register``,
``register_lazy``, ``register_serialization_family``); what needs distributed's internals is in
:mod:`~dask_gpupool.dask.distributed_seam` (the ``"pickle"`` family counted, the ``"dask"`` and ``"cuda"``
families made to register CuPy's first, ``copyreg`` for Buffers).

Ours are registered in front of distributed's own NumPy and CuPy serializers, which they are given
(``previous``) and send every array over no pool buffer to.
"""

from __future__ import annotations

import sys
from typing import Any

from cuda.core import Buffer
from distributed.protocol import dask_deserialize, dask_serialize

from dask_gpupool.dask import cuda_family, dask_family
from dask_gpupool.dask.dask_family import buffer_from_header
from dask_gpupool.dask.distributed_seam import workers as seam
from dask_gpupool.dask.frames_family import FAMILY, FramesFamily

__all__ = ["cupy_dask_serializer", "register_cupy", "register_serializers"]


def register_serializers() -> None:
    """Register this package's serializers with distributed (idempotent)."""
    from dask.sizeof import sizeof
    from distributed.protocol.cuda import cuda_deserialize, cuda_serialize
    from distributed.protocol.serialize import register_serialization_family

    dask_serialize.register(Buffer)(dask_family.serialize_buffer)
    dask_deserialize.register(Buffer)(buffer_from_header)
    _register_numpy()
    sizeof.register(Buffer)(_sizeof_buffer)
    try:
        from dask_cuda.is_device_object import is_device_object
    except ImportError:
        pass
    else:
        is_device_object.register(Buffer)(_is_device_buffer)
    seam.pickle_buffers_as_copies()
    seam.count_pickled_copies()
    if not seam.registered_family(FAMILY):  # used only where frames_family.serializers_for names it
        family = FramesFamily(cupy_dask_serializer)
        register_serialization_family(FAMILY, family.dumps, family.loads)
    if sys.modules.get("cupy") is not None:  # imported already (None: an import that is blocked)
        register_cupy()
    else:
        # Replaces distributed's lazy hooks for CuPy with ours, which run theirs first. They run only if CuPy's first
        # dispatch finds no serializer registered for ``cupy.ndarray``; but importing ``distributed.protocol.cupy``
        # registers distributed's directly (a user's import, or distributed's own lazy hook of another family), and a
        # dispatch then finds those and never runs ours: a client's read of a pool array's header then reached
        # distributed's deserializer (``KeyError: 'shape'``). So the two families also register ours first when CuPy
        # is imported and they are not yet (a string compare otherwise).
        for dispatch in (dask_serialize, dask_deserialize, cuda_serialize, cuda_deserialize):
            dispatch.register_lazy("cupy")(register_cupy)
        seam.ensure_first("cupy", _ensure_cupy)
    cuda_serialize.register(Buffer)(cuda_family.serialize_buffer)
    cuda_deserialize.register(Buffer)(cuda_family.deserialize_buffer)


def _sizeof_buffer(buf: Buffer) -> int:
    return int(buf.size)


def _is_device_buffer(buf: Buffer) -> bool:
    return bool(buf.is_device_accessible and not buf.is_host_accessible)


def _with_context(fn: Any) -> Any:
    """``fn`` as ``f(x, context)``, whether or not it takes ``context`` (decided once, not per call:
    ``inspect.signature`` cost 15 µs per array, eight times distributed's own NumPy serializer)."""
    from dask.utils import has_keyword

    if has_keyword(fn, "context"):
        return lambda x, context: fn(x, context=context)
    return lambda x, context: fn(x)


def _register_numpy() -> None:
    """NumPy's ``"dask"`` serializers: ours, over distributed's own (registered first)."""
    import numpy as np
    from distributed.protocol import numpy as _distributed_numpy  # noqa: F401  (its registrations first)

    previous_loads = dask_deserialize.dispatch(np.ndarray)
    if getattr(previous_loads, "__gpupool__", False):
        return  # registered already
    previous_dumps = _with_context(dask_serialize.dispatch(np.ndarray))
    dumps, loads = dask_family.array_serializers("numpy", previous_dumps, previous_loads)
    loads.__gpupool__ = True  # type: ignore[attr-defined]
    dask_serialize.register(np.ndarray)(dumps)
    dask_deserialize.register(np.ndarray)(loads)


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


def _ensure_cupy() -> None:
    if _cupy_registered == "no":
        register_cupy()


def _register_cupy_now() -> None:
    """CuPy's ``"dask"`` and ``"cuda"`` serializers: ours, over distributed's (registered first)."""
    import cupy
    from distributed.protocol import cupy as _distributed_cupy  # noqa: F401  (its registrations first)
    from distributed.protocol.cuda import cuda_deserialize, cuda_serialize

    previous_dumps = _with_context(dask_serialize.dispatch(cupy.ndarray))
    previous_loads = dask_deserialize.dispatch(cupy.ndarray)
    dumps, loads = dask_family.array_serializers("cupy", previous_dumps, previous_loads)
    dask_serialize.register(cupy.ndarray)(dumps)
    dask_deserialize.register(cupy.ndarray)(loads)
    cuda_dumps, cuda_loads = cuda_family.cupy_serializers(
        cuda_serialize.dispatch(cupy.ndarray), cuda_deserialize.dispatch(cupy.ndarray)
    )
    cuda_serialize.register(cupy.ndarray)(cuda_dumps)
    cuda_deserialize.register(cupy.ndarray)(cuda_loads)


def cupy_dask_serializer(deserialize: bool) -> Any:
    """The ``"dask"`` family's CuPy serializer (or deserializer), ours registered first (the ``gpupool-frames``
    family sends each device frame through it)."""
    import cupy

    register_cupy()
    return (dask_deserialize if deserialize else dask_serialize).dispatch(cupy.ndarray)
