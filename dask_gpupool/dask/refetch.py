"""A key that fails to arrive from one worker again and again: after a bound, the tasks waiting for it err.

Every failure to receive a handed-over value is raised as :class:`~dask_gpupool.errors.DataLostError`, a
``ConnectionError`` (:func:`~dask_gpupool.dask.dask_family.data_lost`): Dask 2026.8 then drops the sender from the key's
holders, asks the scheduler where else it is, and fetches it again, and an honest exporter's retry succeeds (it
sends that worker copies: :meth:`Exports.settle <dask_gpupool.handoff.exports.Exports.settle>`). A member whose every
reply of a key fails (a lying member, or one whose value cannot be sent) was asked again forever, about four times a
second, and the task waiting for the key never ran. Any other exception would leave that task waiting for good
(Dask marks the dependency failed on the consumer, and its scheduler ignores that for a key in memory).

So each worker counts, per sending worker and key, the fetches that failed with a ``DataLostError`` in a row
(:class:`FailedFetches`, told by its comm reads: :func:`~dask_gpupool.dask.comm_reads.count_failures`). At
:data:`REFETCH_BOUND` it tells the scheduler (:data:`LOST_OP`, over its own stream, with its registry key), which
errs the tasks processing on that worker that wait for the key, with a ``DataLostError`` naming the key, the sender
and the last failure (:func:`err_dependents`), and tells the worker to release them, so it fetches the key no more.
The key stays where it is: the client that holds it decides (``client.retry``, or recomputing it elsewhere).
A reply of several keys that fails counts for each of them: Dask fetches them together again.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from distributed.core import error_message

from dask_gpupool.dask.comm_reads import count_failures
from dask_gpupool.dask.distributed_seam import scheduler as scheduler_seam
from dask_gpupool.errors import DataLostError

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["LOST_OP", "REFETCH_BOUND", "FailedFetches", "counted", "err_dependents"]

logger = logging.getLogger(__name__)

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
