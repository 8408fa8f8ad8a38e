from __future__ import annotations

import dataclasses
import uuid

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_gpupool import BrokerRefusedError, ProtocolError, UnknownPoolError
from dask_gpupool.wire.broker import (
    ErrorReply,
    ForwardReply,
    ForwardSettle,
    HandleReply,
    HandleRequest,
    LeaseForward,
    SegmentRelease,
    TransferFailed,
    parse_request,
    raise_for_error,
)
from dask_gpupool.wire.codec import MAX_MESSAGE_BYTES, decode, encode
from dask_gpupool.wire.handoff import ArrayMeta, BufferDescriptor, HandoffHeader, LeaseQuery, LeaseQueryReply
from dask_gpupool.wire.registry import PoolRecord, RegistryUpdate
from dask_gpupool.wire.stream import PullReply, PullRequest

POOL = str(uuid.uuid4())
RECORD = PoolRecord(
    POOL, "tcp://1.2.3.4:5", 42, "h/boot", "h", "device", "GPU-1", 1 << 30, "/tmp/x/broker.sock", ("GPU-1", "GPU-2")
)
RECORD = dataclasses.replace(RECORD, peers=("GPU-2",))


def wire(msg):
    """What a message looks like after a real trip through msgpack."""
    return msgpack.unpackb(msgpack.packb(msg, use_bin_type=True), raw=False)


def test_records_and_updates_round_trip_through_msgpack():
    assert PoolRecord.from_msg(wire(RECORD.to_msg())) == RECORD
    update = RegistryUpdate(7, added=(RECORD,), removed=(str(uuid.uuid4()),), snapshot=True)
    assert RegistryUpdate.from_msg(wire(update.to_msg())) == update
    desc = BufferDescriptor(POOL, 100, b"\1" * 64, 0)
    assert BufferDescriptor.from_msg(wire(desc.to_msg())) == desc
    in_segment = BufferDescriptor(POOL, 100, b"\1" * 64, 4096, 1 << 30, 7)
    assert BufferDescriptor.from_msg(wire(in_segment.to_msg())) == in_segment
    retired = dataclasses.replace(RECORD, retire_below=5, reclaim=(7, 9))
    assert PoolRecord.from_msg(wire(retired.to_msg())) == retired
    older = {k: v for k, v in RECORD.to_msg().items() if k != "reclaim"}  # a row without the field: none
    assert PoolRecord.from_msg(wire(older)) == RECORD
    for made_of in ("vmm", "legacy"):  # what a device pool's segment payloads are
        row = dataclasses.replace(RECORD, segment_memory=made_of)
        assert PoolRecord.from_msg(wire(row.to_msg())) == row
    older = {k: v for k, v in RECORD.to_msg().items() if k != "segment_memory"}  # without the field: pool memory
    assert PoolRecord.from_msg(wire(older)).segment_memory == "pool"
    release = SegmentRelease(((7, 3), (8, 1)))
    assert parse_request(wire(release.to_msg())) == release


@pytest.mark.parametrize(
    "segments",
    [[[0, 1]], [[1, -1]], [[1]], [[1, 2, 3]], [[True, 1]], [["1", 1]], "1,1", [[1, 1]] * 4097],
)
def test_malformed_segment_release_is_a_protocol_error(segments):
    with pytest.raises(ProtocolError, match="segment release"):
        parse_request({"op": "segment-release", "segments": segments})


def test_broker_messages_round_trip():
    for m in (
        HandleRequest(POOL),
        HandleReply(POOL, "host", 10),
        HandleRequest(POOL, 3),
        HandleReply(POOL, "device", 10, 3),
    ):
        assert type(m).from_msg(decode(encode(m))) == m
    # a peer of the previous release sends no segment: it asks for the pool's handle
    assert HandleRequest.from_msg({"op": "pool-handle", "pool": POOL}) == HandleRequest(POOL)
    for bad in ({"segment": -1}, {"segment": "1"}):
        with pytest.raises(ProtocolError):
            HandleRequest.from_msg({**HandleRequest(POOL).to_msg(), **bad})
    with pytest.raises(ProtocolError, match="negative"):
        HandleReply.from_msg({**HandleReply(POOL, "device", 10, 3).to_msg(), "segment": -2})


