"""``dask worker ADDRESS --preload dask_gpupool --gpupool-<key> VALUE``: real ``dask scheduler`` and ``dask worker``
processes, as a user starts them."""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
import tempfile

from conftest import free_port, stop_processes, wait_for

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import testing as T


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
