"""The trust boundary with processes that are not workers, and with members that lie, on real Nanny workers.

A Dask client (no cluster token) speaks to workers over plain comms: it may ask for values and scatter values, as
Dask allows, and gets what Dask would give it. It never gets a lease, never makes a worker import or pull, and a
proof it captures is worth nothing. ``docs/security.md`` has the table.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
from conftest import counters, nanny_cluster, wait_for, warm_up, worker_addresses
from distributed.comm import connect
from distributed.protocol import Serialized, serialize

import dask_gpupool
from dask_gpupool import GPUPool, NotAMemberError, PoolExhaustedError
from dask_gpupool import testing as T
from dask_gpupool.dask.dask_family import KEY
from dask_gpupool.memory.buffers import host_buffer
from dask_gpupool.testing import boundary as B
from dask_gpupool.wire.handoff import LEASE_QUERY_OP

MiB = 1 << 20
PLUGIN = GPUPool(kind="host", max_size="64 MiB", broker_timeout="2s")


@pytest.fixture(scope="module")
def client():
    with nanny_cluster([{}, {}], PLUGIN) as c:
        yield c


async def get_data_as(worker: str, key: str, who: str) -> Serialized:
    """What a client gets for ``get_data(keys=[key], who=who)`` on ``worker``, read without deserializing, after it
    sent the "OK" (and once the worker settled the reply: its next answer on the comm comes after)."""
    comm = await connect(worker, deserialize=False)
    try:
        await comm.write({"op": "get_data", "keys": [key], "who": who, "reply": True})
        msg = await comm.read()
        await comm.write("OK")
        await comm.write({"op": "identity", "reply": True})
        await comm.read()
    finally:
        comm.abort()
    return msg["data"][key]


async def update_data(worker: str, key: str, header: dict[str, Any]) -> Any:
    """Scatter to ``worker``, as a client does (``update_data``), a Buffer whose handoff sub-header is ``header``;
    the reply, or the error."""
    dask_header, _frames = serialize(host_buffer(bytearray(8)), serializers=["dask"])
    crafted = Serialized({**dask_header, "sub-header": {KEY: header}}, [])
    comm = await connect(worker)
    try:
        await comm.write({"op": "update_data", "data": {key: crafted}, "reply": True})
        return await comm.read()
    except Exception as e:
        return e
    finally:
        comm.abort()


def holds(client: Any, worker: str, key: str) -> bool:
    def has(dask_worker: Any) -> bool:
        return key in dask_worker.data

    return client.run(has, workers=[worker])[worker]


def test_a_client_naming_a_worker_in_get_data_gets_no_lease(client):
    """A tokenless client's ``get_data(who=<B>)`` on A, answered "OK" without deserializing, gets copies: A counts
    no lease for B, which would never hold it, and its pool stays free."""
    a, b = worker_addresses(client)
    warm_up(client, a, b)
    x = client.submit(T.make_buffer, MiB, b"pinned?", workers=[a], pure=False)
    x.result()
    got = client.sync(get_data_as, a, x.key, b)
    sub = got.header["sub-header"][KEY]
    assert sub.get("path") != "ipc", sub  # what Dask would send a client: the bytes
    assert counters(client, a)[a]["leases"] == 0
    del x


def test_a_handoff_header_scattered_by_a_client_is_not_imported(client):
    """An IPC header of A's (learned by a client) scattered to B is refused: B maps nothing of A's memory under the
    client's key."""
    a, b = worker_addresses(client)
    x = client.submit(T.make_buffer, MiB, b"A's memory", workers=[a], pure=False)
    x.result()
    header = client.run(B.export_header, x.key, b, workers=[a])[a]
    imports = counters(client, b)[b]["imports"]
    try:
        client.sync(update_data, b, "scattered-ipc", header)
        assert not holds(client, b, "scattered-ipc")
        assert counters(client, b)[b]["imports"] == imports
    finally:
        client.run(B.revoke, [header["lease"]], workers=[a])
    del x


