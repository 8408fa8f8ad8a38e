"""The messages two members exchange outside Dask's frames: the fd broker's protocol on its Unix socket (its
messages, the requests a broker parses, every message by name), and the bind of a Dask comm.

Sections: a connection's opening (:class:`Hello`, answered by :class:`Welcome` or :class:`ErrorReply`; any later
request may be refused with an :class:`ErrorReply` too, and the streamed copy's server
(:mod:`dask_gpupool.wire.stream`) refuses pulls with it; :func:`raise_for_error` turns one back into its exception);
fd requests (:class:`HandleRequest`, :class:`HandleReply`); host copies of leased buffers (:class:`CopyRequest`,
:class:`CopyReply`); :func:`parse_request`; and the bind. The lease messages (claims, releases, resyncs, forwards and
failed transfers) are in :mod:`~dask_gpupool.wire.broker_leases`, and importable from here too.

Broker messages are encoded by :func:`~dask_gpupool.wire.codec.encode` (one length-limited msgpack datagram each)
and parsed by :func:`parse_request`. The streamed copy's pull requests share the codec and the error replies.

**Binding a Dask comm to the member at its other end: a challenge and a response under the cluster's token.** A
worker that opens a comm to another worker of the registry proves, on that very comm and before Dask uses it, that
it is a member and which worker it is; the worker it connected to proves the same back. Leases are granted only over
a bound comm, to the worker it is bound to, and headers are imported only from replies read on one
(:mod:`dask_gpupool.dask.comms`)::

    importer -> exporter   BindHello{op: "gpupool_bind", worker, nonce}       (Dask's RPC op)
    exporter -> importer   BindChallenge{op: "gpupool-bind-challenge", nonce, proof}
    importer -> exporter   BindProof{op: "gpupool-bind-proof", proof}
    exporter -> importer   BindBound{op: "gpupool-bind-ok"} | ErrorReply

Each proof is HMAC-SHA256 under the cluster's membership token over the role, the exporter's address, the
importer's address and the other side's nonce (:func:`bind_proof`): a proof is worth nothing on another comm, in
the other direction, or between other workers.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from dask_gpupool import errors as _errors
from dask_gpupool.errors import ProtocolError
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
from dask_gpupool.wire.codec import TOKEN_BYTES, as_mapping, as_message, field_of, uuid_str

__all__ = [
    "BIND_OP",
    "MAX_LEASES_PER_MESSAGE",
    "BindBound",
    "BindChallenge",
    "BindHello",
    "BindProof",
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
    "bind_proof",
    "parse_request",
    "raise_for_error",
]


# -- a connection's opening, and refusals ------------------------------------------------------------------------------


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


_REPLY_ERRORS: dict[str, type[_errors.GPUPoolError]] = {
    name: getattr(_errors, name) for name in _errors.__all__ if name != "GPUPoolError"
}


# -- fd requests -------------------------------------------------------------------------------------------------------


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


# -- host copies of leased buffers -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CopyRequest:
    """Importer -> exporter's broker: send me a host copy of leased buffer ``lease``.

    The fallback when importing failed. Answered by a :class:`CopyReply` and a
    memfd holding the bytes, or an :class:`~dask_gpupool.wire.broker.ErrorReply`.
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


# -- parsing a request -------------------------------------------------------------------------------------------------


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


# -- binding a Dask comm to the member at its other end ----------------------------------------------------------------


#: The Dask RPC op that starts a bind on the comm it arrives on.
BIND_OP = "gpupool_bind"

#: The longest worker address a bind names.
MAX_ADDRESS = 512


def _nonce(m: dict[str, Any], name: str, what: str) -> bytes:
    value = field_of(m, name, bytes, what)
    if len(value) != TOKEN_BYTES:
        raise ProtocolError(f"{what}: {name} of {len(value)} bytes (expected {TOKEN_BYTES})")
    return bytes(value)


@dataclass(frozen=True)
class BindHello:
    """Importer -> exporter: bind this comm to me, ``worker``; ``nonce`` is what the exporter's proof covers."""

    worker: str
    nonce: bytes = field(repr=False)
    op: ClassVar[str] = BIND_OP

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "worker": self.worker, "nonce": self.nonce}

    @classmethod
    def from_msg(cls, msg: object) -> BindHello:
        what = "bind hello"
        m = as_message(msg, cls.op, what)
        worker = field_of(m, "worker", str, what)
        if not worker or len(worker) > MAX_ADDRESS:
            raise ProtocolError(f"{what}: a worker address of {len(worker)} characters")
        return cls(worker, _nonce(m, "nonce", what))


@dataclass(frozen=True)
class BindChallenge:
    """Exporter -> importer: my proof over the importer's nonce, and the nonce the importer's proof must cover."""

    nonce: bytes = field(repr=False)
    proof: bytes = field(repr=False)
    op: ClassVar[str] = "gpupool-bind-challenge"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "nonce": self.nonce, "proof": self.proof}

    @classmethod
    def from_msg(cls, msg: object) -> BindChallenge:
        what = "bind challenge"
        m = as_message(msg, cls.op, what)
        return cls(_nonce(m, "nonce", what), _nonce(m, "proof", what))


@dataclass(frozen=True)
class BindProof:
    """Importer -> exporter: my proof over the exporter's nonce."""

    proof: bytes = field(repr=False)
    op: ClassVar[str] = "gpupool-bind-proof"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "proof": self.proof}

    @classmethod
    def from_msg(cls, msg: object) -> BindProof:
        what = "bind proof"
        return cls(_nonce(as_message(msg, cls.op, what), "proof", what))


@dataclass(frozen=True)
class BindBound:
    """Exporter -> importer: the comm is bound to the importer."""

    op: ClassVar[str] = "gpupool-bind-ok"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op}

    @classmethod
    def from_msg(cls, msg: object) -> BindBound:
        as_message(msg, cls.op, "bind answer")
        return cls()


def bind_proof(token: bytes, role: str, exporter: str, importer: str, nonce: bytes) -> bytes:
    """What ``role`` (``"exporter"`` or ``"importer"``) presents on a comm between ``importer`` and ``exporter``
    (worker addresses) in answer to the other side's ``nonce``."""
    text = f"bind:{role}:{exporter}:{importer}:".encode()
    return hmac.new(token, text + nonce, hashlib.sha256).digest()
