"""Array views over pool Buffers (:func:`as_array`), and which pool buffer an array lies in.

Every array :func:`as_array` makes is recorded (by address range, weakly) so
that a serializer can find the pool buffer under any array, or any view of
one, that it is asked to send (:func:`pool_buffer_of`). The view does not own
the memory: it keeps its Buffer alive, and the Buffer's owner frees it.
"""

from __future__ import annotations

import bisect
import functools
import sys
import threading
import weakref
from typing import Any

from cuda.core import Buffer

__all__ = ["as_array", "described", "pool_buffer_of", "read_only"]


def pool_buffer_of(value: Any) -> Buffer | None:
    """The Buffer a value would be handed over from: itself, or the pool buffer an array views."""
    if isinstance(value, Buffer):
        return value
    if not VIEWS:
        return None
    module = type(value).__module__.split(".", 1)[0]
    if module == "numpy":
        return viewed_buffer(value, int(value.__array_interface__["data"][0]))
    if module == "cupy":
        return viewed_buffer(value, int(value.data.ptr))
    return None


def described(value: Any) -> bool:
    """Whether an array header (``ArrayMeta.dtype``, the ``dtype.str``) rebuilds ``value``'s dtype (a Buffer: yes).

    Not for structured dtypes, whose ``dtype.str`` (``"|V12"``) says neither
    their fields nor their offsets, nor for any other dtype that string does
    not rebuild: such arrays go through distributed's serializer (a copy),
    which keeps them.
    """
    dtype = getattr(value, "dtype", None)
    return dtype is None or _rebuilt_by_str(dtype)


@functools.lru_cache(maxsize=256)
def _rebuilt_by_str(dtype: Any) -> bool:
    import numpy as np

    try:
        return bool(np.dtype(dtype.str) == dtype)
    except TypeError:
        return False


def viewed_buffer(arr: Any, ptr: int) -> Buffer | None:
    """The live pool buffer holding all of array ``arr`` (data at ``ptr``), if any."""
    if not VIEWS or arr.dtype.hasobject:
        return None
    low, high = _byte_bounds(ptr, tuple(arr.shape), tuple(arr.strides), arr.dtype.itemsize)
    return VIEWS.find(low, high) if high > low else None


