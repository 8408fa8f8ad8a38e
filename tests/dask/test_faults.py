"""Faults with real worker processes, killed for real, on ``host`` pools (CI).

Each case ends with the surviving workers back to their baseline: fds, sockets,
broker connections, mappings, leases and pool bytes.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import (
    HOST_POOL,
    back_to,
    counters,
    free_port,
    kill_consumer_holding_leases,
    kind_cluster,
    nanny_cluster,
    pid_of,
    pool_kinds,
    stop_processes,
    wait_for,
    warm_up,
    worker_addresses,
)
from distributed import wait

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import testing as T
from dask_gpupool.tuning import HOST_HANDOFF_THRESHOLD  # the smallest host-pool buffer handed over, not copied

MiB = 1 << 20


def test_sigkill_of_the_producer_leaves_the_consumers_mapping_readable_and_dask_recomputes():
    # A carries a worker resource that its restarted process keeps: the lost key is recomputed
    # there and read there, so B never meets the new A. C is B's warm-up partner. On a GPU host a
    # host-pool worker makes a CUDA context once (GPU runs saw B gain its fds after the baseline,
    # a warm-up handoff notwithstanding): B makes it before the baseline, since that is not what
    # this test looks for.
    with nanny_cluster([{"resources": {"A": 1}}, {}, {}], HOST_POOL) as c:
        a, b, third = worker_addresses(c)
        c.run(T.make_cuda_context, workers=[b])
        base_b = {b: warm_up(c, b, third)[b]}
        x = c.submit(T.make_buffer, MiB, b"made on A", workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.describe, y, workers=[b], pure=False).result()["imported"]
        lost = c.submit(T.make_buffer, MiB, b"only on A", resources={"A": 1}, pure=False)
        lost.result()
        assert c.who_has(lost)[lost.key] == (a,)
        os.kill(pid_of(c, a), signal.SIGKILL)
        # B's mapping of the dead producer's memory stays readable
        assert c.submit(T.head, y, 9, workers=[b], pure=False).result() == b"made on A"
        # a key that lived only on A is recomputed (on the restarted A), not lost or hung
        c.wait_for_workers(3, timeout=60)
        assert c.submit(T.head, lost, 9, resources={"A": 1}, pure=False).result(timeout=60) == b"only on A"
        del x, y, lost
        # B drops its mapping of the dead pool and its link: back to where it started
        back_to(c, base_b, workers=[b])


def test_sigkill_of_the_consumer_between_export_and_claim_expires_the_lease():
    plugin = GPUPool(kind="host", max_size="64 MiB", lease_timeout="1s")
    with nanny_cluster([{}, {}], plugin) as c:
        a, b = worker_addresses(c)
        base_a = c.run(T.resources, workers=[a])
        x = c.submit(T.make_buffer, MiB, b"unclaimed", workers=[a], pure=False)
        x.result()
        # A grants a lease as if B asked for x, and B dies before it could claim it
        c.run(T.grant_unclaimed_lease, x.key, b, workers=[a])
        assert counters(c, a)[a]["leases"] == 1
        os.kill(pid_of(c, b), signal.SIGKILL)
        wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="the unclaimed lease to expire")
        del x
        back_to(c, base_a, workers=[a])


def test_a_worker_the_scheduler_removes_while_its_process_lives_keeps_its_leases_until_it_exits():
    """The scheduler can remove a worker whose process lives on (``worker-ttl`` after a stall, a broken stream).
    Leaving the registry is not dying: the exporter keeps its leases until the process is gone (its pid, watched
    with a pidfd), so the memory it maps is never reused under it. Here B is stalled (SIGSTOP) and removed; A's
    pool cannot take the leased MiB back until B's process is killed (were B's leases ended at once, a task still
    running on B would read A's next values)."""
    with nanny_cluster([{}, {}], GPUPool(kind="host", max_size="16 MiB")) as c:
        a, b = worker_addresses(c)
        x = c.submit(T.make_buffer, MiB, b"original", workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        wait(y)
        key = x.key
        del x
        wait_for(lambda: not c.who_has().get(key), what="A to forget x")
        assert counters(c, a)[a]["leases"] == 1
        pid = pid_of(c, b)
        b_pool = next(r.pool for r in dask_gpupool.pools(c) if r.worker == b)

        async def remove(dask_scheduler, address=b):
            await dask_scheduler.remove_worker(address, stimulus_id="test-remove-alive", close=False)

        os.kill(pid, signal.SIGSTOP)
        try:
            c.run_on_scheduler(remove)
            wait_for(lambda: b_pool not in c.run(T.known_pools, workers=[a])[a], what="A to learn that B left")
            c.run(T.broker_barrier, workers=[a])  # A's broker handled B's departure (where it would end the lease)
            for _ in range(4):  # new values on A: none lands on the leased MiB
                c.submit(T.scribble, MiB, b"SCRIBBLED!", workers=[a], pure=False).result()
            assert c.run(T.lease_counts, workers=[a])[a]["leases"] == 1
            assert c.run(T.leased_heads, 8, workers=[a])[a] == [b"original"]
        finally:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="A to release B's lease once B's process is gone")
        del y
        wait_for(lambda: counters(c, a)[a]["used"] == 0, what="A's pool bytes to return")


