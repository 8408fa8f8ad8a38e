"""Typed messages that cross a process boundary.

Everything dask_gpupool sends between processes is one of these frozen
dataclasses, turned into a msgpack-safe ``dict`` by ``to_msg()`` and checked
field by field by ``from_msg()``, which raises :class:`ProtocolError` on
anything else. Nothing is ever pickled on the wire.

Two channels carry them:

- Dask's own comms carry :class:`PoolRecord`, :class:`Membership` and
  :class:`RegistryUpdate`: each worker's batched stream, both ways (ops in
  :mod:`dask_gpupool.core`), and the read-only ``gpupool_pools`` RPC.
- The fd broker's Unix socket carries :class:`HandleRequest`,
  :class:`HandleReply`, :class:`LeaseClaim`, :class:`LeaseRelease`,
  :class:`CopyRequest`, :class:`CopyReply` and :class:`ErrorReply`, encoded
  by :func:`encode`.

:class:`HandoffHeader` is the sub-header of a handed-over buffer or array in
a Dask message (the frames of Dask's serialization).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from dask_gpupool import errors as _errors
from dask_gpupool.errors import ProtocolError

__all__ = [
    "MAX_LANES",
    "MAX_MESSAGE_BYTES",
    "TOKEN_BYTES",
    "ArrayMeta",
    "BufferDescriptor",
    "ClaimReply",
    "CopyReply",
    "CopyRequest",
    "ErrorReply",
    "HandleReply",
    "HandleRequest",
    "HandoffHeader",
    "Hello",
    "LeaseClaim",
    "LeaseRelease",
    "Membership",
    "PoolRecord",
    "PullReply",
    "PullRequest",
    "RegistryUpdate",
    "Resync",
    "ResyncReply",
    "SegmentRelease",
    "Welcome",
    "decode",
    "encode",
    "raise_for_error",
]

#: Most connections (lanes) one streamed copy is pulled over.
MAX_LANES = 16

#: Largest broker message accepted; anything bigger is malformed.
MAX_MESSAGE_BYTES = 64 * 1024


def _field(msg: dict[str, Any], name: str, types: type | tuple[type, ...], what: str) -> Any:
    try:
        value = msg[name]
    except KeyError:
        raise ProtocolError(f"{what}: missing field {name!r}") from None
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ProtocolError(f"{what}: field {name!r} has type bool")
    if not isinstance(value, types):
        raise ProtocolError(f"{what}: field {name!r} has type {type(value).__name__}")
    return value


def _uuid_str(value: str, what: str) -> str:
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise ProtocolError(f"{what}: {value!r} is not a UUID") from None


def _mapping(msg: object, what: str) -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise ProtocolError(f"{what}: expected a map, got {type(msg).__name__}")
    return msg


def _message(msg: object, op: str, what: str) -> dict[str, Any]:
    """``msg`` as a map whose ``op`` is ``op``."""
    m = _mapping(msg, what)
    if m.get("op") != op:
        raise ProtocolError(f"{what}: expected op {op!r}, got {m.get('op')!r}")
    return m


@dataclass(frozen=True)
class PoolRecord:
    """One row of the scheduler's registry: a worker's pool.

    Attributes
    ----------
    pool : str
        The pool's UUID (canonical text form); the registry key.
    worker : str
        Address of the worker that owns the pool.
    pid : int
        Process id of that worker.
    host : str
        Host identity (hostname + boot id, or the ``gpupool.host-id`` override).
        Only workers with equal ``host`` map each other's pools.
    hostname : str
        Hostname, for people reading the registry.
    kind : str
        ``"device"``, ``"pinned"`` or ``"host"``.
    device : str or None
        UUID of the GPU the pool lives on (``device``) or whose context made it
        (``pinned``); ``None`` for ``host`` pools.
    max_size : int
        Upper bound of the pool in bytes.
    broker : str
        Path of the owner's fd broker socket.
    devices : tuple of str
        UUIDs of every GPU the owner process can see.
    peers : tuple of str
        UUIDs of the other GPUs the owner granted access to its ``device``
        pool; workers there get its buffers zero-copy, others get copies.
    retire_below : int
        Segments of this pool with a smaller id are retiring: a peer unmaps
        each once no buffer it imported from it is alive, and says so with a
        :class:`SegmentRelease` (:mod:`dask_gpupool.memory.segments`). 0: none.
    """

    pool: str
    worker: str
    pid: int
    host: str
    hostname: str
    kind: str
    device: str | None
    max_size: int
    broker: str
    devices: tuple[str, ...] = ()
    peers: tuple[str, ...] = ()
    retire_below: int = 0

    KINDS: ClassVar[tuple[str, ...]] = ("device", "pinned", "host")

    def to_msg(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "worker": self.worker,
            "pid": self.pid,
            "host": self.host,
            "hostname": self.hostname,
            "kind": self.kind,
            "device": self.device,
            "max_size": self.max_size,
            "broker": self.broker,
            "devices": list(self.devices),
            "peers": list(self.peers),
            "retire_below": self.retire_below,
        }

    @classmethod
    def from_msg(cls, msg: object) -> PoolRecord:
        what = "pool record"
        m = _mapping(msg, what)
        kind = _field(m, "kind", str, what)
        if kind not in cls.KINDS:
            raise ProtocolError(f"{what}: unknown kind {kind!r}")
        devices = _field(m, "devices", (list, tuple), what)
        peers = _field(m, "peers", (list, tuple), what)
        if not all(isinstance(d, str) for d in (*devices, *peers)):
            raise ProtocolError(f"{what}: 'devices' and 'peers' must be strings")
        max_size = _field(m, "max_size", int, what)
        pid = _field(m, "pid", int, what)
        if max_size <= 0 or pid <= 0:
            raise ProtocolError(f"{what}: 'max_size' and 'pid' must be positive")
        retire_below = _field(m, "retire_below", int, what)
        if retire_below < 0:
            raise ProtocolError(f"{what}: negative 'retire_below'")
        return cls(
            pool=_uuid_str(_field(m, "pool", str, what), what),
            worker=_field(m, "worker", str, what),
            pid=pid,
            host=_field(m, "host", str, what),
            hostname=_field(m, "hostname", str, what),
            kind=kind,
            device=_field(m, "device", (str, type(None)), what),
            max_size=max_size,
            broker=_field(m, "broker", str, what),
            devices=tuple(devices),
            peers=tuple(peers),
            retire_below=retire_below,
        )


@dataclass(frozen=True)
class BufferDescriptor:
    """Where a buffer lives inside a peer's pool: enough for that peer to map it.

    Attributes
    ----------
    pool : str
        UUID of the exporting pool.
    size : int
        Bytes of the buffer.
    payload : bytes
        CUDA kinds: the 64-byte ``cuMemPoolExportPointer`` data of the
        allocation holding the buffer. ``host``, and segments of VMM memory
        (whose fd the peer fetches from the owner's broker by ``segment``):
        empty.
    offset : int
        ``host``: byte offset inside the pool's memfd. CUDA kinds: offset
        inside the segment ``payload`` describes (0 without segments).
    extent : int
        CUDA kinds with segments: the segment's size, which the peer imports
        once and keeps mapped (:mod:`dask_gpupool.memory.segments`). 0: the payload
        describes the buffer itself.
    segment : int
        With ``extent``: the segment's id in its pool (positive), named in
        :class:`SegmentRelease` and compared with the pool's
        ``retire_below``. 0 otherwise.
    """

    pool: str
    size: int
    payload: bytes = b""
    offset: int = 0
    extent: int = 0
    segment: int = 0

    PAYLOAD_BYTES: ClassVar[int] = 64

    def to_msg(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "size": self.size,
            "payload": self.payload,
            "offset": self.offset,
            "extent": self.extent,
            "segment": self.segment,
        }

    @classmethod
    def from_msg(cls, msg: object) -> BufferDescriptor:
        what = "buffer descriptor"
        m = _mapping(msg, what)
        payload = _field(m, "payload", bytes, what)
        if len(payload) not in (0, cls.PAYLOAD_BYTES):
            raise ProtocolError(f"{what}: payload of {len(payload)} bytes (expected 0 or {cls.PAYLOAD_BYTES})")
        size = _field(m, "size", int, what)
        offset = _field(m, "offset", int, what)
        extent = _field(m, "extent", int, what)
        if size < 0 or offset < 0 or extent < 0:
            raise ProtocolError(f"{what}: negative size, offset or extent")
        if extent and offset + size > extent:
            raise ProtocolError(f"{what}: {size} bytes at offset {offset} do not fit a segment of {extent} bytes")
        segment = _field(m, "segment", int, what)
        if segment < 0 or bool(segment) != bool(extent):
            raise ProtocolError(f"{what}: segment id {segment} with extent {extent} (both set, or neither)")
        return cls(
            pool=_uuid_str(_field(m, "pool", str, what), what),
            size=size,
            payload=payload,
            offset=offset,
            extent=extent,
            segment=segment,
        )


@dataclass(frozen=True)
class RegistryUpdate:
    """A change of the registry, or a whole snapshot of it.

    Sent by the scheduler to every worker over its batched stream (op
    ``gpupool-registry``); a snapshot of it is part of :class:`Membership`.

    Attributes
    ----------
    version : int
        Registry version after this change; versions only grow.
    added : tuple of PoolRecord
        Rows added (or, in a snapshot, every row).
    removed : tuple of str
        Pool UUIDs removed.
    snapshot : bool
        ``True`` when ``added`` is the whole registry at ``version``.
    """

    version: int
    added: tuple[PoolRecord, ...] = ()
    removed: tuple[str, ...] = ()
    snapshot: bool = False

    def to_msg(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "added": [r.to_msg() for r in self.added],
            "removed": list(self.removed),
            "snapshot": self.snapshot,
        }

    @classmethod
    def from_msg(cls, msg: object) -> RegistryUpdate:
        what = "registry update"
        m = _mapping(msg, what)
        removed = _field(m, "removed", (list, tuple), what)
        if not all(isinstance(r, str) for r in removed):
            raise ProtocolError(f"{what}: 'removed' must be strings")
        return cls(
            version=_field(m, "version", int, what),
            added=tuple(PoolRecord.from_msg(r) for r in _field(m, "added", (list, tuple), what)),
            removed=tuple(_uuid_str(r, what) for r in removed),
            snapshot=_field(m, "snapshot", bool, what),
        )


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
        m = _message(msg, cls.op, what)
        segment = _field(m, "segment", int, what) if "segment" in m else 0
        if segment < 0:
            raise ProtocolError(f"{what}: negative segment id")
        return cls(pool=_uuid_str(_field(m, "pool", str, what), what), segment=segment)


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
        m = _message(msg, cls.op, what)
        size = _field(m, "size", int, what)
        segment = _field(m, "segment", int, what) if "segment" in m else 0
        if size < 0 or segment < 0:
            raise ProtocolError(f"{what}: negative size or segment id")
        return cls(
            pool=_uuid_str(_field(m, "pool", str, what), what),
            kind=_field(m, "kind", str, what),
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
        m = _mapping(msg, what)
        return cls(error=_field(m, "error", str, what), message=_field(m, "message", str, what))

    @classmethod
    def of(cls, exc: _errors.GPUPoolError) -> ErrorReply:
        return cls(error=type(exc).__name__, message=str(exc))


_REPLY_ERRORS: dict[str, type[_errors.GPUPoolError]] = {
    name: getattr(_errors, name) for name in _errors.__all__ if name != "GPUPoolError"
}


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
    ids = _field(m, "leases", (list, tuple), what)
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
        return cls(_lease_ids(_mapping(msg, "lease claim"), "lease claim"))


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
        return cls(_lease_ids(_message(msg, cls.op, what), what))


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
        m = _mapping(msg, what)
        return cls(_lease_ids(m, what), _field(m, "done", bool, what))


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
        ended = _field(_message(msg, cls.op, what), "ended", int, what)
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
        return cls(_lease_ids(_mapping(msg, "lease release"), "lease release"))


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
        items = _field(_mapping(msg, what), "segments", (list, tuple), what)
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
        lease = _field(_mapping(msg, "copy request"), "lease", int, "copy request")
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
        m = _message(msg, cls.op, what)
        size = _field(m, "size", int, what)
        if size < 0:
            raise ProtocolError(f"{what}: negative size")
        return cls(_field(m, "lease", int, what), size)


#: Bytes of a cluster membership token.
TOKEN_BYTES = 32


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
        m = _message(msg, cls.op, what)
        token = _field(m, "token", bytes, what)
        if len(token) != TOKEN_BYTES:
            raise ProtocolError(f"{what}: token of {len(token)} bytes (expected {TOKEN_BYTES})")
        worker = _field(m, "worker", str, what)
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
        _message(msg, cls.op, "broker welcome")
        return cls()


@dataclass(frozen=True)
class PullRequest:
    """Importer -> exporter's copy server: stream me the bytes of leased buffer ``lease``.

    ``proof`` is HMAC-SHA256 of ``pull:<pool>:<lease>`` under the cluster's
    membership token (:func:`dask_gpupool.transport.stream.pull_proof`): only members
    of the cluster can make one, and it names one lease of one pool.
    """

    pool: str
    lease: int
    proof: bytes = field(repr=False)
    op: ClassVar[str] = "pull"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "pool": self.pool, "lease": self.lease, "proof": self.proof}

    @classmethod
    def from_msg(cls, msg: object) -> PullRequest:
        what = "pull request"
        m = _message(msg, cls.op, what)
        lease = _field(m, "lease", int, what)
        if lease <= 0:
            raise ProtocolError(f"{what}: lease ids are positive")
        proof = _field(m, "proof", bytes, what)
        if len(proof) != TOKEN_BYTES:
            raise ProtocolError(f"{what}: proof of {len(proof)} bytes (expected {TOKEN_BYTES})")
        return cls(_uuid_str(_field(m, "pool", str, what), what), lease, proof)


@dataclass(frozen=True)
class PullReply:
    """Exporter's copy server -> importer: ``size`` raw bytes follow, sent in chunks of ``chunk``."""

    lease: int
    size: int
    chunk: int
    op: ClassVar[str] = "pull-ok"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "lease": self.lease, "size": self.size, "chunk": self.chunk}

    @classmethod
    def from_msg(cls, msg: object) -> PullReply:
        what = "pull reply"
        m = _message(msg, cls.op, what)
        size, chunk = _field(m, "size", int, what), _field(m, "chunk", int, what)
        if size < 0 or chunk <= 0:
            raise ProtocolError(f"{what}: size {size} or chunk {chunk} out of range")
        return cls(_field(m, "lease", int, what), size, chunk)


