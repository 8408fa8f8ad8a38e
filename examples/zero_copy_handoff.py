"""Zero-copy handoff between two Dask workers of one host, end to end.

    python examples/zero_copy_handoff.py

A task on worker A writes an array into A's pool (``dask_gpupool.allocate`` +
``dask_gpupool.as_array``); a task pinned to worker B consumes it. B maps A's
memory instead of receiving a copy: the script shows that a write A makes
afterwards is visible to B, and prints both workers' handoff stats.

Uses the GPU when there is one (CuPy arrays in ``device`` pools, both workers
on GPU 0; handoffs between GPUs with peer access are zero-copy too), shared
host memory otherwise (NumPy
arrays in ``host`` pools), with no change to the code below.
"""

from __future__ import annotations

import logging
import os

import dask

import dask_gpupool

N = 1 << 24  # float64 elements: 128 MiB


def produce(n: int):
    """On A: an array in A's pool (CuPy on GPUs, NumPy on host memory)."""
    buf = dask_gpupool.allocate(n * 8)
    arr = dask_gpupool.as_array(buf, (n,), "f8")
    arr[...] = 1.0
    return arr


def set_first(arr, value: float) -> None:
    """On A: change A's own array after B got it."""
    arr[0] = value


def consume(arr) -> tuple[float, float]:
    """On B: read the array it was handed (its first element and its sum)."""
    return float(arr[0]), float(arr.sum())


def local_cluster():
    """Two Nanny workers, both on GPU 0 when there is one (ordinal 0 of what they see), and a scheduler, listening
    on 127.0.0.1 only (dashboards included), as a ``LocalCluster`` does."""
    from distributed import Nanny, Scheduler, SpecCluster

    loopback = {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"}
    envs: list[dict[str, str]] = [{}, {}]
    workers = {
        f"w{i}": {"cls": Nanny, "options": {"nthreads": 1, "env": env, "silence_logs": logging.WARNING, **loopback}}
        for i, env in enumerate(envs)
    }
    scheduler = {"cls": Scheduler, "options": loopback}
    return SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.WARNING)


def main() -> None:
    from distributed import Client

    from dask_gpupool.memory.topology import local_devices

    gpus = len(local_devices().uuids)
    # The demo writes into A's copy of a result after B got it. Dask treats results as immutable,
    # and its Active Memory Manager may drop A's replica (A would then fetch B's back as a copy):
    # its timer is off here so that A keeps its own.
    amm_off = dask.config.set({"distributed.scheduler.active-memory-manager.start": False})
    with amm_off, local_cluster() as cluster:
        with Client(cluster) as client:
            client.wait_for_workers(2)
            client.register_plugin(dask_gpupool.GPUPool(max_size="1 GiB"))
            a, b = sorted(client.run(os.getpid))  # the two workers' addresses (client.run answers per worker)
            kind = {r.worker: r.kind for r in dask_gpupool.pools(client)}[a]
            print(f"{gpus} GPU(s) visible; pools are {kind!r}; A = {a}, B = {b}")

            arr = client.submit(produce, N, workers=[a], pure=False)
            first, total = client.submit(consume, arr, workers=[b], pure=False).result()
            print(f"B read the {N * 8 >> 20} MiB array: arr[0] = {first}, sum = {total:.0f}")
            client.submit(set_first, arr, 42.0, workers=[a], pure=False).result()
            first, _ = client.submit(consume, arr, workers=[b], pure=False).result()
            print(f"A set arr[0] = 42 in its own memory; B now reads arr[0] = {first} (B maps A's memory)")

            stats = dask_gpupool.stats(client)
            for who, name in ((a, "A"), (b, "B")):
                s = stats[who]
                print(
                    f"  {name}: exports {s['exports']}, imports {s['imports']}, live leases {s['leases']} "
                    f"({s['lease_bytes']:,} bytes), zero-copy in {s['zero_copy_bytes']:,} bytes, "
                    f"copied in {s['copied_bytes']:,} bytes, fallbacks {s['fallbacks'] or 'none'}"
                )
            assert stats[b]["copied_bytes"] == 0 and first == 42.0
            print("OK")


if __name__ == "__main__":
    main()
