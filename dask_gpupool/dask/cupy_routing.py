"""Route CuPy's allocations on a worker through its pool (``gpupool.cupy-allocator``).

Like dask-cuda's RMM setup, but with the worker's IPC-enabled pool: every
``cupy`` array a task makes lives in pool memory, so ``dask.array`` on CuPy
gets zero-copy handoffs without a change to user code. Each allocation is a
pool :class:`~cuda.core.Buffer` that the array's memory keeps alive (CuPy's
``UnownedMemory`` holds it); when CuPy frees the memory the Buffer goes back
to the pool. When the pool is full, CuPy's own allocator takes over for that
allocation (such arrays are copied, counted as fallback ``not-in-pool``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from dask_gpupool.errors import PoolExhaustedError

if TYPE_CHECKING:
    from dask_gpupool.handoff.service import PoolService

__all__ = ["install", "uninstall"]

logger = logging.getLogger(__name__)


def install(service: PoolService) -> Any:
    """Make the pool CuPy's allocator; return the allocator it replaced (for :func:`uninstall`)."""
    import cupy

    from dask_gpupool.dask.views import VIEWS, device_of

    previous = cupy.cuda.get_allocator()
    fallback = cupy.get_default_memory_pool().malloc

    def allocate(nbytes: int) -> Any:
        try:
            buf = service.allocate(max(int(nbytes), 1))
        except PoolExhaustedError:
            return fallback(nbytes)
        VIEWS.add(buf)  # arrays over it are recognized by the serializers, as for as_array
        mem = cupy.cuda.UnownedMemory(int(buf.handle), buf.size, buf, device_id=device_of(buf))
        return cupy.cuda.MemoryPointer(mem, 0)

    cupy.cuda.set_allocator(allocate)
    logger.info("pool %s: CuPy allocates from it", service.pool.uuid)
    return previous


def uninstall(previous: Any) -> None:
    """Give CuPy back the allocator :func:`install` replaced."""
    import cupy

    cupy.cuda.set_allocator(previous)
