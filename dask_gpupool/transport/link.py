"""The importer's side of a handoff: links to exporters, imported buffers, lease releases.

:class:`PeerLink` is an importer's one connection to one exporter's fd
broker. It stays open while the importer lives: the pool fd is fetched over
it, lease claims and releases travel on it, and when the importer dies the
kernel closes it, which is how the exporter learns to release that
importer's leases.

:class:`ImportedMemoryResource` is the memory resource of one imported
buffer. The Buffer handed to Dask and user code is
``Buffer.from_handle(ptr, size, mr=ImportedMemoryResource(...))``: when it is
closed or garbage-collected, ``deallocate`` closes the underlying import
under the process's import lock and queues the lease release, which
:class:`Releaser` sends in batches from its own thread, off the hot path,
after the GPU finished the work queued on the legacy default stream (so the
exporter never reuses memory a kernel here still reads).
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import struct
import threading
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, Union

from cuda.core import MemoryResource

from dask_gpupool.errors import BrokerRefusedError, GPUPoolError, PeerLostError, ProtocolError
from dask_gpupool.handoff.importer import IMPORT_LOCK
from dask_gpupool.memory.topology import current_gpu
from dask_gpupool.wire.messages import (
    MAX_LEASES_PER_MESSAGE,
    MAX_MESSAGE_BYTES,
    ClaimReply,
    CopyReply,
    CopyRequest,
    HandleReply,
    HandleRequest,
    Hello,
    LeaseClaim,
    LeaseRelease,
    Resync,
    ResyncReply,
    SegmentRelease,
    Welcome,
    decode,
    encode,
    raise_for_error,
)

if TYPE_CHECKING:
    from cuda.core import Buffer

    from dask_gpupool.handoff.importer import MappedPool

__all__ = ["ImportedMemoryResource", "LinkFactory", "PeerLink", "Releaser"]

Message = Union[HandleRequest, CopyRequest, LeaseClaim, LeaseRelease, SegmentRelease, Resync]  # noqa: UP007

logger = logging.getLogger(__name__)


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
        :class:`~dask_gpupool.wire.messages.Resync` before the link is returned
        (the exporter ends this worker's other claimed leases: their
        releases may have been lost with an earlier link).
    expected_pid : int or None
        The exporter's pid (its registry row's); when given, a listener of
        another pid is refused.

    Raises
    ------
    BrokerRefusedError
        Before the token is sent: when the socket's directory is not a
        directory (a symlink included) owned by this process's uid, or is
        group- or other-writable; or when ``SO_PEERCRED`` shows that the
        listening process is of another uid, or not ``expected_pid``.
    PeerLostError
        When the broker cannot be reached or hangs up.

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
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
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
                self._resync(sorted(live))
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
        msg = decode(data)
        raise_for_error(msg, context)
        return msg

    def _exchange(self, request: HandleRequest | CopyRequest, context: str) -> tuple[dict[str, Any], int]:
        """Send ``request``; return the reply and the fd that follows it (caller closes)."""
        with self._lock:
            msg = self._request(request, context)
            assert self._sock is not None
            try:
                _, fds, flags, _ = socket.recv_fds(self._sock, 16, 4)
            except OSError as e:
                raise self._broken(e) from e
            if len(fds) != 1 or flags & socket.MSG_CTRUNC:
                for fd in fds:
                    os.close(fd)
                raise ProtocolError(f"{context}: expected one fd, got {len(fds)}")
            return msg, fds[0]

    def _resync(self, live: list[int]) -> None:
        context = f"broker {self.address} (resync of {len(live)} leases)"
        with self._lock:
            for i in range(0, max(len(live), 1), MAX_LEASES_PER_MESSAGE):
                chunk = tuple(live[i : i + MAX_LEASES_PER_MESSAGE])
                done = i + MAX_LEASES_PER_MESSAGE >= len(live)
                if not done:
                    self._send_locked(Resync(chunk, False))
                    continue
                reply = ResyncReply.from_msg(self._request(Resync(chunk, True), context))
                if reply.ended:
                    logger.info(
                        "%s: the exporter ended %d lease(s) released while the link was down", context, reply.ended
                    )

    def request_pool_fd(self, pool: str) -> tuple[HandleReply, int]:
        """The pool's fd (**caller closes it**) and the broker's reply."""
        context = f"broker {self.address} (pool {pool})"
        msg, fd = self._exchange(HandleRequest(pool), context)
        try:
            reply = HandleReply.from_msg(msg)
            if reply.pool != pool:
                raise ProtocolError(f"{context}: reply names pool {reply.pool}")
        except BaseException:
            os.close(fd)
            raise
        return reply, fd

    def request_segment_fd(self, pool: str, segment: int) -> tuple[HandleReply, int]:
        """The fd of VMM segment ``segment`` of ``pool`` (**caller closes it**) and the broker's reply."""
        context = f"broker {self.address} (pool {pool}, segment {segment})"
        msg, fd = self._exchange(HandleRequest(pool, segment), context)
        try:
            reply = HandleReply.from_msg(msg)
            if reply.pool != pool or reply.segment != segment:
                raise ProtocolError(f"{context}: reply names pool {reply.pool}, segment {reply.segment}")
        except BaseException:
            os.close(fd)
            raise
        return reply, fd

    def fetch_copy(self, lease: int) -> tuple[CopyReply, int]:
        """A memfd holding a host copy of leased buffer ``lease`` (**caller closes it**)."""
        context = f"broker {self.address} (lease {lease})"
        msg, fd = self._exchange(CopyRequest(lease), context)
        try:
            reply = CopyReply.from_msg(msg)
            if reply.lease != lease or os.fstat(fd).st_size < reply.size:
                raise ProtocolError(f"{context}: copy reply does not match the request")
        except BaseException:
            os.close(fd)
            raise
        return reply, fd

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
                reply = ClaimReply.from_msg(self._request(LeaseClaim(tuple(chunk)), context))
                bad = set(reply.refused)
                held = [lease for lease in chunk if lease not in bad]
                if held and on_held is not None and not on_held(held):
                    bad.update(held)
                refused.extend(lease for lease in chunk if lease in bad)
        return refused

    def release(self, leases: list[int]) -> None:
        """Tell the exporter these imports are closed."""
        for i in range(0, len(leases), MAX_LEASES_PER_MESSAGE):
            self._send(LeaseRelease(tuple(leases[i : i + MAX_LEASES_PER_MESSAGE])))

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


