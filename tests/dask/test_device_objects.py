"""The serialization family that sends "cuda"-serialized objects frame by frame (``dask/frames_family.py``).

What runs without a GPU: the family declines everything outside a same-host reply from a ``device``
pool (so Dask's own families serialize as before), its wire format round-trips an object whose ``cuda``
serializer gives host frames, and malformed headers fail with a clear error. The device frames themselves are
exercised on a GPU: ``tests/dask/test_device_values.py::test_device_objects_go_frame_by_frame_over_tcp``.
"""

from __future__ import annotations

from typing import Any

import pytest
from distributed.protocol import deserialize, serialize
from distributed.protocol.cuda import cuda_deserialize, cuda_serialize
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_gpupool.dask import frames_family as D
from dask_gpupool.errors import DataLostError, ProtocolError


class HostRecord:
    """A type with a ``"cuda"`` serializer whose frames are all host memory."""

    def __init__(self, tag: str, payload: bytes) -> None:
        self.tag, self.payload = tag, payload


def _no_cupy(deserialize: bool) -> Any:
    """The CuPy serializer a family is given: objects whose frames are all host memory never ask for it."""
    raise AssertionError("an object with host frames only went through the CuPy serializer")


#: The family as the package registers it, but with no CuPy serializer.
FAMILY = D.FramesFamily(_no_cupy)


@cuda_serialize.register(HostRecord)
def _dumps_record(x: HostRecord) -> tuple[dict[str, Any], list[Any]]:
    return {"tag": x.tag}, [x.payload, b"second"]


@cuda_deserialize.register(HostRecord)
def _loads_record(header: dict[str, Any], frames: list[Any]) -> HostRecord:
    assert bytes(frames[1]) == b"second"
    return HostRecord(header["tag"], bytes(frames[0]))


def test_the_family_is_registered_and_declines_outside_a_same_host_reply():
    """Outside a ``get_data`` reply to a same-host worker (no request here), the family steps aside: Dask's next
    family serializes the object, and it deserializes as before."""
    x = HostRecord("a", b"payload")
    with pytest.raises(NotImplementedError):
        FAMILY.dumps(x)
    header, frames = serialize(x, serializers=[D.FAMILY, "dask", "pickle"], on_error="raise")
    assert header["serializer"] == "pickle"
    back = deserialize(header, frames)
    assert (back.tag, back.payload) == ("a", b"payload")
    assert D.serializers_for(None) is None  # type: ignore[arg-type]


def test_the_wire_format_round_trips_an_object_with_host_frames():
    """``_dumps_frames`` plus the family header, read back by ``loads``: the same object, the type found by name."""
    x = HostRecord("tag-1", b"\x00\x01\x02")
    sub, frames = D._dumps_frames(x, cuda_serialize.dispatch(HostRecord), _no_cupy)
    header = {"sub-header": sub, "type": D._type_name(HostRecord)}
    assert sub[D.FRAMES_KEY]["parts"] == [{"host": True}, {"host": True}]
    back = FAMILY.loads(header, frames)
    assert type(back) is HostRecord
    assert (back.tag, back.payload) == ("tag-1", b"\x00\x01\x02")


def test_the_header_survives_msgpack_as_distributed_reads_it():
    """distributed packs a sub-header with msgpack and reads it back with ``use_list=False`` (lists come back as
    tuples): the family's header, so packed, still rebuilds the object through distributed's ``deserialize``."""
    import msgpack

    x = HostRecord("tag-2", b"abc")
    sub, frames = D._dumps_frames(x, cuda_serialize.dispatch(HostRecord), _no_cupy)
    header = {"sub-header": sub, "type": D._type_name(HostRecord), "compression": (False,) * len(frames)}
    header["serializer"] = D.FAMILY
    wire = msgpack.loads(msgpack.dumps(header, use_bin_type=True), use_list=False, raw=False)
    assert isinstance(wire["sub-header"][D.FRAMES_KEY]["parts"], tuple)
    back = deserialize(wire, frames)
    assert (type(back), back.tag, back.payload) == (HostRecord, "tag-2", b"abc")


def test_a_type_found_again_by_name_is_the_same_type_and_a_local_one_is_not_found():
    assert D._type_from_name(D._type_name(HostRecord)) is HostRecord

    class Local:
        pass

    with pytest.raises(ProtocolError, match="cannot be imported"):
        D._type_from_name(D._type_name(Local))


