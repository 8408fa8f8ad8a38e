"""``--preload dask_gpupool`` on the scheduler and the workers, with options from ``--gpupool-<key> VALUE``
arguments, ``DASK_GPUPOOL__*`` variables or the workers' config: Nanny workers, and real ``dask scheduler``
and ``dask worker`` processes as a user starts them."""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
from conftest import (
    by_worker,
    free_port,
    handoff_round_trip,
    nanny_cluster,
    stop_processes,
    wait_for,
    worker_addresses,
)

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import testing as T

MiB = 1 << 20


@pytest.mark.parametrize("where", ["scheduler", "worker"])
def test_preload_gives_the_same_cluster(where):
    config = {"gpupool": {"kind": "host", "max-size": "64MiB"}}
    workers = [{"config": config, **({"preload": ["dask_gpupool"]} if where == "worker" else {})} for _ in range(2)]
    scheduler = {"preload": ["dask_gpupool"]} if where == "scheduler" else {}
    with nanny_cluster(workers, **scheduler) as c:
        wait_for(lambda: len(dask_gpupool.pools(c)) == 2)
        a, b = worker_addresses(c)
        rows = by_worker(c)
        assert {r.kind for r in rows.values()} == {"host"}
        desc = c.submit(T.hold, "p", 4096, b"preloaded", workers=[a], pure=False).result()
        assert c.submit(T.read_peer, desc, 9, workers=[b], pure=False).result() == b"preloaded"


def test_workers_preloading_with_different_arguments_each_get_their_own_options():
    """``dask worker --preload dask_gpupool --gpupool-<key> VALUE``: a worker's arguments are its own dask config
    (README), so two workers preloading with different sizes get different pools, whichever registered
    ``GPUPool`` on the scheduler first."""
    config = {"gpupool": {"kind": "host"}}
    workers = [
        {"config": config, "preload": ["dask_gpupool"], "preload_argv": [["--gpupool-max-size", f"{size}MiB"]]}
        for size in (32, 16)
    ]
    with nanny_cluster(workers) as c:
        wait_for(lambda: len(dask_gpupool.pools(c)) == 2)
        w0, w1 = worker_addresses(c)
        rows = by_worker(c)
        assert (rows[w0].max_size, rows[w1].max_size) == (32 * MiB, 16 * MiB)
        handoff_round_trip(c, MiB, b"own options")


