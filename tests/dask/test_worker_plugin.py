"""A worker's set-up of its pool from its options: bad options and broker directories fail it naming the key;
relative and odd temporary directories; nothing left behind after teardown."""

from __future__ import annotations

import os
import re

import pytest
from conftest import (
    PLUGIN,
    by_worker,
    handoff_round_trip,
    nanny_cluster,
    rejected_on_scheduler,
    worker_addresses,
)

import dask_gpupool
from dask_gpupool import GPUPool

MiB = 1 << 20


def test_bad_option_fails_setup_naming_it_and_leaves_nothing_behind():
    with nanny_cluster([{}]) as c:
        with pytest.raises(dask_gpupool.ConfigError, match=r"gpupool\.max-size=.*exceeds"):
            c.register_plugin(GPUPool(kind="host", max_size="100 PiB"))
        with pytest.raises(dask_gpupool.PoolUnavailableError):
            dask_gpupool.pools(c)
        assert c.run(lambda dask_worker: "gpupool" in dask_worker.plugins) == {a: False for a in worker_addresses(c)}


def test_a_bad_gpupool_config_on_the_client_does_not_fail_the_registration():
    """The client's own ``gpupool.*`` config is no worker's: an unknown key and bad values there failed
    ``GPUPool(...)``, although each worker reads (and checks) its own config."""
    import dask

    with nanny_cluster([{}, {}]) as c:
        client_config = {"gpupool.kidn": "host", "gpupool.lease-timeout": "-1s", "gpupool.segment-memory": "pool"}
        with dask.config.set(client_config):
            c.register_plugin(GPUPool(kind="host", max_size="64MiB", segment_memory="vmm"))
        rows = by_worker(c)
        assert set(rows) == set(worker_addresses(c)) and {r.kind for r in rows.values()} == {"host"}
        handoff_round_trip(c, MiB, b"client config")


def test_a_relative_broker_dir_is_taken_from_the_workers_directory_and_every_worker_joins(tmp_path):
    """``gpupool.broker-dir`` given as a relative path (as Dask's own ``temporary-directory`` may be) names a
    directory under each worker's working directory: every worker joins the registry with an absolute broker
    path, and peers hand over zero-copy; rather than each registration being refused as malformed while
    ``register_plugin`` waits out the connect timeout and returns with no pools."""
    relative = os.path.relpath(tmp_path)
    with nanny_cluster([{}, {}]) as c:
        c.register_plugin(GPUPool(kind="host", max_size="64MiB", broker_timeout="2s", broker_dir=relative))
        rows = by_worker(c)
        assert len(rows) == 2
        assert all(os.path.dirname(os.path.dirname(r.broker)) == str(tmp_path) for r in rows.values())
        handoff_round_trip(c, MiB, b"relative broker dir")
        assert rejected_on_scheduler(c) == {}
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("problem", ["missing", "a-file"])
def test_a_broker_dir_the_workers_cannot_use_is_a_config_error_naming_the_key(tmp_path, problem):
    """``gpupool.broker-dir`` naming no directory (or a file) fails the registration with a ``ConfigError`` that
    names the key and the path, as every other bad option does, not an ``OSError`` about a random subdirectory;
    nothing is left behind."""
    path = tmp_path / problem
    if problem == "a-file":
        path.write_text("")
    with nanny_cluster([{}]) as c:
        with pytest.raises(dask_gpupool.ConfigError, match=rf"gpupool\.broker-dir='{re.escape(str(path))}'"):
            c.register_plugin(GPUPool(kind="host", max_size="64MiB", broker_dir=str(path)))
        with pytest.raises(dask_gpupool.PoolUnavailableError):
            dask_gpupool.pools(c)
        assert c.run(lambda dask_worker: "gpupool" in dask_worker.plugins) == {a: False for a in worker_addresses(c)}
    assert os.listdir(tmp_path) == ([] if problem == "missing" else ["a-file"])


def test_a_worker_whose_temporary_directory_is_relative_makes_its_broker_under_its_directory_and_joins():
    """A worker whose temporary directory is ``.`` (``TMPDIR=.``) and that sets no ``gpupool.broker-dir`` made its
    broker under a relative path, which the scheduler refuses in its registry row (peers connect by that path), so
    the worker failed its setup. The default broker directory is now made absolute from the worker's working
    directory, as a relative ``gpupool.broker-dir`` is: the worker joins, and a peer maps its pool; nothing is left
    behind."""
    with nanny_cluster([{"env": {"TMPDIR": "."}}, {}]) as c:
        relative, _ = worker_addresses(c)
        cwd = c.run(os.getcwd, workers=[relative])[relative]
        c.register_plugin(GPUPool(kind="host", max_size="64MiB", broker_timeout="2s"))
        rows = by_worker(c)
        assert len(rows) == 2
        assert os.path.dirname(os.path.dirname(rows[relative].broker)) == cwd
        handoff_round_trip(c, MiB, b"relative temporary directory")  # the peer reaches its broker by that path
        assert rejected_on_scheduler(c) == {}
    assert not [d for d in os.listdir(cwd) if d.startswith("dask-gpupool-")]


def test_a_worker_whose_registry_row_would_be_refused_fails_setup_naming_itself_and_why():
    """A worker whose temporary directory is not UTF-8 (a ``TMPDIR`` of other bytes, here Latin-1 ``café``) makes
    its broker under a path the registry cannot carry: Dask's msgpack refuses the surrogates Python decodes such
    bytes to, so sending the row broke the worker's stream to the scheduler and the worker closed, while
    ``register_plugin`` returned with no error. The registry now refuses a broker path that is not UTF-8, and the
    worker checks its row as the scheduler will and fails its setup: ``register_plugin`` raises at once naming the
    worker and the reason, as for any other setup failure, rather than returning with that worker silently gone or
    silently poolless; nothing is left behind. (Before, this test used ``TMPDIR=.``, which now joins: above.)"""
    import shutil
    import tempfile

    short = tempfile.mkdtemp(prefix="gp-", dir="/tmp")  # the socket path must fit in 107 bytes
    latin1 = os.fsencode(short) + b"/caf\xe9"
    os.mkdir(latin1)
    try:
        with nanny_cluster([{"env": {"TMPDIR": os.fsdecode(latin1)}}, {}]) as c:
            bad, _ = worker_addresses(c)
            with pytest.raises(dask_gpupool.PoolUnavailableError, match=rf"{re.escape(bad)}.*not UTF-8"):
                c.register_plugin(GPUPool(kind="host", max_size="64MiB", broker_timeout="2s"))
            with pytest.raises(dask_gpupool.PoolUnavailableError):
                dask_gpupool.pools(c)
            addresses = worker_addresses(c)
            assert len(addresses) == 2  # the worker lives on, without a pool
            assert c.run(lambda dask_worker: "gpupool" in dask_worker.plugins) == {a: False for a in addresses}
        assert os.listdir(latin1) == []
    finally:
        shutil.rmtree(short)


def test_teardown_removes_broker_sockets():
    with nanny_cluster([{}, {}], PLUGIN) as c:
        brokers = [r.broker for r in dask_gpupool.pools(c)]
        assert all(os.path.exists(p) for p in brokers)
    assert not any(os.path.exists(os.path.dirname(p)) for p in brokers)
