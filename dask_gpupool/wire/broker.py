"""The fd broker's protocol, on its Unix socket: the requests a broker parses, and every message by name.

The messages live by group, and every one is importable from here:

- :mod:`~dask_gpupool.wire.broker_hello`: ``Hello``, ``Welcome``, and the ``ErrorReply`` of any request;
- :mod:`~dask_gpupool.wire.broker_handles`: fd requests (``HandleRequest``, ``HandleReply``);
- :mod:`~dask_gpupool.wire.broker_leases`: lease claims, releases, resyncs, forwards and failed transfers;
- :mod:`~dask_gpupool.wire.broker_copies`: host copies of leased buffers (``CopyRequest``, ``CopyReply``).

Messages are encoded by :func:`~dask_gpupool.wire.codec.encode` (one
length-limited msgpack datagram each) and parsed by :func:`parse_request`.
The streamed copy's pull requests (:mod:`dask_gpupool.wire.stream`) share the
codec and the error replies.
"""

from __future__ import annotations

from typing import Any, Union

from dask_gpupool.errors import ProtocolError
from dask_gpupool.wire.broker_copies import CopyReply, CopyRequest
from dask_gpupool.wire.broker_handles import HandleReply, HandleRequest
from dask_gpupool.wire.broker_hello import ErrorReply, Hello, Welcome, raise_for_error
from dask_gpupool.wire.broker_leases import (
    MAX_LEASES_PER_MESSAGE,
    ClaimReply,
    ForwardReply,
    ForwardSettle,
    LeaseClaim,
    LeaseForward,
    LeaseRelease,
    Resync,
    ResyncReply,
    SegmentRelease,
    TransferFailed,
)
from dask_gpupool.wire.codec import as_mapping

__all__ = [
    "MAX_LEASES_PER_MESSAGE",
    "ClaimReply",
    "CopyReply",
    "CopyRequest",
    "ErrorReply",
    "ForwardReply",
    "ForwardSettle",
    "HandleReply",
    "HandleRequest",
    "Hello",
    "LeaseClaim",
    "LeaseForward",
    "LeaseRelease",
    "Request",
    "Resync",
    "ResyncReply",
    "SegmentRelease",
    "TransferFailed",
    "Welcome",
    "parse_request",
    "raise_for_error",
]


Request = Union[  # noqa: UP007
    HandleRequest,
    LeaseClaim,
    LeaseRelease,
    SegmentRelease,
    CopyRequest,
    Resync,
    LeaseForward,
    ForwardSettle,
    TransferFailed,
]


def parse_request(msg: object) -> Request:
    """The typed broker request ``msg`` is; :class:`ProtocolError` for anything else."""
    op = as_mapping(msg, "broker request").get("op")
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(f"broker request: unknown op {op!r}")
    request: Request = cls.from_msg(msg)
    return request


#: Broker requests by op.
REQUESTS: dict[str, Any] = {
    HandleRequest.op: HandleRequest,
    LeaseClaim.op: LeaseClaim,
    LeaseRelease.op: LeaseRelease,
    SegmentRelease.op: SegmentRelease,
    CopyRequest.op: CopyRequest,
    Resync.op: Resync,
    LeaseForward.op: LeaseForward,
    ForwardSettle.op: ForwardSettle,
    TransferFailed.op: TransferFailed,
}
