"""A transfer that fails the same way again and again ends, on real Nanny workers on ``host`` pools.

Dask fetches a key again after a failed transfer (an ``OSError``, which every failure to receive a handed-over value
is raised as: :class:`~dask_gpupool.DataLostError`), and an honest exporter's retry succeeds (it sends copies). A
member whose every reply of a key fails (:class:`~dask_gpupool.testing.boundary.Unreceivable`) made the consumer
fetch forever. After a bounded number of failed fetches of one key from one worker, the tasks waiting for it err
with the ``DataLostError``, and the consumer lets the key go.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from conftest import back_to, counters, nanny_cluster, wait_for, wait_forgotten, warm_up, worker_addresses
from distributed import wait

from dask_gpupool import DataLostError, GPUPool
from dask_gpupool import testing as T
from dask_gpupool.dask.comms import LOST_OP, REFETCH_BOUND, FailedFetches
from dask_gpupool.testing import boundary as B

MiB = 1 << 20
PLUGIN = GPUPool(kind="host", max_size="64 MiB", broker_timeout="2s")
#: Seconds the dependent may take to err: the bound is a few fetches, each retried within about a second.
BOUNDED = 30


@pytest.fixture(scope="module")
def client():
    with nanny_cluster([{}, {}], PLUGIN) as c:
        yield c


def knows(client: Any, worker: str, key: Any) -> bool:
    """Whether ``worker``'s state machine still has ``key`` (fetching it, or holding it)."""

    def has(dask_worker: Any) -> bool:
        return key in dask_worker.state.tasks

    return client.run(has, workers=[worker])[worker]


def test_a_members_result_that_fails_every_receive_errs_its_dependent_with_the_cause(client):
    """Finding: a member's crafted task result made Dask refetch forever, each fetch failing with a typed
    ``DataLostError``, about four a second, and the dependent task never finished."""
    a, b = worker_addresses(client)
    baseline = warm_up(client, a, b)
    x = client.submit(B.unreceivable, MiB, workers=[a], pure=False)
    wait(x)  # computed on A; the client never fetches it
    y = client.submit(T.keep, x, workers=[b], pure=False)
    with pytest.raises(DataLostError, match=a):
        y.result(timeout=BOUNDED)
    key = x.key
    wait_for(lambda: not knows(client, b, key), what="B to let the key it could not receive go")
    # another task needing the key errs the same way, within the bound again
    z = client.submit(T.keep, x, workers=[b], pure=False)
    with pytest.raises(DataLostError, match=a):
        z.result(timeout=BOUNDED)
    keys = [x.key, y.key, z.key]
    del x, y, z
    wait_forgotten(client, keys)
    wait_for(lambda: not any(knows(client, w, k) for w in (a, b) for k in keys), what="the workers to forget")
    wait_for(lambda: counters(client, a)[a]["leases"] == 0, what="A's leases to end")
    # B still takes A's values (a comm whose read failed was aborted: Dask opens another), and nothing leaked
    warm_up(client, a, b)
    back_to(client, baseline)


def test_failed_fetches_count_per_sender_and_key_in_a_row_and_report_at_the_bound():
    """Below the bound Dask's own retry stands (an honest exporter's next reply carries copies); a key that came starts
    its count again; at the bound the key is reported once, and its count starts again."""
    reports: list[tuple[Any, str, str]] = []
    fetches = FailedFetches(lambda key, sender, error: reports.append((key, sender, error)))
    lost = DataLostError("a value from worker tcp://a:1 could not be received")
    for _ in range(REFETCH_BOUND - 1):
        fetches.failed("tcp://a:1", ["x", ("y", 0)], lost)
    fetches.failed("tcp://b:1", ["x"], lost)  # another sender counts on its own
    assert reports == []
    fetches.received("tcp://a:1", [("y", 0)])
    fetches.failed("tcp://a:1", ["x", ("y", 0)], lost)
    assert reports == [("x", "tcp://a:1", f"DataLostError: {lost}")]
    assert len(fetches) == 2  # ("y", 0) from a, once; x from b, once
    for _ in range(REFETCH_BOUND - 1):
        fetches.failed("tcp://a:1", ["x"], lost)
    assert len(reports) == 1  # counted from the start again


