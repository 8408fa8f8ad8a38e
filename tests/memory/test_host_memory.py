from __future__ import annotations

import gc
import os
from typing import Any

import numpy as np
import pytest

from dask_gpupool import PoolClosedError, PoolExhaustedError, PoolUnavailableError, ProtocolError
from dask_gpupool.memory.host import SharedHostMemoryResource
from dask_gpupool.testing import read_bytes, write_bytes


def test_peer_mapping_sees_owner_bytes_without_copy(no_fd_leak):
    owner = SharedHostMemoryResource(1 << 20)
    buf = owner.allocate(1000)
    write_bytes(buf, b"written by the owner")
    mapped = SharedHostMemoryResource.from_allocation_handle(owner.allocation_handle)
    view = mapped.import_buffer(owner.offset_of(buf), buf.size)
    assert read_bytes(view, 20) == b"written by the owner"
    write_bytes(buf, b"WRITTEN")  # the same pages: later writes show through
    assert read_bytes(view, 7) == b"WRITTEN"
    assert np.from_dlpack(view).nbytes == 1000  # a real cuda.core Buffer
    view.close()
    mapped.close()
    buf.close()
    owner.close()


def test_the_peer_pages_resident_here_are_counted_fresh_at_every_read(no_fd_leak):
    """What Dask reads as this process's memory leaves out a peer's pages the moment they are read in, and counts
    neither the owner's own pages nor other shared memory resident before (a driver's; here 8 MiB of an
    anonymous shared mapping): the owner's 64 MiB written here, then 8 MiB and 24 MiB of them read
    through a peer's mapping of the same pool (the same process plays both: its page tables hold the pages once per
    mapping)."""
    import mmap

    from dask_gpupool.memory.lifetime import peer_resident_bytes

    MiB = 1 << 20
    other = mmap.mmap(-1, 8 * MiB, flags=mmap.MAP_SHARED)
    other.write(b"\1" * (8 * MiB))
    owner = SharedHostMemoryResource(128 * MiB)
    buf = owner.allocate(64 * MiB)
    np.from_dlpack(buf).view(np.uint8)[:] = 1
    mapped = SharedHostMemoryResource.from_allocation_handle(owner.allocation_handle)
    view = mapped.import_buffer(owner.offset_of(buf), buf.size)
    pages = np.from_dlpack(view).view(np.uint8)
    try:
        assert peer_resident_bytes() < 1 * MiB
        for read in (8, 24):
            assert int(pages[: read * MiB : 4096].sum()) == read * MiB // 4096
            assert abs(peer_resident_bytes() - read * MiB) < 1 * MiB, read
    finally:
        del pages
        view.close()
        mapped.close()
        buf.close()
        owner.close()
        other.close()


def test_attributes_track_used_and_resident_bytes():
    owner = SharedHostMemoryResource(1 << 20)
    a, b = owner.allocate(4096), owner.allocate(100)
    assert owner.attributes.used_mem_current == 4096 + 256
    assert owner.attributes.reserved_mem_current == 0  # sparse: nothing written yet
    write_bytes(a, b"x" * 4096)
    assert owner.attributes.reserved_mem_current == 4096
    a.close()  # small: its page stays until a trim
    attrs = owner.attributes
    assert (attrs.used_mem_current, attrs.used_mem_high, attrs.reserved_mem_current) == (256, 4352, 4096)
    assert owner.trim() == 0 and owner.attributes.reserved_mem_high == 4096
    b.close()
    owner.close()


