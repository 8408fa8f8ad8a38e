"""Handoff latency while the producer's GPU is busy with another stream's kernels (stream order).

With ``gpupool.handoff-ordering: device`` an exporter synchronizes its whole GPU before a descriptor goes out, so a
handoff waits for every kernel the producer's process has queued, on any stream. With ``sync`` (the default) it waits
for the event recorded when Dask stored the task's result: kernels of other streams are waited for by ``device``
only. This runs the handoff benchmark's pool-array handoff (two workers, one GPU or two) with and without a
background thread on the producer that keeps a non-blocking stream busy with ``--spin-ms`` kernels, for each
ordering; median of ``--repeats`` after a warm-up. Needs a GPU and CuPy. JSON to ``benchmarks/results/`` (and
``$OUT``).

    python benchmarks/busy_producer.py [--sizes 1MiB,64MiB] [--spin-ms 20] [--repeats 7] [--orderings sync,device]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

from dask.utils import parse_bytes

sys.path.insert(0, os.path.dirname(__file__))
import handoff as H  # benchmarks/handoff.py: its cluster and measurement

from dask_gpupool import GPUPool


def busy(spin_ms: float, on: bool, dask_worker: Any = None) -> None:
    """client.run target: start (``on``) or stop a thread that keeps a non-blocking stream of this GPU busy."""
    if not on:
        stop = getattr(dask_worker, "_gpupool_busy", None)
        if stop is not None:
            stop.set()
        return
    import cupy

    from dask_gpupool.testing.tasks import spin

    stop = threading.Event()
    dask_worker._gpupool_busy = stop

    def loop() -> None:
        with cupy.cuda.Device(0):
            stream = cupy.cuda.Stream(non_blocking=True)
            while not stop.is_set():
                with stream:  # spins, writes nothing
                    spin(spin_ms)
                stream.synchronize()

    threading.Thread(target=loop, name="gpupool-bench-busy", daemon=True).start()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1MiB,64MiB")
    p.add_argument("--spin-ms", type=float, default=20.0)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--placements", default="same,other")
    p.add_argument("--orderings", default="sync,device", help="gpupool.handoff-ordering values, in this order")
    args = p.parse_args()
    places = H.gpu_placements(args.placements)
    sizes = [int(parse_bytes(s)) for s in args.sizes.split(",")]
    orderings = args.orderings.split(",")
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + 3600
    for place, workers in places.items():
        for ordering in orderings:
            plugin = GPUPool(kind="device", max_size="4 GiB", handoff_ordering=ordering)
            with H.cluster(workers, "tcp", plugin) as c:
                a = sorted(c.scheduler_info()["workers"], key=lambda w: str(c.scheduler_info()["workers"][w]["name"]))[
                    0
                ]
                for load in ("idle", "busy"):
                    if load == "busy":
                        c.run(busy, args.spin_ms, True, workers=[a])
                    got: list[dict[str, Any]] = []
                    H.measure(c, sizes, args.repeats, "cupy", True, deadline, print, True, got, lambda: None)
                    if load == "busy":
                        c.run(busy, args.spin_ms, False, workers=[a])
                    for r in got:
                        rows.append({"placement": place, "ordering": ordering, "load": load, **r})
    print(f"consumer transfer time, median of {args.repeats} (ms); producer busy: {args.spin_ms:g} ms kernels")
    print(f"{'placement':<10}{'ordering':<9}{'load':<6}" + "".join(f"{s >> 20:>10} MiB" for s in sizes))
    for place in places:
        for ordering in orderings:
            for load in ("idle", "busy"):
                got = {
                    r["nbytes"]: r["transfer_s"]
                    for r in rows
                    if (r["placement"], r["ordering"], r["load"]) == (place, ordering, load)
                }
                print(
                    f"{place:<10}{ordering:<9}{load:<6}"
                    + "".join(f"{got.get(s, float('nan')) * 1e3:14.2f}" for s in sizes)
                )
    H.save_json("busy_producer", {"machine": H.machine(), "spin_ms": args.spin_ms, "rows": rows})


if __name__ == "__main__":
    main()
