"""What a handed-over value looks like in a Dask message: :class:`HandoffHeader`, and what it points at.

The header is the sub-header of a Buffer or array in the frames of Dask's
serialization: the path (``ipc``, ``stream``, ``copy``), the exporter,
the lease, a :class:`BufferDescriptor` of the memory and the
:class:`ArrayMeta` of an array view.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from dask_gpupool.errors import ProtocolError
from dask_gpupool.wire.broker_leases import _lease_ids
from dask_gpupool.wire.codec import as_mapping, field_of, uuid_str
from dask_gpupool.wire.registry import PoolRecord
from dask_gpupool.wire.stream import copy_server_address

__all__ = [
    "COPIED_KEY",
    "HEADER_KEY",
    "LEASE_QUERY_OP",
    "MAX_LANES",
    "ArrayMeta",
    "BufferDescriptor",
    "HandoffHeader",
    "LeaseQuery",
    "LeaseQueryReply",
]

#: The key of a handed-over value's sub-header in Dask's serialization header: ``{HEADER_KEY: HandoffHeader.to_msg()}``.
HEADER_KEY = "gpupool"

#: The key, in the header of a value a worker's ``get_data`` reply sends in distributed's own frames (a plain array,
#: a pickled object), of the bytes the sender counted in ``copied_out_bytes``: the receiving worker counts them in
#: ``copied_bytes``. Distributed's deserializers ignore it.
COPIED_KEY = "gpupool-copied"

#: Most connections (lanes) one streamed copy is pulled over.
MAX_LANES = 16


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
        m = as_mapping(msg, what)
        payload = field_of(m, "payload", bytes, what)
        if len(payload) not in (0, cls.PAYLOAD_BYTES):
            raise ProtocolError(f"{what}: payload of {len(payload)} bytes (expected 0 or {cls.PAYLOAD_BYTES})")
        size = field_of(m, "size", int, what)
        offset = field_of(m, "offset", int, what)
        extent = field_of(m, "extent", int, what)
        if size < 0 or offset < 0 or extent < 0:
            raise ProtocolError(f"{what}: negative size, offset or extent")
        if extent and offset + size > extent:
            raise ProtocolError(f"{what}: {size} bytes at offset {offset} do not fit a segment of {extent} bytes")
        segment = field_of(m, "segment", int, what)
        if segment < 0 or bool(segment) != bool(extent):
            raise ProtocolError(f"{what}: segment id {segment} with extent {extent} (both set, or neither)")
        return cls(
            pool=uuid_str(field_of(m, "pool", str, what), what),
            size=size,
            payload=payload,
            offset=offset,
            extent=extent,
            segment=segment,
        )


#: ``numpy.dtype.str`` of a plain dtype: byte order, kind (never ``O``, Python objects), item size, a datetime unit.
_PLAIN_DTYPE = re.compile(r"[<>|][biufcmMSUV][0-9]{1,9}(\[[0-9]{0,9}[a-zA-Z]{1,2}\])?")


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
        m = as_mapping(msg, what)
        module = field_of(m, "module", str, what)
        if module not in cls.MODULES:
            raise ProtocolError(f"{what}: unknown array module {module!r}")
        shape = field_of(m, "shape", (list, tuple), what)
        strides = field_of(m, "strides", (list, tuple), what)
        if len(shape) != len(strides) or len(shape) > 64:
            raise ProtocolError(f"{what}: shape and strides differ in length or exceed 64 dimensions")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (*shape, *strides)):
            raise ProtocolError(f"{what}: shape and strides must be integers")
        if any(x < 0 for x in shape):
            raise ProtocolError(f"{what}: negative extent")
        dtype = field_of(m, "dtype", str, what)
        if not _PLAIN_DTYPE.fullmatch(dtype):
            raise ProtocolError(f"{what}: dtype {dtype!r} is not a plain dtype")
        offset = field_of(m, "offset", int, what)
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
    claim : str
        ``ipc`` only: how the importer claims the lease. ``"reply"`` (what an
        exporter's own buffers carry): it holds the lease once it has
        deserialized the header, and the reply's "OK" tells the exporter
        (:mod:`dask_gpupool.handoff.leases`). ``"broker"`` (also when the
        field is absent; a forwarded value's lease): over the exporter's
        broker, and it reads only after the answer.

    The message also carries ``"ready": "synced"``: the work that wrote the
    buffer had finished before the header was sent (its task's event, the
    staging copy's stream, or the GPU); any other value is refused.
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
    array: ArrayMeta | None = None
    address: str = ""
    lanes: tuple[int, ...] = ()
    claim: str = "broker"

    PATHS: ClassVar[tuple[str, ...]] = ("ipc", "copy", "stream")
    READY: ClassVar[str] = "synced"
    CLAIMS: ClassVar[tuple[str, ...]] = ("broker", "reply")

    def to_msg(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "kind": self.kind,
            "nbytes": self.nbytes,
            "exporter": self.exporter,
            "desc": None if self.desc is None else self.desc.to_msg(),
            "lease": self.lease,
            "ready": self.READY,
            "array": None if self.array is None else self.array.to_msg(),
            "address": self.address,
            "lanes": list(self.lanes),
            "claim": self.claim,
        }

    @classmethod
    def from_msg(cls, msg: object) -> HandoffHeader:
        what = "handoff header"
        m = as_mapping(msg, what)
        path = field_of(m, "path", str, what)
        if path not in cls.PATHS:
            raise ProtocolError(f"{what}: unknown path {path!r}")
        kind = field_of(m, "kind", str, what)
        if kind not in PoolRecord.KINDS:
            raise ProtocolError(f"{what}: unknown kind {kind!r}")
        nbytes = field_of(m, "nbytes", int, what)
        lease = field_of(m, "lease", int, what)
        if nbytes < 0 or lease < 0:
            raise ProtocolError(f"{what}: negative nbytes or lease")
        ready = field_of(m, "ready", str, what)
        if ready != cls.READY:
            raise ProtocolError(f"{what}: unknown readiness {ready!r}")
        raw_desc = field_of(m, "desc", (dict, type(None)), what)
        desc = None if raw_desc is None else BufferDescriptor.from_msg(raw_desc)
        if path == "ipc" and (desc is None or lease == 0):
            raise ProtocolError(f"{what}: an ipc handoff needs a descriptor and a lease")
        address = field_of(m, "address", str, what)
        if path == "stream":
            needs = f"{what}: a stream handoff needs a lease and a tcp://host:port address"
            try:
                copy_server_address(address)  # what the importer connects to, as it stands
            except ProtocolError as e:
                raise ProtocolError(f"{needs}: {e}") from None
            if lease == 0:
                raise ProtocolError(needs)
        raw_lanes = field_of(m, "lanes", (list, tuple), what)
        if len(raw_lanes) >= MAX_LANES or not all(
            isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in raw_lanes
        ):
            raise ProtocolError(f"{what}: lanes must be fewer than {MAX_LANES} positive lease ids")
        if raw_lanes and path != "stream":
            raise ProtocolError(f"{what}: only a stream handoff has lanes")
        if desc is not None and desc.size != nbytes:
            raise ProtocolError(f"{what}: descriptor size {desc.size} differs from nbytes {nbytes}")
        claim = field_of(m, "claim", str, what) if "claim" in m else "broker"
        if claim not in cls.CLAIMS:
            raise ProtocolError(f"{what}: unknown claim {claim!r}")
        if claim == "reply" and path != "ipc":
            raise ProtocolError(f"{what}: only an ipc handoff is claimed by reply")
        raw_array = field_of(m, "array", (dict, type(None)), what)
        return cls(
            path=path,
            kind=kind,
            nbytes=nbytes,
            exporter=field_of(m, "exporter", str, what),
            desc=desc,
            lease=lease,
            array=None if raw_array is None else ArrayMeta.from_msg(raw_array),
            address=address,
            lanes=tuple(raw_lanes),
            claim=claim,
        )


#: The worker handler an exporter calls, over Dask's comm, to ask an importer which leases of a failed reply it holds.
LEASE_QUERY_OP = "gpupool_lease_query"


@dataclass(frozen=True)
class LeaseQuery:
    """Exporter → importer (Dask's comm): which of these leases, sent in a reply that failed, do you hold?

    Only leases claimed by the reply (``claim="reply"`` in their header) are
    asked about. Answering refuses the others for good
    (:meth:`HeldLeases.answer <dask_gpupool.handoff.held.HeldLeases.answer>`).

    Attributes
    ----------
    exporter : str
        The exporter's broker address, as the importer's registry row names it.
    leases : tuple of int
        At most :data:`~dask_gpupool.wire.broker_leases.MAX_LEASES_PER_MESSAGE` ids.
    """

    exporter: str
    leases: tuple[int, ...]

    def to_msg(self) -> dict[str, Any]:
        return {"exporter": self.exporter, "leases": list(self.leases)}

    @classmethod
    def from_msg(cls, msg: object) -> LeaseQuery:
        what = "lease query"
        m = as_mapping(msg, what)
        exporter = field_of(m, "exporter", str, what)
        if not exporter or len(exporter) > 4096:
            raise ProtocolError(f"{what}: the exporter's broker address is empty or too long")
        return cls(exporter, _lease_ids(m, what))


@dataclass(frozen=True)
class LeaseQueryReply:
    """Importer → exporter: the queried leases it holds (the others it refused for good)."""

    held: tuple[int, ...]

    def to_msg(self) -> dict[str, Any]:
        return {"leases": list(self.held)}

    @classmethod
    def from_msg(cls, msg: object) -> LeaseQueryReply:
        return cls(_lease_ids(as_mapping(msg, "lease query reply"), "lease query reply"))
