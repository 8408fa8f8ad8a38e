"""``python -m dask_gpupool demo``: a local cluster with the plugin, its registry, and a peer mapping a pool.

Uses GPUs when present: one worker per GPU with rotated ``CUDA_VISIBLE_DEVICES``
when there are several, two workers on one GPU when there is one, and
``host`` pools (shared host memory) when there is none.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any


def _worker_specs(n_gpus: int, workers: int) -> list[dict[str, Any]]:
    if n_gpus >= 2:
        order = list(range(n_gpus))
        return [{"env": {"CUDA_VISIBLE_DEVICES": ",".join(map(str, order[i:] + order[:i]))}} for i in range(n_gpus)]
    return [{} for _ in range(workers)]


def demo(kind: str, workers: int, max_size: str) -> int:
    from distributed import Client, Nanny, Scheduler, SpecCluster

    import dask_gpupool
    from dask_gpupool import _testing as T
    from dask_gpupool._topology import local_devices

    n_gpus = len(local_devices().uuids)
    specs = _worker_specs(n_gpus if kind in ("auto", "device", "pinned") else 0, workers)
    print(f"dask_gpupool demo: {n_gpus} GPU(s) visible; starting {len(specs)} Nanny workers, pool kind {kind!r}")
    cluster_workers = {
        f"worker-{i}": {
            "cls": Nanny,
            "options": {"nthreads": 1, "dashboard_address": None, "silence_logs": logging.WARNING, **s},
        }
        for i, s in enumerate(specs)
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    cluster = SpecCluster(workers=cluster_workers, scheduler=scheduler, silence_logs=logging.WARNING)
    with cluster, Client(cluster) as client:
        client.wait_for_workers(len(specs))
        client.register_plugin(dask_gpupool.GPUPool(kind=kind, max_size=max_size))
        rows = sorted(dask_gpupool.pools(client), key=lambda r: r.worker)
        print("\nRegistry (scheduler), one row per pool:")
        print(f"  {'pool':36}  {'worker':24} {'pid':>7}  {'kind':6}  {'max_size':>14}  device")
        for r in rows:
            print(f"  {r.pool:36}  {r.worker:24} {r.pid:>7}  {r.kind:6}  {r.max_size:>14,}  {r.device or '-'}")
        owner, peer = rows[0], rows[1]
        message = f"written by {owner.worker} into its {owner.kind} pool".encode()
        desc = client.submit(T.hold, "demo", 1 << 20, message, workers=[owner.worker], pure=False).result()
        t0 = time.perf_counter()
        got = client.submit(T.read_peer, desc, len(message), workers=[peer.worker], pure=False).result()
        took = time.perf_counter() - t0
        print(f"\n{peer.worker} mapped pool {owner.pool[:8]}… (fd over the broker) and read:\n  {got.decode()!r}")
        print(f"  round trip of that task: {took * 1e3:.1f} ms (includes mapping the pool the first time)")
        stats = dask_gpupool.pool_stats(client)
        print("\nPool stats (from the pools' own attributes):")
        for w, s in sorted(stats.items()):
            print(
                f"  {w:24} used {s['used']:>10,}  high {s['used_high']:>10,}  "
                f"reserved {s['reserved']:>10,}  mapped peer pools {s['mapped_pools']}"
            )
        client.submit(T.release, "demo", workers=[owner.worker], pure=False).result()
        ok = got == message
    print("\nOK" if ok else "\nMISMATCH")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dask_gpupool")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="start a local cluster with the plugin and show a peer mapping a pool")
    d.add_argument("--kind", default="auto", choices=["auto", "device", "pinned", "host"])
    d.add_argument("--workers", type=int, default=2, help="workers when there are fewer than two GPUs")
    d.add_argument("--max-size", default="1 GiB")
    args = parser.parse_args(argv)
    if args.command == "demo":
        sys.exit(demo(args.kind, max(2, args.workers), args.max_size))
