"""The streamed copy's protocol, on the exporter's copy server (TCP): one pull request per lane.

Messages are length-prefixed msgpack (:mod:`dask_gpupool.transport.staging`
frames them); a refusal is an :class:`~dask_gpupool.wire.broker_hello.ErrorReply`.
The server side is :mod:`dask_gpupool.transport.stream`, the client side
:mod:`dask_gpupool.transport.pull`.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dask_gpupool.config import MAX_COPY_CHUNK
from dask_gpupool.errors import ProtocolError
from dask_gpupool.wire.codec import TOKEN_BYTES, as_message, field_of, uuid_str

__all__ = ["PullReply", "PullRequest", "pull_proof"]


@dataclass(frozen=True)
class PullRequest:
    """Importer -> exporter's copy server: stream me the bytes of leased buffer ``lease``.

    ``proof`` is HMAC-SHA256 of ``pull:<pool>:<lease>`` under the cluster's
    membership token (:func:`pull_proof`): only members
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
        m = as_message(msg, cls.op, what)
        lease = field_of(m, "lease", int, what)
        if lease <= 0:
            raise ProtocolError(f"{what}: lease ids are positive")
        proof = field_of(m, "proof", bytes, what)
        if len(proof) != TOKEN_BYTES:
            raise ProtocolError(f"{what}: proof of {len(proof)} bytes (expected {TOKEN_BYTES})")
        return cls(uuid_str(field_of(m, "pool", str, what), what), lease, proof)


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
        m = as_message(msg, cls.op, what)
        size, chunk = field_of(m, "size", int, what), field_of(m, "chunk", int, what)
        if size < 0 or not 0 < chunk <= MAX_COPY_CHUNK:
            raise ProtocolError(f"{what}: size {size} or chunk {chunk} out of range")
        return cls(field_of(m, "lease", int, what), size, chunk)


def pull_proof(token: bytes, pool: str, lease: int) -> bytes:
    """What a member of the cluster presents to pull lease ``lease`` of ``pool``."""
    return hmac.new(token, f"pull:{pool}:{lease}".encode(), hashlib.sha256).digest()
