"""Device values in Dask's other uses: objects of every "cuda"-serialized type, a 0-d CuPy array, ``to_pool``
of a NumPy result, a value spilled while answering a peer, user code that pickles a pool Buffer (gpu-marked:
run on the GPU machine). The ``host`` cases are in ``test_device_objects.py``, ``test_layouts.py`` and
``test_dask_uses.py``."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import (
    ONE_GPU,
    back_to,
    counters,
    gpus,
    layout_workers,
    nanny_cluster,
    wait_for,
    warm_up,
    worker_addresses,
)

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import testing as T

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
@pytest.mark.parametrize("kind", ["rmm", "numba"])
def test_device_objects_go_frame_by_frame_over_tcp(kind, placement):
    """Every "cuda"-serialized object: an rmm.DeviceBuffer or a Numba device array of 8 MiB goes to a
    same-host worker over TCP as its device frame staged into the producer's pool and handed over (staged-in-pool),
    a 1 KiB one through the comm (small); the consumer rebuilds the same type with the right bytes, and keeps them
    after the producer's key is gone and its pool scribbled over. At the defaults; the consumer
    on the same GPU, or on the other one (the frame read in place over NVLink or PCIe)."""
    workers = layout_workers(placement)
    pytest.importorskip("numba.cuda" if kind == "numba" else "rmm")
    with nanny_cluster(workers, GPUPool(kind="device", max_size="1 GiB")) as c:
        a, b = worker_addresses(c)
        name = "DeviceBuffer" if kind == "rmm" else "DeviceNDArray"
        before = counters(c)
        big = c.submit(T.device_object, kind, 1 << 20, workers=[a], pure=False)
        small = c.submit(T.device_object, kind, 128, workers=[a], pure=False)
        got = c.submit(T.keep, big, workers=[b], pure=False)
        assert c.submit(T.check_device_object, got, 1 << 20, workers=[b], pure=False).result() == f"{name}:ok"
        assert c.submit(T.check_device_object, small, 128, workers=[b], pure=False).result() == f"{name}:ok"
        now = counters(c)
        assert now[a]["fallbacks"] == {"staged-in-pool": 1, "small": 1}, now[a]
        assert now[a]["pool_staged_bytes"] - before[a]["pool_staged_bytes"] == 8 * MiB
        assert now[b]["zero_copy_bytes"] - before[b]["zero_copy_bytes"] == 8 * MiB
        del big, small
        for _ in range(4):
            c.submit(T.scribble_all, 16 * MiB, ord("S"), workers=[a], pure=False).result()
        assert c.submit(T.check_device_object, got, 1 << 20, workers=[b], pure=False).result() == f"{name}:ok"
        del got


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus"])
@pytest.mark.parametrize("kind", ["reads-on-arrival", "wants-rmm-frames"])
def test_any_cuda_serialized_type_goes_frame_by_frame_and_is_read_only_after_its_claim(kind, placement):
    """Every "cuda"-serialized object: a type distributed does not know (``T.DeviceRecord``, registered
    with ``cuda_serialize`` only) over a 16 MiB pool buffer that a producer kernel is still filling (300 ms spin)
    reaches a same-host worker over TCP zero-copy. Its deserializer sums the bytes on arrival, as a cuDF column's
    may read them, and the sum is right: the export waited for the producer's kernel, and the object's claims ran
    before it. A deserializer that wants ``rmm.DeviceBuffer`` frames gets copies, and the right bytes.
    The consumer on the producer's GPU, or on the other one."""
    workers = layout_workers(placement)
    if kind == "wants-rmm-frames":
        pytest.importorskip("rmm")
    plugin = GPUPool(kind="device", max_size="1 GiB")
    with nanny_cluster(workers, plugin) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        before = counters(c)
        name = "RmmFramesRecord" if kind == "wants-rmm-frames" else "DeviceRecord"
        for i in range(3):
            buf = c.submit(T.slow_fill, 16 * MiB, 11 + i, 300, workers=[a], pure=False)
            rec = c.submit(T.device_record, buf, f"r{i}", kind == "wants-rmm-frames", workers=[a], pure=False)
            got = c.submit(T.keep, rec, workers=[b], pure=False)
            assert c.submit(T.check_device_record, got, 11 + i, workers=[b], pure=False).result() == f"{name}:ok"
            del buf, rec, got
        now = counters(c)
        assert now[b]["zero_copy_bytes"] - before[b]["zero_copy_bytes"] == 3 * 16 * MiB, now[b]
        assert now[a]["fallbacks"] == before[a]["fallbacks"], now[a]
        back_to(c, baseline)


