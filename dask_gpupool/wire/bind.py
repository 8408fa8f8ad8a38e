"""Binding a Dask comm to the member at its other end: a challenge and a response under the cluster's token.

A worker that opens a comm to another worker of the registry proves, on that very comm and before Dask uses it,
that it is a member and which worker it is; the worker it connected to proves the same back. Leases are granted
only over a bound comm, to the worker it is bound to, and headers are imported only from replies read on one
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
from typing import Any, ClassVar

from dask_gpupool.errors import ProtocolError
from dask_gpupool.wire.codec import TOKEN_BYTES, as_message, field_of

__all__ = ["BIND_OP", "BindBound", "BindChallenge", "BindHello", "BindProof", "bind_proof"]

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
