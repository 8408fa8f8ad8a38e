"""Every layout of an array over pool memory hands over with its shape, strides and offset (NumPy on host pools).

The GPU twin with CuPy is ``tests/handoff/test_device_forwarding.py::test_every_layout_hands_over_on_a_gpu``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import HOST_POOL, counters, nanny_cluster, worker_addresses

from dask_gpupool import GPUPool
from dask_gpupool import testing as T


def _expected(layout: str) -> dict[str, object]:
    a = np.arange(400, dtype="f8")
    if layout == "fortran":
        a = np.asfortranarray(a.reshape(20, 20))
    view = T.LAYOUTS[layout](np, a)
    return {"shape": list(view.shape), "values": view.tolist()}


@pytest.fixture(scope="module")
def three_workers():
    """Three workers whose host pools hand over every size: the layouts here are a few KiB and a 0-d array, which
    host pools would copy by default (tuning.HOST_HANDOFF_THRESHOLD is not what these tests are about)."""
    with nanny_cluster([{}, {}, {}], HOST_POOL) as c:
        c.run(T.route_sizes, handoff=0)
        yield c, *worker_addresses(c)


@pytest.mark.parametrize("layout", sorted(T.LAYOUTS))
@pytest.mark.parametrize("hops", [1, 2], ids=["handed-over", "passed-on"])
def test_each_layout_arrives_with_the_right_values(three_workers, layout, hops):
    """A view made on A reaches B (and, passed on by B, W) with the same shape and values, zero-copy."""
    c, a, b, w = three_workers
    last = b if hops == 1 else w
    before = counters(c)
    x = c.submit(T.make_array, 400, workers=[a], pure=False)
    v = c.submit(T.view_of, x, layout, workers=[a], pure=False)
    got = c.submit(T.keep, v, workers=[b], pure=False)
    if hops == 2:
        got = c.submit(T.keep, got, workers=[w], pure=False)
    assert c.submit(T.as_nested_list, got, workers=[last], pure=False).result() == _expected(layout)
    now = counters(c)
    if layout != "empty":
        assert now[last]["zero_copy_bytes"] > before[last]["zero_copy_bytes"]
        assert now[last]["copied_bytes"] == before[last]["copied_bytes"]
        assert all(now[k]["fallbacks"] == before[k]["fallbacks"] for k in (a, b, w))


def test_a_consumer_cannot_write_into_the_producers_memory(three_workers):
    """NumPy arrays over imported memory are read-only: the producer's bytes are shared, not the consumer's."""
    c, a, b, _w = three_workers
    x = c.submit(T.make_array, 400, workers=[a], pure=False)
    y = c.submit(T.keep, x, workers=[b], pure=False)
    assert c.submit(T.describe, y, workers=[b], pure=False).result()["imported"]
    assert c.submit(T.try_write, y, workers=[b], pure=False).result() == "ValueError"
    assert c.submit(T.try_write, x, workers=[a], pure=False).result() == "wrote"  # the producer's own array
    assert c.submit(T.total, y, workers=[b], pure=False).result() == 0.0  # ... which B sees: shared memory


def _unlock_and_write(x: Any) -> str:
    """Task: make array ``x`` writable again and write into it; ``"wrote"`` or the error's type name."""
    try:
        x.flags.writeable = True
        x[...] = 0
    except ValueError as e:
        return type(e).__name__
    return "wrote"


@pytest.mark.parametrize("hops", [1, 2], ids=["handed-over", "passed-on"])
def test_a_received_array_cannot_be_made_writable_again(three_workers, hops):
    """NumPy refuses to set ``writeable`` back only on an array whose base is read-only memory: over a writable
    base (the ctypes array over the mapping) a task could turn the flag on and write into the producer's memory:
    a received array's base is read-only."""
    c, a, b, w = three_workers
    x = c.submit(T.make_array, 400, workers=[a], pure=False)
    got = c.submit(T.keep, x, workers=[b], pure=False)
    last = b
    if hops == 2:
        got, last = c.submit(T.keep, got, workers=[w], pure=False), w
    assert c.submit(T.describe, got, workers=[last], pure=False).result()["imported"]
    assert c.submit(_unlock_and_write, got, workers=[last], pure=False).result() == "ValueError"
    assert c.submit(T.total, x, workers=[a], pure=False).result() == float(sum(range(400)))


