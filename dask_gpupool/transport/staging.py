"""Pinned host staging of the streamed copy: the slots each lane copies through, and the framing of its messages.

A process keeps its pinned slots (:data:`STAGING`) for the next pull or send
rather than pinning memory for each: pinning costs more than the copy at
these sizes. The slots are truly per process (a cache of this process's
pinned memory) and go, with every other cache of slots of the process
(:func:`per_process`), when its last pool service lets go of them
(:func:`hold_slots`, :func:`let_go_slots`). The message helpers frame one length-prefixed
msgpack message on a TCP socket, at most ``MAX_MESSAGE_BYTES``.
"""

from __future__ import annotations

import ctypes
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from dask_gpupool.errors import ProtocolError
from dask_gpupool.wire.codec import MAX_MESSAGE_BYTES
from dask_gpupool.wire.stream import copy_server_address

if TYPE_CHECKING:
    from cuda.core import Buffer

__all__ = [
    "SLOTS",
    "STAGING",
    "KeptSlots",
    "Staging",
    "chunks",
    "hold_slots",
    "host_port",
    "host_view",
    "let_go_slots",
    "memcpy",
    "per_process",
    "recv_exactly",
    "recv_message",
    "send_message",
]

logger = logging.getLogger(__name__)


#: Pinned staging chunks per lane on each side: one being sent (or copied in) while the other is filled.
SLOTS = 2

S = TypeVar("S")


_LENGTH = struct.Struct("!I")


class KeptSlots(Generic[S]):
    """Sets of :data:`SLOTS` staging slots per (GPU, chunk size), kept for the next transfer.

    Making slots (pinning host memory, mapping GPU memory) costs more than
    copying a chunk, so a transfer's set goes back here when it ends
    (:meth:`give`, only once its copies finished), and up to ``keep`` sets per
    (GPU, chunk size) stay allocated until :meth:`clear` (for the process's
    own caches: :func:`let_go_slots`). Subclasses make slots (``take``) and
    say how one is freed and how large it is.
    """

    def __init__(self, keep: int = 8) -> None:
        self._keep = keep
        self._free: dict[tuple[int, int], list[list[S]]] = {}
        self._lock = threading.Lock()

    def _kept(self, device: int, chunk: int) -> list[S] | None:
        """A kept set for ``(device, chunk)``, taken out, or ``None``."""
        with self._lock:
            free = self._free.get((device, chunk))
            return free.pop() if free else None

    def _free_slot(self, slot: S) -> None:
        raise NotImplementedError

    def _slot_size(self, slot: S) -> int:
        raise NotImplementedError

    def give(self, device: int, chunk: int, slots: list[S]) -> None:
        """Keep ``slots`` for the next transfer (their copies have finished), or free them."""
        with self._lock:
            free = self._free.setdefault((device, chunk), [])
            if len(free) < self._keep:
                free.append(slots)
                return
        for slot in slots:
            self._free_slot(slot)

    def clear(self) -> None:
        """Free every kept set (a worker's teardown)."""
        with self._lock:
            sets = [s for free in self._free.values() for s in free]
            self._free.clear()
        for slots in sets:
            for slot in slots:
                self._free_slot(slot)

    @property
    def nbytes(self) -> int:
        """Bytes kept in slots."""
        with self._lock:
            return sum(self._slot_size(b) for free in self._free.values() for s in free for b in s)


class Staging(KeptSlots["Buffer"]):
    """Pinned staging slots of this process, kept for the next transfer (at most ``keep * SLOTS`` chunks of pinned
    host memory per GPU and chunk size). Slots come from the driver's default pinned memory pool (cuda.core
    ``PinnedMemoryResource()``)."""

    def take(self, device: int, chunk: int, stream: Any) -> list[Buffer]:
        kept = self._kept(device, chunk)
        if kept is not None:
            return kept
        from cuda.core import PinnedMemoryResource

        mr = PinnedMemoryResource()
        slots = [mr.allocate(chunk, stream=stream) for _ in range(SLOTS)]
        stream.sync()
        return slots

    def _free_slot(self, slot: Buffer) -> None:
        slot.close()

    def _slot_size(self, slot: Buffer) -> int:
        return int(slot.size)


#: The caches of slots of this process (:func:`per_process`), and how many pool services hold them.
_CACHES: list[KeptSlots[Any]] = []
_users = 0
_users_lock = threading.Lock()


def per_process(cache: KeptSlots[Any]) -> None:
    """``cache`` is one of this process's caches of slots: it is cleared when the last pool service lets go."""
    with _users_lock:
        _CACHES.append(cache)


def hold_slots() -> None:
    """A pool service of this process keeps the process's slots until it lets go (:func:`let_go_slots`)."""
    global _users
    with _users_lock:
        _users += 1


def let_go_slots() -> None:
    """A pool service of :func:`hold_slots` closed; the last one frees every kept set of the process's caches."""
    global _users
    with _users_lock:
        _users -= 1
        caches = list(_CACHES) if _users <= 0 else []
    for cache in caches:
        cache.clear()


#: This process's staging slots: truly per process (a cache of this process's pinned memory).
STAGING = Staging()
per_process(STAGING)


def chunks(n: int, chunk: int) -> Iterator[tuple[int, int]]:
    for off in range(0, n, chunk):
        yield off, min(chunk, n - off)


def host_view(ptr: int, n: int) -> memoryview:
    """A writable memoryview of ``n`` bytes of host memory at ``ptr`` (owned by a live Buffer)."""
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")


def memcpy(dst: int, src: int, n: int, stream: Any) -> None:
    """``cuMemcpyAsync`` of ``n`` bytes from ``src`` to ``dst`` on ``stream``: a cuda.core ``Stream``, or a raw
    handle (``int``; 0 is the legacy default stream, as CuPy's null stream's ``ptr``)."""
    from cuda.bindings import driver

    handle = driver.CUstream(stream) if isinstance(stream, int) else stream.handle
    (err,) = driver.cuMemcpyAsync(dst, src, n, handle)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemcpyAsync of {n} bytes failed: {err!r}")


def send_message(conn: socket.socket, msg: dict[str, Any]) -> None:
    import msgpack

    data = msgpack.packb(msg, use_bin_type=True)
    conn.sendall(_LENGTH.pack(len(data)) + data)


def recv_message(conn: socket.socket, deadline: float | None = None) -> bytes:
    """One length-prefixed message; whole by ``deadline`` (``time.monotonic()``) if given, else ``TimeoutError``."""
    head = bytearray(_LENGTH.size)
    recv_exactly(conn, memoryview(head), deadline)
    (n,) = _LENGTH.unpack(head)
    if n > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {n} bytes exceeds {MAX_MESSAGE_BYTES}")
    data = bytearray(n)
    recv_exactly(conn, memoryview(data), deadline)
    return bytes(data)


def recv_exactly(conn: socket.socket, view: memoryview, deadline: float | None = None) -> None:
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


def host_port(address: str) -> tuple[str, int]:
    """``(host, port)`` of a copy server's address (:func:`~dask_gpupool.wire.stream.copy_server_address`)."""
    return copy_server_address(address)
