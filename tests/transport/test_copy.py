"""The pipelined copy path's server and client on host memory (runs in CI, no GPU)."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from conftest import no_fd_leak  # noqa: F401  (fixture)

from dask_gpupool import DataLostError, NotAMemberError
from dask_gpupool.handoff.leases import LeaseTable
from dask_gpupool.memory.buffers import host_buffer
from dask_gpupool.testing import read_bytes
from dask_gpupool.transport.pull import pull
from dask_gpupool.transport.stream import CopyServer, Staged, lanes
from dask_gpupool.wire.stream import pull_proof

POOL = str(uuid.uuid4())
TOKEN = b"t" * 32
IMPORTER = "tcp://importer:1"
CHUNK = 1 << 16


@pytest.fixture
def server(no_fd_leak):  # noqa: F811
    leases = LeaseTable(60.0)
    srv = CopyServer(POOL, leases, "127.0.0.1", 5.0, CHUNK)
    srv.token = TOKEN
    yield srv, leases
    srv.close()
    assert len(leases) == 0 and srv.transfers == 0


def offer(leases: LeaseTable, data: bytes, offset: int = 0) -> tuple[int, int]:
    """Grant a stream lease on ``data[offset:]`` held in a host Buffer; return (lease, nbytes)."""
    buf = host_buffer(bytearray(data))
    n = len(data) - offset
    return leases.grant(Staged(buf, buf, offset, n), n, IMPORTER), n


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_pull_receives_every_chunk_and_ends_the_lease(server):
    srv, leases = server
    data = os.urandom(5 * CHUNK + 123)
    lease, n = offer(leases, data, offset=7)
    dst = host_buffer(bytearray(n))
    pull(srv.address, POOL, [lease], TOKEN, IMPORTER, dst, 5.0)
    assert read_bytes(dst, n) == data[7:]
    wait_for(lambda: len(leases) == 0)
    with pytest.raises(DataLostError, match="ended or was pulled already"):
        pull(srv.address, POOL, [lease], TOKEN, IMPORTER, host_buffer(bytearray(n)), 5.0)


def test_lanes_split_whole_chunks_and_each_lands_at_its_offset(server):
    assert lanes(10 * CHUNK + 5, CHUNK, 4) == [
        (0, 3 * CHUNK),
        (3 * CHUNK, 3 * CHUNK),
        (6 * CHUNK, 3 * CHUNK),
        (9 * CHUNK, CHUNK + 5),
    ]
    assert lanes(CHUNK - 1, CHUNK, 4) == [(0, CHUNK - 1)]
    assert lanes(3 * CHUNK, CHUNK, 1) == [(0, 3 * CHUNK)]
    srv, leases = server
    data = os.urandom(10 * CHUNK + 5)
    src = host_buffer(bytearray(data))
    ids = [leases.grant(Staged(src, src, off, n), n, IMPORTER) for off, n in lanes(len(data), CHUNK, 4)]
    dst = host_buffer(bytearray(len(data)))
    pull(srv.address, POOL, ids, TOKEN, IMPORTER, dst, 5.0)
    assert read_bytes(dst, len(data)) == data
    wait_for(lambda: len(leases) == 0)


def test_a_lost_lane_fails_the_pull_and_the_other_lanes_end(server):
    srv, leases = server
    src = host_buffer(bytearray(4 * CHUNK))
    ids = [leases.grant(Staged(src, src, off, n), n, IMPORTER) for off, n in lanes(4 * CHUNK, CHUNK, 2)]
    leases.release([ids[1]])  # as if expired
    with pytest.raises(DataLostError, match="has ended"):
        pull(srv.address, POOL, ids, TOKEN, IMPORTER, host_buffer(bytearray(4 * CHUNK)), 5.0)
    wait_for(lambda: len(leases) == 0 and srv.transfers == 0)


def test_a_pull_without_the_token_is_refused_and_the_lease_stays(server):
    srv, leases = server
    lease, n = offer(leases, b"x" * 1000)
    with pytest.raises(DataLostError) as info:
        pull(srv.address, POOL, [lease], b"u" * 32, IMPORTER, host_buffer(bytearray(n)), 5.0)
    assert isinstance(info.value.__cause__, NotAMemberError)
    assert len(leases) == 1
    pull(srv.address, POOL, [lease], TOKEN, IMPORTER, host_buffer(bytearray(n)), 5.0)  # the member still gets it
    wait_for(lambda: len(leases) == 0)


def test_an_unknown_pool_or_lease_is_data_lost(server):
    srv, _leases = server
    with pytest.raises(DataLostError, match="has ended"):
        pull(srv.address, POOL, [12345], TOKEN, IMPORTER, host_buffer(bytearray(8)), 5.0)
    other = str(uuid.uuid4())
    with pytest.raises(DataLostError, match="not served here"):
        pull(srv.address, other, [12345], TOKEN, IMPORTER, host_buffer(bytearray(8)), 5.0)


def test_an_ipc_lease_cannot_be_pulled_or_ended_by_a_pull(server):
    srv, leases = server
    ipc = leases.grant(host_buffer(bytearray(8)), 8, IMPORTER)
    with pytest.raises(DataLostError, match="not a stream lease"):
        pull(srv.address, POOL, [ipc], TOKEN, IMPORTER, host_buffer(bytearray(8)), 5.0)
    assert leases.holder(ipc) is not None
    leases.release([ipc])


def test_a_size_mismatch_is_refused_before_any_byte_lands(server):
    srv, leases = server
    lease, n = offer(leases, b"y" * 100)
    with pytest.raises(DataLostError, match="the lanes hold 100 bytes, the value 101"):
        pull(srv.address, POOL, [lease], TOKEN, IMPORTER, host_buffer(bytearray(n + 1)), 5.0)
    wait_for(lambda: len(leases) == 0 and srv.transfers == 0)  # the server saw the connection close


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff\xff\xff\xff",  # a length over the limit
        struct.pack("!I", 3) + b"\xc1\xc1\xc1",  # not msgpack
        struct.pack("!I", 1) + msgpack.packb(1),  # not a map
        b"\0\0",  # cut short
    ],
)
def test_a_malformed_request_closes_only_that_connection(server, raw):
    srv, leases = server
    host, port = srv.address[len("tcp://") :].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)
        s.settimeout(5)
        while s.recv(4096):
            pass
    lease, n = offer(leases, b"z" * 10)
    pull(srv.address, POOL, [lease], TOKEN, IMPORTER, host_buffer(bytearray(n)), 5.0)  # still serving
    wait_for(lambda: len(leases) == 0)


def test_an_importer_that_hangs_up_mid_transfer_releases_the_lease(server):
    srv, leases = server
    lease, _n = offer(leases, b"w" * (64 * CHUNK))
    host, port = srv.address[len("tcp://") :].rsplit(":", 1)
    request = {
        "op": "pull",
        "pool": POOL,
        "lease": lease,
        "proof": pull_proof(TOKEN, srv.address, POOL, lease, IMPORTER),
        "requester": IMPORTER,
    }
    data = msgpack.packb(request, use_bin_type=True)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(struct.pack("!I", len(data)) + data)
        s.recv(CHUNK)  # the reply and some bytes, then hang up
    wait_for(lambda: len(leases) == 0 and srv.transfers == 0)


def test_a_dead_exporter_is_data_lost(no_fd_leak):  # noqa: F811
    leases = LeaseTable(60.0)
    srv = CopyServer(POOL, leases, "127.0.0.1", 5.0, CHUNK)
    address = srv.address
    srv.close()
    with pytest.raises(DataLostError, match="ConnectionRefusedError"):
        pull(address, POOL, [1], TOKEN, IMPORTER, host_buffer(bytearray(8)), 5.0)


@pytest.mark.parametrize("how", ["port over 65535", "not a port", "no port"])
def test_a_copy_server_address_that_is_not_host_and_port_is_data_lost_and_reaches_nobody(server, how):
    """``pull`` of an address it cannot use as it stands fails with ``DataLostError`` (Dask fetches again), and
    never connects elsewhere: a port 65536 over the server's would reach the server itself if it wrapped."""
    srv, leases = server
    port = int(srv.address.rpartition(":")[2])
    address = {
        "port over 65535": f"tcp://127.0.0.1:{port + 65536}",
        "not a port": "tcp://127.0.0.1:\u00b9\u00b2",
        "no port": "tcp://127.0.0.1",
    }[how]
    data = os.urandom(1000)
    lease, n = offer(leases, data)
    dst = host_buffer(bytearray(n))
    with pytest.raises(DataLostError, match="not tcp://host:port"):
        pull(address, POOL, [lease], TOKEN, IMPORTER, dst, 5.0)
    assert read_bytes(dst, n) == bytes(n)  # nothing landed
    pull(
        srv.address, POOL, [lease], TOKEN, IMPORTER, dst, 5.0
    )  # the lease was not pulled: its own address still serves it
    assert read_bytes(dst, n) == data


