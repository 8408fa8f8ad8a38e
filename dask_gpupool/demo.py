"""``dask gpupool demo``: a local cluster with the plugin, and one buffer handed from a worker to another.

It uses GPUs when present: one worker per GPU with rotated
``CUDA_VISIBLE_DEVICES`` when there are several, two workers on one GPU when
there is one, and ``host`` pools (shared host memory) when there is none. A
task on the first worker allocates a buffer in its pool and writes a message;
a task on the second receives it through Dask as any task result, which the
plugin hands over in place, and reads it. Only the public API is used, as a
user's tasks would.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cuda.core import Buffer

__all__ = ["demo"]

_NBYTES = 1 << 20


def _write(message: bytes) -> Buffer:
    """Task: a buffer of this worker's pool holding ``message``."""
    import dask_gpupool
    from dask_gpupool.memory.buffers import copy_from_host

    buf = dask_gpupool.allocate(_NBYTES)
    copy_from_host(buf, message)
    return buf


def _read(buf: Buffer, nbytes: int) -> bytes:
    """Task: the first ``nbytes`` of a buffer, wherever its memory is."""
    from dask_gpupool.memory.buffers import copy_to_host

    return bytes(copy_to_host(buf, 0, nbytes))


def _worker_specs(n_gpus: int, workers: int) -> list[dict[str, Any]]:
    if n_gpus >= 2:
        order = list(range(n_gpus))
        return [{"env": {"CUDA_VISIBLE_DEVICES": ",".join(map(str, order[i:] + order[:i]))}} for i in range(n_gpus)]
    return [{} for _ in range(workers)]


def _local_cluster(specs: list[dict[str, Any]]) -> Any:
    """The demo's cluster (not started): a scheduler and one Nanny worker per entry of ``specs`` (extra options).

    Everything listens on 127.0.0.1 only, as a ``LocalCluster`` does: the scheduler, its dashboard, the nannies,
    the workers and their HTTP servers (on the host's outside interfaces, anyone who reaches the host could submit
    code to run).
    """
    from distributed import Nanny, Scheduler, SpecCluster

    loopback = {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"}
    workers = {
        f"worker-{i}": {"cls": Nanny, "options": {"nthreads": 1, "silence_logs": logging.WARNING, **loopback, **s}}
        for i, s in enumerate(specs)
    }
    scheduler = {"cls": Scheduler, "options": loopback}
    return SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.WARNING)


def demo(kind: str = "auto", workers: int = 2, max_size: str = "1 GiB") -> int:
    """Run the demo; 0 when the second worker read what the first wrote without a host copy, 2 when the workers
    cannot have the pools asked for (one line on stderr says why).
    """
    from distributed import Client

    import dask_gpupool
    from dask_gpupool.memory.topology import local_devices

    n_gpus = len(local_devices().uuids)
    if kind in ("device", "pinned") and not n_gpus:
        print(
            f"dask_gpupool demo: --kind {kind} needs a GPU and none is visible; use --kind host (or auto)",
            file=sys.stderr,
        )
        return 2
    specs = _worker_specs(n_gpus if kind in ("auto", "device", "pinned") else 0, workers)
    print(f"dask_gpupool demo: {n_gpus} GPU(s) visible; starting {len(specs)} Nanny workers, pool kind {kind!r}")
    cluster = _local_cluster(specs)
    with cluster, Client(cluster) as client:
        client.wait_for_workers(len(specs))
        try:
            client.register_plugin(dask_gpupool.GPUPool(kind=kind, max_size=max_size))
        except dask_gpupool.GPUPoolError as e:  # each worker's log above says why in one line
            print(
                f"dask_gpupool demo: the workers could not make their pools: {type(e).__name__}: {e}", file=sys.stderr
            )
            return 2
        rows = sorted(dask_gpupool.pools(client), key=lambda r: r.worker)
        print("\nRegistry (scheduler), one row per pool:")
        print(f"  {'pool':36}  {'worker':24} {'pid':>7}  {'kind':6}  {'max_size':>14}  device")
        for r in rows:
            print(f"  {r.pool:36}  {r.worker:24} {r.pid:>7}  {r.kind:6}  {r.max_size:>14,}  {r.device or '-'}")
        owner, peer = rows[0], rows[1]
        message = f"written by {owner.worker} into its {owner.kind} pool".encode()
        buf = client.submit(_write, message, workers=[owner.worker], pure=False)
        t0 = time.perf_counter()
        got = client.submit(_read, buf, len(message), workers=[peer.worker], pure=False).result()
        took = time.perf_counter() - t0
        received = dask_gpupool.stats(client)[peer.worker]
        print(f"\n{peer.worker} received {owner.worker}'s buffer as a task result and read:\n  {got.decode()!r}")
        print(
            f"  zero-copy bytes received: {received['zero_copy_bytes']:,}, copied: {received['copied_bytes']:,}"
            f"; that task took {took * 1e3:.1f} ms (the first handoff maps the peer's pool)"
        )
        stats = dask_gpupool.pool_stats(client)
        print("\nPool stats (from the pools' own attributes):")
        for w, s in sorted(stats.items()):
            print(
                f"  {w:24} used {s['used']:>10,}  high {s['used_high']:>10,}  "
                f"reserved {s['reserved']:>10,}  mapped peer pools {s['mapped_pools']}"
            )
        del buf
        ok = got == message and received["zero_copy_bytes"] >= _NBYTES  # read in place: never the host
    print("\nOK" if ok else "\nMISMATCH")
    return 0 if ok else 1
