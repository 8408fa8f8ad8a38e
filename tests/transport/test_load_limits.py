"""Servers that cannot be killed by load: fd floods, connection bounds, slow clients.

The broker and the copy server run in a child process of their own (a plain
``multiprocessing`` spawn child) whose ``RLIMIT_NOFILE`` is lowered to a few
fds above what it holds, so that a flood of idle connections from this process
runs it out of fds (``EMFILE``). Each flood test then checks that a legitimate
peer is served once the flood ends, and that the owner's fds and threads are
back to what they were before the flood. Bounds tests run the server in this
process and flood it from another process (per-pid bound) or another source
address (per-IP bound).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from typing import Any

import msgpack
import pytest
from conftest import no_fd_leak  # noqa: F401  (fixture)

from dask_gpupool import BrokerRefusedError, PeerLostError
from dask_gpupool.handoff.leases import LeaseTable
from dask_gpupool.memory.buffers import host_buffer
from dask_gpupool.testing import read_bytes
from dask_gpupool.transport.broker import FdBroker
from dask_gpupool.transport.link import request_pool_fd
from dask_gpupool.transport.pull import pull
from dask_gpupool.transport.stream import CopyServer, Staged
from dask_gpupool.wire.broker import HandleReply
from dask_gpupool.wire.codec import decode
from dask_gpupool.wire.stream import pull_proof

POOL = str(uuid.UUID(int=15))  # the same in the spawned owner, which imports this module anew
TOKEN = b"cluster-token-0123456789abcdef!!"
IMPORTER = "tcp://importer:1"
CHUNK = 1 << 16
PAYLOAD = b"served after the flood"
#: fds the owner may open beyond those it holds when the flood starts.
HEADROOM = 24
FLOOD = 120


@pytest.fixture(autouse=True, scope="module")
def _resource_tracker() -> None:
    """Start multiprocessing's resource tracker before any fd count: spawning starts it once, and its pipe stays."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


