"""Fault injection: stalls, hidden brokers, broken links (the lease tests, ``tests/handoff/test_leases.py``),
plugin installs held back (the registration tests, ``tests/dask/test_scheduler_plugin.py``), and routing sizes
other than the measured ones (:func:`route_sizes`)."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

from dask_gpupool.dask.worker_plugin import service_of

if TYPE_CHECKING:
    from distributed import Worker


def block_imports(seconds: float) -> None:
    """client.run target: hold this process's import lock from a thread for ``seconds``.

    A handoff arriving meanwhile stops inside the import, after the exporter
    granted its lease and before this worker claims it: the window in which
    a stalled consumer could lose its lease. The thread lets go by itself
    (the import may block this worker's event loop, so no later
    ``client.run`` could reach it).
    """
    from dask_gpupool.handoff.mapped_pool import IMPORT_LOCK

    held = threading.Event()

    def hold() -> None:
        with IMPORT_LOCK:
            held.set()
            threading.Event().wait(seconds)

    threading.Thread(target=hold, name="gpupool-test-block-imports", daemon=True).start()
    held.wait(10)


def route_sizes(
    dask_worker: Worker, stage: int | None = None, handoff: int | None = None, stream: int | None = None
) -> None:
    """client.run target: this worker's routing holds values against these sizes instead of
    :mod:`dask_gpupool.tuning`'s, for every pool kind: ``stage`` (plain arrays staged into the pool for same-host
    workers over TCP or TLS; a ``host`` pool then stages NumPy arrays), ``handoff`` (smaller pool buffers go to
    same-host workers as copies) and ``stream`` (the smallest copy pulled over the pipelined copy path). ``None``
    keeps that one. For tests and benchmarks that take a path at sizes the defaults route elsewhere; a restarted
    worker has the defaults again.
    """
    routes = service_of(dask_worker).routes
    if stage is not None:
        routes.stage_threshold_of = lambda kind, over_tcp: stage if over_tcp else 0
    if handoff is not None:
        routes.handoff_threshold_of = lambda kind: handoff
    if stream is not None:
        routes.stream_threshold = stream


def hide_broker(dask_worker: Worker) -> str:
    """client.run target: move this worker's broker socket aside (peers can no longer open a link); return the path."""
    service = service_of(dask_worker)
    os.rename(service.broker.address, service.broker.address + ".hidden")
    return service.broker.address


def restore_broker(dask_worker: Worker) -> None:
    """client.run target: undo :func:`hide_broker`."""
    service = service_of(dask_worker)
    os.rename(service.broker.address + ".hidden", service.broker.address)


def close_links(dask_worker: Worker) -> int:
    """client.run target: close this worker's links to exporters (as if each broke); return how many."""
    return service_of(dask_worker).importer.links.drop()


def stop_copy_server(dask_worker: Worker) -> None:
    """client.run target: close this worker's copy server (pulls from it then fail)."""
    service = service_of(dask_worker)
    assert service.copier is not None
    service.copier.close()


def forget_pool(pool: str, dask_worker: Worker) -> None:
    """client.run target: drop ``pool`` from this worker's copy of the registry (a stale or lying view)."""
    from dask_gpupool.wire.registry import RegistryUpdate

    registry = service_of(dask_worker).registry
    registry.apply(RegistryUpdate(version=registry.version, removed=(pool,)))


def report_failed_transfer(exporter: str, dask_worker: Worker) -> bool:
    """client.run target: tell ``exporter``'s broker, over this worker's link, that a transfer failed after its
    claims (what a fill that fails does, :func:`~dask_gpupool.handoff.deferred.run_fills`); whether it was sent."""
    importer = service_of(dask_worker).importer
    row = importer.registry.worker_row(exporter)
    if row is None:
        return False
    importer.links.link(row).transfer_failed()
    return True


async def get_data_without_ok(exporter: str, key: str, deserialize: bool, dask_worker: Worker) -> int:
    """client.run target: ask ``exporter`` for ``key`` as Dask's gather does, then abort instead of sending "OK".

    The exporter's reply fails after it was written: its leases, claimed by
    the reply, are in doubt until this worker answers the exporter's query. ``deserialize``: the value is deserialized
    (its lease held here) and kept (:func:`kept_head`, :func:`drop_kept`);
    otherwise its serialized form is kept, to deserialize later
    (:func:`deserialize_kept`). Returns the reply's frame count (0: no value).
    """
    from distributed.comm import connect

    from dask_gpupool.dask.comms import bind
    from dask_gpupool.handoff.deferred import SENDER

    comm = await connect(exporter, deserialize=deserialize, **dask_worker.connection_args)
    assert await bind(service_of(dask_worker), comm, exporter), "the comm is not bound"  # as the worker's own are
    token = SENDER.set(exporter)  # as the worker's own comms do (comms.read_then_fill)
    try:
        await comm.write({"op": "get_data", "keys": [key], "who": dask_worker.address, "reply": True})
        msg = await comm.read()
    finally:
        SENDER.reset(token)
        comm.abort()
    dask_worker._gpupool_kept = msg["data"][key]  # type: ignore[attr-defined]
    return len(msg["data"])


def kept_head(nbytes: int, dask_worker: Worker) -> bytes:
    """client.run target: the first ``nbytes`` of the value :func:`get_data_without_ok` kept deserialized."""
    from dask_gpupool.testing.tasks import head

    return head(dask_worker._gpupool_kept, nbytes)  # type: ignore[attr-defined]


