"""The pipelined copy path: bytes streamed from an exporter's memory into an importer's pool.

A value that must be copied to another worker (another host, a GPU that cannot
map the exporter's memory, a buffer over the import limit) over a ``tcp`` comm,
and is at least ``gpupool.copy-stream-threshold`` bytes, does not travel in
Dask's frames. Dask's comm writes a whole message from one thread after it was
serialized, so the device->host copy, the send, the receive and the
host->device copy would each wait for the one before. Instead the exporter
grants a lease and sends a :class:`~dask_gpupool.wire.handoff.HandoffHeader` with
path ``"stream"`` naming its :class:`CopyServer`; the importer's deserializer
pulls the bytes with :func:`pull`::

    importer -> copy server   PullRequest{op: "pull", pool, lease, proof}   (length-prefixed msgpack)
    copy server -> importer   PullReply{op: "pull-ok", lease, size, chunk} | ErrorReply
    copy server -> importer   ``size`` raw bytes

**Pipelining.** GPU memory is copied device->host in chunks of ``chunk`` bytes
into :data:`SLOTS` pinned staging slots (a cuda.core ``PinnedMemoryResource``)
on a stream of the server's; chunk n is sent while the next ones are copied.
The importer receives each chunk into one of its own pinned slots and copies
it host->device into its pool while the next one arrives. Host memory
(``host`` and ``pinned`` pools) is sent from, and received into, the buffers
themselves. Host staging is bounded: :data:`SLOTS` chunks per transfer on each
side, whatever the size.

**Leases.** The lease (:class:`~dask_gpupool.handoff.leases.LeaseTable`) keeps the
exporter's memory alive until the server has copied the last chunk out of it;
a pull claims it for its connection, and a failed or dropped connection
releases it (the importer reads a copy, never this memory). A lease never
pulled ends with the ``get_data`` reply that carried it.

**Who may pull.** ``proof`` is HMAC-SHA256 of ``pull:<pool>:<lease>`` under the
cluster's membership token: only members of the cluster can make one, and it
names one lease of one pool. The bytes themselves travel unencrypted, as they
would in Dask's ``tcp`` frames; with ``tls`` comms the copy path is not used
(copies stay in Dask's frames, encrypted).

**Threads.** The server accepts in one thread and serves each connection in a
thread of its own (blocking sockets), at most ``max_connections`` of them and
``max_per_peer`` per remote IP; connections beyond are closed at once and
counted in :attr:`CopyServer.refused`. :func:`pull` blocks the thread that
deserializes, which for these small messages is Dask's event loop, for the
length of the transfer (on two H200s: docs/performance.md).

**Load.** The whole request must arrive within ``timeout`` of the accept (a
deadline, not a timeout per ``recv``: a client trickling a byte at a time is
dropped at it). When accepting fails for want of fds or memory (``EMFILE``,
``ENFILE``, ``ENOBUFS``, ``ENOMEM``) the acceptor logs once, pauses (50 ms,
doubling up to :data:`~dask_gpupool.transport.accept.ACCEPT_BACKOFF_MAX`) and accepts again. See
docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import hmac
import itertools
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dask_gpupool.errors import ConfigError, DataLostError, GPUPoolError, NotAMemberError, ProtocolError
from dask_gpupool.memory.topology import current_gpu
from dask_gpupool.transport.accept import AcceptBackoff
from dask_gpupool.wire.broker import ErrorReply, PullReply, PullRequest, raise_for_error
from dask_gpupool.wire.codec import MAX_MESSAGE_BYTES, decode

if TYPE_CHECKING:
    from cuda.core import Buffer

    from dask_gpupool.handoff.leases import LeaseTable

__all__ = ["SLOTS", "STAGING", "CopyServer", "Staged", "Staging", "lanes", "pull", "pull_proof"]

logger = logging.getLogger(__name__)

#: Pinned staging chunks per lane on each side: one being sent (or copied in) while the other is filled.
SLOTS = 2

_LENGTH = struct.Struct("!I")

#: Connections (each served by a thread) one remote IP may hold to a copy server; more are refused.
MAX_PER_PEER = 128
#: Connections (threads) a copy server serves at once; more are refused.
MAX_CONNECTIONS = 512


def pull_proof(token: bytes, pool: str, lease: int) -> bytes:
    """What a member of the cluster presents to pull lease ``lease`` of ``pool``."""
    return hmac.new(token, f"pull:{pool}:{lease}".encode(), hashlib.sha256).digest()


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
        :data:`~dask_gpupool.transport.accept.ACCEPT_BACKOFF_MAX`) and tries again; queued peers wait in the
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
                    message = _recv_message(conn, deadline=accepted + self._timeout)
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
                    _send_message(conn, ErrorReply.of(e).to_msg())
                    return
                _send_message(conn, PullReply(lease, staged.nbytes, self._chunk).to_msg())
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
        if token is None or not hmac.compare_digest(request.proof, pull_proof(token, self.pool, request.lease)):
            raise NotAMemberError(f"pool {self.pool}: pull of lease {request.lease} without a valid proof")
        staged = self._leases.holder(request.lease)
        if staged is not None and not isinstance(staged, Staged):
            raise ProtocolError(f"lease {request.lease} on pool {self.pool} is not a stream lease")
        if staged is None or not self._leases.claim_stream(request.lease, connection):
            raise DataLostError(f"lease {request.lease} on pool {self.pool} has ended or was pulled already")
        return staged

    def _send(self, conn: socket.socket, staged: Staged) -> None:
        buf, start, n = staged.buf, int(staged.buf.handle) + staged.offset, staged.nbytes
        if buf.is_host_accessible:
            for off, size in _chunks(n, self._chunk):
                conn.sendall(_view(start + off, size))
            return
        dev = current_gpu(buf.device_id)  # the GPU it is on (an imported view's is this process's GPU)
        stream = dev.create_stream()
        slots = STAGING.take(int(dev.device_id), self._chunk, stream)
        try:
            chunks = list(_chunks(n, self._chunk))
            copied: list[Any] = [None] * len(chunks)

            def copy_out(i: int) -> None:
                off, size = chunks[i]
                _memcpy(int(slots[i % SLOTS].handle), start + off, size, stream)
                copied[i] = stream.record()

            for i in range(min(SLOTS, len(chunks))):
                copy_out(i)
            for i, (_off, size) in enumerate(chunks):
                copied[i].sync()
                conn.sendall(_view(int(slots[i % SLOTS].handle), size))
                if i + SLOTS < len(chunks):
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


def pull(
    address: str,
    pool: str,
    leases: list[int],
    token: bytes,
    dst: Buffer,
    timeout: float,
) -> None:
    """Pull stream leases ``leases`` of ``pool`` from ``address`` into ``dst``, one connection each. Blocking.

    Each lease is one lane: a contiguous part of the value, in order; lane k
    lands after the bytes of lanes 0..k-1. Lanes after the first are received
    in threads of a shared executor, the first in the calling thread.

    Parameters
    ----------
    dst : Buffer
        Receives the bytes from its start; owned by the caller, who closes it
        on failure. GPU memory is filled through pinned staging slots on
        ``dst``'s GPU.

    Raises
    ------
    DataLostError
        The exporter cannot be reached, refused (a lease ended), or a
        connection broke. Leases of lanes not pulled end with the exporter's reply.
    """
    host, port = _parse(address)
    conns: list[socket.socket] = []
    what = f"pulling lease(s) {list(leases)} of pool {pool} from {address}"
    try:
        for lease in leases:
            conn = socket.create_connection((host, port), timeout=timeout)
            conns.append(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _send_message(conn, PullRequest(pool, lease, pull_proof(token, pool, lease)).to_msg())
        offset, parts = 0, []
        for conn, lease in zip(conns, leases, strict=True):
            msg = decode(_recv_message(conn))
            raise_for_error(msg, f"copy server {address}")
            reply = PullReply.from_msg(msg)
            if reply.lease != lease or offset + reply.size > dst.size:
                raise ProtocolError(f"pull reply for lease {reply.lease} of {reply.size} bytes; asked lease {lease}")
            parts.append((conn, offset, reply.size, reply.chunk))
            offset += reply.size
        if offset != dst.size:
            raise ProtocolError(f"the lanes hold {offset} bytes, the value {dst.size}")
        others = [_executor().submit(_receive, c, dst, off, n, chunk) for c, off, n, chunk in parts[1:]]
        first, off, n, chunk = parts[0]
        try:
            _receive(first, dst, off, n, chunk)
        except BaseException:
            for c in conns:  # the other lanes stop at once instead of at their timeout
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
            raise
        finally:
            for f in others:
                f.exception()  # wait for every lane before the connections close
        for f in others:
            f.result()
    except (OSError, GPUPoolError) as e:
        if isinstance(e, DataLostError):
            raise
        raise DataLostError(f"{what}: {type(e).__name__}: {e}") from e
    finally:
        for conn in conns:
            conn.close()


_EXECUTOR: Any = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> Any:
    """The threads that receive lanes after the first (made on first use, shared by the process)."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            from concurrent.futures import ThreadPoolExecutor

            _EXECUTOR = ThreadPoolExecutor(max_workers=16, thread_name_prefix="gpupool-pull")
        return _EXECUTOR


