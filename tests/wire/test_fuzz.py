"""Property-based fuzzing of everything that crosses a process boundary.

- every wire parser turns any msgpack value into its typed message or a
  :class:`ProtocolError`, never another exception;
- a live broker answers hostile first messages and hostile requests with an
  error reply or a closed connection, and keeps serving its members;
- a live worker's deserializer answers hostile handoff headers with a typed
  error, imports nothing for pools that are not registered to the sender, and
  keeps its resources at baseline.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

import msgpack
import pytest
from conftest import nanny_cluster, worker_addresses
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dask_gpupool
from dask_gpupool import GPUPool, ProtocolError
from dask_gpupool import testing as T
from dask_gpupool.transport.broker import FdBroker
from dask_gpupool.transport.link import request_pool_fd
from dask_gpupool.wire.broker import (
    ClaimReply,
    CopyReply,
    ErrorReply,
    ForwardReply,
    ForwardSettle,
    HandleReply,
    Hello,
    LeaseForward,
    Resync,
    ResyncReply,
    SegmentRelease,
    TransferFailed,
    parse_request,
)
from dask_gpupool.wire.codec import decode, encode
from dask_gpupool.wire.handoff import BufferDescriptor, HandoffHeader, LeaseQuery, LeaseQueryReply
from dask_gpupool.wire.registry import Membership, PoolRecord, RegistryUpdate
from dask_gpupool.wire.stream import PullReply, PullRequest

MiB = 1 << 20
POOL = str(uuid.uuid4())
TOKEN = os.urandom(32)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=40),
    st.binary(max_size=80),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=20,
)
PARSERS = [
    parse_request,
    Hello.from_msg,
    Membership.from_msg,
    PoolRecord.from_msg,
    BufferDescriptor.from_msg,
    HandoffHeader.from_msg,
    RegistryUpdate.from_msg,
    HandleReply.from_msg,
    CopyReply.from_msg,
    ErrorReply.from_msg,
    PullRequest.from_msg,
    PullReply.from_msg,
    ClaimReply.from_msg,
    ResyncReply.from_msg,
    ForwardReply.from_msg,
    LeaseQuery.from_msg,
    LeaseQueryReply.from_msg,
]
VALID = {
    "record": PoolRecord(POOL, "tcp://h:1", 7, "h/b", "h", "device", "GPU-1", MiB, "/tmp/b.sock", ("GPU-1",)).to_msg(),
    "descriptor": BufferDescriptor(POOL, 64, b"\1" * 64, 128, MiB, 3).to_msg(),
    "header": {
        "path": "ipc",
        "kind": "device",
        "nbytes": 64,
        "exporter": "tcp://h:1",
        "lease": 3,
        "ready": "synced",
        "desc": BufferDescriptor(POOL, 64, b"\1" * 64, 0).to_msg(),
        "array": None,
        "address": "",
        "lanes": [],
    },
    "hello": Hello(TOKEN, "tcp://h:2").to_msg(),
    "request": {"op": "pool-handle", "pool": POOL},
    "claim": {"op": "lease-claim", "leases": [3, 1 << 61]},
    "claim-reply": ClaimReply((3,)).to_msg(),
    "resync": Resync((3, 4), True).to_msg(),
    "resync-reply": ResyncReply(2).to_msg(),
    "stream": HandoffHeader("stream", "device", 64, "tcp://h:1", lease=3, address="tcp://h:2").to_msg(),
    "pull": PullRequest(POOL, 3, b"p" * 32, "tcp://h:2").to_msg(),
    "segment-release": SegmentRelease(((3, 2), (4, 1))).to_msg(),
    "forward": LeaseForward(3, "tcp://h:3").to_msg(),
    "forward-reply": ForwardReply(5, 2).to_msg(),
    "forward-settle": ForwardSettle((5, 6)).to_msg(),
    "transfer-failed": TransferFailed().to_msg(),
    "header-by-reply": HandoffHeader(
        "ipc", "device", 64, "tcp://h:1", desc=BufferDescriptor(POOL, 64, b"\1" * 64, 0), lease=3, claim="reply"
    ).to_msg(),
    "lease-query": LeaseQuery("/tmp/b.sock", (3, 1 << 61)).to_msg(),
    "lease-query-reply": LeaseQueryReply((3,)).to_msg(),
}
PARSER_OF = {
    "record": PoolRecord.from_msg,
    "descriptor": BufferDescriptor.from_msg,
    "header": HandoffHeader.from_msg,
    "hello": Hello.from_msg,
    "request": parse_request,
    "stream": HandoffHeader.from_msg,
    "pull": PullRequest.from_msg,
    "segment-release": parse_request,
    "claim": parse_request,
    "claim-reply": ClaimReply.from_msg,
    "resync": parse_request,
    "resync-reply": ResyncReply.from_msg,
    "forward": parse_request,
    "forward-reply": ForwardReply.from_msg,
    "forward-settle": parse_request,
    "transfer-failed": parse_request,
    "header-by-reply": HandoffHeader.from_msg,
    "lease-query": LeaseQuery.from_msg,
    "lease-query-reply": LeaseQueryReply.from_msg,
}


def parses_or_refuses(parser: Any, msg: Any) -> None:
    try:
        parser(msg)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(msg=values)
def test_every_parser_takes_any_value_or_raises_protocol_error(msg):
    for parser in PARSERS:
        parses_or_refuses(parser, msg)


@settings(max_examples=300, deadline=None)
@given(which=st.sampled_from(sorted(VALID)), field=st.text(max_size=10), value=values, drop=st.booleans())
def test_mutated_valid_messages_parse_or_raise_protocol_error(which, field, value, drop):
    msg = dict(VALID[which])
    key = next((k for k in msg if k.startswith(field[:1])), field) if msg else field
    if drop:
        msg.pop(key, None)
    else:
        msg[key] = value
    parses_or_refuses(PARSER_OF[which], msg)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300))
def test_decode_takes_any_bytes_or_raises_protocol_error(data):
    try:
        assert isinstance(decode(data), dict)
    except ProtocolError:
        pass


def test_valid_messages_still_parse():
    for which, msg in VALID.items():
        PARSER_OF[which](msg)


# -- a live broker -------------------------------------------------------------------


@pytest.fixture(scope="module")
def live_broker(tmp_path_factory):
    fd = os.memfd_create("fuzz", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    broker = FdBroker(
        lambda p: (fd, HandleReply(POOL, "host", 4096)) if p == POOL else None,
        str(tmp_path_factory.mktemp("fuzz")),
        0.5,
        POOL,
        TOKEN,
    )
    yield broker
    broker.close()
    os.close(fd)


def _answer(address: str, first: bytes, then: bytes | None) -> list[bytes]:
    """Send ``first`` (and ``then``) on a fresh connection; what came back before the broker stopped talking."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(3)
    got = []
    try:
        s.connect(address)
        s.sendall(first)
        for data in (then,):
            reply = s.recv(70000)
            got.append(reply)
            if not reply or data is None:
                break
            s.sendall(data)
            got.append(s.recv(70000))
    except (ConnectionError, TimeoutError, OSError) as e:
        got.append(type(e).__name__.encode())
    finally:
        s.close()
    return got


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    first=st.one_of(st.binary(max_size=200), values.map(lambda v: msgpack.packb(v, use_bin_type=True))),
    then=st.one_of(st.none(), values.map(lambda v: msgpack.packb(v, use_bin_type=True))),
    member=st.booleans(),
)
def test_live_broker_refuses_hostile_input_and_keeps_serving(live_broker, first, then, member):
    if member:  # a member's connection that then sends garbage
        first = encode(Hello(TOKEN))
    served = live_broker.served
    replies = _answer(live_broker.address, first, then)
    for reply in replies:
        if reply and reply not in (b"ConnectionResetError", b"BrokenPipeError", b"TimeoutError"):
            op = decode(reply).get("op")
            assert op in ("welcome", "error", "pool-handle-ok"), reply
    assert live_broker.served - served <= 1  # only a well-formed member request gets the fd
    _reply, fd = request_pool_fd(live_broker.address, POOL, 5, TOKEN)
    os.close(fd)


