"""Making a ``device`` pool's memory: what its segments are made of, and which GPUs may map it.

A ``device`` pool is a :class:`~dask_gpupool.memory.segments.SegmentedResource`
over an IPC-enabled cuda.core ``DeviceMemoryResource`` (which names the pool:
its UUID, the fd peers open first), with segments of VMM memory
(:class:`~dask_gpupool.memory.vmm.VmmMemoryResource`, one fd per segment) or
legacy IPC memory (:class:`~dask_gpupool.memory.legacy.LegacyMemoryResource`,
one IPC handle per segment): :func:`segment_memory_of` decides which. The
other GPUs of the process that can reach it are granted access here
(:func:`grant_peers`). :func:`device_resource` makes it all for
:meth:`Pool.create <dask_gpupool.memory.pool.Pool.create>`; loaded only by
workers with a ``device`` pool.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask_gpupool.config import PoolOptions
from dask_gpupool.errors import ConfigError
from dask_gpupool.memory.segments import SEGMENT_SIZE, SegmentedResource
from dask_gpupool.memory.topology import LocalDevices, device_memory

if TYPE_CHECKING:
    from cuda.core import Buffer

__all__ = ["device_resource", "grant_peers", "segment_memory_of"]

logger = logging.getLogger(__name__)


def _no_payload(buf: Buffer) -> bytes:
    """VMM segments carry no payload: peers fetch the segment's fd by id."""
    return b""


def _segment_payload(made_of: str) -> Any:
    """How a segment made of ``made_of`` (:func:`_segment_memory`'s) is named to peers in descriptors."""
    if made_of == "legacy":
        from dask_gpupool.memory.legacy import legacy_payload

        return legacy_payload
    return _no_payload


#: What each segment memory needs of the GPU, for the errors of :func:`_segment_memory`.
_NEEDS = {"vmm": "export virtual memory as POSIX fds", "legacy": "share memory by IPC handles"}


def _supported(made_of: str, ordinal: int) -> bool:
    """Whether GPU ``ordinal`` can make segments of ``made_of`` (``"vmm"`` or ``"legacy"``) memory."""
    if made_of == "legacy":
        from dask_gpupool.memory.legacy import legacy_supported

        return legacy_supported(ordinal)
    from dask_gpupool.memory.vmm import vmm_supported

    return vmm_supported(ordinal)


def segment_memory_of(
    options: PoolOptions, ordinal: int, supported: Callable[[str], bool], prefer_legacy: bool = False
) -> str:
    """What a ``device`` pool's segments on GPU ``ordinal`` are made of: ``"vmm"`` or ``"legacy"``.

    ``supported(made_of)`` says whether the GPU can make segments of that memory (:func:`_supported`; asked only
    as far as needed). ``segment-memory: auto`` is ``legacy`` when ``prefer_legacy`` (a worker that listens over
    UCX, which sends legacy IPC memory GPU to GPU as it is) and the GPU shares memory by IPC handles, else ``vmm``
    when it exports virtual memory as POSIX fds, else ``legacy``.

    Raises
    ------
    ConfigError
        For ``segment-memory: vmm`` on a GPU without VMM fd export, or ``legacy`` on one without IPC handles; and for
        any value on a GPU with neither, whose memory no other process can map: there the worker takes a ``pinned``
        or ``host`` pool (``gpupool.kind``), whose buffers other processes map without segments.
    """
    wanted = options.segment_memory
    if wanted == "auto":
        order = ("legacy", "vmm") if prefer_legacy else ("vmm", "legacy")
    else:
        order = (wanted, "legacy" if wanted == "vmm" else "vmm")
    made_of = next((m for m in order if supported(m)), None)
    if made_of is None:
        raise ConfigError(
            f"gpupool.kind={options.kind!r}: GPU {ordinal} can neither {_NEEDS['vmm']} nor {_NEEDS['legacy']}, "
            "so no other process can map a device pool's memory; valid here: gpupool.kind 'pinned' or 'host'"
        )
    if wanted not in ("auto", made_of):
        raise ConfigError(
            f"gpupool.segment-memory={wanted!r}: GPU {ordinal} cannot {_NEEDS[wanted]}; "
            f"valid here: {made_of!r} (or 'auto')"
        )
    return made_of


