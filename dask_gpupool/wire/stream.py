"""The streamed copy's protocol, on the exporter's copy server (TCP): one pull request per lane.

Messages are length-prefixed msgpack (:mod:`dask_gpupool.transport.staging`
frames them); a refusal is an :class:`~dask_gpupool.wire.broker.ErrorReply`.
The server side is :mod:`dask_gpupool.transport.stream`, the client side
:mod:`dask_gpupool.transport.pull`.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dask_gpupool.errors import ProtocolError
from dask_gpupool.wire.codec import TOKEN_BYTES, as_message, field_of, uuid_str

__all__ = ["MAX_COPY_CHUNK", "MAX_REQUESTER", "PullReply", "PullRequest", "copy_server_address", "pull_proof"]

#: The largest chunk an importer takes from a copy server's :class:`PullReply`: each lane stages two chunks in
#: pinned or vkgdr memory, so a peer's chunk is bounded (this package's servers send
#: :data:`~dask_gpupool.tuning.COPY_CHUNK_SIZE`).
MAX_COPY_CHUNK = 1 << 30

#: The longest requester (a worker address) a pull request names.
MAX_REQUESTER = 512


@dataclass(frozen=True)
class PullRequest:
    """Importer -> exporter's copy server: stream me, worker ``requester``, the bytes of leased buffer ``lease``.

    ``proof`` is HMAC-SHA256 under the cluster's membership token of the copy
    server's address, the pool, the lease and the requester (:func:`pull_proof`):
    only members of the cluster can make one, and it is worth nothing at another
    server, for another lease, or for another worker than the one granted it.
    """

    pool: str
    lease: int
    proof: bytes = field(repr=False)
    requester: str
    op: ClassVar[str] = "pull"

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, "pool": self.pool, "lease": self.lease, "proof": self.proof, "requester": self.requester}

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
        requester = field_of(m, "requester", str, what)
        if not requester or len(requester) > MAX_REQUESTER:
            raise ProtocolError(f"{what}: a requester of {len(requester)} characters")
        return cls(uuid_str(field_of(m, "pool", str, what), what), lease, proof, requester)


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


def pull_proof(token: bytes, address: str, pool: str, lease: int, requester: str) -> bytes:
    """What worker ``requester``, a member of the cluster, presents to the copy server at ``address`` to pull
    lease ``lease`` of ``pool``."""
    return hmac.new(token, f"pull:{address}:{pool}:{lease}:{requester}".encode(), hashlib.sha256).digest()


def copy_server_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of a copy server's ``tcp://host:port`` address; :class:`ProtocolError` for anything else.

    The port is 1 to 65535 in ASCII digits: a larger one is not refused by the
    resolver but wrapped to another port (65536 + p reaches port p), and
    ``str.isdigit`` takes digits that ``int`` does not. An IPv6 host is in
    brackets (``tcp://[::1]:40000``), which are taken off.
    """
    host, _, port = address[len("tcp://") :].rpartition(":") if address.startswith("tcp://") else ("", "", "")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 1 << 16:
        raise ProtocolError(f"copy server address {address!r} is not tcp://host:port")
    return host, int(port)