def _zero_d_cupy_in_pool() -> Any:
    """Task: a 0-d CuPy array put in the pool."""
    import cupy

    return dask_gpupool.to_pool(cupy.asarray(3.5))


def test_a_zero_d_cupy_array_goes_into_the_pool_and_hands_over():
    """The GPU twin of ``test_layouts.py::test_a_zero_d_array_goes_into_the_pool_and_hands_over``: ``as_array``
    without strides must not fail for a 0-d shape, on CuPy as on NumPy."""
    gpus(1)
    with nanny_cluster([ONE_GPU, ONE_GPU], GPUPool(kind="device", max_size="1 GiB")) as c:
        a, b = worker_addresses(c)
        x = c.submit(_zero_d_cupy_in_pool, workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.as_nested_list, y, workers=[b], pure=False).result() == {"shape": [], "values": 3.5}
        assert c.submit(T.describe, y, workers=[b], pure=False).result()["imported"]


def _numpy_to_pool_on_a_device_pool() -> bool:
    """Task: whether ``to_pool`` of a NumPy array on a worker whose pool is GPU memory returned it as it is."""
    import numpy as np

    arr = np.arange(4.0)
    return dask_gpupool.to_pool(arr) is arr


def test_to_pool_of_a_numpy_array_on_a_device_pool_returns_it_as_it_is():
    """``to_pool`` of a NumPy result on a ``device`` pool (the default kind on a GPU) raised ``ValueError`` from
    ``as_array`` (GPU memory cannot be viewed as NumPy) instead of returning the array, as it does for a CuPy
    array on a ``host`` pool."""
    gpus(1)
    with nanny_cluster([ONE_GPU], GPUPool(kind="device", max_size="64 MiB")) as c:
        (a,) = worker_addresses(c)
        assert c.submit(_numpy_to_pool_on_a_device_pool, workers=[a], pure=False).result()


def test_a_device_value_spilled_while_answering_a_peer_is_a_host_copy_and_leaves_no_lease():
    """tests/dask/test_dask_uses.py's spill case on a ``device`` pool: B's get_data unspills x on A, which evicts y
    to disk inside the reply; y must go to disk as its bytes, not as a descriptor under a lease nobody claims."""
    import dask

    gpus(1)
    memory = {"target": 0.5, "spill": False, "pause": False, "terminate": False}
    spilling = {
        **ONE_GPU,
        "memory_limit": "64 MiB",
        "config": {f"distributed.worker.memory.{k}": v for k, v in memory.items()},
    }
    with (
        dask.config.set({"distributed.worker.memory.terminate": False}),
        nanny_cluster([spilling, ONE_GPU], GPUPool(kind="device", max_size="1 GiB")) as c,
    ):
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        x = c.submit(T.make_buffer, 24 * MiB, b"x-bytes", workers=[a], pure=False)
        x.result()
        y = c.submit(T.make_buffer, 24 * MiB, b"y-bytes", workers=[a], pure=False)
        y.result()
        wait_for(lambda key=x.key: key in c.run(T.spilled_bytes, workers=[a])[a], what="x to be spilled")
        z = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.head, z, 7, workers=[b], pure=False).result() == b"x-bytes"
        spilled = c.run(T.spilled_bytes, workers=[a])[a]
        assert spilled.get(y.key, 0) >= 24 * MiB, spilled
        assert counters(c, a)[a]["leases"] == 1
        assert c.submit(T.head, y, 7, workers=[a], pure=False).result() == b"y-bytes"
        del x, y, z
        back_to(c, baseline)


def test_user_code_that_pickles_a_device_pool_buffer_gets_a_host_copy():
    """tests/dask/test_dask_uses.py's pickling case on a ``device`` pool: cuda.core's own ``__reduce__`` would
    export an IPC descriptor with no lease behind it."""
    gpus(1)
    with nanny_cluster([ONE_GPU, ONE_GPU], GPUPool(kind="device", max_size="1 GiB")) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        x = c.submit(T.make_buffer, MiB, b"pickled!", workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        for which in ("pickle", "cloudpickle"):
            for value, w in ((x, a), (y, b)):
                got = c.submit(T.pickled_copy, value, which, workers=[w], pure=False).result()
                want = {"type": "Buffer", "size": MiB, "before": b"pickled!", "after": b"pickled!", "same": False}
                assert got == want, (which, w)
        assert counters(c, a)[a]["leases"] == 1
        del x, y, value
        back_to(c, baseline)
