"""``client.run`` targets that look into a worker: its fds, leases, mappings, counters and event loop."""

from __future__ import annotations

import collections
import os
from typing import TYPE_CHECKING, Any

from dask_gpupool.dask.worker_plugin import service_of
from dask_gpupool.testing.memory import held_count

if TYPE_CHECKING:
    from distributed import Worker


def workers(client: Any) -> dict[str, dict[str, Any]]:
    """The scheduler's worker records (address -> info), asked of the scheduler itself (client side, synchronous).

    Not ``client.scheduler_info()["workers"]``: in distributed 2026.8 that returns the client's cached identity
    after refreshing it, and the client's periodic refresh (which asks for no workers) can replace it in between:
    a GPU run saw a cluster of two registered workers listed as none. The scheduler lists every worker when asked
    without ``n_workers`` (its default, -1), which distributed before 2025.4 does not take.
    """
    return dict(client.sync(client.scheduler.identity)["workers"])


def open_fds() -> list[str]:
    """What every fd of this process points at, less Python source files.

    Python opens a ``.py`` file for a moment to read a line for a traceback or
    a warning (``linecache``), on whichever thread logs it; one such fd, on
    ``multiprocessing/process.py``, was caught open during a GPU machine's
    run and failed a leak check. This package never opens source files.
    """
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not target.endswith(".py"):
            out.append(target)
    return sorted(out)


def _fd_kind(target: str) -> str:
    """An fd's target without what differs between instances: ``socket:[123]`` -> ``socket``."""
    if target.startswith(("socket:", "pipe:")):
        return target.split(":", 1)[0]
    if target.startswith("/memfd:dask-gpupool"):
        return "/memfd:dask-gpupool"
    return target


def resources(dask_worker: Worker) -> dict[str, Any]:
    """client.run target: what this worker holds, to check that nothing leaked."""
    import gc

    service = service_of(dask_worker)
    gc.collect()
    service.importer.releaser.flush()
    kinds = collections.Counter(_fd_kind(f) for f in open_fds())
    return {
        "fds": sum(kinds.values()),
        "fd_kinds": dict(kinds),
        "sockets": kinds["socket"],
        "memfds": kinds["/memfd:dask-gpupool"],
        "broker_connections": service.broker.connections,
        "mapped_pools": len(service.importer.mapped),
        "used": service.pool.stats().used,
        "held": held_count(),
        "leases": len(service.leases),
        "imports_held": service.importer.held.live(),
        "pulls": 0 if service.copier is None else service.copier.transfers,
    }


def deserialize_headers(headers: list[dict[str, Any]], dask_worker: Worker) -> list[dict[str, Any]]:
    """client.run target (fuzzing): feed handoff headers to this worker's Buffer deserializer, each as read from a
    ``get_data`` reply of the worker it names (``exporter``) on a bound comm.

    Per header: the error it raised (``None`` if it gave a Buffer, which is
    closed at once), whether that error is one of ours, and which pools it
    newly mapped. Mappings made here are closed again at the end.
    """
    from cuda.core import Buffer
    from distributed.protocol import dask_deserialize

    from dask_gpupool.dask.dask_family import KEY
    from dask_gpupool.errors import GPUPoolError
    from dask_gpupool.handoff.deferred import SENDER

    service = service_of(dask_worker)
    loads = dask_deserialize.dispatch(Buffer)
    out = []
    mapped_here: set[str] = set()
    for header in headers:
        before = {r.pool for r in service.registry.records() if r.pool in service.importer.mapped}
        error, typed = None, False
        exporter = header.get("exporter") if isinstance(header, dict) else None
        token = SENDER.set(exporter if isinstance(exporter, str) and exporter else "tcp://fuzzer:1")
        try:
            loads({KEY: header}, [])
        except GPUPoolError as e:
            error, typed = f"{type(e).__name__}: {e}", True
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        finally:
            SENDER.reset(token)
        after = {r.pool for r in service.registry.records() if r.pool in service.importer.mapped}
        mapped_here |= after - before
        out.append({"error": error, "typed": typed, "mapped_new": sorted(after - before)})
    import gc

    gc.collect()
    service.importer.releaser.flush()
    for pool in mapped_here:
        mapped = service.importer.mapped.get(pool)
        if mapped is not None and mapped.imports == 0:
            service.importer.mapped.unmap(pool)
    return out


def grant_unclaimed_lease(key: str, importer: str, dask_worker: Worker) -> int:
    """client.run target: grant ``importer`` a lease on this worker's value of ``key``, as an export would."""
    from dask_gpupool.handoff.exporter import Exported

    buf: Any = dask_worker.data[key]
    return service_of(dask_worker).leases.grant(Exported(buf, buf), int(buf.size), importer)


