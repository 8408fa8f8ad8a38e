"""The broker's copy messages: ``CopyRequest`` for a host copy of a leased buffer, and its ``CopyReply``.

The fallback when importing failed: the reply announces a memfd holding the
bytes, sent in the next message as SCM_RIGHTS ancillary data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dask_gpupool.errors import ProtocolError
from dask_gpupool.wire.codec import as_mapping, as_message, field_of

__all__ = ["CopyReply", "CopyRequest"]


@dataclass(frozen=True)
class CopyRequest:
    """Importer -> exporter's broker: send me a host copy of leased buffer ``lease``.

    The fallback when importing failed. Answered by a :class:`CopyReply` and a
    memfd holding the bytes, or an :class:`~dask_gpupool.wire.broker_hello.ErrorReply`.
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
