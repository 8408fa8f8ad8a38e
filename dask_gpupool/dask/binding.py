"""Comms bound to the member at their other end: who gets leases, and whose replies are imported.

Dask's ``get_data`` names the requester in the request (``who``), and any process that can reach a worker can
send one: a client naming a worker would have been granted that worker's leases. So the process on the comm proves
who it is, once per comm, before Dask uses it (:mod:`dask_gpupool.wire.bind`):

- a worker that opens a comm to a worker of its registry binds it (:func:`bind`, from the ``rpc.connect`` wrap of
  :func:`~dask_gpupool.dask.distributed_seam.workers.fill_after_read`); Dask pools comms, so this costs two small round
  trips per connection, not per transfer;
- the worker it connected to answers (:func:`bind_handler`) and marks its end of the comm as bound to that worker;
  its ``get_data`` wrapper grants leases only when the requester ``who`` is the worker the comm is bound to
  (:func:`granted_to`); anyone else gets what Dask would send;
- the binding worker marks its end too: its reads of that comm name the sender
  (:data:`~dask_gpupool.handoff.deferred.SENDER`), and a handoff or stream header is imported only inside such a
  read (:func:`~dask_gpupool.dask.dask_family.receive`).

A comm that is not bound (the bind was refused, the peer has no pool, or this worker has no token yet) carries
what Dask would carry: copies.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from dask_gpupool.errors import GPUPoolError, NotAMemberError, ProtocolError
from dask_gpupool.wire.bind import BIND_OP, BindBound, BindChallenge, BindHello, BindProof, bind_proof
from dask_gpupool.wire.broker import ErrorReply, raise_for_error
from dask_gpupool.wire.codec import TOKEN_BYTES

if TYPE_CHECKING:
    from dask_gpupool.handoff.service import PoolService

__all__ = ["BIND_OP", "bind", "bind_handler", "bound_worker", "granted_to"]

logger = logging.getLogger(__name__)

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
    """The handler of :data:`~dask_gpupool.wire.bind.BIND_OP` on a worker: answers a peer's bind on the comm it
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
