"""The fd broker's protocol, on its Unix socket: hello, fd requests, lease claims, releases and forwards, copies.

Messages are encoded by :func:`~dask_gpupool.wire.codec.encode` (one
length-limited msgpack datagram each) and parsed by :func:`parse_request`.
The streamed copy's pull requests (:mod:`dask_gpupool.wire.stream`) share the
codec and the error replies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from dask_gpupool import errors as _errors
from dask_gpupool.errors import ProtocolError
from dask_gpupool.wire.codec import TOKEN_BYTES, as_mapping, as_message, field_of, uuid_str

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
    "Welcome",
    "parse_request",
    "raise_for_error",
]


@dataclass(frozen=True)
class HandleRequest:
    """Broker request: send me the shareable handle (fd) of pool ``pool``, or of its segment ``segment``.

    ``segment`` 0 asks for the pool's own handle; a positive id for one of
    its VMM segments (a descriptor with an ``extent`` and no payload).
    """

    pool: str
    segment: int = 0
    op: ClassVar[str] = "pool-handle"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "pool": self.pool, "segment": self.segment}

    @classmethod
    def from_msg(cls, msg: object) -> HandleRequest:
        what = "broker request"
        m = as_message(msg, cls.op, what)
        segment = field_of(m, "segment", int, what) if "segment" in m else 0
        if segment < 0:
            raise ProtocolError(f"{what}: negative segment id")
        return cls(pool=uuid_str(field_of(m, "pool", str, what), what), segment=segment)


@dataclass(frozen=True)
class HandleReply:
    """Broker reply announcing that the next message carries the fd asked for.

    The fd itself travels in a message of its own (one byte of payload, the
    fd as SCM_RIGHTS ancillary data), right after this one. ``size``: the
    pool's ``max_size``, or the segment's size.
    """

    pool: str
    kind: str
    size: int
    segment: int = 0
    op: ClassVar[str] = "pool-handle-ok"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "pool": self.pool, "kind": self.kind, "size": self.size, "segment": self.segment}

    @classmethod
    def from_msg(cls, msg: object) -> HandleReply:
        what = "broker reply"
        m = as_message(msg, cls.op, what)
        size = field_of(m, "size", int, what)
        segment = field_of(m, "segment", int, what) if "segment" in m else 0
        if size < 0 or segment < 0:
            raise ProtocolError(f"{what}: negative size or segment id")
        return cls(
            pool=uuid_str(field_of(m, "pool", str, what), what),
            kind=field_of(m, "kind", str, what),
            size=size,
            segment=segment,
        )


@dataclass(frozen=True)
class ErrorReply:
    """Broker reply refusing a request.

    Attributes
    ----------
    error : str
        Name of a :class:`~dask_gpupool.GPUPoolError` subclass.
    message : str
        What went wrong, for people.
    """

    error: str
    message: str
    op: ClassVar[str] = "error"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "error": self.error, "message": self.message}

    @classmethod
    def from_msg(cls, msg: object) -> ErrorReply:
        what = "broker error reply"
        m = as_mapping(msg, what)
        return cls(error=field_of(m, "error", str, what), message=field_of(m, "message", str, what))

    @classmethod
    def of(cls, exc: _errors.GPUPoolError) -> ErrorReply:
        return cls(error=type(exc).__name__, message=str(exc))


def raise_for_error(msg: dict[str, Any], context: str) -> None:
    """Raise the error an :class:`ErrorReply` carries; do nothing for other replies.

    Unknown error names become :class:`BrokerRefusedError`, so a peer cannot
    make us raise an arbitrary type.
    """
    if msg.get("op") != ErrorReply.op:
        return
    reply = ErrorReply.from_msg(msg)
    exc_type = _REPLY_ERRORS.get(reply.error, _errors.BrokerRefusedError)
    raise exc_type(f"{context}: {reply.message}")


#: Most lease ids in one claim or release message (keeps messages under MAX_MESSAGE_BYTES).
MAX_LEASES_PER_MESSAGE = 4096


def _lease_ids(m: dict[str, Any], what: str) -> tuple[int, ...]:
    ids = field_of(m, "leases", (list, tuple), what)
    if len(ids) > MAX_LEASES_PER_MESSAGE:
        raise ProtocolError(f"{what}: {len(ids)} leases in one message (at most {MAX_LEASES_PER_MESSAGE})")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i > 0 for i in ids):
        raise ProtocolError(f"{what}: lease ids must be positive integers")
    return tuple(ids)


@dataclass(frozen=True)
class LeaseClaim:
    """Importer -> exporter's broker: I imported these leased buffers. Answered by a :class:`ClaimReply`.

    A lease can be claimed only by the worker it was granted to (the one
    that said so in its :class:`Hello`). The importer hands a buffer to its
    user only once the reply says its lease is held; a refused lease ended
    (its reply to the importer failed, or it was never this importer's).
    """

    leases: tuple[int, ...]
    op: ClassVar[str] = "lease-claim"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "leases": list(self.leases)}

    @classmethod
    def from_msg(cls, msg: object) -> LeaseClaim:
        return cls(_lease_ids(as_mapping(msg, "lease claim"), "lease claim"))


@dataclass(frozen=True)
class ClaimReply:
    """Broker -> importer: which leases of a :class:`LeaseClaim` were refused (the rest are held)."""

    refused: tuple[int, ...]
    op: ClassVar[str] = "claim-ok"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "leases": list(self.refused)}

    @classmethod
    def from_msg(cls, msg: object) -> ClaimReply:
        what = "claim reply"
        return cls(_lease_ids(as_message(msg, cls.op, what), what))


@dataclass(frozen=True)
class Resync:
    """Importer -> exporter's broker, first on a new connection: the leases I still hold.

    Sent when a link is opened again after one broke (an exporter that
    stalled past ``broker-timeout``, say). The exporter ends the leases it
    counted as claimed by this worker that are not listed: their releases
    were lost with the old connection. Chunks of at most
    :data:`MAX_LEASES_PER_MESSAGE`; the last has ``done`` set and is answered
    by a :class:`ResyncReply`.
    """

    leases: tuple[int, ...]
    done: bool
    op: ClassVar[str] = "resync"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "leases": list(self.leases), "done": self.done}

    @classmethod
    def from_msg(cls, msg: object) -> Resync:
        what = "lease resync"
        m = as_mapping(msg, what)
        return cls(_lease_ids(m, what), field_of(m, "done", bool, what))


@dataclass(frozen=True)
class ResyncReply:
    """Broker -> importer: the resync is applied; ``ended`` leases were released by it."""

    ended: int
    op: ClassVar[str] = "resync-ok"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "ended": self.ended}

    @classmethod
    def from_msg(cls, msg: object) -> ResyncReply:
        what = "resync reply"
        ended = field_of(as_message(msg, cls.op, what), "ended", int, what)
        if ended < 0:
            raise ProtocolError(f"{what}: negative count")
        return cls(ended)


@dataclass(frozen=True)
class LeaseRelease:
    """Importer -> exporter's broker: I closed my imports of these leases (no reply)."""

    leases: tuple[int, ...]
    op: ClassVar[str] = "lease-release"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "leases": list(self.leases)}

    @classmethod
    def from_msg(cls, msg: object) -> LeaseRelease:
        return cls(_lease_ids(as_mapping(msg, "lease release"), "lease release"))


