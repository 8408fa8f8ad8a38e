"""The pipelined copy path: bytes streamed from an exporter's memory into an importer's pool.

A value that must be copied to another worker (another host, a GPU that cannot
map the exporter's memory) over a ``tcp`` comm,
and is at least :data:`~dask_gpupool.tuning.COPY_STREAM_THRESHOLD` bytes, does not travel in
Dask's frames. Dask's comm writes a whole message from one thread after it was
serialized, so the device->host copy, the send, the receive and the
host->device copy would each wait for the one before. Instead the exporter
grants a lease and sends a :class:`~dask_gpupool.wire.handoff.HandoffHeader` with
path ``"stream"`` naming its :class:`CopyServer` (this module); the importer's
deserializer pulls the bytes with :func:`~dask_gpupool.transport.pull.pull`
(:mod:`dask_gpupool.transport.pull`), both through pinned slots of
:mod:`dask_gpupool.transport.staging`::

    importer -> copy server   PullRequest{op: "pull", pool, lease, proof, requester}   (length-prefixed msgpack)
    copy server -> importer   PullReply{op: "pull-ok", lease, size, chunk} | ErrorReply
    copy server -> importer   ``size`` raw bytes

**Pipelining.** GPU memory is copied device->host in chunks of ``chunk`` bytes
into :data:`~dask_gpupool.transport.staging.SLOTS` pinned staging slots (a cuda.core ``PinnedMemoryResource``)
on a stream of the server's; chunk n is sent while the next ones are copied.
The importer receives each chunk into one of its own pinned slots and copies
it host->device into its pool while the next one arrives. Host memory
(``host`` and ``pinned`` pools) is sent from, and received into, the buffers
themselves. Host staging is bounded: :data:`~dask_gpupool.transport.staging.SLOTS` chunks per transfer on each
side, whatever the size.

**Leases.** The lease (:class:`~dask_gpupool.handoff.leases.LeaseTable`) keeps the
exporter's memory alive until the server has copied the last chunk out of it;
a pull claims it for its connection, and a failed or dropped connection
releases it (the importer reads a copy, never this memory). A lease never
pulled ends with the ``get_data`` reply that carried it.

**Who may pull.** ``proof`` (:func:`~dask_gpupool.wire.stream.pull_proof`) is
HMAC-SHA256 under the cluster's membership token of this server's address, the
pool, the lease and the requesting worker: only members of the cluster can make
one, a proof captured elsewhere is worth nothing here, and a lease is served
only to the worker it was granted to. Importers pull only from the address
the exporter's registry row names (:attr:`~dask_gpupool.wire.registry.PoolRecord.copier`).
The bytes themselves travel unencrypted, as they would in Dask's ``tcp``
frames; with ``tls`` comms the copy path is not used (copies stay in Dask's
frames, encrypted).

**Threads.** The server accepts in one thread and serves each connection in a
thread of its own (blocking sockets), at most ``max_connections`` of them and
``max_per_peer`` per remote IP; connections beyond are closed at once and
counted in :attr:`CopyServer.refused`. ``pull`` blocks the thread that
deserializes, which for these small messages is Dask's event loop, for the
length of the transfer (on two H200s: docs/performance.md).

**Load.** The whole request must arrive within ``timeout`` of the accept (a
deadline, not a timeout per ``recv``: a client trickling a byte at a time is
dropped at it). When accepting fails for want of fds or memory (``EMFILE``,
``ENFILE``, ``ENOBUFS``, ``ENOMEM``) the acceptor logs once, pauses (50 ms,
doubling up to :data:`~dask_gpupool.transport.broker_admission.ACCEPT_BACKOFF_MAX`) and accepts again. See
docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import logging
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from dask_gpupool.errors import ConfigError, DataLostError, GPUPoolError, NotAMemberError, ProtocolError
from dask_gpupool.memory.topology import current_gpu
from dask_gpupool.transport.broker_admission import AcceptBackoff
from dask_gpupool.transport.staging import SLOTS, STAGING, chunks, host_view, memcpy, recv_message, send_message
from dask_gpupool.wire.broker import ErrorReply
from dask_gpupool.wire.codec import decode
from dask_gpupool.wire.stream import PullReply, PullRequest, pull_proof

if TYPE_CHECKING:
    from cuda.core import Buffer

    from dask_gpupool.handoff.leases import LeaseTable

__all__ = ["CopyServer", "Staged", "lanes"]

logger = logging.getLogger(__name__)


#: Connections (each served by a thread) one remote IP may hold to a copy server; more are refused.
MAX_PER_PEER = 128
#: Connections (threads) a copy server serves at once; more are refused.
MAX_CONNECTIONS = 512


class Staged:
    """What a stream lease keeps alive: ``nbytes`` of ``buf`` from ``offset``.

    ``holder`` (the buffer, or an array over it) is the strong reference; the
    lease table owns this object until the lease ends.
    """

    __slots__ = ("buf", "holder", "nbytes", "offset")

    def __init__(self, holder: Any, buf: Buffer, offset: int, nbytes: int) -> None:
        self.holder, self.buf, self.offset, self.nbytes = holder, buf, offset, nbytes


class CopyServer:
    """Serves a worker's stream leases over TCP. Threads of its own; blocking sockets.

    Parameters
    ----------
    pool : str
        The UUID of the pool whose leases it serves.
    leases : LeaseTable
        The pool's leases; stream leases hold :class:`Staged` objects.
    host : str
        The interface to listen on (the worker's).
    timeout : float
        Seconds from a connection's accept to the end of its request (a
        deadline for the whole request), then seconds each chunk may take to
        send.
    chunk : int
        Bytes per chunk.
    max_per_peer : int
        Connections one remote IP may hold open (:data:`MAX_PER_PEER`).
    max_connections : int
        Connections, hence serving threads, in all (:data:`MAX_CONNECTIONS`).

    Attributes
    ----------
    refused : int
        Connections closed over a bound, or for no whole request within
        ``timeout`` of their accept.
    accept_errors : int
        Times accepting failed for want of resources; the acceptor paused and
        went on each time.

    fd ownership: the listening socket and every accepted connection are the
    server's; :meth:`close` closes the listener and waits for the serving
    threads, which close their connections. The acceptor thread closes a
    connection it refuses. Threads: one acceptor, plus one thread per served
    connection, at most ``max_connections``.
    """

    @property
    def accept_errors(self) -> int:
        """Failed accepts that made the accept loop pause (out of fds or memory)."""
        return self._backoff.errors

    def __init__(
        self,
        pool: str,
        leases: LeaseTable,
        host: str,
        timeout: float,
        chunk: int,
        max_per_peer: int = MAX_PER_PEER,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        if max_per_peer < 1 or max_connections < 1:
            raise ConfigError(f"copy server bounds must be positive integers: {max_per_peer=}, {max_connections=}")
        self.pool = pool
        self.token: bytes | None = None  # the cluster's; None refuses every pull
        self.max_per_peer, self.max_connections = max_per_peer, max_connections
        self.refused = 0
        self._backoff = AcceptBackoff(f"pool {pool}: copy server")
        self._leases = leases
        self._timeout = timeout
        self._chunk = chunk
        self._connections = itertools.count(-1, -1)  # negative: broker connections count up from 1
        self._threads: set[threading.Thread] = set()
        self._per_ip: dict[str, int] = {}  # open connections by remote IP (under _lock)
        self._refusing: set[str] = set()  # IPs ("" for the total bound) warned about since they were last under it
        self._lock = threading.Lock()
        self._stop = threading.Event()  # set by close(): ends the acceptor's back-off
        self._closed = False
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind((host, 0))
            self._sock.listen(64)
        except BaseException:
            self._sock.close()
            raise
        bound = self._sock.getsockname()
        self.address = f"tcp://[{bound[0]}]:{bound[1]}" if family == socket.AF_INET6 else f"tcp://{host}:{bound[1]}"
        self._acceptor = threading.Thread(target=self._accept, name=f"gpupool-copy-{pool[:8]}", daemon=True)
        self._acceptor.start()

    def close(self) -> None:
        """Stop accepting, wait for the transfers in flight (each bounded by ``timeout``). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._acceptor.join()
        for t in threads:
            t.join()

    @property
    def transfers(self) -> int:
        """Pulls being served now."""
        with self._lock:
            return len(self._threads)

    def _accept(self) -> None:
        """The acceptor thread: accept until :meth:`close`; no error ends it.

        Out of fds or memory it logs once, pauses (50 ms, doubling up to
        :data:`~dask_gpupool.transport.broker_admission.ACCEPT_BACKOFF_MAX`) and tries again; queued peers wait in the
        listen backlog meanwhile.
        """
        backoff = self._backoff
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError as e:
                with self._lock:
                    if self._closed:
                        return
                pause = backoff.failed(e)
                if pause and self._stop.wait(pause):
                    return
                continue
            backoff.accepted()
            accepted = time.monotonic()
            ip = str(peer[0])
            why = ""
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                if len(self._threads) >= self.max_connections:
                    why, who = f"{len(self._threads)} transfers running (the bound)", ""
                elif self._per_ip.get(ip, 0) >= self.max_per_peer:
                    why, who = f"{ip} holds {self.max_per_peer} connections (the bound per peer)", ip
                else:
                    t = threading.Thread(
                        target=self._serve, args=(conn, ip, accepted), name="gpupool-copy-pull", daemon=True
                    )
                    self._threads.add(t)
                    self._per_ip[ip] = self._per_ip.get(ip, 0) + 1
                if why:
                    self.refused += 1
                    warn = who not in self._refusing
                    self._refusing.add(who)
            if why:
                if warn:
                    logger.warning("pool %s: copy server refuses connections: %s", self.pool, why)
                conn.close()
                continue
            try:
                t.start()
            except RuntimeError as e:  # no thread could be made: refuse this one, like a bound
                logger.warning("pool %s: copy server refused a connection: %s", self.pool, e)
                self._done(t, ip, refused=True)
                conn.close()

    def _done(self, t: threading.Thread, ip: str, refused: bool = False) -> None:
        """Forget serving thread ``t`` of a connection from ``ip``."""
        with self._lock:
            self._threads.discard(t)
            left = self._per_ip.get(ip, 1) - 1
            if left > 0:
                self._per_ip[ip] = left
            else:
                self._per_ip.pop(ip, None)
                self._refusing.discard(ip)
            if len(self._threads) < self.max_connections // 2:
                self._refusing.discard("")
            self.refused += refused

    def _serve(self, conn: socket.socket, ip: str, accepted: float) -> None:
        connection = next(self._connections)
        lease = 0
        try:
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    message = recv_message(conn, deadline=accepted + self._timeout)
                except TimeoutError:
                    with self._lock:
                        self.refused += 1
                    logger.info(
                        "pool %s: copy server dropped a connection from %s: no whole request within %.3g s",
                        self.pool,
                        ip,
                        self._timeout,
                    )
                    return
                except (ConnectionError, OSError) as e:  # hung up before its request: nothing to log loudly
                    logger.debug("pool %s: copy server connection from %s ended: %s", self.pool, ip, e)
                    return
                conn.settimeout(self._timeout)
                try:
                    request = PullRequest.from_msg(decode(message))
                    lease = request.lease
                    staged = self._claim(request, connection)
                except GPUPoolError as e:
                    logger.warning("pool %s: copy server refused a pull: %s", self.pool, e)
                    send_message(conn, ErrorReply.of(e).to_msg())
                    return
                send_message(conn, PullReply(lease, staged.nbytes, self._chunk).to_msg())
                try:
                    self._send(conn, staged)
                finally:
                    del staged  # the lease's release below is what frees the memory
                    self._leases.release_stream(lease, connection)
        except Exception as e:
            logger.warning("pool %s: pull of lease %d failed: %s: %s", self.pool, lease, type(e).__name__, e)
            if lease:
                self._leases.release_stream(lease, connection)
        finally:
            self._done(threading.current_thread(), ip)

    def _claim(self, request: PullRequest, connection: int) -> Staged:
        token = self.token
        if request.pool != self.pool:
            raise DataLostError(f"pool {request.pool} is not served here (this is {self.pool})")
        expected = (
            None if token is None else pull_proof(token, self.address, self.pool, request.lease, request.requester)
        )
        if expected is None or not hmac.compare_digest(request.proof, expected):
            raise NotAMemberError(f"pool {self.pool}: pull of lease {request.lease} without a valid proof")
        staged = self._leases.holder_for(request.lease, request.requester)
        if staged is not None and not isinstance(staged, Staged):
            raise ProtocolError(f"lease {request.lease} on pool {self.pool} is not a stream lease")
        if staged is None or not self._leases.claim_stream(request.lease, connection):
            raise DataLostError(
                f"lease {request.lease} on pool {self.pool} has ended or was pulled already (or is not "
                f"{request.requester}'s)"
            )
        return staged

    def _send(self, conn: socket.socket, staged: Staged) -> None:
        buf, start, n = staged.buf, int(staged.buf.handle) + staged.offset, staged.nbytes
        if buf.is_host_accessible:
            for off, size in chunks(n, self._chunk):
                conn.sendall(host_view(start + off, size))
            return
        dev = current_gpu(buf.device_id)  # the GPU it is on (an imported view's is this process's GPU)
        stream = dev.create_stream()
        slots = STAGING.take(int(dev.device_id), self._chunk, stream)
        try:
            parts = list(chunks(n, self._chunk))
            copied: list[Any] = [None] * len(parts)

            def copy_out(i: int) -> None:
                off, size = parts[i]
                memcpy(int(slots[i % SLOTS].handle), start + off, size, stream)
                copied[i] = stream.record()

            for i in range(min(SLOTS, len(parts))):
                copy_out(i)
            for i, (_off, size) in enumerate(parts):
                copied[i].sync()
                conn.sendall(host_view(int(slots[i % SLOTS].handle), size))
                if i + SLOTS < len(parts):
                    copy_out(i + SLOTS)  # into the slot just sent
        finally:
            stream.sync()
            STAGING.give(int(dev.device_id), self._chunk, slots)
            stream.close()


def lanes(nbytes: int, chunk: int, streams: int) -> list[tuple[int, int]]:
    """Split ``nbytes`` into at most ``streams`` contiguous ``(offset, nbytes)`` lanes of whole chunks."""
    if nbytes == 0:
        return [(0, 0)]
    chunks = -(-nbytes // chunk)
    per = -(-chunks // max(1, min(streams, chunks))) * chunk
    return [(off, min(per, nbytes - off)) for off in range(0, nbytes, per)]


# -- pinned staging ----------------------------------------------------------------------


# -- helpers ---------------------------------------------------------------------------