def test_freed_memory_goes_back_to_the_os_for_owner_and_peers(no_fd_leak):
    """A freed large buffer's pages leave the memfd at once; a trim takes the small free ones. Beyond the kept
    range, which this pool has none of (pages kept resident: tests/memory/test_host_kept_pages.py)."""
    owner = SharedHostMemoryResource(64 << 20, keep_resident=0)
    big = owner.allocate(16 << 20)
    small = owner.allocate(1000)
    write_bytes(big, b"\x07" * (16 << 20))
    write_bytes(small, b"s" * 1000)
    mapped = SharedHostMemoryResource.from_allocation_handle(owner.allocation_handle)
    view = mapped.import_buffer(owner.offset_of(big), big.size)
    assert read_bytes(view, 4) == b"\x07" * 4
    view.close()  # the peer lets go first, as its lease requires
    resident = owner.attributes.reserved_mem_current
    assert resident >= (16 << 20) + 4096
    big.close()
    assert owner.attributes.reserved_mem_current <= resident - (16 << 20)
    assert read_bytes(small, 1) == b"s"  # its neighbour keeps its bytes
    small.close()
    assert owner.attributes.reserved_mem_current == 4096  # one small page is left ...
    owner.trim()
    assert owner.attributes.reserved_mem_current == 0  # ... until a trim
    again = owner.allocate(16 << 20)  # the pages come back as zeros when touched
    assert read_bytes(again, 4) == b"\0" * 4
    again.close()
    mapped.close()
    owner.close()


def test_full_pool_raises_our_out_of_memory_error():
    owner = SharedHostMemoryResource(4096)
    keep = owner.allocate(4096)
    with pytest.raises(PoolExhaustedError):
        owner.allocate(1)
    keep.close()
    owner.close()


@pytest.mark.parametrize(("offset", "size"), [(-1, 10), (0, (1 << 20) + 1), ((1 << 20) - 5, 10), ("0", 1)])
def test_imports_outside_the_pool_are_refused(offset, size):
    owner = SharedHostMemoryResource(1 << 20)
    mapped = SharedHostMemoryResource.from_allocation_handle(owner.allocation_handle)
    with pytest.raises(ProtocolError):
        mapped.import_buffer(offset, size)
    mapped.close()
    owner.close()


def test_close_waits_for_live_buffers_and_is_idempotent(no_fd_leak):
    owner = SharedHostMemoryResource(1 << 20)
    buf = owner.allocate(64)
    write_bytes(buf, b"alive")
    owner.close()
    owner.close()
    assert read_bytes(buf, 5) == b"alive"  # still mapped: a buffer is live
    with pytest.raises(PoolClosedError):
        owner.allocate(1)
    with pytest.raises(PoolClosedError):
        _ = owner.allocation_handle
    del buf
    gc.collect()
    assert owner._mmap is None  # unmapped once the last buffer went


def test_mapping_holds_no_fd_of_the_caller():
    owner = SharedHostMemoryResource(1 << 16)
    fd = os.dup(owner.allocation_handle)
    mapped = SharedHostMemoryResource.from_allocation_handle(fd)
    os.close(fd)  # the caller's fd is the caller's; the mapping stays valid
    buf = owner.allocate(8)
    write_bytes(buf, b"12345678")
    assert read_bytes(mapped.import_buffer(owner.offset_of(buf), 8)) == b"12345678"