@dataclass(frozen=True)
class Membership:
    """The scheduler's answer to a worker registering its pool (op ``gpupool-membership``).

    Attributes
    ----------
    snapshot : RegistryUpdate
        The whole registry.
    token : bytes
        The cluster's membership token (:data:`TOKEN_BYTES`): the worker's
        broker serves only peers presenting it, and the worker presents it to
        others'. It travels only over the registering worker's own stream
        from the scheduler (TLS when the cluster is secured).
    """

    snapshot: RegistryUpdate
    token: bytes = field(repr=False)

    def to_msg(self) -> dict[str, Any]:
        return {"snapshot": self.snapshot.to_msg(), "token": self.token}

    @classmethod
    def from_msg(cls, msg: object) -> Membership:
        what = "registration reply"
        m = _mapping(msg, what)
        token = _field(m, "token", bytes, what)
        if len(token) != TOKEN_BYTES:
            raise ProtocolError(f"{what}: token of {len(token)} bytes (expected {TOKEN_BYTES})")
        return cls(RegistryUpdate.from_msg(_field(m, "snapshot", dict, what)), token)


#: Broker requests by op.
REQUESTS: dict[str, Any] = {
    HandleRequest.op: HandleRequest,
    LeaseClaim.op: LeaseClaim,
    LeaseRelease.op: LeaseRelease,
    SegmentRelease.op: SegmentRelease,
    CopyRequest.op: CopyRequest,
    Resync.op: Resync,
}


