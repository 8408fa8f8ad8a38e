from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from dask_gpupool import PoolClosedError, PoolExhaustedError, ProtocolError
from dask_gpupool._host_memory import SharedHostMemoryResource
from dask_gpupool._testing import read_bytes, write_bytes


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


def test_attributes_track_used_and_reserved():
    owner = SharedHostMemoryResource(1 << 20)
    a, b = owner.allocate(4096), owner.allocate(100)
    assert owner.attributes.used_mem_current == 4096 + 256
    a.close()
    attrs = owner.attributes
    assert (attrs.used_mem_current, attrs.used_mem_high, attrs.reserved_mem_current) == (256, 4352, 4352)
    b.close()
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

    from dask_gpupool._broker import FdBroker, request_pool_fd
    from dask_gpupool._messages import HandleReply

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