class Releaser:
    """Sends lease releases in batches from its own thread, and keeps the importer's live leases.

    :meth:`put` is called from ``ImportedMemoryResource.deallocate`` (any
    thread, often the garbage collector's); the thread waits for the GPU work
    recorded with each release to finish, then drops the lease from the live
    set and sends one :class:`~dask_gpupool.wire.messages.LeaseRelease` (and one
    :class:`~dask_gpupool.wire.messages.SegmentRelease` for unmapped retiring
    segments) per exporter.

    When a send fails (the exporter stalled past ``broker-timeout``, its
    socket buffer full), nothing is dropped: the exporter keeps the leases,
    and this thread opens the link again with backoff. The new link starts
    with a :class:`~dask_gpupool.wire.messages.Resync` of the live set, which
    ends every lease released meanwhile; segment releases are sent again.
    It gives up on an exporter only when ``links`` says it left the cluster.

    Parameters
    ----------
    links : LinkFactory
        Opens (or returns) the link to an exporter, by broker address.
    """

    sent: int
    segments_sent: int
    resyncs: int
    _pending: list[tuple[str, int, Any, tuple[tuple[int, int], ...]]]
    _live: dict[str, set[int]]
    _epoch: dict[str, int]
    _retry: dict[str, list[tuple[int, int]]]
    _cond: threading.Condition
    _closed: bool
    _thread: threading.Thread

    def __init__(self, links: LinkFactory) -> None:
        self.sent = self.segments_sent = self.resyncs = 0
        self._links = links
        self._pending = []
        self._live = {}
        self._epoch = {}
        self._retry = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="gpupool-releaser", daemon=True)
        self._thread.start()

    # -- the live set ------------------------------------------------------------

    def epoch(self, exporter: str) -> int:
        """A number that changes whenever a resync of ``exporter`` snapshots the live set."""
        with self._cond:
            return self._epoch.get(exporter, 0)

    def hold(self, exporter: str, leases: list[int], *, epoch: int) -> bool:
        """Add claimed leases to the live set, unless a resync snapshot was taken since ``epoch``."""
        with self._cond:
            if self._epoch.get(exporter, 0) != epoch:
                return False
            self._live.setdefault(exporter, set()).update(leases)
            return True

    def snapshot(self, exporter: str) -> list[int]:
        """The live leases of ``exporter``, for a resync; claims in flight must be held again."""
        with self._cond:
            self._epoch[exporter] = self._epoch.get(exporter, 0) + 1
            return sorted(self._live.get(exporter, ()))

    def live(self, exporter: str | None = None) -> int:
        """Leases held (of one exporter, or all)."""
        with self._cond:
            if exporter is not None:
                return len(self._live.get(exporter, ()))
            return sum(len(v) for v in self._live.values())

    def forget(self, exporter: str) -> None:
        """``exporter`` left the cluster: nothing to release there any more."""
        with self._cond:
            self._live.pop(exporter, None)
            self._retry.pop(exporter, None)

    # -- releases ------------------------------------------------------------------

    def put(self, exporter: str, lease: int, event: Any = None, segments: tuple[tuple[int, int], ...] = ()) -> None:
        """Queue a release; ``event`` (a cuda.core Event or ``None``) must complete first.

        ``lease`` 0 releases no lease; ``segments`` are ``(id, claims)`` of
        segment imports closed before ``event`` was recorded.
        """
        with self._cond:
            self._pending.append((exporter, lease, event, segments))
            self._cond.notify()

    def _run(self) -> None:
        backoff = 0.05
        while True:
            with self._cond:
                if not self._pending and not self._closed:
                    self._cond.wait(backoff if self._retry else None)
                if not self._pending and self._closed:
                    return
                batch, self._pending = self._pending, []
            self._send(batch)
            if self._retry_failed():
                backoff = 0.05
            else:
                backoff = min(backoff * 2, 2.0)

    def _send(self, batch: list[tuple[str, int, Any, tuple[tuple[int, int], ...]]]) -> None:
        by_exporter: dict[str, tuple[list[int], list[tuple[int, int]]]] = {}
        markers = []
        for exporter, lease, event, segments in batch:
            if not exporter:  # flush(): done once everything before it was handled
                markers.append(event)
                continue
            if event is not None:
                try:
                    event.sync()
                    event.close()
                except Exception:  # the GPU work failed; the memory is no longer ours to guard
                    logger.exception("waiting for GPU work before releasing lease %d failed", lease)
            entry = by_exporter.setdefault(exporter, ([], []))
            if lease:
                entry[0].append(lease)
            entry[1].extend(segments)
        with self._cond:
            for exporter, (leases, _) in by_exporter.items():
                live = self._live.get(exporter)
                if live is not None:
                    live.difference_update(leases)
                    if not live:
                        del self._live[exporter]
        for exporter, (leases, segs) in by_exporter.items():
            if not leases and not segs:
                continue
            with self._cond:
                if exporter in self._retry:  # the link is down: the resync will end these leases
                    self._retry[exporter].extend(segs)
                    continue
            self._deliver(exporter, leases, segs)
        for marker in markers:
            marker.sync()

    def _deliver(self, exporter: str, leases: list[int], segs: list[tuple[int, int]]) -> bool:
        try:
            link = self._links(exporter)
            if link is None:  # the exporter left: its leases went with it
                self.forget(exporter)
                return True
            if leases:
                link.release(leases)
                self.sent += len(leases)
            if segs:
                link.release_segments(segs)
                self.segments_sent += len(segs)
            return True
        except GPUPoolError as e:
            logger.info(
                "releasing %d lease(s), %d segment(s) at %s failed (%s); retrying", len(leases), len(segs), exporter, e
            )
            with self._cond:
                self._retry.setdefault(exporter, []).extend(segs)
            return False

    def _retry_failed(self) -> bool:
        """Open broken links again (they resync on opening) and resend segment releases; whether all went."""
        with self._cond:
            retry, self._retry = self._retry, {}
        ok = True
        for exporter, segs in retry.items():
            if not self._deliver(exporter, [], segs):
                ok = False
            else:
                self.resyncs += 1
        return ok

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until everything queued so far has been handled (tests, teardown)."""
        done = threading.Event()
        with self._cond:
            self._pending.append(("", 0, _SetOnSync(done), ()))
            self._cond.notify()
        done.wait(timeout)

    def close(self) -> None:
        """Send what is queued, then stop the thread. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)


