"""The receiving side of the streamed copy: :func:`pull` a leased buffer from an exporter's copy server.

Each lane is one TCP connection that asks for its part of the buffer with a
:class:`~dask_gpupool.wire.stream.PullRequest` (the cluster's proof, the pool
and the lease) and receives it in chunks into GPU memory mapped into the host
(:mod:`dask_gpupool.transport.vkgdr_staging`) where vkgdr runs, else through pinned staging
(:mod:`dask_gpupool.transport.staging`),
copied into the destination Buffer as they arrive. Runs in the calling thread and a small executor shared
by the process; a lane connects only when a thread is there to read it (:func:`pull`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from typing import TYPE_CHECKING, Any

from dask_gpupool.errors import DataLostError, GPUPoolError, ProtocolError
from dask_gpupool.memory.topology import current_gpu
from dask_gpupool.transport.staging import (
    SLOTS,
    STAGING,
    chunks,
    host_port,
    host_view,
    memcpy,
    recv_exactly,
    recv_message,
    send_message,
)
from dask_gpupool.transport.vkgdr_staging import VKGDR, VkgdrSlot
from dask_gpupool.wire.broker import raise_for_error
from dask_gpupool.wire.codec import decode
from dask_gpupool.wire.stream import PullReply, PullRequest, pull_proof

if TYPE_CHECKING:
    from cuda.core import Buffer

__all__ = ["pull"]

logger = logging.getLogger(__name__)


def pull(
    address: str,
    pool: str,
    leases: list[int],
    token: bytes,
    requester: str,
    dst: Buffer,
    timeout: float,
) -> None:
    """Pull stream leases ``leases`` of ``pool`` from ``address`` into ``dst``, one connection each, as worker
    ``requester`` (whom the leases were granted to; each request's proof binds ``address``, ``pool``, its lease and
    ``requester``: :func:`~dask_gpupool.wire.stream.pull_proof`). Blocking.

    Each lease is one lane: a contiguous part of the value, in order; lane k
    lands after the bytes of lanes 0..k-1. The calling thread and up to
    ``len(leases) - 1`` threads of a pool shared by the process
    (:data:`MAX_LANE_THREADS`) take the lanes in order, each connecting its lane
    only when it is about to read it: the copy server sends a lane's bytes only
    once it has the lane's request, and gives up when a chunk finds no room
    for ``timeout`` seconds, so a lane must never wait for a thread after its
    request went out. A pull is given only threads that are free now, never
    queued behind other pulls' lanes: when the shared threads are all busy, the
    calling thread receives every lane itself, one after the other.

    Parameters
    ----------
    dst : Buffer
        Receives the bytes from its start; owned by the caller, who closes it
        on failure. GPU memory is filled through staging slots on ``dst``'s
        GPU: GPU memory mapped into the host
        (:mod:`dask_gpupool.transport.vkgdr_staging`), received into straight
        from the socket; where vkgdr cannot run, pinned host memory (said
        once per GPU). On one H100 pulls of 256 MiB / 1 GiB took 55.7 / 200.6 ms
        landed by vkgdr and 78.4 / 265.4 ms through pinned staging (2026-11-23).
    timeout : float
        Seconds to connect a lane, and for each ``recv`` of its bytes.

    Raises
    ------
    DataLostError
        The exporter cannot be reached (its ``address`` is not
        ``tcp://host:port`` included), refused (a lease ended), or a
        connection broke. The other lanes being received stop at once; leases
        of lanes never connected end with the exporter's reply.

    Notes
    -----
    Every connection is this function's: each lane closes its own once
    received, or on failure; none is open when it returns or raises.
    """
    what = f"pulling lease(s) {list(leases)} of pool {pool} from {address}"
    try:
        host, port = host_port(address)
    except GPUPoolError as e:
        raise DataLostError(f"{what}: {type(e).__name__}: {e}") from e
    if not leases:
        raise DataLostError(f"{what}: no lanes")
    job = _Lanes(address, host, port, pool, leases, token, requester, dst, timeout)
    job.run(len(leases) - 1)
    error = job.error
    if error is None:
        return
    if isinstance(error, DataLostError):
        raise error
    if isinstance(error, (OSError, GPUPoolError)):
        raise DataLostError(f"{what}: {type(error).__name__}: {error}") from error
    raise error


#: Threads shared by every pull of the process to receive lanes besides each pull's calling thread.
MAX_LANE_THREADS = 16


class _Lanes:
    """The lanes of one :func:`pull`, taken in order by whichever of its threads is free.

    A thread takes the next lane under ``_order``: connects it, sends its
    request and reads its reply (whose size places the next lane), then
    receives its bytes outside the lock. The first error stops the pull: no
    lane is taken after it, and the connections being received are shut down.
    ``address`` names the copy server in errors.

    fd ownership: each lane's connection is the thread's that took it, which
    closes it; ``_open`` only lists them, to shut them down on failure.
    """

    def __init__(
        self,
        address: str,
        host: str,
        port: int,
        pool: str,
        leases: list[int],
        token: bytes,
        requester: str,
        dst: Buffer,
        timeout: float,
    ) -> None:
        self._address, self._host, self._port, self._pool, self._token = address, host, port, pool, token
        self._requester = requester
        self._leases, self._dst, self._timeout = list(leases), dst, timeout
        self._order = threading.Lock()  # one lane connected and placed at a time, in order
        self._state = threading.Condition()  # the fields below
        self._next = 0
        self._offset = 0
        self._running = 0
        self._finished = False
        self._open: set[socket.socket] = set()
        self.error: BaseException | None = None

    def run(self, helpers: int) -> None:
        """Receive the lanes with the calling thread and up to ``helpers`` shared threads (:func:`_help`); return once
        no thread receives one. The first error is kept in :attr:`error`; an interrupt is raised.

        The wait for the shared threads (:meth:`finish`) cannot be skipped by a ``KeyboardInterrupt``, which the
        main thread raises at whichever point of this method it arrives: one arriving before the wait or during it
        stops the lanes being received, as an error does (:meth:`_fail`), and the wait starts again, until no
        thread receives a lane; the first interrupt is raised after that. The helpers that never started are
        cancelled only once the wait is over (one that starts later takes no lane: :meth:`work`), so an interrupt
        that lands while they are cancelled finds every lane stopped.
        """
        interrupted: BaseException | None = None
        futures: list[Any] = []
        try:
            futures = _help(self, helpers)
            self.receive()
        except BaseException as e:  # an interrupt while helpers were asked for, or as the lanes ended here
            interrupted = e
        # From here to the wait, nothing runs code: no interrupt can be raised before the try below.
        while True:
            try:
                if interrupted is not None:
                    self._fail(interrupted)  # stop the lanes being received: the wait below is short
                self.finish()
                break
            except BaseException as e:
                interrupted = interrupted or e
        for f in futures:
            f.cancel()  # one that has not started: the lanes are all taken; it gives its thread back
        if interrupted is not None:
            raise interrupted

    def work(self) -> None:
        """A shared thread's part: take and receive lanes until none is left or one failed (the error is kept, not
        raised). :meth:`finish` waits for it."""
        with self._state:
            if self._finished:
                return
            self._running += 1
        try:
            self.receive()
        finally:
            with self._state:
                self._running -= 1
                self._state.notify_all()

    def receive(self) -> None:
        """Take and receive lanes until none is left or one failed (the error is kept, not raised). The calling
        thread's part: it is not counted, so that an interrupt arriving at any point of it cannot leave
        :meth:`finish`, which the same thread runs next (:meth:`run`), waiting for the calling thread itself."""
        try:
            while True:
                lane = self._take()
                if lane is None:
                    return
                conn, offset, n, chunk = lane
                try:
                    _receive(conn, self._dst, offset, n, chunk)
                finally:
                    with self._state:
                        self._open.discard(conn)
                    conn.close()
        except BaseException as e:
            self._fail(e)

    def _take(self) -> tuple[socket.socket, int, int, int] | None:
        """Connect the next lane and read its reply: ``(conn, offset, size, chunk)``, the conn the caller's; ``None``
        when every lane is taken or the pull failed."""
        with self._order:
            with self._state:
                if self.error is not None or self._next == len(self._leases):
                    return None
                i = self._next
                self._next += 1
            lease = self._leases[i]
            conn = socket.create_connection((self._host, self._port), timeout=self._timeout)
            try:
                with self._state:
                    self._open.add(conn)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                proof = pull_proof(self._token, self._address, self._pool, lease, self._requester)
                send_message(conn, PullRequest(self._pool, lease, proof, self._requester).to_msg())
                msg = decode(recv_message(conn))
                raise_for_error(msg, f"copy server {self._address}")
                reply = PullReply.from_msg(msg)
                offset, size = self._offset, reply.size
                if reply.lease != lease or offset + size > self._dst.size:
                    raise ProtocolError(f"pull reply for lease {reply.lease} of {size} bytes; asked lease {lease}")
                if i == len(self._leases) - 1 and offset + size != self._dst.size:
                    raise ProtocolError(f"the lanes hold {offset + size} bytes, the value {self._dst.size}")
                self._offset = offset + size
                with self._state:
                    stopped = self.error is not None  # another lane failed meanwhile: this one is not received
                    if stopped:
                        self._open.discard(conn)
            except BaseException:
                with self._state:
                    self._open.discard(conn)
                conn.close()
                raise
            if stopped:
                conn.close()
                return None
            return conn, offset, size, reply.chunk

    def _fail(self, e: BaseException) -> None:
        """Keep the first error; stop the lanes being received (at once, not at their timeout)."""
        with self._state:
            if self.error is None:
                self.error = e
            conns = list(self._open)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)

    def finish(self) -> None:
        """No thread takes a lane from now on; wait for those receiving one (each bounded by ``timeout``).

        An interrupt (``KeyboardInterrupt`` on the main thread) raised at any point of it is raised to
        :meth:`run`, which stops the lanes and calls it again until it returns: no thread writes into ``dst`` or
        holds a connection once the pull has raised.
        """
        with self._state:
            self._finished = True
            while self._running:
                self._state.wait()


#: The threads that receive lanes (:func:`_executor`), made on first use. Truly per process: every pull of the
#: process shares them, whichever service asked, so that the lane threads stay bounded by MAX_LANE_THREADS.
_EXECUTOR: Any = None
_EXECUTOR_LOCK = threading.Lock()
#: The shared pool's threads not given to a pull now: one taken per helper thread, given back when its future is
#: done or cancelled.
_FREE = threading.BoundedSemaphore(MAX_LANE_THREADS)


def _help(job: _Lanes, wanted: int) -> list[Any]:
    """Up to ``wanted`` threads of the shared pool that take ``job``'s lanes: as many as are free now, none queued
    behind other pulls (the calling thread receives the lanes left). Returns their futures; each thread is given
    back when its future is done or cancelled."""
    futures: list[Any] = []
    for _ in range(wanted):
        if not _FREE.acquire(blocking=False):
            break
        try:
            f = _executor().submit(job.work)
        except BaseException as e:
            _FREE.release()
            if isinstance(e, RuntimeError):  # the pool is shut down (interpreter exit): the calling thread takes
                break  # the lanes left
            raise
        f.add_done_callback(lambda _f: _FREE.release())
        futures.append(f)
    return futures


def _executor() -> Any:
    """The threads that receive lanes besides each pull's calling thread (made on first use, shared by the
    process, at most :data:`MAX_LANE_THREADS`). A task queued here holds no connection: it connects a lane only
    once it runs."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            from concurrent.futures import ThreadPoolExecutor

            _EXECUTOR = ThreadPoolExecutor(max_workers=MAX_LANE_THREADS, thread_name_prefix="gpupool-pull")
        return _EXECUTOR