# -- review (transport): lanes queued behind other pulls ---------------------------------------------------------


class ScriptedExporter:
    """A copy server whose lanes behave as ``script(lease)`` says, asked when a lane's request arrives:
    ``(size, delay, pause)``: the lane's reply at once, then ``delay`` seconds, then its ``size`` bytes (each the
    lease's low byte), one every ``pause`` seconds (all at once for 0). Records, per lease, when the importer closed
    the lane's connection (``hung_up``) and counts the lanes answered (``replied``). Speaks the copy path's own
    messages; serves any lease (it checks nothing)."""

    def __init__(self, script: Callable[[int], tuple[int, float, float]]) -> None:
        import threading

        self.script = script
        self.hung_up: dict[int, float] = {}
        self.replied = 0  # lanes answered
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self._sock.getsockname()[1]}"
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        from dask_gpupool.transport.staging import recv_message, send_message
        from dask_gpupool.wire.codec import decode
        from dask_gpupool.wire.stream import PullReply, PullRequest

        with conn:
            request = PullRequest.from_msg(decode(recv_message(conn)))
            size, delay, pause = self.script(request.lease)
            send_message(conn, PullReply(request.lease, size, CHUNK).to_msg())
            with self._lock:
                self.replied += 1
            byte = bytes([request.lease % 256])
            try:
                time.sleep(delay)
                if pause:
                    for _ in range(size):
                        time.sleep(pause)
                        conn.sendall(byte)
                else:
                    conn.sendall(byte * size)
                conn.settimeout(10)
                conn.recv(1)  # the importer hangs up once it has the bytes (or once it stopped)
            except OSError:
                pass
            self.hung_up[request.lease] = time.monotonic()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._acceptor.join(10)
        for t in self._threads:
            t.join(30)


