"""The scheduler trusts only workers, with a real Client and Nanny workers on ``host`` pools.

Registration, row updates and unregistration travel over the worker's own batched stream; the
cluster token goes back only over that stream. A client (a plain ``Client``, its RPC or its own
batched stream) can read the registry, and nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import (
    back_to,
    counters,
    fd_targets,
    handoff_round_trip,
    nanny_cluster,
    stop_processes,
    wait_for,
    warm_up,
    worker_addresses,
)
from distributed import Client

import dask_gpupool
from dask_gpupool import GPUPool, NotAMemberError
from dask_gpupool import testing as T
from dask_gpupool.core import JOINED_OP, REGISTER_OP, UNREGISTER_OP, UPDATE_OP
from dask_gpupool.wire.registry import PoolRecord

MiB = 1 << 20
PLUGIN = GPUPool(kind="host", max_size="64 MiB", broker_timeout="2s")
MADE_UP = "tcp://10.255.255.1:4242"


@pytest.fixture(scope="module")
def client():
    with nanny_cluster([{}, {}], PLUGIN) as c:
        yield c


def by_worker(client: Any) -> dict[str, PoolRecord]:
    return {r.worker: r for r in dask_gpupool.pools(client)}


def rejected(client: Any) -> dict[str, int]:
    """The scheduler plugin's count of refused registry messages, by reason (test inspection only)."""

    def get(dask_scheduler: Any) -> dict[str, int]:
        return dict(getattr(dask_scheduler.plugins["gpupool"], "rejected", {}))

    return client.run_on_scheduler(get)


def wait_rejected(client: Any, before: dict[str, int], more: dict[str, int]) -> None:
    """Wait until each reason in ``more`` was counted that many more times than in ``before``."""

    def reached() -> bool:
        now = rejected(client)
        return all(now.get(k, 0) >= before.get(k, 0) + n for k, n in more.items())

    wait_for(reached, timeout=30, what=f"the scheduler to refuse {more}")


#: Stands in a message for the sending worker's own registry key (``send_on_own_stream``).
OWN_KEY = "own registry key"


def send_on_own_stream(msgs: list[dict[str, Any]], dask_worker: Any) -> None:
    """client.run target: send ``msgs`` over this worker's batched stream to the scheduler; a ``key`` of
    :data:`OWN_KEY` is replaced by this worker's own registry key."""
    key = dask_gpupool.dask.worker_plugin.service_of(dask_worker).registry_key
    for m in msgs:
        dask_worker.batched_stream.send({k: key if v == OWN_KEY else v for k, v in m.items()})


def rpc(client: Any, op: str, **kwargs: Any) -> Any:
    """Call a scheduler handler over a plain RPC comm of ``client``; the exception is returned, not raised."""
    try:
        return client.sync(getattr(client.scheduler, op), **kwargs)
    except Exception as e:
        return e


@contextlib.contextmanager
def rogue_client(client: Any) -> Iterator[Any]:
    """A second, plain Client of the cluster; fails if it leaves fds open in this process once closed.

    (What the rogue opened is what opened while it lived, by the open files' names (``socket:[inode]``): the module's
    shared client keeps a pool of comms that may grow meanwhile, and a count of fds would take those for the rogue's.)
    """
    gc.collect()
    before = set(fd_targets().values())
    with Client(client.scheduler.address, timeout=30) as rogue:
        try:
            yield rogue
        finally:
            opened = set(fd_targets().values()) - before

    def closed() -> bool:  # its comms close on the client's loop thread, a moment after close() returns
        gc.collect()
        return not opened & set(fd_targets().values())

    wait_for(closed, timeout=10, what="the rogue client's fds in this process to close")


def test_a_client_calling_register_gets_no_token_and_leaves_no_row(client):
    rows = by_worker(client)
    before = rejected(client)
    made_up = dataclasses.replace(next(iter(rows.values())), pool=str(uuid.uuid4()), worker=MADE_UP, pid=1)
    with rogue_client(client) as rogue:
        reply = rpc(rogue, "gpupool_register", record=made_up.to_msg())
        assert not (isinstance(reply, dict) and "token" in reply), "a client got the cluster token"
        assert isinstance(reply, NotAMemberError), reply
        assert "stream" in str(reply)
        # the read-only handler serves the client, and it holds no row for the made-up address
        assert {r.worker for r in dask_gpupool.pools(rogue)} == set(rows)
    assert by_worker(client) == rows
    wait_rejected(client, before, {"rpc": 1})
    assert set().union(*client.run(T.known_pools).values()) == {r.pool for r in rows.values()}


