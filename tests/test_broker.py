from __future__ import annotations

import os
import socket
import tempfile
import time
import uuid

import msgpack
import pytest

from dask_gpupool import NotAMemberError, PeerLostError, UnknownPoolError
from dask_gpupool._broker import FdBroker, request_pool_fd
from dask_gpupool._messages import HandleReply, HandleRequest, encode

POOL = str(uuid.uuid4())
TOKEN = b"cluster-token-0123456789abcdef!!"


@pytest.fixture
def memfd():
    fd = os.memfd_create("broker-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    yield fd
    os.close(fd)


@pytest.fixture
def broker(memfd, tmp_path):
    def lookup(p: str) -> tuple[int, HandleReply] | None:
        return (memfd, HandleReply(POOL, "host", 4096)) if p == POOL else None

    b = FdBroker(lookup, str(tmp_path), 1.0, POOL, TOKEN)
    yield b
    b.close()


def connect(address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(5)
    s.connect(address)
    return s


def test_fd_crosses_to_the_peer(broker, memfd):
    os.pwrite(memfd, b"pool bytes", 0)
    reply, fd = request_pool_fd(broker.address, POOL, 5, TOKEN)
    try:
        assert reply == HandleReply(POOL, "host", 4096)
        assert fd != memfd and os.pread(fd, 10, 0) == b"pool bytes"
    finally:
        os.close(fd)
    deadline = time.monotonic() + 5  # the broker counts after the send returns: the peer may be faster
    while broker.served != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert broker.served == 1


def test_socket_lives_in_a_private_directory(broker):
    directory = os.path.dirname(broker.address)
    assert os.stat(directory).st_mode & 0o777 == 0o700


def test_unknown_pool_is_a_typed_error(broker):
    with pytest.raises(UnknownPoolError, match="not served"):
        request_pool_fd(broker.address, str(uuid.uuid4()), 5, TOKEN)


@pytest.mark.parametrize(
    "payload",
    [b"\xc1garbage", msgpack.packb([1, 2, 3]), msgpack.packb({"op": "pool-handle", "pool": 7}), b"x" * 70000],
)
def test_malformed_request_closes_only_that_connection(broker, payload):
    s = connect(broker.address)
    s.sendall(payload)
    assert s.recv(100) == b""  # closed without an answer
    s.close()
    _reply, fd = request_pool_fd(broker.address, POOL, 5, TOKEN)  # still serving
    os.close(fd)
    assert broker.refused == 1


def test_silent_peer_is_dropped_after_the_timeout(broker):
    s = connect(broker.address)
    deadline = time.monotonic() + 5
    while broker.connections == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.recv(100) == b""  # the broker hung up after its 1 s timeout
    s.close()
    assert broker.connections == 0


def test_a_peer_without_the_token_gets_nothing(broker):
    with pytest.raises(NotAMemberError, match="not a member"):
        request_pool_fd(broker.address, POOL, 5, b"x" * len(TOKEN))
    assert (broker.refused, broker.served) == (1, 0)
    _reply, fd = request_pool_fd(broker.address, POOL, 5, TOKEN)  # members are still served
    os.close(fd)


def test_a_request_before_the_hello_is_refused(broker):
    s = connect(broker.address)
    s.sendall(encode(HandleRequest(POOL)))
    assert s.recv(100) == b""  # closed; no fd came
    s.close()
    assert (broker.refused, broker.served) == (1, 0)


def test_a_broker_without_a_token_refuses_everyone(memfd, tmp_path):
    b = FdBroker(lambda p: (memfd, HandleReply(POOL, "host", 4096)), str(tmp_path), 1.0, POOL)
    try:
        with pytest.raises(NotAMemberError):
            request_pool_fd(b.address, POOL, 5, TOKEN)
        b.token = TOKEN  # the worker got the cluster's token from the scheduler
        _reply, fd = request_pool_fd(b.address, POOL, 5, TOKEN)
        os.close(fd)
    finally:
        b.close()


def test_dead_broker_is_peer_lost(tmp_path):
    with pytest.raises(PeerLostError):
        request_pool_fd(str(tmp_path / "nobody.sock"), POOL, 1, TOKEN)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")
def test_foreign_uid_is_refused_even_if_the_directory_is_opened(memfd):
    parent = tempfile.mkdtemp(dir="/tmp")
    os.chmod(parent, 0o755)
    broker = FdBroker(lambda p: (memfd, HandleReply(POOL, "host", 4096)), parent, 1.0, POOL, TOKEN)
    directory = os.path.dirname(broker.address)
    os.chmod(directory, 0o755)  # an operator's mistake: the uid check must still hold
    os.chmod(broker.address, 0o777)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: become 'nobody' and ask for the pool
        try:
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            try:
                _reply, _fd = request_pool_fd(broker.address, POOL, 5, TOKEN)
                outcome = b"GOT-FD"
            except PeerLostError:
                outcome = b"refused"
            except Exception as e:
                outcome = repr(e).encode()
            os.write(write, outcome)
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    outcome = os.read(read, 200)
    os.close(read)
    refused, served = broker.refused, broker.served
    broker.close()
    os.rmdir(parent)
    assert outcome == b"refused"
    assert (refused, served) == (1, 0)


def test_close_removes_socket_and_directory_and_leaks_no_fd(memfd, tmp_path, no_fd_leak):
    b = FdBroker(lambda p: (memfd, HandleReply(POOL, "host", 4096)), str(tmp_path), 1.0, POOL, TOKEN)
    _, fd = request_pool_fd(b.address, POOL, 5, TOKEN)
    os.close(fd)
    idle = connect(b.address)  # a connection still open at close time
    b.close()
    b.close()
    idle.close()
    assert not os.path.exists(b.address)
    assert not os.path.exists(os.path.dirname(b.address))
    assert os.listdir(tmp_path) == []
