from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest

from dask_gpupool.memory.topology import local_devices


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if local_devices():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@contextlib.contextmanager
def nanny_cluster(
    workers: list[dict[str, Any]], plugin: Any = None, security: Any = None, **scheduler_options: Any
) -> Iterator[Any]:
    """A SpecCluster of real ``Nanny`` workers (one thread each) and a Client.

    Each entry of ``workers`` holds extra ``Nanny`` options, e.g.
    ``{"env": {"CUDA_VISIBLE_DEVICES": "1,0"}, "config": {"gpupool": {"host-id": "a"}}}``.
    Yields the client; with ``plugin`` given it is registered first.

    The Active Memory Manager's timer is off: tests that write into a
    producer's buffer after a handoff need the producer's replica to stay
    (ReduceReplicas may drop it, and a task pinned to the producer would then
    fetch a copy back from the consumer and write into that). A GPU run saw
    this once. Tests of the AMM make its requests themselves.
    """
    import dask
    from distributed import Client, Nanny, Scheduler, SpecCluster

    secured = {"security": security, "protocol": "tls"} if security is not None else {}
    specs = {
        f"w{i}": {"cls": Nanny, "options": {"nthreads": 1, "dashboard_address": None, **secured, **options}}
        for i, options in enumerate(workers)
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0", **secured, **scheduler_options}}
    amm_off = dask.config.set({"distributed.scheduler.active-memory-manager.start": False})
    with amm_off, SpecCluster(workers=specs, scheduler=scheduler, asynchronous=False, security=security) as cluster:
        with Client(cluster, security=security) as client:
            client.wait_for_workers(len(workers))
            if plugin is not None:
                client.register_plugin(plugin)
            yield client


def worker_addresses(client: Any) -> list[str]:
    """Worker addresses ordered by worker name (w0, w1, ...)."""
    workers = client.scheduler_info()["workers"]
    return [a for a, _ in sorted(workers.items(), key=lambda kv: str(kv[1]["name"]))]


def pid_of(client: Any, worker: str) -> int:
    """The pid of ``worker``'s process, from the pool registry."""
    import dask_gpupool

    return next(r.pid for r in dask_gpupool.pools(client) if r.worker == worker)


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def no_fd_leak() -> Iterator[None]:
    """Fails the test if it leaves more fds open in this process than it found."""
    import gc

    local_devices()  # the driver's own fds, opened once per process, are not the test's
    gc.collect()
    before = fd_count()
    yield
    gc.collect()
    assert fd_count() <= before, "the test leaked file descriptors in the test process"


def handoff_round_trip(client: Any, nbytes: int, data: bytes) -> dict[str, Any]:
    """Worker w0 writes ``data`` into its pool, w1 maps w0's pool and reads it (twice), both let go.

    Checks the bytes, that the pool was mapped once, and that every worker is back to its
    baseline afterwards: fds, sockets, memfds, broker connections, mapped pools, pool bytes.
    One warm-up round trip comes first: a process's first CUDA use opens driver fds that stay.
    Returns the registry rows by worker.
    """
    import dask_gpupool
    from dask_gpupool import testing as T

    a, b = worker_addresses(client)
    rows = {r.worker: r for r in dask_gpupool.pools(client)}

    def trip(key: str, size: int, payload: bytes, reads: int) -> dict[str, Any]:
        desc = client.submit(T.hold, key, size, payload, workers=[a], pure=False).result()
        for _ in range(reads):
            assert client.submit(T.read_peer, desc, len(payload), workers=[b], pure=False).result() == payload
        during = client.run(T.resources)
        client.submit(T.release, key, workers=[a], pure=False).result()
        client.submit(T.unmap, rows[a].pool, workers=[b], pure=False).result()
        return during

    trip("warm-up", 4096, b"w", 1)
    before = client.run(T.resources)
    during = trip("trip", nbytes, data, 2)
    assert during[b]["mapped_pools"] == 1  # mapped once, reused
    assert during[a]["used"] >= nbytes
    after = client.run(T.resources)
    assert after == before, f"not back to the baseline, (after, before) by worker: {resource_diff(after, before)}"
    return rows


def resource_diff(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """What differs between two :func:`~dask_gpupool.testing.resources` snapshots, fd kinds one by one."""
    out: dict[str, Any] = {}
    for w, base in before.items():
        now = after.get(w, {})
        diff = {k: (now.get(k), v) for k, v in base.items() if k != "fd_kinds" and now.get(k) != v}
        kinds_now, kinds_base = now.get("fd_kinds", {}), base.get("fd_kinds", {})
        diff.update(
            {
                f"fd {k}": (kinds_now.get(k, 0), kinds_base.get(k, 0))
                for k in {*kinds_now, *kinds_base}
                if kinds_now.get(k, 0) != kinds_base.get(k, 0)
            }
        )
        if diff:
            out[w] = diff
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_processes(procs: list[Any]) -> None:
    """Terminate the ``subprocess.Popen`` objects still running (last started first), then reap them all."""
    import subprocess

    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(30)