def _segment_memory(options: PoolOptions, ordinal: int, size: int, prefer_legacy: bool = False) -> tuple[str, Any]:
    """What a ``device`` pool's segments are made of (:func:`segment_memory_of`) and the resource they come from:
    a :class:`~dask_gpupool.memory.vmm.VmmMemoryResource` or a
    :class:`~dask_gpupool.memory.legacy.LegacyMemoryResource` of ``size`` bytes, owned by the caller.

    Raises
    ------
    ConfigError
        As :func:`segment_memory_of`.
    """
    made_of = segment_memory_of(options, ordinal, lambda m: _supported(m, ordinal), prefer_legacy)
    if made_of == "legacy":
        from dask_gpupool.memory.legacy import LegacyMemoryResource

        return made_of, LegacyMemoryResource(ordinal, size)
    from dask_gpupool.memory.vmm import VmmMemoryResource

    return made_of, VmmMemoryResource(ordinal, size)


def grant_peers(resource: Any, ordinal: int, devices: LocalDevices) -> tuple[str, ...]:
    """Grant every other visible GPU with peer access to GPU ``ordinal`` access to ``resource``.

    Done in the owner's process, before any import: on two H200s (driver 580)
    a peer that mapped this pool's buffers across GPUs while it was still
    growing, and had been granted access only in its own process, lost its
    CUDA context (``CUDA_ERROR_LAUNCH_FAILED`` during an import); with access
    granted here first, the same handoffs read the right bytes
    (``scripts/probes/two_gpu_handoff.py``; ``docs/design.md``, "Handoff").

    Returns the UUIDs of the GPUs granted access. A GPU that cannot reach
    ``ordinal`` (no peer access) is left out; so is every GPU when granting
    fails, which is logged: buffers then go to those GPUs as copies.
    """
    from cuda.core import Device

    others = [i for i in range(len(devices.uuids)) if i != ordinal and Device(i).can_access_peer(ordinal)]
    if not others:
        return ()
    try:
        resource.peer_accessible_by = set(others)
    except Exception as e:
        logger.warning("GPU %d: granting GPUs %s access to the pool failed (%s); they get copies", ordinal, others, e)
        return ()
    return tuple(devices.uuids[i] for i in others)


def device_resource(
    options: PoolOptions, devices: LocalDevices, ordinal: int, dev: Any, prefer_legacy: bool = False
) -> tuple[SegmentedResource, int, str, tuple[str, ...]]:
    """The resource of a ``device`` pool on GPU ``ordinal`` (``dev``, current), owned by the caller; its size, what
    its segments are made of, and the UUIDs of the GPUs granted access (:func:`grant_peers`).

    Raises
    ------
    ConfigError
        When the GPU does not support memory pools, for a ``max_size`` larger than its memory, and as
        :func:`segment_memory_of`.
    """
    if not dev.properties.memory_pools_supported:
        raise ConfigError(f"gpupool.kind='device': GPU {ordinal} does not support memory pools")
    size = options.max_size.resolve(device_memory(ordinal), f"GPU {ordinal} ({devices.uuids[ordinal]})")
    from cuda.core import DeviceMemoryResource, DeviceMemoryResourceOptions

    upstream = DeviceMemoryResource(dev, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=size))
    try:
        made_of, memory = _segment_memory(options, ordinal, size, prefer_legacy)
        peers = grant_peers(upstream, ordinal, devices)
    except BaseException:
        upstream.close()
        raise
    resource = SegmentedResource(upstream, min(SEGMENT_SIZE, size), ordinal, _segment_payload(made_of), memory)
    return resource, size, made_of, peers
