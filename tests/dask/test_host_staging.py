"""Plain NumPy results between same-host workers on ``host`` pools, at the defaults: staged into the producer's pool
and handed over from ``tuning.HOST_STAGE_THRESHOLD`` up (every layout, with its values, read-only), Dask's own path
below it and for what an array header cannot describe, and nothing left behind (leases, fds, pool bytes)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import back_to, counters, nanny_cluster, warm_up, worker_addresses

from dask_gpupool import GPUPool
from dask_gpupool import testing as T
from dask_gpupool.tuning import HOST_STAGE_THRESHOLD

MiB = 1 << 20
#: Elements of the float64 arrays the layouts are cut from: 4 MiB.
N = 512 * 1024

#: Views of a plain 1024 x 512 float64 array of NumPy's own memory (4 MiB), each of at least the stage threshold.
LAYOUTS = {
    "whole": lambda a: a,
    "transpose": lambda a: a.T,  # Fortran-contiguous: staged in Fortran order
    "slice": lambda a: a[::2],  # every other row
    "columns": lambda a: a[:, 100:400],  # neither C- nor Fortran-contiguous
    "negative-strides": lambda a: a[::-1, ::-1],
    "fortran-slice": lambda a: np.asfortranarray(a)[3:, 5:],
    "broadcast": lambda a: np.broadcast_to(a[0], (1024, 512)),  # strides of 0: 4 MiB of elements from one row
    "int32-3d": lambda a: a.astype("<i4").reshape(64, 64, 128)[:, ::-1, 1:],
}


def _layout(name: str) -> Any:
    """Task: the ``name`` view (:data:`LAYOUTS`) of a plain array counting up from 0."""
    return LAYOUTS[name](np.arange(N, dtype="f8").reshape(1024, 512))


def _check(x: Any, name: str) -> dict[str, Any]:
    """Task: whether ``x`` has the values, shape and dtype of the ``name`` view, and whether a task can write it."""
    want = _layout(name)
    try:
        x.flags.writeable = True
        x[...] = 0
        write = "wrote"
    except ValueError as e:
        write = type(e).__name__
    return {
        "values": bool(np.array_equal(x, want)),
        "shape": x.shape == want.shape,
        "dtype": x.dtype == want.dtype,
        "write": write,
    }


@pytest.fixture(scope="module")
def three_workers():
    """Three same-host workers at the defaults, their links and mappings opened (the leak check's baseline)."""
    with nanny_cluster([{}, {}, {}], GPUPool(kind="host", max_size="64 MiB")) as c:
        a, b, w = worker_addresses(c)
        warm_up(c, a, b)
        warm_up(c, a, w)
        yield c, a, b, w, warm_up(c, b, w)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_each_layout_of_a_plain_array_is_staged_and_arrives_read_only_with_its_values(three_workers, name):
    c, a, b, _w, baseline = three_workers
    nbytes = _layout(name).nbytes
    assert nbytes >= HOST_STAGE_THRESHOLD
    before = counters(c)
    x = c.submit(_layout, name, workers=[a], pure=False)
    got = c.submit(T.keep, x, workers=[b], pure=False)
    assert c.submit(T.describe, got, workers=[b], pure=False).result()["imported"]
    check = c.submit(_check, got, name, workers=[b], pure=False).result()
    assert check == {"values": True, "shape": True, "dtype": True, "write": "ValueError"}
    now = counters(c)
    assert now[a]["fallbacks"] == {
        **before[a]["fallbacks"],
        "staged-in-pool": before[a]["fallbacks"].get("staged-in-pool", 0) + 1,
    }, now[a]
    assert now[a]["pool_staged_bytes"] - before[a]["pool_staged_bytes"] == nbytes
    assert now[b]["zero_copy_bytes"] - before[b]["zero_copy_bytes"] == nbytes
    assert now[b]["copied_bytes"] == before[b]["copied_bytes"]
    assert c.submit(_check, x, name, workers=[a], pure=False).result()["write"] == "wrote"  # A's own stays A's
    del x, got
    back_to(c, baseline)


def test_a_staged_array_passed_on_reaches_the_third_worker_with_its_values(three_workers):
    c, a, b, w, baseline = three_workers
    before = counters(c)
    x = c.submit(_layout, "transpose", workers=[a], pure=False)
    y = c.submit(T.keep, x, workers=[b], pure=False)
    z = c.submit(T.keep, y, workers=[w], pure=False)
    check = c.submit(_check, z, "transpose", workers=[w], pure=False).result()
    assert check == {"values": True, "shape": True, "dtype": True, "write": "ValueError"}
    now = counters(c)
    assert now[b]["forwards"] - before[b]["forwards"] == 1
    assert now[w]["zero_copy_bytes"] - before[w]["zero_copy_bytes"] == 4 * MiB
    assert now[w]["copied_bytes"] == before[w]["copied_bytes"]
    del x, y, z
    back_to(c, baseline)


RECORD = [("i", "<i4"), ("x", "<f8")]


def _plain(kind: str) -> Any:
    """Task: a plain array that Dask's own path carries: under the threshold, 0-d, empty, structured, objects."""
    if kind == "under":
        return np.arange(HOST_STAGE_THRESHOLD // 8 - 1, dtype="f8")
    if kind == "zero-d":
        return np.array(2.5)
    if kind == "empty":
        return np.zeros((0, 512))
    if kind == "structured":
        a = np.zeros(200_000, RECORD)  # 2.4 MB
        a["i"] = np.arange(200_000)
        a["x"] = np.arange(200_000) / 2
        return a
    a = np.empty(300_000, dtype=object)  # 2.4 MB of references
    a[:] = [str(i) for i in range(300_000)]
    return a


def _summary(x: Any) -> Any:
    """Task: what ``x`` holds, in a form to compare."""
    if x.dtype.names:
        return [x.dtype.descr, int(x["i"].sum()), float(x["x"].sum())]
    if x.dtype.hasobject:
        return [x.shape, x[0], x[-1], len(set(x.tolist()))]
    return [x.shape, str(x.dtype), x.tolist() if x.size < 10 else float(x.sum())]


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("under", "small"),
        ("zero-d", "small"),
        ("empty", None),
        ("structured", "not-in-pool"),
        ("objects", "not-in-pool"),
    ],
)
def test_what_is_not_staged_goes_dasks_way_with_its_values_and_is_counted(three_workers, kind, reason):
    """Under the stage threshold, a 0-d or empty array, a structured dtype (an array header loses its fields), an
    array of objects: each arrives as Dask sends it, nothing staged; a same-host copy is counted under its reason
    (none for an empty array, which copies nothing)."""
    c, a, b, _w, baseline = three_workers
    before = counters(c)
    x = c.submit(_plain, kind, workers=[a], pure=False)
    assert c.submit(_summary, x, workers=[b], pure=False).result() == _summary(_plain(kind))
    now = counters(c)
    assert now[a]["pool_staged_bytes"] == before[a]["pool_staged_bytes"]
    assert now[b]["zero_copy_bytes"] == before[b]["zero_copy_bytes"]
    grew = {k: n - before[a]["fallbacks"].get(k, 0) for k, n in now[a]["fallbacks"].items()}
    assert {k: n for k, n in grew.items() if n} == ({reason: 1} if reason else {}), now[a]["fallbacks"]
    del x
    back_to(c, baseline)