def last_transfer(dask_worker: Worker, key: str) -> float | None:
    """client.run target (benchmarks): duration of this worker's latest incoming transfer that carried ``key``.

    ``stop - start`` of the log entry, not its ``duration``: distributed 2026.8 clamps ``duration`` to at least
    1 ms (``max(0.001, stop - start)``, for its bandwidth estimate), which hid every transfer under 1 ms.
    """
    for entry in reversed(dask_worker.transfer_incoming_log):
        if key in entry.get("keys", {}):
            return float(entry["stop"] - entry["start"])
    return None


def has_cluster_token(dask_worker: Worker) -> bool:
    """client.run target: whether this worker got the cluster's membership token (not the token itself)."""
    return service_of(dask_worker).importer.links.token is not None


def mapped_segments(dask_worker: Worker) -> int:
    """client.run target: segments of peers' pools this worker keeps mapped."""
    service = service_of(dask_worker)
    total = 0
    for r in service.registry.records():
        mapped = service.importer.mapped.get(r.pool)
        total += mapped.segments if mapped is not None else 0
    return total


def segment_memory(dask_worker: Worker) -> dict[str, str]:
    """client.run target: what this worker's pool makes segments of, as the pool and its registry row say, and as
    this worker's registry copy says of every pool (by worker address)."""
    service = service_of(dask_worker)
    rows = {r.worker: r.segment_memory for r in service.registry.records()}
    return {"pool": service.pool.segment_memory, "row": service.record.segment_memory, **rows}


def known_pools(dask_worker: Worker) -> list[str]:
    """client.run target: the pools in this worker's copy of the registry."""
    return sorted(r.pool for r in service_of(dask_worker).registry.records())


def leased_heads(nbytes: int, dask_worker: Worker) -> list[bytes]:
    """client.run target: the first ``nbytes`` of each buffer this worker's leases keep alive (host pools)."""
    from dask_gpupool.testing.memory import read_bytes

    leases = service_of(dask_worker).leases
    with leases._lock:
        buffers = [getattr(lease.holder, "buf", lease.holder) for lease in leases._leases.values()]  # Exported
    return [read_bytes(b, nbytes) for b in buffers]


def task_events_recorded(dask_worker: Worker) -> int | None:
    """client.run target: how many task results hold a staging event, ``None`` when the plugin records none."""
    from dask_gpupool.dask.worker_plugin import PLUGIN_NAME

    events = getattr(dask_worker.plugins[PLUGIN_NAME], "_task_events", None)
    return None if events is None else len(events)


def handoff_counters(dask_worker: Worker) -> dict[str, Any]:
    """client.run target: handoff counters plus pool bytes."""
    service = service_of(dask_worker)
    import gc

    gc.collect()
    service.importer.releaser.flush()
    return {**service.handoff_stats(), "used": service.pool.stats().used}


def serialized_inline(keys: list[str], who: str, dask_worker: Worker, scheme: str = "tcp") -> bool:
    """client.run target: whether a ``get_data`` for ``keys`` from ``who`` over a ``scheme`` comm skips Dask's
    offload thread."""
    from dask_gpupool.dask.distributed_seam.workers import DaskWorkerStore
    from dask_gpupool.dask.replies import Replies

    return Replies(service_of(dask_worker), DaskWorkerStore(dask_worker), dask_worker.rpc).inline(keys, who, scheme)


def lease_counts(dask_worker: Worker) -> dict[str, int]:
    """client.run target: live, unclaimed and held-import counts of this worker's leases."""
    service = service_of(dask_worker)
    import gc

    gc.collect()
    service.importer.releaser.flush()
    return {
        "leases": len(service.leases),
        "unclaimed": service.leases.unclaimed,
        "in_doubt": service.leases.doubtful,
        "held": service.importer.held.live(),
        "resyncs": service.importer.releaser.resyncs,
    }


def broker_barrier(dask_worker: Worker) -> None:
    """client.run target: one round trip to this worker's own broker (a request for a pool it does not serve, which
    it refuses), answered on the broker's thread after everything queued there before it: a departed importer's
    watch, say."""
    import uuid

    from dask_gpupool.errors import UnknownPoolError
    from dask_gpupool.transport.link import request_pool_fd

    broker = service_of(dask_worker).broker
    assert broker.token is not None, "the worker has no cluster token yet"
    try:
        _reply, fd = request_pool_fd(broker.address, str(uuid.uuid4()), 10.0, broker.token)
    except UnknownPoolError:
        return
    os.close(fd)
    raise AssertionError("the broker served a pool it does not have")