def parse_request(
    msg: object,
) -> HandleRequest | LeaseClaim | LeaseRelease | SegmentRelease | CopyRequest | Resync:
    """The typed broker request ``msg`` is; :class:`ProtocolError` for anything else."""
    op = _mapping(msg, "broker request").get("op")
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(f"broker request: unknown op {op!r}")
    request: HandleRequest | LeaseClaim | LeaseRelease | SegmentRelease | CopyRequest | Resync = cls.from_msg(msg)
    return request


@dataclass(frozen=True)
class ArrayMeta:
    """Shape of an array view over a handed-over buffer.

    Attributes
    ----------
    module : {"numpy", "cupy"}
        Which array type to rebuild.
    shape, strides : tuple of int
        In elements and bytes, as NumPy and CuPy spell them.
    dtype : str
        ``numpy.dtype.str`` (e.g. ``"<f8"``); only plain (non-object) dtypes.
    offset : int
        Byte offset of element 0 inside the buffer.
    """

    module: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    offset: int = 0

    MODULES: ClassVar[tuple[str, ...]] = ("numpy", "cupy")

    def to_msg(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "shape": list(self.shape),
            "strides": list(self.strides),
            "dtype": self.dtype,
            "offset": self.offset,
        }

    @classmethod
    def from_msg(cls, msg: object) -> ArrayMeta:
        what = "array header"
        m = _mapping(msg, what)
        module = _field(m, "module", str, what)
        if module not in cls.MODULES:
            raise ProtocolError(f"{what}: unknown array module {module!r}")
        shape = _field(m, "shape", (list, tuple), what)
        strides = _field(m, "strides", (list, tuple), what)
        if len(shape) != len(strides) or len(shape) > 64:
            raise ProtocolError(f"{what}: shape and strides differ in length or exceed 64 dimensions")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (*shape, *strides)):
            raise ProtocolError(f"{what}: shape and strides must be integers")
        if any(x < 0 for x in shape):
            raise ProtocolError(f"{what}: negative extent")
        dtype = _field(m, "dtype", str, what)
        if len(dtype) > 16 or "O" in dtype:
            raise ProtocolError(f"{what}: dtype {dtype!r} is not a plain dtype")
        offset = _field(m, "offset", int, what)
        if offset < 0:
            raise ProtocolError(f"{what}: negative offset")
        return cls(module, tuple(shape), tuple(strides), dtype, offset)


