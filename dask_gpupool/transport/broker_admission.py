"""Who a broker serves: its bounds on open connections, the peer's credentials, and the check of its ``Hello``.

A broker accepts connections before it knows who is asking.
:class:`ConnectionBounds` keeps a flood of them from stopping it: at most
``max_per_peer`` open connections per peer process (its ``SO_PEERCRED`` pid)
and ``max_connections`` in all. :func:`peer_credentials` reads who is at the
other end of a connection; :func:`hello_refusal` checks its first message:
the cluster's membership token (compared with :func:`hmac.compare_digest`)
and, when it names a worker, that the registry row of that worker names the
peer's process (:meth:`~dask_gpupool.transport.broker_handler.BrokerHandler.identify`).
See docs/security.md and docs/reliability.md.

Broker thread only.
"""

from __future__ import annotations

import hmac
import socket
import struct

from dask_gpupool.errors import ConfigError, GPUPoolError, NotAMemberError
from dask_gpupool.transport.broker_handler import BrokerHandler
from dask_gpupool.wire.broker import Hello

__all__ = ["MAX_CONNECTIONS", "MAX_PER_PEER", "ConnectionBounds", "hello_refusal", "peer_credentials"]

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
