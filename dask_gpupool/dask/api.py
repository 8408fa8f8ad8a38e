"""Public functions: allocate inside a task, read the registry and pool stats from a client."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from dask_gpupool.core import UPDATE_OP
from dask_gpupool.errors import PoolExhaustedError, PoolUnavailableError
from dask_gpupool.ops.summary import HandoffTable, PoolTable
from dask_gpupool.wire.registry import PoolRecord

if TYPE_CHECKING:
    from cuda.core import Buffer
    from distributed import Client, Worker

    from dask_gpupool.handoff.service import PoolService

__all__ = ["allocate", "current_service", "pool_stats", "pools", "stats", "to_pool", "trim"]


def service_of(worker: Worker) -> PoolService:
    """:func:`dask_gpupool.dask.worker_plugin.service_of`, imported on first use.

    This module is imported with ``dask_gpupool`` by clients and the scheduler
    too; the worker stack loads only in processes that run these on a worker.
    """
    from dask_gpupool.dask.worker_plugin import service_of as _service_of

    return _service_of(worker)


def current_service() -> PoolService:
    """The pool service of the worker running the current task.

    Raises
    ------
    PoolUnavailableError
        Outside a task, or on a worker without the gpupool plugin.
    """
    from distributed import get_worker

    try:
        worker = get_worker()
    except ValueError:
        raise PoolUnavailableError("not running on a Dask worker; allocate() is for tasks") from None
    return service_of(worker)


def allocate(nbytes: int, stream: Any = None) -> Buffer:
    """Allocate ``nbytes`` from the current worker's pool. Call inside a task.

    Parameters
    ----------
    nbytes : int
        Size of the buffer.
    stream : cuda.core.Stream, optional
        Stream the allocation is ordered on (CUDA kinds); default: the
        device's default stream.

    Returns
    -------
    cuda.core.Buffer
        Owned by the caller; the memory goes back to the pool when the buffer
        is closed or garbage-collected. ``device`` pools give GPU memory,
        ``pinned`` and ``host`` pools give host memory.

    Raises
    ------
    PoolUnavailableError
        Outside a task on a worker that runs the plugin.
    PoolExhaustedError
        When the pool cannot hold ``nbytes`` more, even after a garbage collection (buffers that only reference
        cycles hold, such as a failed task's: docs/operations.rst); it says which peers' leases hold how much.
    """
    service = current_service()
    try:
        return service.pool.allocate(nbytes, stream, wait=True)
    except PoolExhaustedError as e:
        held = sorted(service.leases.bytes_by_importer().items(), key=lambda kv: -kv[1])
        if not held:
            raise
        holders = ", ".join(f"{peer}: {n} bytes" for peer, n in held)
        raise PoolExhaustedError(f"{e}; peers' leases hold {holders}") from None


def to_pool(array: Any) -> Any:
    """A copy of a NumPy or CuPy ``array`` in the current worker's pool, so that it hands over zero-copy.

    For a task that got its result from a library that allocates on its own
    (``dask.array`` chunks, CuPy's or NumPy's functions): returning
    ``to_pool(result)`` costs one copy here, on the producer, and saves the
    copies of every same-host transfer after it. An array in this worker's
    pool already, any array outside a worker with a pool (plain Dask, or
    the plugin not registered), a NumPy array on a worker whose pool is GPU
    memory (``device``) and a CuPy array on one whose pool is host memory
    (``host``) are returned as they are.

    Parameters
    ----------
    array : numpy.ndarray or cupy.ndarray
        The value to put in the pool (not changed).

    Returns
    -------
    cupy.ndarray or numpy.ndarray
        Same type, shape, dtype and values (C order), over a pool buffer;
        or ``array``.

    Raises
    ------
    PoolExhaustedError
        When the pool cannot hold the copy.
    TypeError
        For anything but a NumPy or CuPy array.
    """
    from dask_gpupool.dask.views import as_array, pool_buffer_of

    module = type(array).__module__.split(".", 1)[0]
    if module not in ("numpy", "cupy"):
        raise TypeError(f"to_pool takes a NumPy or CuPy array, not {type(array).__module__}.{type(array).__qualname__}")
    try:
        service = current_service()
    except PoolUnavailableError:
        return array
    held = pool_buffer_of(array)
    if held is not None and service.pool.owns(held):
        return array  # in this worker's pool already
    buf = service.pool.allocate(max(int(array.nbytes), 1), wait=True)
    if (module == "cupy" and not buf.is_device_accessible) or (module == "numpy" and not buf.is_host_accessible):
        # a host pool cannot hold a CuPy array, nor a device pool a NumPy one: leave it where it is
        buf.close()
        return array
    out = as_array(buf, tuple(array.shape), array.dtype, like=module)
    out[...] = array
    return out


def pools(client: Client) -> list[PoolRecord]:
    """The scheduler's registry: one :class:`PoolRecord` per pool.

    Parameters
    ----------
    client : distributed.Client
        A client of the cluster.

    Returns
    -------
    list of PoolRecord
        One row per registered pool, in no particular order.

    Raises
    ------
    PoolUnavailableError
        If the scheduler has no gpupool plugin.

    Notes
    -----
    On an asynchronous client (``Client(asynchronous=True)``) this returns an
    awaitable of the same, as Dask's own ``Client`` methods do:
    ``await pools(client)``.
    """
    result: list[PoolRecord] = client.sync(_pools, client)
    return result


async def _pools(client: Client) -> list[PoolRecord]:
    assert client.scheduler is not None, "the client is not connected"
    rows = await client.scheduler.gpupool_pools()
    if rows is None:  # Dask answers an unknown handler with None (and logs it)
        raise PoolUnavailableError("the scheduler has no gpupool registry; register dask_gpupool.GPUPool() first")
    return [PoolRecord.from_msg(r) for r in rows]


def _no_pool(dask_worker: Worker) -> dict[str, str] | None:
    """``{"error": why}`` where ``dask_worker`` has no pool, else ``None``: returned to ``client.run`` rather than
    raised, for which distributed logs a traceback on the worker at every call (``stats()``, ``info``, the page)."""
    try:
        service_of(dask_worker)
    except PoolUnavailableError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return None


def _worker_pool_stats(dask_worker: Worker) -> dict[str, Any]:
    if (no_pool := _no_pool(dask_worker)) is not None:
        return no_pool
    service = service_of(dask_worker)
    return {
        "pool": service.pool.uuid,
        "kind": service.pool.kind,
        **service.pool.stats().to_msg(),
        "mapped_pools": len(service.importer.mapped),
    }


def _per_worker(client: Client, fn: Any, timeout: float | None = None, table: type[dict[str, Any]] = dict) -> Any:
    """``fn`` run on every worker (``client.run``), each given ``timeout`` seconds to answer (default:
    ``distributed.comm.timeouts.connect``); a worker where it fails (no pool: its set-up failed) or that does not
    answer in time (stopped, or its event loop held) gets ``{"error": text}``, and the others answer as usual.
    The answers come in a ``table`` (a :class:`dict` or a :class:`~dask_gpupool.ops.summary.WorkerTable`).

    One ``client.run`` per worker, so that a worker that never answers (SIGSTOP) cannot hold back the others:
    ``client.run`` has no timeout, and one call to all of them waited for it with no end.

    On an asynchronous client, an awaitable of the same (``client.sync`` returns the coroutine there, as for
    Dask's own methods).
    """
    return client.sync(_per_worker_async, client, fn, timeout, table)


async def _per_worker_async(client: Client, fn: Any, timeout: float | None, table: type[dict[str, Any]]) -> Any:
    import asyncio

    import dask.config
    from dask.utils import parse_timedelta

    limit = parse_timedelta(dask.config.get("distributed.comm.timeouts.connect")) if timeout is None else timeout
    assert client.scheduler is not None, "the client is not connected"
    # Every worker: no ``n_workers``, which distributed before 2025.4 does not take (-1, all, is its default since).
    workers = list((await client.scheduler.identity())["workers"])

    async def one(worker: str) -> Any:
        try:
            got = await asyncio.wait_for(client.run(fn, workers=[worker], on_error="return", asynchronous=True), limit)
        except asyncio.TimeoutError:
            return TimeoutError(f"no answer within {limit:g} s")
        except Exception as e:  # the worker left while asked
            return e
        return got.get(worker, KeyError(f"{worker} left")) if isinstance(got, dict) else got

    results = dict(zip(workers, await asyncio.gather(*(one(w) for w in workers)), strict=True))
    return table(
        {w: {"error": f"{type(r).__name__}: {r}"} if isinstance(r, BaseException) else r for w, r in results.items()}
    )


def pool_stats(client: Client, timeout: float | None = None) -> PoolTable:
    """Per worker: its pool's used and reserved bytes (now and high-water) and mapped peer pools.

    Parameters
    ----------
    client : distributed.Client
        A client of the cluster.
    timeout : float, optional
        Seconds each worker has to answer; default ``distributed.comm.timeouts.connect``.

    Returns
    -------
    PoolTable
        ``{worker address: stats}``, a :class:`dict` that prints as a table (one line per worker, human sizes;
        ``.raw`` is the plain dict), with ``pool`` (its UUID), ``kind``,
        ``used``, ``used_high``, ``reserved``, ``reserved_high`` (bytes),
        ``max_size`` and ``mapped_pools`` (peers' pools mapped there). A worker without
        a pool (its set-up failed), or that did not answer within ``timeout``, is listed as ``{"error": why}``.

    Notes
    -----
    On an asynchronous client (``Client(asynchronous=True)``) this returns an
    awaitable of the same, as Dask's own ``Client`` methods do:
    ``await pool_stats(client)``.
    """
    result: PoolTable = _per_worker(client, _worker_pool_stats, timeout, PoolTable)
    return result


def _worker_handoff_stats(dask_worker: Worker) -> dict[str, Any]:
    if (no_pool := _no_pool(dask_worker)) is not None:
        return no_pool
    service = service_of(dask_worker)
    usage = service.pool.stats()
    return {"kind": service.pool.kind, "used": usage.used, "max_size": usage.max_size, **service.handoff_stats()}


def stats(client: Client, timeout: float | None = None) -> HandoffTable:
    """Per worker: its handoff counters.

    ``print(stats(client))`` shows a table, one line per worker: its pool's kind, used and maximum bytes, the bytes
    it received zero-copy, the buffers it handed over, the bytes copied in and out, the leases peers hold on its
    pool and its fallbacks by reason. Every counter is in ``stats(client)[worker]``.

    Parameters
    ----------
    client : distributed.Client
        A client of the cluster.
    timeout : float, optional
        Seconds each worker has to answer; default ``distributed.comm.timeouts.connect``.

    Returns
    -------
    HandoffTable
        ``{worker address: counters}``, a :class:`dict` that prints as that table (``.raw`` is the plain dict),
        with ``kind``, ``used`` and ``max_size`` (the pool's kind, bytes in use and upper bound), ``exports`` and
        ``imports`` (buffers handed over / mapped), ``forwards`` (imported buffers passed
        on as their exporter's memory), ``returns`` (values of this pool that
        came back from a peer: the buffer taken back), ``pool_bytes`` (bytes of this worker's own
        pool in use), ``leases`` and ``lease_bytes`` (live leases this worker granted and the bytes
        they keep alive: its memory lent to peers), ``borrowed_bytes`` (bytes of peers' pools this
        worker holds under their leases: counted by their owner, not here; see
        :mod:`~dask_gpupool.dask.spilling`),
        ``lease_bytes_by_peer`` (those bytes per importer),
        ``leases_unclaimed`` (granted, not claimed yet), ``leases_in_doubt``
        (claimed by a reply that failed: kept until the importer answers
        which it holds), ``leases_abandoned``
        (ended unclaimed: their transfer failed), ``imports_held`` (peers'
        leases this worker holds), ``resyncs`` (links opened again after one
        broke), ``zero_copy_bytes`` and ``copied_bytes`` (bytes this
        worker received by mapping / as host copies), ``copied_out_bytes``
        (bytes it sent as host copies), ``streamed_bytes`` and
        ``streamed_out_bytes`` (the part of those copies pulled over the
        streamed copy path), ``device_frames_bytes`` and
        ``device_frames_out_bytes`` (device frames received / sent on UCX
        comms), ``device_staged_bytes`` (the part of those sent that was pool
        memory staged for UCX), ``host_frames_bytes`` and
        ``host_frames_out_bytes`` (CuPy arrays below
        :data:`~dask_gpupool.tuning.UCX_HOST_FRAME_THRESHOLD` received / sent over UCX as a
        host frame), ``receive_pooled_bytes`` and ``receive_pool_misses``
        (device frames received over UCX into the receive pool, in bytes,
        and frames that did not fit under its ceiling:
        :mod:`~dask_gpupool.dask.ucx_receive`), ``pool_staged_bytes`` (arrays outside the
        pool copied into it before a handoff), ``fallbacks`` (same-host transfers that were
        copied, by reason), ``timings`` (where a handoff's time went, by step:
        ``{step: {"count", "total_s", "max_s", "hist"}}``, the histogram for
        :func:`~dask_gpupool.handoff.stats.quantile_s`; see
        :data:`~dask_gpupool.handoff.stats.TIMED_STEPS`), ``mapped_pools``, ``links``, ``pulls`` and
        ``staging_bytes`` (streamed copies being served, and the pinned staging
        kept for them), ``ucx_quarantined`` and ``ucx_quarantined_bytes`` (device
        frames of this process's UCX transfers that did not complete, and their
        bytes: kept out of reuse while UCX may still read or write them, until
        the peer's process exits or for the process's life;
        :class:`~dask_gpupool.memory.lifetime.Quarantine`), ``segments``, ``segments_retiring`` and
        ``segments_released`` (this pool's segments held and retired, and
        segment releases sent to peers), and ``routing`` (what and why:
        ``"staging"``, whether plain CuPy results are staged into the pool;
        ``"ucx-receive"``, where device frames received over UCX go; and
        ``"segment-memory"``, what the pool's segments are made of and why,
        see ``gpupool.segment-memory``). A worker without a pool (its set-up
        failed), or that did not answer within ``timeout``, is listed as ``{"error": why}``.

    Notes
    -----
    On an asynchronous client (``Client(asynchronous=True)``) this returns an
    awaitable of the same, as Dask's own ``Client`` methods do:
    ``await stats(client)``.
    """
    result: HandoffTable = _per_worker(client, _worker_handoff_stats, timeout, HandoffTable)
    return result


async def _worker_trim(dask_worker: Worker) -> dict[str, Any]:
    if (no_pool := _no_pool(dask_worker)) is not None:
        return no_pool
    service = service_of(dask_worker)
    row = service.retire_segments()
    if row is not None and service.registry_key is not None:
        # Over this worker's own stream, with its key (the scheduler takes row changes only from their worker):
        # peers learn retire_below from the update the scheduler then pushes. No key: not joined yet, and the
        # row it joins with is refreshed then.
        dask_worker.batched_stream.send({"op": UPDATE_OP, "record": row.to_msg(), "key": service.registry_key})
    counters = service.handoff_stats()
    staging = 0
    if "dask_gpupool.memory.ucx_staging" in sys.modules:  # loaded only once a value went to UCX as device frames
        staging = sys.modules["dask_gpupool.memory.ucx_staging"].free_kept()
    return {
        "retire_below": 0 if row is None else row.retire_below,
        "ucx_staging_freed": staging,
        "segments": counters["segments"],
        "segments_retiring": counters["segments_retiring"],
        "reserved": service.pool.stats().reserved,
    }


def trim(client: Client, timeout: float | None = None) -> dict[str, dict[str, Any]]:
    """Give pool memory back, on every worker.

    ``device`` pools retire their segments. Retired segments take no new
    buffers. Each is freed once no buffer lives in it and every peer that
    mapped it has unmapped it, which peers do as soon as none of their
    imports from it is alive (the retire protocol,
    :mod:`dask_gpupool.memory.segments`). New buffers go to new segments. ``host``
    pools give every free page back to the OS at once (large buffers' pages
    go back when they are freed anyway). ``pinned`` pools and ``device``
    pools without segments are left as they are. Device memory kept for
    sending pool memory over UCX (:mod:`dask_gpupool.memory.ucx_staging`) is freed.

    Parameters
    ----------
    client : distributed.Client
        A client of the cluster.
    timeout : float, optional
        Seconds each worker has to answer; default ``distributed.comm.timeouts.connect``.

    Returns
    -------
    dict
        ``{worker address: counters}`` right after the call: ``retire_below``
        (segment ids below it are retired; 0 without segments), ``segments``
        and ``segments_retiring`` (held, and retired but not freed yet), and
        ``reserved`` (bytes the pool holds), ``ucx_staging_freed`` (bytes of
        kept UCX staging memory freed). A worker without a pool (its set-up
        failed), or that did not answer within ``timeout``, is listed as ``{"error": why}``; the others are
        trimmed.

    Notes
    -----
    On an asynchronous client (``Client(asynchronous=True)``) this returns an
    awaitable of the same, as Dask's own ``Client`` methods do:
    ``await trim(client)``.
    """
    result: dict[str, dict[str, Any]] = _per_worker(client, _worker_trim, timeout)
    return result
