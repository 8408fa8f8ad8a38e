"""What a worker does on the comms Dask opens: binds each to the member at its other end, runs what a read's
deserializers left before Dask sees the message, and stops fetching a key that fails to arrive again and again.

**Bound comms: who gets leases, and whose replies are imported.** Dask's ``get_data`` names the requester in the
request (``who``), and any process that can reach a worker can send one: a client naming a worker would have been
granted that worker's leases. So the process on the comm proves who it is, once per comm, before Dask uses it
(:mod:`dask_gpupool.wire.broker`):

- a worker that opens a comm to a worker of its registry binds it (:func:`bind`, from the ``rpc.connect`` wrap of
  :func:`~dask_gpupool.dask.distributed_seam.workers.fill_after_read`); Dask pools comms, so this costs two small
  round trips per connection, not per transfer;
- the worker it connected to answers (:func:`bind_handler`) and marks its end of the comm as bound to that worker;
  its ``get_data`` wrapper grants leases only when the requester ``who`` is the worker the comm is bound to
  (:func:`granted_to`); anyone else gets what Dask would send;
- the binding worker marks its end too: its reads of that comm name the sender
  (:data:`~dask_gpupool.handoff.deferred.SENDER`), and a handoff or stream header is imported only inside such a
  read (:func:`~dask_gpupool.dask.dask_family.receive`).

A comm that is not bound (the bind was refused, the peer has no pool, or this worker has no token yet) carries
what Dask would carry: copies.

**A comm read: the copies its deserializers left run in a thread before Dask sees the message.** Dask deserializes a
small message on the event loop, and a handoff header is small even when the copy it names is gigabytes: the
importer returns the landing buffer at once and leaves the copy in the collector :func:`read_then_fill` opens
around ``comm.read`` (:func:`~dask_gpupool.handoff.deferred.collecting`). The wrapper runs the copies with
``asyncio.to_thread`` before it returns the message, so the values are complete when Dask stores them and the event
loop keeps serving heartbeats and other transfers meanwhile. Values a deserializer left to the fills (placeholders
of :func:`~dask_gpupool.handoff.deferred.make_later`) are put in their place then.

A copy that fails is raised as :class:`~dask_gpupool.errors.DataLostError` (a ``ConnectionError``: Dask fetches the
key again or recomputes it) and the comm is aborted, since the sender still waits for this reader's "OK". The same
holds for a ``DataLostError`` a deserializer raised. The read runs with
:data:`~dask_gpupool.handoff.deferred.SENDER` naming the worker it reads from (on a bound comm), and a
:class:`~dask_gpupool.dask.context.ReadBlocks` collector open (:data:`~dask_gpupool.dask.context.READ_BLOCKS`): the
UCX receive pool's blocks of a read that raises are parked in :data:`~dask_gpupool.memory.lifetime.QUARANTINE`,
never given back.

**A key that fails to arrive from one worker again and again: after a bound, the tasks waiting for it err.** Every
failure to receive a handed-over value is raised as :class:`~dask_gpupool.errors.DataLostError`, a
``ConnectionError`` (:func:`~dask_gpupool.dask.dask_family.data_lost`): Dask 2026.8 then drops the sender from the
key's holders, asks the scheduler where else it is, and fetches it again, and an honest exporter's retry succeeds
(it sends that worker copies: :meth:`Exports.settle <dask_gpupool.handoff.exporter.Exports.settle>`). A member whose
every reply of a key fails (a lying member, or one whose value cannot be sent) was asked again forever, about four
times a second, and the task waiting for the key never ran. Any other exception would leave that task waiting for
good (Dask marks the dependency failed on the consumer, and its scheduler ignores that for a key in memory).

So each worker counts, per sending worker and key, the fetches that failed with a ``DataLostError`` in a row
(:class:`FailedFetches`, told by its comm reads that answer a ``get_data`` request, their keys noted by
:func:`requests_noted`: :func:`count_failures`). At :data:`REFETCH_BOUND` it tells the scheduler (:data:`LOST_OP`,
over its own stream, with its registry key), which errs the tasks processing on that worker that wait for the key,
with a ``DataLostError`` naming the key, the sender and the last failure (:func:`err_dependents`), and tells the
worker to release them, so it fetches the key no more. The key stays where it is: the client that holds it decides
(``client.retry``, or recomputing it elsewhere). A reply of several keys that fails counts for each of them: Dask
fetches them together again.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from distributed.core import error_message

from dask_gpupool.dask.context import READ_BLOCKS, ReadBlocks, clear_tracebacks
from dask_gpupool.dask.distributed_seam import scheduler as scheduler_seam
from dask_gpupool.errors import DataLostError, GPUPoolError, NotAMemberError, ProtocolError
from dask_gpupool.handoff.deferred import SENDER, abandon_all, collecting, resolve, run_fills
from dask_gpupool.memory.lifetime import QUARANTINE
from dask_gpupool.wire.broker import (
    BIND_OP,
    BindBound,
    BindChallenge,
    BindHello,
    BindProof,
    ErrorReply,
    bind_proof,
    raise_for_error,
)
from dask_gpupool.wire.codec import TOKEN_BYTES

if TYPE_CHECKING:
    from distributed import Scheduler

    from dask_gpupool.handoff.service import PoolService

__all__ = [
    "BIND_OP",
    "LOST_OP",
    "REFETCH_BOUND",
    "FailedFetches",
    "bind",
    "bind_handler",
    "bound_worker",
    "count_failures",
    "counted",
    "err_dependents",
    "granted_to",
    "read_then_fill",
    "requests_noted",
]

logger = logging.getLogger(__name__)


# -- bound comms -------------------------------------------------------------------------------------------------------


#: The attribute of a comm that names the worker at its other end, once bound.
_BOUND = "_gpupool_bound"
#: The attribute of a comm this worker opened once its peer was asked to bind it.
_ASKED = "_gpupool_bind_asked"


def bound_worker(comm: Any) -> str | None:
    """The worker ``comm`` is bound to (at its other end), or ``None``."""
    return getattr(comm, _BOUND, None)


def granted_to(comm: Any, who: str | None) -> str | None:
    """Who a ``get_data`` reply over ``comm`` may grant leases to: ``who`` if it is the worker the comm is bound to,
    else ``None`` (the reply is Dask's own: copies)."""
    return who if who is not None and who == bound_worker(comm) else None


async def bind(service: PoolService, comm: Any, peer: str) -> bool:
    """Bind ``comm``, opened by this worker to ``peer``, to both ends, unless it was asked before: whether it is
    bound. Called each time Dask hands the comm out; ``peer`` is asked once per comm.

    Only a ``peer`` of this worker's registry is asked, and only once this worker holds the cluster's token (until
    then the comm stays unbound, and is asked when Dask hands it out again). Never raises but for cancellation: a
    refusal leaves the comm as Dask's (unbound); a comm whose bind broke off is aborted (Dask's next use of it
    fails as a broken connection does).
    """
    if getattr(comm, _ASKED, False):
        return bound_worker(comm) == peer
    token = service.importer.links.token
    own = service.record.worker
    if token is None or peer == own or service.registry.worker_row(peer) is None:
        return False
    setattr(comm, _ASKED, True)
    nonce = secrets.token_bytes(TOKEN_BYTES)
    in_step = True
    try:
        await comm.write({**BindHello(own, nonce).to_msg(), "reply": True})
        in_step = False
        answer = await comm.read()
        in_step = True
        if not isinstance(answer, dict) or answer.get("op") != BindChallenge.op:
            if isinstance(answer, dict):
                raise_for_error(answer, f"binding a comm to {peer}")
            raise ProtocolError(f"binding a comm to {peer}: answered {type(answer).__name__}")
        challenge = BindChallenge.from_msg(answer)
        in_step = False
        if not hmac.compare_digest(challenge.proof, bind_proof(token, "exporter", peer, own, nonce)):
            raise NotAMemberError(f"binding a comm to {peer}: its proof is not the cluster's")
        await comm.write(BindProof(bind_proof(token, "importer", peer, own, challenge.nonce)).to_msg())
        answer = await comm.read()
        in_step = True
        if isinstance(answer, dict):
            raise_for_error(answer, f"binding a comm to {peer}")
        BindBound.from_msg(answer)
    except asyncio.CancelledError:
        comm.abort()
        raise
    except Exception as e:
        logger.info("gpupool: a comm to %s is not bound (it carries copies): %s: %s", peer, type(e).__name__, e)
        if not in_step:
            comm.abort()
        return False
    setattr(comm, _BOUND, peer)
    return True


def bind_handler(service: PoolService) -> Callable[..., Awaitable[dict[str, Any]]]:
    """The handler of :data:`~dask_gpupool.wire.broker.BIND_OP` on a worker: answers a peer's bind on the comm it
    came on (a challenge, then its proof, within ``broker-timeout``), and marks that comm as bound to the peer. A
    process without the token (a client) is answered with :class:`~dask_gpupool.errors.NotAMemberError`; the comm
    stays as it was, unbound."""

    async def gpupool_bind(comm: Any, worker: Any = None, nonce: Any = None) -> dict[str, Any]:
        timeout = service.options.broker_timeout
        try:
            token = service.importer.links.token
            hello = BindHello.from_msg({"op": BIND_OP, "worker": worker, "nonce": nonce})
            if token is None:
                raise NotAMemberError(f"pool {service.pool.uuid}: not registered yet (no cluster token)")
            own = service.record.worker
            mine = secrets.token_bytes(TOKEN_BYTES)
            proof = bind_proof(token, "exporter", own, hello.worker, hello.nonce)
            await comm.write(BindChallenge(mine, proof).to_msg())
            answer = BindProof.from_msg(await asyncio.wait_for(comm.read(), timeout))
            if not hmac.compare_digest(answer.proof, bind_proof(token, "importer", own, hello.worker, mine)):
                raise NotAMemberError(f"pool {service.pool.uuid}: a bind as {hello.worker} without a valid proof")
        except TimeoutError:
            comm.abort()  # its proof may still come: the comm is out of step
            e = NotAMemberError(f"pool {service.pool.uuid}: no proof within {timeout:.3g} s")
            logger.info("gpupool: refused to bind a comm from %s: %s", getattr(comm, "peer_address", "?"), e)
            return ErrorReply.of(e).to_msg()
        except GPUPoolError as e:
            logger.info("gpupool: refused to bind a comm from %s: %s", getattr(comm, "peer_address", "?"), e)
            return ErrorReply.of(e).to_msg()
        setattr(comm, _BOUND, hello.worker)
        return BindBound().to_msg()

    return gpupool_bind


# -- a comm read: what its deserializers left, run before Dask sees the message ----------------------------------------


#: The attribute of a comm holding the keys of the ``get_data`` request its next read answers.
_REQUESTED = "_gpupool_requested"
#: The attribute of a comm holding the :class:`FailedFetches` its reads report to.
_FETCHES = "_gpupool_fetches"


def requests_noted(comm: Any, write: Any) -> Any:
    """``write`` (``comm``'s own ``write``) wrapped to note the keys of a ``get_data`` request (Dask's
    ``{"op": "get_data", "keys": ...}``) on ``comm``, for the read that answers it; put in place by
    :func:`~dask_gpupool.dask.distributed_seam.workers.fill_after_read`."""

    async def write_noting(msg: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(msg, dict) and msg.get("op") == "get_data":
            setattr(comm, _REQUESTED, tuple(msg.get("keys") or ()))
        return await write(msg, *args, **kwargs)

    return write_noting


def count_failures(comm: Any, fetches: FailedFetches | None) -> None:
    """Make ``comm``'s reads of ``get_data`` replies report to ``fetches`` (this worker's, set each time Dask hands
    the comm out: a comm kept from a plugin since replaced reports to the current one)."""
    setattr(comm, _FETCHES, fetches)


def _reported(comm: Any, sender: str, asked: tuple[Any, ...], lost: BaseException | None, msg: Any = None) -> None:
    """Tell ``comm``'s :class:`FailedFetches` which keys ``asked`` came from ``sender`` (those in the data of ``msg``,
    an ``"OK"`` reply), or that they were lost with ``lost``: only a :class:`DataLostError` counts as a failed
    fetch."""
    fetches: FailedFetches | None = getattr(comm, _FETCHES, None)
    if fetches is None or not asked:
        return
    if isinstance(lost, DataLostError):
        fetches.failed(sender, asked, lost)
    elif lost is None and isinstance(msg, dict) and msg.get("status") == "OK" and isinstance(msg.get("data"), dict):
        fetches.received(sender, [k for k in asked if k in msg["data"]])


def read_then_fill(comm: Any, read: Any, sender: str) -> Any:
    """``read`` (``comm``'s own ``read``, from a comm this worker opened to ``sender``) wrapped so that the copies,
    claims and values its deserializers left run in a thread once it returns (see the module docstring).
    :data:`~dask_gpupool.handoff.deferred.SENDER` names ``sender`` only while ``comm`` is bound to it
    (:mod:`~dask_gpupool.dask.comms`): outside such a read no handoff or stream header is imported.

    Uses ``comm``'s public :class:`~distributed.comm.Comm` API only (``abort``, ``peer_address``); the wrap is put in
    place by :func:`~dask_gpupool.dask.distributed_seam.workers.fill_after_read`.
    """

    async def read_then_fill(deserializers: Any = None) -> Any:
        asked: tuple[Any, ...] = getattr(comm, _REQUESTED, ())  # a get_data reply's keys, or none
        if asked:
            setattr(comm, _REQUESTED, ())
        pending: list[Any] = []
        token = SENDER.set(sender if bound_worker(comm) == sender else None)  # who answers, proven by its bind
        blocks = ReadBlocks()
        watched = READ_BLOCKS.set(blocks)  # the receive pool gives blocks to this read, and is told how it ended
        try:
            with collecting() as pending:
                msg = await read(deserializers)
        except BaseException as e:
            # UCX may still write into the receive-pool blocks of a read that did not complete: never given back
            QUARANTINE.park(blocks.blocks, None, f"a read from {sender} did not complete")
            abandon_all(pending)
            pending = []
            if isinstance(e, DataLostError):
                comm.abort()  # the sender waits for an "OK" that will not come
            _reported(comm, sender, asked, e)
            # Dask logs the failure and keeps the record: no frame of it may keep imports (and so leases), or the
            # device frames a comm received (distributed-ucxx's read holds them), alive
            clear_tracebacks(e)
            raise
        finally:
            READ_BLOCKS.reset(watched)
            blocks.open = False
            blocks.blocks.clear()
            SENDER.reset(token)
        if not pending:
            _reported(comm, sender, asked, None, msg)
            return msg
        fills, laters = list(pending), list(getattr(pending, "laters", ()))
        pending = []

        def fill_then_resolve() -> Any:
            run_fills(fills)
            return resolve(msg, laters) if laters else msg  # values deserializers left to fills (frames_family)

        try:
            filled = await asyncio.to_thread(fill_then_resolve)
        except asyncio.CancelledError:
            comm.abort()  # the thread runs on with its fills (and ends or abandons them); nothing to clear here
            raise
        except BaseException as e:
            comm.abort()
            # Dask logs the failure and keeps the record: no frame of it may keep imports, and so leases, alive
            msg = None
            fills.clear()
            laters.clear()
            clear_tracebacks(e)
            lost = (
                e
                if isinstance(e, DataLostError)
                else DataLostError(f"a value from {comm.peer_address} could not be received: {type(e).__name__}: {e}")
            )
            _reported(comm, sender, asked, lost)
            if lost is e:
                raise
            raise lost from e
        _reported(comm, sender, asked, None, filled)
        return filled

    read_then_fill.gpupool_fills = True  # type: ignore[attr-defined]  # how a comm already wrapped is told
    return read_then_fill


# -- a key that fails to arrive again and again ------------------------------------------------------------------------


#: ``{"task": key, "sender": str, "error": str, "key": registry key}``: the worker failed :data:`REFETCH_BOUND`
#: fetches of ``task`` from ``sender`` in a row.
LOST_OP = "gpupool-lost"

#: Failed fetches of one key from one worker, in a row, that end the fetching. An honest exporter's value arrives
#: on the fetch after a failed one (it sends copies from then on); a third failure in a row is no passing fault.
REFETCH_BOUND = 3

#: (sender, key) pairs counted at most; the oldest count is dropped first (a pair that keeps failing comes back).
_KEPT = 4096
#: Characters of the last failure sent to the scheduler.
_ERROR_CHARS = 2000


class FailedFetches:
    """One worker's count of failed fetches per (sender, key), in a row; at :data:`REFETCH_BOUND`, ``report``.

    Parameters
    ----------
    report : callable
        ``report(key, sender, error)``: tell the scheduler (:meth:`RegistryMember.report_lost
        <dask_gpupool.dask.registry_member.RegistryMember.report_lost>`). The count of that pair starts again.

    Notes
    -----
    Runs on the worker's event loop (its comm reads); holds no memory and no fd.
    """

    def __init__(self, report: Callable[[Any, str, str], None]) -> None:
        self._report = report
        self._counts: dict[tuple[str, Any], int] = {}

    def failed(self, sender: str, keys: Iterable[Any], error: BaseException) -> None:
        """A fetch of ``keys`` from ``sender`` failed with ``error``."""
        for key in keys:
            pair = (sender, key)
            n = self._counts.pop(pair, 0) + 1
            if n < REFETCH_BOUND:
                self._counts[pair] = n
                while len(self._counts) > _KEPT:
                    del self._counts[next(iter(self._counts))]
                continue
            text = f"{type(error).__name__}: {error}"[:_ERROR_CHARS]
            logger.warning(
                "gpupool: %d fetches of %r from %s failed in a row; the tasks waiting for it err: %s",
                n,
                key,
                sender,
                text,
            )
            self._report(key, sender, text)

    def received(self, sender: str, keys: Iterable[Any]) -> None:
        """``keys`` came from ``sender``: their counts start again."""
        for key in keys:
            self._counts.pop((sender, key), None)

    def __len__(self) -> int:
        return len(self._counts)


def counted(bind: Callable[[Any, str], Awaitable[Any]], fetches: FailedFetches) -> Callable[[Any, str], Awaitable[Any]]:
    """``bind`` (``bind(comm, peer)``, run each time Dask hands this worker a comm:
    :func:`~dask_gpupool.dask.distributed_seam.workers.fill_after_read`) that also makes the comm's reads report to
    ``fetches``."""

    async def bind_and_count(comm: Any, peer: str) -> Any:
        count_failures(comm, fetches)
        return await bind(comm, peer)

    return bind_and_count


def err_dependents(scheduler: Scheduler, key: Any, worker: str, sender: str, error: str) -> list[Any]:
    """On the scheduler: ``worker`` failed :data:`REFETCH_BOUND` fetches of ``key`` from ``sender`` in a row (the
    last with ``error``). The tasks processing on ``worker`` that wait for ``key`` err with a
    :class:`DataLostError` saying so, and ``worker`` releases them
    (:func:`~dask_gpupool.dask.distributed_seam.scheduler.err_waiting_on`); returns their keys. Nothing happens when
    ``key`` is no longer in memory on ``sender`` (recomputed, released, or its holder left meanwhile)."""
    lost = DataLostError(
        f"{key!r} could not be received from worker {sender}: {REFETCH_BOUND} fetches in a row by {worker} failed; "
        f"the last: {error}"
    )
    fields = dict(error_message(lost))
    fields.pop("status", None)
    erred = scheduler_seam.err_waiting_on(scheduler, key, worker, sender, fields)
    if erred:
        logger.warning("gpupool: %d task(s) waiting for %r on %s erred: %s", len(erred), key, worker, lost)
    return erred
