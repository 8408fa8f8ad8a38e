from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
from conftest import wait_for

from dask_gpupool import BrokerRefusedError, NotAMemberError, PeerLostError, ProtocolError, UnknownPoolError
from dask_gpupool.transport.broker import FdBroker
from dask_gpupool.transport.link import PeerLink, request_pool_fd
from dask_gpupool.wire.broker import HandleReply, HandleRequest, Hello
from dask_gpupool.wire.codec import encode

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
    """A member (past its hello) that sends garbage is dropped; other connections are served."""
    s = connect(broker.address)
    s.sendall(encode(Hello(TOKEN)))
    assert msgpack.unpackb(s.recv(1000))["op"] == "welcome"  # a member now
    s.sendall(encode(HandleRequest(POOL)))  # a well-formed request is answered
    assert HandleReply.from_msg(msgpack.unpackb(s.recv(100))) == HandleReply(POOL, "host", 4096)
    _, fds, _, _ = socket.recv_fds(s, 16, 1)
    for fd in fds:
        os.close(fd)
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
                # A raw client, not a PeerLink: a link refuses this broker itself (its directory is not
                # nobody's); here the broker's own check is under test.
                s = connect(broker.address)
                s.sendall(encode(Hello(TOKEN)))
                outcome = b"refused" if s.recv(100) == b"" else b"ANSWERED"
            except (BrokenPipeError, ConnectionResetError):  # closed before, or with, the hello unread
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


# -- the importer checks who answers on a broker socket -------------------------------------------


@contextlib.contextmanager
def planted_listener(path: str, uid: int | None = None) -> Iterator[tuple[int, Callable[[], bytes]]]:
    """A broker-like listener at ``path`` in a forked process (of ``uid``, when root gives it one).

    The socket is bound here (the directory may be closed to ``uid``); the child calls ``listen``, so
    ``SO_PEERCRED`` names the child. Yields ``(pid, outcome)``: ``outcome()`` ends the child and returns
    ``b"N"`` if nobody connected, else ``b"R"`` followed by the bytes it received before the peer hung up.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.bind(path)
    out_r, out_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the planted listener
        try:
            os.close(out_r)
            os.close(stop_w)
            if uid is not None:
                os.setgid(uid)
                os.setuid(uid)
            sock.listen(1)
            os.write(out_w, b"L")
            ready, _, _ = select.select([sock, stop_r], [], [], 60)
            if sock in ready:
                conn, _ = sock.accept()
                conn.settimeout(30)
                os.write(out_w, b"R" + conn.recv(65536))
            else:
                os.write(out_w, b"N")
        finally:
            os._exit(0)
    sock.close()
    os.close(out_w)
    os.close(stop_r)
    assert os.read(out_r, 1) == b"L"
    outcome: list[bytes] = []

    def finish() -> bytes:
        if not outcome:
            os.close(stop_w)
            chunks = []
            while chunk := os.read(out_r, 65536):
                chunks.append(chunk)
            os.close(out_r)
            os.waitpid(pid, 0)
            outcome.append(b"".join(chunks))
        return outcome[0]

    try:
        yield pid, finish
    finally:
        finish()


def test_link_checks_the_broker_pid_before_it_sends_the_token(broker, no_fd_leak):
    """A listener that is not the registry row's process gets a closed connection and never the token."""
    planted = os.path.join(tempfile.mkdtemp(dir=os.path.dirname(os.path.dirname(broker.address))), "broker.sock")
    with planted_listener(planted) as (pid, outcome):
        with pytest.raises(BrokerRefusedError, match=rf"pid {pid}.*expected pid {os.getpid()}"):
            PeerLink(planted, 5, TOKEN, expected_pid=os.getpid())
        assert outcome() == b"R"  # it was connected to, and got not a byte
    link = PeerLink(broker.address, 5, TOKEN, expected_pid=os.getpid())  # the real broker runs in this process
    _reply, fd = link.request_pool_fd(POOL)
    os.close(fd)
    link.close()
    wait_closed(broker)


def wait_closed(broker: FdBroker) -> None:
    """Wait until the broker (in this process, on its own thread) closed its ends of every connection."""
    deadline = time.monotonic() + 5
    while broker.connections and time.monotonic() < deadline:
        time.sleep(0.01)
    assert broker.connections == 0