def deserialize_kept(exporter: str, dask_worker: Worker) -> str:
    """client.run target: deserialize the value :func:`get_data_without_ok` kept serialized, as a reply read from
    ``exporter`` (so that a lease claimed by the reply would be held here); ``"Type: message"`` of the error, or
    ``""``. A value that deserializes is dropped at once.
    """
    from distributed.protocol import deserialize

    from dask_gpupool.handoff.deferred import SENDER

    kept = dask_worker._gpupool_kept  # type: ignore[attr-defined]
    token = SENDER.set(exporter)
    try:
        value = deserialize(kept.header, kept.frames)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        SENDER.reset(token)
        dask_worker._gpupool_kept = None  # type: ignore[attr-defined]
    del value
    return ""


def drop_kept(dask_worker: Worker) -> None:
    """client.run target: drop what :func:`get_data_without_ok` kept."""
    dask_worker._gpupool_kept = None  # type: ignore[attr-defined]


async def get_data_held_open(exporter: str, key: str, dask_worker: Worker) -> int:
    """client.run target: ask ``exporter`` for ``key`` as Dask's gather does, read the reply without deserializing
    it (no lease is claimed here), and keep the comm open without sending "OK": the exporter's reply waits until
    :func:`abort_held_reply`. Returns the reply's value count."""
    from distributed.comm import connect

    from dask_gpupool.dask.comms import bind

    comm = await connect(exporter, deserialize=False, **dask_worker.connection_args)
    assert await bind(service_of(dask_worker), comm, exporter), "the comm is not bound"  # as the worker's own are
    await comm.write({"op": "get_data", "keys": [key], "who": dask_worker.address, "reply": True})
    msg = await comm.read()
    dask_worker._gpupool_held_reply = comm  # type: ignore[attr-defined]
    return len(msg["data"])


def abort_held_reply(dask_worker: Worker) -> None:
    """client.run target: abort the comm :func:`get_data_held_open` kept: the exporter's reply fails there."""
    comm = dask_worker._gpupool_held_reply  # type: ignore[attr-defined]
    dask_worker._gpupool_held_reply = None  # type: ignore[attr-defined]
    comm.abort()


async def hold_plugin_add(held: str, until: str, timeout: float, dask_worker: Worker) -> None:
    """client.run target: order this worker's gpupool plugin installs, to force an interleaving of two registrations.

    The scheduler's ``plugin-add`` of a gpupool worker plugin whose ``max_size`` option is ``held`` waits here until
    one whose ``max_size`` is ``until`` has been installed (its ``plugin-add`` answered), or ``timeout`` seconds pass
    (a later registration that never comes while the held one's runs). What arrived, in order, is in
    :func:`plugin_adds`: ``"held <size>"`` when the held one starts waiting, ``"add <size>"`` when one is installed.
    Undone by :func:`release_plugin_add`, which also lets a held one go on at once.
    """
    import asyncio
    import contextlib

    from distributed.protocol.pickle import loads

    from dask_gpupool.core import PLUGIN_NAME

    original = dask_worker.handlers["plugin-add"]
    installed = asyncio.Event()
    seen: list[str] = []

    async def plugin_add(plugin: object, name: str | None = None, catch_errors: bool = True) -> object:
        if isinstance(plugin, bytes):
            plugin = loads(plugin)
        size = getattr(plugin, "overrides", {}).get("max_size") if name == PLUGIN_NAME else None
        if size == held and not installed.is_set():
            seen.append(f"held {size}")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(installed.wait(), timeout)
        seen.append(f"add {size}")
        try:
            return await original(plugin=plugin, name=name, catch_errors=catch_errors)
        finally:
            if size == until:
                installed.set()

    plugin_add.original = original  # type: ignore[attr-defined]
    plugin_add.seen = seen  # type: ignore[attr-defined]
    plugin_add.release = installed.set  # type: ignore[attr-defined]
    dask_worker.handlers["plugin-add"] = plugin_add


def plugin_adds(dask_worker: Worker) -> list[str]:
    """client.run target: the gpupool plugin installs :func:`hold_plugin_add` saw on this worker, in order."""
    return list(getattr(dask_worker.handlers["plugin-add"], "seen", []))


def release_plugin_add(dask_worker: Worker) -> None:
    """client.run target: undo :func:`hold_plugin_add`: a ``plugin-add`` held goes on at once, and the worker's own
    ``plugin-add`` handler answers from now on."""
    gate = dask_worker.handlers["plugin-add"]
    original = getattr(gate, "original", None)
    if original is not None:
        gate.release()  # type: ignore[attr-defined]
        dask_worker.handlers["plugin-add"] = original


def replay_import(key: str, sender: str, dask_worker: Worker) -> str:
    """client.run target: deserialize again the header this worker's import of ``key`` came with, as a message
    from ``sender`` (a member that sent it once, replaying it for another key) would carry it, and keep what it
    gives (:func:`drop_replayed`). ``"Type: message"`` of the error, or ``""``.
    """
    from cuda.core import Buffer
    from distributed.protocol import dask_deserialize

    from dask_gpupool.dask.dask_family import KEY
    from dask_gpupool.handoff.deferred import SENDER
    from dask_gpupool.wire.handoff import HandoffHeader

    service = service_of(dask_worker)
    value: Any = dask_worker.data[key]
    origin = value.memory_resource.origin
    row = service.registry.worker_row(origin.exporter)
    assert row is not None
    header = HandoffHeader(
        "ipc", row.kind, origin.desc.size, exporter=origin.exporter, desc=origin.desc, lease=origin.lease
    )
    token = SENDER.set(sender)
    try:
        dask_worker._gpupool_replayed = dask_deserialize.dispatch(Buffer)({KEY: header.to_msg()}, [])  # type: ignore[attr-defined]
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        SENDER.reset(token)
    return ""


def drop_replayed(dask_worker: Worker) -> None:
    """client.run target: drop what :func:`replay_import` kept (its import closes, and its lease is released)."""
    dask_worker._gpupool_replayed = None  # type: ignore[attr-defined]