def test_forward_messages_round_trip_and_refuse_bad_fields():
    for m in (LeaseForward(3, "tcp://h:3"), ForwardReply(5, 2), ForwardSettle((5, 6))):
        assert type(m).from_msg(decode(encode(m))) == m
    assert parse_request(LeaseForward(3, "tcp://h:3").to_msg()) == LeaseForward(3, "tcp://h:3")
    assert parse_request(ForwardSettle((7,)).to_msg()) == ForwardSettle((7,))
    assert parse_request(wire(TransferFailed().to_msg())) == TransferFailed()
    for bad in ({"lease": 0}, {"lease": -1}, {"to": ""}, {"to": "x" * 1025}, {"to": 3}, {"lease": True}):
        with pytest.raises(ProtocolError):
            LeaseForward.from_msg({**LeaseForward(3, "tcp://h:3").to_msg(), **bad})
    for bad in ({"lease": 0}, {"segment": -1}):
        with pytest.raises(ProtocolError):
            ForwardReply.from_msg({**ForwardReply(5, 2).to_msg(), **bad})
    with pytest.raises(ProtocolError):
        ForwardSettle.from_msg({"op": "forward-settle", "leases": [0]})


def test_a_vmm_segment_descriptor_carries_no_payload():
    """A segment of VMM memory is named by its id: the peer fetches its fd from the owner's broker."""
    desc = BufferDescriptor(POOL, 8, b"", 4096, 1 << 21, 3)
    assert BufferDescriptor.from_msg(wire(desc.to_msg())) == desc
    with pytest.raises(ProtocolError, match="do not fit"):
        BufferDescriptor.from_msg({**desc.to_msg(), "offset": 1 << 21})


def test_an_ipc_header_says_its_gpu_work_finished_before_it_went_out():
    """``ready: synced``: the work that wrote the buffer had finished before the header went out; nothing else is
    read (a header whose memory may still be written is refused)."""
    desc = BufferDescriptor(POOL, 8, b"", 4096, 1 << 21, 3)
    header = HandoffHeader("ipc", "device", 8, "tcp://h:1", desc=desc, lease=7)
    assert header.to_msg()["ready"] == "synced"
    assert HandoffHeader.from_msg(wire(header.to_msg())) == header
    for ready in ("later", "claim"):
        with pytest.raises(ProtocolError, match=f"unknown readiness '{ready}'"):
            HandoffHeader.from_msg({**header.to_msg(), "ready": ready})


def test_an_ipc_header_says_how_its_lease_is_claimed_and_old_headers_mean_the_broker():
    """``broker``: a claim round trip before reading; ``reply``: held once deserialized (only ipc handoffs)."""
    desc = BufferDescriptor(POOL, 8, b"", 4096, 1 << 21, 3)
    header = HandoffHeader("ipc", "device", 8, "tcp://h:1", desc=desc, lease=7, claim="reply")
    assert HandoffHeader.from_msg(wire(header.to_msg())) == header
    old = {k: v for k, v in header.to_msg().items() if k != "claim"}
    assert HandoffHeader.from_msg(old).claim == "broker"
    with pytest.raises(ProtocolError, match="unknown claim 'later'"):
        HandoffHeader.from_msg({**header.to_msg(), "claim": "later"})
    stream = HandoffHeader("stream", "device", 8, "tcp://h:1", lease=7, address="tcp://h:2")
    with pytest.raises(ProtocolError, match="claimed by reply"):
        HandoffHeader.from_msg({**stream.to_msg(), "claim": "reply"})


def test_releases_say_unmapped_and_resyncs_carry_their_snapshot_number_absent_fields_keep_the_old_meaning():
    from dask_gpupool.wire.broker_leases import LeaseRelease, Resync

    for m in (LeaseRelease((3, 4), True), Resync((3,), True, 1 << 62)):
        assert type(m).from_msg(wire(m.to_msg())) == m
    assert LeaseRelease.from_msg({"op": "lease-release", "leases": [3]}) == LeaseRelease((3,), False)
    assert Resync.from_msg({"op": "resync", "leases": [], "done": True}).epoch == 0
    with pytest.raises(ProtocolError, match="negative epoch"):
        Resync.from_msg({"op": "resync", "leases": [], "done": True, "epoch": -1})
    with pytest.raises(ProtocolError):
        LeaseRelease.from_msg({"op": "lease-release", "leases": [3], "unmapped": "yes"})


