"""The routing decision, one row per case: no cluster, no GPU (issue 17: routing as a pure function)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from dask_gpupool.handoff.routing import Route, route
from dask_gpupool.handoff.stats import FALLBACK_REASONS
from dask_gpupool.wire.registry import PoolRecord

GPU0, GPU1, GPU2 = "GPU-0", "GPU-1", "GPU-2"
OWN = PoolRecord(
    pool="00000000-0000-0000-0000-000000000001",
    worker="tcp://10.0.0.1:4000",
    pid=100,
    host="host-a",
    hostname="a",
    kind="device",
    device=GPU0,
    max_size=1 << 30,
    broker="/tmp/b0",
    devices=(GPU0, GPU1),
    peers=(GPU1,),
)
PEER = dataclasses.replace(
    OWN, pool="00000000-0000-0000-0000-000000000002", worker="tcp://10.0.0.1:4001", pid=101, peers=()
)
MiB = 1 << 20


def peer(**changes: object) -> PoolRecord:
    return dataclasses.replace(PEER, **changes)  # type: ignore[arg-type]


# (case, own row changes, requester's row (or None), scheme, keyword facts, expected reason or "handoff"/"copy")
CASES = [
    ("same GPU, tcp", {}, PEER, "tcp", {}, "handoff"),
    ("same GPU, tls", {}, PEER, "tls", {}, "handoff"),
    ("same GPU, ucxx", {}, PEER, "ucxx", {}, "handoff"),
    ("inproc comm", {}, PEER, "inproc", {}, "comm"),
    ("another host", {}, peer(host="host-b"), "tcp", {}, "copy"),
    ("same process", {}, peer(pid=OWN.pid), "tcp", {}, "same-process"),
    ("pool closing", {}, PEER, "tcp", {"pool_open": False}, "pool-closed"),
    ("not in the pool", {}, PEER, "tcp", {"owned": False}, "not-in-pool"),
    ("transfer failed lately", {}, PEER, "tcp", {"unreachable": True}, "peer-unreachable"),
    ("requester cannot see the GPU", {}, peer(devices=(GPU1,), device=GPU1), "tcp", {}, "no-access"),
    ("requester on a granted GPU", {}, peer(device=GPU1), "tcp", {}, "handoff"),
    ("requester on a GPU not granted", {}, peer(device=GPU2, devices=(GPU0, GPU2)), "tcp", {}, "other-gpu"),
    ("host pool, requester without GPU", {"kind": "host", "device": None}, peer(devices=()), "tcp", {}, "handoff"),
    ("pinned pool, requester without GPU", {"kind": "pinned"}, peer(devices=()), "tcp", {}, "no-access"),
    ("under the handoff threshold", {}, PEER, "tcp", {"nbytes": 1024, "handoff_threshold": 4096}, "small"),
    ("at the handoff threshold", {}, PEER, "tcp", {"nbytes": 4096, "handoff_threshold": 4096}, "handoff"),
    ("handoff threshold, ucxx", {}, PEER, "ucxx", {"nbytes": 1024, "handoff_threshold": 4096}, "handoff"),
]


@pytest.mark.parametrize(("case", "own", "row", "scheme", "facts", "expected"), CASES, ids=[c[0] for c in CASES])
def test_route(case, own, row, scheme, facts, expected):
    mine = dataclasses.replace(OWN, **own)
    got = route(mine, row.worker, row, scheme, **{"pool_open": True, "owned": True, **facts})
    if expected == "handoff":
        assert got == Route(row, None)
    elif expected == "copy":
        assert got == Route(None, None)
    else:
        assert got.reason == expected and expected in FALLBACK_REASONS


def test_a_requester_without_a_row():
    """A worker at this host's address with no row is told apart from a client or another host's worker."""
    here, there = "tcp://10.0.0.1:5000", "tcp://10.0.0.2:5000"
    assert route(OWN, here, None, "tcp", pool_open=True, owned=True) == Route(None, "unknown-requester")
    assert route(OWN, there, None, "tcp", pool_open=True, owned=True) == Route(None, None)
    assert route(OWN, here, None, "tcp", pool_open=True, owned=False) == Route(None, None)  # not pool memory
    assert route(OWN, None, None, "tcp", pool_open=True, owned=True) == Route(None, None)  # no get_data


# (case, requester address, requester's row (or None), expected reason for a value outside every pool)
PLAIN_CASES = [
    ("a worker of this host", PEER.worker, PEER, "not-in-pool"),
    ("a worker of another host", "tcp://10.0.0.2:4001", peer(host="host-b", worker="tcp://10.0.0.2:4001"), None),
    ("this process", OWN.worker, peer(pid=OWN.pid), None),
    ("a worker at this address with no row", "tcp://10.0.0.1:4009", None, "unknown-requester"),
    ("another address with no row", "tcp://10.0.0.2:4009", None, None),
    ("not a worker's request (a client)", None, None, None),
]


@pytest.mark.parametrize(("case", "requester", "row", "expected"), PLAIN_CASES, ids=[c[0] for c in PLAIN_CASES])
def test_plain_copy_reason(case, requester, row, expected):
    from dask_gpupool.handoff.routing import plain_copy_reason

    assert plain_copy_reason(OWN, requester, row) == expected
    assert expected is None or expected in FALLBACK_REASONS


@contextlib.contextmanager
def _routes(requester: PoolRecord, **options: object) -> Iterator[tuple[Any, Any]]:
    """:class:`Routes` of a real (host) pool under ``OWN``, a device pool's registry row, with ``requester``'s row
    registered, and its stats: the decisions read the rows (no GPU needed)."""
    from dask_gpupool.config import PoolOptions
    from dask_gpupool.handoff.registry import RegistryView
    from dask_gpupool.handoff.routes import Routes
    from dask_gpupool.handoff.stats import HandoffStats
    from dask_gpupool.memory.pool import Pool
    from dask_gpupool.memory.topology import LocalDevices
    from dask_gpupool.wire.registry import RegistryUpdate

    pool_options = PoolOptions.from_config(kind="host", max_size="16 MiB", **options)
    pool = Pool.create(pool_options, LocalDevices(()))
    try:
        view = RegistryView()
        view.apply(RegistryUpdate(version=1, added=(OWN, requester)))
        stats = HandoffStats()
        yield Routes(pool_options, pool, OWN, view, stats, None), stats
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("requester", "scheme", "nbytes", "staged"),
    [
        (PEER, "tcp", 8 * MiB, True),
        (peer(device=GPU1), "tcp", 8 * MiB, True),  # over TCP the alternative is a host copy: stage for any GPU
        (PEER, "ucxx", 8 * MiB, True),  # UCX, same GPU: a staging copy and a handoff instead of UCX's copy
        (peer(device=GPU1), "ucxx", 8 * MiB, False),  # UCX, another GPU: UCX copies into the requester's memory
        (peer(device=GPU1), "ucx", 8 * MiB, False),
        (PEER, "ucxx", 1 * MiB, False),  # below gpupool.stage-threshold
        (PEER, "inproc", 8 * MiB, False),
        (peer(host="host-b"), "tcp", 8 * MiB, False),
    ],
)
def test_which_plain_arrays_are_staged_into_the_pool(requester, scheme, nbytes, staged):
    """Routes.stage_route: from gpupool.stage-threshold up, to a same-host worker over TCP or TLS, and over UCX only
    to one on this pool's GPU."""
    with _routes(requester, stage_threshold="4 MiB") as (routes, _stats):
        row = routes.stage_route(requester.worker, scheme, nbytes)
        assert (row == requester) if staged else row is None


