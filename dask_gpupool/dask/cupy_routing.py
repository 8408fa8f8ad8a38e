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

__all__ = ["decide", "install", "uninstall"]

logger = logging.getLogger(__name__)


def decide(setting: bool | None, kind: str) -> tuple[bool, str]:
    """Whether to route CuPy into a pool of ``kind``, and why: ``gpupool.cupy-allocator`` resolved.

    ``None`` (``auto``) leaves CuPy's allocator alone: with
    ``gpupool.stage-threshold`` (on for ``device`` pools by default) a plain
    CuPy array sent to a same-host worker is copied into the pool on the GPU
    and handed over, which measured as fast or faster than routing every
    CuPy allocation into the pool (docs/performance.md, "Workloads"), and
    works beside any allocator (dask-cuda's RMM pool included). The reason is
    what ``stats()["routing"]["cupy"]`` shows.
    """
    if kind not in ("device", "pinned"):
        return False, f"off: a {kind} pool holds no GPU memory"
    if setting is None and kind == "pinned":
        return False, "off (auto): CuPy keeps its allocator"
    if setting is None:
        return False, (
            "off (auto): CuPy keeps its allocator; arrays from gpupool.stage-threshold up are copied into the "
            "pool on the GPU when a same-host worker asks"
        )
    if not setting:
        return False, "off (gpupool.cupy-allocator: false)"
    return True, "pool (gpupool.cupy-allocator: true)"


def foreign_allocator() -> str | None:
    """The name of CuPy's current allocator when it is not CuPy's default memory pool (nor ours); else ``None``."""
    import cupy

    current = cupy.cuda.get_allocator()
    if current == cupy.get_default_memory_pool().malloc or getattr(current, "_gpupool", False):
        return None
    owner = getattr(current, "__self__", None)
    name = getattr(current, "__qualname__", None) or type(current).__qualname__
    module = getattr(current, "__module__", None) or type(owner if owner is not None else current).__module__
    return f"{module}.{name}"


def install(service: PoolService) -> tuple[Any, str | None]:
    """Make the pool CuPy's allocator.

    Returns the allocator it replaced (for :func:`uninstall`) and, when that was not CuPy's own pool, its name
    (:func:`foreign_allocator`; logged as a WARNING).
    """
    import cupy

    from dask_gpupool.dask.views import VIEWS, device_of

    found = foreign_allocator()
    if found is not None:
        logger.warning(
            "gpupool.cupy-allocator: true replaces CuPy's allocator %s (installed before the plugin): CuPy now "
            "allocates from pool %s, and %s serves CuPy no more on this worker",
            found,
            service.pool.uuid,
            found,
        )
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

    allocate._gpupool = True  # type: ignore[attr-defined]  # foreign_allocator: ours, not another's
    cupy.cuda.set_allocator(allocate)
    logger.info("pool %s: CuPy allocates from it", service.pool.uuid)
    return previous, found


def uninstall(previous: Any) -> None:
    """Give CuPy back the allocator :func:`install` replaced."""
    import cupy

    cupy.cuda.set_allocator(previous)
