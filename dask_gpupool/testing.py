"""Helpers that tests and benchmarks run inside worker processes.

Kept in the package (like ``distributed.utils_test``) so that spawned Nanny
workers can import them by name. Nothing here is used by the library itself.
"""

from __future__ import annotations

import collections
import ctypes
import os
import threading
from typing import TYPE_CHECKING, Any

from dask_gpupool.dask.api import current_service
from dask_gpupool.dask.worker_plugin import service_of
from dask_gpupool.wire.handoff import BufferDescriptor

if TYPE_CHECKING:
    from cuda.core import Buffer
    from distributed import Worker

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
    buf = service.allocate(nbytes)
    write_bytes(buf, data)
    with _held_lock:
        _held[key] = buf
    return service.export(buf).to_msg()


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
    buf = service.import_buffer(d)
    try:
        return read_bytes(buf, nbytes)
    finally:
        service.map_peer(d.pool).release(buf)


def read_peer_on_gpu(desc: dict[str, Any], nbytes: int) -> bytes:
    """Task: like :func:`read_peer`, but the GPU reads: copied on a stream into device memory first."""
    from cuda.core import Device, DeviceMemoryResource

    service = current_service()
    d = BufferDescriptor.from_msg(desc)
    buf = service.import_buffer(d)
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
        service.map_peer(d.pool).release(buf)
        stream.close()


def map_peer(pool: str) -> str:
    """Task: map a peer's pool; return the mapped resource's repr."""
    return repr(current_service().map_peer(pool).resource)


def open_fds() -> list[str]:
    """What every fd of this process points at."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return sorted(out)


def _fd_kind(target: str) -> str:
    """An fd's target without what differs between instances: ``socket:[123]`` -> ``socket``."""
    if target.startswith(("socket:", "pipe:")):
        return target.split(":", 1)[0]
    if target.startswith("/memfd:dask-gpupool"):
        return "/memfd:dask-gpupool"
    return target


def resources(dask_worker: Worker) -> dict[str, Any]:
    """client.run target: what this worker holds, to check that nothing leaked."""
    import gc

    service = service_of(dask_worker)
    gc.collect()
    service.releaser.flush()
    kinds = collections.Counter(_fd_kind(f) for f in open_fds())
    return {
        "fds": sum(kinds.values()),
        "fd_kinds": dict(kinds),
        "sockets": kinds["socket"],
        "memfds": kinds["/memfd:dask-gpupool"],
        "broker_connections": service.broker.connections,
        "mapped_pools": len(service.mapped),
        "used": service.stats().used,
        "held": len(_held),
        "leases": len(service.leases),
        "imports_held": service.releaser.live(),
        "pulls": 0 if service.copier is None else service.copier.transfers,
    }


def deserialize_headers(headers: list[dict[str, Any]], dask_worker: Worker) -> list[dict[str, Any]]:
    """client.run target (fuzzing): feed handoff headers to this worker's Buffer deserializer.

    Per header: the error it raised (``None`` if it gave a Buffer, which is
    closed at once), whether that error is one of ours, and which pools it
    newly mapped. Mappings made here are closed again at the end.
    """
    from cuda.core import Buffer
    from distributed.protocol import dask_deserialize

    from dask_gpupool.dask.serializers import KEY
    from dask_gpupool.errors import GPUPoolError

    service = service_of(dask_worker)
    loads = dask_deserialize.dispatch(Buffer)
    out = []
    mapped_here: set[str] = set()
    for header in headers:
        before = {r.pool for r in service.registry.records() if r.pool in service.mapped}
        error, typed = None, False
        try:
            loads({KEY: header}, [])
        except GPUPoolError as e:
            error, typed = f"{type(e).__name__}: {e}", True
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        after = {r.pool for r in service.registry.records() if r.pool in service.mapped}
        mapped_here |= after - before
        out.append({"error": error, "typed": typed, "mapped_new": sorted(after - before)})
    import gc

    gc.collect()
    service.releaser.flush()
    for pool in mapped_here:
        mapped = service.mapped.get(pool)
        if mapped is not None and mapped.imports == 0:
            service.mapped.unmap(pool)
    return out


