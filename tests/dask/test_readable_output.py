"""What a user reads: ``stats()`` and ``pool_stats()`` print one line per worker, the ``info`` command's and the
``/gpupool`` page's columns say what they count, the preload's usage names the command it runs in, and expected
failures (a bad option, a worker that cannot make a pool) log one line, not a traceback, on each process."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import urllib.request

from conftest import free_port, nanny_cluster, stop_processes, wait_for, worker_addresses

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import testing as T

MiB = 1 << 20


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dask_gpupool", *args], capture_output=True, text=True, timeout=120)


def test_stats_and_pool_stats_print_one_line_per_worker_and_still_index_as_dicts():
    """``print(stats(client))`` printed every counter of every worker as nested dicts: kilobytes per worker."""
    with nanny_cluster([{}, {}], GPUPool(kind="host", max_size="64MiB")) as c:
        a, b = worker_addresses(c)
        x = c.submit(T.fill, 4 * MiB, 7, workers=[a], pure=False)
        assert c.submit(T.all_equal, x, 7, workers=[b], pure=False).result()

        got = dask_gpupool.stats(c)
        text = str(got)
        lines = text.splitlines()
        assert len(lines) == 3 and all(len(line) < 200 for line in lines), text  # a header, then a line per worker
        assert repr(got) == text
        assert got[b]["zero_copy_bytes"] == 4 * MiB and got[b]["copied_bytes"] == 0  # indexed as ever
        assert isinstance(got, dict) and type(got.raw) is dict and got.raw == dict(got)
        assert json.loads(json.dumps(got)) == json.loads(json.dumps(got.raw))
        (row_a,) = [line for line in lines if line.startswith(a)]
        (row_b,) = [line for line in lines if line.startswith(b)]
        assert "host" in row_b and "4.00 MiB" in row_b and "64.00 MiB" in row_b, text
        assert "4.00 MiB" in row_a, text  # a's pool holds x, and b holds a lease on it
        for column in ("pool", "zero-copy in", "copied in", "copied out", "fallbacks"):
            assert column in lines[0], text

        usage = dask_gpupool.pool_stats(c)
        lines = str(usage).splitlines()
        assert len(lines) == 3 and "used" in lines[0] and "reserved" in lines[0], str(usage)
        assert usage[a]["used"] >= 4 * MiB and usage[a]["kind"] == "host"
        assert isinstance(usage, dict) and type(usage.raw) is dict and usage.raw == dict(usage)
        (row_a,) = [line for line in lines if line.startswith(a)]
        assert "host" in row_a and "4.00 MiB" in row_a and "64.00 MiB" in row_a, str(usage)

        # The registry's count of other GPUs granted access to a pool: not "peers" (read as peer workers)
        out = cli("info", c.scheduler.address)
        assert out.returncode == 0, out.stderr
        header = out.stdout.splitlines()[2]
        assert "peer GPUs" in header and " peers " not in f"{header} ", out.stdout
        port = c.scheduler_info()["services"]["dashboard"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/gpupool", timeout=10) as r:
            page = r.read().decode()
        assert "<th>peer GPUs</th>" in page and "<th>peers</th>" not in page, page
        del x


def preload_usage(command: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``COMMAND --preload dask_gpupool ARGS``, stopped by click before any server starts; its output's words one
    space apart (click wraps a usage line longer than the terminal)."""
    out = subprocess.run([*command, "--preload", "dask_gpupool", *args], capture_output=True, text=True, timeout=120)
    out.stdout, out.stderr = " ".join(out.stdout.split()), " ".join(out.stderr.split())
    return out


def test_the_preload_usage_names_the_command_it_runs_in():
    """A bad preload argument printed ``Usage:  [OPTIONS]`` and ``Try ' --help' for help.``: no program at all."""
    worker = [sys.executable, "-m", "distributed.cli.dask_worker", "tcp://127.0.0.1:1"]
    out = preload_usage(worker, "--gpupool-bogus", "1")
    assert out.returncode == 2, out.stderr
    usage = "Usage: python -m distributed.cli.dask_worker --preload dask_gpupool [--gpupool-<key> VALUE]..."
    assert usage in out.stderr and "No such option '--gpupool-bogus'" in out.stderr, out.stderr
    # the preload's own help, after "--" (a --help before it is dask worker's): what the hint says to run
    assert "python -m distributed.cli.dask_worker SCHEDULER --preload dask_gpupool -- --help" in out.stderr
    assert "Try ' --help'" not in out.stderr, out.stderr
    out = preload_usage(worker, "--", "--help")
    assert out.returncode == 0 and out.stdout.startswith(usage), out.stdout + out.stderr
    assert "--gpupool-max-size" in out.stdout and ":class:" not in out.stdout, out.stdout

    scheduler = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
    out = preload_usage(scheduler, "--gpupool-kind", "gpu")
    assert out.returncode == 2, out.stderr
    assert "Usage: python -m distributed.cli.dask_scheduler --preload dask_gpupool [--gpupool-" in out.stderr
    assert "python -m distributed.cli.dask_scheduler --preload dask_gpupool -- --help" in out.stderr, out.stderr

    dask = shutil.which("dask", path=os.path.dirname(sys.executable))
    if dask is not None:  # Dask's own command, as the docs show it
        out = preload_usage([dask, "worker", "tcp://127.0.0.1:1"], "--gpupool-bogus", "1")
        assert "Usage: dask worker --preload dask_gpupool [--gpupool-<key> VALUE]..." in out.stderr, out.stderr


