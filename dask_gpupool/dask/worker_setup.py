"""What a worker's setup decides, as plain functions: its registry row checked, what its stats say about routing,
and which task results get an event (the worker plugin, :mod:`~dask_gpupool.dask.worker_plugin`, applies them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cuda.core import Buffer
from dask.utils import format_bytes

from dask_gpupool import tuning
from dask_gpupool.config import PoolOptions
from dask_gpupool.dask.task_events import is_cupy_array
from dask_gpupool.dask.views import pool_buffer_of
from dask_gpupool.errors import PoolUnavailableError, ProtocolError
from dask_gpupool.handoff.routes import stage_threshold_of
from dask_gpupool.memory.topology import current_gpu, sleeping_event
from dask_gpupool.wire.registry import PoolRecord

if TYPE_CHECKING:
    from distributed import Worker

    from dask_gpupool.handoff.service import PoolService

__all__ = [
    "check_row",
    "default_stream_recorder",
    "listen_scheme",
    "segment_memory_line",
    "staging_line",
    "wants_event",
]


def check_row(record: PoolRecord, address: str) -> None:
    """Check this worker's registry row as the scheduler will (:meth:`PoolRecord.from_msg`) before it is sent.

    A row the scheduler refuses would leave the worker without a pool, and ``register_plugin`` waiting out the
    connect timeout and returning with no error: the scheduler answers no refusal, since a registration may come
    from another worker in this one's name. A row Dask cannot even send (a broker under a temporary directory whose
    path is not UTF-8) broke the worker's stream to the scheduler, and the worker closed.

    Raises
    ------
    PoolUnavailableError
        Naming the worker and what in its row the scheduler would refuse; its setup fails with it.
    """
    try:
        PoolRecord.from_msg(record.to_msg())
    except ProtocolError as e:
        raise PoolUnavailableError(
            f"worker {address}: the scheduler would refuse this worker's pool registration: {e}"
        ) from None


def listen_scheme(worker: Worker) -> str | None:
    """The scheme of the comm ``worker``'s peers reach it over (``"tcp"``, ``"ucxx"``, ...); ``None`` if unknown."""
    from distributed.comm import parse_address

    try:
        return str(parse_address(worker.address)[0])
    except Exception:
        return None


def segment_memory_line(options: PoolOptions, kind: str, made_of: str, over_ucx: bool) -> str:
    """``stats()["routing"]["segment-memory"]``: what a ``kind`` pool's segments are made of (``made_of``), and why."""
    if kind != "device":
        return f"none: a {kind} pool has no segments"
    if options.segment_memory != "auto":
        return f"{made_of} (gpupool.segment-memory)"
    if made_of == "legacy" and over_ucx:
        return "legacy (auto): this worker listens over UCX, which sends legacy IPC memory with no staging copy"
    if made_of == "legacy":
        return "legacy (auto): this GPU exports no virtual memory as POSIX fds"
    why = "this GPU shares no memory by IPC handle" if over_ucx else "this worker does not listen over UCX"
    return f"vmm (auto): {why}"


def staging_line(kind: str, has_cupy: bool, over_tcp: bool) -> str:
    """``stats()["routing"]["staging"]``: whether plain CuPy (``device`` pools) or NumPy (``host`` pools) results are
    staged into the pool, and why (not) (:func:`dask_gpupool.handoff.routes.stage_threshold_of`)."""
    if kind == "host":
        if not over_tcp:
            return "off: a host pool stages plain NumPy results over TCP and TLS only"
        low, high = format_bytes(tuning.HOST_STAGE_THRESHOLD), format_bytes(tuning.HOST_KEEP_RESIDENT)
        return f"on: plain NumPy results of {low} to {high} are staged into the pool for same-host workers"
    if kind != "device":
        return f"off: a {kind} pool stages no plain arrays"
    if not has_cupy:
        return "off: CuPy is not installed"
    threshold = stage_threshold_of(kind, over_tcp)
    if not threshold:
        return "off: over UCX, UCX copies plain CuPy arrays GPU to GPU"
    return f"on: plain CuPy results of {format_bytes(threshold)} or more are staged into the pool for same-host workers"


def default_stream_recorder(device: int | None) -> Callable[[], Any]:
    """``record()`` for :class:`TaskEvents`: a new cuda.core event on GPU ``device``'s default stream, now.

    Its ``sync()`` sleeps rather than spins (:func:`~dask_gpupool.memory.topology.sleeping_event`): an export waits on
    it for as long as the task's kernels run.
    """

    def record() -> Any:
        return sleeping_event(current_gpu(device).default_stream)

    return record


def wants_event(service: PoolService, stage_threshold: int) -> Callable[[Any], bool]:
    """Which stored task results get an event (:class:`TaskEvents`): CuPy arrays of ``stage_threshold`` bytes or
    more (staged after it; 0: none for that reason), and any over this worker's pool memory, whatever its size (a
    pool Buffer, an array over one): their export waits for that event rather than for the whole GPU
    (``gpupool.handoff-ordering: sync``)."""
    pool = service.pool

    def wanted(value: Any) -> bool:
        if isinstance(value, Buffer):
            return pool.owns(value)
        if not is_cupy_array(value):
            return False
        nbytes = int(value.nbytes)
        if stage_threshold and nbytes >= stage_threshold:
            return True
        return bool(nbytes) and pool_buffer_of(value) is not None

    return wanted