def test_lanes_waiting_behind_other_pulls_never_outlast_the_servers_send_timeout(no_fd_leak):  # noqa: F811
    """Lanes after the first were received by a 16-thread pool shared by every pull of the process, after all the
    pull's lanes had sent their requests: while other pulls' lanes (here 16, from a slow exporter) held those
    threads, a lane's copy server sent into a connection nobody read, gave up at its per-chunk timeout, and the
    pull failed with ``DataLostError`` (Dask fetched the value again, with the same odds). A lane now asks for its
    bytes only once a thread reads it, so a pull that finds the threads busy receives its lanes itself, one after
    the other; threads stay bounded."""
    import threading

    leases = LeaseTable(60.0)
    srv = CopyServer(POOL, leases, "127.0.0.1", 0.5, CHUNK)  # a short per-chunk send timeout
    srv.token = TOKEN
    size = 30
    slow = ScriptedExporter(lambda lease: (size, 0.0, 0.1))  # each of its lanes takes 3 s
    outcomes: list[BaseException | bytes] = []

    def slow_pull(first: int) -> None:
        dst = host_buffer(bytearray(3 * size))
        try:
            pull(slow.address, POOL, [first, first + 1, first + 2], TOKEN, IMPORTER, dst, 10.0)
            outcomes.append(read_bytes(dst, 3 * size))
        except BaseException as e:
            outcomes.append(e)

    background = [threading.Thread(target=slow_pull, args=(1 + 3 * i,)) for i in range(8)]  # 8 pulls of 3 lanes
    try:
        for t in background:
            t.start()
        wait_for(lambda: slow.replied == 24)  # every lane of theirs is being received: 16 in the shared threads
        data = os.urandom(32 << 20)
        src = host_buffer(bytearray(data))
        ids = [leases.grant(Staged(src, src, off, n), n, IMPORTER) for off, n in lanes(len(data), CHUNK, 4)]
        assert len(ids) == 4
        dst = host_buffer(bytearray(len(data)))
        pull(srv.address, POOL, ids, TOKEN, IMPORTER, dst, 10.0)
        assert read_bytes(dst, len(data)) == data
        pull_threads = [t for t in threading.enumerate() if t.name.startswith("gpupool-pull")]
        assert len(pull_threads) <= 16
        for t in background:
            t.join(30)
        expected = [bytes([(1 + 3 * i + k) % 256]) * size for i in range(8) for k in range(3)]
        assert all(isinstance(o, bytes) for o in outcomes), outcomes  # the slow pulls got their bytes too
        assert sorted(outcomes) == sorted(b"".join(expected[3 * i : 3 * i + 3]) for i in range(8))  # type: ignore
        wait_for(lambda: len(leases) == 0 and srv.transfers == 0)
        assert srv.refused == 0
    finally:
        slow.close()
        for t in background:
            t.join(30)
        srv.close()