def wait_for(predicate: Any, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached in time"
        time.sleep(0.02)


# -- the owner: a child process with a lowered fd limit ---------------------------------------


def _owner(kind: str, timeout: float, pipe: Any) -> None:
    """Child process: run an FdBroker or a CopyServer under a lowered RLIMIT_NOFILE; answer ``pipe``.

    Commands: ``("stats", None)``, ``("offer", bytes)`` (copy server: grant a
    stream lease on the bytes, answer its id), ``("close", None)``.
    """
    import resource
    import threading

    memfd = os.memfd_create("load-limits", os.MFD_CLOEXEC)
    os.ftruncate(memfd, 4096)
    os.pwrite(memfd, PAYLOAD, 0)
    server: Any
    leases = LeaseTable(60.0)
    if kind == "broker":
        directory = tempfile.mkdtemp()
        server = FdBroker(
            lambda p: (memfd, HandleReply(POOL, "host", 4096)) if p == POOL else None, directory, timeout, POOL, TOKEN
        )
    else:
        server = CopyServer(POOL, leases, "127.0.0.1", timeout, CHUNK)
        server.token = TOKEN
    keep: list[Any] = []

    def fds() -> int:
        try:
            return len(os.listdir("/proc/self/fd"))
        except OSError:  # EMFILE: not one fd left to list them with
            return limit

    def stats() -> dict[str, Any]:
        return {
            "fds": fds(),
            "threads": threading.active_count(),
            "connections": server.connections if kind == "broker" else server.transfers,
            "refused": getattr(server, "refused", None),
            "accept_errors": getattr(server, "accept_errors", None),
            "accepting": not server._accept_task.done() if kind == "broker" else server._acceptor.is_alive(),
            "leases": len(leases),
        }

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = len(os.listdir("/proc/self/fd")) + HEADROOM
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    pipe.send((server.address, limit, stats()))
    while True:
        cmd, arg = pipe.recv()
        if cmd == "stats":
            pipe.send(stats())
        elif cmd == "offer":
            buf = host_buffer(bytearray(arg))
            keep.append(buf)
            pipe.send(leases.grant(Staged(buf, buf, 0, len(arg)), len(arg), IMPORTER))
        elif cmd == "close":
            server.close()
            pipe.send(stats())
            return


def met_emfile(stats: dict[str, Any]) -> bool:
    """The owner's accept loop met EMFILE: it counted an accept error, or (before the fix) it died of it."""
    return bool(stats["accept_errors"]) or not stats["accepting"]


class Owner:
    """A child process owning a broker or a copy server, with ``HEADROOM`` fds left."""

    def __init__(self, kind: str, timeout: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self.process = ctx.Process(target=_owner, args=(kind, timeout, child), daemon=True)
        self.process.start()
        child.close()
        self.address, self.limit, self.baseline = self._pipe.recv()

    def ask(self, cmd: str, arg: Any = None) -> Any:
        self._pipe.send((cmd, arg))
        return self._pipe.recv()

    def stats(self) -> dict[str, Any]:
        return dict(self.ask("stats"))

    def close(self) -> dict[str, Any]:
        try:
            return dict(self.ask("close")) if self.process.is_alive() else {}
        finally:
            self.process.join(30)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(30)
            self.process.close()
            self._pipe.close()


def flood_unix(address: str, n: int) -> list[socket.socket]:
    """``n`` idle connections to a broker (no hello); connections the backlog cannot take are skipped."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setblocking(False)
        if s.connect_ex(address) == 0:
            socks.append(s)
        else:
            s.close()
    return socks


def flood_tcp(address: str, n: int, source: str = "127.0.0.1") -> list[socket.socket]:
    """``n`` idle TCP connections to a copy server from ``source`` (nothing sent)."""
    host, port = address[len("tcp://") :].rsplit(":", 1)
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((source, 0))
        s.setblocking(False)
        s.connect_ex((host, int(port)))
        socks.append(s)
    return socks


def fd_of(address: str) -> tuple[HandleReply, int]:
    """``request_pool_fd``, tried again while the broker's listen backlog is full (``EAGAIN`` at connect).

    Connections a flooder closed stay in the backlog until the broker accepts
    them; a broker that accepts again drains it within its back-off.
    """
    deadline = time.monotonic() + 30
    while True:
        try:
            return request_pool_fd(address, POOL, 10, TOKEN)
        except PeerLostError as e:
            if not isinstance(e.__cause__, BlockingIOError) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()


# -- fd floods ---------------------------------------------------------------------------------


def test_an_fd_flood_does_not_stop_the_broker(no_fd_leak):  # noqa: F811
    owner = Owner("broker", timeout=5.0)
    try:
        flood = flood_unix(owner.address, FLOOD)
        try:
            wait_for(lambda: owner.stats()["fds"] >= owner.limit, what="the broker's fds at their limit")
            wait_for(lambda: met_emfile(owner.stats()), what="the broker meeting EMFILE")
        finally:
            close_all(flood)
        reply, fd = fd_of(owner.address)
        try:
            assert reply == HandleReply(POOL, "host", 4096)
            assert os.pread(fd, len(PAYLOAD), 0) == PAYLOAD
        finally:
            os.close(fd)
        base = owner.baseline
        wait_for(
            lambda: owner.stats()["connections"] == 0 and owner.stats()["fds"] == base["fds"],
            what="the broker's fds back to baseline",
        )
        after = owner.stats()
        assert (after["fds"], after["threads"], after["connections"]) == (base["fds"], base["threads"], 0)
        assert after["accept_errors"] > 0  # it did meet EMFILE, and lived on
    finally:
        owner.close()


def test_a_broker_drops_an_idle_flood_that_never_ends_and_serves_again(no_fd_leak):  # noqa: F811
    owner = Owner("broker", timeout=1.0)
    flood = flood_unix(owner.address, FLOOD)
    try:
        wait_for(lambda: owner.stats()["fds"] >= owner.limit, what="the broker's fds at their limit")
        # The flooder keeps every connection open: the broker's deadline (from accept) drops each of them.
        wait_for(lambda: owner.stats()["refused"] == len(flood), what="every idle connection dropped")
        reply, fd = fd_of(owner.address)
        os.close(fd)
        assert reply.pool == POOL
    finally:
        close_all(flood)
        try:
            base = owner.baseline
            wait_for(lambda: owner.stats()["fds"] == base["fds"], what="the broker's fds back to baseline")
            assert owner.stats()["threads"] == base["threads"]
        finally:
            owner.close()


def test_an_fd_flood_does_not_stop_the_copy_server(no_fd_leak):  # noqa: F811
    owner = Owner("copy", timeout=5.0)
    try:
        flood = flood_tcp(owner.address, FLOOD)
        try:
            wait_for(lambda: owner.stats()["fds"] >= owner.limit, what="the copy server's fds at their limit")
            wait_for(lambda: met_emfile(owner.stats()), what="the copy server meeting EMFILE")
        finally:
            close_all(flood)
        data = os.urandom(3 * CHUNK + 5)
        lease = owner.ask("offer", data)
        dst = host_buffer(bytearray(len(data)))
        pull(owner.address, POOL, [lease], TOKEN, IMPORTER, dst, 10.0)
        assert read_bytes(dst, len(data)) == data
        base = owner.baseline
        wait_for(
            lambda: owner.stats()["fds"] == base["fds"] and owner.stats()["threads"] == base["threads"],
            what="the copy server's fds and threads back to baseline",
        )
        after = owner.stats()
        assert (after["connections"], after["leases"]) == (0, 0)
        assert after["accept_errors"] > 0  # it did meet EMFILE, and lived on
    finally:
        owner.close()


# -- slow clients ------------------------------------------------------------------------------


def test_a_slow_loris_is_dropped_at_the_request_deadline(no_fd_leak):  # noqa: F811
    leases = LeaseTable(60.0)
    srv = CopyServer(POOL, leases, "127.0.0.1", 1.0, CHUNK)
    srv.token = TOKEN
    try:
        host, port = srv.address[len("tcp://") :].rsplit(":", 1)
        request = msgpack.packb(
            {
                "op": "pull",
                "pool": POOL,
                "lease": 1,
                "proof": pull_proof(TOKEN, srv.address, POOL, 1, IMPORTER),
                "requester": IMPORTER,
            },
            use_bin_type=True,
        )
        raw = struct.pack("!I", len(request)) + request
        hung_up = False
        with socket.create_connection((host, int(port)), timeout=5) as s:
            # One byte every 0.25 s: each recv on the server returns well within its 1 s timeout, but the
            # whole request would take 40 s. The server must hang up on it while it still trickles in.
            for i in range(min(len(raw) - 1, 40)):
                try:
                    s.sendall(raw[i : i + 1])
                    if s.recv(1, socket.MSG_DONTWAIT) == b"":
                        hung_up = True
                        break
                except BlockingIOError:
                    pass
                except OSError:  # reset or broken pipe: hung up as well
                    hung_up = True
                    break
                time.sleep(0.25)
        assert hung_up, "the copy server kept a trickling request open past its deadline"
        assert srv.refused == 1
        wait_for(lambda: srv.transfers == 0, what="the serving thread gone")
    finally:
        srv.close()


# -- connection bounds -------------------------------------------------------------------------

_FLOODER = textwrap.dedent(
    """
    import json, socket, sys, time
    address, n = sys.argv[1], int(sys.argv[2])
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(address)  # blocking: waits while the listen backlog is full
        socks.append(s)
    print(json.dumps({"connected": len(socks)}), flush=True)
    sys.stdin.readline()  # hold every connection until told
    errors = []
    for s in socks:
        s.setblocking(False)
        try:
            data = s.recv(65536)
        except BlockingIOError:
            continue  # open, nothing sent: one the broker kept
        except OSError:
            data = b""
        errors.append(data.hex())
    print(json.dumps({"closed": errors}), flush=True)
    """
)


def start_flooder(address: str, n: int) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _FLOODER, address, str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


def end_flooder(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    out = json.loads(proc.stdout.readline())
    proc.wait(30)
    proc.stdin.close()
    proc.stdout.close()
    return dict(out)


@pytest.fixture
def memfd():
    fd = os.memfd_create("load-limits", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    os.pwrite(fd, PAYLOAD, 0)
    yield fd
    os.close(fd)


def test_a_flood_beyond_the_per_peer_bound_is_refused_while_another_peer_is_served(
    memfd,
    tmp_path,
    no_fd_leak,  # noqa: F811
):
    broker = FdBroker(lambda p: (memfd, HandleReply(POOL, "host", 4096)), str(tmp_path), 30.0, POOL, TOKEN)
    proc = None
    try:
        bound = broker.max_per_peer
        assert bound == 64  # the documented default
        proc, got = start_flooder(broker.address, bound + 36)
        assert got["connected"] == bound + 36
        wait_for(lambda: broker.refused == 36, what="36 connections refused")
        assert broker.connections == bound  # the flooder's first 64 are kept (until the deadline)
        _reply, fd = request_pool_fd(broker.address, POOL, 10, TOKEN)  # another pid: served
        try:
            assert os.pread(fd, len(PAYLOAD), 0) == PAYLOAD
        finally:
            os.close(fd)
        closed = end_flooder(proc)["closed"]
        proc = None
        assert len(closed) == 36
        refusals = [decode(bytes.fromhex(c)) for c in closed if c]
        assert refusals and all(r["error"] == BrokerRefusedError.__name__ for r in refusals)
        wait_for(lambda: broker.connections == 0, what="the flood's connections closed")
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(30)
            proc.stdin.close()  # type: ignore[union-attr]
            proc.stdout.close()  # type: ignore[union-attr]
        broker.close()


def test_a_flood_beyond_the_total_bound_is_refused_and_served_again_after(memfd, tmp_path, no_fd_leak):  # noqa: F811
    broker = FdBroker(
        lambda p: (memfd, HandleReply(POOL, "host", 4096)), str(tmp_path), 30.0, POOL, TOKEN, max_connections=8
    )
    try:
        proc, _got = start_flooder(broker.address, 20)
        wait_for(lambda: broker.refused == 12, what="12 connections refused")
        assert broker.connections == 8
        with pytest.raises((BrokerRefusedError, PeerLostError)):
            request_pool_fd(broker.address, POOL, 10, TOKEN)  # the whole broker is at its bound
        assert len(end_flooder(proc)["closed"]) == 12
        wait_for(lambda: broker.connections == 0, what="the flood's connections closed")
        reply, fd = request_pool_fd(broker.address, POOL, 10, TOKEN)
        os.close(fd)
        assert reply.pool == POOL
    finally:
        broker.close()


def test_a_copy_server_flood_beyond_the_per_ip_bound_is_refused_while_another_ip_is_served(no_fd_leak):  # noqa: F811
    leases = LeaseTable(60.0)
    srv = CopyServer(POOL, leases, "127.0.0.1", 30.0, CHUNK, max_per_peer=8)
    srv.token = TOKEN
    flood: list[socket.socket] = []
    try:
        flood = flood_tcp(srv.address, 20, source="127.0.0.2")
        wait_for(lambda: srv.refused == 12, what="12 connections refused")
        assert srv.transfers == 8  # one thread each for the first 8, until their deadline
        data = os.urandom(2 * CHUNK)
        buf = host_buffer(bytearray(data))
        lease = leases.grant(Staged(buf, buf, 0, len(data)), len(data), IMPORTER)
        dst = host_buffer(bytearray(len(data)))
        pull(srv.address, POOL, [lease], TOKEN, IMPORTER, dst, 10.0)  # from 127.0.0.1: served
        assert read_bytes(dst, len(data)) == data
        close_all(flood)
        flood = []
        wait_for(lambda: srv.transfers == 0 and len(leases) == 0, what="the flood's threads gone")
    finally:
        close_all(flood)
        srv.close()
