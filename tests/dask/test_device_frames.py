"""The serializers of CuPy arrays and device frames on a GPU: a staged array's header, a received frame's size,
a client whose CuPy serializers were registered first, and the package imported after CuPy (gpu-marked: run
on the GPU machine)."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import (
    ONE_GPU,
    gpus,
    nanny_cluster,
    worker_addresses,
)

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import testing as T

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def test_a_staged_cupy_header_matches_distributeds_and_deserializes():
    """The header a staged CuPy array goes with over UCX is what distributed's own serializer writes for a C-ordered
    copy (shape, typestr, strides), and distributed's deserializer rebuilds the array from it and the frame."""
    gpus(1)
    import cupy
    from distributed.protocol.cupy import cuda_deserialize_cupy_ndarray, cuda_serialize_cupy_ndarray

    from dask_gpupool.dask.cuda_family import staged_cupy_header

    for x in (
        cupy.arange(12, dtype="f8").reshape(3, 4),
        cupy.arange(30, dtype="i2").reshape(5, 6)[:, ::2],  # staged as a C-ordered copy
        cupy.asarray(7.0, dtype="f4"),
        cupy.empty((0, 5), dtype="f8"),
    ):
        c_ordered = x.copy(order="C")  # (not ascontiguousarray, which makes a 0-d array 1-d)
        theirs, frames = cuda_serialize_cupy_ndarray(c_ordered)
        ours = staged_cupy_header(tuple(x.shape), x.dtype, int(c_ordered.data.ptr))
        assert tuple(ours["shape"]) == tuple(theirs["shape"]) and ours["typestr"] == theirs["typestr"]
        if x.size:  # an empty array's strides are any
            assert tuple(ours["strides"]) == tuple(theirs["strides"]), (ours, theirs)
        back = cuda_deserialize_cupy_ndarray(ours, frames)
        assert back.shape == x.shape and bool((back == x).all())


def test_a_received_device_frame_is_taken_at_its_own_size():
    """On a GPU, the frames distributed-ucxx receives (a CuPy byte array, an ``rmm.DeviceBuffer``) give a Buffer of
    their own size; a header that says another size is a ProtocolError."""
    gpus(1)
    import cupy

    from dask_gpupool.dask.cuda_family import _cuda_deserialize_buffer

    frames: list[Any] = [cupy.arange(16, dtype="u1")]
    try:
        import rmm

        frames.append(rmm.DeviceBuffer(size=16))
    except ImportError:
        pass
    for frame in frames:
        buf = _cuda_deserialize_buffer({"nbytes": 16}, [frame])
        assert buf.size == 16 and int(buf.handle) == int(frame.__cuda_array_interface__["data"][0])
        with pytest.raises(dask_gpupool.ProtocolError, match="a device frame of 16 bytes"):
            _cuda_deserialize_buffer({"nbytes": 1 << 30}, [frame])


def test_the_package_imports_after_cupy():
    """``import cupy`` before ``dask_gpupool`` (benchmarks/dask_array.py does): no circular import."""
    import subprocess
    import sys

    gpus(1)
    code = "import cupy, dask_gpupool, dask_gpupool.dask.cuda_family; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


_CLIENT_AFTER_DISTRIBUTEDS_CUPY = """
import sys
import dask_gpupool  # before CuPy: its CuPy serializers wait for the first CuPy dispatch
from distributed import Client
{first}
with Client(sys.argv[1], timeout=30) as client:
    got = client.get_dataset(sys.argv[2]).result(timeout=60)
    print(type(got).__module__.split(".")[0], float(got.sum()))
"""


@pytest.mark.parametrize(
    "first",
    [
        "import distributed.protocol.cupy",
        "import cupy; from distributed.protocol import cuda_deserialize; cuda_deserialize.dispatch(cupy.ndarray)",
    ],
    ids=["distributeds-cupy-module", "cuda-family-first"],
)
def test_a_client_gathers_a_pool_cupy_array_whatever_registered_cupys_serializers_first(first):
    """A client process that imported ``dask_gpupool`` before CuPy, and then distributed's CuPy module (directly, or
    through a first dispatch of the ``"cuda"`` family, as a UCX comm makes), gets a pool-backed CuPy array's copy
    header: distributed's CuPy serializers had taken the dispatch before the lazy hook that installs ours, and the
    header reached distributed's deserializer (``KeyError: 'shape'``)."""
    import subprocess
    import sys

    gpus(1)
    with nanny_cluster([ONE_GPU], GPUPool(kind="device", max_size="1 GiB")) as c:
        (a,) = worker_addresses(c)
        x = c.submit(T.make_array, 1000, "cupy", workers=[a], pure=False)
        assert c.submit(T.describe, x, workers=[a], pure=False).result()["in_own_pool"]
        c.publish_dataset(x, name="pool-cupy")  # a Future by key alone in another client never resolved
        code = _CLIENT_AFTER_DISTRIBUTEDS_CUPY.format(first=first)
        done = subprocess.run(
            [sys.executable, "-c", code, c.scheduler.address, "pool-cupy"], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split() == ["cupy", str(float(999 * 1000 // 2))], done.stdout
