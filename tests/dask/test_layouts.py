"""Every layout of an array over pool memory hands over with its shape, strides and offset (NumPy on host pools).

Issue 18. The GPU twin with CuPy is ``tests/test_gpu.py::test_every_layout_hands_over_on_a_gpu``.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import HOST_POOL, counters, nanny_cluster, worker_addresses

from dask_gpupool import testing as T


def _expected(layout: str) -> dict[str, object]:
    a = np.arange(400, dtype="f8")
    if layout == "fortran":
        a = np.asfortranarray(a.reshape(20, 20))
    view = T.LAYOUTS[layout](np, a)
    return {"shape": list(view.shape), "values": view.tolist()}


@pytest.fixture(scope="module")
def three_workers():
    with nanny_cluster([{}, {}, {}], HOST_POOL) as c:
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