# -- a live worker's deserializer ------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    with nanny_cluster([{}, {}], GPUPool(kind="host", max_size="64 MiB")) as c:
        yield c


def headers(pools: list[str], exporters: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    desc = st.fixed_dictionaries(
        {
            "pool": st.sampled_from([*pools, str(uuid.uuid4())]),
            "size": st.integers(min_value=0, max_value=2**40),
            "payload": st.sampled_from([b"", b"\0" * 64, b"x" * 63]),
            "offset": st.integers(min_value=0, max_value=2**40),
            "extent": st.sampled_from([0, 0, MiB, 2**40]),
            "segment": st.sampled_from([0, 0, 1, 2**40]),
        }
    )
    hostile = st.fixed_dictionaries(
        {
            "path": st.sampled_from(["ipc", "ipc", "copy", "smoke"]),
            "kind": st.sampled_from(["host", "device", "pinned"]),
            "nbytes": st.integers(min_value=-1, max_value=2**40),
            "exporter": st.sampled_from([*exporters, "tcp://10.0.0.1:1"]),
            "lease": st.integers(min_value=0, max_value=2**63),
            "ready": st.sampled_from(["synced", "synced", "later"]),
            "desc": st.one_of(st.none(), desc),
            "array": st.none(),
            "address": st.sampled_from(["", "tcp://10.0.0.1:1"]),
            "lanes": st.sampled_from([[], [1], [0]]),
            "claim": st.sampled_from(["broker", "reply", "smoke"]),
        }
    )
    # Well-formed headers that lie: sizes and offsets beyond the pool, unknown leases, another
    # worker's pool, a pool that is nobody's.
    well_formed = st.builds(
        lambda d, exporter, lease: {
            "path": "ipc",
            "kind": "host",
            "nbytes": d["size"],
            "exporter": exporter,
            "lease": lease,
            "ready": "synced",
            "desc": {**d, "payload": b"", "extent": 0, "segment": 0},
            "array": None,
            "address": "",
            "lanes": [],
            # claimed by its reply: read outside a reply from its exporter, the exporter's broker is asked (and
            # refuses a lease it never granted)
            "claim": "reply",
        },
        desc,
        st.sampled_from([*exporters, "tcp://10.0.0.1:1"]),
        st.integers(min_value=1, max_value=2**63),
    )
    return st.one_of(hostile, well_formed, well_formed)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hostile_headers_get_typed_errors_and_import_nothing_unregistered(cluster, data):
    from conftest import back_to, warm_up

    a, b = worker_addresses(cluster)
    pools = [r.pool for r in dask_gpupool.pools(cluster)]
    batch = data.draw(st.lists(headers(pools, [a, b]), min_size=40, max_size=40))
    baseline = warm_up(cluster, a, b)
    outcomes = cluster.run(T.deserialize_headers, batch, workers=[b])[b]
    for header, outcome in zip(batch, outcomes, strict=True):
        assert outcome["error"] is None or outcome["typed"], (header, outcome)
        if outcome["mapped_new"]:  # a pool was mapped: it must be registered to the header's exporter
            assert header["desc"]["pool"] in pools and header["exporter"] in (a, b), (header, outcome)
    back_to(cluster, baseline)