@pytest.mark.parametrize(
    ("requester", "scheme", "nbytes", "threshold", "staged"),
    [
        (PEER, "tcp", 64 << 10, None, True),  # auto, a worker on this GPU over TCP: from 64 KiB
        (PEER, "tls", 64 << 10, None, True),
        (PEER, "tcp", 32 << 10, None, False),
        (peer(device=GPU1), "tcp", 64 << 10, None, True),  # auto, another GPU: from 64 KiB too
        (peer(device=GPU1), "tcp", 32 << 10, None, False),
        (PEER, "ucxx", 64 << 10, None, False),  # auto over UCX: never (PoolOptions.effective_stage_threshold)
        (PEER, "ucxx", 64 * MiB, None, False),
        (PEER, "ucx", 64 * MiB, None, False),
        (PEER, "ucxx", 4 * MiB, "4 MiB", True),  # set by the user: over UCX too, to a worker on this GPU
        (PEER, "tcp", 64 << 10, "1 MiB", False),  # set by the user: for every GPU and comm
        (peer(device=GPU1), "tcp", 1 * MiB, "1 MiB", True),
    ],
)
def test_the_stage_threshold_of_device_pools_depends_on_the_requesters_gpu_and_comm(
    requester, scheme, nbytes, threshold, staged
):
    """gpupool.stage-threshold: auto on a device pool is 64 KiB for a worker on the pool's GPU over TCP or TLS (staging
    measured faster than the comm from there) and for one on another GPU, and never over UCX; a value the user
    sets holds for all."""
    with _routes(requester, stage_threshold=threshold) as (routes, _stats):
        row = routes.stage_route(requester.worker, scheme, nbytes)
        assert (row == requester) if staged else row is None


@pytest.mark.parametrize(
    ("requester", "nbytes", "threshold", "handed"),
    [
        (PEER, 4 << 10, None, True),  # auto, a worker on this GPU: every size is handed over
        (PEER, 1, None, True),
        (peer(device=GPU1), 4 << 10, None, True),  # auto, another GPU: every size handed over too
        (peer(device=GPU1), 1, None, True),
        (PEER, 4 << 10, "64 KiB", False),  # set by the user: for every GPU
        (peer(device=GPU1), 64 << 10, "64 KiB", True),
    ],
)
def test_the_handoff_threshold_of_device_pools_depends_on_the_requesters_gpu(requester, nbytes, threshold, handed):
    """gpupool.handoff-threshold: auto on a device pool is 0 for a worker on the pool's GPU (a handoff measured faster
    at every size there) and for one on another GPU (measured the same on two H200s); a value the user sets holds for
    both."""
    with _routes(requester, handoff_threshold=threshold) as (routes, stats):
        buf = routes.pool.allocate(nbytes)  # a host pool's buffer under a device pool's row: the row decides
        try:
            row, reason = routes.plan(requester.worker, "tcp", buf)
        finally:
            buf.close()
        assert (row, reason) == ((requester, None) if handed else (None, "small"))
        assert stats.fallbacks == ({} if handed else {"small": 1})
