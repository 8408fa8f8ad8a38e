"""The fd broker: hands a pool's shareable fd to same-host peers.

A CUDA pool's (or a memfd's) shareable handle is a file descriptor, and the
only way to give an fd to an unrelated process is a Unix-domain socket with
SCM_RIGHTS (re-opening ``/proc/<pid>/fd/<n>`` fails for CUDA handles, and
``pidfd_getfd`` needs ptrace rights). Each worker runs one :class:`FdBroker`.

Protocol (``SOCK_SEQPACKET``, so each message arrives whole; msgpack maps
from :mod:`dask_gpupool._messages`)::

    peer   -> broker   Hello{op: "hello", token}                 (first, always)
    broker -> peer     Welcome{op: "welcome"}
                   or  ErrorReply{error: "NotAMemberError"}, then closes

    peer   -> broker   HandleRequest{op: "pool-handle", pool}
    broker -> peer     HandleReply{op: "pool-handle-ok", pool, kind, size}
    broker -> peer     one byte, with the fd as SCM_RIGHTS ancillary data
                   or  ErrorReply{op: "error", error, message}

    peer   -> broker   LeaseClaim{op: "lease-claim", leases}      (no reply)
    peer   -> broker   LeaseRelease{op: "lease-release", leases}  (no reply)
    peer   -> broker   SegmentRelease{op: "segment-release", segments}  (no reply)

    peer   -> broker   CopyRequest{op: "lease-copy", lease}
    broker -> peer     CopyReply{op: "lease-copy-ok", lease, size}
    broker -> peer     one byte, with a memfd holding the bytes
                   or  ErrorReply

A connection stays open as long as the peer wants (an importer keeps one to
each exporter it imports from, see :mod:`dask_gpupool._link`); when it
closes, the broker tells its handler, which releases the leases claimed on
it. That is how an importer that dies gives its leases back.

Trust boundary: the socket lives in a private directory (mode 0700, made by
the broker); the broker checks each peer's uid with ``SO_PEERCRED`` and then
the cluster's membership token, which the first message must carry (compared
with :func:`hmac.compare_digest`): only processes of the same user that are
members of this cluster get anything. Until the worker has the token (from
the scheduler's registry) the broker refuses everyone. A malformed request,
one too large, or no first message within ``timeout`` closes that connection
(logged once); the broker goes on serving others. See docs/security.md.

Threads: the broker runs its own asyncio loop in a daemon thread, so it
never blocks the worker's event loop. :func:`request_pool_fd` is blocking
and runs in the caller's thread (a task thread or an executor).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol, cast

from dask_gpupool._errors import GPUPoolError, NotAMemberError, ProtocolError, UnknownPoolError
from dask_gpupool._messages import (
    MAX_MESSAGE_BYTES,
    CopyReply,
    CopyRequest,
    ErrorReply,
    HandleReply,
    HandleRequest,
    Hello,
    LeaseClaim,
    LeaseRelease,
    SegmentRelease,
    Welcome,
    decode,
    encode,
    parse_request,
)

__all__ = ["BrokerHandler", "FdBroker", "PoolLookup", "remove_stale_broker_dirs", "request_pool_fd"]

logger = logging.getLogger(__name__)

#: Returns ``(fd, reply)`` for a pool this broker serves, else ``None``. The fd stays owned by the pool.
PoolLookup = Callable[[str], "tuple[int, HandleReply] | None"]


class BrokerHandler(Protocol):
    """What a broker asks its owner. Every method runs on the broker's thread
    (``copy_out`` on a helper thread) and must not block for long."""

    def thread_started(self) -> None:
        """Called once on the broker's thread before it serves anything."""

    def pool_handle(self, pool: str) -> tuple[int, HandleReply] | None:
        """``(fd, reply)`` for a pool this broker serves, else ``None``. The fd stays the pool's."""

    def claim(self, leases: Iterable[int], connection: int) -> None:
        """An importer on ``connection`` imported these leased buffers."""

    def release(self, leases: Iterable[int], connection: int) -> None:
        """An importer on ``connection`` closed its imports of these leased buffers."""

    def segments_released(self, segments: tuple[tuple[int, int], ...], connection: int) -> None:
        """An importer on ``connection`` unmapped these retiring segments ``(id, claims)``."""

    def connection_closed(self, connection: int) -> None:
        """``connection`` closed: release what was claimed on it."""

    def copy_out(self, lease: int) -> tuple[int, int]:
        """``(memfd, size)`` holding a copy of a leased buffer; the broker closes the memfd.

        Raises a :class:`~dask_gpupool.GPUPoolError` when the lease is gone.
        """

    def tick(self) -> None:
        """Called about once a second (lease expiry)."""