def test_cli_preload_cluster_configured_by_environment(tmp_path):
    """`dask scheduler --preload dask_gpupool` + `dask worker`, options from DASK_GPUPOOL__* variables."""
    import contextlib
    import subprocess
    import sys
    import time as _time

    from distributed import Client

    port = free_port()
    env = {**os.environ, "DASK_GPUPOOL__KIND": "host", "DASK_GPUPOOL__MAX_SIZE": "64MiB"}
    dask_cli = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
    address = f"tcp://127.0.0.1:{port}"
    worker_cli = [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nworkers", "2", "--nthreads", "1"]
    logs = contextlib.ExitStack()
    procs = [
        subprocess.Popen(
            [*dask_cli, "--host", "127.0.0.1", "--port", str(port), "--no-dashboard", "--preload", "dask_gpupool"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=logs.enter_context(open(tmp_path / "scheduler.log", "w")),
        )
    ]
    try:
        procs.append(
            subprocess.Popen(
                [*worker_cli, "--no-dashboard"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=logs.enter_context(open(tmp_path / "worker.log", "w")),
            )
        )
        with Client(address, timeout=30) as c:
            c.wait_for_workers(2, timeout=60)
            deadline = _time.monotonic() + 30
            while len(dask_gpupool.pools(c)) < 2 and _time.monotonic() < deadline:
                _time.sleep(0.2)
            rows = dask_gpupool.pools(c)
            assert len(rows) == 2 and all(r.kind == "host" and r.max_size == 64 << 20 for r in rows)
            a, b = sorted(r.worker for r in rows)
            desc = c.submit(T.hold, "cli", 4096, b"from the CLI", workers=[a], pure=False).result()
            assert c.submit(T.read_peer, desc, 12, workers=[b], pure=False).result() == b"from the CLI"
            c.submit(T.release, "cli", workers=[a], pure=False).result()
    finally:
        stop_processes(procs)
        logs.close()
    # distributed starts a preloaded plugin again after the preloads: ours sets the workers up once
    assert (tmp_path / "scheduler.log").read_text().count("Registering Worker plugin gpupool") == 1


def test_preload_arguments_set_every_option_and_a_bad_value_is_logged_and_reported(tmp_path):
    """`dask worker --preload dask_gpupool --gpupool-<key> VALUE ...` sets options; a worker whose config is bad
    logs a ConfigError naming the key at start-up and is reported without a pool."""
    import sys

    from conftest import wait_for
    from distributed import Client

    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = {**os.environ, "DASK_GPUPOOL__KIND": "host"}
    scheduler = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(port)]
    worker = [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1", "--no-dashboard"]
    args = ["--preload", "dask_gpupool", "--gpupool-max-size", "32MiB", "--gpupool-lease-timeout", "30s"]
    procs = [subprocess.Popen([*scheduler, "--no-dashboard", "--preload", "dask_gpupool"], env=env)]
    try:
        procs.append(subprocess.Popen([*worker, *args], env=env, stderr=subprocess.DEVNULL))
        with Client(address, timeout=30) as c:
            c.wait_for_workers(1, timeout=60)
            wait_for(lambda: len(dask_gpupool.pools(c)) == 1, what="the good worker's pool")
            (row,) = dask_gpupool.pools(c)
            assert row.kind == "host" and row.max_size == 32 << 20
            bad_log = tmp_path / "bad-worker.log"
            with open(bad_log, "w") as log:
                bad_env = {**env, "DASK_GPUPOOL__KIND": "gpu"}
                procs.append(subprocess.Popen([*worker, "--preload", "dask_gpupool"], env=bad_env, stderr=log))
                c.wait_for_workers(2, timeout=60)
            assert "ConfigError: gpupool.kind='gpu' is not a pool kind" in bad_log.read_text()
            (bad,) = set(T.workers(c)) - {row.worker}
            wait_for(lambda: "error" in dask_gpupool.stats(c)[bad], what="the bad worker's failure")
            assert "gpupool.kind='gpu'" in dask_gpupool.stats(c)[bad]["error"]
            assert [r.worker for r in dask_gpupool.pools(c)] == [row.worker]
    finally:
        stop_processes(procs)


def test_a_bad_preload_argument_leaves_the_worker_without_a_pool_and_says_why_in_one_line(tmp_path):
    """``--gpupool-max-size banana``: the worker joins with no pool (never a pool of the default size), is listed as
    ``no pool: ConfigError: ...`` by ``stats()`` and ``info``, and its log says why in one line, with no traceback.
    A registration made while it is there returns without waiting for it, and it still has no pool."""
    from distributed import Client

    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    # not under tmp_path: a broker socket's path under this test's long directory name is past AF_UNIX's limit
    brokers = pathlib.Path(tempfile.mkdtemp(prefix="brokers-"))
    env = {**os.environ, "DASK_GPUPOOL__KIND": "host", "DASK_GPUPOOL__BROKER_DIR": str(brokers)}
    scheduler = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(port)]
    worker = [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1", "--no-dashboard"]
    worker += ["--host", "127.0.0.1", "--preload", "dask_gpupool"]
    scheduler_log, bad_log = tmp_path / "scheduler.log", tmp_path / "bad-worker.log"
    logs = contextlib.ExitStack()
    procs = [
        subprocess.Popen(
            [*scheduler, "--no-dashboard", "--preload", "dask_gpupool"],
            env=env,
            stderr=logs.enter_context(open(scheduler_log, "w")),
        )
    ]
    try:
        procs.append(subprocess.Popen([*worker, "--gpupool-max-size", "32MiB"], env=env, stderr=subprocess.DEVNULL))
        with Client(address, timeout=30) as c:
            c.wait_for_workers(1, timeout=60)
            wait_for(lambda: len(dask_gpupool.pools(c)) == 1, what="the good worker's pool")
            (good,) = dask_gpupool.pools(c)
            bad_args = ["--gpupool-max-size", "banana"]
            procs.append(subprocess.Popen([*worker, *bad_args], env=env, stderr=logs.enter_context(open(bad_log, "w"))))
            c.wait_for_workers(2, timeout=60)
            (bad,) = set(T.workers(c)) - {good.worker}
            wait_for(lambda: "error" in dask_gpupool.stats(c)[bad], what="the bad worker to be listed without a pool")
            assert [r.worker for r in dask_gpupool.pools(c)] == [good.worker]
            why = "ConfigError: gpupool.max-size='banana'"
            assert f"its set-up failed: {why}" in dask_gpupool.stats(c)[bad]["error"]
            out = subprocess.run(
                [sys.executable, "-m", "dask_gpupool", "info", address], capture_output=True, text=True, timeout=120
            )
            assert out.returncode == 0, out.stderr
            (line,) = [line for line in out.stdout.splitlines() if line.startswith(bad)]
            assert "no pool: " in line and why in line, out.stdout

            # Registered again while the poolless worker is there: returns once the good worker joined (the bad one
            # answered that it has no pool), and the bad worker still has none.
            c.register_plugin(GPUPool(kind="host", max_size="16MiB"))
            (row,) = dask_gpupool.pools(c)
            assert row.worker == good.worker and row.max_size == 16 << 20
            assert why in dask_gpupool.stats(c)[bad]["error"]
            text = bad_log.read_text()  # before the processes stop (a worker may log its scheduler leaving first)
            said = [line for line in text.splitlines() if "banana" in line]
            assert len(said) == 1 and "ConfigError" in said[0] and "no pool" in said[0], text
            assert "Traceback" not in text, text
    finally:
        stop_processes(procs[1:])  # the workers first: a worker whose scheduler left at the same time may be killed
        stop_processes(procs[:1])
        logs.close()
    assert "have not joined the registry" not in scheduler_log.read_text()
    assert not list(brokers.iterdir()), "a broker directory outlived its worker"
    brokers.rmdir()