#: A structured dtype: its ``dtype.str`` (``"|V12"``) does not say its fields.
RECORD = [("i", "<i4"), ("x", "<f8")]


def _records(n: int, in_pool: bool) -> Any:
    """Task: ``n`` records of :data:`RECORD` (``i`` counts up, ``x`` is half of it), in the pool or NumPy's own."""
    import dask_gpupool

    a = np.zeros(n, RECORD)
    a["i"] = np.arange(n)
    a["x"] = np.arange(n) / 2
    return dask_gpupool.to_pool(a) if in_pool else a


def _fields(x: Any) -> dict[str, Any]:
    """Task: the dtype of records ``x``, and the sums of its fields (the error when it has none)."""
    try:
        return {"dtype": x.dtype.descr, "i": int(x["i"].sum()), "x": float(x["x"].sum())}
    except (IndexError, KeyError, ValueError) as e:
        return {"dtype": x.dtype.descr, "error": str(e)}


@pytest.mark.parametrize("where", ["handed-over", "passed-on", "gathered", "staged"])
def test_records_arrive_with_their_fields(three_workers, where):
    """An array of a structured dtype keeps its fields on every path (``dtype.str``, ``"|V12"``, would give the
    consumer raw bytes with no fields). Such arrays
    go through distributed's serializer, which keeps them; ``staged``: a plain NumPy array over the stage
    threshold given to the producer (host pools stage nothing by default)."""
    n = 5000
    expected = {"dtype": RECORD, "i": n * (n - 1) // 2, "x": n * (n - 1) / 4}
    if where == "staged":
        with nanny_cluster([{}, {}], GPUPool(kind="host", max_size="64 MiB")) as c:
            a, b = worker_addresses(c)
            c.run(T.route_sizes, stage=16 << 10, workers=[a])
            x = c.submit(_records, n, False, workers=[a], pure=False)
            got = c.submit(T.keep, x, workers=[b], pure=False)
            assert c.submit(_fields, got, workers=[b], pure=False).result() == expected
        return
    c, a, b, w = three_workers
    x = c.submit(_records, n, True, workers=[a], pure=False)
    if where == "gathered":
        assert _fields(x.result()) == expected
        return
    got = c.submit(T.keep, x, workers=[b], pure=False)
    last = b
    if where == "passed-on":
        got, last = c.submit(T.keep, got, workers=[w], pure=False), w
    assert c.submit(_fields, got, workers=[last], pure=False).result() == expected


def test_a_pool_array_of_a_structured_dtype_is_a_counted_copy(three_workers):
    """A pool array whose dtype an array header cannot describe (structured) goes as distributed's copy: counted under
    its own fallback reason, never a silent same-host copy."""
    c, a, b, _w = three_workers
    before = counters(c)
    x = c.submit(_records, 5000, True, workers=[a], pure=False)
    got = c.submit(T.keep, x, workers=[b], pure=False)
    assert c.submit(_fields, got, workers=[b], pure=False).result()["i"] == 5000 * 4999 // 2
    now = counters(c)
    fallbacks = {k: v - before[a]["fallbacks"].get(k, 0) for k, v in now[a]["fallbacks"].items()}
    assert {k: v for k, v in fallbacks.items() if v} == {"structured-dtype": 1}


def _zero_d_in_pool() -> Any:
    """Task: a 0-d NumPy array put in the pool."""
    import dask_gpupool

    return dask_gpupool.to_pool(np.array(3.5))


def test_a_zero_d_array_goes_into_the_pool_and_hands_over(three_workers):
    """``as_array`` without strides must not make the strides of a 0-d array those of a 1-d one (``zip()
    argument 2 is longer``): ``to_pool`` of a 0-d result goes into the pool and hands over."""
    c, a, b, _w = three_workers
    x = c.submit(_zero_d_in_pool, workers=[a], pure=False)
    y = c.submit(T.keep, x, workers=[b], pure=False)
    assert c.submit(T.as_nested_list, y, workers=[b], pure=False).result() == {"shape": [], "values": 3.5}
    assert c.submit(T.describe, y, workers=[b], pure=False).result()["imported"]


def _view_and_write(buf: Any) -> str:
    """Task: view Buffer ``buf`` with ``as_array`` and write into the view; ``"wrote"`` or the error's type name."""
    from dask_gpupool import as_array

    view = as_array(buf, int(buf.size), "u1", like="numpy")
    try:
        view[...] = 0
    except ValueError as e:
        return type(e).__name__
    return "wrote"


@pytest.mark.parametrize("hops", [1, 2], ids=["handed-over", "passed-on"])
def test_a_view_of_a_received_buffer_is_read_only(three_workers, hops):
    """A Buffer received zero-copy is the producer's memory as an array over it is: ``as_array`` views it
    read-only, so that no task writes into the producer's value. The producer's own buffers stay writable."""
    c, a, b, w = three_workers
    x = c.submit(T.make_buffer, 4096, b"mine", workers=[a], pure=False)
    got = c.submit(T.keep, x, workers=[b], pure=False)
    last = b
    if hops == 2:
        got, last = c.submit(T.keep, got, workers=[w], pure=False), w
    assert c.submit(T.describe, got, workers=[last], pure=False).result()["imported"]
    assert c.submit(_view_and_write, got, workers=[last], pure=False).result() == "ValueError"
    assert c.submit(T.head, x, 4, workers=[a], pure=False).result() == b"mine"
    assert c.submit(_view_and_write, x, workers=[a], pure=False).result() == "wrote"


def test_the_view_index_keeps_every_live_buffer_at_one_address():
    """Two Buffers at one address (two imports of one allocation): the index finds the one left when the other went,
    and nothing once both went; a buffer that does not hold the whole range is never the answer."""
    import gc

    from cuda.core import Buffer

    from dask_gpupool.dask.views import ViewIndex
    from dask_gpupool.memory.buffers import host_buffer

    outer = host_buffer(bytearray(64))
    start = int(outer.handle)
    first = Buffer.from_handle(start, 64, owner=outer)
    second = Buffer.from_handle(start, 64, owner=outer)
    short = Buffer.from_handle(start, 8, owner=outer)
    index = ViewIndex()
    for buf in (first, short, second, second):
        index.add(buf)
    del buf
    assert index.find(start + 8, start + 64) in (first, second)
    del second
    gc.collect()
    assert index.find(start + 8, start + 64) is first
    assert index.find(start, start + 8) in (first, short)
    del first
    gc.collect()
    assert index.find(start + 8, start + 64) is None and index.find(start, start + 8) is short
    del short
    gc.collect()
    assert not index


@pytest.mark.parametrize(
    "shape, strides, offset",
    [
        ((3,), (-8,), 0),  # element 0 at the start: the others below the buffer
        ((2,), (8,), 24),  # the second element past the end
        ((5,), (8,), 0),  # one element past the end
        ((0,), (8,), 40),  # empty, but placed past the end
        ((2**62, 2), (0, 8), 0),  # a broadcast NumPy cannot make: too many elements
        ((2**40, 2**40), (8, 8), 0),  # far past the end
        ((2,), (2**63 - 1,), 0),  # a stride that overflows
        ((), (), 2**64 - 1),  # an offset that overflows
    ],
)
def test_an_array_header_that_does_not_fit_its_bytes_is_a_data_lost_error(shape, strides, offset):
    """A header whose shape, strides and offset reach outside the 32 bytes that came is refused with the package's
    DataLostError (Dask then fetches the value again), never read: the lowest address of negative strides, empty
    arrays, overflowing sizes, strides and offsets."""
    from dask_gpupool.dask.dask_family import KEY, loads_array
    from dask_gpupool.errors import DataLostError
    from dask_gpupool.wire.handoff import ArrayMeta, HandoffHeader

    meta = ArrayMeta("numpy", shape, strides, "<f8", offset)
    header = HandoffHeader("copy", "host", 32, exporter="tcp://10.0.0.1:1", array=meta)
    with pytest.raises(DataLostError):
        loads_array({KEY: header.to_msg()}, [bytes(32)], lambda header, frames: None)
