"""Make RMM allocate from the worker's pool (``gpupool.rmm-allocator``).

With it on, the RMM pool that places buffers inside the pool's IPC segments
(:mod:`dask_gpupool.memory.rmm_placement`) becomes RMM's resource for the
worker's GPU, and CuPy's allocator RMM's: CuPy arrays and ``rmm.DeviceBuffer``
objects (and cuDF, which allocates through RMM) that tasks make live in
memory a same-host peer can map, and go to it zero-copy without the staging
copy of ``gpupool.stage-threshold``
(:func:`dask_gpupool.dask.plain_arrays.in_segments`). RMM's allocations are
C++ calls, not the Python call per allocation of ``gpupool.cupy-allocator``.

How it meets dask-cuda's RMM options (``rmm_pool_size``, ``rmm_async``,
``rmm_managed_memory``, which set RMM's resource before the plugin starts):
the plugin replaces that resource and says so (a WARNING, and
``stats()["routing"]["rmm"]``); buffers made before keep their own resource.
Managed memory cannot be exported over IPC; with this option it is no longer
what RMM gives. At ``auto`` (the default, off) or ``false``, dask-cuda's set-up
stays and staging covers it.

``auto`` is off: its GPU tests pass on two H200s (the twelfth session), and on
the ``dask.array`` workloads it was as fast as staging (0.83-1.07x of it,
docs/performance.md), so staging stays the default. The pool's ``used`` bytes do not count RMM's allocations,
and ``trim`` leaves the segments in place while RMM allocates from them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dask_gpupool.handoff.service import PoolService

__all__ = ["decide", "install", "uninstall"]

logger = logging.getLogger(__name__)


def decide(setting: bool | None, kind: str, rmm_placed: bool) -> tuple[bool, str]:
    """Whether to make RMM allocate from a pool of ``kind``, and why (``stats()["routing"]["rmm"]``).

    ``None`` (``auto``) leaves RMM's resource alone: ``gpupool.stage-threshold``
    copies what RMM allocated into the pool on the GPU when a same-host worker
    asks, which measured as fast as routing RMM into the pool
    (docs/performance.md), and works beside any resource (dask-cuda's
    included). ``rmm_placed``: the pool's segments are placed by RMM
    (``gpupool.suballocator`` ``rmm`` or ``auto`` with RMM installed, and
    ``segment-size`` not 0).
    """
    if setting is None:
        return False, (
            "off (auto): RMM keeps its resource; CuPy arrays and device frames from gpupool.stage-threshold up are "
            "copied into the pool on the GPU when a same-host worker asks"
        )
    if not setting:
        return False, "off (gpupool.rmm-allocator: false)"
    if kind != "device":
        return False, f"off: a {kind} pool holds no memory RMM allocates"
    if not rmm_placed:
        return False, "off: the pool's segments are not placed by RMM (gpupool.suballocator, segment-size, rmm)"
    return True, "pool (gpupool.rmm-allocator: true)"


def _name(resource: Any) -> str:
    return f"{type(resource).__module__}.{type(resource).__qualname__}"


def install(service: PoolService) -> tuple[Any, Any, str | None]:
    """Make the pool RMM's resource for the worker's GPU, and RMM CuPy's allocator (when CuPy is installed).

    Returns what it replaced, for :func:`uninstall`: RMM's resource, CuPy's
    allocator (``None`` without CuPy), and the name of RMM's resource when it
    was not RMM's default (dask-cuda's, for example; logged as a WARNING).
    """
    import importlib.util

    import rmm.mr

    segmented = service.pool.segmented
    device = service.pool.device
    assert segmented is not None and device is not None  # decide() checked both
    previous = rmm.mr.get_per_device_resource(device)
    replaced = None if isinstance(previous, rmm.mr.CudaMemoryResource) else _name(previous)
    resource = segmented.shared_rmm_resource()
    rmm.mr.set_per_device_resource(device, resource)
    if replaced is not None:
        logger.warning(
            "gpupool.rmm-allocator: true replaces RMM's resource %s (set before the plugin, dask-cuda's RMM options "
            "for example): RMM now allocates from pool %s on GPU %d; buffers made before keep theirs",
            replaced,
            service.pool.uuid,
            device,
        )
    cupy_previous = None
    if importlib.util.find_spec("cupy") is not None:
        import cupy
        from rmm.allocators.cupy import rmm_cupy_allocator

        cupy_previous = cupy.cuda.get_allocator()
        cupy.cuda.set_allocator(rmm_cupy_allocator)
    logger.info("pool %s: RMM (and CuPy through it) allocates from it", service.pool.uuid)
    return previous, cupy_previous, replaced


def uninstall(service: PoolService, previous: Any, cupy_previous: Any) -> None:
    """Give RMM and CuPy back what :func:`install` replaced."""
    import rmm.mr

    if service.pool.device is not None:
        rmm.mr.set_per_device_resource(service.pool.device, previous)
    if cupy_previous is not None:
        import cupy

        cupy.cuda.set_allocator(cupy_previous)