@dataclass(frozen=True)
class SegmentRelease:
    """Importer -> exporter's broker: I unmapped these retiring segments (no reply).

    Attributes
    ----------
    segments : tuple of (int, int)
        ``(segment id, leases on it this importer claimed in all)``: the
        exporter counts the segment unmapped by this connection only if no
        claim arrived after the ones counted here (see :mod:`dask_gpupool.memory.segments`).
    """

    segments: tuple[tuple[int, int], ...]
    op: ClassVar[str] = "segment-release"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "segments": [list(s) for s in self.segments]}

    @classmethod
    def from_msg(cls, msg: object) -> SegmentRelease:
        what = "segment release"
        items = field_of(as_mapping(msg, what), "segments", (list, tuple), what)
        if len(items) > MAX_LEASES_PER_MESSAGE:
            raise ProtocolError(f"{what}: {len(items)} segments in one message (at most {MAX_LEASES_PER_MESSAGE})")
        out = []
        for item in items:
            if (
                not isinstance(item, (list, tuple))
                or len(item) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in item)
            ):
                raise ProtocolError(f"{what}: each entry is [segment id, claims], both positive integers")
            out.append((item[0], item[1]))
        return cls(tuple(out))


@dataclass(frozen=True)
class LeaseForward:
    """Importer -> exporter's broker: grant worker ``to`` a lease on what my lease ``lease`` keeps alive.

    Sent by a worker passing on a value it imported from this exporter:
    ``to`` then maps the exporter's memory itself. Answered by a
    :class:`ForwardReply` or an :class:`ErrorReply` (the lease is not this
    worker's, not claimed, or ``to`` is not a worker of this host).
    """

    lease: int
    to: str
    op: ClassVar[str] = "lease-forward"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "lease": self.lease, "to": self.to}

    @classmethod
    def from_msg(cls, msg: object) -> LeaseForward:
        what = "lease forward"
        m = as_message(msg, cls.op, what)
        lease = field_of(m, "lease", int, what)
        to = field_of(m, "to", str, what)
        if lease <= 0 or not to or len(to) > 1024:
            raise ProtocolError(f"{what}: lease id or worker address out of range")
        return cls(lease, to)