class _LookupOnly:
    """A :class:`BrokerHandler` that serves pool fds and nothing else."""

    def __init__(self, lookup: PoolLookup) -> None:
        self._lookup = lookup

    def thread_started(self) -> None:
        pass

    def pool_handle(self, pool: str) -> tuple[int, HandleReply] | None:
        return self._lookup(pool)

    def claim(self, leases: Iterable[int], connection: int) -> None:
        pass

    def release(self, leases: Iterable[int], connection: int) -> None:
        pass

    def segments_released(self, segments: tuple[tuple[int, int], ...], connection: int) -> None:
        pass

    def connection_closed(self, connection: int) -> None:
        pass

    def copy_out(self, lease: int) -> tuple[int, int]:
        raise UnknownPoolError("this broker serves no leases")

    def tick(self) -> None:
        pass


_SOCKET_NAME = "broker.sock"
_UNIX_PATH_MAX = 107
_PEERCRED = struct.Struct("3i")


class FdBroker:
    """Serve pools' fds to same-uid peers on this host.

    Parameters
    ----------
    handler : BrokerHandler or PoolLookup
        Answers requests (runs on the broker's thread). A bare
        :data:`PoolLookup` serves pool fds only.
    directory : str or None
        Parent of the broker's private directory (default: the temp dir).
    timeout : float
        Seconds a connection may wait to send its next request.
    name : str
        Used in log messages and the directory name (the pool UUID).
    token : bytes or None
        The cluster's membership token; ``None`` refuses everyone until
        :attr:`token` is set.

    Attributes
    ----------
    address : str
        Path of the socket; peers find it in the scheduler's registry.
    served, refused : int
        Fds handed out; connections closed for bad credentials or input.

    Notes
    -----
    fd ownership: the listening socket and every accepted connection are the
    broker's and closed by :meth:`close`; the pool fds it sends stay owned by
    their pools (the kernel gives the peer its own copy).
    """

    address: str
    served: int
    refused: int
    copies: int
    token: bytes | None
    _handler: BrokerHandler
    _timeout: float
    _name: str
    _dir: str
    _sock: socket.socket
    _loop: asyncio.AbstractEventLoop
    _thread: threading.Thread
    _conns: set[socket.socket]
    _closed: bool

    def __init__(
        self,
        handler: BrokerHandler | PoolLookup,
        directory: str | None,
        timeout: float,
        name: str = "pool",
        token: bytes | None = None,
    ) -> None:
        self.token = token
        self._handler = cast(BrokerHandler, handler) if hasattr(handler, "pool_handle") else _LookupOnly(handler)
        self._timeout = timeout
        self._name = name
        self._next_connection = 0
        self.served = self.refused = self.copies = 0
        self._conns = set()
        self._closed = False
        parent = directory or tempfile.gettempdir()
        remove_stale_broker_dirs(parent)
        self._dir = tempfile.mkdtemp(prefix=f"dask-gpupool-{name[:8]}-", dir=parent)  # mode 0700
        self.address = os.path.join(self._dir, _SOCKET_NAME)
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
        self._thread = threading.Thread(target=self._run, name=f"gpupool-broker-{name[:8]}", daemon=True)
        self._thread.start()
        logger.debug("pool %s: broker serving at %s", name, self.address)

    # -- the broker's thread ----------------------------------------------------

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
            self._loop.close()

    async def _accept(self) -> None:
        while True:
            conn, _ = await self._loop.sock_accept(self._sock)
            conn.setblocking(False)
            self._conns.add(conn)
            self._loop.create_task(self._serve(conn))

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                self._handler.tick()
            except Exception:
                logger.exception("pool %s: broker tick failed", self._name)

    async def _serve(self, conn: socket.socket) -> None:
        pid = -1
        self._next_connection += 1
        connection = self._next_connection
        spoke = False
        try:
            pid, uid, _gid = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
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
                    if not self._member(Hello.from_msg(decode(data))):
                        self.refused += 1
                        logger.warning("pool %s: broker refused pid %d: not a member of this cluster", self._name, pid)
                        refusal = NotAMemberError(f"pool {self._name}: not a member of this cluster (token mismatch)")
                        with contextlib.suppress(OSError):
                            await self._loop.sock_sendall(conn, encode(ErrorReply.of(refusal)))
                        return
                    await self._loop.sock_sendall(conn, encode(Welcome()))
                    spoke = True
                    continue
                await self._answer(conn, decode(data), connection)
        except ProtocolError as e:
            self.refused += 1
            logger.warning("pool %s: broker closed connection of pid %d: %s", self._name, pid, e)
        except (ConnectionError, OSError) as e:
            logger.debug("pool %s: broker connection of pid %d broke: %s", self._name, pid, e)
        except asyncio.CancelledError:
            pass
        finally:
            self._conns.discard(conn)
            conn.close()
            try:
                self._handler.connection_closed(connection)
            except Exception:
                logger.exception("pool %s: releasing the leases of a closed connection failed", self._name)

    @property
    def handler(self) -> BrokerHandler:
        """What this broker asks (its owner's :class:`BrokerHandler`)."""
        return self._handler

    def _member(self, hello: Hello) -> bool:
        token = self.token
        return token is not None and hmac.compare_digest(hello.token, token)

    async def _answer(self, conn: socket.socket, msg: dict[str, object], connection: int) -> None:
        request = parse_request(msg)
        if isinstance(request, LeaseClaim):
            self._handler.claim(request.leases, connection)
        elif isinstance(request, LeaseRelease):
            self._handler.release(request.leases, connection)
        elif isinstance(request, SegmentRelease):
            self._handler.segments_released(request.segments, connection)
        elif isinstance(request, HandleRequest):
            found = self._handler.pool_handle(request.pool)
            if found is None:
                reply = ErrorReply.of(UnknownPoolError(f"pool {request.pool} is not served by this broker"))
                await self._loop.sock_sendall(conn, encode(reply))
                return
            fd, handle_reply = found
            await self._loop.sock_sendall(conn, encode(handle_reply))
            await self._send_fd(conn, fd)
            self.served += 1
        elif isinstance(request, CopyRequest):
            try:
                fd, size = await self._loop.run_in_executor(None, self._handler.copy_out, request.lease)
            except GPUPoolError as e:
                await self._loop.sock_sendall(conn, encode(ErrorReply.of(e)))
                return
            try:
                await self._loop.sock_sendall(conn, encode(CopyReply(request.lease, size)))
                await self._send_fd(conn, fd)
            finally:
                os.close(fd)
            self.copies += 1

    async def _send_fd(self, conn: socket.socket, fd: int) -> None:
        # The fd travels in a message of its own; a seqpacket socket sends it whole or not at all.
        while True:
            try:
                socket.send_fds(conn, [b"\0"], [fd])
                return
            except BlockingIOError:
                await asyncio.sleep(0.001)

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
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.address)
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(self._dir)
        logger.debug("pool %s: broker closed", self._name)


