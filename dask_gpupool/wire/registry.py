"""The registry's messages, on Dask's own comms: rows, updates, and a worker's membership.

:class:`PoolRecord`, :class:`RegistryUpdate` and :class:`Membership` travel on
each worker's batched stream, both ways (ops in :mod:`dask_gpupool.core`), and
in the answer of the read-only ``gpupool_pools`` RPC.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from dask_gpupool.errors import ProtocolError
from dask_gpupool.wire.codec import TOKEN_BYTES, as_mapping, field_of, uuid_str
from dask_gpupool.wire.stream import copy_server_address

__all__ = ["MAX_RECLAIM", "Membership", "PoolRecord", "RegistryUpdate"]

#: The most segment ids a row's ``reclaim`` may name (a pool reclaims its large buffers' spares, a handful).
MAX_RECLAIM = 1024


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
    reclaim : tuple of int
        Ids of segments retired one by one, at or above ``retire_below``: a
        large buffer's spare segment that peers still map, which the owner
        wants back because its pool is full. Peers treat them as retiring.
        Ascending, at most :data:`MAX_RECLAIM` ids.
    segment_memory : str
        ``device`` pools: what the segments peers map are made of, which says
        what a segment descriptor's payload is: ``"vmm"`` (no payload; the
        segment's fd comes from the broker), ``"legacy"`` (the segment's
        64-byte ``cuIpcGetMemHandle`` handle) or ``"pool"`` (the pool's
        64-byte pointer export; also pools without segments, and the other
        kinds).
    copier : str
        The ``tcp://host:port`` address of the owner's copy server
        (:mod:`dask_gpupool.transport.stream`); ``""`` when it runs none. Importers
        pull streamed copies from this address only, never from one a header names.
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
    reclaim: tuple[int, ...] = ()
    segment_memory: str = "pool"
    copier: str = ""

    KINDS: ClassVar[tuple[str, ...]] = ("device", "pinned", "host")
    SEGMENT_MEMORY: ClassVar[tuple[str, ...]] = ("pool", "vmm", "legacy")

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
            "reclaim": list(self.reclaim),
            "segment_memory": self.segment_memory,
            "copier": self.copier,
        }

    @classmethod
    def from_msg(cls, msg: object) -> PoolRecord:
        what = "pool record"
        m = as_mapping(msg, what)
        kind = field_of(m, "kind", str, what)
        if kind not in cls.KINDS:
            raise ProtocolError(f"{what}: unknown kind {kind!r}")
        devices = field_of(m, "devices", (list, tuple), what)
        peers = field_of(m, "peers", (list, tuple), what)
        if not all(isinstance(d, str) for d in (*devices, *peers)):
            raise ProtocolError(f"{what}: 'devices' and 'peers' must be strings")
        max_size = field_of(m, "max_size", int, what)
        pid = field_of(m, "pid", int, what)
        if max_size <= 0 or pid <= 0:
            raise ProtocolError(f"{what}: 'max_size' and 'pid' must be positive")
        retire_below = field_of(m, "retire_below", int, what)
        if retire_below < 0:
            raise ProtocolError(f"{what}: negative 'retire_below'")
        reclaim = field_of(m, "reclaim", (list, tuple), what) if "reclaim" in m else ()
        if len(reclaim) > MAX_RECLAIM or not all(
            isinstance(i, int) and not isinstance(i, bool) and i > 0 for i in reclaim
        ):
            raise ProtocolError(f"{what}: 'reclaim' must be at most {MAX_RECLAIM} positive segment ids")
        if list(reclaim) != sorted(set(reclaim)):
            raise ProtocolError(f"{what}: 'reclaim' must be ascending, without repeats")
        segment_memory = field_of(m, "segment_memory", str, what) if "segment_memory" in m else "pool"
        if segment_memory not in cls.SEGMENT_MEMORY or (segment_memory != "pool" and kind != "device"):
            raise ProtocolError(f"{what}: segment memory {segment_memory!r} for a {kind} pool")
        copier = field_of(m, "copier", str, what) if "copier" in m else ""
        if copier:
            copy_server_address(copier)  # ProtocolError for anything but tcp://host:port
        return cls(
            pool=uuid_str(field_of(m, "pool", str, what), what),
            worker=field_of(m, "worker", str, what),
            pid=pid,
            host=field_of(m, "host", str, what),
            hostname=field_of(m, "hostname", str, what),
            kind=kind,
            device=field_of(m, "device", (str, type(None)), what),
            max_size=max_size,
            broker=broker_path(field_of(m, "broker", str, what), what),
            devices=tuple(devices),
            peers=tuple(peers),
            retire_below=retire_below,
            reclaim=tuple(reclaim),
            segment_memory=segment_memory,
            copier=copier,
        )


#: The longest path of a Unix socket (``sun_path`` holds 108 bytes with the closing NUL).
MAX_BROKER_PATH = 107


def broker_path(value: str, what: str) -> str:
    """``value`` if it can name a broker's Unix socket: UTF-8, absolute, without NUL, at most
    :data:`MAX_BROKER_PATH` bytes; else :class:`ProtocolError` (a peer's link would fail on it outside the error
    hierarchy).

    A path of bytes that are not UTF-8 (which Python decodes to surrogates) cannot travel in the registry at all:
    msgpack refuses it, and a worker's stream that tried to send such a row broke.
    """
    try:
        nbytes = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ProtocolError(
            f"{what}: broker {value[:120]!r} is not UTF-8; set gpupool.broker-dir (or the temporary directory) "
            "to a directory whose path is"
        ) from None
    if not value.startswith("/") or "\0" in value or nbytes > MAX_BROKER_PATH:
        raise ProtocolError(f"{what}: broker {value[:120]!r} is not an absolute Unix socket path")
    return value


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
        m = as_mapping(msg, what)
        removed = field_of(m, "removed", (list, tuple), what)
        if not all(isinstance(r, str) for r in removed):
            raise ProtocolError(f"{what}: 'removed' must be strings")
        return cls(
            version=field_of(m, "version", int, what),
            added=tuple(PoolRecord.from_msg(r) for r in field_of(m, "added", (list, tuple), what)),
            removed=tuple(uuid_str(r, what) for r in removed),
            snapshot=field_of(m, "snapshot", bool, what),
        )


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
    key : bytes
        This worker's own registry key (:data:`TOKEN_BYTES`), sent like the
        token over its own stream only: its later registry messages
        (``gpupool-joined``, ``gpupool-update``, ``gpupool-unregister``) carry
        it, so that another worker naming this one's address in a message of
        its own stream cannot act as it (Dask lets a message's keys override
        the ``worker=`` it adds). Empty only where no scheduler made it (tests).
    """

    snapshot: RegistryUpdate
    token: bytes = field(repr=False)
    key: bytes = field(default=b"", repr=False)

    def to_msg(self) -> dict[str, Any]:
        return {"snapshot": self.snapshot.to_msg(), "token": self.token, "key": self.key}

    @classmethod
    def from_msg(cls, msg: object) -> Membership:
        what = "registration reply"
        m = as_mapping(msg, what)
        token = field_of(m, "token", bytes, what)
        if len(token) != TOKEN_BYTES:
            raise ProtocolError(f"{what}: token of {len(token)} bytes (expected {TOKEN_BYTES})")
        key = field_of(m, "key", bytes, what)
        if len(key) != TOKEN_BYTES:
            raise ProtocolError(f"{what}: key of {len(key)} bytes (expected {TOKEN_BYTES})")
        return cls(RegistryUpdate.from_msg(field_of(m, "snapshot", dict, what)), token, key)
