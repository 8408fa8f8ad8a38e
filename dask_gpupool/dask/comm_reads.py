"""A comm read of this worker: the copies its deserializers left run in a thread before Dask sees the message.

Dask deserializes a small message on the event loop, and a handoff header
is small even when the copy it names is gigabytes: the importer returns
the landing buffer at once and leaves the copy in the collector
:func:`read_then_fill` opens around ``comm.read``
(:func:`~dask_gpupool.handoff.deferred.collecting`). The wrapper runs the
copies with ``asyncio.to_thread`` before it returns the message, so the
values are complete when Dask stores them and the event loop keeps serving
heartbeats and other transfers meanwhile. Values a deserializer left to the
fills (placeholders of :func:`~dask_gpupool.handoff.deferred.make_later`)
are put in their place then.

A copy that fails is raised as :class:`~dask_gpupool.errors.DataLostError`
(a ``ConnectionError``: Dask fetches the key again or recomputes it) and the
comm is aborted, since the sender still waits for this reader's "OK". The
same holds for a ``DataLostError`` a deserializer raised. The read runs with
:data:`~dask_gpupool.handoff.deferred.SENDER` naming the worker it reads from (on a bound comm),
and a :class:`~dask_gpupool.dask.context.ReadBlocks` collector open
(:data:`~dask_gpupool.dask.context.READ_BLOCKS`): the UCX receive pool's
blocks of a read that raises are parked in
:data:`~dask_gpupool.memory.lifetime.QUARANTINE`, never given back.
"""

from __future__ import annotations

import asyncio
from typing import Any

from dask_gpupool.dask.binding import bound_worker
from dask_gpupool.dask.context import READ_BLOCKS, ReadBlocks, clear_tracebacks
from dask_gpupool.errors import DataLostError
from dask_gpupool.handoff.deferred import SENDER, abandon_all, collecting, resolve, run_fills
from dask_gpupool.memory.lifetime import QUARANTINE

__all__ = ["read_then_fill"]


def read_then_fill(comm: Any, read: Any, sender: str) -> Any:
    """``read`` (``comm``'s own ``read``, from a comm this worker opened to ``sender``) wrapped so that the copies,
    claims and values its deserializers left run in a thread once it returns (see the module docstring).
    :data:`~dask_gpupool.handoff.deferred.SENDER` names ``sender`` only while ``comm`` is bound to it
    (:mod:`~dask_gpupool.dask.binding`): outside such a read no handoff or stream header is imported.

    Uses ``comm``'s public :class:`~distributed.comm.Comm` API only (``abort``, ``peer_address``); the wrap is put in
    place by :func:`~dask_gpupool.dask.distributed_seam.fill_after_read`.
    """

    async def read_then_fill(deserializers: Any = None) -> Any:
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
            return msg
        fills, laters = list(pending), list(getattr(pending, "laters", ()))
        pending = []

        def fill_then_resolve() -> Any:
            run_fills(fills)
            return resolve(msg, laters) if laters else msg  # values deserializers left to fills (frames_family)

        try:
            return await asyncio.to_thread(fill_then_resolve)
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
            if isinstance(e, DataLostError):
                raise
            raise DataLostError(
                f"a value from {comm.peer_address} could not be received: {type(e).__name__}: {e}"
            ) from e

    read_then_fill.gpupool_fills = True  # type: ignore[attr-defined]  # how a comm already wrapped is told
    return read_then_fill