def test_a_segment_handle_is_asked_for_by_a_named_worker_only(memfd, tmp_path, no_fd_leak):
    """Segment fds (VMM segments) go to connections that named a worker; a broker without segments says so."""
    broker = FdBroker(lambda p: (memfd, HandleReply(POOL, "host", 4096)), str(tmp_path), 1.0, POOL, TOKEN)
    link = PeerLink(broker.address, 5, TOKEN, "tcp://10.0.0.1:4000", expected_pid=os.getpid())
    with pytest.raises(UnknownPoolError, match="pool handles only"):
        link.request_segment_fd(POOL, 3)
    _reply, fd = link.request_pool_fd(POOL)  # the link still works
    os.close(fd)
    link.close()
    anonymous = PeerLink(broker.address, 5, TOKEN, expected_pid=os.getpid())
    with pytest.raises(PeerLostError):
        anonymous.request_segment_fd(POOL, 3)  # closed without an answer
    anonymous.close()
    wait_closed(broker)
    assert broker.refused == 1
    broker.close()  # it watched this process (the named link's): that pidfd goes with it


@pytest.mark.skipif(os.getuid() != 0, reason="a listener of another uid needs root (a process of ours cannot fake one)")
def test_link_refuses_a_broker_of_another_uid(tmp_path, no_fd_leak):
    planted = str(tmp_path / "broker.sock")
    with planted_listener(planted, uid=65534) as (_pid, outcome):
        with pytest.raises(BrokerRefusedError, match="uid 65534"):
            PeerLink(planted, 5, TOKEN)
        assert outcome() == b"R"  # connected (to check its credentials), never sent the token


def _loosen(directory: str, how: str) -> str:
    """Make ``directory`` one a link must refuse; returns the socket path to use."""
    if how == "symlink":
        link = directory + "-link"
        os.symlink(directory, link)
        return os.path.join(link, "broker.sock")
    if how == "foreign":
        os.chown(directory, 65534, 65534)
    else:
        os.chmod(directory, {"group-writable": 0o770, "other-writable": 0o703}[how])
    return os.path.join(directory, "broker.sock")


@pytest.mark.parametrize("how", ["group-writable", "other-writable", "symlink", "foreign"])
def test_link_refuses_a_loose_or_foreign_broker_directory(tmp_path, how, no_fd_leak):
    if how == "foreign" and os.getuid() != 0:
        pytest.skip("giving a directory to another uid needs root")
    directory = str(tmp_path / "dask-gpupool-planted")
    os.mkdir(directory, 0o700)
    with planted_listener(os.path.join(directory, "broker.sock")) as (_pid, outcome):
        address = _loosen(directory, how)
        with pytest.raises(BrokerRefusedError, match="directory"):
            PeerLink(address, 5, TOKEN)
        assert outcome() == b"N"  # refused before connecting


# -- directories of brokers that died without closing ---------------------------------------------

BROKER_PROCESS = """
import sys, time
from dask_gpupool.transport.broker import FdBroker
b = FdBroker(lambda p: None, sys.argv[1], 1.0, "killed00", b"x" * 32)
print(b.address, flush=True)
time.sleep(600)
"""