_EMPTY = {D.FRAMES_KEY: {"header": {}, "parts": []}}


@pytest.mark.parametrize(
    "header, frames, match",
    [
        ({}, [], "missing field"),
        ({"type": D._type_name(HostRecord), "sub-header": {}}, [], "missing field"),
        ({"type": "no-colon", "sub-header": _EMPTY}, [], "module>:<qualname"),
        ({"type": "nosuchmodule_x:T", "sub-header": _EMPTY}, [], "imported"),
        ({"type": "os:sep", "sub-header": _EMPTY}, [], "not a type"),
        ({"type": "builtins:int", "sub-header": _EMPTY}, [], "no cuda deserializer"),
        (
            {"type": D._type_name(HostRecord), "sub-header": {D.FRAMES_KEY: {"header": {}, "parts": [{"host": True}]}}},
            [b"a", b"b"],
            "do not match",
        ),
    ],
    ids=["empty", "no-frames-key", "bad-name", "no-module", "not-a-type", "no-deserializer", "frame-count"],
)
def test_a_malformed_header_is_data_lost_so_dask_fetches_again(header, frames, match):
    """A ``DataLostError`` (a ``ConnectionError``: Dask fetches the value again) whose cause names what is wrong."""
    with pytest.raises(DataLostError, match=match) as got:
        FAMILY.loads(header, frames)
    assert isinstance(got.value.__cause__, ProtocolError)


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["host", "device", "frames", "x"]), inner)
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(
    sub=st.one_of(
        _VALUES, st.fixed_dictionaries({D.FRAMES_KEY: st.fixed_dictionaries({"header": _VALUES, "parts": _VALUES})})
    ),
    nframes=st.integers(0, 3),
)
def test_any_garbage_in_the_header_is_data_lost(sub, nframes):
    """A peer's header is input: whatever its sub-header holds, ``loads`` rebuilds the object (host parts that add
    up) or raises ``DataLostError``, never another error."""
    header = {"type": D._type_name(HostRecord), "sub-header": sub}
    frames = [b"x"] * nframes
    try:
        FAMILY.loads(header, frames)
    except DataLostError:
        pass


def test_staging_for_ucx_is_timed_in_its_parts():
    """``device-stage`` (and ``device-stage-alloc`` only for new staging memory) and ``device-serialize``: the split
    that says where a staged value's time goes on a UCX cluster (the staging itself needs a GPU)."""
    import time
    from types import SimpleNamespace

    from dask_gpupool.dask import cuda_family as F
    from dask_gpupool.handoff.stats import HandoffStats

    stats = HandoffStats()
    request: Any = SimpleNamespace(service=SimpleNamespace(handoffs=stats))
    start = time.perf_counter()
    F._timed_stage(request, start, SimpleNamespace(alloc_s=0.0), time.perf_counter())  # type: ignore[arg-type]
    F._timed_stage(request, start, SimpleNamespace(alloc_s=0.002))  # type: ignore[arg-type]
    F._timed_stage(None, start, SimpleNamespace(alloc_s=0.002))  # type: ignore[arg-type]  # no reply: not timed
    timings = stats.to_msg()["timings"]
    assert timings["device-stage"]["count"] == 2
    assert timings["device-stage-alloc"]["count"] == 1 and timings["device-stage-alloc"]["total_s"] == 0.002
    assert timings["device-serialize"]["count"] == 1


def test_staging_copies_are_waited_for_unless_the_comm_synchronizes_the_gpu():
    """A staging copy for UCX is left unwaited only in a ``get_data`` reply over distributed-ucxx (schemes ``ucx`` and
    ``ucxx``), whose ``write`` synchronizes the GPU before it sends device frames; anywhere else it is waited for."""
    from types import SimpleNamespace

    from dask_gpupool.dask import cuda_family as F

    assert not F._comm_synchronizes(None)  # no reply being serialized
    gpu0 = SimpleNamespace(pool=SimpleNamespace(device=0))
    for scheme, synchronizes in [("ucxx", True), ("ucx", True), ("tcp", False), ("tls", False), ("inproc", False)]:
        request: Any = SimpleNamespace(scheme=scheme, service=gpu0)
        assert F._comm_synchronizes(request) is synchronizes, scheme
    # distributed-ucxx synchronizes device 0 of the process, whatever GPU the worker uses: a worker on another
    # ordinal waits for its staging copy itself
    other_gpu: Any = SimpleNamespace(scheme="ucxx", service=SimpleNamespace(pool=SimpleNamespace(device=1)))
    assert F._comm_synchronizes(other_gpu) is False