def test_lease_queries_round_trip_and_refuse_bad_fields():
    query = LeaseQuery("/run/gpupool/b.sock", (3, 1 << 61))
    assert LeaseQuery.from_msg(wire(query.to_msg())) == query
    assert LeaseQueryReply.from_msg(wire(LeaseQueryReply((3,)).to_msg())) == LeaseQueryReply((3,))
    for bad in ({"exporter": "", "leases": [1]}, {"exporter": "x", "leases": [0]}, {"exporter": "x", "leases": "1"}):
        with pytest.raises(ProtocolError):
            LeaseQuery.from_msg(bad)
    with pytest.raises(ProtocolError, match="at most"):
        LeaseQuery.from_msg({"exporter": "x", "leases": list(range(1, 5000))})


def test_copy_path_messages_round_trip_and_refuse_bad_fields():
    for m in (PullRequest(POOL, 9, b"p" * 32, "tcp://h:2"), PullReply(9, 1 << 30, 16 << 20)):
        assert type(m).from_msg(wire(m.to_msg())) == m
    header = HandoffHeader("stream", "device", 64, "tcp://h:1", lease=3, address="tcp://h:2", lanes=(4, 5))
    assert HandoffHeader.from_msg(wire(header.to_msg())) == header
    for bad in ({"lease": 0}, {"address": ""}, {"address": "ucx://h:2"}):
        with pytest.raises(ProtocolError, match="stream handoff needs"):
            HandoffHeader.from_msg({**header.to_msg(), **bad})
    for lanes in ([0], [True], ["4"], list(range(1, 17))):
        with pytest.raises(ProtocolError, match="lanes must be"):
            HandoffHeader.from_msg({**header.to_msg(), "lanes": lanes})
    for missing in ("address", "lanes"):
        with pytest.raises(ProtocolError, match=f"missing field '{missing}'"):
            HandoffHeader.from_msg({k: v for k, v in header.to_msg().items() if k != missing})
    with pytest.raises(ProtocolError, match="only a stream handoff has lanes"):
        HandoffHeader.from_msg({**header.to_msg(), "path": "copy"})
    with pytest.raises(ProtocolError, match="proof of 3 bytes"):
        PullRequest.from_msg({**PullRequest(POOL, 9, b"p" * 32, "tcp://h:2").to_msg(), "proof": b"abc"})
    with pytest.raises(ProtocolError, match="lease ids are positive"):
        PullRequest.from_msg({**PullRequest(POOL, 9, b"p" * 32, "tcp://h:2").to_msg(), "lease": -1})
    with pytest.raises(ProtocolError, match="out of range"):
        PullReply.from_msg({**PullReply(9, 10, 16).to_msg(), "chunk": 0})
    with pytest.raises(ProtocolError, match="out of range"):  # a peer cannot make the importer pin without bound
        PullReply.from_msg({**PullReply(9, 10, 16).to_msg(), "chunk": (1 << 30) + 1})
    assert PullReply.from_msg(PullReply(9, 10, 1 << 30).to_msg()).chunk == 1 << 30


@pytest.mark.parametrize(
    "change",
    [
        {"pool": "not-a-uuid"},
        {"kind": "gpu"},
        {"pid": "42"},
        {"pid": True},
        {"max_size": -1},
        {"devices": [1]},
        {"peers": [None]},
        {"peers": "GPU-2"},
        {"device": 3},
        {"retire_below": -1},
        {"retire_below": "1"},
        {"reclaim": [0]},
        {"reclaim": [True]},
        {"reclaim": ["3"]},
        {"reclaim": [5, 3]},
        {"reclaim": [3, 3]},
        {"reclaim": "3"},
        {"reclaim": list(range(1, 1026))},
        {"segment_memory": "cuda"},
        {"segment_memory": 1},
        {"segment_memory": "legacy", "kind": "host", "device": None},  # segments are device memory
        # a broker path a Unix socket cannot have: a peer's link raised a bare ValueError from os.lstat for a NUL
        {"broker": "/tmp/x/bro\0ker.sock"},
        {"broker": "relative/broker.sock"},
        {"broker": ""},
        {"broker": "/tmp/" + "x" * 200 + "/broker.sock"},
        # a path of bytes that are not UTF-8 (decoded with surrogates): Dask's msgpack cannot send the row at all
        {"broker": "/tmp/caf\udce9/broker.sock"},
    ],
)
def test_malformed_record_is_a_protocol_error(change):
    with pytest.raises(ProtocolError, match="pool record"):
        PoolRecord.from_msg({**RECORD.to_msg(), **change})