@dataclass(frozen=True)
class HandoffHeader:
    """The sub-header of a handed-over buffer or array (msgpack-safe, never pickle).

    Attributes
    ----------
    path : {"ipc", "copy", "stream"}
        ``ipc``: the frames are empty and ``desc`` locates the memory in the
        exporter's pool. ``copy``: the one frame holds the bytes. ``stream``:
        the frames are empty; the importer pulls the bytes from the copy
        server at ``address`` (:mod:`dask_gpupool.transport.stream`).
    kind : {"device", "pinned", "host"}
        Where the data lives at the sender: GPU memory or host memory.
    nbytes : int
        Bytes of the buffer.
    exporter : str
        Address of the sending worker ("" when unknown, e.g. spilling).
    desc : BufferDescriptor or None
        ``ipc`` only: where the buffer lives in the exporter's pool.
    lease : int
        ``ipc`` and ``stream``: the lease that keeps the memory alive; 0 otherwise.
    ready : str
        How the exporter ordered its pending work before the importer reads:
        ``"synced"`` (the exporter's streams were synchronized before sending).
    array : ArrayMeta or None
        Present when the value is an array view rather than a Buffer.
    address : str
        ``stream`` only: the exporter's copy server, ``tcp://host:port``.
    lanes : tuple of int
        ``stream`` only: the leases of the lanes after the first (``lease``):
        the value is pulled over one connection per lease, each lease holding
        the next contiguous part (at most :data:`MAX_LANES` in all).
    """

    path: str
    kind: str
    nbytes: int
    exporter: str = ""
    desc: BufferDescriptor | None = None
    lease: int = 0
    ready: str = "synced"
    array: ArrayMeta | None = None
    address: str = ""
    lanes: tuple[int, ...] = ()

    PATHS: ClassVar[tuple[str, ...]] = ("ipc", "copy", "stream")
    READY: ClassVar[tuple[str, ...]] = ("synced",)

    def to_msg(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "kind": self.kind,
            "nbytes": self.nbytes,
            "exporter": self.exporter,
            "desc": None if self.desc is None else self.desc.to_msg(),
            "lease": self.lease,
            "ready": self.ready,
            "array": None if self.array is None else self.array.to_msg(),
            "address": self.address,
            "lanes": list(self.lanes),
        }

    @classmethod
    def from_msg(cls, msg: object) -> HandoffHeader:
        what = "handoff header"
        m = _mapping(msg, what)
        path = _field(m, "path", str, what)
        if path not in cls.PATHS:
            raise ProtocolError(f"{what}: unknown path {path!r}")
        kind = _field(m, "kind", str, what)
        if kind not in PoolRecord.KINDS:
            raise ProtocolError(f"{what}: unknown kind {kind!r}")
        nbytes = _field(m, "nbytes", int, what)
        lease = _field(m, "lease", int, what)
        if nbytes < 0 or lease < 0:
            raise ProtocolError(f"{what}: negative nbytes or lease")
        ready = _field(m, "ready", str, what)
        if ready not in cls.READY:
            raise ProtocolError(f"{what}: unknown readiness {ready!r}")
        raw_desc = _field(m, "desc", (dict, type(None)), what)
        desc = None if raw_desc is None else BufferDescriptor.from_msg(raw_desc)
        if path == "ipc" and (desc is None or lease == 0):
            raise ProtocolError(f"{what}: an ipc handoff needs a descriptor and a lease")
        address = _field(m, "address", str, what)
        if path == "stream" and (lease == 0 or not address.startswith("tcp://")):
            raise ProtocolError(f"{what}: a stream handoff needs a lease and a tcp:// address")
        raw_lanes = _field(m, "lanes", (list, tuple), what)
        if len(raw_lanes) >= MAX_LANES or not all(
            isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in raw_lanes
        ):
            raise ProtocolError(f"{what}: lanes must be fewer than {MAX_LANES} positive lease ids")
        if raw_lanes and path != "stream":
            raise ProtocolError(f"{what}: only a stream handoff has lanes")
        if desc is not None and desc.size != nbytes:
            raise ProtocolError(f"{what}: descriptor size {desc.size} differs from nbytes {nbytes}")
        raw_array = _field(m, "array", (dict, type(None)), what)
        return cls(
            path=path,
            kind=kind,
            nbytes=nbytes,
            exporter=_field(m, "exporter", str, what),
            desc=desc,
            lease=lease,
            ready=ready,
            array=None if raw_array is None else ArrayMeta.from_msg(raw_array),
            address=address,
            lanes=tuple(raw_lanes),
        )


def encode(
    message: Hello
    | Welcome
    | HandleRequest
    | HandleReply
    | ErrorReply
    | LeaseClaim
    | LeaseRelease
    | SegmentRelease
    | CopyRequest
    | CopyReply
    | ClaimReply
    | Resync
    | ResyncReply,
) -> bytes:
    """Serialize a broker message (msgpack)."""
    return msgpack.packb(message.to_msg(), use_bin_type=True)


def decode(data: bytes) -> dict[str, Any]:
    """Parse one broker message into a map; :class:`ProtocolError` if it is not one."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable message: {type(e).__name__}: {e}") from None
    return _mapping(msg, "broker message")
