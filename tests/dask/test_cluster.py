"""Multi-process behaviour with real Nanny workers and ``host`` pools (runs in CI)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import subprocess
import time

import pytest
from conftest import free_port, handoff_round_trip, nanny_cluster, stop_processes, worker_addresses

import dask_gpupool
from dask_gpupool import BrokerRefusedError, GPUPool, NotAMemberError, PeerAccessError, PeerLostError
from dask_gpupool import testing as T
from dask_gpupool.transport.link import request_pool_fd

MiB = 1 << 20
PLUGIN = GPUPool(kind="host", max_size="64MiB", broker_timeout="2s")


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def by_worker(client):
    return {r.worker: r for r in dask_gpupool.pools(client)}


@pytest.fixture(scope="module")
def client():
    with nanny_cluster([{}, {}], PLUGIN) as c:
        yield c


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
    assert all(r["staging"] == "off: a host pool stages no CuPy results" for r in routing.values()), routing
    # every worker's cached view holds the whole registry
    assert client.run(T.known_pools) == {w: sorted(r.pool for r in rows.values()) for w in rows}


def test_peer_maps_the_pool_once_and_reads_the_owners_bytes(client):
    handoff_round_trip(client, MiB, b"bytes from A")


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


def test_teardown_removes_broker_sockets():
    with nanny_cluster([{}, {}], PLUGIN) as c:
        brokers = [r.broker for r in dask_gpupool.pools(c)]
        assert all(os.path.exists(p) for p in brokers)
    assert not any(os.path.exists(os.path.dirname(p)) for p in brokers)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m dask_gpupool ARGS`` in a subprocess, its output captured."""
    import sys

    return subprocess.run([sys.executable, "-m", "dask_gpupool", *args], capture_output=True, text=True, timeout=120)


def test_info_and_trim_commands_print_the_registry_and_stats():
    from conftest import warm_up

    with nanny_cluster([{}, {}], PLUGIN) as c:
        a, b = worker_addresses(c)
        warm_up(c, a, b)
        out = cli("info", c.scheduler.address)
        assert out.returncode == 0, out.stderr
        assert "2 pool(s)" in out.stdout and a in out.stdout and b in out.stdout
        assert "zero-copy in" in out.stdout and "host" in out.stdout and "segments" in out.stdout
        # trim: host pools have no segments, so it retires nothing and says so per worker
        out = cli("trim", c.scheduler.address)
        assert out.returncode == 0, out.stderr
        assert a in out.stdout and b in out.stdout and "retiring" in out.stdout
        for w, t in dask_gpupool.trim(c).items():
            assert (t["retire_below"], t["segments"], t["segments_retiring"]) == (0, 0, 0), (w, t)