#: Prefix of every broker directory (``mkdtemp`` adds the pool's first 8 characters and a random suffix).
_DIR_PREFIX = "dask-gpupool-"
#: Broker directories changed less than this many seconds ago are never judged stale: a broker may be
#: starting in one (``mkdtemp`` comes before ``bind``).
STALE_AFTER = 10.0


def remove_stale_broker_dirs(parent: str, min_age: float = STALE_AFTER) -> list[str]:
    """Remove the broker directories in ``parent`` that brokers left when they died without closing.

    A broker killed with SIGKILL (or a worker that crashed) leaves its private
    directory and socket behind. :class:`FdBroker` calls this before it makes
    its own directory. An entry is removed only when all of these hold:

    - its name starts with ``dask-gpupool-``;
    - it is a directory, not a link to one (``lstat``), owned by this
      process's uid;
    - it was last modified more than ``min_age`` seconds ago;
    - nobody listens on it: it has no ``broker.sock``, or that is a socket of
      ours and connecting to it is refused (``ECONNREFUSED``).

    Then the socket file is unlinked and the directory removed with ``rmdir``,
    so a directory that holds anything else stays. Other users' directories,
    live brokers' (even of another cluster: a connection that sends nothing
    is closed by the broker) and anything that cannot be judged are left
    alone. ``gpupool.broker-dir`` must be host-local: a socket on a shared
    filesystem would look dead from every other host.

    Parameters
    ----------
    parent : str
        The directory brokers make their directories in.
    min_age : float
        Seconds since a directory's last change before it may count as stale.

    Returns
    -------
    list of str
        The directories removed. Never raises for an entry it cannot read or
        remove; it leaves it.

    Notes
    -----
    Blocking, in the caller's thread: one non-blocking ``connect`` per
    candidate. Each probe's socket is opened and closed here.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(parent))
    except OSError as e:
        logger.debug("broker directory %s cannot be listed: %s", parent, e)
        return removed
    uid, now = os.getuid(), time.time()
    for entry in entries:
        if not entry.name.startswith(_DIR_PREFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or now - st.st_mtime < min_age:
                continue
            address = os.path.join(entry.path, _SOCKET_NAME)
            try:
                sst = os.lstat(address)
            except FileNotFoundError:
                pass  # died before bind, or its socket is gone: nobody can listen here
            else:
                if not stat.S_ISSOCK(sst.st_mode) or sst.st_uid != uid or not _refused(address):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(address)
            os.rmdir(entry.path)
        except FileNotFoundError:
            continue  # removed meanwhile (another broker starting here cleans up too)
        except OSError as e:
            logger.debug("broker directory %s left as it is: %s", entry.path, e)
            continue
        logger.info("removed the stale broker directory %s (its broker died without closing)", entry.path)
        removed.append(entry.path)
    return removed


def _refused(address: str) -> bool:
    """Whether connecting to the socket at ``address`` is refused: nobody listens on it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as probe:
        probe.setblocking(False)
        try:
            probe.connect(address)
        except ConnectionRefusedError:
            return True
        except OSError:  # a full backlog (EAGAIN) is a live broker; anything else cannot be judged
            return False
        return False


def request_pool_fd(address: str, pool: str, timeout: float, token: bytes) -> tuple[HandleReply, int]:
    """Ask the broker at ``address`` for pool ``pool``'s fd over a one-shot connection. Blocking.

    Workers keep a :class:`~dask_gpupool._link.PeerLink` per exporter instead;
    this is the same exchange for callers that need only the fd.

    Returns
    -------
    (HandleReply, int)
        The broker's reply and the received fd. **The caller owns the fd and
        must close it.**

    Raises
    ------
    PeerLostError
        If the broker cannot be reached or hangs up.
    NotAMemberError
        If ``token`` is not the cluster's.
    UnknownPoolError
        If the broker does not serve that pool.
    ProtocolError
        If the answer breaks the protocol.
    """
    from dask_gpupool._link import PeerLink

    link = PeerLink(address, timeout, token)
    try:
        return link.request_pool_fd(pool)
    finally:
        link.close()
