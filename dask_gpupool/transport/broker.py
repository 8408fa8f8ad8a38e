"""The fd broker: hands a pool's shareable fd to same-host peers.

A CUDA pool's (or a memfd's) shareable handle is a file descriptor, and the
only way to give an fd to an unrelated process is a Unix-domain socket with
SCM_RIGHTS (re-opening ``/proc/<pid>/fd/<n>`` fails for CUDA handles, and
``pidfd_getfd`` needs ptrace rights). Each worker runs one :class:`FdBroker`.

Protocol (``SOCK_SEQPACKET``, so each message arrives whole; msgpack maps
from :mod:`dask_gpupool.wire.broker`)::

    peer   -> broker   Hello{op: "hello", token, worker}         (first, always)
    broker -> peer     Welcome{op: "welcome"}
                   or  ErrorReply{error: "NotAMemberError"}, then closes

    peer   -> broker   HandleRequest{op: "pool-handle", pool}
    broker -> peer     HandleReply{op: "pool-handle-ok", pool, kind, size}
    broker -> peer     one byte, with the fd as SCM_RIGHTS ancillary data
                   or  ErrorReply{op: "error", error, message}

    peer   -> broker   LeaseClaim{op: "lease-claim", leases}
    broker -> peer     ClaimReply{op: "claim-ok", leases: the refused ones}
    peer   -> broker   LeaseRelease{op: "lease-release", leases}  (no reply)
    peer   -> broker   Resync{op: "resync", leases, done}         (first on a reopened link)
    broker -> peer     ResyncReply{op: "resync-ok", ended}        (after the chunk with done)
    peer   -> broker   SegmentRelease{op: "segment-release", segments}  (no reply)
    peer   -> broker   LeaseForward{op: "lease-forward", lease, to}  (pass on an import)
    broker -> peer     ForwardReply{op: "forward-ok", lease, segment}
                   or  ErrorReply
    peer   -> broker   ForwardSettle{op: "forward-settle", leases}   (no reply)
    peer   -> broker   TransferFailed{op: "transfer-failed"}         (no reply; copies to the peer for a while)

    peer   -> broker   CopyRequest{op: "lease-copy", lease}
    broker -> peer     CopyReply{op: "lease-copy-ok", lease, size}
    broker -> peer     one byte, with a memfd holding the bytes
                   or  ErrorReply

A connection stays open as long as the peer wants (an importer keeps one to
each exporter it imports from, see :mod:`dask_gpupool.transport.link`). Lease requests
act only on leases of the worker the connection named in its ``Hello``
(accepted by :meth:`BrokerHandler.identify`). A connection closing ends
nothing: the broker watches each importer's process with a pidfd and tells
its handler when that process exits (:meth:`BrokerHandler.importer_exited`).
That is how an importer that dies gives its leases back, while one whose
link merely broke keeps them (it reopens the link and resyncs).

Trust boundary: the socket lives in a private directory (mode 0700, made by
the broker); the broker checks each peer's uid with ``SO_PEERCRED`` and then
the cluster's membership token, which the first message must carry (compared
with :func:`hmac.compare_digest`): only processes of the same user that are
members of this cluster get anything. Until the worker has the token (from
the scheduler's registry) the broker refuses everyone. A malformed request,
one too large, or no first message within ``timeout`` closes that connection
(logged once); the broker goes on serving others. See docs/security.md.

Parts: :class:`FdBroker` owns the socket, its thread and loop, and each
connection until its hello; :mod:`~dask_gpupool.transport.broker_admission`
bounds the open connections and checks each peer's uid and hello;
:class:`~dask_gpupool.transport.broker_requests.BrokerRequests` answers the
requests after it; :class:`~dask_gpupool.transport.broker_admission.ImporterWatch`
watches the importers' processes.

Threads: the broker runs its own asyncio loop in a daemon thread, so it
never blocks the worker's event loop. :func:`~dask_gpupool.transport.link.request_pool_fd` is blocking
and runs in the caller's thread (a task thread or an executor).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import tempfile
import threading
from typing import cast

from dask_gpupool.errors import BrokerRefusedError, ConfigError, GPUPoolError, ProtocolError
from dask_gpupool.transport.broker_admission import (
    MAX_CONNECTIONS,
    MAX_PER_PEER,
    AcceptBackoff,
    ConnectionBounds,
    ImporterWatch,
    hello_refusal,
    peer_credentials,
)
from dask_gpupool.transport.broker_dirs import DIR_PREFIX, SOCKET_NAME, remove_stale_broker_dirs
from dask_gpupool.transport.broker_handler import BrokerHandler, LookupOnly, PoolLookup
from dask_gpupool.transport.broker_requests import BrokerRequests
from dask_gpupool.wire.broker import ErrorReply, Hello, Welcome
from dask_gpupool.wire.codec import MAX_MESSAGE_BYTES, decode, encode

__all__ = ["MAX_CONNECTIONS", "MAX_PER_PEER", "BrokerHandler", "FdBroker", "PoolLookup"]

logger = logging.getLogger(__name__)

_UNIX_PATH_MAX = 107


class FdBroker:
    """Serve pools' fds to same-uid peers on this host.

    Parameters
    ----------
    handler : BrokerHandler or PoolLookup
        Answers requests (runs on the broker's thread). A bare
        :data:`PoolLookup` serves pool fds only.
    directory : str or None
        Parent of the broker's private directory (default: the temporary
        directory, made absolute from the working directory).
    timeout : float
        Seconds a new connection may take to send its hello, and a reply (or
        the fd after it) may wait for room in a connection whose member does
        not read its answers; past either, the connection is closed.
    name : str
        Used in log messages and the directory name (the pool UUID).
    token : bytes or None
        The cluster's membership token; ``None`` refuses everyone until
        :attr:`token` is set.
    max_per_peer : int
        Open connections one peer process (its ``SO_PEERCRED`` pid) may hold;
        further ones are refused (:data:`MAX_PER_PEER`).
    max_connections : int
        Open connections in all; further ones are refused
        (:data:`MAX_CONNECTIONS`).

    Attributes
    ----------
    address : str
        Path of the socket; peers find it in the scheduler's registry.
    served, refused : int
        Fds handed out; connections closed for bad credentials or input, for
        no hello within ``timeout`` of their accept, or over a bound.
    accept_errors : int
        Times accepting failed for want of resources (``EMFILE``, ``ENFILE``,
        ...); the broker paused and went on accepting each time.
    max_per_peer, max_connections : int
        The bounds above.

    Raises
    ------
    ConfigError
        When ``directory`` (``gpupool.broker-dir``) is missing, not a
        directory, or not writable by this process.

    Notes
    -----
    fd ownership: the listening socket and every accepted connection are the
    broker's and closed by :meth:`close`; the pool fds it sends stay owned by
    their pools (the kernel gives the peer its own copy). A connection refused
    over a bound is closed by the broker's thread at once, after a
    best-effort :class:`BrokerRefusedError` reply.

    Load: a peer that does not send its hello within ``timeout`` of its
    accept is closed (one message, whole, on a ``SOCK_SEQPACKET`` socket, so
    no trickle can stretch it); at most ``max_per_peer`` connections per pid
    and ``max_connections`` in all are open; when the process runs out of fds
    the accept loop logs once, backs off up to :data:`~dask_gpupool.transport.broker_admission.ACCEPT_BACKOFF_MAX`
    seconds (on its own asyncio loop, which keeps serving the open
    connections) and accepts again. See docs/reliability.md.
    """

    address: str
    refused: int
    token: bytes | None
    _handler: BrokerHandler
    _timeout: float
    _name: str
    _dir: str
    _sock: socket.socket
    _loop: asyncio.AbstractEventLoop
    _thread: threading.Thread
    _conns: set[socket.socket]
    _importers: ImporterWatch
    _bounds: ConnectionBounds
    _requests: BrokerRequests
    _closed: bool

    def __init__(
        self,
        handler: BrokerHandler | PoolLookup,
        directory: str | None,
        timeout: float,
        name: str = "pool",
        token: bytes | None = None,
        max_per_peer: int = MAX_PER_PEER,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self._bounds = ConnectionBounds(max_per_peer, max_connections)
        self.token = token
        self._handler = cast(BrokerHandler, handler) if hasattr(handler, "pool_handle") else LookupOnly(handler)
        self._timeout = timeout
        self._name = name
        self._backoff = AcceptBackoff(f"pool {name}: broker")
        self._next_connection = 0
        self.refused = 0
        self._conns = set()
        self._importers = ImporterWatch(self._handler, name)
        self._closed = False
        # Peers connect by the path in the registry row, which must be absolute: a relative temporary directory
        # (TMPDIR=., which tempfile keeps as ".") is taken from this process's working directory, as a relative
        # gpupool.broker-dir is (config._parse_broker_dir).
        parent = directory or os.path.abspath(tempfile.gettempdir())
        remove_stale_broker_dirs(parent)
        try:
            self._dir = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{name[:8]}-", dir=parent)  # mode 0700
        except (FileNotFoundError, NotADirectoryError, PermissionError) as e:
            if directory is None:
                raise
            raise ConfigError(
                f"gpupool.broker-dir={directory!r}: this worker cannot make its broker's directory there "
                f"({e.strerror}); valid: an existing directory it may write to, on this host"
            ) from None
        self.address = os.path.join(self._dir, SOCKET_NAME)
        try:
            if len(os.fsencode(self.address)) > _UNIX_PATH_MAX:
                raise GPUPoolError(
                    f"broker socket path {self.address!r} is longer than {_UNIX_PATH_MAX} bytes; "
                    "set gpupool.broker-dir to a shorter directory"
                )
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            try:
                self._sock.bind(self.address)
                self._sock.listen(64)
                self._sock.setblocking(False)
            except BaseException:
                self._sock.close()
                raise
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(self.address)
            os.rmdir(self._dir)
            raise
        self._loop = asyncio.new_event_loop()
        self._requests = BrokerRequests(self._handler, self._loop, timeout)
        self._thread = threading.Thread(target=self._run, name=f"gpupool-broker-{name[:8]}", daemon=True)
        self._thread.start()
        logger.debug("pool %s: broker serving at %s", name, self.address)

    # -- the broker's thread ----------------------------------------------------

    @property
    def accept_errors(self) -> int:
        """Failed accepts that made the accept loop pause (out of fds or memory)."""
        return self._backoff.errors

    @property
    def served(self) -> int:
        """Pool and segment fds handed out."""
        return self._requests.served

    @property
    def copies(self) -> int:
        """Host copies (memfds) handed out."""
        return self._requests.copies

    @property
    def max_per_peer(self) -> int:
        """Open connections one peer process may hold."""
        return self._bounds.max_per_peer

    @property
    def max_connections(self) -> int:
        """Open connections in all."""
        return self._bounds.max_connections

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._handler.thread_started()
        except Exception:
            logger.exception("pool %s: broker thread setup failed", self._name)
        self._accept_task = self._loop.create_task(self._accept())
        self._tick_task = self._loop.create_task(self._tick())
        try:
            self._loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(self._loop)
            for t in tasks:
                t.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._importers.close()
            self._loop.close()

    async def _accept(self) -> None:
        """Accept peers until the broker closes; no error ends it.

        Out of fds (``EMFILE``/``ENFILE``) or memory, it logs once, pauses
        (50 ms, doubling up to :data:`~dask_gpupool.transport.broker_admission.ACCEPT_BACKOFF_MAX`) and tries again; the
        queued peers wait in the listen backlog meanwhile. Runs on the
        broker's thread.
        """
        backoff = self._backoff
        while True:
            try:
                conn, _ = await self._loop.sock_accept(self._sock)
            except asyncio.CancelledError:
                raise
            except OSError as e:
                if self._closed or self._sock.fileno() < 0:
                    return
                pause = backoff.failed(e)
                if pause:
                    await asyncio.sleep(pause)
                continue
            backoff.accepted()
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        """Serve ``conn`` if its pid and the broker are under their bounds; else refuse and close it."""
        conn.setblocking(False)
        try:
            pid = peer_credentials(conn)[0]
        except OSError:
            conn.close()
            return
        refused = self._bounds.admit(pid, len(self._conns))
        if refused is None:
            self._conns.add(conn)
            self._loop.create_task(self._serve_counted(conn, pid))
            return
        why, first = refused
        self.refused += 1
        if first:
            logger.warning("pool %s: broker refuses connections: %s", self._name, why)
        refusal = BrokerRefusedError(f"pool {self._name}: broker refused the connection: {why}")
        with contextlib.suppress(OSError):
            conn.send(encode(ErrorReply.of(refusal)))  # best effort; never waits
        conn.close()

    async def _serve_counted(self, conn: socket.socket, pid: int) -> None:
        """:meth:`_serve`, counted against ``pid``'s bound while it runs."""
        try:
            await self._serve(conn)
        finally:
            self._bounds.closed(pid, len(self._conns))

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                self._handler.tick()
            except Exception:
                logger.exception("pool %s: broker tick failed", self._name)

    async def _serve(self, conn: socket.socket) -> None:
        pid = -1
        spoke = False
        importer = ""
        resync: set[int] = set()
        try:
            pid, uid, _gid = peer_credentials(conn)
            if uid != os.getuid():
                self.refused += 1
                logger.warning("pool %s: broker refused pid %d of uid %d (not ours)", self._name, pid, uid)
                return
            while True:
                recv = self._loop.sock_recv(conn, MAX_MESSAGE_BYTES + 1)
                try:
                    # The first request must come within the timeout; after that the peer
                    # keeps the connection for its leases as long as it likes.
                    data = await (recv if spoke else asyncio.wait_for(recv, self._timeout))
                except TimeoutError:
                    self.refused += 1
                    logger.warning("pool %s: broker closed connection of pid %d: no request", self._name, pid)
                    return
                if not data:
                    return
                if not spoke:
                    hello = Hello.from_msg(decode(data))
                    refusal = hello_refusal(hello, pid, self.token, self._handler, self._name)
                    if refusal is not None:
                        self.refused += 1
                        logger.warning("pool %s: broker refused pid %d: %s", self._name, pid, refusal)
                        with contextlib.suppress(OSError):
                            await self._loop.sock_sendall(conn, encode(ErrorReply.of(refusal)))
                        return
                    importer = hello.worker
                    if importer:
                        self._importers.watch(self._loop, pid, importer)
                    await self._loop.sock_sendall(conn, encode(Welcome()))
                    spoke = True
                    continue
                await self._requests.answer(conn, decode(data), importer, resync)
        except ProtocolError as e:
            self.refused += 1
            logger.warning("pool %s: broker closed connection of pid %d: %s", self._name, pid, e)
        except TimeoutError as e:  # a reply found no room: it sends requests and does not read the answers
            self.refused += 1
            logger.warning("pool %s: broker dropped connection of pid %d: it reads no replies (%s)", self._name, pid, e)
        except (ConnectionError, OSError) as e:
            logger.debug("pool %s: broker connection of pid %d broke: %s", self._name, pid, e)
        except asyncio.CancelledError:
            pass
        finally:
            self._conns.discard(conn)
            conn.close()
            # A closed connection is not a dead importer (its link may have timed out on us while we
            # were stalled): its leases stay until it releases them, resyncs, or its process exits.
            if importer and pid > 0:
                self._importers.check_exited(pid)

    def importer_left(self, importer: str, pid: int) -> None:
        """``importer`` (process ``pid`` on this host, 0: unknown) left the registry; any thread.

        Its leases end when its process exits, not now
        (:meth:`ImporterWatch.left <dask_gpupool.transport.broker_admission.ImporterWatch.left>`, on the broker's
        thread); at once when this broker is closed.
        """
        try:
            self._loop.call_soon_threadsafe(self._importers.left, self._loop, pid, importer)
        except RuntimeError:  # the broker's loop is closed: nothing watches any more
            self._handler.importer_exited(importer)

    @property
    def watched(self) -> int:
        """Importer processes watched (for leak checks)."""
        return len(self._importers)

    @property
    def handler(self) -> BrokerHandler:
        """What this broker asks (its owner's :class:`BrokerHandler`)."""
        return self._handler

    # -- owner's side -------------------------------------------------------------

    @property
    def connections(self) -> int:
        """Open peer connections."""
        return len(self._conns)

    def close(self) -> None:
        """Stop serving, close every socket, remove the socket file and directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._sock.close()
        for conn in list(self._conns):
            conn.close()
        self._conns.clear()
        self._bounds.clear()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.address)
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(self._dir)
        logger.debug("pool %s: broker closed", self._name)