def test_a_client_cannot_unregister_a_live_workers_pool_nor_end_its_leases(client):
    a, b = worker_addresses(client)
    baseline = warm_up(client, a, b)
    rows = by_worker(client)
    x = client.submit(T.make_buffer, MiB, b"still leased", workers=[a], pure=False)
    y = client.submit(T.keep, x, workers=[b], pure=False)
    assert client.submit(T.describe, y, workers=[b], pure=False).result()["imported"]
    assert counters(client, a)[a]["leases"] == 1
    with rogue_client(client) as rogue:
        reply = rpc(rogue, "gpupool_unregister", pool=rows[b].pool)
        assert isinstance(reply, NotAMemberError), reply
    assert by_worker(client) == rows
    # the exporter kept B's lease: B still reads the bytes it maps
    assert counters(client, a)[a]["leases"] == 1
    assert client.submit(T.head, y, 12, workers=[b], pure=False).result() == b"still leased"
    del x, y
    back_to(client, baseline)


def test_a_client_cannot_overwrite_a_workers_row_over_rpc_or_its_own_stream(client, tmp_path):
    a, b = worker_addresses(client)
    rows = by_worker(client)
    before = rejected(client)  # also opens the shared client's pooled comm that the waits below reuse
    evil = dataclasses.replace(rows[a], broker=str(tmp_path / "client-broker.sock"))
    with rogue_client(client) as rogue:
        assert isinstance(rpc(rogue, "gpupool_register", record=evil.to_msg()), NotAMemberError)
        # The client's batched stream reaches the same stream handlers as workers' streams. Dask lets
        # a message's keys override the stream's own (worker=..., even client=None): all refused.
        assert rogue.scheduler_comm is not None
        for msg in (
            {"op": REGISTER_OP, "record": evil.to_msg()},
            {"op": REGISTER_OP, "worker": a, "record": evil.to_msg()},
            {"op": REGISTER_OP, "worker": a, "client": None, "record": evil.to_msg()},
            {"op": UPDATE_OP, "worker": a, "record": dataclasses.replace(rows[a], retire_below=7).to_msg()},
            {"op": UNREGISTER_OP, "worker": b, "pool": rows[b].pool},
        ):
            rogue._send_to_scheduler(msg)
        wait_rejected(client, before, {"rpc": 1, "client": 5})
        assert by_worker(rogue) == rows  # the client's stream still works, and nothing changed
    assert client.run(T.known_pools) == {w: sorted(r.pool for r in rows.values()) for w in rows}
    handoff_round_trip(client, MiB, b"the real broker")


def test_a_worker_cannot_register_update_or_unregister_another_workers_row(client):
    a, b = worker_addresses(client)
    rows = by_worker(client)
    before = rejected(client)
    theirs = dataclasses.replace(rows[a], broker="/tmp/not-the-broker.sock")
    made_up = dataclasses.replace(rows[b], pool=str(uuid.uuid4()), worker=MADE_UP)
    client.run(
        send_on_own_stream,
        [
            {"op": REGISTER_OP, "record": theirs.to_msg()},  # a row naming another worker
            {"op": REGISTER_OP, "record": made_up.to_msg()},  # ... or an address that is no worker
            {"op": REGISTER_OP, "record": dataclasses.replace(rows[b], worker=b, pool=rows[a].pool).to_msg()},
            {"op": UPDATE_OP, "record": dataclasses.replace(rows[a], retire_below=9).to_msg(), "key": OWN_KEY},
            {"op": UPDATE_OP, "record": dataclasses.replace(rows[b], broker="/tmp/x.sock").to_msg(), "key": OWN_KEY},
            {"op": UNREGISTER_OP, "pool": rows[a].pool, "key": OWN_KEY},
            {"op": REGISTER_OP, "record": {"pool": "not a row"}},
            {"op": UNREGISTER_OP, "pool": 12, "extra": True},
        ],
        workers=[b],
    )
    wait_rejected(client, before, {"another-worker": 5, "row-changed": 1, "malformed": 2})
    assert by_worker(client) == rows
    assert client.run(T.known_pools) == {w: sorted(r.pool for r in rows.values()) for w in rows}
    assert all(client.run(T.has_cluster_token).values())
    handoff_round_trip(client, MiB, b"rows untouched")


def test_a_worker_naming_another_worker_in_its_messages_changes_nothing_of_that_worker(client):
    """Dask lets a message's own keys override the ``worker=`` it adds for a worker's stream
    (``merge(extra, msg)``): a worker that puts another's address in its messages must not act as it.
    Here B, with its own registry key, raises A's ``retire_below``, re-registers A's row with another
    broker and joins it, and unregisters A's pool, each time naming A."""
    a, b = worker_addresses(client)
    rows = by_worker(client)
    evil = dataclasses.replace(rows[a], broker="/tmp/not-the-broker.sock")
    first = rejected(client)
    client.run(
        send_on_own_stream,
        [
            {"op": UPDATE_OP, "worker": a, "record": dataclasses.replace(rows[a], retire_below=5).to_msg()},
            {"op": UPDATE_OP, "worker": a, "record": rows[a].to_msg(), "key": OWN_KEY},
            {"op": REGISTER_OP, "worker": a, "record": evil.to_msg()},
            {"op": JOINED_OP, "worker": a, "pool": rows[a].pool},
            {"op": JOINED_OP, "worker": a, "record": evil.to_msg(), "key": OWN_KEY},
            {"op": UNREGISTER_OP, "worker": a, "pool": rows[a].pool},
            {"op": UNREGISTER_OP, "worker": a, "pool": rows[a].pool, "key": OWN_KEY},
        ],
        workers=[b],
    )
    # a message B sends after them on the same stream is handled after them: once it is refused, they were
    before = rejected(client)
    client.run(send_on_own_stream, [{"op": UNREGISTER_OP, "pool": 12, "key": OWN_KEY}], workers=[b])
    wait_rejected(client, before, {"malformed": 1})
    # without a key they are malformed, with B's own they are not A's: A's registration (which changes nothing)
    # went to A, which joined again with its own row
    more = {k: n - first.get(k, 0) for k, n in rejected(client).items() if n != first.get(k, 0)}
    assert more == {"malformed": 4, "not-its-key": 3}
    assert by_worker(client) == rows
    assert client.run(T.known_pools) == {w: sorted(r.pool for r in rows.values()) for w in rows}
    handoff_round_trip(client, MiB, b"still A's own row")  # B maps A's pool through A's broker; nothing leaks


