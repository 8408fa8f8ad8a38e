"""How a registration reaches the workers: its worker plugin sent to each one on its own, and the order kept.

What ``Scheduler.register_worker_plugin`` does (list the plugin for new workers, send ``plugin-add`` to every
worker), with each worker's answer awaited on its own and for at most a deadline: its broadcast waited for every
worker, so one that never answered (stopped, its event loop blocked) held the registration, and every later one,
until ``distributed.scheduler.worker-ttl`` removed it (never, with ``worker-ttl: null``). A worker gets one message at
a time and, once it answers late, whatever is registered then (:func:`settle`). Registrations on one scheduler run
one at a time (:func:`registrations`). The state kept per scheduler lives here, weakly keyed by the scheduler.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any

from distributed.core import Status
from distributed.protocol import Serialized, deserialize
from distributed.protocol.pickle import loads

from dask_gpupool.core import PLUGIN_NAME
from dask_gpupool.dask.distributed_seam.scheduler import list_worker_plugin, listed_worker_plugin, plugin_message
from dask_gpupool.dask.registry_handlers import answer_timeout
from dask_gpupool.errors import GPUPoolError

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["install", "registrations", "send", "settle", "setup_error", "tell", "unanswered", "uninstall"]

logger = logging.getLogger(__name__)

#: Per scheduler: the lock its registrations take in turn (:func:`registrations`).
_locks: weakref.WeakKeyDictionary[Any, asyncio.Lock] = weakref.WeakKeyDictionary()
#: Per scheduler: the plugin install or removal each worker has not answered yet (:func:`unanswered`).
_outstandings: weakref.WeakKeyDictionary[Any, dict[str, asyncio.Future[Any]]] = weakref.WeakKeyDictionary()


def registrations(scheduler: Scheduler) -> asyncio.Lock:
    """The lock that runs ``scheduler``'s ``GPUPool`` registrations one at a time, in the order they came (FIFO)."""
    lock = _locks.get(scheduler)
    if lock is None:
        lock = _locks[scheduler] = asyncio.Lock()
    return lock


def unanswered(scheduler: Scheduler) -> dict[str, asyncio.Future[Any]]:
    """The plugin install or removal each worker has not answered yet, by worker (at most one per worker)."""
    outstanding = _outstandings.get(scheduler)
    if outstanding is None:
        outstanding = _outstandings[scheduler] = {}
    return outstanding


async def install(scheduler: Scheduler, pickled: bytes, deadline: float) -> tuple[dict[str, Any], list[str]]:
    """List ``pickled`` (a worker plugin) for new workers and send it to every worker (:func:`tell`), as
    ``Scheduler.register_worker_plugin`` does (its log line too, on distributed's logger)."""
    logging.getLogger("distributed.scheduler").info("Registering Worker plugin %s", PLUGIN_NAME)
    list_worker_plugin(scheduler, PLUGIN_NAME, pickled)
    return await tell(scheduler, plugin_message(PLUGIN_NAME, pickled), pickled, list(scheduler.workers), deadline)


def setup_error(worker: str, response: dict[str, Any]) -> BaseException:
    """The exception a worker's failed ``plugin-add`` (``response``) carries, as the worker raised it."""
    exc = response.get("exception")
    if isinstance(exc, Serialized):  # replies to a broadcast arrive undeserialized
        exc = deserialize(exc.header, exc.frames)
    if isinstance(exc, bytes):  # ... and Dask pickles the exception inside (its own error transport)
        exc = loads(exc)
    if isinstance(exc, BaseException):
        return exc
    return GPUPoolError(f"gpupool setup failed on {worker}: {response.get('exception_text')}")


async def uninstall(scheduler: Scheduler, pickled: bytes | None) -> None:
    """The worker plugin ``pickled`` (a registration's), if still the one new workers get, unregistered from every
    worker: each tears its pool down (closed once its leases end). A worker that does not answer within
    :func:`~dask_gpupool.dask.registry_handlers.answer_timeout` is logged and gets it when it answers."""
    if pickled is None or listed_worker_plugin(scheduler, PLUGIN_NAME) is not pickled:
        return  # another registration's since
    list_worker_plugin(scheduler, PLUGIN_NAME, None)
    deadline = time.monotonic() + answer_timeout()
    responses, late = await tell(scheduler, plugin_message(PLUGIN_NAME, None), None, list(scheduler.workers), deadline)
    broken = sorted(w for w, r in responses.items() if isinstance(r, BaseException))
    if broken:  # a worker that cannot be reached (one that died): the others are told
        logger.warning("gpupool: removing the worker plugin failed on %s", ", ".join(broken))
    if late:
        logger.warning(
            "gpupool: %d worker(s) did not answer the plugin removal within %.3g s: %s; each is told on answering",
            len(late),
            answer_timeout(),
            ", ".join(sorted(late)),
        )


