"""The routing decision, one row per case, as a pure function: no cluster, no GPU."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from dask_gpupool.handoff.routes import Route, route
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
    from dask_gpupool.handoff.routes import plain_copy_reason

    assert plain_copy_reason(OWN, requester, row) == expected
    assert expected is None or expected in FALLBACK_REASONS


@contextlib.contextmanager
def _routes(requester: PoolRecord, own: PoolRecord = OWN, **sizes: Any) -> Iterator[tuple[Any, Any]]:
    """:class:`Routes` of a real (host) pool under ``own`` (by default a device pool's registry row), with
    ``requester``'s row registered, and its stats: the decisions read the rows (no GPU needed). ``sizes``: the
    collaborators Routes holds values against (by default dask_gpupool.tuning's)."""
    from dask_gpupool.config import PoolOptions
    from dask_gpupool.handoff.registry import RegistryView
    from dask_gpupool.handoff.routes import Routes
    from dask_gpupool.handoff.stats import HandoffStats
    from dask_gpupool.memory.pool import Pool
    from dask_gpupool.memory.topology import LocalDevices
    from dask_gpupool.wire.registry import RegistryUpdate

    pool_options = PoolOptions.from_config(kind="host", max_size="16 MiB")
    pool = Pool.create(pool_options, LocalDevices(()))
    try:
        view = RegistryView()
        view.apply(RegistryUpdate(version=1, added=(own, requester)))
        stats = HandoffStats()
        yield Routes(pool_options, pool, own, view, stats, None, **sizes), stats
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("requester", "scheme", "nbytes", "staged"),
    [
        (PEER, "tcp", 8 * MiB, True),
        (PEER, "tcp", 64 << 10, True),  # a device pool over TCP: from 64 KiB (tuning.STAGE_THRESHOLD)
        (PEER, "tls", 64 << 10, True),
        (PEER, "tcp", 32 << 10, False),
        (peer(device=GPU1), "tcp", 64 << 10, True),  # over TCP the alternative is a host copy: for any GPU
        (peer(device=GPU1), "tcp", 32 << 10, False),
        (PEER, "ucxx", 8 * MiB, False),  # over UCX never: UCX copies the array GPU to GPU itself
        (peer(device=GPU1), "ucxx", 8 * MiB, False),
        (peer(device=GPU1), "ucx", 8 * MiB, False),
        (PEER, "inproc", 8 * MiB, False),
        (peer(host="host-b"), "tcp", 8 * MiB, False),
    ],
)
def test_which_plain_arrays_are_staged_into_the_pool(requester, scheme, nbytes, staged):
    """Routes.stage_route: on a device pool from 64 KiB, to a same-host worker over TCP or TLS, whatever its GPU;
    never over UCX."""
    with _routes(requester) as (routes, _stats):
        row = routes.stage_route(requester.worker, scheme, nbytes)
        assert (row == requester) if staged else row is None


def test_host_pools_stage_from_their_threshold_over_tcp_only():
    """routes.stage_threshold_of is 1 MiB on host pools over TCP or TLS (tuning.HOST_STAGE_THRESHOLD); a test's own
    threshold (testing.faults.route_sizes gives one to a worker) is what Routes holds arrays against then."""
    host = dataclasses.replace(OWN, kind="host", device=None, devices=(), peers=())
    requester = peer(devices=(), device=None)
    with _routes(requester, host) as (routes, _stats):
        assert routes.stage_threshold(requester.worker, "tcp") == 1 * MiB
        assert routes.stage_route(requester.worker, "tcp", 8 * MiB) == requester
        assert routes.stage_route(requester.worker, "tcp", MiB - 1) is None
        assert routes.stage_route(requester.worker, "ucxx", 8 * MiB) is None
    given = {"stage_threshold_of": lambda kind, over_tcp: (1 * MiB) if over_tcp else 0}
    with _routes(requester, host, **given) as (routes, _stats):
        assert routes.stage_route(requester.worker, "tcp", 1 * MiB) == requester
        assert routes.stage_route(requester.worker, "tcp", MiB - 1) is None
        assert routes.stage_route(requester.worker, "ucxx", 8 * MiB) is None


@pytest.mark.parametrize(
    ("own", "requester", "nbytes", "handed"),
    [
        ({}, PEER, 4 << 10, True),  # a device pool, a worker on its GPU: every size is handed over
        ({}, PEER, 1, True),
        ({}, peer(device=GPU1), 4 << 10, True),  # another GPU: every size handed over too
        ({}, peer(device=GPU1), 1, True),
        ({"kind": "host", "device": None}, peer(devices=(), device=None), 32 << 10, False),  # host pools: from 64 KiB
        ({"kind": "host", "device": None}, peer(devices=(), device=None), 64 << 10, True),
    ],
)
def test_the_handoff_threshold_depends_on_the_pool_kind(own, requester, nbytes, handed):
    """routes.handoff_threshold_of: 0 on a device pool, for a worker on its GPU or another (a handoff measured faster at
    every size on one H100 and across two H200s); 64 KiB on a host pool (the CPU crossover)."""
    with _routes(requester, dataclasses.replace(OWN, **own)) as (routes, stats):
        buf = routes.pool.allocate(nbytes)  # a host pool's buffer under the row given: the row decides
        try:
            row, reason = routes.plan(requester.worker, "tcp", buf)
        finally:
            buf.close()
        assert (row, reason) == ((requester, None) if handed else (None, "small"))
        assert stats.fallbacks == ({} if handed else {"small": 1})
