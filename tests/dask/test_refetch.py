"""A transfer that fails the same way again and again ends, on real Nanny workers on ``host`` pools.

Dask fetches a key again after a failed transfer (an ``OSError``, which every failure to receive a handed-over value
is raised as: :class:`~dask_gpupool.DataLostError`), and an honest exporter's retry succeeds (it sends copies). A
member whose every reply of a key fails (:class:`~dask_gpupool.testing.boundary.Unreceivable`) made the consumer
fetch forever. After a bounded number of failed fetches of one key from one worker, the tasks waiting for it err
with the ``DataLostError``, and the consumer lets the key go.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import back_to, counters, nanny_cluster, wait_for, wait_forgotten, warm_up, worker_addresses
from distributed import wait

from dask_gpupool import DataLostError, GPUPool
from dask_gpupool import testing as T
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