@dataclass(frozen=True)
class ForwardReply:
    """Exporter's broker -> importer: ``lease`` is granted to the worker a :class:`LeaseForward` named."""

    lease: int
    segment: int
    op: ClassVar[str] = "forward-ok"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "lease": self.lease, "segment": self.segment}

    @classmethod
    def from_msg(cls, msg: object) -> ForwardReply:
        what = "forward reply"
        m = as_message(msg, cls.op, what)
        lease, segment = field_of(m, "lease", int, what), field_of(m, "segment", int, what)
        if lease <= 0 or segment < 0:
            raise ProtocolError(f"{what}: lease id or segment out of range")
        return cls(lease, segment)


@dataclass(frozen=True)
class ForwardSettle:
    """Importer -> exporter's broker: the replies that carried these forwarded leases ended (no reply).

    The exporter ends those still unclaimed; the worker they were forwarded
    to claims (and waits for the answer) before it acknowledges the reply.
    """

    leases: tuple[int, ...]
    op: ClassVar[str] = "forward-settle"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "leases": list(self.leases)}

    @classmethod
    def from_msg(cls, msg: object) -> ForwardSettle:
        return cls(_lease_ids(as_mapping(msg, "forward settle"), "forward settle"))


@dataclass(frozen=True)
class CopyRequest:
    """Importer -> exporter's broker: send me a host copy of leased buffer ``lease``.

    The fallback when importing failed. Answered by a :class:`CopyReply` and a
    memfd holding the bytes, or an :class:`ErrorReply`.
    """

    lease: int
    op: ClassVar[str] = "lease-copy"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "lease": self.lease}

    @classmethod
    def from_msg(cls, msg: object) -> CopyRequest:
        lease = field_of(as_mapping(msg, "copy request"), "lease", int, "copy request")
        if lease <= 0:
            raise ProtocolError("copy request: lease ids are positive")
        return cls(lease)


@dataclass(frozen=True)
class CopyReply:
    """Exporter's broker -> importer: the next message carries a memfd of ``size`` bytes."""

    lease: int
    size: int
    op: ClassVar[str] = "lease-copy-ok"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "lease": self.lease, "size": self.size}

    @classmethod
    def from_msg(cls, msg: object) -> CopyReply:
        what = "copy reply"
        m = as_message(msg, cls.op, what)
        size = field_of(m, "size", int, what)
        if size < 0:
            raise ProtocolError(f"{what}: negative size")
        return cls(field_of(m, "lease", int, what), size)


@dataclass(frozen=True)
class Hello:
    """First message on every broker connection: the cluster's membership token and who is asking.

    The broker compares the token in constant time with the one its worker
    got from the scheduler's registry and closes the connection on a
    mismatch. ``worker`` is the importer's worker address (``""`` for a
    caller that only fetches pool fds); the broker accepts it only if the
    registry row of that worker names the process at the other end of the
    socket (``SO_PEERCRED``), and scopes lease claims to it.
    """

    token: bytes = field(repr=False)
    worker: str = ""
    op: ClassVar[str] = "hello"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "token": self.token, "worker": self.worker}

    @classmethod
    def from_msg(cls, msg: object) -> Hello:
        what = "broker hello"
        m = as_message(msg, cls.op, what)
        token = field_of(m, "token", bytes, what)
        if len(token) != TOKEN_BYTES:
            raise ProtocolError(f"{what}: token of {len(token)} bytes (expected {TOKEN_BYTES})")
        worker = field_of(m, "worker", str, what)
        if len(worker) > 1024:
            raise ProtocolError(f"{what}: worker address of {len(worker)} characters")
        return cls(token, worker)


@dataclass(frozen=True)
class Welcome:
    """Broker reply to a :class:`Hello` with the right token; the connection may now make requests."""

    op: ClassVar[str] = "welcome"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op}

    @classmethod
    def from_msg(cls, msg: object) -> Welcome:
        as_message(msg, cls.op, "broker welcome")
        return cls()


Request = Union[  # noqa: UP007
    HandleRequest, LeaseClaim, LeaseRelease, SegmentRelease, CopyRequest, Resync, LeaseForward, ForwardSettle
]


def parse_request(msg: object) -> Request:
    """The typed broker request ``msg`` is; :class:`ProtocolError` for anything else."""
    op = as_mapping(msg, "broker request").get("op")
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(f"broker request: unknown op {op!r}")
    request: Request = cls.from_msg(msg)
    return request


_REPLY_ERRORS: dict[str, type[_errors.GPUPoolError]] = {
    name: getattr(_errors, name) for name in _errors.__all__ if name != "GPUPoolError"
}


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
}
