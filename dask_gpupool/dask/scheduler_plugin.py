"""The scheduler plugin: the pool registry, and the installer of the worker twin.

``client.register_plugin(GPUPool(...))`` (or ``--preload dask_gpupool``) is
all a user does: :meth:`GPUPool.start` adds the handlers and registers
:class:`~dask_gpupool.dask.worker_plugin.GPUPoolWorkerPlugin` on every worker,
present and future.

Only a worker changes the registry, and only its own row, over its own
batched stream (the ops of :mod:`dask_gpupool.core`): Dask calls these stream
handlers with ``worker=<the address of the stream's worker>``. Registration is
a handshake: ``gpupool-register`` (the row; it stays pending), the
:class:`Membership` (registry and token) sent back over that worker's stream
only, then ``gpupool-joined``, which publishes the row to every worker. So no
peer hands a worker anything, nor maps its pool, before it holds the token.
Rows leave with their worker (``remove_worker``). Clients get the read-only
``gpupool_pools`` RPC (and the ``/gpupool`` page); ``gpupool_register`` and
``gpupool_unregister`` called over RPC are refused. Refused messages are
logged (WARNING) and counted in :attr:`GPUPool.rejected`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

import dask.config
from dask.utils import parse_timedelta
from distributed import SchedulerPlugin
from distributed.core import error_message
from distributed.protocol import Serialized, deserialize
from distributed.protocol.pickle import dumps, loads

from dask_gpupool.config import PoolOptions
from dask_gpupool.core import JOINED_OP, MEMBERSHIP_OP, PLUGIN_NAME, REGISTER_OP, REGISTRY_OP, UNREGISTER_OP, UPDATE_OP
from dask_gpupool.errors import GPUPoolError, NotAMemberError, ProtocolError
from dask_gpupool.handoff.registry import PoolRegistry
from dask_gpupool.ops import dashboard as _dashboard
from dask_gpupool.ops import metrics as _metrics
from dask_gpupool.ops.dashboard import STATS_OP
from dask_gpupool.wire.registry import TOKEN_BYTES, Membership, PoolRecord, RegistryUpdate

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["GPUPool"]

logger = logging.getLogger(__name__)


class GPUPool(SchedulerPlugin):
    """Give every worker an IPC-enabled memory pool shared with same-host peers.

    Register it once; it installs its worker twin on every worker::

        client.register_plugin(dask_gpupool.GPUPool())

    Parameters
    ----------
    kind : {"auto", "device", "pinned", "host"}, optional
        Pool kind (``gpupool.kind``).
    device : int or str, optional
        The worker's GPU: ordinal or UUID (``gpupool.device``).
    max_size : int, float or str, optional
        Pool bound: bytes, "8 GiB", "50%" or 0.5 (``gpupool.max-size``).
    host_id : str, optional
        Host identity override (``gpupool.host-id``).
    broker_dir : str, optional
        Parent of each broker's private directory (``gpupool.broker-dir``).
    broker_timeout : str or float, optional
        Broker timeout (``gpupool.broker-timeout``).
    lease_timeout : str or float, optional
        After how long an unclaimed lease is logged, and how long a peer whose
        transfer failed gets copies (``gpupool.lease-timeout``); no timer ends a lease.
    peer_gpu_handoff : bool or "auto", optional
        Zero-copy handoffs to workers on another GPU (``gpupool.peer-gpu-handoff``).
    segment_size : int or str, optional
        Segments of ``device`` pools, e.g. ``"1 GiB"``; 0 for none (``gpupool.segment-size``).
    suballocator : {"auto", "rmm", "arena"}, optional
        What places buffers inside segments (``gpupool.suballocator``).
    segment_memory : {"auto", "vmm", "pool"}, optional
        What segments are made of (``gpupool.segment-memory``): ``vmm`` memory
        stays readable by peers after its owner died.
    import_limit : int or str, optional
        Largest CUDA allocation handed over zero-copy (``gpupool.import-limit``).
    cupy_allocator : bool, optional
        Route CuPy's allocations through the pool (``gpupool.cupy-allocator``).
    ucx_handoff_threshold : int or str, optional
        Smallest value handed over zero-copy on UCX comms (``gpupool.ucx-handoff-threshold``).
    copy_chunk_size, copy_stream_threshold : int or str, optional
        The pipelined copy path's chunk, and the smallest copy it carries
        (``gpupool.copy-chunk-size``, ``gpupool.copy-stream-threshold``).
    copy_streams : int, optional
        Connections one copy is pulled over (``gpupool.copy-streams``).
    stage_threshold : int or str, optional
        Smallest array outside the pool copied into it and handed over to a
        same-host worker (``gpupool.stage-threshold``; 0: never).

    Attributes
    ----------
    registry : PoolRegistry
        The registry (on the scheduler, once started): published rows only.
    rejected : collections.Counter
        Registry messages refused, by reason: ``"rpc"`` (``gpupool_register``
        or ``gpupool_unregister`` called over RPC), ``"client"`` (sent on a
        client's stream), ``"not-a-worker"``, ``"malformed"``,
        ``"another-worker"`` (the row or pool is another worker's),
        ``"row-changed"`` (an update changing more than ``retire_below``) and
        ``"not-its-row"`` (no such row of this worker). Each is logged once
        per message as a WARNING.

    Raises
    ------
    ConfigError
        For a bad option value: values are checked here, so a typo fails at
        once. Options left out are read by each worker from its own dask
        config when it sets its pool up.

    Notes
    -----
    The plugin holds the cluster's membership token, made where the plugin
    lives (never pickled: a copy sent to the scheduler makes its own). Each
    worker gets it in its :class:`Membership`, sent over that worker's own
    stream only, and brokers serve only peers presenting it
    (docs/security.md). Every handler runs on the scheduler's event loop.
    """

    name = PLUGIN_NAME
    overrides: dict[str, Any]
    registry: PoolRegistry
    worker_stats: dict[str, dict[str, Any]]
    rejected: collections.Counter[str]
    _token: bytes
    _scheduler: Scheduler | None
    _pending: dict[str, PoolRecord]
    _joined: asyncio.Event | None

    def __init__(
        self,
        kind: str | None = None,
        device: int | str | None = None,
        max_size: int | float | str | None = None,
        host_id: str | None = None,
        broker_dir: str | None = None,
        broker_timeout: str | float | None = None,
        lease_timeout: str | float | None = None,
        peer_gpu_handoff: bool | str | None = None,
        segment_size: int | str | None = None,
        suballocator: str | None = None,
        segment_memory: str | None = None,
        import_limit: int | str | None = None,
        cupy_allocator: bool | None = None,
        ucx_handoff_threshold: int | str | None = None,
        copy_chunk_size: int | str | None = None,
        copy_stream_threshold: int | str | None = None,
        copy_streams: int | None = None,
        stage_threshold: int | str | None = None,
    ) -> None:
        self.overrides = {
            k: v
            for k, v in dict(
                kind=kind,
                device=device,
                max_size=max_size,
                host_id=host_id,
                broker_dir=broker_dir,
                broker_timeout=broker_timeout,
                lease_timeout=lease_timeout,
                peer_gpu_handoff=peer_gpu_handoff,
                segment_size=segment_size,
                suballocator=suballocator,
                segment_memory=segment_memory,
                import_limit=import_limit,
                cupy_allocator=cupy_allocator,
                ucx_handoff_threshold=ucx_handoff_threshold,
                copy_chunk_size=copy_chunk_size,
                copy_stream_threshold=copy_stream_threshold,
                copy_streams=copy_streams,
                stage_threshold=stage_threshold,
            ).items()
            if v is not None
        }
        PoolOptions.from_config(**self.overrides)  # fail early on bad values
        self._fresh_state()

    def _fresh_state(self) -> None:
        self.registry = PoolRegistry()
        self.worker_stats = {}
        self.rejected = collections.Counter()
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._scheduler = None
        self._pending = {}  # worker -> its row, registered but not yet joined (not published)
        self._joined = None

    def __getstate__(self) -> dict[str, Any]:
        return {"overrides": self.overrides}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.overrides = state["overrides"]
        self._fresh_state()

    @property
    def _handlers(self) -> dict[str, Any]:
        """RPC handlers: any comm reaches them, so they only read (or refuse)."""
        return {
            "gpupool_pools": self.handle_pools,
            "gpupool_register": self.refuse_register_rpc,
            "gpupool_unregister": self.refuse_unregister_rpc,
        }

    @property
    def _stream_handlers(self) -> dict[str, Any]:
        """Batched-stream handlers: each checks that a worker sent it about its own row (:meth:`_source`)."""
        return {
            REGISTER_OP: self.handle_register,
            JOINED_OP: self.handle_joined,
            UPDATE_OP: self.handle_update,
            UNREGISTER_OP: self.handle_unregister,
            STATS_OP: self.handle_stats,
        }

    async def start(self, scheduler: Scheduler) -> None:
        from dask_gpupool.dask.worker_plugin import GPUPoolWorkerPlugin  # the class, pickled for workers

        if self._scheduler is scheduler:
            # A plugin that a preload registered (and so started) is started again by distributed once
            # the preloads are done: once is enough.
            return
        self._scheduler = scheduler
        self._joined = asyncio.Event()
        scheduler.handlers.update(self._handlers)
        # Never removed: an unknown op would end that worker's whole stream (see _drop).
        scheduler.stream_handlers.update(self._stream_handlers)
        _metrics.register_scheduler(self._pools_by_kind)
        _dashboard.install(scheduler, self.snapshot)
        worker_plugin = dumps(GPUPoolWorkerPlugin(self.overrides))
        responses = await scheduler.register_worker_plugin(None, worker_plugin, PLUGIN_NAME, idempotent=False)
        failed = {w: r for w, r in responses.items() if r.get("status") == "error"}
        if failed:
            await scheduler.unregister_worker_plugin(None, PLUGIN_NAME)
            self._remove_handlers()
            self._scheduler = None
            worker, response = next(iter(failed.items()))
            logger.error("gpupool: setup failed on %d worker(s), e.g. %s", len(failed), worker)
            exc = response.get("exception")
            if isinstance(exc, Serialized):  # replies to a broadcast arrive undeserialized
                exc = deserialize(exc.header, exc.frames)
            if isinstance(exc, bytes):  # ... and Dask pickles the exception inside (its own error transport)
                exc = loads(exc)
            if isinstance(exc, BaseException):
                raise exc
            raise GPUPoolError(f"gpupool setup failed on {worker}: {response.get('exception_text')}")
        await self._wait_until_joined(list(responses))
        logger.info("gpupool: registry started, worker plugin installed on %d worker(s)", len(responses))

    async def _wait_until_joined(self, workers: list[str]) -> None:
        """Wait until each of ``workers`` (still here) has a published row, so that ``register_plugin``
        returns with the registry complete, as it did when registration was an RPC.

        A worker's setup sends its registration and returns before the handshake ends (a worker
        joining the cluster reads its stream only after its plugins are set up). Bounded by
        ``distributed.comm.timeouts.connect``; a worker still missing then is logged, not failed.
        """
        assert self._joined is not None
        scheduler_workers = self._scheduler_workers()
        deadline = time.monotonic() + parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"))
        while True:
            self._joined.clear()
            owners = self.registry.owners()
            missing = [w for w in workers if w in scheduler_workers and w not in owners]
            left = deadline - time.monotonic()
            if not missing:
                return
            if left <= 0:
                logger.warning(
                    "gpupool: %d worker(s) have not joined the registry yet, e.g. %s", len(missing), missing[0]
                )
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._joined.wait(), left)

    async def close(self) -> None:
        self._remove_handlers()

    def _remove_handlers(self) -> None:
        if self._scheduler is not None:
            for op, handler in self._handlers.items():
                if self._scheduler.handlers.get(op) == handler:
                    del self._scheduler.handlers[op]
            for op, handler in self._stream_handlers.items():
                if self._scheduler.stream_handlers.get(op) == handler:
                    self._scheduler.stream_handlers[op] = _drop

    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str, **kwargs: Any) -> None:
        """Rows (published or pending) leave with their worker; the only way rows of a worker leave
        other than its own ``gpupool-unregister``. Rows exist only for workers (:meth:`_source`)."""
        self.worker_stats.pop(worker, None)
        self._pending.pop(worker, None)
        self._broadcast(self.registry.remove_worker(worker))
        if self._joined is not None:
            self._joined.set()

    def handle_stats(self, **msg: Any) -> None:
        """A worker's periodic statistics push (its batched stream); kept for the /gpupool page."""
        worker = self._source(STATS_OP, msg, ("stats",))
        if worker is not None and isinstance(msg["stats"], dict):
            self.worker_stats[worker] = msg["stats"]

    def _scheduler_workers(self) -> Any:
        return self._scheduler.workers if self._scheduler is not None else {}

    def snapshot(self) -> dict[str, Any]:
        """What the /gpupool page shows: registry rows with their pools' bytes, and per-worker handoffs."""
        pools = []
        for r in sorted(self.registry.records(), key=lambda r: r.worker):
            s = self.worker_stats.get(r.worker, {})
            pools.append({**r.to_msg(), "used": s.get("used"), "reserved": s.get("reserved")})
        return {"pools": pools, "workers": dict(self.worker_stats), "rejected": dict(self.rejected)}

    # -- who sent it -----------------------------------------------------------------

    def _source(self, op: str, msg: dict[str, Any], fields: tuple[str, ...]) -> str | None:
        """The worker whose own batched stream carried ``msg``; ``None`` (refused) otherwise.

        Dask calls stream handlers with ``worker=<address>`` for a worker's
        stream and ``client=<id>`` for a client's (one handler table serves
        both). A message's own keys override these (``merge(extra, msg)``) but
        cannot remove them: a ``client`` key therefore means a client's
        stream, whatever else the message says. Beyond ``worker``, the
        message must carry exactly ``fields``.
        """
        if "client" in msg:
            self._reject(op, "client", f"client {msg['client']!r}", "registry messages come from workers")
            return None
        worker = msg.get("worker")
        if not isinstance(worker, str) or worker not in self._scheduler_workers():
            self._reject(op, "not-a-worker", repr(worker), "not a worker of this scheduler")
            return None
        if set(msg) != {"worker", *fields}:
            got = sorted(set(msg) - {"worker"})
            self._reject(op, "malformed", worker, f"fields {got}, expected {sorted(fields)}")
            return None
        return worker

    def _reject(self, op: str, reason: str, source: str, detail: str) -> None:
        """Count and log (WARNING) a refused message."""
        self.rejected[reason] += 1
        logger.warning("gpupool: refused %s from %s (%s): %s", op, source, reason, detail)

    def _own_row(self, op: str, worker: str, record: Any) -> PoolRecord | None:
        """``record`` decoded, if it is a row of ``worker`` itself; ``None`` (refused) otherwise."""
        try:
            row = PoolRecord.from_msg(record)
        except ProtocolError as e:
            self._reject(op, "malformed", worker, str(e))
            return None
        if row.worker != worker:
            self._reject(op, "another-worker", worker, f"its row names worker {row.worker!r}")
            return None
        return row

    def _row_of_pool(self, pool: str) -> PoolRecord | None:
        """The published or pending row of ``pool``."""
        return self.registry.get(pool) or next((r for r in self._pending.values() if r.pool == pool), None)

    # -- stream handlers (scheduler's event loop) -----------------------------------------

    def handle_register(self, **msg: Any) -> None:
        """``gpupool-register``: a worker registers its pool; the row stays pending until it joins.

        The :class:`Membership` (the registry and the cluster's token) goes
        back over that worker's own stream, and only there. A worker has one
        pool: a row it registered before leaves.
        """
        worker = self._source(REGISTER_OP, msg, ("record",))
        row = None if worker is None else self._own_row(REGISTER_OP, worker, msg["record"])
        if worker is None or row is None:
            return
        taken = self._row_of_pool(row.pool)
        if taken is not None and taken.worker != worker:
            self._reject(REGISTER_OP, "another-worker", worker, f"pool {row.pool} is registered to {taken.worker}")
            return
        stream = self._scheduler.stream_comms.get(worker) if self._scheduler is not None else None
        if stream is None:  # the worker is leaving
            return
        self._broadcast(self.registry.remove_worker(worker))
        self._pending[worker] = row
        stream.send({"op": MEMBERSHIP_OP, **Membership(self.registry.snapshot(), self._token).to_msg()})
        logger.info("pool %s: registering (%s pool of %s on %s)", row.pool, row.kind, row.worker, row.hostname)

    def handle_joined(self, **msg: Any) -> None:
        """``gpupool-joined``: the worker holds its Membership; publish its row to every worker."""
        worker = self._source(JOINED_OP, msg, ("pool",))
        if worker is None:
            return
        row = self._pending.get(worker)
        if row is None or row.pool != msg["pool"]:
            self._reject(JOINED_OP, "not-its-row", worker, f"no pending registration of pool {msg['pool']!r}")
            return
        del self._pending[worker]
        self._broadcast(self.registry.add(row))
        logger.info("pool %s: registered (%s pool of %s on %s)", row.pool, row.kind, row.worker, row.hostname)
        if self._joined is not None:
            self._joined.set()

    def handle_update(self, **msg: Any) -> None:
        """``gpupool-update``: a worker's row changed; only ``retire_below`` may, and only grow."""
        worker = self._source(UPDATE_OP, msg, ("record",))
        row = None if worker is None else self._own_row(UPDATE_OP, worker, msg["record"])
        if worker is None or row is None:
            return
        old = self._row_of_pool(row.pool)
        if old is None:
            self._reject(UPDATE_OP, "not-its-row", worker, f"pool {row.pool} is not registered")
        elif old.worker != worker:
            self._reject(UPDATE_OP, "another-worker", worker, f"pool {row.pool} is registered to {old.worker}")
        elif row.retire_below < old.retire_below or dataclasses.replace(old, retire_below=row.retire_below) != row:
            self._reject(UPDATE_OP, "row-changed", worker, "an update may only raise retire_below")
        elif self._pending.get(worker) is old:
            self._pending[worker] = row
        else:
            self._broadcast(self.registry.add(row))

    def handle_unregister(self, **msg: Any) -> None:
        """``gpupool-unregister``: a worker's pool leaves while the worker stays."""
        worker = self._source(UNREGISTER_OP, msg, ("pool",))
        if worker is None:
            return
        pool = msg["pool"]
        row = self._row_of_pool(pool) if isinstance(pool, str) else None
        if not isinstance(pool, str):
            self._reject(UNREGISTER_OP, "malformed", worker, f"pool of type {type(pool).__name__}")
        elif row is not None and row.worker != worker:
            self._reject(UNREGISTER_OP, "another-worker", worker, f"pool {pool} is registered to {row.worker}")
        elif self._pending.get(worker) is row and row is not None:
            del self._pending[worker]
        else:
            self._broadcast(self.registry.remove([pool]))

    # -- RPC handlers (scheduler's event loop; any comm, clients included) ----------------

    def refuse_register_rpc(self, comm: Any, **msg: Any) -> dict[str, Any]:
        """``gpupool_register`` over RPC: refused (the token goes only to workers, over their streams)."""
        return self._refuse_rpc("gpupool_register", comm)

    def refuse_unregister_rpc(self, comm: Any, **msg: Any) -> dict[str, Any]:
        """``gpupool_unregister`` over RPC: refused (only a worker unregisters, its own pool)."""
        return self._refuse_rpc("gpupool_unregister", comm)

    def _refuse_rpc(self, op: str, comm: Any) -> dict[str, Any]:
        peer = str(getattr(comm, "peer_address", "?"))
        self._reject(op, "rpc", peer, "pools are registered by their workers over their own streams")
        error = NotAMemberError(
            f"{op} refused for {peer}: only a worker registers or unregisters its own pool, over its own "
            "stream to the scheduler; clients can read the registry (dask_gpupool.pools)"
        )
        return dict(error_message(error, status="uncaught-error"))  # raised in the caller; no traceback logged here

    def _pools_by_kind(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.registry.records():
            counts[r.kind] = counts.get(r.kind, 0) + 1
        return counts

    def handle_pools(self) -> list[dict[str, Any]]:
        return [r.to_msg() for r in self.registry.records()]

    def _broadcast(self, update: RegistryUpdate | None) -> None:
        if update is None or self._scheduler is None:
            return
        msg = {"op": REGISTRY_OP, **update.to_msg()}
        # Workers with a row, published or pending, run the worker plugin and listen; a pending one
        # got its snapshot in its Membership and must see every change after it.
        workers = self.registry.owners() | set(self._pending)
        self._scheduler.send_all({}, {w: [msg] for w in workers if w in self._scheduler.workers})


def _drop(**msg: Any) -> None:
    """Stands in for a stream handler after the plugin closed: late messages are dropped."""
