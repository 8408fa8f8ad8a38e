"""The receiving side of the streamed copy: :func:`pull` a leased buffer from an exporter's copy server.

Each lane is one TCP connection that asks for its part of the buffer with a
:class:`~dask_gpupool.wire.stream.PullRequest` (the cluster's proof, the pool
and the lease) and receives it in chunks through pinned staging
(:mod:`dask_gpupool.transport.staging`), or GPU memory mapped into the host
(:mod:`dask_gpupool.transport.vkgdr_staging`, ``gpupool.tcp-landing: vkgdr``),
copied into the destination Buffer as they arrive. Runs in the calling thread and a small executor.
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
    dst: Buffer,
    timeout: float,
    landing: str = "pinned",
) -> None:
    """Pull stream leases ``leases`` of ``pool`` from ``address`` into ``dst``, one connection each. Blocking.

    Each lease is one lane: a contiguous part of the value, in order; lane k
    lands after the bytes of lanes 0..k-1. Lanes after the first are received
    in threads of a shared executor, the first in the calling thread.

    Parameters
    ----------
    dst : Buffer
        Receives the bytes from its start; owned by the caller, who closes it
        on failure. GPU memory is filled through staging slots on ``dst``'s
        GPU: pinned host memory, or with ``landing="vkgdr"`` GPU memory mapped
        into the host (:mod:`dask_gpupool.transport.vkgdr_staging`), received
        into straight from the socket. Where vkgdr cannot run, pinned slots
        are used (logged once per GPU).
    landing : {"auto", "pinned", "vkgdr"}
        ``gpupool.tcp-landing`` (``auto``: vkgdr where it runs).

    Raises
    ------
    DataLostError
        The exporter cannot be reached (its ``address`` is not
        ``tcp://host:port`` included), refused (a lease ended), or a
        connection broke. Leases of lanes not pulled end with the exporter's reply.
    """
    conns: list[socket.socket] = []
    what = f"pulling lease(s) {list(leases)} of pool {pool} from {address}"
    try:
        host, port = host_port(address)
        for lease in leases:
            conn = socket.create_connection((host, port), timeout=timeout)
            conns.append(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send_message(conn, PullRequest(pool, lease, pull_proof(token, pool, lease)).to_msg())
        offset, parts = 0, []
        for conn, lease in zip(conns, leases, strict=True):
            msg = decode(recv_message(conn))
            raise_for_error(msg, f"copy server {address}")
            reply = PullReply.from_msg(msg)
            if reply.lease != lease or offset + reply.size > dst.size:
                raise ProtocolError(f"pull reply for lease {reply.lease} of {reply.size} bytes; asked lease {lease}")
            parts.append((conn, offset, reply.size, reply.chunk))
            offset += reply.size
        if offset != dst.size:
            raise ProtocolError(f"the lanes hold {offset} bytes, the value {dst.size}")
        others = [_executor().submit(_receive, c, dst, off, n, chunk, landing) for c, off, n, chunk in parts[1:]]
        first, off, n, chunk = parts[0]
        try:
            _receive(first, dst, off, n, chunk, landing)
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


def _receive(conn: socket.socket, dst: Buffer, offset: int, n: int, chunk: int, landing: str = "pinned") -> None:
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
    vk_slots = _vkgdr_slots(device, chunk, quiet=landing == "auto") if landing in ("vkgdr", "auto") else None
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


_VKGDR_REFUSED: set[int] = set()


def _vkgdr_slots(device: int, chunk: int, quiet: bool = False) -> list[VkgdrSlot] | None:
    """vkgdr landing slots on ``device``, or ``None`` (pinned staging) when vkgdr cannot run there: said once
    (a WARNING when vkgdr was asked for, INFO for ``auto``)."""
    if device in _VKGDR_REFUSED:
        return None
    try:
        return VKGDR.take(device, chunk)
    except Exception as e:
        _VKGDR_REFUSED.add(device)
        logger.log(
            logging.INFO if quiet else logging.WARNING,
            "gpupool.tcp-landing: vkgdr cannot land copies on GPU %d (%s: %s); pinned staging is used instead",
            device,
            type(e).__name__,
            e,
        )
        return None