def test_retiring_the_producer_keeps_the_consumers_data():
    with nanny_cluster([{}, {}, {}], HOST_POOL) as c:
        a, b, _ = worker_addresses(c)
        x = c.submit(T.make_buffer, MiB, b"retired A", workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.describe, y, workers=[b], pure=False).result()["imported"]
        c.retire_workers([a], close_workers=True)
        wait_for(lambda: a not in T.workers(c), what="A to retire")
        # B's value is a view of A's memory: it must stay right after A is gone
        assert c.submit(T.head, y, 9, workers=[b], pure=False).result() == b"retired A"
        assert c.submit(T.head, x, 9, workers=[b], pure=False).result() == b"retired A"
        del x, y
        wait_for(lambda: c.run(T.resources, workers=[b])[b]["mapped_pools"] == 0, what="B to drop A's pool")


def test_a_full_receiver_pool_falls_back_to_memory_outside_it():
    small = [{"config": {"gpupool": {"host-id": f"host-{i}", "max-size": "4 MiB"}}} for i in range(2)]
    with nanny_cluster(small, GPUPool(kind="host")) as c:
        a, b = worker_addresses(c)
        hog = c.submit(T.make_buffer, 3 * MiB, b"hog", workers=[b], pure=False)
        hog.result()
        x = c.submit(T.make_buffer, 2 * MiB, b"does not fit", workers=[a], pure=False)
        assert c.submit(T.head, x, 12, workers=[b], pure=False).result() == b"does not fit"
        assert counters(c, b)[b]["fallbacks"] == {"receiver-pool-full": 1}


def test_a_full_pool_is_a_clear_error_of_ours():
    with nanny_cluster([{}], GPUPool(kind="host", max_size="4 MiB")) as c:

        def too_much() -> str:
            try:
                dask_gpupool.allocate(8 * MiB)
            except dask_gpupool.PoolExhaustedError as e:
                return str(e)
            return "no error"

        (row,) = dask_gpupool.pools(c)
        message = c.submit(too_much, pure=False).result()
        assert "cannot allocate" in message and row.pool in message


def _values_for_the_consumer(c, kind: str, a: str) -> list:
    """A's values that its consumer keeps: 200 of the smallest buffer a ``host`` pool hands over rather than copies,
    or 8 of 16 MiB on a ``device`` pool."""
    if kind == "host":
        return [c.submit(T.make_buffer, HOST_HANDOFF_THRESHOLD, b"x", workers=[a], pure=False) for _ in range(200)]
    return [c.submit(T.fill, 16 * MiB, 4, workers=[a], pure=False) for _ in range(8)]


@pool_kinds("one-gpu")
def test_consumer_killed_while_holding_many_leases_releases_them_all(kind):
    with kind_cluster(kind, "64 MiB" if kind == "host" else "1 GiB") as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        xs = _values_for_the_consumer(c, kind, a)
        kill_consumer_holding_leases(c, a, b, xs)
        del xs
        c.wait_for_workers(2, timeout=60)
        # the restarted B has a new baseline; A's pool bytes and leases are what must come back
        wait_for(lambda: counters(c, a)[a]["used"] == baseline[a]["used"], what="A's pool bytes back")


def test_consumer_killed_while_importing_leaves_the_producer_at_baseline():
    """B is SIGKILLed while it fetches (imports) 400 keys from A: leases it claimed end with its
    connection, leases granted for replies it never read expire, and A is back to its baseline.

    This found that Dask's log deque kept the values of a failed reply alive through the logged
    traceback's frames (the get_data hook now clears them).
    """
    plugin = GPUPool(kind="host", max_size="64 MiB", lease_timeout="2s")
    with nanny_cluster([{}, {}], plugin) as c:
        a, b = worker_addresses(c)
        baseline = c.run(T.resources, workers=[a])
        xs = [c.submit(T.make_buffer, HOST_HANDOFF_THRESHOLD, b"x", workers=[a], pure=False) for _ in range(400)]
        wait(xs)
        ys = [c.submit(T.keep, x, workers=[b], pure=False) for x in xs]
        wait_for(lambda: counters(c, a)[a]["leases"] > 0, timeout=30, what="B to start importing")
        os.kill(pid_of(c, b), signal.SIGKILL)
        del ys
        wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="A to end every lease of the dead importer")
        del xs
        c.wait_for_workers(2, timeout=60)
        back_to(c, baseline, workers=[a])


