"""gpupool.cupy-allocator resolved (issue 18): which pools CuPy is routed into, and the reason stats() shows.

Replacing an allocator installed before the plugin (dask-cuda's RMM one) runs on a GPU (``tests/test_gpu.py``).
"""

from __future__ import annotations

import pytest

from dask_gpupool import PoolOptions
from dask_gpupool.dask import rmm_routing
from dask_gpupool.dask.cupy_routing import decide

AUTO = (
    "off (auto): CuPy keeps its allocator; arrays from gpupool.stage-threshold up are copied into the pool on the GPU "
    "when a same-host worker asks"
)


@pytest.mark.parametrize(
    ("setting", "kind", "route", "reason"),
    [
        (None, "host", False, "off: a host pool holds no GPU memory"),
        (True, "host", False, "off: a host pool holds no GPU memory"),
        (None, "pinned", False, "off (auto): CuPy keeps its allocator"),
        (None, "device", False, AUTO),
        (True, "pinned", True, "pool (gpupool.cupy-allocator: true)"),
        (True, "device", True, "pool (gpupool.cupy-allocator: true)"),
        (False, "device", False, "off (gpupool.cupy-allocator: false)"),
    ],
)
def test_decide(setting, kind, route, reason):
    assert decide(setting, kind) == (route, reason)


@pytest.mark.parametrize(("raw", "expected"), [("auto", None), ("true", True), (False, False)])
def test_the_setting_parses(raw, expected):
    assert PoolOptions.from_config(cupy_allocator=raw).cupy_allocator is expected


@pytest.mark.parametrize(
    ("setting", "kind", "placed", "route", "reason"),
    [
        (
            None,
            "device",
            True,
            False,
            "off (auto): RMM keeps its resource; CuPy arrays and device frames from gpupool.stage-threshold up are "
            "copied into the pool on the GPU when a same-host worker asks",
        ),
        (False, "device", True, False, "off (gpupool.rmm-allocator: false)"),
        (True, "host", False, False, "off: a host pool holds no memory RMM allocates"),
        (True, "pinned", False, False, "off: a pinned pool holds no memory RMM allocates"),
        (
            True,
            "device",
            False,
            False,
            "off: the pool's segments are not placed by RMM (gpupool.suballocator, segment-size, rmm)",
        ),
        (True, "device", True, True, "pool (gpupool.rmm-allocator: true)"),
    ],
)
def test_rmm_allocator_resolves_to_a_route_and_a_reason(setting, kind, placed, route, reason):
    assert rmm_routing.decide(setting, kind, placed) == (route, reason)


def test_rmm_and_cupy_allocators_are_not_both_on():
    assert PoolOptions.from_config().rmm_allocator is None  # auto: off, staging covers what RMM allocates
    assert PoolOptions.from_config(rmm_allocator="auto").rmm_allocator is None
    assert PoolOptions.from_config(rmm_allocator="false").rmm_allocator is False
    assert PoolOptions.from_config(rmm_allocator="true").rmm_allocator is True
    assert PoolOptions.from_config(rmm_allocator="auto", cupy_allocator=True).cupy_allocator is True
    assert PoolOptions.from_config(rmm_allocator=True, cupy_allocator=False).rmm_allocator is True
    with pytest.raises(ValueError, match=r"rmm-allocator and gpupool\.cupy-allocator are both on"):
        PoolOptions.from_config(rmm_allocator=True, cupy_allocator=True)
