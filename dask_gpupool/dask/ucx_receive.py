"""Where distributed-ucxx receives device frames: an RMM pool, not a ``cudaMalloc`` each.

distributed-ucxx 0.52 receives every device frame of a message into
``rmm.DeviceBuffer(size=n)`` from RMM's current resource: its module global
``device_array``, set once by its ``init_once`` when the first UCX comm of the
process is made (before any worker plugin runs). On a worker whose RMM
resource is RMM's default, ``CudaMemoryResource``, that is a ``cudaMalloc`` per
frame, and a ``cudaFree``, which waits for the whole device, when the value
is released. dask-cuda's ``rmm_pool_size`` or ``distributed.rmm.pool-size``
put an RMM pool there; a plain UCX worker has none.

The worker plugin points ``device_array`` at :class:`ReceivePool`
(:func:`~dask_gpupool.dask.distributed_seam.workers.point_device_array`): an RMM
``PoolMemoryResource`` over ``CudaMemoryResource`` of at most
:data:`UCX_RECEIVE_POOL` bytes, made on the first frame. A frame that does
not fit under that ceiling is received as before (counted in
``receive_pool_misses``). The memory is ``cudaMalloc`` memory, which UCX's
``cuda_ipc`` and ``cuda_copy`` handle as they do any (receiving into the
plugin's own VMM pool instead was 2.5-5.8x slower at 1-4 MiB: UCX cannot
register it, ``docs/performance.md``).

Who owns what: each received frame is an ``rmm.DeviceBuffer`` that holds a
reference to the pool resource, so the resource (and its reserved memory)
lives until the last frame made from it is released, even after the plugin
is removed and ``device_array`` put back. No file descriptor is involved.

The pool gives blocks only to the comm reads the worker watches (its comm-read
wrapper, :func:`~dask_gpupool.dask.comms.read_then_fill`: the
reads of values from other workers), which tell it how they ended
(:data:`~dask_gpupool.dask.context.READ_BLOCKS`). The blocks of a read
that raised (cancelled, or its comm failed) may still be written by UCX: they
are parked in :data:`~dask_gpupool.memory.lifetime.QUARANTINE` for the
process's life, never given out again; at most the ceiling's worth, beyond
which frames come from RMM's resource. Any other read (a handler's on a comm
the worker accepted, a client's in the same process) gets its frames from
distributed-ucxx's own ``device_array``, as without the plugin.

It stands aside where someone else chose RMM's resource (an RMM pool,
``cudaMallocAsync``, managed memory): that resource already serves the frames,
and the user picked it (:func:`decide`).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from dask.utils import format_bytes

from dask_gpupool.dask.context import READ_BLOCKS, SYNCHRONIZED_DEVICE
from dask_gpupool.handoff.stats import HandoffStats

__all__ = ["UCX_RECEIVE_POOL", "ReceivePool", "comm_module", "current_resource", "decide"]

logger = logging.getLogger(__name__)

#: distributed-ucxx's comm module, whose ``device_array`` global this module replaces.
COMM_MODULE = "distributed_ucxx.ucxx"

#: The most device memory the receive pool may reserve. Without it distributed-ucxx 0.52 makes an
#: ``rmm.DeviceBuffer`` per frame from RMM's current resource: on a worker without an RMM pool a ``cudaMalloc`` and
#: later a ``cudaFree``. On one H100, four workers as two "hosts", pool arrays, each sample taken four ways back to
#: back in one cluster (benchmarks/ucx_pairs.py ``-recvrmm-ab``, 2026-11-25, docs/performance.md): other-host pairs
#: received into an RMM pool took 0.86 / 0.95 / 0.85x UCXX alone's path at 64 KiB / 1 MiB / 4 MiB, against 1.10 /
#: 1.10 / 1.08x with a ``cudaMalloc`` per frame. Frames that do not fit under it go to RMM's resource.
UCX_RECEIVE_POOL = 1 << 30


def decide(kind: str, over_ucx: bool, resource: str | None, device: int = 0) -> tuple[int, str]:
    """The ceiling of the receive pool (0: none) and why (``stats()["routing"]["ucx-receive"]``).

    Parameters
    ----------
    kind : str
        The worker's pool kind; only a ``device`` pool's worker gets a receive pool.
    over_ucx : bool
        Whether the worker listens over UCX and distributed-ucxx has set up its comm module (``device_array``).
    resource : str or None
        RMM's current resource for the worker's GPU: ``"default"`` (``CudaMemoryResource``), the class name of any
        other, or ``None`` when RMM is not installed.
    device : int
        The worker's GPU (ordinal in its process). A block given out again is safe from kernels still reading it
        only on the GPU distributed-ucxx synchronizes before it receives (device 0).
    """
    if not over_ucx:
        return 0, "off: this worker does not receive over UCX"
    if kind != "device":
        return 0, f"off: a {kind} pool's worker receives device frames as distributed-ucxx does"
    if resource is None:
        return 0, "off: RMM is not installed (distributed-ucxx needs it to receive device frames)"
    if device != SYNCHRONIZED_DEVICE:
        return 0, (
            f"off: the worker's GPU is device {device}, and distributed-ucxx synchronizes only device "
            f"{SYNCHRONIZED_DEVICE} before it receives"
        )
    if resource != "default":
        return 0, f"off: RMM's resource {resource} was set before the plugin and already serves device frames"
    return UCX_RECEIVE_POOL, (
        f"on: device frames received into an RMM pool of at most {format_bytes(UCX_RECEIVE_POOL)}"
    )


class ReceivePool:
    """``device_array`` for distributed-ucxx: frames from an RMM pool of at most ``ceiling`` bytes.

    Parameters
    ----------
    rmm : module
        The ``rmm`` package (passed in, so that this module imports it only where RMM is installed).
    ceiling : int
        Most bytes the pool reserves from ``cudaMalloc``; it grows on demand up to that (RMM's
        ``PoolMemoryResource``), from the first frame on.
    handoffs : HandoffStats
        Counts ``receive_pooled_bytes`` and ``receive_pool_misses``.
    fallback : callable
        ``fallback(n)``: the frame when the pool has no room (distributed-ucxx's own ``device_array``).

    Notes
    -----
    Runs on the worker's event loop (distributed-ucxx's ``read``), on the worker's GPU. Each frame is an
    ``rmm.DeviceBuffer`` that owns its allocation and keeps the pool resource alive; dropping it returns the memory
    to the pool, stream-ordered on the default stream. A frame of a read that raised is never dropped: the read's
    :class:`~dask_gpupool.dask.context.ReadBlocks` parks it, since UCX may still write into it (module
    docstring). A block given out again is written by UCX only after
    distributed-ucxx's ``read`` has synchronized the whole device (``ucxx._cuda_context.synchronize_default_stream``
    is cuda.core's ``Device(0).sync()``), so kernels of any stream that still read the value it held have ended, as
    a ``cudaFree`` would have waited for them. That holds on device 0 only: a worker on another ordinal gets no
    receive pool (:func:`decide`).
    """

    def __init__(self, rmm: Any, ceiling: int, handoffs: HandoffStats, fallback: Any) -> None:
        self._rmm = rmm
        self.ceiling = ceiling
        self._handoffs = handoffs
        self._fallback = fallback
        self._resource: Any = None

    @property
    def fallback(self) -> Any:
        """What frames the pool does not take come from: the ``device_array`` that was in place before it."""
        return self._fallback

    def device_array(self, n: int) -> Any:
        """A device buffer of ``n`` bytes for a frame: from the pool, else from ``fallback``.

        From the pool only inside a read the worker watches (:data:`~dask_gpupool.dask.context.READ_BLOCKS`
        open), which holds the block until it knows whether the read completed; outside one, from ``fallback``
        (not counted).
        """
        read = READ_BLOCKS.get()
        if read is None or not read.open:
            return self._fallback(n)
        resource = self._resource
        if resource is None:
            resource = self._resource = self._make()
        if resource is not False and n <= self.ceiling:
            try:
                buf = self._rmm.DeviceBuffer(size=n, mr=resource)
            except MemoryError:  # the pool is at its ceiling
                pass
            except Exception:  # anything else: logged once, and from then on RMM's resource for every frame
                logger.warning("gpupool: the UCX receive pool failed; frames use RMM's resource", exc_info=True)
                self._resource = False
            else:
                read.blocks.append(buf)
                self._handoffs.add(receive_pooled_bytes=n)
                return buf
        self._handoffs.add(receive_pool_misses=1)
        return self._fallback(n)

    def reserved(self) -> int:
        """Bytes the pool holds from ``cudaMalloc`` now (0 before the first frame)."""
        resource = self._resource
        return int(resource.pool_size()) if resource else 0

    def _make(self) -> Any:
        mr = self._rmm.mr
        try:
            return mr.PoolMemoryResource(mr.CudaMemoryResource(), initial_pool_size=0, maximum_pool_size=self.ceiling)
        except Exception:
            logger.warning("gpupool: the UCX receive pool could not be made; frames use RMM's resource", exc_info=True)
            return False


def comm_module() -> Any | None:
    """distributed-ucxx's comm module if it is imported and has set ``device_array`` (its ``init_once`` ran)."""
    module = sys.modules.get(COMM_MODULE)
    if module is None or getattr(module, "device_array", None) is None:
        return None
    return module


def current_resource(device: int) -> str | None:
    """RMM's current resource for ``device``, as :func:`decide` takes it (``None``: RMM is not installed)."""
    try:
        import rmm.mr
    except ImportError:
        return None
    resource = rmm.mr.get_per_device_resource(device)
    return "default" if type(resource) is rmm.mr.CudaMemoryResource else type(resource).__name__
