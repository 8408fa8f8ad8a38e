"""What every typed message shares: field checks for ``from_msg`` and the broker's length-limited msgpack codec.

Everything dask_gpupool sends between processes is a frozen dataclass turned
into a msgpack-safe ``dict`` by ``to_msg()`` and checked field by field by
``from_msg()``, which raises :class:`ProtocolError` on anything else.
Nothing is ever pickled on the wire.
"""

from __future__ import annotations

import uuid
from typing import Any, Protocol

import msgpack

from dask_gpupool.errors import ProtocolError

__all__ = ["MAX_MESSAGE_BYTES", "TOKEN_BYTES", "as_mapping", "as_message", "decode", "encode", "field_of", "uuid_str"]


#: Largest broker message accepted; anything bigger is malformed.
MAX_MESSAGE_BYTES = 64 * 1024

#: Bytes of a cluster membership token.
TOKEN_BYTES = 32


def field_of(msg: dict[str, Any], name: str, types: type | tuple[type, ...], what: str) -> Any:
    try:
        value = msg[name]
    except KeyError:
        raise ProtocolError(f"{what}: missing field {name!r}") from None
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ProtocolError(f"{what}: field {name!r} has type bool")
    if not isinstance(value, types):
        raise ProtocolError(f"{what}: field {name!r} has type {type(value).__name__}")
    return value


def uuid_str(value: str, what: str) -> str:
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise ProtocolError(f"{what}: {value!r} is not a UUID") from None


def as_mapping(msg: object, what: str) -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise ProtocolError(f"{what}: expected a map, got {type(msg).__name__}")
    return msg


def as_message(msg: object, op: str, what: str) -> dict[str, Any]:
    """``msg`` as a map whose ``op`` is ``op``."""
    m = as_mapping(msg, what)
    if m.get("op") != op:
        raise ProtocolError(f"{what}: expected op {op!r}, got {m.get('op')!r}")
    return m


class Encodable(Protocol):
    """A typed message: what :func:`encode` takes."""

    def to_msg(self) -> dict[str, Any]: ...


def encode(message: Encodable) -> bytes:
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
    return as_mapping(msg, "broker message")
