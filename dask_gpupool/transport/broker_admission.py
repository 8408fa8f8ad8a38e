"""Who a broker serves, for how long, and how its accept loop stays alive.

Sections:

- *Admission.* A broker accepts connections before it knows who is asking. :class:`ConnectionBounds` keeps a flood
  of them from stopping it: at most ``max_per_peer`` open connections per peer process (its ``SO_PEERCRED`` pid)
  and ``max_connections`` in all. :func:`peer_credentials` reads who is at the other end of a connection;
  :func:`hello_refusal` checks its first message: the cluster's membership token (compared with
  :func:`hmac.compare_digest`) and, when it names a worker, that the registry row of that worker names the peer's
  process (:meth:`~dask_gpupool.transport.broker_handler.BrokerHandler.identify`). See docs/security.md and
  docs/reliability.md.
- *The importer processes a broker watches* (:class:`ImporterWatch`): their exit, not a closed connection, ends
  their leases. A connection closing ends nothing (an importer whose link broke reopens it and resyncs), and neither
  does an importer leaving the registry while its process lives (the scheduler removes workers it lost touch with:
  ``worker-ttl`` after a stall, a broken stream), :meth:`ImporterWatch.left`. The broker watches each importer's
  process with a pidfd (``os.pidfd_open``) on its own event loop and tells its
  :class:`~dask_gpupool.transport.broker_handler.BrokerHandler` when that process exits
  (:meth:`~dask_gpupool.transport.broker_handler.BrokerHandler.importer_exited`). One process may be several
  importers (``dask worker --no-nanny --nworkers 2`` runs two workers in one process): a pid is watched once, for
  every worker address it is, and its exit ends the leases of each. :class:`ImporterWatch` owns the pidfds and
  closes each when its process exits or in :meth:`ImporterWatch.close`.
- *The back-off that keeps an accept loop alive* (:class:`AcceptBackoff`), shared by the fd broker and the copy
  server. A server that stops accepting for good is a denial of service (an fd flood would end both accept loops
  with ``EMFILE``). An accept loop asks :meth:`AcceptBackoff.failed` what to do after each failed ``accept``: try
  again at once (a transient error: the peer gave up, a signal) or pause, 50 ms doubling up to
  :data:`ACCEPT_BACKOFF_MAX` (out of fds or memory), while the queued peers wait in the listen backlog. It logs once
  when it starts backing off and once when it accepts again.

Broker thread only (:class:`AcceptBackoff`: the thread of the accept loop that owns it).
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import logging
import os
import select
import socket
import struct

from dask_gpupool.errors import ConfigError, GPUPoolError, NotAMemberError
from dask_gpupool.memory.lifetime import open_pidfd
from dask_gpupool.transport.broker_handler import BrokerHandler
from dask_gpupool.wire.broker import Hello

__all__ = [
    "ACCEPT_BACKOFF_MAX",
    "MAX_CONNECTIONS",
    "MAX_PER_PEER",
    "AcceptBackoff",
    "ConnectionBounds",
    "ImporterWatch",
    "hello_refusal",
    "peer_credentials",
]

logger = logging.getLogger(__name__)


_PEERCRED = struct.Struct("3i")

#: Open connections one peer process (``SO_PEERCRED`` pid) may hold to a broker; more are refused.
MAX_PER_PEER = 64
#: Open connections a broker holds in all; more are refused.
MAX_CONNECTIONS = 1024


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of ``conn`` (``SO_PEERCRED``); ``OSError`` if unreadable."""
    pid, uid, gid = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid, gid