def killed_broker(parent: str) -> str:
    """Run an FdBroker in a process of its own, SIGKILL it, and return its (left-over) directory."""
    proc = subprocess.Popen([sys.executable, "-c", BROKER_PROCESS, parent], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address, "the broker process did not start"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()
    assert os.path.exists(address)  # a SIGKILLed broker cannot clean up
    return os.path.dirname(address)


def make_old(*paths: str) -> None:
    old = time.time() - 3600
    for p in paths:
        os.utime(p, (old, old), follow_symlinks=False)


def test_a_broker_start_removes_our_stale_broker_directories_and_nothing_else(memfd, tmp_path, no_fd_leak):
    parent = str(tmp_path / "b")  # short: socket paths have 107 bytes
    os.mkdir(parent, 0o700)
    lookup = lambda p: (memfd, HandleReply(POOL, "host", 4096)) if p == POOL else None  # noqa: E731
    live = FdBroker(lookup, parent, 1.0, POOL, TOKEN)
    try:
        stale = killed_broker(parent)
        young = killed_broker(parent)  # died a moment ago: it could be a broker starting, so it stays
        empty = os.path.join(parent, "dask-gpupool-empty0-x")  # ours, no socket: a broker died before bind
        os.mkdir(empty, 0o700)
        notes = os.path.join(parent, "dask-gpupool-notes")  # holds something else: only the socket is ours to remove
        os.mkdir(notes, 0o700)
        with open(os.path.join(notes, "keep.txt"), "w") as f:
            f.write("not a broker's")
        os.mkdir(tmp_path / "e", 0o700)
        elsewhere = killed_broker(str(tmp_path / "e"))  # stale, but reached only through a link
        link = os.path.join(parent, "dask-gpupool-link")
        os.symlink(elsewhere, link)
        other = os.path.join(parent, "other-dir")
        os.mkdir(other, 0o700)
        kept = [os.path.dirname(live.address), young, notes, link, elsewhere, other]
        if os.getuid() == 0:  # another user's directory is never touched
            foreign = os.path.join(parent, "dask-gpupool-foreign")
            os.mkdir(foreign, 0o700)
            os.chown(foreign, 65534, 65534)
            make_old(foreign)
            kept.append(foreign)
        make_old(stale, empty, notes, elsewhere, link, other, os.path.dirname(live.address))

        fresh = FdBroker(lookup, parent, 1.0, POOL, TOKEN)
        fresh.close()

        assert not os.path.exists(stale) and not os.path.exists(empty)
        assert all(os.path.lexists(p) for p in kept), [p for p in kept if not os.path.lexists(p)]
        assert os.path.exists(os.path.join(young, "broker.sock")) and os.path.exists(os.path.join(notes, "keep.txt"))
        _reply, fd = request_pool_fd(live.address, POOL, 5, TOKEN)  # the live broker still serves
        os.close(fd)
    finally:
        live.close()


# -- an importer that left the registry: its process, not the registry, ends its leases ---------------------------


def test_an_importer_that_left_the_registry_is_released_when_its_process_exits(memfd, tmp_path, no_fd_leak):
    """``FdBroker.importer_left`` (the worker's loop calls it when a row leaves the registry): a process that lives
    on is watched and released when it exits; one gone already, or of pid 0 (another host), is released at once."""
    from dask_gpupool.transport.broker_handler import LookupOnly

    exited: list[str] = []

    class Recording(LookupOnly):
        def importer_exited(self, importer: str) -> None:
            exited.append(importer)

    b = FdBroker(Recording(lambda p: (memfd, HandleReply(POOL, "host", 4096))), str(tmp_path), 1.0, POOL, TOKEN)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        b.importer_left("tcp://alive:1", child.pid)
        b.importer_left("tcp://other-host:1", 0)
        deadline = time.monotonic() + 5
        while "tcp://other-host:1" not in exited and time.monotonic() < deadline:
            time.sleep(0.01)
        _reply, fd = request_pool_fd(b.address, POOL, 5, TOKEN)  # a round trip: the broker's loop went on since
        os.close(fd)
        assert exited == ["tcp://other-host:1"] and b.watched == 1  # the live one is watched, not released
        child.stdin.close()
        child.wait(10)
        while "tcp://alive:1" not in exited and time.monotonic() < deadline + 5:
            time.sleep(0.01)
        assert exited == ["tcp://other-host:1", "tcp://alive:1"] and b.watched == 0
        b.importer_left("tcp://gone:1", child.pid)  # exited (and reaped) already: released at once
        while "tcp://gone:1" not in exited and time.monotonic() < deadline + 10:
            time.sleep(0.01)
        assert exited[-1] == "tcp://gone:1"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        b.close()
    b.importer_left("tcp://after-close:1", 12345)  # a closed broker watches nothing: at once
    assert exited[-1] == "tcp://after-close:1"


# -- review (transport): a copy in flight when the broker closes -----------------------------------------------


def _open_copies() -> list[str]:
    """The host copies (``copy_out``'s memfds) open in this process."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("/memfd:dask-gpupool-copy"):
                out.append(target)
    return out


def _exporting_broker(tmp_path: Any) -> tuple[Any, Any, str, FdBroker]:
    """A broker over a real exporter of a 16 MiB ``host`` pool, with one importer in its registry:
    ``(pool, leases, importer, broker)``; the caller closes the broker, then the pool."""
    from dask_gpupool.config import PoolOptions
    from dask_gpupool.handoff.exporter import ExportSide
    from dask_gpupool.handoff.leases import LeaseTable
    from dask_gpupool.handoff.registry import RegistryView
    from dask_gpupool.memory.pool import Pool
    from dask_gpupool.memory.topology import LocalDevices
    from dask_gpupool.wire.registry import PoolRecord, RegistryUpdate

    pool = Pool.create(PoolOptions.from_config(kind="host", max_size="16 MiB"), LocalDevices(()))
    leases = LeaseTable(60)
    registry = RegistryView()
    importer = "tcp://127.0.0.1:1"
    row = PoolRecord(str(uuid.uuid4()), importer, os.getpid(), "h", "h", "host", None, 1 << 20, "/x")
    registry.apply(RegistryUpdate(version=1, added=(row,)))
    broker = FdBroker(ExportSide(pool, leases, registry, "h"), str(tmp_path), 30.0, pool.uuid, TOKEN)
    return pool, leases, importer, broker


def test_a_copy_in_flight_when_the_broker_closes_closes_its_memfd(tmp_path, monkeypatch):
    """``CopyRequest``: the memfd ``copy_out`` makes on a helper thread, for a connection the broker stopped
    serving meanwhile (it closed), is closed once the copy returns, not left open with the bytes in it."""
    import threading

    from dask_gpupool.handoff import exporter
    from dask_gpupool.handoff.exporter import Exported

    pool, leases, importer, broker = _exporting_broker(tmp_path)
    copying, go = threading.Event(), threading.Event()
    copy_to_host = exporter.copy_to_host

    def slow_copy(*args: Any, **kwargs: Any) -> Any:  # a long copy into the memfd, on the broker's helper thread
        copying.set()
        go.wait(30)
        return copy_to_host(*args, **kwargs)

    monkeypatch.setattr(exporter, "copy_to_host", slow_copy)

    outcome: list[BaseException] = []
    link = PeerLink(broker.address, 30.0, TOKEN, importer)

    def fetch() -> None:
        try:
            _reply, fd = link.fetch_copy(lease)
            os.close(fd)
        except BaseException as e:
            outcome.append(e)

    buf = pool.allocate(4096)
    lease = leases.grant(Exported(buf, buf), 4096, importer)
    fetcher = threading.Thread(target=fetch)
    try:
        assert _open_copies() == []
        fetcher.start()
        assert copying.wait(30), "the copy did not start"
        broker.close()  # the worker shuts down while the copy runs
        go.set()
        fetcher.join(30)
        assert outcome and isinstance(outcome[0], PeerLostError)  # the importer hears the broker went away
        deadline = time.monotonic() + 10
        while _open_copies() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _open_copies() == [], "the copy's memfd stayed open after its connection was gone"
    finally:
        go.set()
        fetcher.join(30)
        link.close()
        broker.close()
        leases.clear()
        del buf
        pool.close()


def test_an_importer_gone_when_its_connection_closes_is_released_at_once_even_with_a_pidfd_over_1023():
    """``ImporterWatch.check_exited`` (a connection just closed: is its process gone?) in a worker with many fds
    open, as one whose broker holds its 1024 connections: the pidfd is numbered 1024 or more, which ``select()``
    refuses with ``ValueError``; the exit is noticed all the same."""
    import asyncio
    import resource

    from dask_gpupool.transport.broker_admission import ImporterWatch
    from dask_gpupool.transport.broker_handler import LookupOnly

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"needs 1200 fds (hard limit {hard})")
    exited: list[str] = []

    class Recording(LookupOnly):
        def importer_exited(self, importer: str) -> None:
            exited.append(importer)

    watch = ImporterWatch(Recording(lambda p: None), POOL)
    loop = asyncio.new_event_loop()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    filler: list[int] = []
    try:
        if soft != resource.RLIM_INFINITY and soft < 1200:
            resource.setrlimit(resource.RLIMIT_NOFILE, (1200, hard))
        filler.append(os.open(os.devnull, os.O_RDONLY))
        while filler[-1] < 1024:  # every fd below 1024 taken: the next one opened is numbered over it
            filler.append(os.dup(filler[0]))
        watch.watch(loop, child.pid, "tcp://importer:1")
        assert len(watch) == 1 and exited == []
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(10)
        watch.check_exited(child.pid)
        assert exited == ["tcp://importer:1"] and len(watch) == 0
    finally:
        for fd in filler:
            os.close(fd)
        watch.close()
        loop.close()
        if child.poll() is None:
            child.kill()
            child.wait()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_broker_that_hangs_up_between_its_reply_and_the_fd_is_a_lost_peer(tmp_path, no_fd_leak):
    """The fd travels in a message after the reply; a broker that cannot send it (here the pool's fd is gone: the
    pool closed meanwhile) hangs up in between. That is ``PeerLostError``, as documented for a broker that hangs
    up, and the link is dead (not handed out again to fail at its next request)."""
    gone = next(n for n in range(4000, 8000) if not os.path.exists(f"/proc/self/fd/{n}"))
    b = FdBroker(lambda p: (gone, HandleReply(POOL, "host", 4096)), str(tmp_path), 5.0, POOL, TOKEN)
    try:
        with pytest.raises(PeerLostError, match="closed the connection"):
            request_pool_fd(b.address, POOL, 5, TOKEN)
        link = PeerLink(b.address, 5, TOKEN)
        try:
            with pytest.raises(PeerLostError):
                link.request_pool_fd(POOL)
            assert not link.alive
        finally:
            link.close()
    finally:
        b.close()


def test_a_link_opened_with_no_fd_left_is_a_lost_peer_not_a_bare_os_error(broker, no_fd_leak):
    """Out of fds (an fd flood) the importer cannot even make the socket: ``PeerLostError`` like any
    broker it cannot reach, which its callers turn into ``DataLostError``, not an ``OSError`` from outside the
    hierarchy."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    filler: list[int] = []
    try:
        top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (top + 2, hard))
        null = os.open(os.devnull, os.O_RDONLY)
        filler.append(null)
        with contextlib.suppress(OSError):  # EMFILE: every fd this process may have is taken
            while True:
                filler.append(os.dup(null))
        with pytest.raises(PeerLostError, match="Too many open files"):
            PeerLink(broker.address, 5, TOKEN)
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    _reply, fd = request_pool_fd(broker.address, POOL, 5, TOKEN)  # with fds again, it connects
    os.close(fd)