def test_handoffs_on_a_tls_secured_cluster():
    """With distributed.Security the scheduler comm (which carries the cluster token) is TLS, and
    handoffs between workers (over tls://) are still zero-copy."""
    from distributed.security import Security

    pytest.importorskip("cryptography", reason="Security.temporary needs cryptography")
    security = Security.temporary()
    with nanny_cluster([{}, {}], HOST_POOL, security=security) as c:
        a, b = worker_addresses(c)
        assert a.startswith("tls://") and c.scheduler.address.startswith("tls://")
        assert all(c.run(T.has_cluster_token).values())
        x = c.submit(T.make_buffer, MiB, b"over tls", workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.describe, y, workers=[b], pure=False).result()["imported"]
        assert c.submit(T.head, y, 8, workers=[b], pure=False).result() == b"over tls"
        assert counters(c, b)[b]["copied_bytes"] == 0


def test_scheduler_restart_workers_leave_nothing_and_a_restarted_cluster_hands_over(tmp_path):
    """Dask 2026.8 workers do not reconnect to a new scheduler: when theirs dies they close (and
    `dask worker` exits). Ours must close cleanly then, leaving no broker socket or directory, and a
    supervisor's restart of scheduler and workers must give a working cluster with new pools."""
    import subprocess
    import sys

    from distributed import Client

    port = free_port()
    import pathlib
    import shutil
    import tempfile

    # short: a Unix socket path has at most 107 bytes, and pytest's tmp_path can be longer
    brokers = pathlib.Path(tempfile.mkdtemp(prefix="gp-", dir="/tmp"))
    env = {
        **os.environ,
        "DASK_GPUPOOL__KIND": "host",
        "DASK_GPUPOOL__MAX_SIZE": "64MiB",
        "DASK_GPUPOOL__BROKER_DIR": str(brokers),
    }
    address = f"tcp://127.0.0.1:{port}"
    scheduler_cli = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(port)]
    worker_cli = [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nworkers", "2", "--nthreads", "1"]
    procs: list[subprocess.Popen] = []

    def start(cmd: list[str], log: str) -> subprocess.Popen:
        with open(tmp_path / log, "a") as err:
            p = subprocess.Popen(
                [*cmd, "--no-dashboard", "--preload", "dask_gpupool"], env=env, stdout=subprocess.DEVNULL, stderr=err
            )
        procs.append(p)
        return p

    def handoff(text: bytes) -> list[str]:
        with Client(address, timeout=30) as c:
            c.wait_for_workers(2, timeout=60)
            wait_for(lambda: len(dask_gpupool.pools(c)) == 2, what="both pools to register")
            a, b = sorted(r.worker for r in dask_gpupool.pools(c))
            x = c.submit(T.make_buffer, MiB, text, workers=[a], pure=False)
            y = c.submit(T.keep, x, workers=[b], pure=False)
            assert c.submit(T.describe, y, workers=[b], pure=False).result()["imported"]
            assert c.submit(T.head, y, len(text), workers=[b], pure=False).result() == text
            return [r.pool for r in dask_gpupool.pools(c)]

    try:
        scheduler = start(scheduler_cli, "scheduler.log")
        workers = start(worker_cli, "worker.log")
        first = handoff(b"before the restart")
        assert len(list(brokers.iterdir())) == 2  # one private directory per broker

        scheduler.kill()
        scheduler.wait(30)
        workers.wait(60)  # the workers close when their scheduler is gone, and `dask worker` exits
        assert list(brokers.iterdir()) == []  # every broker removed its socket and directory

        start(scheduler_cli, "scheduler.log")  # what a supervisor does
        start(worker_cli, "worker.log")
        second = handoff(b"after the restart")
        assert not set(first) & set(second)  # new pools, registered anew (with the new cluster's token)
    finally:
        stop_processes(procs)
        shutil.rmtree(brokers, ignore_errors=True)


def test_a_restarted_worker_removes_the_broker_directory_its_killed_process_left():
    """A SIGKILLed worker cannot remove its broker's directory; the next broker started in that
    broker-dir (here: the Nanny's restarted worker) removes it, and leaves the live peer's."""
    import shutil
    import tempfile

    parent = tempfile.mkdtemp(prefix="gp-")  # short: socket paths have 107 bytes
    try:
        plugin = GPUPool(kind="host", max_size="64 MiB", broker_dir=parent)
        with nanny_cluster([{}, {}], plugin) as c:
            a, b = worker_addresses(c)
            rows = {r.worker: r for r in dask_gpupool.pools(c)}
            dead, live = (os.path.dirname(rows[w].broker) for w in (a, b))
            old = time.time() - 3600  # both look old: only the dead one's socket is not listened on
            for d in (dead, live):
                os.utime(d, (old, old))
            base_b = c.run(T.resources, workers=[b])
            os.kill(rows[a].pid, signal.SIGKILL)
            assert os.path.exists(os.path.join(dead, "broker.sock"))  # left behind
            wait_for(
                lambda: {r.pool for r in dask_gpupool.pools(c)} - {rows[a].pool, rows[b].pool},
                what="the restarted worker's pool",
            )
            assert not os.path.exists(dead)
            assert os.path.exists(os.path.join(live, "broker.sock"))
            assert len(os.listdir(parent)) == 2  # the live peer's and the restarted worker's
            back_to(c, base_b, workers=[b])
        assert os.listdir(parent) == []
    finally:
        shutil.rmtree(parent, ignore_errors=True)
