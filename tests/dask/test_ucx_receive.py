"""The UCX receive pool: when distributed-ucxx's device frames go into an RMM pool, and why not (CPU).

The pool itself (RMM over cudaMalloc, frames received into it over UCXX) is covered by the GPU tests
(``tests/dask/test_ucxx.py``, ``receive_pool``)."""

from __future__ import annotations

import pytest
from conftest import nanny_cluster

from dask_gpupool import GPUPool
from dask_gpupool.dask import ucx_receive
from dask_gpupool.dask.distributed_seam import workers as seam

GiB = 1 << 30


@pytest.mark.parametrize(
    ("kind", "over_ucx", "resource", "ceiling", "reason"),
    [
        ("device", True, "default", GiB, "on: device frames received into an RMM pool of at most 1.00 GiB"),
        ("device", True, "PoolMemoryResource", 0, "off: RMM's resource PoolMemoryResource was set"),
        ("device", True, "CudaAsyncMemoryResource", 0, "off: RMM's resource CudaAsyncMemoryResource"),
        ("device", False, "default", 0, "off: this worker does not receive over UCX"),
        ("host", True, None, 0, "off: a host pool's worker receives device frames as distributed-ucxx does"),
        ("pinned", True, "default", 0, "off: a pinned pool's worker receives device frames as distributed-ucxx"),
        ("device", True, None, 0, "off: RMM is not installed (distributed-ucxx needs it"),
    ],
)
def test_the_receive_pool_is_decided_with_a_reason(kind, over_ucx, resource, ceiling, reason):
    """1 GiB (``UCX_RECEIVE_POOL``) on a ``device`` pool's UCX worker whose RMM resource is RMM's default; none
    beside a resource someone else set, which already serves the frames."""
    got, why = ucx_receive.decide(kind, over_ucx, resource)
    assert got == ceiling and ceiling in (0, ucx_receive.UCX_RECEIVE_POOL)
    assert why.startswith(reason), why


def test_no_receive_pool_on_a_gpu_that_distributed_ucxx_does_not_synchronize():
    """distributed-ucxx synchronizes device 0 of the process before it writes a received frame; a block of the
    receive pool given out again is safe from kernels still reading it only there."""
    got, why = ucx_receive.decide("device", True, "default", device=1)
    assert got == 0 and why.startswith("off: the worker's GPU is device 1"), why
    assert ucx_receive.decide("device", True, "default", device=0)[0] > 0


def test_a_tcp_worker_keeps_distributed_ucxx_as_it_is_and_says_why():
    """Over TCP nothing of distributed-ucxx is touched: stats() names the reason, and the counters are 0 (nothing
    in the UCX quarantine either)."""
    import dask_gpupool

    with nanny_cluster([{}], GPUPool(kind="host", max_size="64 MiB")) as c:
        (got,) = dask_gpupool.stats(c).values()
        assert got["routing"]["ucx-receive"] == "off: this worker does not receive over UCX"
        assert got["receive_pooled_bytes"] == 0 and got["receive_pool_misses"] == 0
        assert got["ucx_quarantined"] == 0 and got["ucx_quarantined_bytes"] == 0


def test_install_and_uninstall_put_back_only_what_was_there():
    """``install`` points a comm module's ``device_array`` at the pool and keeps the previous one as its fallback;
    ``uninstall`` puts it back only while the pool is still the one there (a later installer's is left alone)."""
    import types

    from dask_gpupool.handoff.stats import HandoffStats

    def own(n):  # what distributed-ucxx's init_once puts there
        return bytearray(n)

    module = types.ModuleType("comm")
    module.device_array = own
    pool = ucx_receive.ReceivePool(None, GiB, HandoffStats(), seam.device_array(module))
    previous = seam.point_device_array(module, pool.device_array)
    assert previous is own and pool.fallback is own
    assert module.device_array.__self__ is pool
    seam.restore_device_array(module, pool, previous)
    assert module.device_array is own

    seam.point_device_array(module, pool.device_array)
    later = ucx_receive.ReceivePool(None, GiB, HandoffStats(), module.device_array)
    seam.point_device_array(module, later.device_array)
    seam.restore_device_array(module, pool, own)  # not pool's any more: left as it is
    assert module.device_array.__self__ is later and later.fallback.__self__ is pool


