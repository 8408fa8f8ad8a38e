"""Device memory UCX can send between processes: where pool memory is copied before it goes as device frames.

UCX sends a device frame to another process of the host through its
``cuda_ipc`` transport only from memory it can export. UCX 1.21 (what
distributed-ucxx 0.52 needs) exports ``cuMemAlloc`` memory (legacy IPC
handles) and, through fabric handles only, pool and VMM memory. dask_gpupool's
pool and VMM memory allows POSIX file descriptors, not fabric handles, so UCX
moved it through host memory: 2.3 s for 1 GiB on an H100, where ``cuMemAlloc``
memory took 4.5 ms (docs/performance.md). UCX 1.22 adds POSIX file
descriptors for VMM memory (openucx/ucx#11183), yet under distributed-ucxx
0.52 it still sent our pool memory through host fragments (16 MiB in over
200 ms on an H100, docs/performance.md), so device frames of pool memory are
copied here first with either version.

The receiving side of ``cuda_ipc`` opens each exported allocation once and
caches the mapping (about 1 ms per new allocation), so freed staging memory is
kept for reuse: at most :data:`KEEP_PER_CLASS` free allocations of each size
class and :data:`KEEP_BYTES` in all, per process. Sizes are rounded up to a
power of two up to 64 MiB, to a multiple of 64 MiB above.

Ownership: a :class:`UcxStaging` owns its allocation until it is collected; the
allocation then goes back to the process's free list, or is freed
(``cuMemFree``, in the context it was made in) when the list is full. Reuse
is safe while a copy into it may still run: every copy is on the legacy
default stream, so the next one is ordered after it, and ``cuMemFree`` waits
for the GPU. A copy not waited for keeps its source alive with it. Reuse is
not safe while a peer's UCX may still read the memory: a UCX reply keeps its
staging blocks until the requester's "OK", and one that ended without it
parks them (:class:`~dask_gpupool.memory.lifetime.Quarantine`) until the
requester's process exits, or for this process's life; only then are they
collected and come back here.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

from dask_gpupool.memory.topology import current_gpu

__all__ = ["KEEP_BYTES", "KEEP_PER_CLASS", "UcxStaging", "free_kept"]

#: Free staging allocations kept for reuse, per size class and in all (bytes), per process.
KEEP_PER_CLASS = 2
KEEP_BYTES = 4 << 30

_lock = threading.Lock()
#: (context handle as int, size class) -> free allocations [(context, pointer)]. Truly per process: the free
#: allocations of this process, kept because the receiving side's UCX caches its mapping of each allocation (a
#: pool service's lifetime does not bound them: a UCX reply's staging outlives it when it is quarantined).
_free: dict[tuple[int, int], list[tuple[Any, int]]] = {}
_kept_bytes = 0
#: GPU ordinal -> its primary context (as int), once made current here: a thread where it is current already
#: skips making it current again. Truly per process: the primary contexts of this process.
_contexts: dict[int, int] = {}


def size_class(nbytes: int) -> int:
    """The allocation size a staging copy of ``nbytes`` bytes gets."""
    if nbytes <= 1 << 20:
        return 1 << 20
    if nbytes <= 64 << 20:
        return 1 << (nbytes - 1).bit_length()
    return -(-nbytes // (64 << 20)) * (64 << 20)


class UcxStaging:
    """``nbytes`` of ``cuMemAlloc`` device memory on GPU ``device``, kept or freed when collected.

    Raises
    ------
    RuntimeError
        When the driver cannot allocate (the GPU is full).
    """

    ptr: int
    nbytes: int
    #: Seconds spent in ``cuMemAlloc`` for this staging memory (0.0: a kept allocation was reused).
    alloc_s: float
    #: What owns the memory a copy still in flight reads (:meth:`copy_of` without ``wait``), else ``None``.
    source: Any

    def __init__(self, nbytes: int, device: int) -> None:
        from cuda.bindings import driver

        err, ctx = driver.cuCtxGetCurrent()
        _check(err, "cuCtxGetCurrent")
        if not int(ctx) or _contexts.get(device) != int(ctx):
            current_gpu(device)  # serializers also run in Dask's offload thread, with no context current
            err, ctx = driver.cuCtxGetCurrent()
            _check(err, "cuCtxGetCurrent")
            _contexts[device] = int(ctx)
        size = size_class(nbytes)
        key = (int(ctx), size)
        ptr = _take(key)
        self.alloc_s = 0.0
        if ptr is None:
            start = time.perf_counter()
            err, dptr = driver.cuMemAlloc(size)
            if err == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY and free_kept():
                err, dptr = driver.cuMemAlloc(size)  # the kept ones were in the way
            _check(err, f"cuMemAlloc({size})")
            ptr = int(dptr)
            self.alloc_s = time.perf_counter() - start
        self.ptr = ptr
        self.nbytes = nbytes
        self.source = None
        weakref.finalize(self, _give, key, ctx, ptr)

    @classmethod
    def copy_of(cls, ptr: int, nbytes: int, device: int, *, source: Any = None, wait: bool = True) -> UcxStaging:
        """A copy of the ``nbytes`` bytes at ``ptr`` on GPU ``device``, made on the legacy default stream.

        ``wait``: return once the copy is done. Without it the copy may still
        be running when this returns: for a caller whose comm synchronizes the
        GPU before it sends a device frame (distributed-ucxx does, with
        ``cuCtxSynchronize``), which makes a second synchronize here pure
        cost. ``source`` (what owns the memory at ``ptr``) is then kept alive
        as long as the staging memory, so that the memory cannot be freed and
        reused under a copy still in flight.
        """
        from cuda.bindings import driver

        staged = cls(nbytes, device)
        stream = driver.CUstream(0)  # the legacy default stream: ordered after the pool's work on it
        _check(driver.cuMemcpyDtoDAsync(staged.ptr, ptr, nbytes, stream)[0], "cuMemcpyDtoDAsync")
        if wait:
            _check(driver.cuStreamSynchronize(stream)[0], "cuStreamSynchronize")
        else:
            staged.source = source
        return staged


def _take(key: tuple[int, int]) -> int | None:
    global _kept_bytes
    with _lock:
        free = _free.get(key)
        if not free:
            return None
        _kept_bytes -= key[1]
        return free.pop()[1]


def _give(key: tuple[int, int], ctx: Any, ptr: int) -> None:
    global _kept_bytes
    with _lock:
        free = _free.setdefault(key, [])
        if len(free) < KEEP_PER_CLASS and _kept_bytes + key[1] <= KEEP_BYTES:
            free.append((ctx, ptr))
            _kept_bytes += key[1]
            return
    _release(ctx, ptr)


def free_kept() -> int:
    """Free every kept staging allocation of this process; returns the bytes freed."""
    global _kept_bytes
    with _lock:
        kept = [(key, entry) for key, entries in _free.items() for entry in entries]
        _free.clear()
        _kept_bytes = 0
    for _key, (ctx, ptr) in kept:
        _release(ctx, ptr)
    return sum(key[1] for key, _ in kept)


def _release(ctx: Any, ptr: int) -> None:
    from cuda.bindings import driver

    if driver.cuCtxPushCurrent(ctx)[0] != driver.CUresult.CUDA_SUCCESS:
        return  # the context is gone (the process is exiting): so is the memory
    try:
        driver.cuMemFree(ptr)
    finally:
        driver.cuCtxPopCurrent()


def _check(err: Any, what: str) -> None:
    from cuda.bindings import driver

    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err!r}")
