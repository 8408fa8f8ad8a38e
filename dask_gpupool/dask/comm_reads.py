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

A read that answers a ``get_data`` request (its keys noted by :func:`requests_noted`) tells the comm's
:class:`~dask_gpupool.dask.refetch.FailedFetches` (:func:`count_failures`) whether its keys came or were lost: a key
that fails again and again from one worker is not fetched forever (:mod:`~dask_gpupool.dask.refetch`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from dask_gpupool.dask.binding import bound_worker
from dask_gpupool.dask.context import READ_BLOCKS, ReadBlocks, clear_tracebacks
from dask_gpupool.errors import DataLostError
from dask_gpupool.handoff.deferred import SENDER, abandon_all, collecting, resolve, run_fills
from dask_gpupool.memory.lifetime import QUARANTINE

if TYPE_CHECKING:
    from dask_gpupool.dask.refetch import FailedFetches

__all__ = ["count_failures", "read_then_fill", "requests_noted"]

#: The attribute of a comm holding the keys of the ``get_data`` request its next read answers.
_ASKED = "_gpupool_asked"
#: The attribute of a comm holding the :class:`FailedFetches` its reads report to.
_FETCHES = "_gpupool_fetches"


def requests_noted(comm: Any, write: Any) -> Any:
    """``write`` (``comm``'s own ``write``) wrapped to note the keys of a ``get_data`` request (Dask's
    ``{"op": "get_data", "keys": ...}``) on ``comm``, for the read that answers it; put in place by
    :func:`~dask_gpupool.dask.distributed_seam.workers.fill_after_read`."""

    async def write_noting(msg: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(msg, dict) and msg.get("op") == "get_data":
            setattr(comm, _ASKED, tuple(msg.get("keys") or ()))
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
    (:mod:`~dask_gpupool.dask.binding`): outside such a read no handoff or stream header is imported.

    Uses ``comm``'s public :class:`~distributed.comm.Comm` API only (``abort``, ``peer_address``); the wrap is put in
    place by :func:`~dask_gpupool.dask.distributed_seam.workers.fill_after_read`.
    """

    async def read_then_fill(deserializers: Any = None) -> Any:
        asked: tuple[Any, ...] = getattr(comm, _ASKED, ())  # a get_data reply's keys, or none
        if asked:
            setattr(comm, _ASKED, ())
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