def grant_unclaimed_lease(key: str, importer: str, dask_worker: Worker) -> int:
    """client.run target: grant ``importer`` a lease on this worker's value of ``key``, as an export would."""
    from dask_gpupool.handoff.service import _Exported

    buf: Any = dask_worker.data[key]
    return service_of(dask_worker).leases.grant(_Exported(buf, buf), int(buf.size), importer)


def last_transfer(dask_worker: Worker, key: str) -> float | None:
    """client.run target (benchmarks): duration of this worker's latest incoming transfer that carried ``key``."""
    for entry in reversed(dask_worker.transfer_incoming_log):
        if key in entry.get("keys", {}):
            return float(entry["duration"])
    return None


def has_cluster_token(dask_worker: Worker) -> bool:
    """client.run target: whether this worker got the cluster's membership token (not the token itself)."""
    return service_of(dask_worker).token is not None


def mapped_segments(dask_worker: Worker) -> int:
    """client.run target: segments of peers' pools this worker keeps mapped."""
    service = service_of(dask_worker)
    total = 0
    for r in service.registry.records():
        mapped = service.mapped.get(r.pool)
        total += mapped.segments if mapped is not None else 0
    return total


def unmap(pool: str) -> None:
    """Task: close this worker's mapping of a peer's pool."""
    current_service().mapped.unmap(pool)


def known_pools(dask_worker: Worker) -> list[str]:
    """client.run target: the pools in this worker's copy of the registry."""
    return sorted(r.pool for r in service_of(dask_worker).registry.records())


def make_cuda_context() -> bool:
    """client.run target: make GPU 0's primary CUDA context current here, if this host has a GPU.

    A ``host``-pool worker on a GPU host makes a CUDA context once, at a moment
    not yet pinned down (docs/gpu-checks.md); a test that compares fds with a
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


# -- handoff helpers: tasks whose inputs and outputs travel through Dask ----------------


def make_buffer(nbytes: int, data: bytes) -> Buffer:
    """Task: a Buffer from this worker's pool holding ``data`` at its start (the task's result)."""
    buf = current_service().allocate(nbytes)
    write_bytes(buf, data)
    return buf


def serializer_families(n: int) -> dict[str, str]:
    """Task: which serializer family distributed picks, with a UCX comm's list, for a pool array and a pool Buffer.

    ``"cuda"`` means device frames (UCX moves them GPU to GPU); ``"dask"`` means our serializer, a host copy
    outside a same-host TCP handoff (issue 16).
    """
    from distributed.protocol import serialize

    ucx = ("cuda", "dask", "pickle", "error")
    arr = make_array(n)
    buf = current_service().allocate(n)
    try:
        return {
            "pool array": serialize(arr, serializers=ucx)[0]["serializer"],
            "pool buffer": serialize(buf, serializers=ucx)[0]["serializer"],
        }
    finally:
        buf.close()


def make_array(n: int, like: str | None = None) -> Any:
    """Task: ``arange(n)`` as float64 in an array view over a pool buffer."""
    import numpy as np

    from dask_gpupool import as_array

    buf = current_service().allocate(n * 8)
    arr = as_array(buf, (n,), "f8", like=like)
    if type(arr).__module__.startswith("cupy"):
        import cupy

        arr[...] = cupy.arange(n, dtype="f8")
        cupy.cuda.runtime.deviceSynchronize()
    else:
        arr[...] = np.arange(n, dtype="f8")
    return arr


def plain_cupy(n: int) -> Any:
    """Task: ``cupy.arange(n)`` as float64, made by plain CuPy (pool memory only if CuPy is routed there)."""
    import cupy

    arr = cupy.arange(n, dtype="f8")
    cupy.cuda.runtime.deviceSynchronize()
    return arr


def every_other(x: Any) -> Any:
    """Task: ``x[::2]``, a strided view of the same memory."""
    return x[::2]


def keep(x: Any) -> Any:
    """Task: return the input itself (the consumer then holds the handed-over value)."""
    return x


def describe(x: Any) -> dict[str, Any]:
    """Task: how a value arrived here: imported from a peer (zero-copy) or not, and where it points."""
    from dask_gpupool.handoff.imported import ImportedMemoryResource

    if hasattr(x, "memory_resource"):
        buf = x
    else:  # an array view over a Buffer
        buf = _buffer_of(x)
    return {
        "type": f"{type(x).__module__}.{type(x).__name__}",
        "imported": isinstance(getattr(buf, "memory_resource", None), ImportedMemoryResource),
        "in_own_pool": buf is not None and current_service().pool.owns(buf),
    }


def _buffer_of(arr: Any) -> Any:
    from dask_gpupool.dask.views import VIEWS

    if type(arr).__module__.startswith("cupy"):
        ptr = int(arr.data.ptr)
    else:
        ptr = int(arr.__array_interface__["data"][0])
    return VIEWS.find(ptr, ptr + max(arr.nbytes, 1))


def head(x: Any, nbytes: int) -> bytes:
    """Task: the first ``nbytes`` of a Buffer, or of an array's data."""
    if hasattr(x, "memory_resource"):
        return read_bytes(x, nbytes)
    if type(x).__module__.startswith("cupy"):
        return bytes(x.get().tobytes()[:nbytes])
    return bytes(x.tobytes()[:nbytes])