@pytest.mark.parametrize("header", [{"nbytes": 1 << 30}, {"nbytes": 15}, {"nbytes": -1}, {}, {"nbytes": "x"}])
def test_a_device_frame_whose_header_says_another_size_is_a_protocol_error(header):
    """A UCX device frame is taken at the size it has, never at the size its header says: a header that names
    another size (or none) is a ProtocolError, as for host frames, and no Buffer past the frame's end is made.
    The frame is the plugin's own ``_DeviceFrame`` (what the receive pool
    gives distributed-ucxx) over host memory: the check runs before any CUDA call."""
    import ctypes

    from dask_gpupool import ProtocolError
    from dask_gpupool.dask.cuda_family import _cuda_deserialize_buffer, _DeviceFrame

    memory = ctypes.create_string_buffer(16)
    frame = _DeviceFrame(ctypes.addressof(memory), 16, memory)
    with pytest.raises(ProtocolError, match="device-frame header"):
        _cuda_deserialize_buffer(header, [frame])
    assert _cuda_deserialize_buffer({"nbytes": 16}, [frame]).size == 16


@pytest.mark.parametrize(
    "header, frames",
    [
        ({"nbytes": 15}, "device-frame"),  # a device frame of 16 bytes whose header says 15
        ({}, "device-frame"),  # no size at all
        ({"gpupool-host-frame": True, "nbytes": 8}, [b"abc"]),  # a host frame of a Buffer, 3 bytes for 8
        ({"gpupool-host-frame": True}, [b"abcdefgh"]),  # a host frame of a Buffer without its size
    ],
    ids=["device-frame-of-another-size", "device-frame-without-size", "host-frame-too-short", "host-frame-no-size"],
)
def test_a_malformed_device_frame_message_reaches_dask_as_data_lost(header, frames):
    """What distributed's ``"cuda"`` family calls for a Buffer (``cuda_deserialize``) raises DataLostError, caused
    by the ProtocolError, for a device- or host-frame header that does not describe its frame: a ConnectionError,
    so Dask fetches the key again, where a bare ProtocolError left the dependent task waiting for ever (Dask
    2026.8's ``gather_dep`` never retries other errors). As the ``"dask"`` family's serializers do for a malformed
    handoff header. Checked before any CUDA call or allocation."""
    import ctypes

    from cuda.core import Buffer
    from distributed.protocol.cuda import cuda_deserialize

    from dask_gpupool import DataLostError, ProtocolError
    from dask_gpupool.dask.cuda_family import _DeviceFrame

    memory = ctypes.create_string_buffer(16)
    if frames == "device-frame":
        frames = [_DeviceFrame(ctypes.addressof(memory), 16, memory)]
    with pytest.raises(DataLostError, match="could not be received") as info:
        cuda_deserialize.dispatch(Buffer)(header, frames)
    assert isinstance(info.value, ConnectionError) and isinstance(info.value.__cause__, ProtocolError)
    good = cuda_deserialize.dispatch(Buffer)({"nbytes": 16}, [_DeviceFrame(ctypes.addressof(memory), 16, memory)])
    assert good.size == 16


@pytest.mark.parametrize(
    "header, frames",
    [
        ({"shape": [3], "dtype": "<f8", "gpupool-host-frame": True}, [b"\0" * 16]),  # 16 bytes for 24
        ({"shape": [2], "gpupool-host-frame": True}, [b"\0" * 16]),  # no dtype
    ],
    ids=["too-short", "no-dtype"],
)
def test_a_malformed_cupy_host_frame_reaches_dask_as_data_lost(header, frames):
    """The ``"cuda"`` family's CuPy deserializer (:func:`~dask_gpupool.dask.cuda_family.cuda_loads_cupy`) raises
    DataLostError caused by the ProtocolError for a host-frame header that does not describe its frame, before
    CuPy is imported (so this runs on a CPU-only host)."""
    from dask_gpupool import DataLostError, ProtocolError
    from dask_gpupool.dask.cuda_family import cuda_loads_cupy

    with pytest.raises(DataLostError, match="could not be received") as info:
        cuda_loads_cupy(header, frames, lambda header, frames: None)
    assert isinstance(info.value.__cause__, ProtocolError)