def test_distributed_ucxx_synchronizes_the_gpu_before_it_sends_device_frames():
    """What leaving the staging copy unwaited rests on: distributed-ucxx's ``write`` synchronizes the GPU (the
    default stream, through cuda.core's ``Device.sync``, a whole-context synchronize) whenever a frame it sends has
    ``__cuda_array_interface__``. Fails when a distributed-ucxx release stops doing so (runs where it is installed:
    the GPU machine)."""
    import inspect

    ucxx_comm = pytest.importorskip("distributed_ucxx.ucxx")
    context = pytest.importorskip("ucxx._cuda_context")
    write = inspect.getsource(ucxx_comm.UCXX.write)
    assert write.count("synchronize_stream(CudaStream.Default)") >= 2, "both send paths synchronize"
    assert "__cuda_array_interface__" in write
    assert "synchronize_default_stream" in inspect.getsource(ucxx_comm.synchronize_stream)
    assert ".sync()" in inspect.getsource(context.synchronize_default_stream)


@pytest.mark.parametrize(
    ("shape", "dtype", "strides"),
    [
        ((3, 4), "f8", (32, 8)),
        ((5,), "i2", (2,)),
        ((), "f4", ()),
        ((0, 5), "f8", (40, 8)),
        ((2, 1, 3), "u1", (3, 3, 1)),
    ],
)
def test_a_staged_cupy_header_is_distributeds_for_a_c_ordered_array(shape, dtype, strides):
    """The header a staged CuPy array goes with (built without a CuPy array): what distributed's
    ``cuda_deserialize_cupy_ndarray`` reads, C-ordered strides (the GPU test compares it with distributed's own)."""
    import msgpack
    import numpy as np

    from dask_gpupool.dask.cuda_family import staged_cupy_header

    header = staged_cupy_header(shape, np.dtype(dtype), 1234)
    assert header["shape"] == shape and header["typestr"] == np.dtype(dtype).str and header["strides"] == strides
    if 0 not in shape:
        assert np.empty(shape, dtype).strides == strides  # NumPy's C order agrees (it gives 0s for empty arrays)
    msgpack.packb(header)  # it travels in the message header


@pytest.mark.parametrize(
    ("header", "frames"),
    [
        ({"shape": [2], "gpupool-host-frame": True}, [b"\0" * 16]),  # no dtype
        ({"shape": [3], "dtype": "<f8", "gpupool-host-frame": True}, [b"\0" * 16]),  # 16 bytes for 24
        ({"shape": [2], "dtype": "<f8", "gpupool-host-frame": True}, [b"\0" * 8, b"\0" * 8]),  # two frames
        ({"shape": "two", "dtype": "<f8", "gpupool-host-frame": True}, [b"\0" * 16]),
        ({"shape": [2], "dtype": "not-a-dtype", "gpupool-host-frame": True}, [b"\0" * 16]),
    ],
)
def test_a_malformed_host_frame_is_a_protocol_error_before_anything_is_allocated(header, frames):
    """Host frames (tuning.UCX_HOST_FRAME_THRESHOLD): a host-frame header that does not describe its frame (no dtype,
    a size that does not match, more than one frame, a bad shape or dtype) raises ProtocolError, checked on the host
    before the receiver allocates GPU memory (so this runs without CuPy)."""
    from dask_gpupool.dask import ucx_host_frames as H

    with pytest.raises(ProtocolError, match="malformed host-frame header"):
        H.cupy_from_host_frame(header, frames, None)