def test_a_receiver_cannot_resize_the_pool_and_mappings_still_read(tmp_path, no_fd_leak):
    """The memfd is sealed against shrinking and growing: a peer that gets the fd (over a real
    broker) cannot ftruncate it, which would SIGBUS every process that maps the pool."""
    import fcntl

    from dask_gpupool.transport.broker import FdBroker
    from dask_gpupool.transport.link import request_pool_fd
    from dask_gpupool.wire.broker import HandleReply

    owner = SharedHostMemoryResource(1 << 20)
    buf = owner.allocate(4096)
    write_bytes(buf, b"still here")
    pool = str(owner.uuid)
    token = b"t" * 32
    broker = FdBroker(
        lambda p: (owner.allocation_handle, HandleReply(pool, "host", owner.size)), str(tmp_path), 5, pool, token
    )
    try:
        _reply, fd = request_pool_fd(broker.address, pool, 5, token)
    finally:
        broker.close()
    try:
        mapped = SharedHostMemoryResource.from_allocation_handle(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        for size in (0, 4096, (1 << 20) - 1, 1 << 21):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
        with pytest.raises(PermissionError):  # nor can the seals be taken back or changed
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        assert os.fstat(fd).st_size == 1 << 20
    finally:
        os.close(fd)
    view = mapped.import_buffer(owner.offset_of(buf), buf.size)
    assert read_bytes(view, 10) == b"still here"  # both mappings still read the pool
    assert read_bytes(buf, 10) == b"still here"
    view.close()
    mapped.close()
    buf.close()
    owner.close()


def test_as_array_views_a_pool_buffer_and_refuses_anything_else():
    from dask_gpupool import as_array

    owner = SharedHostMemoryResource(1 << 20)
    buf = owner.allocate(800)
    arr = as_array(buf, (10, 10), "f8")
    arr[...] = 2.0
    assert isinstance(arr, np.ndarray) and float(as_array(buf, 100, "f8").sum()) == 200.0
    with pytest.raises(TypeError, match=r"as_array views a cuda\.core Buffer .*not a numpy\.ndarray"):
        as_array(np.zeros(10), 10, "f8")
    with pytest.raises(ValueError, match="holds Python objects"):
        as_array(buf, 10, object)
    with pytest.raises(ValueError, match="does not fit"):
        as_array(buf, 101, "f8")
    del arr
    buf.close()
    owner.close()


def _rss_shmem() -> int:
    """Bytes of shared memory resident in this process (``RssShmem`` of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    return 0


def _peer_pages_left_out(dask_worker) -> int:
    """Bytes the worker's ``rss`` holds above the process memory Dask reads (``monitor.get_process_memory``)."""
    import psutil

    return psutil.Process().memory_info().rss - dask_worker.monitor.get_process_memory()


def test_a_handoff_and_release_leave_no_shared_memory_resident_in_either_worker():
    """256 MiB handed over between Nanny workers, then released: the pages stay in the owner's kept range, and a
    trim takes them: both workers' RssShmem drops, and the owner's pool reports it."""
    from conftest import back_to, counters, nanny_cluster, wait_for, warm_up, worker_addresses

    import dask_gpupool
    from dask_gpupool import GPUPool
    from dask_gpupool import testing as T
    from dask_gpupool.tuning import HOST_KEEP_RESIDENT

    size = 256 << 20
    with nanny_cluster([{}, {}], GPUPool(kind="host", max_size="1 GiB")) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        before = c.run(lambda: _rss_shmem())
        x = c.submit(T.fill, size, 7, workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.all_equal, y, 7, workers=[b], pure=False).result()
        during = c.run(lambda: _rss_shmem())
        assert min(during[a] - before[a], during[b] - before[b]) >= size * 0.9  # both map the same pages
        # ... but B's process memory, as Dask sees it (pause threshold, the scheduler's figures), leaves A's pages out
        peer = c.run(_peer_pages_left_out)
        assert peer[b] >= size * 0.9 and peer[a] < size // 8, peer
        # ... and so do the figures the scheduler gets in B's heartbeats: B's process memory is below its RSS
        # by A's pages, and the value's bytes (managed on both, as for any replica) are not unmanaged memory too
        rss_b = c.run(lambda: __import__("psutil").Process().memory_info().rss, workers=[b])[b]

        def scheduler_view(dask_scheduler, b=b):
            m = dask_scheduler.workers[b].memory
            return m.process, m.managed, m.unmanaged

        wait_for(lambda: c.run_on_scheduler(scheduler_view)[0] < rss_b - size * 0.8, what="B's heartbeat")
        process, managed, unmanaged = c.run_on_scheduler(scheduler_view)
        assert managed + unmanaged == process and unmanaged < size // 2, (process, managed, unmanaged)
        assert counters(c, b)[b]["zero_copy_bytes"] >= size
        del x, y
        wait_for(lambda: dask_gpupool.pool_stats(c)[a]["used"] == 0, what="A's buffer to go")
        # its pages lie in A's kept range (tuning.HOST_KEEP_RESIDENT), resident for the next buffers there until a
        # trim; B still leaves them out of its own figure
        assert dask_gpupool.pool_stats(c)[a]["reserved"] <= HOST_KEEP_RESIDENT + size // 8
        trimmed = dask_gpupool.trim(c)
        assert trimmed[a]["reserved"] == trimmed[b]["reserved"] == 0  # nothing live: every page went back
        after = c.run(lambda: _rss_shmem())
        assert after[a] - before[a] < size // 8 and after[b] - before[b] < size // 8, (before, after)
        assert max(c.run(_peer_pages_left_out).values()) < size // 8
        back_to(c, baseline)


def test_a_peer_fd_that_cannot_be_mapped_read_write_is_a_protocol_error_and_leaks_no_fd(no_fd_leak):
    """A peer's pool fd that cannot be mapped for writing (a memfd sealed against writes) is a ProtocolError of
    ours, and the mapping's own duplicate of it is closed: retried handoffs from that pool leak nothing.
    The caller's fd stays the caller's."""
    import fcntl

    fd = os.memfd_create("sealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 1 << 20)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        for _ in range(3):
            with pytest.raises(ProtocolError, match="cannot be mapped"):
                SharedHostMemoryResource.from_allocation_handle(fd)
        os.fstat(fd)  # still open
    finally:
        os.close(fd)


def test_a_buffer_freed_by_the_garbage_collector_inside_an_allocation_does_not_deadlock_it():
    """A pool Buffer in a reference cycle (a traceback's frame, a task's closure) is freed whenever the
    collector runs: also inside the pool's own allocate or trim, on the thread that holds the pool's locks.
    Its free must neither wait for those locks (a deadlock) nor lose its range."""
    from conftest import run_with_frequent_collections

    owner = SharedHostMemoryResource(64 << 20)

    def step() -> None:
        b = owner.allocate(128 << 10)
        cycle: list[Any] = [b]
        cycle.append(cycle)
        del b, cycle
        owner.allocate(100).close()
        owner.trim()

    run_with_frequent_collections(step)
    gc.collect()
    assert owner.attributes.used_mem_current == 0
    owner.allocate(64 << 20).close()  # every range came back, coalesced
    owner.close()


def test_the_collector_check_fails_while_a_collection_is_stuck_on_another_thread():
    """Why the garbage-collector tests first check that ``gc.collect()`` collects: a finalizer blocked on another
    thread (an earlier case's deadlock) stops every later collection in the process, so pool Buffers in cycles stay
    allocated and a used-bytes check fails for a reason that is not the pool's (``[arena]`` on an H100, after
    ``[rmm]`` deadlocked)."""
    import threading

    from conftest import assert_the_collector_collects

    release = threading.Event()
    entered = threading.Event()

    class Blocks:
        def __del__(self) -> None:
            entered.set()
            release.wait(30)

    def collect_a_blocking_cycle() -> None:
        cycle: list[Any] = [Blocks(), None]
        cycle[1] = cycle
        del cycle
        gc.collect()

    t = threading.Thread(target=collect_a_blocking_cycle, daemon=True)
    t.start()
    try:
        assert entered.wait(10)
        with pytest.raises(AssertionError, match="stuck on another thread"):
            assert_the_collector_collects()
    finally:
        release.set()
        t.join(10)
    assert_the_collector_collects()


def test_closing_while_another_thread_allocates_never_hands_out_unmapped_memory():
    """Pool.close on teardown while a task or the offload thread allocates: an allocation either fails with
    PoolClosedError or gets a buffer whose memory stays mapped until it is freed (before: the allocation passed
    the closed check, close unmapped the pool, then the arena handed out a range of the unmapped memory)."""
    import sys
    import threading

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(500):
            owner = SharedHostMemoryResource(1 << 20)
            unmapped: list[Any] = []

            def allocate(owner: SharedHostMemoryResource = owner, unmapped: list[Any] = unmapped) -> None:
                while True:
                    try:
                        b = owner.allocate(64)
                    except PoolClosedError:
                        return
                    if owner._mmap is None:
                        unmapped.append(b)
                        return
                    b.close()

            t = threading.Thread(target=allocate)
            t.start()
            owner.close()
            t.join()
            assert not unmapped, "a buffer was handed out over the closed pool's unmapped memory"
    finally:
        sys.setswitchinterval(interval)


def test_a_forked_child_neither_gives_back_nor_hands_out_the_parents_memory():
    """A task that forks (multiprocessing's default start method on Linux) leaves the child a copy of the pool:
    the child's frees and trims must not punch holes in the memfd the parent's live buffers use, and the
    child cannot allocate from it (its copy of the arena would hand out ranges the parent uses)."""
    owner = SharedHostMemoryResource(8 << 20)
    buf = owner.allocate(1 << 20)
    write_bytes(buf, b"\x07" * (1 << 20))
    pid = os.fork()
    if pid == 0:  # the child: free its copy of the buffer, trim, try to allocate; exit code says what happened
        code = 0
        try:
            buf.close()
            owner.trim()
            try:
                owner.allocate(4096)
                code = 3
            except PoolUnavailableError:
                pass
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert read_bytes(buf, 1 << 20) == b"\x07" * (1 << 20), "the child's free zeroed the parent's live buffer"
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child could allocate from the parent's pool"
    assert owner.attributes.used_mem_current == 1 << 20
    buf.close()
    owner.close()


@pytest.mark.parametrize(
    ("size", "error"),
    [(-1, ValueError), (1.5, TypeError), ("8", TypeError), (None, TypeError), (2**64, PoolExhaustedError)],
)
def test_a_pool_refuses_sizes_that_are_not_byte_counts_by_name(size, error):
    """``Pool.allocate`` of a size that is negative, not an integer, or larger than the pool: a clear error that
    names the pool, and nothing allocated (``1.5`` was a buffer of 1 byte; ``np.int64(2**63 - 100)``, below, one
    of 2**63 bytes over 256)."""
    import numpy as np

    from dask_gpupool.config import PoolOptions
    from dask_gpupool.memory.pool import Pool
    from dask_gpupool.memory.topology import LocalDevices

    pool = Pool.create(PoolOptions.from_config(kind="host", max_size="16 MiB"), LocalDevices(()))
    try:
        for s in (size, np.int64(2**63 - 100)) if error is PoolExhaustedError else (size,):
            with pytest.raises(error) as got:
                pool.allocate(s)
            if error is PoolExhaustedError:
                assert pool.uuid in str(got.value) and str(16 << 20) in str(got.value)
        assert pool.stats().used == 0
        empty = pool.allocate(0)
        assert empty.size == 0
        empty.close()
        assert pool.stats().used == 0
    finally:
        pool.close()


def test_reading_the_stats_while_the_pool_closes_is_never_an_error():
    """``Pool.stats()`` reads the memfd's resident pages; a close on another thread closed the fd between the
    check and the ``fstat`` (``OSError: [Errno 9] Bad file descriptor``, or the figures of whatever file took
    the fd number since)."""
    import sys
    import threading

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(100):
            owner = SharedHostMemoryResource(1 << 20)
            errors: list[BaseException] = []

            def read(owner: SharedHostMemoryResource = owner, errors: list[BaseException] = errors) -> None:
                while not owner.is_closed:
                    try:
                        _ = owner.attributes
                    except BaseException as e:
                        errors.append(e)
                        return

            t = threading.Thread(target=read)
            t.start()
            owner.close()
            t.join()
            assert not errors, errors
            assert owner.attributes.reserved_mem_current == 0
    finally:
        sys.setswitchinterval(interval)