def total(x: Any) -> float:
    """Task: the sum of an array (read where it lives)."""
    return float(x.sum())


def overwrite(buf: Buffer, data: bytes) -> None:
    """Task: write ``data`` at the start of ``buf`` (the producer's own copy of the key)."""
    write_bytes(buf, data)


def scribble(nbytes: int, data: bytes) -> None:
    """Task: allocate ``nbytes`` from this pool, fill its start with ``data``, free it."""
    buf = current_service().allocate(nbytes)
    write_bytes(buf, data)
    buf.close()


def handoff_counters(dask_worker: Worker) -> dict[str, Any]:
    """client.run target: handoff counters plus pool bytes."""
    service = service_of(dask_worker)
    import gc

    gc.collect()
    service.releaser.flush()
    return {**service.handoff_stats(), "used": service.stats().used}


def fill(nbytes: int, value: int) -> Buffer:
    """Task: a pool Buffer of ``nbytes`` with every byte set to ``value`` (GPU memset or memset)."""
    buf = current_service().allocate(nbytes)
    set_all(buf, value)
    return buf


def set_all(buf: Buffer, value: int) -> None:
    if buf.is_host_accessible:
        ctypes.memset(int(buf.handle), value, buf.size)
        return
    from cuda.bindings import driver
    from cuda.core import Device

    Device(buf.device_id).set_current()
    (err,) = driver.cuMemsetD8(int(buf.handle), value, buf.size)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemsetD8 failed: {err!r}")


def scribble_all(nbytes: int, value: int) -> None:
    """Task: allocate ``nbytes`` from this pool, set every byte to ``value``, free it."""
    buf = current_service().allocate(nbytes)
    set_all(buf, value)
    buf.close()


def all_equal(x: Any, value: int) -> bool:
    """Task: whether every byte of a Buffer is ``value``, read where it lives (GPU or CPU)."""
    import numpy as np

    from dask_gpupool import as_array

    if x.is_device_accessible:
        import cupy

        arr = as_array(x, (x.size,), "u1", like="cupy")
        ok = bool((arr == value).all())
        cupy.cuda.runtime.deviceSynchronize()
        return ok
    return bool((np.frombuffer(read_bytes(x), dtype="u1") == value).all())