class ViewIndex:
    """Buffers that :func:`as_array` made arrays over, by address range (weakly held).

    Several live Buffers may start at one address: two imports of one
    allocation (fetched under two keys) share one mapping, each its own
    Buffer and lease. Each is kept until it dies, so the arrays of either
    are found as long as that one lives.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._entries: dict[int, list[tuple[int, weakref.ref[Buffer]]]] = {}
        self._lock = threading.Lock()

    def add(self, buf: Buffer) -> None:
        start, size = int(buf.handle), int(buf.size)
        with self._lock:
            entries = self._entries.get(start)
            if entries is None:
                bisect.insort(self._starts, start)
                entries = self._entries[start] = []
            if not any(ref() is buf for _size, ref in entries):
                entries.append((size, weakref.ref(buf, self._on_death(start))))

    def _on_death(self, start: int) -> Any:
        def callback(_ref: Any) -> None:
            self._remove(start)

        return callback

    def _remove(self, start: int) -> None:
        with self._lock:
            entries = self._entries.get(start)
            if entries is None:
                return
            entries[:] = [(size, ref) for size, ref in entries if ref() is not None]
            if not entries:
                del self._entries[start]
                i = bisect.bisect_left(self._starts, start)
                if i < len(self._starts) and self._starts[i] == start:
                    del self._starts[i]

    def find(self, low: int, high: int) -> Buffer | None:
        """A live buffer holding ``[low, high)``, if any."""
        with self._lock:
            i = bisect.bisect_right(self._starts, low) - 1
            if i < 0:
                return None
            start = self._starts[i]
            entries = list(self._entries[start])
        for size, ref in entries:
            buf = ref()
            if buf is not None and not buf.is_closed and high <= start + size:
                return buf
        return None

    def __bool__(self) -> bool:
        return bool(self._starts)


VIEWS = ViewIndex()


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
    shape : int or tuple of int
        As for ``numpy.ndarray``.
    dtype : numpy.dtype or str
        As for ``numpy.ndarray``; object dtypes are refused. An array of a
        structured dtype is sent as a copy, not handed over (:func:`described`).
    strides : tuple of int, optional
        In bytes; default C order.
    offset : int, optional
        In bytes from the start of ``buf``; default 0.
    like : {"cupy", "numpy"}, optional
        The array type. Default: CuPy for GPU-accessible memory (``device``
        and ``pinned`` pools), NumPy for ``host`` pools. ``pinned`` memory can
        be viewed either way.

    Returns
    -------
    cupy.ndarray or numpy.ndarray
        A view: no copy, and the array keeps ``buf`` alive. A NumPy view of
        memory received from another worker (an imported Buffer) is
        read-only, for good (:func:`read_only`): it is that worker's memory.

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
        strides = c_strides(shape, dt)  # () for a 0-d array
    elif len(strides) != len(shape):
        raise ValueError(f"shape {shape} and strides {strides} differ in length")
    low, high = _byte_bounds(int(buf.handle) + offset, shape, strides, dt.itemsize)
    if low < int(buf.handle) or high > int(buf.handle) + buf.size:
        raise ValueError(f"an array of shape {shape}, strides {strides} at offset {offset} does not fit {buf!r}")
    if like is None:
        like = "cupy" if buf.is_device_accessible else "numpy"
    if like not in ("cupy", "numpy") or (like == "cupy" and not buf.is_device_accessible):
        raise ValueError(f"cannot view {buf!r} as a {like} array")
    if like == "numpy" and not buf.is_host_accessible:
        raise ValueError(f"{buf!r} is GPU memory: view it with like='cupy'")
    VIEWS.add(buf)
    if like == "cupy":
        import cupy

        mem = cupy.cuda.UnownedMemory(int(buf.handle), buf.size, buf, device_id=device_of(buf))
        return cupy.ndarray(shape, dt, cupy.cuda.MemoryPointer(mem, offset), strides=strides)
    import ctypes

    anchor = (ctypes.c_char * buf.size).from_address(int(buf.handle))
    anchor._buf = buf  # the array keeps the Buffer alive through it
    if _received(buf):  # another worker's memory: read-only for good
        return _read_only_view(anchor, shape, dt, offset, strides)
    return np.ndarray(shape, dt, buffer=anchor, offset=offset, strides=strides)


def _received(buf: Buffer) -> bool:
    """Whether ``buf`` is another worker's memory mapped here (an import), not this process's own."""
    imported = sys.modules.get("dask_gpupool.handoff.imported")  # not loaded: no import was made here
    return imported is not None and isinstance(buf.memory_resource, imported.ImportedMemoryResource)


def read_only(arr: Any) -> Any:
    """The NumPy view ``arr`` made by :func:`as_array`, again and read-only for good.

    Over a read-only buffer, so that NumPy refuses to make it, or any view
    of it, writable (``flags.writeable = True`` raises ``ValueError``);
    clearing the flag alone leaves it settable, since the ctypes array under
    it is writable. It keeps the Buffer alive as ``arr`` does.
    """
    import ctypes

    anchor = arr.base  # the ctypes array over the whole Buffer (as_array), which keeps the Buffer alive
    offset = int(arr.__array_interface__["data"][0]) - ctypes.addressof(anchor)
    return _read_only_view(anchor, arr.shape, arr.dtype, offset, arr.strides)


def _read_only_view(anchor: Any, shape: Any, dt: Any, offset: int, strides: Any) -> Any:
    """An array over ctypes array ``anchor`` through a read-only memoryview (which keeps ``anchor`` alive)."""
    import numpy as np

    flat = np.frombuffer(memoryview(anchor).toreadonly(), np.uint8)
    return np.ndarray(shape, dt, buffer=flat, offset=offset, strides=strides)


def c_strides(shape: tuple[int, ...], dt: Any) -> tuple[int, ...]:
    strides, step = [], dt.itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def device_of(buf: Buffer) -> int:
    dev = int(buf.device_id)
    if dev >= 0:
        return dev
    from cuda.core import Device

    return int(Device().device_id)