def _small(n: int, dtype: str) -> Any:
    """Task: a plain (1, n) array under the stage threshold, as a per-key table of partial sums is."""
    return np.arange(n, dtype=dtype).reshape(1, n)


def _alignment(x: Any) -> list[Any]:
    """Task: whether ``x``'s data sits at an address its dtype can load from directly, and its values."""
    return [bool(x.flags.aligned), x.ctypes.data % x.dtype.alignment, float(x.sum())]


def test_a_small_plain_array_arrives_aligned_whatever_the_headers_beside_it(three_workers):
    """Dask reads a small message into one buffer and cuts its frames out of it, so an array's bytes land wherever the
    headers before them end: a reply of a worker with the plugin carries headers of other lengths than plain Dask's,
    and a (1, 64) float64 table could land 2 bytes past an 8-byte boundary, where NumPy's fancy indexing from it
    took 2-4 times as long. Each of these arrives at an address its dtype loads from, with its values."""
    c, a, b, _w, baseline = three_workers
    cases = [(n, dtype) for n in (1, 3, 8, 63, 64, 65, 200, 1000) for dtype in ("f8", "i4", "c16")]
    xs = [c.submit(_small, n, dtype, workers=[a], pure=False) for n, dtype in cases]
    got = c.gather([c.submit(_alignment, x, workers=[b], pure=False) for x in xs])
    assert got == [[True, 0, float(np.arange(n).sum())] for n, _ in cases]
    del xs
    back_to(c, baseline)