def test_a_buffers_host_frame_lands_in_the_receivers_pool_and_a_malformed_one_allocates_nothing(tmp_path, no_fd_leak):
    """Host frames (tuning.UCX_HOST_FRAME_THRESHOLD), a pool Buffer's receiving side: the host frame's bytes land in
    a new buffer of this worker's pool (a ``host`` pool stands in for the device pool; the copy is the same
    ``copy_from_host``), counted in ``host_frames_bytes``, or outside a full pool (fallback ``receiver-pool-full``),
    as host copies land; a header that does not describe its frame raises ProtocolError before anything is
    allocated, and without a pool in the process it is a ProtocolError too."""
    import ctypes

    from dask_gpupool import PoolOptions
    from dask_gpupool.dask import cuda_family as F
    from dask_gpupool.dask.ucx_host_frames import HOST_FRAME_KEY
    from dask_gpupool.handoff.startup import start_service

    with pytest.raises(ProtocolError, match="without a pool"):
        F._cuda_deserialize_buffer({HOST_FRAME_KEY: True, "nbytes": 3}, [b"abc"])
    options = PoolOptions.from_config(kind="host", max_size="16 MiB", broker_dir=str(tmp_path))
    service = start_service(options, "tcp://127.0.0.1:40011")
    try:
        got = F._cuda_deserialize_buffer({HOST_FRAME_KEY: True, "nbytes": 12}, [b"copied bytes"])
        assert service.pool.owns(got) and ctypes.string_at(int(got.handle), 12) == b"copied bytes"
        assert service.handoffs.to_msg()["host_frames_bytes"] == 12
        used = service.pool.stats().used
        for header, frames in [
            ({HOST_FRAME_KEY: True}, [b"abc"]),  # no size
            ({HOST_FRAME_KEY: True, "nbytes": 4}, [b"abc"]),  # 3 bytes for 4
            ({HOST_FRAME_KEY: True, "nbytes": 3}, [b"abc", b"abc"]),  # two frames
        ]:
            with pytest.raises(ProtocolError, match="malformed host-frame header"):
                F._cuda_deserialize_buffer(header, frames)
        assert service.pool.stats().used == used  # nothing allocated for them
        big = bytes(range(256)) * (32 << 12)  # 32 MiB, more than the 16 MiB pool holds
        outside = F._cuda_deserialize_buffer({HOST_FRAME_KEY: True, "nbytes": len(big)}, [big])
        assert not service.pool.owns(outside) and ctypes.string_at(int(outside.handle), 256) == big[:256]
        assert service.handoffs.to_msg()["fallbacks"].get("receiver-pool-full") == 1
        outside.close()
        got.close()
    finally:
        service.close()


def test_host_frames_go_only_in_small_ucx_replies_to_workers_that_run_the_plugin(tmp_path, no_fd_leak):
    """Host frames (tuning.UCX_HOST_FRAME_THRESHOLD, 8 KiB), the sending side's decision (real services on ``host``
    pools, a registry snapshot naming both workers): a value under the threshold in a ``get_data`` reply over
    ``ucx``/``ucxx`` to a worker with a registry row goes as a host frame; not over TCP, not from the threshold up,
    and not to a requester without a row (a client or the scheduler, which could not read it)."""
    import secrets

    from dask_gpupool import PoolOptions
    from dask_gpupool.dask.context import Request
    from dask_gpupool.dask.ucx_host_frames import host_frame_reply
    from dask_gpupool.handoff.startup import start_service
    from dask_gpupool.wire.registry import Membership, RegistryUpdate

    options = PoolOptions.from_config(kind="host", max_size="16 MiB", broker_dir=str(tmp_path))
    a = start_service(options, "ucxx://127.0.0.1:40021")
    b = start_service(options, "ucxx://127.0.0.1:40022")
    try:
        snapshot = RegistryUpdate(1, (a.record, b.record), (), snapshot=True)
        token = secrets.token_bytes(32)
        for s in (a, b):
            s.join(Membership(snapshot, token))

        def decided(requester: str | None, scheme: str, nbytes: int) -> bool:
            return host_frame_reply(Request(requester, scheme, a), nbytes) is a

        assert host_frame_reply(None, 4096) is None  # not in a reply
        assert decided(b.record.worker, "ucxx", 4096) and decided(b.record.worker, "ucx", 8191)
        assert not decided(b.record.worker, "tcp", 4096)
        assert not decided(b.record.worker, "ucxx", 8192)  # the threshold itself goes as device frames
        assert not decided("ucxx://127.0.0.1:50000", "ucxx", 4096)  # a client: no registry row
        assert not decided(None, "ucxx", 4096)
        assert decided(b.record.worker, "ucxx", 1)
    finally:
        b.close()
        a.close()