@contextlib.contextmanager
def out_of_step_broker(directory: str) -> Iterator[tuple[str, int]]:
    """A listener of ours that welcomes a link, answers its first handle request with bytes that are no message,
    then sends a well-formed reply for the pool and an fd anyway (a broker gone wrong, or a member that lies); yields
    its address and the fd it sent, whose memory says ``stale``."""
    import threading

    from dask_gpupool.wire.broker import Welcome

    os.mkdir(directory, 0o700)
    address = os.path.join(directory, "broker.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(1)
    stale = os.memfd_create("stale", os.MFD_CLOEXEC)
    os.pwrite(stale, b"stale", 0)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            conn.recv(65536)  # the hello
            conn.sendall(encode(Welcome()))
            conn.recv(65536)  # the first request
            conn.sendall(b"\xc1 not a message")
            conn.sendall(encode(HandleReply(POOL, "host", 4096)))
            socket.send_fds(conn, [b"\0"], [stale])
            with contextlib.suppress(OSError):
                while conn.recv(65536):  # whatever comes next gets no answer of its own
                    pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield address, stale
    finally:
        listener.close()
        t.join(10)
        os.close(stale)


def test_a_reply_that_cannot_be_decoded_breaks_the_link_so_no_later_request_takes_its_fd(tmp_path, no_fd_leak):
    """A handle request whose reply cannot be decoded left the link alive, with whatever the broker sent after it
    (here a reply and an fd) queued as the answer to the *next* request: another pool's or segment's memory. Out of
    step is not recoverable on a link: the link is broken, and the next request fails as a lost peer."""
    with out_of_step_broker(str(tmp_path / "dask-gpupool-lying")) as (address, _stale):
        link = PeerLink(address, 5, TOKEN)
        try:
            with pytest.raises(ProtocolError):
                link.request_pool_fd(POOL)
            assert not link.alive
            with pytest.raises(PeerLostError, match="link is closed"):
                link.request_pool_fd(POOL)
        finally:
            link.close()


def test_a_member_that_never_reads_its_replies_is_dropped_after_the_timeout(broker):
    """A member that sends requests and never reads the answers (a flood, or a lying member) filled its socket's
    queue, and the broker then waited to send it the next reply or fd for ever (the fd retried every millisecond),
    holding the connection, and a copy's memfd where it asked for copies. Past the broker's timeout it is dropped."""
    s = connect(broker.address)
    s.sendall(encode(Hello(TOKEN)))
    assert msgpack.unpackb(s.recv(1000))["op"] == "welcome"
    s.setblocking(False)
    sent = 0
    with contextlib.suppress(BlockingIOError):
        while sent < 10_000:
            s.send(encode(HandleRequest(POOL)))
            sent += 1
    assert 0 < sent < 10_000  # the queues filled: the broker waits to send
    s.setblocking(True)
    deadline = time.monotonic() + 10
    while broker.connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert broker.connections == 0  # dropped after its 1 s timeout
    s.settimeout(5)
    with contextlib.suppress(ConnectionResetError):
        while s.recv(1000):  # what was queued for it, then the end
            pass
    s.close()
    _reply, fd = request_pool_fd(broker.address, POOL, 5, TOKEN)  # other members are served
    os.close(fd)


def test_a_copy_asked_with_no_fd_left_is_refused_and_the_connection_keeps_serving(tmp_path, no_fd_leak):
    """``CopyRequest`` while the exporter's process has no fd left (an fd flood): the memfd of the copy
    cannot be made. That one request is answered with a refusal of ours (``BrokerRefusedError``, naming the cause),
    not an ``OSError`` that dropped the whole connection (the importer saw ``PeerLostError``, and its link, with
    every lease it held over it, had to be opened again and resynced). The link stays up, nothing is left open, and
    once fds are free the same link gets the copy."""
    import resource

    from dask_gpupool.handoff.exporter import Exported
    from dask_gpupool.memory.buffers import copy_from_host

    pool, leases, importer, broker = _exporting_broker(tmp_path)
    link = PeerLink(broker.address, 30.0, TOKEN, importer)
    buf = pool.allocate(4096)
    data = os.urandom(4096)
    copy_from_host(buf, memoryview(data))
    lease = leases.grant(Exported(buf, buf), 4096, importer)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    filler: list[int] = []
    try:
        assert broker.connections == 1
        top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (top + 2, hard))
        filler.append(os.open(os.devnull, os.O_RDONLY))
        with contextlib.suppress(OSError):  # EMFILE: every fd this process may have is taken
            while True:
                filler.append(os.dup(filler[0]))
        with pytest.raises(BrokerRefusedError, match="Too many open files"):
            link.fetch_copy(lease)
        for fd in filler:
            os.close(fd)
        filler.clear()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert link.alive and broker.connections == 1  # that request was refused, not the connection
        assert _open_copies() == [] and broker.copies == 0
        reply, fd = link.fetch_copy(lease)  # the same link, fds free again: the copy
        try:
            assert reply.size == 4096 and os.pread(fd, 4096, 0) == data
        finally:
            os.close(fd)
        # The broker counts a copy once its fd is sent, on its own thread: this one may read the fd first (seen on
        # the GPU machine).
        wait_for(lambda: broker.copies == 1, 10.0, "the broker to count the copy")
        assert leases.holder(lease) is not None  # the lease is still the importer's to end
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        link.close()
        broker.close()
        leases.clear()
        del buf
        pool.close()


def test_an_os_error_a_handlers_copy_lets_through_refuses_that_request_only(memfd, tmp_path, no_fd_leak):
    """Any handler's ``copy_out`` that lets an ``OSError`` through (no fd left for its memfd) gets the same answer
    from the broker: ``BrokerRefusedError`` for that request, and the connection serves the next one."""
    import errno

    from dask_gpupool.transport.broker_handler import LookupOnly

    class OutOfFds(LookupOnly):
        def copy_out(self, lease: int, importer: str) -> tuple[int, int]:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    b = FdBroker(OutOfFds(lambda p: (memfd, HandleReply(POOL, "host", 4096))), str(tmp_path), 5.0, POOL, TOKEN)
    link = PeerLink(b.address, 5.0, TOKEN, "tcp://127.0.0.1:1")
    try:
        with pytest.raises(BrokerRefusedError, match="Too many open files"):
            link.fetch_copy(7)
        assert link.alive and b.connections == 1
        _reply, fd = link.request_pool_fd(POOL)  # the same connection serves on
        os.close(fd)
    finally:
        link.close()
        b.close()
