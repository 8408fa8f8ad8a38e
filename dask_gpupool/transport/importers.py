"""The importer processes a broker watches: their exit, not a closed connection, ends their leases.

A connection closing ends nothing (an importer whose link broke reopens it and
resyncs), and neither does an importer leaving the registry while its process
lives (the scheduler removes workers it lost touch with: ``worker-ttl`` after a
stall, a broken stream), :meth:`ImporterWatch.left`. The broker watches each importer's process with a pidfd
(``os.pidfd_open``) on its own event loop and tells its
:class:`~dask_gpupool.transport.broker_handler.BrokerHandler` when that process
exits (:meth:`~dask_gpupool.transport.broker_handler.BrokerHandler.importer_exited`).

One process may be several importers (``dask worker --no-nanny --nworkers 2``
runs two workers in one process): a pid is watched once, for every worker
address it is, and its exit ends the leases of each.

Ownership: :class:`ImporterWatch` owns the pidfds and closes each when its
process exits or in :meth:`ImporterWatch.close`. Broker thread only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select

from dask_gpupool.memory.lifetime import open_pidfd
from dask_gpupool.transport.broker_handler import BrokerHandler

__all__ = ["ImporterWatch"]

logger = logging.getLogger(__name__)


class ImporterWatch:
    """Pidfds of importer processes, by pid; their exit calls ``handler.importer_exited`` for each importer
    (worker address) of that process.

    Parameters
    ----------
    handler : BrokerHandler
        Told when a watched importer's process exits.
    name : str
        The pool, for logs.
    """

    def __init__(self, handler: BrokerHandler, name: str) -> None:
        self._handler = handler
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watched: dict[int, tuple[int, set[str]]] = {}  # pid -> (pidfd, the importers of that process)

    def watch(self, loop: asyncio.AbstractEventLoop, pid: int, importer: str) -> None:
        """Watch ``pid`` (the importer ``importer``) on ``loop``; its exit releases its leases.

        A pid already gone releases at once; one that cannot be watched (no
        pidfds here) is logged and left to the lease timeouts. A pid watched
        already (another worker of that process) is watched for this importer too.
        """
        if pid <= 0:
            return
        entry = self._watched.get(pid)
        if entry is not None:
            entry[1].add(importer)
        elif self._try_watch(loop, pid, importer) is False:
            self._handler.importer_exited(importer)

    def left(self, loop: asyncio.AbstractEventLoop, pid: int, importer: str) -> None:
        """``importer`` left the registry: release what it held when its process ``pid`` exits.

        Leaving is not dying: the scheduler removes workers whose process
        lives on, and their running tasks can still read what they imported.
        An importer watched since it connected is left to that watch;
        otherwise its process is watched from now on by ``pid`` (its registry
        row's, on this host). Released at once when that process is gone
        already, or cannot be watched (``pid`` 0: another host or pid
        namespace; no pidfds here).
        """
        if any(importer in names for _, names in self._watched.values()):
            return
        entry = self._watched.get(pid) if pid > 0 and pid != os.getpid() else None
        if entry is not None:  # its process is watched already, for another worker of that process
            entry[1].add(importer)
            return
        if pid > 0 and pid != os.getpid() and self._try_watch(loop, pid, importer):
            logger.info(
                "pool %s: %s left the registry while its process %d lives; its leases end when it exits",
                self._name,
                importer,
                pid,
            )
            return
        self._handler.importer_exited(importer)

    def _try_watch(self, loop: asyncio.AbstractEventLoop, pid: int, importer: str) -> bool | None:
        """Watch ``pid`` on ``loop`` for ``importer``: ``True`` watched, ``False`` the process is gone already,
        ``None`` it cannot be watched (no pidfds here)."""
        try:
            pidfd = open_pidfd(pid)
        except ProcessLookupError:
            return False
        if pidfd is None:
            logger.debug("pool %s: cannot watch pid %d of %s", self._name, pid, importer)
            return None
        self._loop = loop
        self._watched[pid] = (pidfd, {importer})
        loop.add_reader(pidfd, self._exited, pid)
        return True

    def check_exited(self, pid: int) -> None:
        """Right after a connection closed: release at once if its process is gone already."""
        entry = self._watched.get(pid)
        if entry is None:
            return
        poll = select.poll()  # not select(): a worker with many fds open numbers its pidfds over FD_SETSIZE
        poll.register(entry[0], select.POLLIN)
        if poll.poll(0):
            self._exited(pid)

    def _exited(self, pid: int) -> None:
        pidfd, importers = self._watched.pop(pid)
        if self._loop is not None:
            self._loop.remove_reader(pidfd)
        os.close(pidfd)
        for importer in sorted(importers):
            logger.info("pool %s: importer %s (pid %d) exited; releasing what it held", self._name, importer, pid)
            try:
                self._handler.importer_exited(importer)
            except Exception:
                logger.exception("pool %s: releasing the leases of %s failed", self._name, importer)

    def __len__(self) -> int:
        return len(self._watched)

    def close(self) -> None:
        """Stop watching; close every pidfd (the broker is closing)."""
        for pidfd, _ in self._watched.values():
            if self._loop is not None:
                self._loop.remove_reader(pidfd)
            os.close(pidfd)
        self._watched.clear()