def test_pool_memory_goes_to_ucx_unstaged_when_small_or_in_this_workers_own_legacy_segments(tmp_path, no_fd_leak):
    """The sending side's staging decision for pool memory in a UCX reply (real services on ``host`` pools): under
    ``tuning.UCX_STAGING_THRESHOLD`` (8 KiB) it goes as it is; larger, it is staged, unless the worker's pool makes
    segments of legacy IPC memory (``segment-memory: legacy``, which UCX exports itself) and the buffer is that
    pool's own: a buffer imported from or made by another pool is staged, since an opened IPC handle cannot be
    exported again. The pool's ``segment_memory`` is set here as a ``device`` pool with legacy segments has it; the
    CUDA side runs in ``tests/dask/test_ucxx.py`` (``test_on_ucxx_legacy_ipc_segments_*``)."""
    import secrets

    from dask_gpupool import PoolOptions
    from dask_gpupool.dask import cuda_family as F
    from dask_gpupool.dask.context import Request
    from dask_gpupool.handoff.startup import start_service
    from dask_gpupool.wire.registry import Membership, RegistryUpdate

    options = PoolOptions.from_config(kind="host", max_size="16 MiB", broker_dir=str(tmp_path))
    a = start_service(options, "ucxx://127.0.0.1:40031")
    b = start_service(options, "ucxx://127.0.0.1:40032")
    own = a.pool.allocate(1 << 20)
    other = b.pool.allocate(1 << 20)
    try:
        snapshot = RegistryUpdate(1, (a.record, b.record), (), snapshot=True)
        token = secrets.token_bytes(32)
        for s in (a, b):
            s.join(Membership(snapshot, token))

        def unstaged(nbytes: int, buf: Any) -> bool:
            return F._unstaged(Request("ucxx://127.0.0.1:50000", "ucxx", a), nbytes, buf)

        assert unstaged(8191, own) and unstaged(8191, other)  # small: UCX's eager protocol moves it
        assert not unstaged(8192, own) and not unstaged(1 << 20, own)  # pool memory: staged
        a.pool.segment_memory = "legacy"
        assert unstaged(1 << 20, own)  # its own legacy segment: UCX exports it
        assert not unstaged(1 << 20, other)  # another pool's memory: staged
    finally:
        own.close()
        other.close()
        b.close()
        a.close()


def test_a_failed_read_leaves_no_frame_holding_what_it_received():
    """Dask logs a failed read with its traceback and keeps the record (``gather_dep``'s ``logger.exception``):
    no frame of the exception, its cause or its context may keep what the read held alive (distributed-ucxx's
    ``read`` holds the received device frames, and raises ``CommClosedError`` from the UCX error). The comm is a real
    one (inproc); the read is the comm's read as the wrapper is given it."""
    import asyncio
    import gc
    import weakref

    from distributed.comm import CommClosedError, connect, listen

    from dask_gpupool.dask.comms import read_then_fill

    class Frame:
        pass

    box = [Frame()]
    held = weakref.ref(box[0])

    async def failing_read(deserializers: Any = None) -> Any:
        frames = [box.pop()]  # what the comm received, held by this frame only
        try:
            raise OSError(f"endpoint closed with {len(frames)} frame(s) received")
        except OSError as e:
            raise CommClosedError("while reading") from e

    async def main() -> BaseException:
        async def serve(comm: Any) -> None:
            await comm.read()

        listener = await listen("inproc://", serve)  # awaited: started
        comm = await connect(listener.contact_address)
        try:
            await read_then_fill(comm, failing_read, "tcp://sender:1")()
        except CommClosedError as e:
            return e  # what Dask's log keeps
        finally:
            comm.abort()
            listener.stop()
        raise AssertionError("the read did not fail")

    kept = asyncio.run(main())
    gc.collect()
    assert held() is None, "a traceback frame keeps the received frames alive"
    assert isinstance(kept.__cause__, OSError)