def settles_waiting(dask_worker: Worker) -> int:
    """client.run target: forwarded leases whose settle this worker could not send, kept until a link to their
    exporter opens again (:meth:`~dask_gpupool.handoff.imported.Releaser.settle_later`)."""
    releaser = service_of(dask_worker).importer.releaser
    with releaser._cond:
        return sum(len(entry.settled) for entry in releaser._retry.values())


async def start_loop_ticks(dask_worker: Worker, interval: float = 0.01) -> None:
    """client.run target: tick on this worker's event loop every ``interval`` s, noting the longest gap."""
    import asyncio
    import time

    gaps = {"longest": 0.0, "ticks": 0}

    async def tick() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            gaps["longest"] = max(gaps["longest"], now - last)
            gaps["ticks"] += 1
            last = now

    dask_worker._gpupool_test_ticks = gaps  # type: ignore[attr-defined]
    dask_worker._gpupool_test_ticker = asyncio.ensure_future(tick())  # type: ignore[attr-defined]


async def stop_loop_ticks(dask_worker: Worker) -> dict[str, float]:
    """client.run target: stop :func:`start_loop_ticks`; the longest gap between ticks (s) and their count."""
    dask_worker._gpupool_test_ticker.cancel()  # type: ignore[attr-defined]
    return dict(dask_worker._gpupool_test_ticks)  # type: ignore[attr-defined]


def _socket_table() -> dict[str, str]:
    """inode -> ``"tcp <local> <remote> <state>"`` or ``"unix <path>"`` from ``/proc/net`` (this net namespace)."""
    table: dict[str, str] = {}
    states = {"01": "ESTABLISHED", "0A": "LISTEN", "06": "TIME_WAIT", "08": "CLOSE_WAIT", "04": "FIN_WAIT1"}
    for name in ("tcp", "tcp6"):
        try:
            lines = open(f"/proc/net/{name}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            local, remote = (int(x.split(":")[1], 16) for x in (f[1], f[2]))
            table[f[9]] = f"tcp :{local} :{remote} {states.get(f[3], f[3])}"
    try:
        for line in open("/proc/net/unix").read().splitlines()[1:]:
            f = line.split()
            table[f[6]] = f"unix {f[7] if len(f) > 7 else '(unnamed)'}"
    except OSError:
        pass
    return table


def socket_peers(roles: dict[int, str], dask_worker: Worker) -> list[str]:
    """client.run target (leak hunts): this worker's sockets, each as what it connects, ports named by role.

    ``roles`` names TCP ports (the caller's view of the cluster: ``{port:
    "worker:w1"}``, nannies, the scheduler); this worker's own port reads as
    ``worker:self``, its copy server's as ``copy-server``, others as
    ``ephemeral``. A Unix socket reads as its path's last part (the brokers'
    sockets) or ``(unnamed)``.
    """
    from urllib.parse import urlsplit

    roles = dict(roles)
    roles[urlsplit(dask_worker.address).port or 0] = "worker:self"
    service = service_of(dask_worker)
    if service.copier is not None:
        roles[urlsplit(service.copier.address).port or 0] = "copy-server"
    table = _socket_table()
    out = []
    for target in open_fds():
        if not target.startswith("socket:["):
            continue
        desc = table.get(target[8:-1], "socket (not in /proc/net)")
        if desc.startswith("tcp "):
            _, local, remote, state = desc.split()
            lport, rport = int(local[1:]), int(remote[1:])
            desc = f"tcp {roles.get(lport, 'ephemeral')} -> {roles.get(rport, 'ephemeral' if rport else '-')} {state}"
        elif desc.startswith("unix "):
            desc = "unix " + desc.split()[1].rsplit("/", 1)[-1]
        out.append(desc)
    return sorted(out)


def vkgdr_unavailable(dask_worker: Worker) -> str | None:
    """client.run target: why vkgdr cannot land copies on this worker's GPU (``None``: it can)."""
    from dask_gpupool.transport.vkgdr_staging import VKGDR

    service = service_of(dask_worker)
    if service.pool.device is None:
        return "the pool is not on a GPU"
    return VKGDR.unavailable(service.pool.device)


def vkgdr_kept_bytes() -> int:
    """client.run target: bytes of vkgdr landing slots this process keeps for its next pull."""
    from dask_gpupool.transport.vkgdr_staging import VKGDR

    return VKGDR.nbytes


def spilled_bytes(dask_worker: Worker) -> dict[str, int]:
    """The bytes each key spilled to disk takes there (distributed's ``SpillBuffer``)."""
    slow = dask_worker.data._slow_uncached  # type: ignore[attr-defined]
    return {str(k): int(w.disk) for k, w in slow.weight_by_key.items()}
