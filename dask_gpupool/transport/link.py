"""An importer's connection to one exporter's fd broker (:class:`PeerLink`).

It stays open while the importer lives: the pool fd and segment fds are
fetched over it, lease claims and releases travel on it, and when the
importer dies the kernel closes it, which is how the exporter learns to
release that importer's leases. Who uses it: the importer's links
(:mod:`dask_gpupool.handoff.links`) and its releaser
(:mod:`dask_gpupool.handoff.imported`), through a :data:`LinkFactory`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import struct
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any, TypeVar, Union

from dask_gpupool.errors import BrokerRefusedError, PeerLostError, ProtocolError
from dask_gpupool.wire.broker import (
    MAX_LEASES_PER_MESSAGE,
    ClaimReply,
    CopyReply,
    CopyRequest,
    ForwardReply,
    ForwardSettle,
    HandleReply,
    HandleRequest,
    Hello,
    LeaseClaim,
    LeaseForward,
    LeaseRelease,
    Resync,
    ResyncReply,
    SegmentRelease,
    TransferFailed,
    Welcome,
    raise_for_error,
)
from dask_gpupool.wire.codec import MAX_MESSAGE_BYTES, decode, encode

__all__ = ["LinkFactory", "PeerLink", "request_pool_fd"]

Message = Union[  # noqa: UP007
    HandleRequest,
    CopyRequest,
    LeaseClaim,
    LeaseRelease,
    SegmentRelease,
    Resync,
    LeaseForward,
    ForwardSettle,
    TransferFailed,
]

logger = logging.getLogger(__name__)

_R = TypeVar("_R")


class PeerLink:
    """A persistent connection to one exporter's broker. Blocking; thread-safe.

    Parameters
    ----------
    address : str
        The exporter's broker socket (from its registry row).
    timeout : float
        Seconds to wait for a reply (and for a send to go out).
    token : bytes
        The cluster's membership token, sent first (see :mod:`dask_gpupool.transport.broker`).
    worker : str
        This (the importer's) worker address; the exporter scopes lease claims
        to it. ``""`` for a link that only fetches pool fds.
    live : collection of int, optional
        Leases of this exporter this worker still holds, sent as a
        :class:`~dask_gpupool.wire.broker_leases.Resync` before the link is returned
        (the exporter ends this worker's other claimed leases: their
        releases may have been lost with an earlier link).
    expected_pid : int or None
        The exporter's pid (its registry row's); when given, a listener of
        another pid is refused.
    epoch : int
        The releaser's number of the snapshot ``live`` is (0: not known), sent
        with the resync: the exporter ignores an older one than it applied.

    Raises
    ------
    BrokerRefusedError
        Before the token is sent: when the socket's directory is not a
        directory (a symlink included) owned by this process's uid, or is
        group- or other-writable; or when ``SO_PEERCRED`` shows that the
        listening process is of another uid, or not ``expected_pid``.
    PeerLostError
        When the broker cannot be reached (this process out of fds
        included) or hangs up.

    Notes
    -----
    fd ownership: the link owns its socket (closed by :meth:`close`, and at
    once when the checks refuse the broker). Fds it receives are returned to
    the caller, who closes them. Threads: the constructor and every request
    block the calling thread.
    """

    address: str
    timeout: float
    _sock: socket.socket | None
    _lock: threading.Lock

    def __init__(
        self,
        address: str,
        timeout: float,
        token: bytes,
        worker: str = "",
        live: Collection[int] | None = None,
        expected_pid: int | None = None,
        epoch: int = 0,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self._lock = threading.Lock()
        # Who answers must be the exporter: its directory ours and closed to others (lstat: a link is
        # refused), the listener of our uid (and its pid the registry's), all before the token is sent.
        directory = os.path.dirname(os.path.abspath(address))
        try:
            st = os.lstat(directory)
        except OSError as e:
            raise PeerLostError(f"broker {address}: {type(e).__name__}: {e}") from e
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise BrokerRefusedError(
                f"broker {address}: its directory is not a directory of ours closed to group and others "
                f"(owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}); refusing to connect"
            )
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        except OSError as e:  # out of fds or memory here: this broker cannot be reached either
            raise PeerLostError(f"broker {address}: {type(e).__name__}: {e}") from e
        try:
            sock.settimeout(timeout)
            sock.connect(address)
            pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid() or (expected_pid is not None and pid != expected_pid):
                sock.close()
                wanted = f"uid {os.getuid()}" + (f", expected pid {expected_pid}" if expected_pid is not None else "")
                raise BrokerRefusedError(
                    f"broker {address}: listened on by pid {pid} of uid {uid} ({wanted}); not sending it the token"
                )
            sock.sendall(encode(Hello(token, worker)))
            data = sock.recv(MAX_MESSAGE_BYTES + 1)
        except BrokerRefusedError:  # a ConnectionError, so an OSError: not a lost peer
            raise
        except OSError as e:
            sock.close()
            raise PeerLostError(f"broker {address}: {type(e).__name__}: {e}") from e
        try:
            if not data:
                raise PeerLostError(f"broker {address}: closed the connection at hello")
            msg = decode(data)
            raise_for_error(msg, f"broker {address}")
            Welcome.from_msg(msg)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        if live is not None:
            try:
                self._resync(sorted(live), epoch)
            except BaseException:
                self.close()
                raise

    @property
    def alive(self) -> bool:
        return self._sock is not None

    def _broken(self, e: BaseException) -> PeerLostError:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        return PeerLostError(f"broker {self.address}: {type(e).__name__}: {e}")

    @contextlib.contextmanager
    def _in_step(self) -> Iterator[None]:
        """Close the link if the block raises :class:`ProtocolError`. Call with ``_lock`` held.

        A reply that is not the answer to the request just sent (bytes that
        are no message, another message, an fd too many or too few) puts the
        link out of step: whatever the broker sent after it would be read as
        the answer to the next request, another pool's or segment's fd among
        them. A link cannot find its step again, so it is closed; the next
        request on it raises :class:`PeerLostError` and the caller opens a new
        one.
        """
        try:
            yield
        except ProtocolError:
            sock, self._sock = self._sock, None
            if sock is not None:
                sock.close()
            raise

    def _request(self, request: Message, context: str) -> dict[str, Any]:
        """Send ``request`` and return the reply (errors raised). Call with ``_lock`` held."""
        if self._sock is None:
            raise PeerLostError(f"{context}: link is closed")
        try:
            self._sock.sendall(encode(request))
            data = self._sock.recv(MAX_MESSAGE_BYTES + 1)
        except OSError as e:
            raise self._broken(e) from e
        if not data:
            raise self._broken(ConnectionResetError("the broker closed the connection"))
        with self._in_step():
            msg = decode(data)
        raise_for_error(msg, context)  # a refusal is an answer: the link stays in step
        return msg

    def _exchange(
        self, request: HandleRequest | CopyRequest, context: str, check: Callable[[dict[str, Any], int], _R]
    ) -> tuple[_R, int]:
        """Send ``request``; return ``check(reply, fd)`` and the fd that follows the reply (caller closes).

        ``check`` parses the reply and raises :class:`ProtocolError` if it does not answer ``request``; then the
        fd is closed here, and the link too (:meth:`_in_step`).
        """
        with self._lock:
            msg = self._request(request, context)
            assert self._sock is not None
            try:
                data, fds, flags, _ = socket.recv_fds(self._sock, 16, 4)
            except OSError as e:
                raise self._broken(e) from e
            if not data and not fds:  # it hung up between the reply and the fd (it could not send it)
                raise self._broken(ConnectionResetError("the broker closed the connection before sending the fd"))
            with self._in_step():
                if len(fds) != 1 or flags & socket.MSG_CTRUNC:
                    for fd in fds:
                        os.close(fd)
                    raise ProtocolError(f"{context}: expected one fd, got {len(fds)}")
                try:
                    return check(msg, fds[0]), fds[0]
                except BaseException:
                    os.close(fds[0])
                    raise

    def _resync(self, live: list[int], epoch: int = 0) -> None:
        context = f"broker {self.address} (resync of {len(live)} leases)"
        with self._lock:
            for i in range(0, max(len(live), 1), MAX_LEASES_PER_MESSAGE):
                chunk = tuple(live[i : i + MAX_LEASES_PER_MESSAGE])
                done = i + MAX_LEASES_PER_MESSAGE >= len(live)
                if not done:
                    self._send_locked(Resync(chunk, False, epoch))
                    continue
                msg = self._request(Resync(chunk, True, epoch), context)
                with self._in_step():
                    reply = ResyncReply.from_msg(msg)
                if reply.ended:
                    logger.info(
                        "%s: the exporter ended %d lease(s) released while the link was down", context, reply.ended
                    )

    def request_pool_fd(self, pool: str) -> tuple[HandleReply, int]:
        """The pool's fd (**caller closes it**) and the broker's reply."""
        context = f"broker {self.address} (pool {pool})"

        def check(msg: dict[str, Any], _fd: int) -> HandleReply:
            reply = HandleReply.from_msg(msg)
            if reply.pool != pool:
                raise ProtocolError(f"{context}: reply names pool {reply.pool}")
            return reply

        return self._exchange(HandleRequest(pool), context, check)

    def request_segment_fd(self, pool: str, segment: int) -> tuple[HandleReply, int]:
        """The fd of VMM segment ``segment`` of ``pool`` (**caller closes it**) and the broker's reply."""
        context = f"broker {self.address} (pool {pool}, segment {segment})"

        def check(msg: dict[str, Any], _fd: int) -> HandleReply:
            reply = HandleReply.from_msg(msg)
            if reply.pool != pool or reply.segment != segment:
                raise ProtocolError(f"{context}: reply names pool {reply.pool}, segment {reply.segment}")
            return reply

        return self._exchange(HandleRequest(pool, segment), context, check)

    def fetch_copy(self, lease: int) -> tuple[CopyReply, int]:
        """A memfd holding a host copy of leased buffer ``lease`` (**caller closes it**)."""
        context = f"broker {self.address} (lease {lease})"

        def check(msg: dict[str, Any], fd: int) -> CopyReply:
            reply = CopyReply.from_msg(msg)
            if reply.lease != lease or os.fstat(fd).st_size < reply.size:
                raise ProtocolError(f"{context}: copy reply does not match the request")
            return reply

        return self._exchange(CopyRequest(lease), context, check)

    def _send_locked(self, message: Message) -> None:
        if self._sock is None:
            raise PeerLostError(f"broker {self.address}: link is closed")
        try:
            self._sock.sendall(encode(message))
        except OSError as e:
            raise self._broken(e) from e

    def _send(self, message: Message) -> None:
        with self._lock:
            self._send_locked(message)

    def claim(self, leases: list[int], on_held: Callable[[list[int]], bool] | None = None) -> list[int]:
        """Claim these leases and wait for the answer; return the ids the exporter refused.

        ``on_held`` is called with the held ids before the link is let go
        (so that a resync on another link cannot miss them); if it returns
        ``False`` they count as refused too.

        Raises
        ------
        PeerLostError
            If the exporter cannot be reached or does not answer within ``timeout``.
        """
        refused: list[int] = []
        context = f"broker {self.address} (claim)"
        with self._lock:
            for i in range(0, len(leases), MAX_LEASES_PER_MESSAGE):
                chunk = leases[i : i + MAX_LEASES_PER_MESSAGE]
                msg = self._request(LeaseClaim(tuple(chunk)), context)
                with self._in_step():
                    reply = ClaimReply.from_msg(msg)
                bad = set(reply.refused)
                held = [lease for lease in chunk if lease not in bad]
                if held and on_held is not None and not on_held(held):
                    bad.update(held)
                refused.extend(lease for lease in chunk if lease in bad)
        return refused

    def release(self, leases: list[int], unmapped: bool = False) -> None:
        """Tell the exporter these imports are closed (``unmapped``: they were never mapped here)."""
        for i in range(0, len(leases), MAX_LEASES_PER_MESSAGE):
            self._send(LeaseRelease(tuple(leases[i : i + MAX_LEASES_PER_MESSAGE]), unmapped))

    def forward(self, lease: int, to: str) -> tuple[int, int]:
        """Ask the exporter to grant worker ``to`` a lease on what our lease ``lease`` keeps alive.

        Returns ``(lease id for to, segment id)``.

        Raises
        ------
        GPUPoolError
            The exporter refused (``lease`` is not ours and claimed, or ``to``
            is not a worker of its host), or :class:`PeerLostError` when it
            cannot be reached.
        """
        context = f"broker {self.address} (forward of lease {lease} to {to})"
        with self._lock:
            msg = self._request(LeaseForward(lease, to), context)
            with self._in_step():
                reply = ForwardReply.from_msg(msg)
        return reply.lease, reply.segment

    def settle_forwarded(self, leases: list[int]) -> None:
        """Tell the exporter the replies that carried these forwarded leases ended."""
        for i in range(0, len(leases), MAX_LEASES_PER_MESSAGE):
            self._send(ForwardSettle(tuple(leases[i : i + MAX_LEASES_PER_MESSAGE])))

    def transfer_failed(self) -> None:
        """Tell the exporter a transfer failed after its leases were claimed here: it sends copies for a while."""
        self._send(TransferFailed())

    def release_segments(self, segments: list[tuple[int, int]]) -> None:
        """Tell the exporter these retiring segments are unmapped here: ``(id, leases claimed on it)``."""
        for i in range(0, len(segments), MAX_LEASES_PER_MESSAGE):
            self._send(SegmentRelease(tuple(segments[i : i + MAX_LEASES_PER_MESSAGE])))

    def close(self) -> None:
        """Close the connection. Idempotent.

        The exporter keeps this worker's leases (a closed link is not a dead
        importer): they end when it releases them, resyncs, or exits.
        """
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


#: Returns the live link to an exporter's broker (opening and resyncing one if needed), or
#: ``None`` when that exporter left the cluster. Raises :class:`PeerLostError` when it cannot be reached.
LinkFactory = Callable[[str], "PeerLink | None"]


def request_pool_fd(address: str, pool: str, timeout: float, token: bytes) -> tuple[HandleReply, int]:
    """Ask the broker at ``address`` for pool ``pool``'s fd over a one-shot connection. Blocking.

    Workers keep a :class:`PeerLink` per exporter instead;
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
    link = PeerLink(address, timeout, token)
    try:
        return link.request_pool_fd(pool)
    finally:
        link.close()