def _receive(conn: socket.socket, dst: Buffer, offset: int, n: int, chunk: int) -> None:
    """Receive ``n`` bytes into ``dst`` from ``offset``, chunk by chunk."""
    start = int(dst.handle) + offset
    if dst.is_host_accessible:
        for off, size in _chunks(n, chunk):
            _recv_exactly(conn, _view(start + off, size))
        return
    dev = current_gpu(dst.device_id)
    stream = dev.create_stream()
    stream.wait(dev.default_stream)  # dst was allocated on the default stream
    slots = STAGING.take(int(dev.device_id), chunk, stream)
    copied_in: list[Any] = [None] * SLOTS
    try:
        for i, (off, size) in enumerate(_chunks(n, chunk)):
            k = i % SLOTS
            if copied_in[k] is not None:
                copied_in[k].sync()  # the slot's previous chunk is on the GPU
            _recv_exactly(conn, _view(int(slots[k].handle), size))
            _memcpy(start + off, int(slots[k].handle), size, stream)
            copied_in[k] = stream.record()
    finally:
        stream.sync()
        STAGING.give(int(dev.device_id), chunk, slots)
        stream.close()


# -- pinned staging ----------------------------------------------------------------------


class Staging:
    """Pinned staging slots of this process, kept for the next transfer.

    Pinning memory costs more than copying a chunk, so a transfer's
    :data:`SLOTS` slots go back here when it ends, and up to ``keep`` sets
    per (GPU, chunk size) stay allocated until :meth:`clear` (at most
    ``keep * SLOTS`` chunks of pinned host memory). Slots come from the
    driver's default pinned memory pool (cuda.core ``PinnedMemoryResource()``).
    A set is given back only after its transfer's stream was synchronized.
    """

    def __init__(self, keep: int = 8) -> None:
        self._keep = keep
        self._free: dict[tuple[int, int], list[list[Buffer]]] = {}
        self._lock = threading.Lock()

    def take(self, device: int, chunk: int, stream: Any) -> list[Buffer]:
        with self._lock:
            free = self._free.get((device, chunk))
            if free:
                return free.pop()
        from cuda.core import PinnedMemoryResource

        mr = PinnedMemoryResource()
        slots = [mr.allocate(chunk, stream=stream) for _ in range(SLOTS)]
        stream.sync()
        return slots

    def give(self, device: int, chunk: int, slots: list[Buffer]) -> None:
        with self._lock:
            free = self._free.setdefault((device, chunk), [])
            if len(free) < self._keep:
                free.append(slots)
                return
        for slot in slots:
            slot.close()

    def clear(self) -> None:
        """Free every kept set (a worker's teardown)."""
        with self._lock:
            sets = [s for free in self._free.values() for s in free]
            self._free.clear()
        for slots in sets:
            for slot in slots:
                slot.close()

    @property
    def nbytes(self) -> int:
        """Pinned bytes kept."""
        with self._lock:
            return sum(int(b.size) for free in self._free.values() for s in free for b in s)


