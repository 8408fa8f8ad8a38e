"""A pull proof is bound to the copy server, the pool, the lease and the requester (runs in CI, no GPU).

A proof captured by a process that made a member connect to it (or read off the wire) is worth nothing at the real
copy server, and a lease is served only to the worker it was granted to.
"""

from __future__ import annotations

import socket
import struct
import uuid

import msgpack
import pytest
from conftest import no_fd_leak  # noqa: F401  (fixture)

from dask_gpupool import DataLostError, NotAMemberError
from dask_gpupool.handoff.leases import LeaseTable
from dask_gpupool.memory.buffers import host_buffer
from dask_gpupool.testing import read_bytes
from dask_gpupool.transport.pull import pull
from dask_gpupool.transport.stream import CopyServer, Staged
from dask_gpupool.wire.stream import pull_proof

POOL = str(uuid.uuid4())
TOKEN = b"t" * 32
CHUNK = 1 << 16
IMPORTER = "tcp://importer:1"


@pytest.fixture
def served(no_fd_leak):  # noqa: F811
    leases = LeaseTable(60.0)
    srv = CopyServer(POOL, leases, "127.0.0.1", 5.0, CHUNK)
    srv.token = TOKEN
    buf = host_buffer(bytearray(b"leased bytes"))
    lease = leases.grant(Staged(buf, buf, 0, 12), 12, IMPORTER)
    yield srv, leases, lease
    srv.close()


def replay(address: str, request: dict) -> dict:
    """Send ``request`` to the copy server at ``address``; its reply."""
    host, port = address[len("tcp://") :].rsplit(":", 1)
    data = msgpack.packb(request, use_bin_type=True)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(struct.pack("!I", len(data)) + data)
        (n,) = struct.unpack("!I", s.recv(4, socket.MSG_WAITALL))
        return msgpack.unpackb(s.recv(n, socket.MSG_WAITALL), raw=False)


def test_a_proof_made_for_another_address_is_refused(served):
    srv, leases, lease = served
    captured = pull_proof(TOKEN, "tcp://127.0.0.1:9", POOL, lease, IMPORTER)  # what a member sent elsewhere
    reply = replay(srv.address, {"op": "pull", "pool": POOL, "lease": lease, "proof": captured, "requester": IMPORTER})
    assert reply["error"] == NotAMemberError.__name__, reply
    assert len(leases) == 1  # nothing served, nothing ended


def test_a_lease_is_served_only_to_the_worker_it_was_granted_to(served):
    srv, _leases, lease = served
    with pytest.raises(DataLostError, match="is not tcp://other:2's"):
        pull(srv.address, POOL, [lease], TOKEN, "tcp://other:2", host_buffer(bytearray(12)), 5.0)
    dst = host_buffer(bytearray(12))
    pull(srv.address, POOL, [lease], TOKEN, IMPORTER, dst, 5.0)  # the worker it was granted to
    assert read_bytes(dst, 12) == b"leased bytes"
