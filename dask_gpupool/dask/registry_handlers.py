"""The scheduler's registry handlers: who may change which row, the registration handshake, the pushes to workers.

:class:`RegistryHandlers` holds the scheduler's side of the registry (its
published rows, the pending ones, the cluster's token, the workers' pushed
statistics and the count of refused messages) and answers the ops of
:mod:`dask_gpupool.core`; :class:`~dask_gpupool.dask.scheduler_plugin.GPUPool`
installs its methods as the scheduler's handlers.

Only a worker changes the registry, and only its own row, over its own
batched stream: Dask calls these stream handlers with ``worker=<the address
of the stream's worker>`` (:meth:`RegistryHandlers._source` checks it). A
message's own keys override that ``worker``, so every message that changes a
row also carries the worker's own registry key, which only that worker gets
(in its Membership, over its own stream).
Registration is a handshake: ``gpupool-register`` (the row; it stays pending
and changes nothing else, so a worker naming another cannot act as it),
the :class:`~dask_gpupool.wire.registry.Membership` (registry, token and the
worker's key) sent back over that worker's stream only, then
``gpupool-joined`` with the key and the row, which publishes the row to every
worker. Clients get the read-only ``gpupool_pools`` RPC, and workers the
read-only ``gpupool_registration`` (which registration the handlers serve);
``gpupool_register`` and ``gpupool_unregister`` called over RPC are refused.
Refused messages are logged (WARNING) and counted in
:attr:`RegistryHandlers.rejected`. Every method runs on the scheduler's event
loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import hmac
import logging
import secrets
import time
import weakref
from typing import TYPE_CHECKING, Any

import dask.config
from dask.utils import parse_timedelta
from distributed.core import error_message

from dask_gpupool.core import JOINED_OP, MEMBERSHIP_OP, REGISTER_OP, REGISTRY_OP, UNREGISTER_OP, UPDATE_OP
from dask_gpupool.dask import comms
from dask_gpupool.errors import NotAMemberError, ProtocolError
from dask_gpupool.handoff.registry import PoolRegistry
from dask_gpupool.ops.dashboard import STATS_OP, finite
from dask_gpupool.wire.registry import TOKEN_BYTES, Membership, PoolRecord, RegistryUpdate

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["RegistryHandlers", "answer_timeout"]

logger = logging.getLogger(__name__)


#: Per scheduler: the secret of its workers' registry keys (:meth:`RegistryHandlers.serve`).
_secrets: weakref.WeakKeyDictionary[Any, bytes] = weakref.WeakKeyDictionary()


def answer_timeout() -> float:
    """How long, in seconds, a registration waits for the workers: for their answers to the plugin install, then for
    them to join (``distributed.comm.timeouts.connect``, both within one such time)."""
    return float(parse_timedelta(dask.config.get("distributed.comm.timeouts.connect")))


class RegistryHandlers:
    """The scheduler's registry and its handlers; one per :class:`~dask_gpupool.dask.scheduler_plugin.GPUPool`.

    Attributes
    ----------
    registry : PoolRegistry
        Published rows only.
    worker_stats : dict
        Each worker's last statistics push, for the /gpupool page.
    rejected : collections.Counter
        Registry messages refused, by reason (see
        :class:`~dask_gpupool.dask.scheduler_plugin.GPUPool`).
    scheduler : Scheduler or None
        The scheduler served (set by :meth:`serve`); ``None`` before, or
        after a failed start: then nothing is sent and no worker is known.
    registration : str
        This registration's id (random), carried by the worker plugins it
        sends: a worker plugin whose id is not the one the scheduler's
        handlers serve belongs to a registration replaced or removed since,
        and sets nothing up.

    Notes
    -----
    The cluster's membership token is made here, with the plugin (never
    pickled: a copy sent to the scheduler makes its own); it goes to a worker
    only in its :class:`~dask_gpupool.wire.registry.Membership`.
    """

    registry: PoolRegistry
    worker_stats: dict[str, dict[str, Any]]
    rejected: collections.Counter[str]
    scheduler: Scheduler | None
    registration: str
    _token: bytes
    _secret: bytes
    _pending: dict[str, PoolRecord]
    _joined: asyncio.Event | None

    def __init__(self) -> None:
        self.registry = PoolRegistry()
        self.worker_stats = {}
        self.rejected = collections.Counter()
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._secret = secrets.token_bytes(TOKEN_BYTES)  # makes each worker's registry key (_key)
        self.scheduler = None
        self.registration = secrets.token_hex(16)
        self._pending = {}  # worker -> its row, registered but not yet joined (not published)
        self._joined = None

    def serve(self, scheduler: Scheduler) -> None:
        """Answer for ``scheduler`` from now on (called on its event loop).

        The secret of the workers' registry keys is the scheduler's, kept from the first plugin that served it:
        a plugin registered again (new options) takes over while the old one's worker plugins are torn down, and
        their ``gpupool-unregister`` carries the key they have. Each key still belongs to its worker alone.
        """
        self._secret = _secrets.setdefault(scheduler, self._secret)
        self.scheduler = scheduler
        self._joined = asyncio.Event()

    async def wait_until_joined(self, workers: list[str], deadline: float | None = None) -> None:
        """Wait until each of ``workers`` (still here) has a published row, so that ``register_plugin``
        returns with the registry complete, as it did when registration was an RPC.

        A worker's setup sends its registration and returns before the handshake ends (a worker
        joining the cluster reads its stream only after its plugins are set up). Bounded by
        ``deadline`` (a :func:`time.monotonic` time; by default :func:`answer_timeout` from now); a worker still
        missing then is logged, not failed.
        """
        assert self._joined is not None
        scheduler_workers = self._scheduler_workers()
        if deadline is None:
            deadline = time.monotonic() + answer_timeout()
        while True:
            self._joined.clear()
            owners = self.registry.owners()
            # a worker that reported it has no pool (its set-up failed, or its options were refused) never joins
            missing = [
                w
                for w in workers
                if w in scheduler_workers and w not in owners and "error" not in self.worker_stats.get(w, {})
            ]
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

    def remove_worker(self, worker: str) -> None:
        """Rows (published or pending) leave with their worker; the only way rows of a worker leave
        other than its own ``gpupool-unregister``. Rows exist only for workers (:meth:`_source`)."""
        self.worker_stats.pop(worker, None)
        self._pending.pop(worker, None)
        self._broadcast(self.registry.remove_worker(worker))
        if self._joined is not None:
            self._joined.set()

    def drop_departed(self) -> None:
        """Rows (published or pending) and statistics of workers the scheduler no longer has leave, as in
        :meth:`remove_worker`: for departures while the plugin was not listed yet, which distributed told only the
        plugins listed then."""
        workers = self._scheduler_workers()
        for worker in sorted(self.registry.owners() | set(self._pending) | set(self.worker_stats)):
            if worker not in workers:
                self.remove_worker(worker)

    def handle_stats(self, **msg: Any) -> None:
        """A worker's periodic statistics push (its batched stream); kept for the /gpupool page, with NaN and
        infinite numbers as ``None`` (:func:`~dask_gpupool.ops.dashboard.finite`: ``/gpupool.json`` is strict
        JSON). A push nested too deep to walk is refused (``malformed``)."""
        worker = self._source(STATS_OP, msg, ("stats",))
        if worker is not None and isinstance(msg["stats"], dict):
            try:
                self.worker_stats[worker] = finite(msg["stats"])
            except RecursionError:
                self._reject(STATS_OP, "malformed", worker, "statistics nested too deep")
                return
            if "error" in msg["stats"] and self._joined is not None:
                self._joined.set()  # it has no pool: a registration waits for it no more (wait_until_joined)

    def _scheduler_workers(self) -> Any:
        return self.scheduler.workers if self.scheduler is not None else {}

    def snapshot(self) -> dict[str, Any]:
        """What the /gpupool page shows: registry rows with their pools' bytes, and per-worker handoffs."""
        pools = []
        for r in sorted(self.registry.records(), key=lambda r: r.worker):
            s = self.worker_stats.get(r.worker, {})
            pools.append({**r.to_msg(), "used": s.get("used"), "reserved": s.get("reserved")})
        return {"pools": pools, "workers": dict(self.worker_stats), "rejected": dict(self.rejected)}

    # -- who sent it -----------------------------------------------------------------

    def _key(self, worker: str) -> bytes:
        """The registry key of the worker at address ``worker``: sent to it alone, in its Membership."""
        return hmac.new(self._secret, worker.encode(), hashlib.sha256).digest()

    def _source(self, op: str, msg: dict[str, Any], fields: tuple[str, ...]) -> str | None:
        """The worker whose own batched stream carried ``msg``; ``None`` (refused) otherwise.

        Dask calls stream handlers with ``worker=<address>`` for a worker's
        stream and ``client=<id>`` for a client's (one handler table serves
        both). A message's own keys override these (``merge(extra, msg)``) but
        cannot remove them: a ``client`` key therefore means a client's
        stream, whatever else the message says. A ``worker`` key may be
        another worker's own, put in by a worker naming it: a message with a
        ``key`` field is taken only if it is that worker's registry key
        (:meth:`_key`). Beyond ``worker``, the message must carry exactly
        ``fields``.
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
        if "key" in fields and not (
            isinstance(msg["key"], bytes) and hmac.compare_digest(msg["key"], self._key(worker))
        ):
            self._reject(op, "not-its-key", worker, "the message does not carry that worker's registry key")
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

        The :class:`Membership` (the registry, the cluster's token and the
        worker's key) goes back over that worker's own stream, and only there.
        Nothing else changes here: the message carries no key (the worker has
        none yet), so it may come from another worker naming this one; the
        row that is published is the one ``gpupool-joined`` carries.
        """
        worker = self._source(REGISTER_OP, msg, ("record",))
        row = None if worker is None else self._own_row(REGISTER_OP, worker, msg["record"])
        if worker is None or row is None:
            return
        taken = self._row_of_pool(row.pool)
        if taken is not None and taken.worker != worker:
            self._reject(REGISTER_OP, "another-worker", worker, f"pool {row.pool} is registered to {taken.worker}")
            return
        stream = self.scheduler.stream_comms.get(worker) if self.scheduler is not None else None
        if stream is None:  # the worker is leaving
            return
        self._pending[worker] = row
        membership = Membership(self.registry.snapshot(), self._token, self._key(worker))
        stream.send({"op": MEMBERSHIP_OP, **membership.to_msg()})
        logger.info("pool %s: registering (%s pool of %s on %s)", row.pool, row.kind, row.worker, row.hostname)

    def handle_joined(self, **msg: Any) -> None:
        """``gpupool-joined``: the worker holds its Membership; publish the row it sends (with its key) to every
        worker. A worker has one pool: a row of another pool it published before leaves."""
        worker = self._source(JOINED_OP, msg, ("record", "key"))
        row = None if worker is None else self._own_row(JOINED_OP, worker, msg["record"])
        if worker is None or row is None:
            return
        if self._pending.pop(worker, None) is None:
            if self.registry.get(row.pool) != row:  # a second Membership's answer repeats the published row
                self._reject(JOINED_OP, "not-its-row", worker, f"no pending registration of pool {row.pool}")
            return
        taken = self._row_of_pool(row.pool)
        if taken is not None and taken.worker != worker:
            self._reject(JOINED_OP, "another-worker", worker, f"pool {row.pool} is registered to {taken.worker}")
            return
        earlier = [r.pool for r in self.registry.records() if r.worker == worker and r.pool != row.pool]
        self._broadcast(self.registry.remove(earlier))
        self._broadcast(self.registry.add(row))
        logger.info("pool %s: registered (%s pool of %s on %s)", row.pool, row.kind, row.worker, row.hostname)
        if self._joined is not None:
            self._joined.set()

    def handle_update(self, **msg: Any) -> None:
        """``gpupool-update``: a worker's row changed; only ``retire_below`` (only up) and ``reclaim`` may."""
        worker = self._source(UPDATE_OP, msg, ("record", "key"))
        row = None if worker is None else self._own_row(UPDATE_OP, worker, msg["record"])
        if worker is None or row is None:
            return
        old = self._row_of_pool(row.pool)
        if old is None:
            self._reject(UPDATE_OP, "not-its-row", worker, f"pool {row.pool} is not registered")
        elif old.worker != worker:
            self._reject(UPDATE_OP, "another-worker", worker, f"pool {row.pool} is registered to {old.worker}")
        elif (
            row.retire_below < old.retire_below
            or dataclasses.replace(old, retire_below=row.retire_below, reclaim=row.reclaim) != row
        ):
            self._reject(UPDATE_OP, "row-changed", worker, "an update may only raise retire_below or change reclaim")
        elif self._pending.get(worker) is old:
            self._pending[worker] = row
        else:
            self._broadcast(self.registry.add(row))

    def handle_unregister(self, **msg: Any) -> None:
        """``gpupool-unregister``: a worker's pool leaves while the worker stays."""
        worker = self._source(UNREGISTER_OP, msg, ("pool", "key"))
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
            self.worker_stats.pop(worker, None)
        else:
            if (pending := self._pending.get(worker)) is not None and pending.pool == pool:
                del self._pending[worker]  # registered again, not joined yet: it must not join after this
            self._broadcast(self.registry.remove([pool]))
            if row is not None:  # not a pool of an earlier plugin, which this registry never held
                self.worker_stats.pop(worker, None)  # its last push described a pool that is gone (the /gpupool page)

    def handle_lost(self, **msg: Any) -> None:
        """``gpupool-lost`` (:data:`~dask_gpupool.dask.comms.LOST_OP`): a worker failed
        :data:`~dask_gpupool.dask.comms.REFETCH_BOUND` fetches in a row of key ``task`` from ``sender``; the tasks
        processing on that worker (only) that wait for it err (:func:`~dask_gpupool.dask.comms.err_dependents`)."""
        worker = self._source(comms.LOST_OP, msg, ("task", "sender", "error", "key"))
        if worker is None or self.scheduler is None:
            return
        if not isinstance(msg["sender"], str) or not isinstance(msg["error"], str):
            self._reject(comms.LOST_OP, "malformed", worker, "sender and error must be strings")
            return
        comms.err_dependents(self.scheduler, msg["task"], worker, msg["sender"], msg["error"])

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

    def handle_registration(self) -> str:
        """``gpupool_registration`` over RPC: the id of the registration these handlers serve, read-only (a worker
        plugin's setup asks it: one of a registration replaced or removed since it was sent sets nothing up)."""
        return self.registration

    def pools_by_kind(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.registry.records():
            counts[r.kind] = counts.get(r.kind, 0) + 1
        return counts

    def handle_pools(self) -> list[dict[str, Any]]:
        """``gpupool_pools`` over RPC: the published rows, read-only (what :func:`~dask_gpupool.pools` asks)."""
        return [r.to_msg() for r in self.registry.records()]

    def _broadcast(self, update: RegistryUpdate | None) -> None:
        if update is None or self.scheduler is None:
            return
        msg = {"op": REGISTRY_OP, **update.to_msg()}
        # Workers with a row, published or pending, run the worker plugin and listen; a pending one
        # got its snapshot in its Membership and must see every change after it.
        workers = self.registry.owners() | set(self._pending)
        self.scheduler.send_all({}, {w: [msg] for w in workers if w in self.scheduler.workers})