@pytest.mark.parametrize(
    "msg",
    [
        {"pool": POOL, "size": 1, "payload": b"\0" * 63, "offset": 0},
        {"pool": POOL, "size": -1, "payload": b"", "offset": 0},
        {"pool": POOL, "size": 1, "payload": "text", "offset": 0},
        {"pool": POOL, "size": 1, "payload": b""},
        {"pool": POOL, "size": 8, "payload": b"\0" * 64, "offset": 4, "extent": 8},
        {"pool": POOL, "size": 8, "payload": b"", "offset": 0, "extent": 8},
        {"pool": POOL, "size": 8, "payload": b"\0" * 64, "offset": 0, "extent": -1},
        {"pool": POOL, "size": 8, "payload": b"\0" * 64, "offset": 0, "extent": 8, "segment": 0},
        {"pool": POOL, "size": 8, "payload": b"\0" * 64, "offset": 0, "extent": 0, "segment": 2},
        {"pool": POOL, "size": 8, "payload": b"\0" * 64, "offset": 0, "extent": 8, "segment": -1},
        [POOL, 1],
    ],
)
def test_malformed_descriptor_is_a_protocol_error(msg):
    with pytest.raises(ProtocolError):
        BufferDescriptor.from_msg(msg)


@pytest.mark.parametrize("dtype", ["object", "zz", "|O", "<f", "f8", "<f8 ", "<M8[ns", "", "<" + "f" * 15])
def test_an_array_header_takes_only_plain_dtype_strings(dtype):
    """``numpy.dtype.str`` of a plain dtype (byte order, kind, item size, a datetime unit); anything else, Python
    objects above all, is a ProtocolError before NumPy or CuPy sees it."""
    meta = {"module": "numpy", "shape": [2], "strides": [8], "dtype": dtype, "offset": 0}
    with pytest.raises(ProtocolError, match="not a plain dtype"):
        ArrayMeta.from_msg(meta)


@pytest.mark.parametrize("dtype", ["<f8", "|b1", "<c16", "<M8[ns]", "<m8[s]", "|V16", "<U5", "|S3", ">i2", "|u1"])
def test_an_array_header_round_trips_plain_dtypes(dtype):
    meta = ArrayMeta("numpy", (2,), (8,), dtype)
    assert ArrayMeta.from_msg(meta.to_msg()) == meta


def test_decode_refuses_garbage_and_oversized_messages():
    with pytest.raises(ProtocolError, match="undecodable"):
        decode(b"\xc1\xc1")
    with pytest.raises(ProtocolError, match="expected a map"):
        decode(msgpack.packb([1, 2]))
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(b"\0" * (MAX_MESSAGE_BYTES + 1))


def test_error_replies_raise_our_types_only():
    with pytest.raises(UnknownPoolError, match="ctx: gone"):
        raise_for_error(ErrorReply("UnknownPoolError", "gone").to_msg(), "ctx")
    with pytest.raises(BrokerRefusedError):
        raise_for_error(ErrorReply("SystemExit", "ha").to_msg(), "ctx")
    raise_for_error(HandleReply(POOL, "host", 1).to_msg(), "ctx")  # not an error: no raise


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_decode_or_raise_protocol_error(data):
    try:
        msg = decode(data)
    except ProtocolError:
        return
    for cls in (HandleRequest, HandleReply, PoolRecord, RegistryUpdate, BufferDescriptor):
        try:
            cls.from_msg(msg)
        except ProtocolError:
            pass


@pytest.mark.parametrize(
    "address",
    [
        "tcp://h:99999",  # over 65535: the resolver wraps it to another port (34463) instead of refusing
        "tcp://h:65536",
        "tcp://h:0",
        "tcp://h:\u00b2",  # str.isdigit() says yes, int() says no
        "tcp://h:",
        "tcp://:2",
        "tcp://[]:2",
        "tcp://h:+2",
        "tcp://h: 2",
    ],
)
def test_a_stream_header_refuses_a_copy_server_address_that_is_not_host_and_port(address):
    """The importer pulls from ``address``: one it cannot connect to as it stands is malformed at decode time."""
    header = HandoffHeader("stream", "host", 64, "tcp://h:1", lease=3, address="tcp://h:2")
    with pytest.raises(ProtocolError, match="stream handoff needs"):
        HandoffHeader.from_msg({**header.to_msg(), "address": address})
    for good in ("tcp://h:1", "tcp://h:65535", "tcp://[::1]:2", "tcp://10.0.0.1:40000"):
        assert HandoffHeader.from_msg({**header.to_msg(), "address": good}).address == good