def test_a_worker_joining_later_gets_its_membership_and_its_row_leaves_with_it(client, tmp_path):
    """A worker that joins a cluster already running the plugin sets the plugin up while it
    registers, before it reads its stream: it must neither block there nor be handed anything
    before it holds its Membership. Its row leaves with it."""
    a, b = worker_addresses(client)
    baseline = warm_up(client, a, b)
    rows = by_worker(client)
    cli = [sys.executable, "-m", "distributed.cli.dask_worker", client.scheduler.address, "--nthreads", "1"]
    logs = contextlib.ExitStack()
    log = logs.enter_context(open(tmp_path / "late-worker.log", "w"))
    procs = [subprocess.Popen([*cli, "--no-dashboard", "--name", "late"], stdout=subprocess.DEVNULL, stderr=log)]
    try:
        client.wait_for_workers(3, timeout=60)
        wait_for(lambda: len(dask_gpupool.pools(client)) == 3, timeout=60, what="the late worker's row")
        (late,) = set(by_worker(client)) - set(rows)
        assert client.run(T.has_cluster_token, workers=[late])[late]
        all_pools = sorted(r.pool for r in dask_gpupool.pools(client))
        wait_for(lambda: set(map(tuple, client.run(T.known_pools).values())) == {tuple(all_pools)}, what="views")
        for src, dst in ((a, late), (late, b)):
            x = client.submit(T.make_buffer, MiB, b"late joiner", workers=[src], pure=False)
            y = client.submit(T.keep, x, workers=[dst], pure=False)
            assert client.submit(T.describe, y, workers=[dst], pure=False).result()["imported"], (src, dst)
            assert client.submit(T.head, y, 11, workers=[dst], pure=False).result() == b"late joiner"
            del x, y
        wait_for(lambda: counters(client, a)[a]["leases"] == 0, what="A's lease to end")
    finally:
        stop_processes(procs)
        logs.close()
    wait_for(lambda: by_worker(client) == rows, timeout=60, what="the late worker's row to leave with it")
    wait_for(lambda: all(len(p) == 2 for p in client.run(T.known_pools).values()), what="views without it")
    back_to(client, baseline)
    assert os.path.exists(rows[a].broker) and os.path.exists(rows[b].broker)


def test_a_worker_updates_its_own_row_and_removing_the_plugin_takes_the_rows_out(client):
    """The accepted paths: a worker raises its own ``retire_below`` (what ``trim`` sends); the plugin
    removed from running workers takes their rows out over their own streams; registered again, every
    worker gets the new token and hands over zero-copy. Runs last: it replaces the module's plugin."""
    a, b = worker_addresses(client)
    rows = by_worker(client)
    raised = dataclasses.replace(rows[b], retire_below=3, reclaim=(4, 6))  # what trim / a full pool send
    client.run(send_on_own_stream, [{"op": UPDATE_OP, "record": raised.to_msg(), "key": OWN_KEY}], workers=[b])
    wait_for(lambda: by_worker(client)[b] == raised, what="the scheduler to take B's own update")

    def view_of_b(dask_worker: Any) -> int:
        row = dask_gpupool.dask.worker_plugin.service_of(dask_worker).registry.get(rows[b].pool)
        return -1 if row is None else row.retire_below

    wait_for(lambda: client.run(view_of_b, workers=[a])[a] == 3, what="A to learn B's update")
    client.unregister_worker_plugin("gpupool")
    wait_for(lambda: dask_gpupool.pools(client) == [], what="the rows to leave with the plugin")
    client.register_plugin(PLUGIN)  # a new scheduler plugin: a new token, every worker registers again
    new_rows = by_worker(client)
    assert set(new_rows) == {a, b} and not {r.pool for r in new_rows.values()} & {r.pool for r in rows.values()}
    assert all(client.run(T.has_cluster_token).values())
    handoff_round_trip(client, MiB, b"registered again")
    assert rejected(client) == {}  # the new plugin counts afresh, and refused nothing
