"""A broker connection's opening and refusals: ``Hello``, ``Welcome``, and the ``ErrorReply`` of any request.

Every broker connection starts with a :class:`Hello` (the cluster's token and
who is asking), answered by a :class:`Welcome` or an :class:`ErrorReply`. Any
later request may be refused with an :class:`ErrorReply` too, and the streamed
copy's server (:mod:`dask_gpupool.wire.stream`) refuses pulls with it;
:func:`raise_for_error` turns one back into its exception.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from dask_gpupool import errors as _errors
from dask_gpupool.errors import ProtocolError
from dask_gpupool.wire.codec import TOKEN_BYTES, as_mapping, as_message, field_of

__all__ = ["ErrorReply", "Hello", "Welcome", "raise_for_error"]


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