def serialized_inline(keys: list[str], who: str, dask_worker: Worker) -> bool:
    """client.run target: whether a ``get_data`` for ``keys`` from ``who`` skips Dask's offload thread."""
    from dask_gpupool.dask.worker_internals import _inline_reply

    return _inline_reply(dask_worker, service_of(dask_worker), keys, who, "tcp")


# -- fault injection for the lease tests (tests/test_leases.py) ------------------------------


def block_imports(seconds: float) -> None:
    """client.run target: hold this process's import lock from a thread for ``seconds``.

    A handoff arriving meanwhile stops inside the import, after the exporter
    granted its lease and before this worker claims it: the window in which
    a stalled consumer used to lose its lease. The thread lets go by itself
    (the import may block this worker's event loop, so no later
    ``client.run`` could reach it).
    """
    from dask_gpupool.handoff.mappings import IMPORT_LOCK

    held = threading.Event()

    def hold() -> None:
        with IMPORT_LOCK:
            held.set()
            threading.Event().wait(seconds)

    threading.Thread(target=hold, name="gpupool-test-block-imports", daemon=True).start()
    held.wait(10)


def hide_broker(dask_worker: Worker) -> str:
    """client.run target: move this worker's broker socket aside (peers can no longer open a link); return the path."""
    service = service_of(dask_worker)
    os.rename(service.broker.address, service.broker.address + ".hidden")
    return service.broker.address


def restore_broker(dask_worker: Worker) -> None:
    """client.run target: undo :func:`hide_broker`."""
    service = service_of(dask_worker)
    os.rename(service.broker.address + ".hidden", service.broker.address)


def close_links(dask_worker: Worker) -> int:
    """client.run target: close this worker's links to exporters (as if each broke); return how many."""
    return service_of(dask_worker).importer.drop_links()


def stop_copy_server(dask_worker: Worker) -> None:
    """client.run target: close this worker's copy server (pulls from it then fail)."""
    service = service_of(dask_worker)
    assert service.copier is not None
    service.copier.close()


def forget_pool(pool: str, dask_worker: Worker) -> None:
    """client.run target: drop ``pool`` from this worker's copy of the registry (a stale or lying view)."""
    from dask_gpupool.wire.registry import RegistryUpdate

    registry = service_of(dask_worker).registry
    registry.apply(RegistryUpdate(version=registry.version, removed=(pool,)))


def lease_counts(dask_worker: Worker) -> dict[str, int]:
    """client.run target: live, unclaimed and held-import counts of this worker's leases."""
    service = service_of(dask_worker)
    import gc

    gc.collect()
    service.releaser.flush()
    return {
        "leases": len(service.leases),
        "unclaimed": service.leases.unclaimed,
        "held": service.releaser.live(),
        "resyncs": service.releaser.resyncs,
    }


# -- the event loop's responsiveness (tests/test_handoff.py) ---------------------------------


async def start_loop_ticks(dask_worker: Worker, interval: float = 0.01) -> None:
    """client.run target: tick on this worker's event loop every ``interval`` s, noting the longest gap."""
    import asyncio
    import time

    gaps = {"longest": 0.0, "ticks": 0}

    async def tick() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            gaps["longest"] = max(gaps["longest"], now - last)
            gaps["ticks"] += 1
            last = now

    dask_worker._gpupool_test_ticks = gaps  # type: ignore[attr-defined]
    dask_worker._gpupool_test_ticker = asyncio.ensure_future(tick())  # type: ignore[attr-defined]


async def stop_loop_ticks(dask_worker: Worker) -> dict[str, float]:
    """client.run target: stop :func:`start_loop_ticks`; the longest gap between ticks (s) and their count."""
    dask_worker._gpupool_test_ticker.cancel()  # type: ignore[attr-defined]
    return dict(dask_worker._gpupool_test_ticks)  # type: ignore[attr-defined]