def test_a_receive_pool_block_of_a_read_that_did_not_complete_is_never_given_back():
    """A comm read that raised may leave UCX writing into the device frames it received into (a cancelled or failed
    read: distributed-ucxx drops its request, which UCX cancels only when it is deallocated; a peer's ``cuda_ipc``
    copy already queued runs on). So the receive-pool blocks of a read that did not complete are parked in the
    process's quarantine, never given back to the pool (counted in ``ucx_quarantined_bytes``); those of a read that
    returned are the message's, as before. A frame asked for outside a read the worker watches (its comm-read
    wrapper, ``fill_after_read``) comes from distributed-ucxx's own ``device_array``, not from the pool.

    The comm is a real one (inproc) and the reads are what distributed-ucxx's ``read`` does with ``device_array``
    before its receives. RMM is not installed here: the pool is given plain objects for RMM's pool resource and
    ``DeviceBuffer`` (it only keeps references to them); the receives into RMM memory run in the GPU tests."""
    import asyncio
    import gc
    import types
    import weakref
    from typing import Any

    from distributed.comm import CommClosedError, connect, listen

    from dask_gpupool.dask.comms import read_then_fill
    from dask_gpupool.handoff.stats import HandoffStats
    from dask_gpupool.memory.lifetime import QUARANTINE

    class Block:  # a block of the pool: rmm.DeviceBuffer(size=n, mr=pool)
        def __init__(self, size: int, mr: Any) -> None:
            self.nbytes = size

    rmm = types.SimpleNamespace(
        DeviceBuffer=Block,
        mr=types.SimpleNamespace(CudaMemoryResource=object, PoolMemoryResource=lambda upstream, **_: object()),
    )
    handoffs = HandoffStats()
    pool = ucx_receive.ReceivePool(rmm, GiB, handoffs, bytearray)  # fallback: distributed-ucxx's own device_array
    given: list[weakref.ref[Any]] = []

    async def failing_read(deserializers: Any = None) -> Any:
        frames = [pool.device_array(1 << 20)]  # distributed-ucxx's read: the frames first, then a receive each
        given.append(weakref.ref(frames[0]))
        try:
            raise OSError("the endpoint closed during the receive")
        except OSError as e:
            raise CommClosedError("Connection closed by writer") from e

    async def read(deserializers: Any = None) -> Any:
        frames = [pool.device_array(2 << 20)]
        given.append(weakref.ref(frames[0]))
        return {"frames": len(frames)}

    async def main() -> None:
        async def serve(comm: Any) -> None:
            await comm.read()

        listener = await listen("inproc://", serve)
        comm = await connect(listener.contact_address)
        try:
            with pytest.raises(CommClosedError):
                await read_then_fill(comm, failing_read, "ucxx://127.0.0.1:40051")()
            assert await read_then_fill(comm, read, "ucxx://127.0.0.1:40051")() == {"frames": 1}
        finally:
            comm.abort()
            listener.stop()

    count, nbytes = QUARANTINE.count, QUARANTINE.nbytes
    asyncio.run(main())
    gc.collect()
    failed, completed = given
    assert failed() is not None, "a block UCX may still write went back to the pool"
    assert completed() is None  # a completed read's frames are the message's: gone with it
    assert (QUARANTINE.count - count, QUARANTINE.nbytes - nbytes) == (1, 1 << 20)
    assert handoffs.receive_pooled_bytes == 3 << 20
    outside = pool.device_array(4096)  # not in a watched read (a client's, or a handler's on an accepted comm)
    assert type(outside) is bytearray and handoffs.receive_pooled_bytes == 3 << 20