def _receive(conn: socket.socket, dst: Buffer, offset: int, n: int, chunk: int) -> None:
    """Receive ``n`` bytes into ``dst`` from ``offset``, chunk by chunk."""
    start = int(dst.handle) + offset
    if dst.is_host_accessible:
        for off, size in chunks(n, chunk):
            recv_exactly(conn, host_view(start + off, size))
        return
    dev = current_gpu(dst.device_id)
    device = int(dev.device_id)
    stream = dev.create_stream()
    stream.wait(dev.default_stream)  # dst was allocated on the default stream
    vk_slots = _vkgdr_slots(device, chunk)
    pinned = STAGING.take(device, chunk, stream) if vk_slots is None else None
    copied_in: list[Any] = [None] * SLOTS
    try:
        for i, (off, size) in enumerate(chunks(n, chunk)):
            k = i % SLOTS
            if copied_in[k] is not None:
                copied_in[k].sync()  # the slot's previous chunk is on the GPU
            if vk_slots is not None:  # received into GPU memory; a device-to-device copy into dst
                slot = vk_slots[k]
                recv_exactly(conn, slot.host[:size])
                slot.flush(size)
                memcpy(start + off, slot.device_ptr, size, stream)
            else:
                assert pinned is not None
                recv_exactly(conn, host_view(int(pinned[k].handle), size))
                memcpy(start + off, int(pinned[k].handle), size, stream)
            copied_in[k] = stream.record()
    finally:
        stream.sync()
        if vk_slots is not None:
            VKGDR.give(device, chunk, vk_slots)
        if pinned is not None:
            STAGING.give(device, chunk, pinned)
        stream.close()


#: GPUs of this process where vkgdr could not land copies (said once). Truly per process, as the vkgdr slots are.
_VKGDR_REFUSED: set[int] = set()


def _vkgdr_slots(device: int, chunk: int) -> list[VkgdrSlot] | None:
    """vkgdr landing slots on ``device``, or ``None`` (pinned staging) when vkgdr cannot run there: said once, at
    INFO."""
    if device in _VKGDR_REFUSED:
        return None
    try:
        return VKGDR.take(device, chunk)
    except Exception as e:
        _VKGDR_REFUSED.add(device)
        logger.info(
            "vkgdr cannot land copies on GPU %d (%s: %s); pinned staging is used instead",
            device,
            type(e).__name__,
            e,
        )
        return None
