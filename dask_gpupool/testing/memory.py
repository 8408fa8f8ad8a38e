"""Reading and writing pool memory from tests, and mapping a peer's pool by hand (in worker processes or not)."""

from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING, Any

from dask_gpupool.dask.api import current_service
from dask_gpupool.wire.handoff import BufferDescriptor

if TYPE_CHECKING:
    from cuda.core import Buffer

_held: dict[str, Buffer] = {}
_held_lock = threading.Lock()


def _cpu_path(buf: Buffer) -> bool:
    return bool(buf.is_host_accessible)


def write_bytes(buf: Buffer, data: bytes) -> None:
    """Write ``data`` at the start of ``buf`` (host or device memory); synchronous."""
    if _cpu_path(buf):
        ctypes.memmove(int(buf.handle), data, len(data))
        return
    from cuda.bindings import driver
    from cuda.core import Device

    Device().set_current()
    src = ctypes.create_string_buffer(data, len(data))
    (err,) = driver.cuMemcpy(int(buf.handle), ctypes.addressof(src), len(data))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemcpy failed: {err!r}")


def read_bytes(buf: Buffer, nbytes: int | None = None) -> bytes:
    """Copy the first ``nbytes`` of ``buf`` (host or device memory) into ``bytes``."""
    n = buf.size if nbytes is None else nbytes
    if _cpu_path(buf):
        return ctypes.string_at(int(buf.handle), n)
    from cuda.bindings import driver
    from cuda.core import Device

    Device().set_current()
    out = ctypes.create_string_buffer(n)
    # cuMemcpy infers the direction (unified addressing): the source may be device or pinned host memory.
    (err,) = driver.cuMemcpy(ctypes.addressof(out), int(buf.handle), n)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemcpy failed: {err!r}")
    return out.raw


def hold(key: str, nbytes: int, data: bytes) -> dict[str, Any]:
    """Task: allocate from this worker's pool, write ``data``, keep the buffer; return its descriptor."""
    service = current_service()
    buf = service.pool.allocate(nbytes)
    write_bytes(buf, data)
    with _held_lock:
        _held[key] = buf
    return service.pool.export(buf).to_msg()


def held_count() -> int:
    """How many buffers :func:`hold` keeps in this process."""
    return len(_held)


def release(key: str) -> None:
    """Task: free a buffer made by :func:`hold`."""
    with _held_lock:
        buf = _held.pop(key)
    buf.close()


def read_bytes_of(key: str, nbytes: int) -> bytes:
    """Task: read a buffer made by :func:`hold` on this worker."""
    with _held_lock:
        buf = _held[key]
    return read_bytes(buf, nbytes)


def read_peer(desc: dict[str, Any], nbytes: int) -> bytes:
    """Task: map the buffer a peer described (mapping its pool once), read it, release it."""
    service = current_service()
    d = BufferDescriptor.from_msg(desc)
    buf = service.importer.import_buffer(d)
    try:
        return read_bytes(buf, nbytes)
    finally:
        service.importer.map_peer(d.pool).release(buf)


def read_peer_on_gpu(desc: dict[str, Any], nbytes: int) -> bytes:
    """Task: like :func:`read_peer`, but the GPU reads: copied on a stream into device memory first."""
    from cuda.core import Device, DeviceMemoryResource

    service = current_service()
    d = BufferDescriptor.from_msg(desc)
    buf = service.importer.import_buffer(d)
    dev = Device()
    dev.set_current()
    stream = dev.create_stream()
    mr = DeviceMemoryResource(dev)
    try:
        dst = mr.allocate(buf.size, stream=stream)
        dst.copy_from(buf, stream=stream)
        stream.sync()
        data = read_bytes(dst, nbytes)
        dst.close(stream)
        stream.sync()
        return data
    finally:
        service.importer.map_peer(d.pool).release(buf)
        stream.close()


def map_peer(pool: str) -> str:
    """Task: map a peer's pool; return the mapped resource's repr."""
    return repr(current_service().importer.map_peer(pool).resource)


def unmap(pool: str) -> None:
    """Task: close this worker's mapping of a peer's pool."""
    current_service().importer.mapped.unmap(pool)


def make_cuda_context() -> bool:
    """client.run target: make GPU 0's primary CUDA context current here, if this host has a GPU.

    A ``host``-pool worker on a GPU host makes a CUDA context once, at a moment
    not yet pinned down (docs/design.md, "Known gaps"); a test that compares fds with a
    baseline makes it first. Returns whether a GPU was there.
    """
    from dask_gpupool.memory.topology import local_devices

    if not local_devices().uuids:
        return False
    from cuda.core import Device

    Device(0).set_current()
    return True


def visible_devices() -> tuple[str, ...]:
    from dask_gpupool.memory.topology import local_devices

    return local_devices().uuids
