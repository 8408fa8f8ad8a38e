"""The broker's fd requests: ``HandleRequest`` for a pool's (or a VMM segment's) fd, and its ``HandleReply``.

The reply announces the fd, which travels in the next message of its own as
SCM_RIGHTS ancillary data; a refusal is an
:class:`~dask_gpupool.wire.broker_hello.ErrorReply`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dask_gpupool.errors import ProtocolError
from dask_gpupool.wire.codec import as_message, field_of, uuid_str

__all__ = ["HandleReply", "HandleRequest"]


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
