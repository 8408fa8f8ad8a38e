"""The broker's lease messages: claims, releases, resyncs, segment releases, forwards and their settling.

An importer claims the leases its imports hold (:class:`LeaseClaim`,
:class:`ClaimReply`), releases them (:class:`LeaseRelease`,
:class:`SegmentRelease`), resends the ones it still holds on a reopened link
(:class:`Resync`, :class:`ResyncReply`) and passes them on to another worker
(:class:`LeaseForward`, :class:`ForwardReply`, :class:`ForwardSettle`). Lease
lists are bounded by :data:`MAX_LEASES_PER_MESSAGE`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dask_gpupool.errors import ProtocolError
from dask_gpupool.wire.codec import as_mapping, as_message, field_of

__all__ = [
    "MAX_LEASES_PER_MESSAGE",
    "ClaimReply",
    "ForwardReply",
    "ForwardSettle",
    "LeaseClaim",
    "LeaseForward",
    "LeaseRelease",
    "Resync",
    "ResyncReply",
    "SegmentRelease",
    "TransferFailed",
]


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
    that said so in its :class:`~dask_gpupool.wire.broker.Hello`). The importer hands a buffer to its
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
    by a :class:`ResyncReply`. ``epoch`` (positive; 0 or absent: not known)
    numbers the importer's snapshots of its leases of this exporter, in
    order: the exporter ignores a resync older than the newest it applied
    from that importer (one sent on a link that broke, read late).
    """

    leases: tuple[int, ...]
    done: bool
    epoch: int = 0
    op: ClassVar[str] = "resync"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "leases": list(self.leases), "done": self.done, "epoch": self.epoch}

    @classmethod
    def from_msg(cls, msg: object) -> Resync:
        what = "lease resync"
        m = as_mapping(msg, what)
        epoch = field_of(m, "epoch", int, what) if "epoch" in m else 0
        if epoch < 0:
            raise ProtocolError(f"{what}: negative epoch")
        return cls(_lease_ids(m, what), field_of(m, "done", bool, what), epoch)


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
    """Importer -> exporter's broker: I closed my imports of these leases (no reply).

    ``unmapped`` (absent: false): I never mapped them (their import failed),
    so the segment claims the exporter noted for them are taken back.
    """

    leases: tuple[int, ...]
    unmapped: bool = False
    op: ClassVar[str] = "lease-release"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "leases": list(self.leases), "unmapped": self.unmapped}

    @classmethod
    def from_msg(cls, msg: object) -> LeaseRelease:
        what = "lease release"
        m = as_mapping(msg, what)
        unmapped = field_of(m, "unmapped", bool, what) if "unmapped" in m else False
        return cls(_lease_ids(m, what), unmapped)


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
    :class:`ForwardReply` or an :class:`~dask_gpupool.wire.broker.ErrorReply` (the lease is not this
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
class TransferFailed:
    """Importer -> exporter's broker: a transfer failed after its leases were claimed (no reply).

    A fill the importer runs after its claims (a copy out of what it mapped)
    failed, so Dask will ask again. Claimed leases do not tell the exporter
    that, so it would hand the same value over again, and a fill that fails
    every time would fail every retry. The exporter sends this importer
    copies for ``gpupool.lease-timeout`` instead (fallback
    ``peer-unreachable``). The leases themselves end as usual, with the
    releases of the imports the importer closed.
    """

    op: ClassVar[str] = "transfer-failed"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op}

    @classmethod
    def from_msg(cls, msg: object) -> TransferFailed:
        as_mapping(msg, "transfer failed")
        return cls()