def test_a_comms_reads_of_get_data_replies_tell_the_workers_failed_fetches():
    """Each comm (a new one after a failed read: it is aborted) notes the keys its ``get_data`` request asked for;
    its read's ``DataLostError`` counts for them, an ``"OK"`` reply clears the keys it carries; other errors and other
    messages count nothing."""
    import asyncio

    from distributed.comm import CommClosedError, connect, listen

    from dask_gpupool.dask.comms import count_failures, read_then_fill, requests_noted

    reports: list[Any] = []
    fetches = FailedFetches(lambda key, sender, error: reports.append(key))
    lost = DataLostError("could not be received")
    outcomes: list[Any] = [
        lost,
        CommClosedError("not a failed fetch"),
        {"status": "OK", "data": {"y": 1}},  # x missing from the reply: not counted as received
        lost,
        {"status": "OK", "data": {"x": 1, "y": 1}},
        lost,
        lost,
        lost,
    ]

    async def read(deserializers: Any = None) -> Any:
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def fetch(address: str) -> None:
        comm = await connect(address)
        try:
            comm.write = requests_noted(comm, comm.write)
            count_failures(comm, fetches)
            await comm.write({"op": "get_data", "keys": ("x", "y"), "who": "tcp://me:1"})
            await read_then_fill(comm, read, "tcp://sender:1")()
        except (DataLostError, CommClosedError):
            pass
        finally:
            comm.abort()

    async def main() -> list[int]:
        async def serve(comm: Any) -> None:
            with contextlib.suppress(CommClosedError):
                while True:
                    await comm.read()

        listener = await listen("inproc://", serve)
        counted = []
        try:
            while outcomes:
                await fetch(listener.contact_address)
                counted.append(len(fetches))
        finally:
            listener.stop()
        return counted

    counted = asyncio.run(main())
    assert counted == [2, 2, 1, 2, 0, 2, 2, 0]
    assert reports == ["x", "y"]


def rejected(client: Any) -> dict[str, int]:
    """The scheduler plugin's count of refused messages, by reason (test inspection only)."""

    def get(dask_scheduler: Any) -> dict[str, int]:
        return dict(dask_scheduler.plugins["gpupool"].rejected)

    return client.run_on_scheduler(get)


def send_lost(msgs: list[dict[str, Any]], dask_worker: Any) -> None:
    """client.run target: send ``msgs`` (``gpupool-lost``) over this worker's stream, with its own registry key
    where a message has ``key=True``."""
    from dask_gpupool.dask.worker_plugin import service_of

    key = service_of(dask_worker).registry_key
    for m in msgs:
        dask_worker.batched_stream.send({"op": LOST_OP, **m, **({"key": key} if m.get("key") is True else {})})


def test_a_lost_report_errs_only_the_reporting_workers_tasks_and_a_bad_one_is_refused(client):
    """``gpupool-lost`` is taken only from a worker's own stream with its own registry key (naming another worker in
    it is refused), and a report of a key in no task, or of a key that is no key, changes nothing and ends no
    stream."""
    a, b = worker_addresses(client)
    before = rejected(client)
    fields = {"task": "no-such-key", "sender": a, "error": "lost"}
    client.run(
        send_lost,
        [
            {**fields, "worker": a, "key": True},  # in A's name, with B's key
            {**fields},  # no key
            {**fields, "sender": 5, "key": True},
            {**fields, "key": True},  # B's own: no such task, nothing to err
            {**fields, "task": {"not": "a key"}, "key": True},
        ],
        workers=[b],
    )
    client.run(send_lost, [{"task": 1, "key": True}], workers=[b])  # handled after the others: missing fields

    def counted() -> bool:
        now = rejected(client)
        return now.get("malformed", 0) >= before.get("malformed", 0) + 3

    wait_for(counted, what="the scheduler to refuse the malformed reports")
    more = {k: n - before.get(k, 0) for k, n in rejected(client).items() if n != before.get(k, 0)}
    assert more == {"not-its-key": 1, "malformed": 3}
    x = client.submit(T.make_buffer, MiB, b"still served", workers=[a], pure=False)
    assert client.submit(T.head, x, 12, workers=[b], pure=False).result() == b"still served"  # B's stream is fine
