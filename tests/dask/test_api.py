"""The client functions (``pools``, ``stats``, ``pool_stats``, ``trim``) on a live cluster: on an asynchronous
client, and with a worker that does not answer or has no pool."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from conftest import (
    PLUGIN,
    cli,
    free_port,
    nanny_cluster,
    stop_processes,
    wait_for,
    worker_addresses,
)

import dask_gpupool
from dask_gpupool import testing as T

MiB = 1 << 20


def test_the_client_functions_work_on_an_asynchronous_client(client):
    """``pools``, ``stats``, ``pool_stats`` and ``trim`` on ``Client(asynchronous=True)`` raised ``TypeError`` (a
    coroutine is not subscriptable): they return awaitables there, as Dask's own Client methods do."""
    import asyncio

    from distributed import Client

    async def ask(address: str) -> dict:
        async with Client(address, asynchronous=True) as ac:
            calls = {
                "pools": dask_gpupool.pools(ac),
                "stats": dask_gpupool.stats(ac),
                "pool_stats": dask_gpupool.pool_stats(ac, timeout=10),
                "trim": dask_gpupool.trim(ac),
            }
            assert all(asyncio.iscoroutine(c) or asyncio.isfuture(c) for c in calls.values()), calls
            return {name: await call for name, call in calls.items()}

    got = asyncio.run(ask(client.scheduler.address))
    workers = set(worker_addresses(client))
    assert {r.worker for r in got["pools"]} == workers
    assert {r.pool for r in got["pools"]} == {r.pool for r in dask_gpupool.pools(client)}  # as the sync client sees
    for name in ("stats", "pool_stats", "trim"):
        assert set(got[name]) == workers and not any("error" in v for v in got[name].values()), (name, got[name])
    assert all(got["pool_stats"][w]["kind"] == "host" for w in workers)
    assert all("exports" in got["stats"][w] and "reserved" in got["trim"][w] for w in workers)


def test_a_worker_that_does_not_answer_is_reported_and_the_others_still_are():
    """A stopped worker (SIGSTOP: swapping, a debugger, a task holding the GIL) made ``dask gpupool info`` and
    ``trim``, and ``stats()``, ``pool_stats()`` and ``trim()``, wait for it with no end: the operator's tool hung
    exactly when something was wrong. Each worker now has ``--timeout`` (``timeout=``) to answer; one that does
    not is listed as not answering, and the others are listed as usual."""
    import sys

    from conftest import pid_of, warm_up

    with nanny_cluster([{}, {}], PLUGIN) as c:
        a, b = worker_addresses(c)
        warm_up(c, a, b)
        address = c.scheduler.address
        pid = pid_of(c, b)
        os.kill(pid, signal.SIGSTOP)
        try:
            for command in ("info", "trim"):
                t0 = time.monotonic()
                try:
                    out = subprocess.run(
                        [sys.executable, "-m", "dask_gpupool", command, address, "--timeout", "3"],
                        capture_output=True,
                        text=True,
                        timeout=60,
                    )
                except subprocess.TimeoutExpired:
                    pytest.fail(f"`{command}` still waited for the stopped worker after 60 s")
                assert out.returncode == 0, out.stderr
                assert time.monotonic() - t0 < 30
                assert f"{b:28} no answer within 3 s" in out.stdout, out.stdout
                assert f"{a:28} no answer" not in out.stdout and f"{a:28} no pool" not in out.stdout, out.stdout
            for call in (dask_gpupool.stats, dask_gpupool.pool_stats, dask_gpupool.trim):
                got = call(c, timeout=2)
                assert set(got) == {a, b} and "error" not in got[a], (call, got)
                assert got[b] == {"error": "TimeoutError: no answer within 2 s"}, (call, got)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert "error" not in dask_gpupool.stats(c)[b]  # answering again


def test_a_worker_whose_pool_set_up_failed_is_reported_and_the_others_still_answer(tmp_path):
    """A worker joins with a bad gpupool config (no preload of its own): stats, pool_stats, trim, info, the trim
    command and the page name its failure; the other workers' pools work and are listed."""
    import json
    import sys
    import urllib.request

    from distributed import Client

    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = {**os.environ, "DASK_GPUPOOL__KIND": "host", "DASK_GPUPOOL__MAX_SIZE": "64MiB"}
    scheduler = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(port)]
    worker = [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1", "--no-dashboard"]
    procs = [
        subprocess.Popen(
            # the scheduler picks its dashboard's port and says which (a port picked here beforehand was taken by
            # another process's comm in a GPU-machine run of two halves side by side)
            [*scheduler, "--dashboard-address", "127.0.0.1:0", "--preload", "dask_gpupool"],
            env=env,
            stderr=subprocess.DEVNULL,
        )
    ]
    try:
        procs.append(subprocess.Popen([*worker, "--nworkers", "2"], env=env, stderr=subprocess.DEVNULL))
        with Client(address, timeout=30) as c:
            c.wait_for_workers(2, timeout=60)
            wait_for(lambda: len(dask_gpupool.pools(c)) == 2, what="the two good workers' pools")
            good = set(T.workers(c))
            bad_env = {**env, "DASK_GPUPOOL__SEGMENT_MEMORY": "jemalloc"}
            procs.append(subprocess.Popen(worker, env=bad_env, stderr=subprocess.DEVNULL))
            c.wait_for_workers(3, timeout=60)
            (w,) = set(T.workers(c)) - good
            a, b = sorted(good)
            desc = c.submit(T.hold, "ok", 4096, b"the others still hand over", workers=[a], pure=False).result()
            assert c.submit(T.read_peer, desc, 26, workers=[b], pure=False).result() == b"the others still hand over"
            c.submit(T.release, "ok", workers=[a], pure=False).result()
            # a pool value fetched by the poolless worker: copied, and counted with its reason
            v = c.submit(T.fill, 4096, 3, workers=[a], pure=False)
            assert c.submit(T.all_equal, v, 3, workers=[w], pure=False).result()
            assert dask_gpupool.stats(c)[a]["fallbacks"] == {"unknown-requester": 1}
            del v
            for got in (dask_gpupool.stats(c), dask_gpupool.pool_stats(c)):
                assert set(got) == good | {w}
                assert not any("error" in got[g] for g in good)
                assert "its set-up failed: ConfigError: gpupool.segment-memory='jemalloc'" in got[w]["error"]

            dash = c.scheduler_info()["services"]["dashboard"]

            def page(path: str) -> str:
                with urllib.request.urlopen(f"http://127.0.0.1:{dash}{path}", timeout=10) as r:
                    return r.read().decode()

            wait_for(lambda: "error" in json.loads(page("/gpupool.json"))["workers"].get(w, {}), what="w's failure")
            assert "no pool: ConfigError: gpupool.segment-memory=&#x27;jemalloc&#x27;" in page("/gpupool")
            out = cli("info", address)
            assert out.returncode == 0, out.stderr
            assert "2 pool(s)" in out.stdout and f"{w:28} no pool: PoolUnavailableError" in out.stdout
            # trim gives the others' memory back and names the poolless worker, as stats() does
            trimmed = dask_gpupool.trim(c)
            assert set(trimmed) == good | {w} and not any("error" in trimmed[g] for g in good)
            assert "its set-up failed: ConfigError: gpupool.segment-memory='jemalloc'" in trimmed[w]["error"]
            out = cli("trim", address)
            assert out.returncode == 0, out.stderr
            assert f"{w:28} no pool: PoolUnavailableError" in out.stdout
    finally:
        stop_processes(procs)