def _listener() -> tuple[socket.socket, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    return sock, f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def _connected(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def test_a_stream_header_scattered_by_a_client_makes_no_worker_connect_anywhere(client):
    """A ``stream`` header a client scatters to B, naming the client's own address, is refused: B connects nowhere
    and sends no pull proof that the client could replay to A's copy server."""
    a, b = worker_addresses(client)
    x = client.submit(T.make_buffer, MiB, b"streamed", workers=[a], pure=False)
    x.result()
    sock, address = _listener()
    header = client.run(B.stream_header, x.key, b, address, workers=[a])[a]
    try:
        client.sync(update_data, b, "scattered-stream", header)
        assert not holds(client, b, "scattered-stream")
        assert not _connected(sock), "B connected to the address a client's header named"
    finally:
        sock.close()
        client.run(B.revoke, [header["lease"], *header.get("lanes", [])], workers=[a])
    del x


def test_a_members_stream_header_is_pulled_only_from_the_exporters_own_copy_server(client):
    """A header in a member's reply names the copy server; the importer pulls from the exporter's registered one."""
    a, b = worker_addresses(client)
    x = client.submit(T.make_buffer, MiB, b"from A's server", workers=[a], pure=False)
    x.result()
    sock, address = _listener()
    header = client.run(B.stream_header, x.key, b, address, workers=[a])[a]
    try:
        error = client.run(B.read_as_reply_from, a, header, workers=[b])[b]
        assert not _connected(sock), "B pulled from the address the header named"
        assert error == "", error  # pulled from A's own copy server, under the lease A granted to B
    finally:
        sock.close()
        client.run(B.drop_read, workers=[b])
        client.run(B.revoke, [header["lease"], *header.get("lanes", [])], workers=[a])
    wait_for(lambda: counters(client, a)[a]["leases"] == 0, what="A's stream leases to end")
    del x


async def ask(worker: str, msg: dict[str, Any]) -> Any:
    """A client's plain RPC call to ``worker``: its reply."""
    comm = await connect(worker)
    try:
        await comm.write({**msg, "reply": True})
        return await comm.read()
    finally:
        comm.abort()


def test_a_client_asking_a_worker_about_leases_is_refused(client):
    """``gpupool_lease_query`` answers members only, about their own leases: a client confirms no lease id (nor
    floods a worker's remembered refusals with fake exporters)."""
    a, b = worker_addresses(client)
    broker_of_a = next(r.broker for r in dask_gpupool.pools(client) if r.worker == a)
    reply = client.sync(ask, b, {"op": LEASE_QUERY_OP, "exporter": broker_of_a, "leases": [1, 2]})
    assert isinstance(reply, dict) and reply.get("error") == NotAMemberError.__name__, reply


def test_one_peer_pins_at_most_half_a_pool_and_a_full_pool_names_who_holds_it(client):
    """A consumer holding the leases of many values (stalled, or keeping them) pins at most half the producer's
    pool; the rest go as copies (``peer-share``), the producer's own tasks allocate the other half, and a full pool's
    ``PoolExhaustedError`` names the peers' lease bytes."""
    a, b = worker_addresses(client)
    base = counters(client, a)[a]["fallbacks"].get("peer-share", 0)
    ys = []
    for _ in range(6):  # 48 MiB of A's 64 MiB pool, each value held by B alone once A forgot it
        x = client.submit(T.make_buffer, 8 * MiB, b"pinned", workers=[a], pure=False)
        ys.append(client.submit(T.keep, x, workers=[b], pure=False))
        ys[-1].result()
        del x
    try:
        assert counters(client, a)[a]["lease_bytes"] <= 32 * MiB  # the rest went as copies
        assert counters(client, a)[a]["fallbacks"].get("peer-share", 0) > base
        assert client.submit(B.allocate_in_task, 24 * MiB, workers=[a], pure=False).result() == 24 * MiB
        with pytest.raises(PoolExhaustedError, match=b):
            client.submit(B.allocate_in_task, 40 * MiB, workers=[a], pure=False).result()
        assert all(client.submit(T.head, y, 6, workers=[b], pure=False).result() == b"pinned" for y in ys)
    finally:
        del ys
    wait_for(lambda: counters(client, a)[a]["leases"] == 0, what="B's leases on A to end")