class _SetOnSync:
    """A stand-in event whose ``sync`` marks a :meth:`Releaser.flush` done."""

    def __init__(self, done: threading.Event) -> None:
        self._done = done

    def sync(self) -> None:
        self._done.set()

    def close(self) -> None:
        pass


class ImportedMemoryResource(MemoryResource):
    """The memory resource of one buffer imported from a peer's pool.

    Parameters
    ----------
    raw : cuda.core.Buffer
        The import itself, shared with other users of the same allocation in
        this process (:meth:`MappedPool.acquire`); the last one closes it.
    key : object
        Its key for :meth:`MappedPool.unshare`.
    mapped : MappedPool
        The mapping ``raw`` came from (kept alive while the buffer lives).
    on_close : callable
        Called with the cuda.core Event to wait for (or ``None``) and the
        ``(id, claims)`` of a retiring segment unmapped with it (or ``None``)
        once the import is closed; queues the lease (and segment) release.

    Notes
    -----
    The Buffer built over this resource is the only owner of ``raw``;
    closing it (or losing the last reference) runs :meth:`deallocate` once.
    """

    mapped: MappedPool
    _key: Any
    _open: bool
    _on_close: Callable[[Any, Any], None]
    _device_accessible: bool
    _host_accessible: bool
    _device_id: int

    def __init__(self, raw: Buffer, key: Any, mapped: MappedPool, on_close: Callable[[Any, Any], None]) -> None:
        self.mapped = mapped
        self._key = key
        self._open = True
        self._on_close = on_close
        self._device_accessible = bool(raw.is_device_accessible)
        self._host_accessible = bool(raw.is_host_accessible)
        # The GPU that uses the import: this process's own GPU (granted access to the pool), not the
        # pool's resident GPU. Array libraries run on it; CuPy would otherwise enable context peer
        # access to the owner's GPU for every kernel, which broke imports across H200s
        # (docs/gpu-checks.md).
        self._device_id = int(mapped.device) if mapped.device is not None else int(raw.device_id)

    def allocate(self, size: int, *, stream: Any = None) -> Buffer:
        raise TypeError("an imported buffer's resource cannot allocate")

    def deallocate(self, ptr: Any, size: int, *, stream: Any = None) -> None:
        if not self._open:
            return
        self._open = False
        event = segment = None
        try:
            with IMPORT_LOCK:
                raw, segment = self.mapped.unshare(self._key)
                if self.mapped.device is not None and self._device_accessible:
                    dev = current_gpu(self.mapped.device)
                    if raw is not None:
                        raw.close(dev.default_stream)
                    # Work queued here on blocking streams (CuPy's default) must finish before the
                    # exporter may reuse the memory: the releaser waits for this event.
                    event = dev.default_stream.record()
                elif raw is not None:
                    raw.close()
        except Exception:
            logger.exception("closing an import from pool %s failed", self.mapped.record.pool)
        finally:
            self._on_close(event, segment)

    @property
    def is_device_accessible(self) -> bool:
        return self._device_accessible

    @property
    def is_host_accessible(self) -> bool:
        return self._host_accessible

    @property
    def device_id(self) -> int:
        return self._device_id
