"""What a broker answers once a connection is welcomed: fds, lease claims, releases, resyncs, forwards, copies.

:class:`BrokerRequests` parses each request of a welcomed connection
(:func:`~dask_gpupool.wire.broker.parse_request`), asks the broker's
:class:`~dask_gpupool.transport.broker_handler.BrokerHandler`, and sends the
reply; after a handle or copy reply, the fd itself travels in a message of its
own (SCM_RIGHTS). Pool fds are for any member; segment fds and every lease
request need a connection that named its worker in its ``Hello``. A malformed
request raises :class:`~dask_gpupool.errors.ProtocolError`, which closes the
connection (:class:`~dask_gpupool.transport.broker.FdBroker` does).

fd ownership: a pool's fd stays the pool's; a segment fd or a copy's memfd,
made for one request, is closed here once sent, or once the broker stops waiting for it
(:class:`_FdHandover`: it closed while a copy ran). Broker thread only.

A copy that cannot be made (the lease ended, a CUDA error, no fd left for its
memfd) is answered with an :class:`~dask_gpupool.wire.broker.ErrorReply` for
that request; the connection keeps serving.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading

from dask_gpupool.errors import BrokerRefusedError, GPUPoolError, ProtocolError, UnknownPoolError
from dask_gpupool.transport.broker_handler import BrokerHandler
from dask_gpupool.wire.broker import (
    ClaimReply,
    CopyReply,
    CopyRequest,
    ErrorReply,
    ForwardReply,
    ForwardSettle,
    HandleRequest,
    LeaseClaim,
    LeaseForward,
    LeaseRelease,
    Resync,
    ResyncReply,
    SegmentRelease,
    TransferFailed,
    parse_request,
)
from dask_gpupool.wire.codec import encode

__all__ = ["BrokerRequests"]

#: Most lease ids one resync may name (an importer's live imports of one exporter).
_MAX_RESYNC = 1 << 20


class BrokerRequests:
    """Answers the requests of one broker's welcomed connections.

    Parameters
    ----------
    handler : BrokerHandler
        What the broker asks (its owner).
    loop : asyncio.AbstractEventLoop
        The broker's event loop: replies are sent on it, copies made in its
        default executor.
    timeout : float
        Seconds a reply, or the fd after it, may wait for room in the
        connection: a member that sends requests and does not read the
        answers fills its queue; past this it is dropped (``TimeoutError``,
        the connection closed), instead of holding a coroutine, and a copy's
        memfd, for ever. A member that reads never waits: one reply fits.

    Attributes
    ----------
    served : int
        Pool and segment fds handed out.
    copies : int
        Host copies (memfds) handed out.
    """

    served: int
    copies: int
    _handler: BrokerHandler
    _loop: asyncio.AbstractEventLoop
    _timeout: float

    def __init__(self, handler: BrokerHandler, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self._handler = handler
        self._loop = loop
        self._timeout = timeout
        self.served = self.copies = 0

    async def answer(self, conn: socket.socket, msg: dict[str, object], importer: str, resync: set[int]) -> None:
        """Answer one request ``msg`` of a connection that named worker ``importer`` (``""``: none).

        ``resync`` is the connection's resync in progress (lease ids of its chunks so far).
        """
        request = parse_request(msg)
        if isinstance(request, HandleRequest) and request.segment:
            if not importer:
                raise ProtocolError("segment handle request on a connection that named no worker")
            try:
                fd, handle_reply = self._handler.segment_handle(request.pool, request.segment, importer)
            except GPUPoolError as e:
                await self._send(conn, encode(ErrorReply.of(e)))
                return
            try:
                await self._send(conn, encode(handle_reply))
                await self._send_fd(conn, fd)
            finally:
                os.close(fd)
            self.served += 1
            return
        if isinstance(request, HandleRequest):
            found = self._handler.pool_handle(request.pool)
            if found is None:
                reply = ErrorReply.of(UnknownPoolError(f"pool {request.pool} is not served by this broker"))
                await self._send(conn, encode(reply))
                return
            fd, handle_reply = found
            await self._send(conn, encode(handle_reply))
            await self._send_fd(conn, fd)
            self.served += 1
            return
        if not importer:
            raise ProtocolError(f"{request.op} on a connection that named no worker")
        if isinstance(request, LeaseClaim):
            refused = self._handler.claim(request.leases, importer)
            await self._send(conn, encode(ClaimReply(tuple(refused))))
        elif isinstance(request, LeaseRelease):
            self._handler.release(request.leases, importer, request.unmapped)
        elif isinstance(request, Resync):
            # chunks of one resync come in order on one connection; the last one's epoch names the snapshot
            resync.update(request.leases)
            if len(resync) > _MAX_RESYNC:
                raise ProtocolError(f"resync of more than {_MAX_RESYNC} leases")
            if request.done:
                ended = self._handler.resync(set(resync), importer, request.epoch)
                resync.clear()
                await self._send(conn, encode(ResyncReply(ended)))
        elif isinstance(request, SegmentRelease):
            self._handler.segments_released(request.segments, importer)
        elif isinstance(request, LeaseForward):
            try:
                lease, segment = self._handler.forward(request.lease, importer, request.to)
            except GPUPoolError as e:
                await self._send(conn, encode(ErrorReply.of(e)))
                return
            await self._send(conn, encode(ForwardReply(lease, segment)))
        elif isinstance(request, ForwardSettle):
            self._handler.settle_forwarded(request.leases, importer)
        elif isinstance(request, TransferFailed):
            self._handler.transfer_failed(importer)
        elif isinstance(request, CopyRequest):
            try:
                fd, size = await self._copy_out(request.lease, importer)
            except GPUPoolError as e:
                await self._send(conn, encode(ErrorReply.of(e)))
                return
            except OSError as e:  # a handler that let one through (no fd left): refuse the request, not the link
                refusal = BrokerRefusedError(f"lease {request.lease}: no host copy can be made now: {e}")
                await self._send(conn, encode(ErrorReply.of(refusal)))
                return
            try:
                await self._send(conn, encode(CopyReply(request.lease, size)))
                await self._send_fd(conn, fd)
            finally:
                os.close(fd)
            self.copies += 1

    async def _copy_out(self, lease: int, importer: str) -> tuple[int, int]:
        """``handler.copy_out`` on a helper thread: ``(memfd, size)``, the memfd now the caller's.

        When this wait is cancelled (the broker closes while the copy runs) the
        memfd the helper thread still makes has no owner: it is closed there, as
        soon as the copy returns, or here if it returned already.
        """
        handover = _FdHandover()

        def copy_out() -> tuple[int, int]:
            fd, size = self._handler.copy_out(lease, importer)
            handover.made(fd)
            return fd, size

        try:
            _fd, size = await self._loop.run_in_executor(None, copy_out)
        except asyncio.CancelledError:
            handover.abandon()
            raise
        return handover.take(), size

    async def _send(self, conn: socket.socket, data: bytes) -> None:
        """Send one message, waiting at most ``timeout`` for room (``TimeoutError``: the connection is dropped)."""
        await asyncio.wait_for(self._loop.sock_sendall(conn, data), self._timeout)

    async def _send_fd(self, conn: socket.socket, fd: int) -> None:
        """Send ``fd`` in a message of its own (a seqpacket socket sends it whole or not at all), waiting at most
        ``timeout`` for room (``TimeoutError``). ``fd`` stays the caller's."""
        deadline = self._loop.time() + self._timeout
        pause = 0.001
        while True:
            try:
                socket.send_fds(conn, [b"\0"], [fd])
                return
            except BlockingIOError:
                if self._loop.time() >= deadline:
                    raise TimeoutError(f"no room to send an fd within {self._timeout:g} s") from None
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.05)


class _FdHandover:
    """An fd made on a helper thread for a coroutine that may stop waiting for it (cancelled).

    Exactly one side closes it: the coroutine, once it :meth:`take` s it; or,
    once it :meth:`abandon` ed the wait, whichever of the two sides holds it
    then (the helper thread in :meth:`made`, or :meth:`abandon` itself).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._abandoned = False

    def made(self, fd: int) -> None:
        """The helper thread made ``fd``: keep it for the coroutine, or close it if the coroutine left."""
        with self._lock:
            if not self._abandoned:
                self._fd = fd
                return
        os.close(fd)

    def take(self) -> int:
        """The coroutine's result arrived: the fd is its own now."""
        with self._lock:
            fd, self._fd = self._fd, None
        assert fd is not None
        return fd

    def abandon(self) -> None:
        """The coroutine stops waiting: close the fd if it was made, else have the helper thread close it."""
        with self._lock:
            self._abandoned = True
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