# -- review (pull): what a pull leaves behind when it is interrupted ---------------------------------------------


def _in_frames(frame: Any, *names: str) -> bool:
    """Whether the stack from ``frame`` holds a frame of each of these functions (``module.py:function``)."""
    stack = set()
    while frame is not None:
        stack.add(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}")
        frame = frame.f_back
    return all(name in stack for name in names)


def _main_thread_in(*names: str) -> bool:
    """Whether the main thread is running all of these functions now."""
    import threading

    return _in_frames(sys._current_frames().get(threading.main_thread().ident or 0), *names)


def _sent_by_the_calling_thread() -> bool:
    """Whether the request a :class:`ScriptedExporter` just read is the main (calling) thread's: it is then in
    ``_take`` past the lane lock (``_order``), which the thread that sent a lane's request holds until its reply is
    read, not waiting for it. Where it waits for the reply cannot tell: the server may read the request before the
    calling thread, descheduled under load, has left ``send_message``."""
    import linecache
    import threading

    from dask_gpupool.transport import pull as pull_module

    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    while frame is not None and frame.f_code is not pull_module._Lanes._take.__code__:
        frame = frame.f_back
    return frame is not None and "self._order" not in linecache.getline(frame.f_code.co_filename, frame.f_lineno)


def test_a_pull_interrupted_while_it_waits_for_its_other_lanes_stops_them_before_it_raises(no_fd_leak):  # noqa: F811
    """``KeyboardInterrupt`` (Ctrl-C in a script that pulls on its main thread) while the calling thread, its own
    lane done, waits for a lane another thread receives: ``pull`` raised at once and left that lane running. Its
    connection stayed open after the pull had raised (the docstring: none is), and its bytes went on landing in
    ``dst``, which the caller frees on failure (a pool buffer that may hold another value by then). The interrupt
    now stops the other lanes like any error, and the pull raises it once they have stopped."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT interrupts only the main thread's waits")

    def script(lease: int) -> tuple[int, float, float]:
        # The lane the main thread asked for (it holds the lane lock in _take): its bytes after 0.3 s, at once;
        # the lane of the shared thread: 200 bytes over 6 s.
        return (200, 0.3, 0.0) if _sent_by_the_calling_thread() else (200, 0.0, 0.03)

    slow = ScriptedExporter(script)
    dst = host_buffer(bytearray(400))
    sent = threading.Event()

    def interrupt_in_finish() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if _main_thread_in("pull.py:pull", "pull.py:finish"):
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
                sent.set()
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=interrupt_in_finish, daemon=True)
    try:
        watcher.start()
        with pytest.raises(KeyboardInterrupt):
            pull(slow.address, POOL, [1, 2], TOKEN, IMPORTER, dst, 10.0)
        receiving = [t for t, f in sys._current_frames().items() if _in_frames(f, "pull.py:work")]
        assert sent.is_set()
        landed = read_bytes(dst, 400)
        assert receiving == [], "a thread still received a lane of the pull that raised"
        wait_for(lambda: len(slow.hung_up) == 2)  # the slow lane's server saw it closed: nothing more can land
        assert read_bytes(dst, 400) == landed, "bytes landed in dst after the pull raised"
    finally:
        watcher.join(10)
        slow.close()


def test_an_interrupt_as_the_calling_threads_lanes_end_cannot_leave_the_pull_waiting_for_ever(server):
    """An interrupt is raised at whichever bytecode the calling thread runs when it arrives. Arriving as the calling
    thread's own lanes ended, just before it counted itself out of the threads receiving them, it left that count at
    one for ever: ``finish`` waited for the calling thread itself, and the pull never returned. The interrupt is
    raised here the way a signal's would be, at that line (a trace function in the calling thread)."""
    import linecache
    import threading

    from dask_gpupool.transport import pull as pull_module

    srv, leases = server
    data = os.urandom(4 * CHUNK)
    src = host_buffer(bytearray(data))
    ids = [leases.grant(Staged(src, src, off, n), n, IMPORTER) for off, n in lanes(len(data), CHUNK, 1)]
    outcome: list[BaseException | None] = []

    def tracer(frame: Any, event: str, _arg: Any) -> Any:
        if frame.f_code.co_filename != pull_module.__file__:
            return None
        if event == "line" and "self._running -= 1" in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
            raise KeyboardInterrupt
        return tracer

    def caller() -> None:
        sys.settrace(tracer)
        try:
            pull(srv.address, POOL, ids, TOKEN, IMPORTER, host_buffer(bytearray(len(data))), 5.0)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)
        finally:
            sys.settrace(None)

    t = threading.Thread(target=caller, daemon=True)
    t.start()
    t.join(15)
    assert not t.is_alive(), "the pull waits for ever"
    assert outcome and (outcome[0] is None or isinstance(outcome[0], KeyboardInterrupt))
    wait_for(lambda: len(leases) == 0)


