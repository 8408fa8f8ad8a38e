"""Buffers of any kind, read and written from the host: the copy primitives every layer uses.

``copy_to_host`` / ``copy_from_host`` move bytes between host memory and a
cuda.core ``Buffer`` of any kind (device memory with the driver's
synchronous copies, host-accessible memory with ``memmove``);
``host_buffer`` wraps host bytes as a ``Buffer`` that owns them. None of
these keeps a reference to its arguments after it returns.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

from dask_gpupool.memory.host import HostOnlyResource
from dask_gpupool.memory.topology import current_gpu

if TYPE_CHECKING:
    from cuda.core import Buffer

__all__ = ["buffer_kind", "copy_from_host", "copy_to_host", "host_buffer"]


def buffer_kind(buf: Buffer) -> str:
    """``"device"``, ``"pinned"`` or ``"host"``: where a Buffer's memory is."""
    if buf.is_device_accessible:
        return "pinned" if buf.is_host_accessible else "device"
    return "host"


def copy_to_host(buf: Buffer, offset: int, nbytes: int, out: Any = None) -> Any:
    """``nbytes`` of ``buf`` from ``offset`` in host memory (a writable buffer).

    Host-accessible memory is copied with ``memmove``; device memory with
    ``cuMemcpyDtoH`` (synchronous) after making the buffer's device current.
    ``out`` (any writable buffer of ``nbytes``) receives the bytes if given.
    """
    if out is None:
        out = bytearray(nbytes)
    if nbytes == 0:
        return out
    dst = (ctypes.c_char * nbytes).from_buffer(out)
    src = int(buf.handle) + offset
    if buf.is_host_accessible:
        ctypes.memmove(dst, src, nbytes)
    else:
        from cuda.bindings import driver

        current_gpu(buf.device_id)
        (err,) = driver.cuMemcpyDtoH(ctypes.addressof(dst), src, nbytes)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpyDtoH of {nbytes} bytes failed: {err!r}")
    del dst
    return out


def copy_from_host(buf: Buffer, data: Any) -> None:
    """Copy a host buffer (bytes-like) to the start of ``buf``; synchronous."""
    import numpy as np

    view = memoryview(data).cast("B")
    n = view.nbytes
    if n == 0:
        return
    if n > buf.size:
        raise ValueError(f"{n} bytes do not fit a buffer of {buf.size}")
    src = np.frombuffer(view, dtype=np.uint8)  # no copy, read-only views too
    if buf.is_host_accessible:
        ctypes.memmove(int(buf.handle), src.ctypes.data, n)
        return
    from cuda.bindings import driver

    current_gpu(buf.device_id)
    (err,) = driver.cuMemcpyHtoD(int(buf.handle), src.ctypes.data, n)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemcpyHtoD of {n} bytes failed: {err!r}")


def host_buffer(data: Any) -> Buffer:
    """A Buffer over host memory owned by ``data`` (a writable bytes-like object). Needs no driver."""
    from cuda.core import Buffer

    view = memoryview(data).cast("B")
    nbytes = view.nbytes
    anchor = (ctypes.c_char * max(nbytes, 1)).from_buffer(view if nbytes else bytearray(1))
    return Buffer.from_handle(ctypes.addressof(anchor), nbytes, mr=_HostBytes(anchor, data))


class _HostBytes(HostOnlyResource):
    """The memory resource of one :func:`host_buffer`: keeps its bytes alive until the Buffer closes."""

    def __init__(self, anchor: Any, data: Any) -> None:
        self._keep: tuple[Any, Any] | None = (anchor, data)

    def allocate(self, size: int, *, stream: Any = None) -> Buffer:
        raise TypeError("a host_buffer's resource cannot allocate")

    def deallocate(self, ptr: Any, size: int, *, stream: Any = None) -> None:
        self._keep = None
