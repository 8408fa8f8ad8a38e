"""The scheduler's registry of pools on a live cluster of ``host`` pools: its rows, how they leave, and what the
brokers they name give to whom."""

from __future__ import annotations

import os
import signal
import stat

import pytest
from conftest import (
    PLUGIN,
    by_worker,
    nanny_cluster,
    wait_for,
    worker_addresses,
)

import dask_gpupool
from dask_gpupool import BrokerRefusedError, NotAMemberError, PeerAccessError, PeerLostError
from dask_gpupool import testing as T
from dask_gpupool.transport.link import request_pool_fd

MiB = 1 << 20


def test_registry_lists_every_pool_with_the_right_fields(client):
    a, b = worker_addresses(client)
    rows = by_worker(client)
    assert set(rows) == {a, b}
    pids = client.run(os.getpid)
    devices = client.run(T.visible_devices)
    for addr, row in rows.items():
        assert row.pid == pids[addr]
        assert row.kind == "host" and row.device is None
        assert row.max_size == 64 * MiB
        assert row.host == rows[a].host and row.hostname
        assert row.devices == tuple(devices[addr])
        assert stat.S_ISSOCK(os.stat(row.broker).st_mode)
    assert rows[a].pool != rows[b].pool
    routing = {w: s["routing"] for w, s in dask_gpupool.stats(client).items()}  # what the plugin routes, and why
    assert all(set(r) == {"segment-memory", "staging", "ucx-receive"} for r in routing.values()), routing
    assert all(r["staging"].startswith("on: plain NumPy results of 1.00 MiB") for r in routing.values()), routing
    # every worker's cached view holds the whole registry
    assert client.run(T.known_pools) == {w: sorted(r.pool for r in rows.values()) for w in rows}


def test_entries_vanish_when_a_worker_is_killed():
    with nanny_cluster([{}, {}], PLUGIN) as c:
        a, b = worker_addresses(c)
        victim = by_worker(c)[a]
        desc = c.submit(T.hold, "k", 4096, b"mapped", workers=[a], pure=False).result()
        assert c.submit(T.read_peer, desc, 6, workers=[b], pure=False).result() == b"mapped"
        os.kill(victim.pid, signal.SIGKILL)
        wait_for(lambda: victim.pool not in {r.pool for r in dask_gpupool.pools(c)})
        wait_for(lambda: victim.pool not in c.run(T.known_pools, workers=[b])[b])
        # the Nanny restarts the worker, which registers a fresh pool
        wait_for(lambda: len(dask_gpupool.pools(c)) == 2)
        assert victim.pool not in {r.pool for r in dask_gpupool.pools(c)}
        # A killed broker cannot remove its directory; the next broker start does (min_age 0 here, not the
        # default that keeps directories of brokers still starting), and it leaves the live brokers' alone.
        from dask_gpupool.transport.broker_dirs import remove_stale_broker_dirs

        victim_dir = os.path.dirname(victim.broker)
        remove_stale_broker_dirs(os.path.dirname(victim_dir), min_age=0)
        assert not os.path.exists(victim_dir)
        assert all(os.path.exists(r.broker) for r in dask_gpupool.pools(c))


def test_workers_on_different_hosts_do_not_map():
    hosts = [{"config": {"gpupool": {"host-id": "host-a"}}}, {"config": {"gpupool": {"host-id": "host-b"}}}]
    with nanny_cluster(hosts, PLUGIN) as c:
        a, b = worker_addresses(c)
        rows = by_worker(c)
        assert (rows[a].host, rows[b].host) == ("host-a", "host-b")
        desc = c.submit(T.hold, "z", 4096, b"x", workers=[a], pure=False).result()
        with pytest.raises(PeerAccessError, match="is on host 'host-a', this worker on 'host-b'"):
            c.submit(T.read_peer, desc, 1, workers=[b], pure=False).result()
        assert c.run(T.resources)[b]["mapped_pools"] == 0


def test_live_broker_refuses_malformed_input_and_keeps_serving(client):
    a, b = worker_addresses(client)
    row = by_worker(client)[a]
    import socket

    import msgpack

    from dask_gpupool.wire.broker import Hello
    from dask_gpupool.wire.codec import encode

    token = client.run(lambda dask_worker: dask_worker.plugins["gpupool"].service.importer.links.token, workers=[a])[a]
    for member in (False, True):  # before the hello, and past it (a member that then sends garbage)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(5)
        s.connect(row.broker)
        if member:
            s.sendall(encode(Hello(token)))
            assert msgpack.unpackb(s.recv(1000))["op"] == "welcome"
        s.sendall(b"\x93\x01\x02")
        assert s.recv(10) == b""
        s.close()
    desc = client.submit(T.hold, "y", 4096, b"still here", workers=[a], pure=False).result()
    assert client.submit(T.read_peer, desc, 10, workers=[b], pure=False).result() == b"still here"
    client.submit(T.release, "y", workers=[a], pure=False).result()
    client.submit(T.unmap, row.pool, workers=[b], pure=False).result()


def test_same_uid_without_the_cluster_token_gets_nothing(client):
    a, b = worker_addresses(client)
    row = by_worker(client)[a]
    for token in (bytes(32), os.urandom(32)):
        with pytest.raises(NotAMemberError):
            request_pool_fd(row.broker, row.pool, 2, token)
    # the worker keeps serving its members
    desc = client.submit(T.hold, "z", 4096, b"members only", workers=[a], pure=False).result()
    assert client.submit(T.read_peer, desc, 12, workers=[b], pure=False).result() == b"members only"
    client.submit(T.release, "z", workers=[a], pure=False).result()
    client.submit(T.unmap, row.pool, workers=[b], pure=False).result()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")
def test_another_uid_gets_nothing_from_a_worker_broker(client):
    a, _ = worker_addresses(client)
    row = by_worker(client)[a]
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            try:
                request_pool_fd(row.broker, row.pool, 2, bytes(32))
            except BrokerRefusedError:  # the link's own check: the broker's directory is not nobody's
                code = 0
            except PeerLostError:  # the directory's mode: no connection
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