def test_dask_gpupool_commands_take_a_scheduler_file_tls_and_report_a_bad_address_in_one_line(tmp_path):
    """`dask gpupool info|trim` (Dask's own command, through the dask_cli entry point): an address or
    --scheduler-file, Dask's TLS options; an unreachable scheduler is one line and status 2; a closed pipe
    is no traceback (issue 20)."""
    import json
    import sys

    from distributed.security import Security

    pytest.importorskip("cryptography", reason="Security.temporary needs cryptography")
    dask_cmd = [sys.executable, "-m", "dask", "gpupool"]
    out = subprocess.run([*dask_cmd, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "info" in out.stdout and "trim" in out.stdout
    security = Security.temporary()
    files = {}
    for name, pem in (
        ("ca", security.tls_ca_file),
        ("cert", security.tls_client_cert),
        ("key", security.tls_client_key),
    ):
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_text(pem)
    tls = ["--tls-ca-file", str(files["ca"]), "--tls-cert", str(files["cert"]), "--tls-key", str(files["key"])]
    with nanny_cluster([{}, {}], PLUGIN, security=security) as c:
        address = c.scheduler.address
        assert address.startswith("tls://")
        scheduler_file = tmp_path / "scheduler.json"
        scheduler_file.write_text(json.dumps({"address": address, "type": "Scheduler"}))
        out = subprocess.run(
            [*dask_cmd, "info", "--scheduler-file", str(scheduler_file), *tls],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert "2 pool(s)" in out.stdout
        out = subprocess.run([*dask_cmd, "trim", address, *tls], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "retiring" in out.stdout, out.stderr
        closed = subprocess.run(  # `true` reads nothing and is gone before the first line is written
            f"{sys.executable} -m dask_gpupool info {address} {' '.join(tls)} | true",
            shell=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "Traceback" not in closed.stderr and "BrokenPipe" not in closed.stderr, closed.stderr
    port = free_port()
    out = cli("info", f"tcp://127.0.0.1:{port}", "--timeout", "1")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().startswith(f"cannot reach tcp://127.0.0.1:{port}") and "Traceback" not in out.stderr
    out = cli("info")
    assert out.returncode == 2 and "give the scheduler's ADDRESS or --scheduler-file" in out.stderr


def test_info_command_on_a_cluster_without_the_plugin_says_so():
    with nanny_cluster([{}]) as c:
        out = cli("info", c.scheduler.address)
        assert out.returncode == 2 and "no gpupool registry" in out.stderr


def one_line_exit_2(*args: str, within: float = 30.0) -> str:
    """``python -m dask_gpupool ARGS`` must fail at once with status 2 and one line on stderr; that line."""
    import sys

    t0 = time.monotonic()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "dask_gpupool", *args], capture_output=True, text=True, timeout=within
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{args}: still running after {within} s")
    took = time.monotonic() - t0
    assert out.returncode == 2 and out.stdout == "", (args, out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, (args, out.stderr)
    assert took < within, (args, took)
    return out.stderr.strip()


@pytest.mark.parametrize("timeout", ["-1", "0", "nan", "-inf"])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_a_usage_error(timeout):
    """``--timeout -1`` reached Dask as ``-1`` and came back as "could not convert string to float: '1-1.0'",
    ``nan`` as a traceback (``KeyError: 'Invalid time unit: nan'``), and 0 timed out at once: each is click's usage
    error now, status 2, before any connection."""
    for command in ("info", "trim"):
        out = cli(command, f"tcp://127.0.0.1:{free_port()}", "--timeout", timeout)
        assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
        assert "Traceback" not in out.stderr and "Invalid value for '--timeout'" in out.stderr, out.stderr
        assert "cannot reach" not in out.stderr


def test_the_console_script_names_itself_in_its_usage():
    """``dask-gpupool --help`` said ``Usage: python -m dask_gpupool``; ``python -m dask_gpupool`` still says that."""
    import shutil
    import sys

    script = shutil.which("dask-gpupool", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("the dask-gpupool script is not installed beside this Python (pip install -e .)")
    out = subprocess.run([script, "info", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("Usage: dask-gpupool info "), out.stdout + out.stderr
    out = cli("info", "--help")
    assert out.returncode == 0 and out.stdout.startswith("Usage: python -m dask_gpupool info "), out.stdout


def test_dash_h_is_help_as_in_dask_own_commands():
    """``python -m dask_gpupool -h`` (and of each command) prints the help, as ``dask scheduler -h`` does."""
    for args in (("-h",), ("info", "-h"), ("demo", "-h")):
        out = cli(*args)
        assert out.returncode == 0 and out.stdout == cli(*args[:-1], "--help").stdout, (args, out.stderr)
        assert out.stdout.startswith("Usage: python -m dask_gpupool"), out.stdout


def test_a_scheduler_file_that_is_missing_or_not_one_is_one_line_and_status_2(tmp_path):
    """``--scheduler-file``: a file that does not appear within ``--timeout`` (Dask's Client waits for it for
    ever), or one that holds no scheduler address (the Client raised ``AssertionError`` after ten reads), is one
    line and status 2, like an unreachable scheduler."""
    missing = tmp_path / "nowhere.json"
    line = one_line_exit_2("info", "--scheduler-file", str(missing), "--timeout", "1")
    assert str(missing) in line and "no such file" in line
    for name, text in (("garbage.json", "garbage"), ("empty.json", "{}"), ("number.json", '{"address": 7}')):
        bad = tmp_path / name
        bad.write_text(text)
        line = one_line_exit_2("trim", "--scheduler-file", str(bad), "--timeout", "1")
        assert str(bad) in line and "no scheduler address" in line


def test_tls_options_that_cannot_work_are_one_line_and_status_2(tmp_path):
    """TLS options with a ``tcp://`` address (Dask's ``RuntimeError``: encryption required), a CA file that does
    not exist, or a key without a certificate (Dask's ``TypeError``: no ``ssl_context``) are one line and status
    2, not a traceback followed by the half-started client's own one at exit."""
    from distributed.security import Security

    pytest.importorskip("cryptography", reason="Security.temporary needs cryptography")
    security = Security.temporary()
    ca, cert, key = tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    ca.write_text(security.tls_ca_file)
    cert.write_text(security.tls_client_cert)
    key.write_text(security.tls_client_key)
    tls = ["--tls-ca-file", str(ca), "--tls-cert", str(cert), "--tls-key", str(key)]
    port = free_port()
    line = one_line_exit_2("info", f"tcp://127.0.0.1:{port}", *tls)
    assert "tls://" in line
    pem = tmp_path / "not-a-cert.pem"
    pem.write_text("not a certificate")
    missing = tmp_path / "missing-ca.pem"
    line = one_line_exit_2("info", f"tls://127.0.0.1:{port}", "--tls-ca-file", str(missing), "--tls-cert", str(pem))
    assert "TLS" in line
    line = one_line_exit_2("trim", f"tls://127.0.0.1:{port}", "--tls-key", str(pem))
    assert "--tls-ca-file" in line and "--tls-cert" in line


def test_an_address_that_is_not_one_is_one_line_and_status_2():
    """An unknown scheme, a missing port or an unparsable address was one line, then the half-started client's
    ``TimeoutError`` traceback at exit, twice ``--timeout`` later."""
    for address in ("foo://127.0.0.1:8786", "127.0.0.1", "notanaddress:::"):
        line = one_line_exit_2("info", address, "--timeout", "5", within=9)
        assert line.startswith(f"cannot reach {address}: ") and "address" in line


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


def test_prometheus_metrics_on_dasks_own_endpoints():
    pytest.importorskip("prometheus_client")
    import urllib.request

    from conftest import warm_up

    def scrape(host: str, port: int) -> str:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
            return r.read().decode()

    with nanny_cluster([{"dashboard_address": ":0"}] * 2, PLUGIN) as c:
        a, b = worker_addresses(c)
        warm_up(c, a, b)
        # a small buffer held on B: its page stays resident (freed buffers from 64 KiB give theirs back at once)
        held = c.submit(T.make_buffer, 4096, b"held", workers=[b], pure=False)
        held.result()
        info = c.scheduler_info()
        host = info["address"].split("://")[1].rsplit(":", 1)[0]
        text = scrape(host, T.workers(c)[b]["services"]["dashboard"])
        samples = [line for line in text.splitlines() if line.startswith("dask_worker_gpupool_")]

        def sample(name: str, label: str) -> list[str]:
            return [line for line in samples if line.startswith(name + "{") and label in line]

        assert sample("dask_worker_gpupool_received_bytes_total", 'path="zero-copy"')
        assert sample("dask_worker_gpupool_pool_bytes", 'state="used"') and 'reason="other-gpu"' in text
        # pool_bytes summed over ``state`` is what the pool reserves (used, and free: reserved, in no live buffer);
        # the limit is a metric of its own, not a ``state`` to be summed with them
        states = {
            re.search(r'state="(\w+)"', line).group(1): float(line.rsplit(" ", 1)[1])
            for line in sample("dask_worker_gpupool_pool_bytes", "w1")
        }
        assert set(states) == {"used", "free"}, states
        assert sum(states.values()) == dask_gpupool.pool_stats(c)[b]["reserved"] > 0
        limit = [float(line.rsplit(" ", 1)[1]) for line in sample("dask_worker_gpupool_pool_limit_bytes", "w1")]
        assert limit == [64 * MiB]
        assert sample("dask_worker_gpupool_segments", 'state="retiring"')
        assert [line.rsplit(" ", 1)[1] for line in sample("dask_worker_gpupool_leases_in_doubt", "w1")] == ["0.0"]
        # what stats() counts beside the handoffs: arrays staged into the pool, device memory kept out of reuse
        # after a UCX transfer that did not complete (both 0 here: host pools stage nothing, and TCP has no quarantine)
        assert [line.rsplit(" ", 1)[1] for line in sample("dask_worker_gpupool_staged_bytes_total", "w1")] == ["0.0"]
        assert [line.rsplit(" ", 1)[1] for line in sample("dask_worker_gpupool_ucx_quarantined_bytes", "w1")] == ["0.0"]
        # labelled by the worker's name, which a restarted worker keeps, not by its pool's UUID
        assert samples and all('worker="w1"' in line and "pool=" not in line for line in samples)
        imported = sample("dask_worker_gpupool_handoffs_total", 'direction="import"')
        assert imported and float(imported[0].rsplit(" ", 1)[1]) >= 1
        assert sample("dask_worker_gpupool_handoffs_total", 'direction="forward"')
        assert sample("dask_worker_gpupool_handoffs_total", 'direction="return"')
        text = scrape(host, info["services"]["dashboard"])
        assert 'dask_scheduler_gpupool_pools{kind="host"} 2.0' in text


def dashboard_base(client, worker=None):
    """``http://host:port`` of ``worker``'s HTTP server (its dashboard's port), or of the scheduler's."""
    info = client.scheduler_info()
    host = info["address"].split("://")[1].rsplit(":", 1)[0]
    port = T.workers(client)[worker]["services"]["dashboard"] if worker else info["services"]["dashboard"]
    return f"http://{host}:{port}"


def scrape_metrics(client, worker=None):
    """The text of ``/metrics`` on ``worker`` (its dashboard's port), or on the scheduler."""
    import urllib.request

    with urllib.request.urlopen(dashboard_base(client, worker) + "/metrics", timeout=10) as r:
        return r.read().decode()


def metric_help(text: str, name: str) -> str:
    return re.search(rf"^# HELP {name} (.*)$", text, re.M).group(1)


def metric_value(text: str, name: str, labels: str) -> float:
    return float(re.search(rf"^{name}{{{labels}}} (\S+)$", text, re.M).group(1))


def test_prometheus_help_says_what_the_copy_counters_count():
    """``received_bytes`` said "from same-host peers" but its ``copy`` path counts copies from any sender, other
    hosts included; ``sent_copy_bytes`` said "to peers" but counts copies to workers of other hosts and to clients
    too. Both are seen counting those here, and their help says so."""
    pytest.importorskip("prometheus_client")
    hosts = [{"dashboard_address": ":0", "config": {"gpupool": {"host-id": host}}} for host in ("host-a", "host-b")]
    with nanny_cluster(hosts, PLUGIN) as c:
        a, b = worker_addresses(c)
        x = c.submit(T.make_buffer, MiB, b"x", workers=[a], pure=False)
        assert c.submit(T.head, x, 1, workers=[b], pure=False).result() == b"x"  # a copy: w1 is on another host
        received = scrape_metrics(c, b)
        assert metric_value(received, "dask_worker_gpupool_received_bytes_total", 'path="copy",worker="w1"') == MiB
        help_text = metric_help(received, "dask_worker_gpupool_received_bytes_total")
        assert "from same-host peers" not in help_text, help_text
        assert "any sender" in help_text and "other hosts" in help_text, help_text
        y = c.submit(T.make_buffer, MiB, b"y", workers=[a], pure=False)  # on w0 alone (w1 holds a replica of x)
        c.gather(y)  # the client's copy
        sent = scrape_metrics(c, a)
        assert metric_value(sent, "dask_worker_gpupool_sent_copy_bytes_total", 'worker="w0"') == 2 * MiB
        help_text = metric_help(sent, "dask_worker_gpupool_sent_copy_bytes_total")
        assert all(who in help_text for who in ("other hosts", "clients", "spill")), help_text


IN_ONE_PROCESS = """
import json, sys, urllib.request
import dask
from distributed import Client, LocalCluster
import dask_gpupool

def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return [line for line in r.read().decode().splitlines() if line.startswith("dask_") and "_gpupool_" in line]

if __name__ == "__main__":
    options = dict(n_workers=2, threads_per_worker=1, processes=False, protocol="tcp", host="127.0.0.1")
    with LocalCluster(dashboard_address=":0", worker_dashboard_address=":0", **options) as cluster:
        with Client(cluster) as c:
            c.register_plugin(dask_gpupool.GPUPool(kind="host", max_size="64MiB"))
            info = c.scheduler_info()
            out = {"scheduler": scrape(info["services"]["dashboard"])}
            out.update({str(w["name"]): scrape(w["services"]["dashboard"]) for w in info["workers"].values()})
            print(json.dumps(out))
"""


def test_several_workers_in_one_process_serve_each_series_once(tmp_path):
    """Workers of one process (``LocalCluster(processes=False)``) share one Prometheus registry: every worker's
    ``/metrics`` (and the scheduler's) served every worker's series, and the process-wide ``ucx_quarantined_bytes``
    once per worker, so sums over the endpoints counted them several times. Each endpoint now serves its own
    worker's series, the scheduler's its own, and a process-wide figure comes once per process."""
    import json
    import subprocess
    import sys

    pytest.importorskip("prometheus_client")
    script = tmp_path / "in_one_process.py"
    script.write_text(IN_ONE_PROCESS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_GPUPOOL")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    by_endpoint = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(by_endpoint) == {"scheduler", "0", "1"}
    assert by_endpoint["scheduler"] and all(s.startswith("dask_scheduler_") for s in by_endpoint["scheduler"])
    for worker in ("0", "1"):
        assert by_endpoint[worker] and all(f'worker="{worker}"' in s for s in by_endpoint[worker]), worker
    served = [s.rsplit(" ", 1)[0] for samples in by_endpoint.values() for s in samples]
    assert len(served) == len(set(served))  # each series on one endpoint only
    quarantined = [s for s in served if s.startswith("dask_worker_gpupool_ucx_quarantined_bytes{")]
    assert len(quarantined) == 1, quarantined  # once per process, under one of its workers


def test_dashboard_page_lists_pools_and_handoffs():
    import importlib.util
    import json
    import urllib.request

    from conftest import wait_for, warm_up

    with nanny_cluster([{}, {}], PLUGIN) as c:
        a, b = worker_addresses(c)
        warm_up(c, a, b)
        base = dashboard_base(c)

        def page(path: str) -> str:
            with urllib.request.urlopen(base + path, timeout=10) as r:
                return r.read().decode()

        def imports_seen() -> bool:
            snap = json.loads(page("/gpupool.json"))
            return len(snap["pools"]) == 2 and all(snap["workers"].get(w, {}).get("imports") == 1 for w in (a, b))

        wait_for(imports_seen, what="both workers' pushed stats on the page")
        html = page("/gpupool")
        assert "2 pool(s)" in html and a in html and b in html and "zero-copy in" in html
        assert "http-equiv='refresh'" in html
        # each worker imported once: its mean import time is a number; no claim round trip was timed
        # (claimed by the reply)
        assert "mean import, ms (claim)" in html
        assert re.search(r"<td>\d+\.\d\d \(-\)</td>", html), html
        # linked from Dask's own dashboard: the "More..." menu of every page (Bokeh, a test dependency, serves it)
        if importlib.util.find_spec("bokeh") is not None:
            assert '<a href="gpupool">GPU Pool</a>' in page("/status")


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


def test_dashboard_page_in_a_headless_browser(tmp_path):
    """The /gpupool page as Debian's chromium renders it (skips where chromium is not installed).

    With GPUPOOL_SCREENSHOT=path the screenshot is also written there (docs/_static/gpupool-page.png).
    """
    import shutil
    import subprocess

    from conftest import wait_for, warm_up
    from distributed import wait

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium (Debian package 'chromium')")

    def render(url: str, *extra: str) -> str:
        out = subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                f"--user-data-dir={tmp_path / 'profile'}",
                "--window-size=1280,720",
                *extra,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    with nanny_cluster([{}, {}, {}], PLUGIN) as c:
        a, b, third = worker_addresses(c)
        warm_up(c, a, b)
        x = c.submit(T.make_buffer, 3 * MiB, b"x", workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[third], pure=False)  # a live lease on A, held by the third worker
        wait(y)  # not y.result(): the client's copy would show as copied out
        url = dashboard_base(c) + "/gpupool"
        # the workers push their stats every 2 s: wait until the browser shows A's 3 MiB lease
        wait_for(lambda: "3.00 MiB" in render(url, "--dump-dom"), what="the page to show the pushed stats")
        dom = render(url, "--dump-dom")
        assert "3 pool(s)" in dom and "live leases" in dom and all(w in dom for w in (a, b, third))
        shot = tmp_path / "gpupool.png"
        render(url, f"--screenshot={shot}")
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
        if os.environ.get("GPUPOOL_SCREENSHOT"):
            shutil.copy(shot, os.environ["GPUPOOL_SCREENSHOT"])
        del x, y


def test_dashboard_page_escapes_every_pushed_value():
    """A worker's stats push is the worker's claim: every value and key on /gpupool is escaped, and the page
    still renders when the values have the wrong types; /gpupool.json carries them back unchanged but with no raw
    ``<`` (issue 15)."""
    import json
    import urllib.error
    import urllib.request

    from conftest import wait_for

    from dask_gpupool.ops.dashboard import STATS_OP

    evil = "<script>alert(1)</script>"
    pushes = [
        {
            "exports": evil,
            "imports": f"{evil}imports",
            "leases": f"{evil}leases",
            "lease_bytes": evil,
            "zero_copy_bytes": evil,
            "segments": f"{evil}segments",
            "segments_retiring": f"{evil}retiring",
            "fallbacks": {f"{evil}key": f"{evil}value"},
            "used": evil,
            "reserved": evil,
        },
        {"exports": [evil], "imports": {evil: evil}, "fallbacks": f"{evil}fallbacks", "used": [evil]},
    ]

    def push(stats, dask_worker):
        dask_worker.plugins["gpupool"]._push.stop()  # no honest push overwrites this one
        dask_worker.batched_stream.send({"op": STATS_OP, "stats": stats})

    with nanny_cluster([{}, {}], PLUGIN) as c:
        by_worker = dict(zip(worker_addresses(c), pushes, strict=True))
        before = c.run(T.resources)
        for w, stats in by_worker.items():
            c.run(push, stats, workers=[w])
        base = dashboard_base(c)

        def fetch(path: str) -> tuple[str, str]:
            with urllib.request.urlopen(base + path, timeout=10) as r:
                return r.read().decode(), r.headers.get("Content-Type", "")

        def pushed() -> bool:
            snap = json.loads(fetch("/gpupool.json")[0])
            return all(snap["workers"].get(w) == stats for w, stats in by_worker.items())

        wait_for(pushed, what="the hostile pushes to reach the scheduler")
        try:
            page, kind = fetch("/gpupool")
        except urllib.error.HTTPError as e:
            raise AssertionError(f"/gpupool failed on hostile stats: {e}") from e
        assert kind.startswith("text/html")
        assert "<script" not in page.lower()  # the page has no script of its own, and none came in
        for text in ("imports", "leases", "segments", "retiring", "key", "value", "fallbacks"):
            assert f"&lt;script&gt;alert(1)&lt;/script&gt;{text}" in page, text
        raw, kind = fetch("/gpupool.json")
        assert kind.startswith("application/json") and "<" not in raw
        assert all(json.loads(raw)["workers"][w] == stats for w, stats in by_worker.items())
        assert c.run(T.resources) == before  # the workers hold nothing more for it


def test_gpupool_json_is_strict_json_whatever_a_worker_pushes():
    """A worker's push with NaN or infinite numbers made ``/gpupool.json`` carry ``NaN`` and ``Infinity``, which
    strict JSON parsers (JavaScript's ``JSON.parse``, Go's, jq's) refuse: the scheduler keeps them as null, and the
    page still renders."""
    import json
    import math
    import urllib.request

    from conftest import wait_for

    from dask_gpupool.ops.dashboard import STATS_OP

    nan, inf = math.nan, math.inf
    stats = {
        "leases": 7,
        "exports": nan,
        "lease_bytes": -inf,
        "fallbacks": {"small": inf},
        "timings": {"import": {"count": 1, "total_s": nan}},
        "samples": [1.5, nan, [inf]],
    }
    finite = {
        "leases": 7,
        "exports": None,
        "lease_bytes": None,
        "fallbacks": {"small": None},
        "timings": {"import": {"count": 1, "total_s": None}},
        "samples": [1.5, None, [None]],
    }

    def push(dask_worker):
        dask_worker.plugins["gpupool"]._push.stop()  # no honest push overwrites this one
        dask_worker.batched_stream.send({"op": STATS_OP, "stats": stats})

    def strict(text: str):
        def refuse(constant: str):
            raise ValueError(f"not JSON: {constant}")

        return json.loads(text, parse_constant=refuse)

    with nanny_cluster([{}, {}], PLUGIN) as c:
        a, _ = worker_addresses(c)
        c.run(push, workers=[a])
        base = dashboard_base(c)

        def fetch(path: str) -> str:
            with urllib.request.urlopen(base + path, timeout=10) as r:
                return r.read().decode()

        wait_for(lambda: json.loads(fetch("/gpupool.json"))["workers"].get(a, {}).get("leases") == 7, what="the push")
        assert strict(fetch("/gpupool.json"))["workers"][a] == finite
        assert "<td>7</td>" in fetch("/gpupool")


def test_gpupool_json_answers_when_a_worker_pushes_a_nan_or_infinite_key():
    """A worker's push whose dicts have NaN or infinite numbers as keys (msgpack carries them): ``finite`` made the
    values null but left the keys, and ``json.dumps(..., allow_nan=False)`` raised on them, so ``/gpupool.json``
    answered 500 for the whole cluster for as long as that push was the worker's last. Such keys are kept as text;
    the output is strict JSON, and the page renders."""
    import json
    import math
    import urllib.request

    from conftest import wait_for

    from dask_gpupool.ops.dashboard import STATS_OP

    stats = {"leases": 9, "fallbacks": {math.nan: 1, math.inf: 2, -math.inf: 3, 1.5: 4}}

    def push(dask_worker):
        dask_worker.plugins["gpupool"]._push.stop()  # no honest push overwrites this one
        dask_worker.batched_stream.send({"op": STATS_OP, "stats": stats})

    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    with nanny_cluster([{}, {}], PLUGIN) as c:
        a, _ = worker_addresses(c)
        c.run(push, workers=[a])
        base = dashboard_base(c)

        def fetch(path: str) -> str:
            try:
                with urllib.request.urlopen(base + path, timeout=10) as r:
                    return r.read().decode()
            except urllib.error.HTTPError as e:
                return f"HTTP {e.code}"

        wait_for(lambda: "<td>9</td>" in fetch("/gpupool"), what="the push")
        text = fetch("/gpupool.json")
        assert not text.startswith("HTTP"), text
        fallbacks = json.loads(text, parse_constant=refuse)["workers"][a]["fallbacks"]
        assert sorted(fallbacks.values()) == [1, 2, 3, 4], fallbacks


def test_a_worker_whose_pool_set_up_failed_is_reported_and_the_others_still_answer(tmp_path):
    """A worker joins with a bad gpupool config (no preload of its own): stats, pool_stats, trim, info, the trim
    command and the page name its failure; the other workers' pools work and are listed (issue 20)."""
    import json
    import sys
    import urllib.request

    from conftest import wait_for
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


def test_preload_arguments_set_every_option_and_a_bad_value_is_logged_and_reported(tmp_path):
    """`dask worker --preload dask_gpupool --gpupool-<key> VALUE ...` sets options; a worker whose config is bad
    logs a ConfigError naming the key at start-up and is reported without a pool (issue 20)."""
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


def rejected_on_scheduler(client, name="gpupool"):
    """The scheduler plugin's count of refused registry messages, by reason (test inspection only)."""

    def get(dask_scheduler):
        return dict(getattr(dask_scheduler.plugins[name], "rejected", {}))

    return client.run_on_scheduler(get)


def test_registering_the_plugin_again_replaces_every_pool_and_refuses_nothing():
    """``client.register_plugin(GPUPool(...))`` again, with new options, on a running cluster: every worker gets a
    new pool with the new options, the old pools leave the registry and their broker directories go, and the old
    pools' own unregistrations are not refused as a worker acting as another (no false alarm in ``rejected``)."""
    with nanny_cluster([{}, {}], PLUGIN) as c:
        old = by_worker(c)
        c.register_plugin(GPUPool(kind="host", max_size="32MiB", broker_timeout="2s"))
        new = by_worker(c)
        assert set(new) == set(old) and {r.max_size for r in new.values()} == {32 * MiB}
        assert not {r.pool for r in new.values()} & {r.pool for r in old.values()}
        handoff_round_trip(c, MiB, b"registered again")
        wait_for(lambda: not any(os.path.exists(os.path.dirname(r.broker)) for r in old.values()))
        assert rejected_on_scheduler(c) == {}


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


def pool_count(client):
    """How many pools the registry lists; 0 while the scheduler has no registry."""
    try:
        return len(dask_gpupool.pools(client))
    except dask_gpupool.PoolUnavailableError:
        return 0


def test_a_failed_registration_over_a_running_plugin_leaves_none_so_a_preloading_worker_installs_it(tmp_path):
    """``client.register_plugin(GPUPool(...))`` again with options that fail on the workers raises, and tears down
    the pools of the plugin it replaced: the cluster is then left without the plugin, not with the old one
    listed on the scheduler and serving nothing, so that a worker started with ``--preload dask_gpupool``
    installs it again (its registration is idempotent)."""
    import sys

    with nanny_cluster([{}, {}], PLUGIN) as c:
        old = by_worker(c)
        with pytest.raises(dask_gpupool.ConfigError, match=r"gpupool\.broker-dir=.*missing"):
            c.register_plugin(GPUPool(kind="host", max_size="64MiB", broker_dir=str(tmp_path / "missing")))
        with pytest.raises(dask_gpupool.PoolUnavailableError):
            dask_gpupool.pools(c)
        assert not any(os.path.exists(os.path.dirname(r.broker)) for r in old.values())
        env = {**os.environ, "DASK_GPUPOOL__KIND": "host", "DASK_GPUPOOL__MAX_SIZE": "32MiB"}
        worker = [sys.executable, "-m", "distributed.cli.dask_worker", c.scheduler.address, "--nthreads", "1"]
        with open(tmp_path / "late-worker.log", "w") as log:
            procs = [subprocess.Popen([*worker, "--no-dashboard", "--preload", "dask_gpupool"], env=env, stderr=log)]
        try:
            c.wait_for_workers(3, timeout=60)
            wait_for(lambda: pool_count(c) == 3, timeout=60)
            assert not {r.pool for r in dask_gpupool.pools(c)} & {r.pool for r in old.values()}
        finally:
            stop_processes(procs)
        wait_for(lambda: len(dask_gpupool.pools(c)) == 2, timeout=60)
        handoff_round_trip(c, MiB, b"installed again")


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


def listed_gpupools(client):
    """The names under which the scheduler lists a ``GPUPool``, with each one's ``max_size`` option."""

    def on_scheduler(dask_scheduler):
        return {n: p.overrides.get("max_size") for n, p in dask_scheduler.plugins.items() if isinstance(p, GPUPool)}

    return client.run_on_scheduler(on_scheduler)


def registration_state(client, name="gpupool"):
    """Where the cluster's gpupool registration stands (test inspection only), by the ``max_size`` option of each
    plugin: on the scheduler, the plugin listed under ``name``, every name a ``GPUPool`` is listed under, whether its
    registry is the one the handlers serve, the worker plugin new workers get, and the listed registry's rows
    (worker -> pool); on each worker, its plugin, its pool, and whether the worker's registry stream handlers are
    that plugin's (its ``RegistryMember``'s)."""

    def on_scheduler(dask_scheduler):
        from distributed.protocol.pickle import loads

        from dask_gpupool.core import JOINED_OP, REGISTER_OP, UNREGISTER_OP

        listed = dask_scheduler.plugins.get(name)
        handlers = [dask_scheduler.handlers["gpupool_pools"]]
        handlers += [dask_scheduler.stream_handlers[op] for op in (REGISTER_OP, JOINED_OP, UNREGISTER_OP)]
        return {
            "listed": listed.overrides.get("max_size"),
            "names": sorted(n for n, p in dask_scheduler.plugins.items() if isinstance(p, GPUPool)),
            "serves": all(getattr(h, "__self__", None) is listed._registry_handlers for h in handlers),
            "worker-plugin": loads(dask_scheduler.worker_plugins["gpupool"]).overrides.get("max_size"),
            "rows": {r.worker: r.pool for r in listed.registry.records()},
        }

    def on_worker(dask_worker):
        from dask_gpupool.core import MEMBERSHIP_OP, REGISTRY_OP

        plugin = dask_worker.plugins.get("gpupool")
        service = getattr(plugin, "service", None)
        return {
            "plugin": getattr(plugin, "overrides", {}).get("max_size"),
            "pool": None if service is None else service.pool.uuid,
            "handlers": all(
                getattr(dask_worker.stream_handlers.get(op), "__self__", None) is getattr(plugin, "_member", None)
                for op in (MEMBERSHIP_OP, REGISTRY_OP)
            ),
        }

    return client.run_on_scheduler(on_scheduler), client.run(on_worker)


def broker_dirs(path):
    return sorted(d for d in os.listdir(path) if d.startswith("dask-gpupool-"))


def assert_one_plugin(client, size, broker_dir, name="gpupool"):
    """The whole cluster runs the GPUPool of ``max_size=size``: the scheduler lists it under ``name`` and no other
    GPUPool, its handlers serve the registry, new workers get its worker plugin; every worker runs its pool and no
    other (``broker_dir`` holds the live pools' broker directories only); the registry holds exactly the live
    workers' rows, of those pools."""
    on_scheduler, on_workers = registration_state(client, name)
    state = {"scheduler": on_scheduler, "workers": on_workers, "rows": dask_gpupool.pools(client)}
    assert on_scheduler["names"] == [name], state
    assert on_scheduler["listed"] == on_scheduler["worker-plugin"] == size, state
    assert on_scheduler["serves"], state
    assert {w: (s["plugin"], s["handlers"]) for w, s in on_workers.items()} == dict.fromkeys(
        on_workers, (size, True)
    ), state
    rows = by_worker(client)
    assert set(rows) == set(on_workers) == set(worker_addresses(client))
    assert {w: r.pool for w, r in rows.items()} == on_scheduler["rows"] == {w: s["pool"] for w, s in on_workers.items()}
    assert {r.max_size for r in rows.values()} == {int(size.removesuffix("MiB")) * MiB}
    live = sorted(os.path.basename(os.path.dirname(r.broker)) for r in rows.values())
    with contextlib.suppress(AssertionError):  # a torn-down pool's directory may take a moment to go
        wait_for(lambda: broker_dirs(broker_dir) == live, timeout=10)
    assert broker_dirs(broker_dir) == live


def assert_a_killed_workers_row_leaves(client, size, broker_dir):
    """Kill w0: its row leaves the registry, and the Nanny's new worker joins with the same plugin's pool."""
    victim = by_worker(client)[worker_addresses(client)[0]]
    os.kill(victim.pid, signal.SIGKILL)
    wait_for(lambda: victim.pool not in {r.pool for r in dask_gpupool.pools(client)}, timeout=60)
    wait_for(lambda: len(dask_gpupool.pools(client)) == 2, timeout=60)
    from dask_gpupool.transport.broker_dirs import remove_stale_broker_dirs

    remove_stale_broker_dirs(broker_dir, min_age=0)  # the killed broker's own directory (as in the kill test above)
    assert_one_plugin(client, size, broker_dir)


def register_from_threads(client, plugins, start=None):
    """Each of ``plugins`` registered by a client of its own, each from a thread: all at the same moment (a barrier),
    or, with ``start`` given, each once ``start(i)`` returned. What each ``register_plugin`` raised, or ``None``."""
    import threading

    from distributed import Client

    clients = [Client(client.scheduler.address, timeout=30) for _ in plugins]
    outcomes = [None] * len(plugins)
    barrier = threading.Barrier(len(plugins)) if start is None else None

    def register(i):
        if barrier is not None:
            barrier.wait(30)
        try:
            clients[i].register_plugin(plugins[i])
        except BaseException as e:
            outcomes[i] = e

    try:
        threads = [threading.Thread(target=register, args=(i,)) for i in range(len(plugins))]
        for i, t in enumerate(threads):
            if start is not None:
                start(i)
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "register_plugin did not return"
    finally:
        for other in clients:
            other.close()
    return outcomes


def test_two_registrations_at_once_with_other_options_leave_the_later_one_on_the_scheduler_and_every_worker(tmp_path):
    """Two clients register ``GPUPool`` with other sizes, the second while the first's start is still installing its
    worker plugins. The interleaving that left the workers with pools of both plugins is forced: worker w0 gets to
    install the first plugin only after the second (it holds the first one's ``plugin-add`` until the second's is
    answered, or 5 s); w1 installs them as they come. Registrations run one after the other, in the order the
    scheduler received them, as two registrations made in turn do: both ``register_plugin`` calls return, and the
    later one replaces the first everywhere (one plugin listed, serving the registry, installed on every worker;
    one pool per worker); a worker killed afterwards leaves the registry, and its restarted worker joins with the
    same plugin. Nothing is refused, and no broker directory is left."""
    plugins = [
        GPUPool(kind="host", max_size=size, broker_timeout="2s", broker_dir=str(tmp_path))
        for size in ("32MiB", "16MiB")
    ]
    with nanny_cluster([{}, {}]) as c:
        w0, _ = worker_addresses(c)
        c.run(T.hold_plugin_add, "32MiB", "16MiB", 5.0, workers=[w0])

        def start(i):
            if i == 1:  # the second registration goes once the first one's plugin-add is held on w0
                wait_for(lambda: c.run(T.plugin_adds, workers=[w0])[w0] == ["held 32MiB"])

        assert register_from_threads(c, plugins, start) == [None, None]
        seen = c.run(T.plugin_adds, workers=[w0])[w0]
        c.run(T.release_plugin_add, workers=[w0])
        assert_one_plugin(c, "16MiB", tmp_path)
        assert seen == ["held 32MiB", "add 32MiB", "add 16MiB"], seen  # the second waited for the first
        assert_a_killed_workers_row_leaves(c, "16MiB", tmp_path)
        handoff_round_trip(c, MiB, b"registered at once")
        assert rejected_on_scheduler(c) == {}
    assert os.listdir(tmp_path) == []


def test_two_clients_registering_other_options_at_the_same_moment_leave_one_plugin_everywhere(tmp_path):
    """Two clients call ``register_plugin(GPUPool(...))`` with other sizes at the same moment (no forced order): both
    return, and whichever the scheduler received last is the plugin listed, serving the registry and installed on
    every worker; a killed worker's row leaves the registry; nothing is refused, no broker directory is left."""
    sizes = ("32MiB", "16MiB")
    plugins = [GPUPool(kind="host", max_size=size, broker_timeout="2s", broker_dir=str(tmp_path)) for size in sizes]
    with nanny_cluster([{}, {}]) as c:
        assert register_from_threads(c, plugins) == [None, None]
        size = registration_state(c)[0]["listed"]
        assert size in sizes
        assert_one_plugin(c, size, tmp_path)
        assert_a_killed_workers_row_leaves(c, size, tmp_path)
        handoff_round_trip(c, MiB, b"registered at the same moment")
        assert rejected_on_scheduler(c) == {}
    assert os.listdir(tmp_path) == []


def test_two_installs_of_the_worker_plugin_at_once_leave_that_worker_one_pool(tmp_path):
    """A worker gets a gpupool worker plugin while another one's set-up has not ended (a worker joining while a
    registration is broadcast gets the plugin the scheduler gave it and the broadcast one): Dask tears the first
    down, installs the second, and the first's set-up goes on after (forced here: it waits until the second is
    installed). The worker ends with the second plugin's pool alone, registered and serving; the first's pool is not
    left running, unlisted, with its broker and its stream handlers; nothing is refused, no broker directory is
    left."""
    options = {"kind": "host", "broker_timeout": "2s", "broker_dir": str(tmp_path)}
    with nanny_cluster([{}, {}], GPUPool(max_size="16MiB", **options)) as c:
        w0, _ = worker_addresses(c)

        async def install_two(dask_worker):
            import asyncio

            from dask_gpupool.dask.worker_plugin import GPUPoolWorkerPlugin

            replaced = asyncio.Event()

            class SetUpLate(GPUPoolWorkerPlugin):
                async def setup(self, worker):
                    await replaced.wait()
                    await super().setup(worker)

            first = SetUpLate({**options, "max_size": "32MiB"})
            second = GPUPoolWorkerPlugin({**options, "max_size": "16MiB"})
            installing = asyncio.ensure_future(dask_worker.plugin_add(first, name="gpupool"))
            while dask_worker.plugins.get("gpupool") is not first:
                await asyncio.sleep(0.01)
            added = await dask_worker.plugin_add(second, name="gpupool")
            replaced.set()
            return [(await installing)["status"], added["status"]], dask_worker.plugins["gpupool"] is second

        old = by_worker(c)[w0].pool
        assert c.run(install_two, workers=[w0])[w0] == (["OK", "OK"], True)
        wait_for(lambda: getattr(by_worker(c).get(w0), "pool", old) != old)  # w0's row leaves, then the new one joins
        assert_one_plugin(c, "16MiB", tmp_path)
        handoff_round_trip(c, MiB, b"installed twice at once")
        assert rejected_on_scheduler(c) == {}
    assert os.listdir(tmp_path) == []


def test_a_worker_killed_while_a_registration_waits_for_the_others_leaves_the_new_registry(tmp_path):
    """A worker dies while ``register_plugin(GPUPool(...))`` still runs: w1 joined the new registry, w0's install is
    held, and w1 is killed. Distributed tells only the plugins it lists of a worker leaving, and the new one is
    listed only when its start returns; its registry drops the dead worker's row then. The registry holds exactly
    the live workers' rows (the Nanny's new w1 joins), and nothing is left behind."""
    import threading

    plugin = GPUPool(kind="host", max_size="16MiB", broker_timeout="2s", broker_dir=str(tmp_path))
    with nanny_cluster([{}, {}]) as c:
        w0, w1 = worker_addresses(c)
        c.run(T.hold_plugin_add, "16MiB", "none", 60.0, workers=[w0])
        outcome = []
        thread = threading.Thread(target=lambda: outcome.append(c.register_plugin(plugin)))
        thread.start()
        try:
            wait_for(lambda: c.run(T.plugin_adds, workers=[w0])[w0] == ["held 16MiB"])
            wait_for(lambda: w1 in by_worker(c))
            os.kill(by_worker(c)[w1].pid, signal.SIGKILL)
            wait_for(lambda: not c.run_on_scheduler(lambda dask_scheduler: w1 in dask_scheduler.workers))
        finally:
            c.run(T.release_plugin_add, workers=[w0])
            thread.join(120)
        assert outcome == [None]
        wait_for(lambda: len(worker_addresses(c)) == 2 and set(worker_addresses(c)) <= set(by_worker(c)), timeout=60)
        assert set(by_worker(c)) == set(worker_addresses(c))  # the dead w1's row is not among them
        from dask_gpupool.transport.broker_dirs import remove_stale_broker_dirs

        remove_stale_broker_dirs(str(tmp_path), min_age=0)  # the killed broker's own directory
        assert_one_plugin(c, "16MiB", tmp_path)
        handoff_round_trip(c, MiB, b"after a death during registration")
        assert rejected_on_scheduler(c) == {}
    assert os.listdir(tmp_path) == []


def test_two_idempotent_registrations_at_once_install_the_plugin_once(tmp_path):
    """Two ``GPUPool`` registrations marked idempotent at the same moment, as workers started together with
    ``--preload dask_gpupool`` make (distributed lets both start: neither finds a plugin listed): the one that runs
    second finds the first listed and does nothing, so each worker installs the worker plugin once, and the
    cluster runs the first one's pools."""
    plugins = [
        GPUPool(kind="host", max_size=size, broker_timeout="2s", broker_dir=str(tmp_path))
        for size in ("32MiB", "16MiB")
    ]
    for plugin in plugins:
        plugin.idempotent = True
    with nanny_cluster([{}, {}]) as c:
        c.run(T.hold_plugin_add, "none", "none", 0.0)  # holds nothing; counts the installs
        assert register_from_threads(c, plugins) == [None, None]
        size = registration_state(c)[0]["listed"]
        assert c.run(T.plugin_adds) == {w: [f"add {size}"] for w in worker_addresses(c)}
        c.run(T.release_plugin_add)
        assert_one_plugin(c, size, tmp_path)
        handoff_round_trip(c, MiB, b"installed once")
        assert rejected_on_scheduler(c) == {}
    assert os.listdir(tmp_path) == []


def register_in_background(c, plugin, then=None):
    """``c.register_plugin(plugin)`` on a thread of its own, started: returns the thread and the list its outcome
    lands in (``None``, or the exception raised; then ``then()``'s value, when given)."""
    import threading

    outcome = []

    def register():
        try:
            c.register_plugin(plugin)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)
        if then is not None:
            outcome.append(then())

    thread = threading.Thread(target=register)
    thread.start()
    return thread, outcome


def test_a_worker_killed_while_its_install_is_under_way_fails_the_registration_and_leaves_no_plugin_serving(
    tmp_path,
):
    """A worker dies while the scheduler waits for its answer to ``plugin-add`` (the broadcast's comm breaks):
    distributed's ``register_worker_plugin`` raises, and ``register_plugin`` with it. The registration's handlers
    stayed installed and its worker plugin registered, with the plugin never listed: the registry went on serving
    with no ``remove_worker`` reaching it, so a worker that died later kept its row for ever, and new workers kept
    installing pools of a plugin the scheduler did not have. A registration that fails so is now undone as one that a
    worker's setup failed: no handler serves (``pools`` says there is no registry), and no worker runs a pool. The
    caller gets a ``GPUPoolError`` naming the worker that left and its comm error (it got a ``CommClosedError`` naming
    its own connection to the scheduler, as if the scheduler were gone)."""
    plugin = GPUPool(kind="host", max_size="16MiB", broker_timeout="2s", broker_dir=str(tmp_path))
    with nanny_cluster([{}, {}]) as c:
        w0, _ = worker_addresses(c)
        pid = c.run(os.getpid, workers=[w0])[w0]
        c.run(T.hold_plugin_add, "16MiB", "none", 60.0, workers=[w0])
        thread, outcome = register_in_background(c, plugin)
        wait_for(lambda: c.run(T.plugin_adds, workers=[w0])[w0] == ["held 16MiB"])
        os.kill(pid, signal.SIGKILL)
        thread.join(120)
        # The caller is told which worker left: re-raised out of the scheduler's handler, the dead worker's
        # CommClosedError read as the caller's own connection closing (Dask aborted it unanswered).
        assert len(outcome) == 1 and isinstance(outcome[0], dask_gpupool.GPUPoolError), outcome
        assert w0 in str(outcome[0]) and "CommClosedError" in str(outcome[0]), outcome
        wait_for(lambda: len(worker_addresses(c)) == 2 and w0 not in worker_addresses(c), timeout=60)
        with pytest.raises(dask_gpupool.PoolUnavailableError):
            dask_gpupool.pools(c)
        assert c.run_on_scheduler(lambda dask_scheduler: "gpupool" in dask_scheduler.worker_plugins) is False
        assert c.run(lambda dask_worker: "gpupool" in dask_worker.plugins) == dict.fromkeys(worker_addresses(c), False)
    from dask_gpupool.transport.broker_dirs import remove_stale_broker_dirs

    remove_stale_broker_dirs(str(tmp_path), min_age=0)  # the killed worker never made one; w1's went with its pool
    assert os.listdir(tmp_path) == []


def assert_a_mib_goes_zero_copy(c, src, dst, payload):
    """A 1 MiB buffer made on ``src`` and read on ``dst`` arrives zero-copy: ``dst``'s counters gain 1 MiB received
    zero-copy and no copied byte."""
    from conftest import counters

    before = counters(c, dst)[dst]
    x = c.submit(T.make_buffer, MiB, payload, workers=[src], pure=False)
    assert c.submit(T.head, x, len(payload), workers=[dst], pure=False).result() == payload
    after = counters(c, dst)[dst]
    assert after["zero_copy_bytes"] - before["zero_copy_bytes"] == MiB, (before, after)
    assert after["copied_bytes"] == before["copied_bytes"], (before, after)


def test_a_registration_returns_while_a_worker_never_answers_its_install_and_that_worker_joins_when_it_resumes(
    tmp_path, caplog
):
    """A worker that never answers the scheduler's ``plugin-add`` (stopped with SIGSTOP, its event loop blocked)
    made ``register_plugin(GPUPool(...))`` wait for it, and every later registration wait behind that one, until
    ``distributed.scheduler.worker-ttl`` removed the worker (never, with ``worker-ttl: null``). A registration now
    returns within ``distributed.comm.timeouts.connect``, logging a WARNING that names the worker that did not
    answer; the workers that answered have pools and hand over zero-copy, and a later registration does not wait
    behind the stopped worker either. When it resumes, the worker ends with the pool of the plugin registered last
    (never the replaced one's), joins the registry and hands over zero-copy; nothing is refused or left behind."""
    import logging
    import threading

    import dask

    plugins = [
        GPUPool(kind="host", max_size=size, broker_timeout="2s", broker_dir=str(tmp_path))
        for size in ("32MiB", "16MiB")
    ]
    caplog.set_level(logging.WARNING, logger="dask_gpupool.dask.scheduler_plugin")
    with dask.config.set({"distributed.comm.timeouts.connect": "5s"}), nanny_cluster([{}, {}, {}]) as c:
        w0, w1, w2 = worker_addresses(c)
        pid = c.run(os.getpid, workers=[w2])[w2]
        os.kill(pid, signal.SIGSTOP)
        threads = []
        try:
            for plugin in plugins:
                outcome = []
                thread = threading.Thread(target=lambda p=plugin, o=outcome: o.append(c.register_plugin(p)))
                threads.append(thread)
                t0 = time.monotonic()
                thread.start()
                thread.join(30)
                assert outcome == [None], f"register_plugin had not returned after {time.monotonic() - t0:.0f} s"
                rows = by_worker(c)
                assert set(rows) == {w0, w1}
                assert {r.max_size for r in rows.values()} == {int(plugin.overrides["max_size"][:2]) * MiB}
                warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
                assert any(w2 in m and "did not answer" in m for m in warned), warned
                caplog.clear()
                assert_a_mib_goes_zero_copy(c, w0, w1, b"answered")
        finally:
            os.kill(pid, signal.SIGCONT)
            for thread in threads:
                thread.join(120)
        wait_for(lambda: set(by_worker(c)) == {w0, w1, w2}, timeout=60)
        assert_one_plugin(c, "16MiB", tmp_path)
        assert_a_mib_goes_zero_copy(c, w0, w2, b"resumed")
        assert rejected_on_scheduler(c) == {}
    assert os.listdir(tmp_path) == []


def gpupool_served(client):
    """What of the gpupool plugin the scheduler still serves (test inspection only): its RPC handlers, its stream
    handlers other than the one that drops late messages, and whether new workers get its worker plugin."""

    def on_scheduler(dask_scheduler):
        from dask_gpupool.core import JOINED_OP, PLUGIN_NAME, REGISTER_OP, UNREGISTER_OP, UPDATE_OP
        from dask_gpupool.dask.scheduler_plugin import _drop
        from dask_gpupool.ops.dashboard import STATS_OP

        ops = (REGISTER_OP, JOINED_OP, UPDATE_OP, UNREGISTER_OP, STATS_OP)
        return {
            "handlers": sorted(op for op in dask_scheduler.handlers if op.startswith("gpupool")),
            "stream-handlers": sorted(op for op in ops if dask_scheduler.stream_handlers.get(op) not in (None, _drop)),
            "worker-plugin": PLUGIN_NAME in dask_scheduler.worker_plugins,
        }

    return client.run_on_scheduler(on_scheduler)


def test_unregistering_the_scheduler_plugin_stops_its_handlers_and_every_pool_and_a_new_registration_works(tmp_path):
    """``client.unregister_scheduler_plugin("gpupool")``: distributed only delists the plugin (``remove_plugin`` calls
    no ``close``), so its handlers kept serving the registry, new workers kept getting its worker plugin, and every
    worker's pool kept running. Now no gpupool handler serves (late stream messages are dropped), the worker plugin is
    unregistered from every worker (their pools close, their broker directories go), and a later registration works
    from a clean state; nothing is refused or left behind."""
    plugin = GPUPool(kind="host", max_size="16MiB", broker_timeout="2s", broker_dir=str(tmp_path))
    with nanny_cluster([{}, {}], plugin) as c:
        assert len(broker_dirs(tmp_path)) == 2
        c.unregister_scheduler_plugin("gpupool")
        gone = {"handlers": [], "stream-handlers": [], "worker-plugin": False}
        wait_for(lambda: gpupool_served(c) == gone, timeout=30)
        with pytest.raises(dask_gpupool.PoolUnavailableError):
            dask_gpupool.pools(c)
        no_plugin = dict.fromkeys(worker_addresses(c), False)
        wait_for(lambda: c.run(lambda dask_worker: "gpupool" in dask_worker.plugins) == no_plugin, timeout=30)
        wait_for(lambda: broker_dirs(tmp_path) == [], timeout=30)
        c.register_plugin(GPUPool(kind="host", max_size="32MiB", broker_timeout="2s", broker_dir=str(tmp_path)))
        assert_one_plugin(c, "32MiB", tmp_path)
        handoff_round_trip(c, MiB, b"registered after it was unregistered")
        assert rejected_on_scheduler(c) == {}
    assert os.listdir(tmp_path) == []


def test_a_stopped_worker_retired_while_a_registration_waits_for_it_leaves_the_registration_to_the_others(tmp_path):
    """A re-registration waits for a worker that never answers its install (stopped with SIGSTOP), and the operator
    retires that worker meanwhile (``client.retire_workers``): the scheduler removes it, and the listed plugin gives
    up the install it never answered (``remove_worker``). That worker left the cluster as any worker leaving during a
    registration does: ``register_plugin`` returns, the others run the new plugin's pools and hand over zero-copy,
    and the registry holds the live workers' rows only; nothing is refused or left behind."""

    import dask

    plugins = [
        GPUPool(kind="host", max_size=size, broker_timeout="2s", broker_dir=str(tmp_path))
        for size in ("32MiB", "16MiB")
    ]
    with dask.config.set({"distributed.comm.timeouts.connect": "30s"}), nanny_cluster([{}, {}], plugins[0]) as c:
        w0, w1 = worker_addresses(c)
        pid = c.run(os.getpid, workers=[w1])[w1]
        os.kill(pid, signal.SIGSTOP)
        thread, outcome = register_in_background(c, plugins[1])
        try:
            wait_for(lambda: set(by_worker(c)) == {w0} and {r.max_size for r in by_worker(c).values()} == {16 * MiB})
            c.retire_workers([w1], close_workers=False)
            thread.join(60)
            assert outcome == [None], outcome
        finally:
            os.kill(pid, signal.SIGKILL)
            thread.join(120)
        wait_for(lambda: w1 not in c.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.workers)))
        wait_for(lambda: len(worker_addresses(c)) == 2, timeout=60)  # the Nanny's new w1 joins
        wait_for(lambda: len(dask_gpupool.pools(c)) == 2, timeout=60)
        from dask_gpupool.transport.broker_dirs import remove_stale_broker_dirs

        remove_stale_broker_dirs(str(tmp_path), min_age=0)  # the killed w1's broker directory
        assert_one_plugin(c, "16MiB", tmp_path)
        handoff_round_trip(c, MiB, b"after a stopped worker was retired")
        assert rejected_on_scheduler(c) == {}
    assert os.listdir(tmp_path) == []


def test_a_plugin_registered_under_a_name_of_its_own_serves_until_unregistered_under_that_name(tmp_path):
    """``client.register_plugin(GPUPool(...), name="pools")``: distributed lists the plugin under the name given. Its
    watch looked for it under ``"gpupool"`` only, took it for unregistered half a second after it started and tore
    it down (its handlers, every worker's pool). It now serves on, pools hand over zero-copy, and
    ``client.unregister_scheduler_plugin("pools")`` tears it down as unregistering ``"gpupool"`` does; nothing is
    refused or left behind."""
    from dask_gpupool.dask.scheduler_plugin import _WATCH_INTERVAL

    plugin = GPUPool(kind="host", max_size="16MiB", broker_timeout="2s", broker_dir=str(tmp_path))
    with nanny_cluster([{}, {}]) as c:
        c.register_plugin(plugin, name="pools")
        time.sleep(4 * _WATCH_INTERVAL)  # the watch looks several times
        served = {
            "handlers": sorted(gpupool_served(c)["handlers"]),
            "worker-plugin": gpupool_served(c)["worker-plugin"],
        }
        assert served == {
            "handlers": ["gpupool_pools", "gpupool_register", "gpupool_registration", "gpupool_unregister"],
            "worker-plugin": True,
        }
        assert set(by_worker(c)) == set(worker_addresses(c))
        assert len(broker_dirs(tmp_path)) == 2
        handoff_round_trip(c, MiB, b"registered under a name of its own")
        assert c.run_on_scheduler(lambda dask_scheduler: dict(dask_scheduler.plugins["pools"].rejected)) == {}
        c.unregister_scheduler_plugin("pools")
        gone = {"handlers": [], "stream-handlers": [], "worker-plugin": False}
        wait_for(lambda: gpupool_served(c) == gone, timeout=30)
        no_plugin = dict.fromkeys(worker_addresses(c), False)
        wait_for(lambda: c.run(lambda dask_worker: "gpupool" in dask_worker.plugins) == no_plugin, timeout=30)
        wait_for(lambda: broker_dirs(tmp_path) == [], timeout=30)
    assert os.listdir(tmp_path) == []


def test_a_registration_a_killed_worker_fails_raises_only_once_every_live_worker_answered_and_is_undone(tmp_path):
    """A worker dies while its install is under way, and another, live, answers its install a moment later (forced:
    w1 holds it for 3 s, far within ``distributed.comm.timeouts.connect``). ``register_plugin`` raised as soon as the
    dead worker's comm broke, before w1 answered: the undo skipped w1 (one message at a time), and w1 installed the
    failed registration's worker plugin after the caller was told it failed (the removal came later still; the
    neighbouring kill test saw w1 holding it, now and then, on a loaded machine). It now raises once every live
    worker answered and was undone: w1 installed it before, runs no pool after, and installs nothing later; no
    handler serves; nothing is left behind."""

    plugin = GPUPool(kind="host", max_size="16MiB", broker_timeout="2s", broker_dir=str(tmp_path))
    with nanny_cluster([{}, {}]) as c:
        w0, w1 = worker_addresses(c)
        pid = c.run(os.getpid, workers=[w0])[w0]
        c.run(T.hold_plugin_add, "16MiB", "none", 60.0, workers=[w0])
        c.run(T.hold_plugin_add, "16MiB", "none", 3.0, workers=[w1])
        # and what w1 had installed when it raised
        thread, outcome = register_in_background(c, plugin, then=lambda: c.run(T.plugin_adds, workers=[w1])[w1])
        wait_for(lambda: c.run(T.plugin_adds) == {w: ["held 16MiB"] for w in (w0, w1)})
        os.kill(pid, signal.SIGKILL)
        thread.join(120)
        assert len(outcome) == 2 and isinstance(outcome[0], Exception), outcome
        assert outcome[1] == ["held 16MiB", "add 16MiB"], outcome  # w1 had answered before it raised
        assert c.run(lambda dask_worker: "gpupool" in dask_worker.plugins, workers=[w1]) == {w1: False}
        with pytest.raises(dask_gpupool.PoolUnavailableError):
            dask_gpupool.pools(c)
        assert c.run_on_scheduler(lambda dask_scheduler: "gpupool" in dask_scheduler.worker_plugins) is False
        wait_for(lambda: len(worker_addresses(c)) == 2 and w0 not in worker_addresses(c), timeout=60)
        assert c.run(lambda dask_worker: "gpupool" in dask_worker.plugins) == dict.fromkeys(worker_addresses(c), False)
        assert c.run(T.plugin_adds, workers=[w1])[w1] == ["held 16MiB", "add 16MiB"]  # nothing installed since
    from dask_gpupool.transport.broker_dirs import remove_stale_broker_dirs

    remove_stale_broker_dirs(str(tmp_path), min_age=0)  # the killed worker never made one; w1's went with its pool
    assert os.listdir(tmp_path) == []


def test_a_registration_under_another_name_delists_the_plugin_it_replaces_and_unregistering_it_tears_all_down(
    tmp_path,
):
    """``register_plugin(GPUPool(...))`` (listed as ``"gpupool"``), then ``register_plugin(GPUPool(...),
    name="pools")``: the second replaced the first's handlers and worker plugins, yet distributed listed both, so
    unregistering ``"pools"`` left the first listed and taken for a registration made since: no watch tore anything
    down, and the second's handlers and every worker's pool served on. The later registration now delists the one it
    replaced: the scheduler lists one ``GPUPool``, under ``"pools"``; every worker runs its pool and hands over
    zero-copy; unregistering ``"pools"`` leaves no handler serving, no worker plugin, no pool, no ``GPUPool``
    listed; nothing is refused or left behind."""
    plugins = [
        GPUPool(kind="host", max_size=size, broker_timeout="2s", broker_dir=str(tmp_path))
        for size in ("32MiB", "16MiB")
    ]
    with nanny_cluster([{}, {}], plugins[0]) as c:
        w0, w1 = worker_addresses(c)
        c.register_plugin(plugins[1], name="pools")
        assert listed_gpupools(c) == {"pools": "16MiB"}
        assert_one_plugin(c, "16MiB", tmp_path, name="pools")
        assert_a_mib_goes_zero_copy(c, w0, w1, b"under a name of its own")
        assert_a_mib_goes_zero_copy(c, w1, w0, b"and back")
        assert rejected_on_scheduler(c, "pools") == {}
        c.unregister_scheduler_plugin("pools")
        gone = {"handlers": [], "stream-handlers": [], "worker-plugin": False}
        wait_for(lambda: gpupool_served(c) == gone, timeout=30)
        assert listed_gpupools(c) == {}
        with pytest.raises(dask_gpupool.PoolUnavailableError):
            dask_gpupool.pools(c)
        no_plugin = dict.fromkeys(worker_addresses(c), False)
        wait_for(lambda: c.run(lambda dask_worker: "gpupool" in dask_worker.plugins) == no_plugin, timeout=30)
        wait_for(lambda: broker_dirs(tmp_path) == [], timeout=30)
    assert os.listdir(tmp_path) == []


def test_an_idempotent_registration_finding_a_plugin_listed_under_another_name_does_nothing(tmp_path):
    """A ``GPUPool`` listed as ``"pools"``, then an idempotent registration (what ``--preload dask_gpupool`` makes,
    under ``"gpupool"``): distributed found no plugin under ``"gpupool"``, and the plugin looked under that name only,
    so it replaced the running one everywhere and both were listed. It now does nothing: one ``GPUPool`` listed, as
    ``"pools"``; no worker installs a plugin; every worker keeps its pool; nothing is refused or left behind."""
    plugin = GPUPool(kind="host", max_size="16MiB", broker_timeout="2s", broker_dir=str(tmp_path))
    preloaded = GPUPool(kind="host", max_size="32MiB", broker_timeout="2s", broker_dir=str(tmp_path))
    preloaded.idempotent = True
    with nanny_cluster([{}, {}]) as c:
        w0, w1 = worker_addresses(c)
        c.register_plugin(plugin, name="pools")
        before = by_worker(c)
        c.run(T.hold_plugin_add, "none", "none", 0.0)  # holds nothing; counts the installs
        c.register_plugin(preloaded)
        time.sleep(0.5)
        assert c.run(T.plugin_adds) == {w0: [], w1: []}
        c.run(T.release_plugin_add)
        assert listed_gpupools(c) == {"pools": "16MiB"}
        assert by_worker(c) == before
        assert_one_plugin(c, "16MiB", tmp_path, name="pools")
        assert_a_mib_goes_zero_copy(c, w0, w1, b"preloaded once")
        assert rejected_on_scheduler(c, "pools") == {}
    assert os.listdir(tmp_path) == []
