"""Tasks whose inputs and outputs travel through Dask: pool buffers and arrays, made, read and checked."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

from dask_gpupool.dask.api import current_service
from dask_gpupool.testing.memory import read_bytes, write_bytes

if TYPE_CHECKING:
    from cuda.core import Buffer


def make_buffer(nbytes: int, data: bytes) -> Buffer:
    """Task: a Buffer from this worker's pool holding ``data`` at its start (the task's result)."""
    buf = current_service().pool.allocate(nbytes, wait=True)
    write_bytes(buf, data)
    return buf


def serializer_families(n: int) -> dict[str, str]:
    """Task: which serializer family distributed picks, with a UCX comm's list, for a pool array and a pool Buffer.

    ``"cuda"`` means device frames (UCX moves them GPU to GPU); ``"dask"`` means our serializer, a host copy
    outside a same-host TCP handoff.
    """
    from distributed.protocol import serialize

    ucx = ("cuda", "dask", "pickle", "error")
    arr = make_array(n)
    buf = current_service().pool.allocate(n, wait=True)
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

    buf = current_service().pool.allocate(n * 8, wait=True)
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


def plain_cupy_shaped(shape: tuple[int, ...]) -> Any:
    """Task: ``cupy.arange`` as float64 in ``shape`` (``()``: a 0-d array; a 0 in it: an empty one), plain CuPy."""
    import math

    import cupy

    arr = cupy.arange(math.prod(shape), dtype="f8").reshape(shape)
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
    buf = current_service().pool.allocate(nbytes, wait=True)
    write_bytes(buf, data)
    buf.close()


def fill(nbytes: int, value: int) -> Buffer:
    """Task: a pool Buffer of ``nbytes`` with every byte set to ``value`` (GPU memset or memset)."""
    buf = current_service().pool.allocate(nbytes, wait=True)
    set_all(buf, value)
    return buf


_SLOW_FILL = r"""
extern "C" __global__ void slow_fill(unsigned char* p, long long n, unsigned char value, long long spin_ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)spin_ns);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        p[i] = value;
}
"""


def slow_fill(nbytes: int, value: int, spin_ms: float, stream: str = "default") -> Buffer:
    """Task: a pool Buffer that a kernel fills with ``value`` after spinning ``spin_ms``; returned without waiting.

    The kernel runs on CuPy's current stream (``"default"``) or on a new
    non-blocking stream (``"nonblocking"``), and the task returns while it
    still runs: a consumer that read before the producer's GPU finished would
    see the pool's old bytes (:func:`all_equal` tells). For the ordering tests
    of ``gpupool.handoff-ordering``.
    """
    import cupy

    buf = current_service().pool.allocate(nbytes, wait=True)
    with cupy.cuda.Device(buf.device_id):
        kernel = cupy.RawKernel(_SLOW_FILL, "slow_fill")
        s = cupy.cuda.Stream(non_blocking=True) if stream == "nonblocking" else cupy.cuda.get_current_stream()
        with s:
            mem = cupy.cuda.UnownedMemory(int(buf.handle), nbytes, buf, device_id=buf.device_id)
            out = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
            kernel((256,), (256,), (out, cupy.int64(nbytes), cupy.uint8(value), cupy.int64(int(spin_ms * 1e6))))
    return buf


def slow_plain_cupy(nbytes: int, value: int, spin_ms: float) -> Any:
    """Task: a CuPy array from CuPy's own allocator that a kernel on the current stream fills with ``value`` after
    spinning ``spin_ms``; returned without waiting (the ordering tests of staged copies)."""
    import cupy

    with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):  # not the pool, whatever allocator CuPy has
        out = cupy.empty(nbytes, dtype=cupy.uint8)
    kernel = cupy.RawKernel(_SLOW_FILL, "slow_fill")
    kernel((256,), (256,), (out, cupy.int64(nbytes), cupy.uint8(value), cupy.int64(int(spin_ms * 1e6))))
    return out


def plain_fill(nbytes: int, value: int) -> Any:
    """Task: ``nbytes`` uint8 all ``value`` from the array library's own allocator, not this worker's pool.

    NumPy on a worker with a ``host`` pool; CuPy (its own memory pool, whatever allocator CuPy has) otherwise, filled on
    CuPy's current stream and returned without waiting, as a task's result is. Sent to a same-host worker, such
    an array is staged into the pool (:mod:`dask_gpupool.dask.plain_arrays`).
    """
    if current_service().pool.kind == "host":
        import numpy as np

        return np.full(nbytes, value, dtype=np.uint8)
    import cupy

    with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
        return cupy.full(nbytes, value, dtype=cupy.uint8)


def tracked_plain_fill(nbytes: int, value: int) -> Any:
    """Task: :func:`plain_fill`, whose array this worker tracks by a weak reference (:func:`tracked_alive`)."""
    import weakref

    from distributed import get_worker

    arr = plain_fill(nbytes, value)
    get_worker().__dict__.setdefault("_gpupool_test_tracked", []).append(weakref.ref(arr))
    return arr


def tracked_alive(dask_worker: Any) -> int:
    """client.run target: how many arrays :func:`tracked_plain_fill` made on this worker are still alive."""
    import gc

    gc.collect()
    return sum(ref() is not None for ref in dask_worker.__dict__.get("_gpupool_test_tracked", []))


def spin(spin_ms: float, stream: str = "default") -> int:
    """Task: queue a kernel that spins ``spin_ms`` on CuPy's current stream (``"default"``) or on a new non-blocking
    stream (``"nonblocking"``) and return at once (a worker whose GPU is still busy with a later task, or with
    another stream's work, when it answers a transfer)."""
    import cupy

    dummy = cupy.empty(1, dtype=cupy.uint8)
    kernel = cupy.RawKernel(_SLOW_FILL, "slow_fill")
    s = cupy.cuda.Stream(non_blocking=True) if stream == "nonblocking" else cupy.cuda.get_current_stream()
    with s:
        kernel((1,), (32,), (dummy, cupy.int64(0), cupy.uint8(0), cupy.int64(int(spin_ms * 1e6))))
    return 0


def array_equal(x: Any, value: int) -> bool:
    """Task: whether every element of array ``x`` equals ``value``."""
    return bool((x == value).all())


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


def device_object(kind: str, n: int) -> Any:
    """Task: ``arange(n)`` as float64 in an ``rmm.DeviceBuffer`` (``kind="rmm"``) or a Numba device array."""
    import numpy as np

    host = np.arange(n, dtype="f8")
    if kind == "rmm":
        import rmm

        return rmm.DeviceBuffer.to_device(host.view("u1"))
    import numba.cuda

    return numba.cuda.to_device(host)


def check_device_object(x: Any, n: int) -> str:
    """Task: ``"<type name>:ok"`` when ``x`` (from :func:`device_object`) holds ``arange(n)``, else ``":wrong"``."""
    import numpy as np

    got = x.copy_to_host()
    if type(x).__module__.startswith("rmm"):
        got = np.asarray(got).view("f8")
    ok = np.array_equal(np.asarray(got), np.arange(n, dtype="f8"))
    return f"{type(x).__name__}:{'ok' if ok else 'wrong'}"


def scribble_all(nbytes: int, value: int) -> None:
    """Task: allocate ``nbytes`` from this pool, set every byte to ``value``, free it."""
    buf = current_service().pool.allocate(nbytes, wait=True)
    set_all(buf, value)
    buf.close()


def all_equal(x: Any, value: int) -> bool:
    """Task: whether every byte of a Buffer is ``value``, read where it lives (GPU or CPU)."""
    import numpy as np

    from dask_gpupool import as_array

    if x.is_device_accessible:
        import cupy

        arr = as_array(x, (x.size,), "u1", like="cupy")
        if x.size < 1 << 30:
            ok = bool((arr == value).all())
        else:
            # One pass over the whole grid that only raises a flag: no temporary as large as the buffer (an 8 or
            # 16 GiB handoff must not need that much more memory on the consumer), no single-block reduction.
            bad = cupy.zeros(1, dtype=cupy.int32)
            _differs(cupy)(arr, cupy.uint8(value), bad)
            ok = int(bad.get()[0]) == 0
        cupy.cuda.runtime.deviceSynchronize()
        return ok
    return bool((np.frombuffer(read_bytes(x), dtype="u1") == value).all())


_DIFFERS: Any = None


def _differs(cupy: Any) -> Any:
    """The CuPy kernel of :func:`all_equal`: ``bad[0] = 1`` where a byte differs from ``v``."""
    global _DIFFERS
    if _DIFFERS is None:
        _DIFFERS = cupy.ElementwiseKernel("T x, T v", "raw int32 bad", "if (x != v) bad[0] = 1;", "gpupool_differs")
    return _DIFFERS


#: Views of a 400-element array, by name: every layout a handoff must describe (shape, strides, offset).
LAYOUTS = {
    "slice": lambda xp, a: a[3:350:2],
    "transpose": lambda xp, a: a.reshape(20, 20).T,
    "negative-strides": lambda xp, a: a.reshape(20, 20)[::-1, ::-3],
    "broadcast": lambda xp, a: xp.broadcast_to(a[:7], (5, 7)),
    "zero-d": lambda xp, a: a[5:6].reshape(()),
    "empty": lambda xp, a: a[:0],
    "fortran": lambda xp, a: a[2:, 3:],  # of a Fortran-ordered copy of the 20 x 20 array, made in the pool
}


def view_of(x: Any, layout: str) -> Any:
    """Task: the ``layout`` view (:data:`LAYOUTS`) of array ``x``, no copy (``fortran`` copies once, in the pool)."""
    module = "cupy" if type(x).__module__.startswith("cupy") else "numpy"
    if module == "cupy":
        import cupy as xp
    else:
        import numpy as xp
    if layout == "fortran":
        from dask_gpupool import as_array

        size = x.dtype.itemsize
        f = as_array(current_service().pool.allocate(x.nbytes), (20, 20), x.dtype, (size, 20 * size), like=module)
        f[...] = x.reshape(20, 20)
        return LAYOUTS[layout](xp, f)
    return LAYOUTS[layout](xp, x)


def plain_view(n: int, layout: str) -> Any:
    """Task: the ``layout`` view (:data:`LAYOUTS`, or ``"whole"``) of ``cupy.arange(n)`` as float64, all from CuPy's
    own allocator, not the pool (``fortran``: of a Fortran-ordered copy CuPy makes). Staged when sent."""
    import cupy

    with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
        x = cupy.arange(n, dtype="f8")
        if layout == "whole":
            return x
        if layout == "fortran":
            x = cupy.asfortranarray(x.reshape(20, 20))
        return LAYOUTS[layout](cupy, x)


def as_nested_list(x: Any) -> Any:
    """Task: the values of array ``x`` as nested Python lists (and its shape), wherever it lives."""
    if type(x).__module__.startswith("cupy"):
        x = x.get()
    return {"shape": list(x.shape), "values": x.tolist()}


def try_write(x: Any) -> str:
    """Task: write into array ``x`` in place; ``"wrote"`` or the error's type name."""
    try:
        x[...] = 0
    except Exception as e:
        return type(e).__name__
    return "wrote"


def pickled_copy(x: Buffer, which: str) -> dict[str, Any]:
    """Task: a pool Buffer (own or imported) through ``pickle`` or ``cloudpickle`` (``which``), and what came back:
    its type, size, first 8 bytes (and the original's), and whether it is the same memory."""
    import pickle

    import cloudpickle

    dumps = {"pickle": pickle.dumps, "cloudpickle": cloudpickle.dumps}[which]
    before = read_bytes(x, 8)
    copy = pickle.loads(dumps(x))
    after = read_bytes(copy, 8)
    same = int(copy.handle) == int(x.handle)
    return {"type": type(copy).__name__, "size": int(copy.size), "before": before, "after": after, "same": same}