async def tell(
    scheduler: Scheduler, msg: dict[str, Any], sent: bytes | None, workers: list[str], deadline: float
) -> tuple[dict[str, Any], list[str]]:
    """Send ``msg`` (a ``plugin-add`` of the worker plugin ``sent``, or a ``plugin-remove``: ``sent`` is ``None``) to
    each of ``workers`` as ``Scheduler.broadcast`` does, each on its own; wait for their answers until ``deadline``.

    Returns the answers that came (a worker's reply, or the exception its comm raised) by worker, and the workers
    that did not answer (a worker removed meanwhile, :meth:`~dask_gpupool.dask.scheduler_plugin.GPUPool.remove_worker`,
    is in neither). Those are not
    waited for, and nothing later waits behind them: a worker gets one message at a time (a later one is not sent
    while it has not answered the one before, so that two cannot reach it in the wrong order), and once it answers
    it gets whatever is registered then (:func:`settle`).
    """
    outstanding = unanswered(scheduler)
    late = [w for w in workers if w in outstanding]
    tasks = {w: send(scheduler, w, msg) for w in workers if w not in outstanding}
    if tasks:
        # Every answer, even once one worker's comm broke: returning at the first exception left the workers that
        # answer a moment later outstanding, so undoing a failed registration skipped them, and they installed its
        # worker plugin after register_plugin had raised.
        await asyncio.wait(tasks.values(), timeout=max(0.0, deadline - time.monotonic()))
    responses: dict[str, Any] = {}
    for worker, task in tasks.items():
        if not task.done():
            late.append(worker)
            task.add_done_callback(functools.partial(settle, scheduler, worker, sent))
        elif task.cancelled():
            # Its worker was removed meanwhile (remove_worker gave the message up): it left the cluster, as any worker
            # may during a registration, and is neither an answer nor late. As an answer, the CancelledError raised
            # out of start undid the registration on every worker and ended the client's comm.
            continue
        elif task.exception() is not None:
            responses[worker] = task.exception()
        else:
            responses[worker] = task.result().get(worker, {})
    return responses, late


def send(scheduler: Scheduler, worker: str, msg: dict[str, Any]) -> asyncio.Future[Any]:
    """``msg`` sent to ``worker`` alone, outstanding until it answers (:func:`unanswered`)."""
    outstanding = unanswered(scheduler)
    task = asyncio.ensure_future(scheduler.broadcast(msg=msg, workers=[worker]))
    outstanding[worker] = task

    def answered(task: asyncio.Future[Any]) -> None:
        if outstanding.get(worker) is task:
            del outstanding[worker]

    task.add_done_callback(answered)
    return task


def settle(scheduler: Scheduler, worker: str, sent: bytes | None, task: asyncio.Future[Any]) -> None:
    """``worker`` answered late the ``plugin-add`` of ``sent`` (or, with ``sent`` ``None``, a ``plugin-remove``): if
    that is not what is registered now (a registration replaced, made or removed meanwhile, which sent it nothing),
    it gets what is: the worker plugin registered now, else the removal of the one it holds."""
    if task.cancelled():
        return
    if task.exception() is not None:  # it left (distributed logged it); remove_worker takes its rows
        return
    current = listed_worker_plugin(scheduler, PLUGIN_NAME)
    answer = task.result().get(worker, {})
    if sent is not None and sent is current:
        if isinstance(answer, dict) and answer.get("status") == "error":
            logger.warning(
                "gpupool: %s answered the plugin install late: its setup failed (%s); it has no pool",
                worker,
                answer.get("exception_text"),
            )
        else:
            logger.info("gpupool: %s answered the plugin install late; it joins the registry", worker)
        return
    if worker not in scheduler.workers or scheduler.status != Status.running or (current is sent is None):
        return
    msg = plugin_message(PLUGIN_NAME, current)
    logger.info(
        "gpupool: %s answered late for a registration since replaced or removed; it gets the current one", worker
    )
    send(scheduler, worker, msg).add_done_callback(functools.partial(settle, scheduler, worker, current))