#: This process's staging slots.
STAGING = Staging()


# -- helpers ---------------------------------------------------------------------------


def _chunks(n: int, chunk: int) -> Iterator[tuple[int, int]]:
    for off in range(0, n, chunk):
        yield off, min(chunk, n - off)


def _view(ptr: int, n: int) -> memoryview:
    """A writable memoryview of ``n`` bytes of host memory at ``ptr`` (owned by a live Buffer)."""
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")


def _memcpy(dst: int, src: int, n: int, stream: Any) -> None:
    from cuda.bindings import driver

    (err,) = driver.cuMemcpyAsync(dst, src, n, stream.handle)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemcpyAsync of {n} bytes failed: {err!r}")


def _send_message(conn: socket.socket, msg: dict[str, Any]) -> None:
    import msgpack

    data = msgpack.packb(msg, use_bin_type=True)
    conn.sendall(_LENGTH.pack(len(data)) + data)


def _recv_message(conn: socket.socket, deadline: float | None = None) -> bytes:
    """One length-prefixed message; whole by ``deadline`` (``time.monotonic()``) if given, else ``TimeoutError``."""
    head = bytearray(_LENGTH.size)
    _recv_exactly(conn, memoryview(head), deadline)
    (n,) = _LENGTH.unpack(head)
    if n > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {n} bytes exceeds {MAX_MESSAGE_BYTES}")
    data = bytearray(n)
    _recv_exactly(conn, memoryview(data), deadline)
    return bytes(data)


def _recv_exactly(conn: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view``; with a ``deadline`` each ``recv`` waits only for the time left (``TimeoutError`` after)."""
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{got} of {len(view)} bytes by the deadline")
            conn.settimeout(left)
        k = conn.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {len(view)} bytes")
        got += k


def _parse(address: str) -> tuple[str, int]:
    if not address.startswith("tcp://"):
        raise ProtocolError(f"copy server address {address!r} is not tcp://")
    host, _, port = address[len("tcp://") :].rpartition(":")
    if not host or not port.isdigit():
        raise ProtocolError(f"copy server address {address!r} is not tcp://host:port")
    return host.strip("[]"), int(port)