class ConnectionBounds:
    """A broker's open connections by peer pid, against its bounds per peer and in all.

    Parameters
    ----------
    max_per_peer : int
        Open connections one peer process (its ``SO_PEERCRED`` pid) may hold
        (:data:`MAX_PER_PEER`).
    max_connections : int
        Open connections in all (:data:`MAX_CONNECTIONS`).

    Raises
    ------
    ConfigError
        For a bound below 1.
    """

    max_per_peer: int
    max_connections: int
    _per_pid: dict[int, int]
    _refusing: set[int]

    def __init__(self, max_per_peer: int = MAX_PER_PEER, max_connections: int = MAX_CONNECTIONS) -> None:
        if max_per_peer < 1 or max_connections < 1:
            raise ConfigError(f"broker bounds must be positive integers: {max_per_peer=}, {max_connections=}")
        self.max_per_peer, self.max_connections = max_per_peer, max_connections
        self._per_pid = {}  # open connections by peer pid (broker thread only)
        self._refusing = set()  # pids (-1: everyone) refused since their last close: warned once

    def admit(self, pid: int, open_now: int) -> tuple[str, bool] | None:
        """Count a new connection of ``pid`` (``open_now`` are open) and return ``None`` if it is under the bounds.

        Over a bound, it is not counted: returns why, and whether this is the
        first refusal of that peer (or of everyone, for the bound in all)
        since its connections closed, which the broker warns about.
        """
        if open_now >= self.max_connections:
            why, who = f"{open_now} connections open (gpupool broker bound {self.max_connections})", -1
        elif self._per_pid.get(pid, 0) >= self.max_per_peer:
            why, who = f"pid {pid} holds {self.max_per_peer} connections (the bound per peer)", pid
        else:
            self._per_pid[pid] = self._per_pid.get(pid, 0) + 1
            return None
        first = who not in self._refusing
        self._refusing.add(who)
        return why, first

    def closed(self, pid: int, open_now: int) -> None:
        """A connection of ``pid`` that :meth:`admit` counted closed; ``open_now`` stay open."""
        left = self._per_pid.get(pid, 1) - 1
        if left > 0:
            self._per_pid[pid] = left
        else:
            self._per_pid.pop(pid, None)
            self._refusing.discard(pid)  # warn again about this pid's next flood, not its every refusal
        if open_now < self.max_connections // 2:
            self._refusing.discard(-1)

    def clear(self) -> None:
        """Forget every count (the broker closed its connections)."""
        self._per_pid.clear()


def hello_refusal(
    hello: Hello, pid: int, token: bytes | None, handler: BrokerHandler, name: str
) -> GPUPoolError | None:
    """Why the connection of process ``pid`` whose first message is ``hello`` is refused; ``None`` if it is not.

    ``token`` is the cluster's membership token (``None`` until the worker has
    it: everyone is refused); ``handler`` says whether ``pid`` is the process
    of the worker the hello names; ``name`` is the pool, for messages.
    """
    if token is None or not hmac.compare_digest(hello.token, token):
        return NotAMemberError(f"pool {name}: not a member of this cluster (token mismatch)")
    if hello.worker and not handler.identify(hello.worker, pid):
        return NotAMemberError(f"pool {name}: pid {pid} is not the process of worker {hello.worker} in the registry")
    return None


# -- the importer processes a broker watches ---------------------------------------------------------------------------


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


# -- the back-off that keeps an accept loop alive ----------------------------------------------------------------------


#: Longest pause between accept attempts after a failure, in seconds.
ACCEPT_BACKOFF_MAX = 1.0

#: Errors of one connection, not of the server: accept again at once.
_TRANSIENT = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN})


class AcceptBackoff:
    """How long an accept loop pauses after a failed ``accept``.

    Parameters
    ----------
    what : str
        The server, as its log lines name it (``"pool <uuid>: broker"``).

    Attributes
    ----------
    errors : int
        Failed accepts that were not transient (each made the loop pause).
    """

    what: str
    errors: int
    _pause: float

    def __init__(self, what: str) -> None:
        self.what = what
        self.errors = 0
        self._pause = 0.0

    def failed(self, e: OSError) -> float:
        """Seconds to pause before accepting again after ``e`` (0: at once, a transient error)."""
        if e.errno in _TRANSIENT:
            return 0.0
        self.errors += 1
        if not self._pause:
            logger.warning(
                "%s cannot accept (%s); retrying, backing off up to %.0f s", self.what, e, ACCEPT_BACKOFF_MAX
            )
        self._pause = min(max(2 * self._pause, 0.05), ACCEPT_BACKOFF_MAX)
        return self._pause

    def accepted(self) -> None:
        """A connection was accepted: end the back-off (and say so if there was one)."""
        if self._pause:
            logger.warning("%s accepts again", self.what)
            self._pause = 0.0