def test_a_pull_interrupted_as_it_cancels_its_unstarted_helpers_still_waits_for_its_lanes(no_fd_leak, monkeypatch):  # noqa: F811
    """The calling thread's own lane done, ``pull``'s ``finally`` cancels the helpers that never started, then
    waits for the lanes others receive (``finish``). A ``KeyboardInterrupt`` that landed between the two (a real
    SIGINT, raised here as the calling thread cancels a helper) skipped the wait: ``pull`` raised while a shared
    thread still received a lane into ``dst``, which the caller frees on failure. The lanes are now waited for
    whatever point of that ``finally`` the interrupt lands at, and it is raised after."""
    import signal
    import threading

    from dask_gpupool.transport import pull as pull_module

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT interrupts only the main thread")

    def script(lease: int) -> tuple[int, float, float]:
        # the calling thread's lane: at once; the shared thread's: 40 bytes over a second
        return (40, 0.0, 0.0) if _sent_by_the_calling_thread() else (40, 0.0, 0.025)

    class InterruptedCancel:
        """A helper's future whose ``cancel`` is followed by a real SIGINT to this (the main) thread."""

        def __init__(self, future: Any) -> None:
            self._future = future

        def cancel(self) -> bool:
            cancelled = self._future.cancel()
            signal.raise_signal(signal.SIGINT)  # its handler raises KeyboardInterrupt here, as this call returns
            return cancelled

    real_help = pull_module._help
    monkeypatch.setattr(
        pull_module, "_help", lambda job, wanted: [InterruptedCancel(f) for f in real_help(job, wanted)]
    )
    slow = ScriptedExporter(script)
    dst = host_buffer(bytearray(80))
    try:
        with pytest.raises(KeyboardInterrupt):
            pull(slow.address, POOL, [1, 2], TOKEN, IMPORTER, dst, 10.0)
        receiving = [t for t, f in sys._current_frames().items() if _in_frames(f, "pull.py:work")]
        landed = read_bytes(dst, 80)
        assert receiving == [], "a thread still received a lane of the pull that raised"
        wait_for(lambda: len(slow.hung_up) == 2)  # both lanes' servers saw them closed: nothing more can land
        assert read_bytes(dst, 80) == landed, "bytes landed in dst after the pull raised"
    finally:
        slow.close()