def test_a_ucx_reply_that_ends_without_its_ok_parks_what_its_device_frames_keep_alive(tmp_path):
    """A ``get_data`` reply over UCX that ends without the requester's "OK" (cancelled while distributed-ucxx waits
    for its send, or failed) may leave the requester's UCX reading its device frames (a ``cuda_ipc`` read of a
    staging block or of pool memory): what those frames keep alive is parked in the process's quarantine, never
    given back to a free list or pool, until the requester's process exits (its registry row's pid, on this host),
    or for this process's life when that cannot be watched (a requester without a row: a client). A reply that
    ended with its "OK" lets go of them at once; over TCP nothing is noted (the sender copies into the socket).

    Real services on ``host`` pools and a registry snapshot; the requester's row names a real process of this host.
    The device frames are the serializers' own ``_DeviceFrame`` s, noted as ``cuda_dumps_cupy`` and
    ``cuda_family.serialize_buffer`` note what they return (which needs device memory: the GPU test
    ``test_on_ucxx_a_cancelled_reply_keeps_its_staging_memory_until_the_consumer_exits``); their owners are plain
    objects, which the code only keeps references to."""
    import dataclasses
    import gc
    import secrets
    import subprocess
    import sys
    import weakref

    from dask_gpupool import PoolOptions
    from dask_gpupool.dask import cuda_family as F
    from dask_gpupool.dask.context import Request
    from dask_gpupool.handoff.startup import start_service
    from dask_gpupool.memory.lifetime import QUARANTINE
    from dask_gpupool.wire.registry import Membership, RegistryUpdate

    class Staging:  # what a frame keeps alive: a staging block, a pool buffer, a CuPy array
        nbytes = 1 << 20

    options = PoolOptions.from_config(kind="host", max_size="16 MiB", broker_dir=str(tmp_path))
    a = start_service(options, "ucxx://127.0.0.1:40061")
    b = start_service(options, "ucxx://127.0.0.1:40062")
    requester = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        row = dataclasses.replace(b.record, pid=requester.pid)  # the requester's process, on this host
        a.join(Membership(RegistryUpdate(1, (a.record, row), (), snapshot=True), secrets.token_bytes(32)))

        def reply(who: str, scheme: str, ok: bool) -> weakref.ref[Any]:
            """One reply of one value staged for UCX; the weak reference to what its device frame keeps alive."""
            staged = Staging()
            request = Request(who, scheme, a)
            _, frames = F._noted(request, ({"nbytes": staged.nbytes}, [F._DeviceFrame(4096, staged.nbytes, staged)]))
            ref = weakref.ref(staged)
            del staged, frames  # Dask's write dropped them (a cancelled send drops them at once)
            request.settle_frames(ok)  # what the get_data hook does when the reply ends
            gc.collect()
            return ref

        count, nbytes = QUARANTINE.count, QUARANTINE.nbytes
        assert reply(b.record.worker, "ucxx", ok=True)() is None  # the requester read it all: its OK came
        assert reply(b.record.worker, "tcp", ok=False)() is None  # over TCP the bytes were copied into the socket
        parked = reply(b.record.worker, "ucxx", ok=False)
        assert parked() is not None, "staging memory the requester may still read went back to the free list"
        assert (QUARANTINE.count - count, QUARANTINE.nbytes - nbytes) == (1, 1 << 20)
        client = reply("ucx://127.0.0.1:50000", "ucx", ok=False)  # no row: no process to watch
        # the requester's process is the one its row named when the reply began sending, even if the row is gone
        # by the time the reply fails (a requester that died may have left the registry then)
        request = Request(b.record.worker, "ucxx", a)
        request.sending([F._DeviceFrame(4096, 1 << 20, Staging())])
        a.join(Membership(RegistryUpdate(2, (a.record,), (), snapshot=True), secrets.token_bytes(32)))
        assert a.registry.worker_row(b.record.worker) is None
        request.settle_frames(False)
        assert (QUARANTINE.count - count, QUARANTINE.nbytes - nbytes) == (3, 3 << 20)
        requester.kill()
        requester.wait()
        QUARANTINE.sweep()
        gc.collect()
        assert parked() is None  # its reader's process is gone: the memory may be reused
        assert client() is not None  # kept for this process's life
        assert (QUARANTINE.count - count, QUARANTINE.nbytes - nbytes) == (1, 1 << 20)
    finally:
        requester.kill()
        requester.wait()
        b.close()
        a.close()