def test_expected_failures_log_one_line_on_each_process_and_no_traceback(tmp_path):
    """A bad option in the scheduler's preload, a registration whose option no worker can meet, and a worker that
    joins with a config it cannot make a pool of: each process logs one line naming the typed error, where
    distributed logged a traceback (``Failed to start preload``, ``Worker plugin gpupool failed to setup``,
    ``Exception while handling op register_scheduler_plugin``). Asking the poolless worker for its stats, pool
    stats and trim logs nothing, and ``print(stats(client))`` lists it as ``no pool``."""
    from distributed import Client

    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    # not under tmp_path: a broker socket's path under this test's long directory name is past AF_UNIX's limit
    brokers = pathlib.Path(tempfile.mkdtemp(prefix="brokers-"))
    env = {**os.environ, "DASK_GPUPOOL__KIND": "host", "DASK_GPUPOOL__BROKER_DIR": str(brokers)}
    scheduler = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(port)]
    scheduler += ["--no-dashboard", "--preload", "dask_gpupool", "--gpupool-max-size", "banana"]
    worker = [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1", "--no-dashboard"]
    worker += ["--host", "127.0.0.1"]
    logs = {name: tmp_path / f"{name}.log" for name in ("scheduler", "good", "bad")}
    files = contextlib.ExitStack()

    def start(command: list[str], name: str, **extra_env: str) -> subprocess.Popen[bytes]:
        log = files.enter_context(open(logs[name], "w"))
        return subprocess.Popen(command, env={**env, **extra_env}, stderr=log)

    procs = [start(scheduler, "scheduler")]
    try:
        procs.append(start(worker, "good"))
        with Client(address, timeout=30) as c:
            c.wait_for_workers(1, timeout=60)
            (good,) = T.workers(c)
            try:
                c.register_plugin(GPUPool(max_size="100 PiB"))
            except dask_gpupool.ConfigError as e:
                assert "exceeds" in str(e)
            else:
                raise AssertionError("a pool larger than the host's memory was made")
            c.register_plugin(GPUPool(max_size="32MiB"))
            wait_for(lambda: len(dask_gpupool.pools(c)) == 1, what="the good worker's pool")
            procs.append(start(worker, "bad", DASK_GPUPOOL__SEGMENT_MEMORY="jemalloc"))
            c.wait_for_workers(2, timeout=60)
            (bad,) = set(T.workers(c)) - {good}
            wait_for(lambda: "error" in dask_gpupool.stats(c)[bad], what="the bad worker's failure")
            assert "error" in dask_gpupool.pool_stats(c)[bad] and "error" in dask_gpupool.trim(c)[bad]
            (line,) = [line for line in str(dask_gpupool.stats(c)).splitlines() if line.startswith(bad)]
            assert "no pool" in line and "segment-memory='jemalloc'" in line, line
            text = {name: path.read_text() for name, path in logs.items()}  # before the processes stop
    finally:
        stop_processes(procs[1:])
        stop_processes(procs[:1])
        files.close()
    for name, log in text.items():
        assert "Traceback" not in log, (name, log)
    said = {
        "scheduler": ("ConfigError: gpupool.max-size='banana'", "exceeds"),
        "good": ("exceeds",),
        "bad": ("segment-memory='jemalloc'",),
    }
    for name, needles in said.items():
        for needle in needles:
            lines = [line for line in text[name].splitlines() if needle in line]
            assert len(lines) == 1 and "Error: " in lines[0], (name, needle, text[name])
    assert not list(brokers.iterdir()), "a broker directory outlived its worker"
    brokers.rmdir()


def test_only_gpupool_errors_from_preloads_and_plugins_lose_their_traceback():
    """The one-line rule is for this package's typed errors where distributed logs a preload or plugin failure:
    any other exception, or the same error in another of distributed's records, keeps its traceback."""
    import logging

    from dask_gpupool.dask.distributed_seam import workers as seam

    seam.one_line_failures()
    seam.one_line_failures()  # idempotent
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("distributed.worker")
    assert sum(isinstance(f, seam.OneLine) for f in logger.filters) == 1
    logger.addHandler(handler)
    try:
        for error in (dask_gpupool.ConfigError("gpupool.kind='gpu' is not a pool kind"), RuntimeError("a bug")):
            for message in ("Worker plugin %s failed to setup", "Compute Failed: %s"):
                try:
                    raise error
                except Exception:
                    logger.exception(message, "gpupool")
        said = dask_gpupool.PoolUnavailableError("said already")
        seam.said(said)
        try:
            raise said
        except Exception:
            logger.exception("Worker plugin %s failed to setup", "gpupool")
    finally:
        logger.removeHandler(handler)
    lines = [(r.getMessage(), r.exc_info is not None) for r in records]
    assert lines == [
        ("Worker plugin gpupool failed to setup: ConfigError: gpupool.kind='gpu' is not a pool kind", False),
        ("Compute Failed: gpupool", True),
        ("Worker plugin gpupool failed to setup", True),
        ("Compute Failed: gpupool", True),
    ]
