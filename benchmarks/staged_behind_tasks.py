"""A staged CuPy task result while the producer's later tasks keep its GPU's default stream busy.

``dask/plain_arrays.py::stage`` copies a plain CuPy array into the pool for a same-host worker. On the device's
default stream that copy waits for every kernel queued there before it, the producer's later tasks' included
(``scripts/probes/stage_steps.py``: 5.6 ms median behind queued matrix products). For a result of a task the
producer ran, the copy waits on a stream of its own for the event recorded when Dask stored the result
(``dask/task_events.py``), and its pool allocation on that stream for the frees queued on the default stream only
(``memory/arena_placement.py``). This takes each sample both ways back to back in one cluster (two workers, one GPU
or one per GPU): the producer makes a float64 CuPy array (CuPy's own memory), then a later task queues a
``--spin-ms`` kernel on the default stream, then a task on the consumer takes the array; ``event`` as the plugin
does it (the side stream while the default stream has work queued, the default stream when it is idle),
``default-stream`` with the producer's table of events switched off (the copy on the default stream, after every
kernel queued there). ``idle`` rows take the same samples without the later task. The transfer time is the
consumer's ``stop - start`` of its transfer log entry; median of ``--samples``. JSON to ``benchmarks/results/``.

    python benchmarks/staged_behind_tasks.py [--sizes 16MiB,64MiB] [--spin-ms 20] [--samples 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

from dask.utils import format_bytes, parse_bytes
from distributed import wait

sys.path.insert(0, os.path.dirname(__file__))
import handoff as H  # benchmarks/handoff.py: its cluster, placements and save_json

from dask_gpupool import GPUPool
from dask_gpupool import testing as T


def use_events(on: bool, dask_worker: Any = None) -> bool:
    """On the producer: look task results' events up (``on``, the plugin's way) or not (the copy on the default
    stream). Returns whether the worker has a table of events."""
    from dask_gpupool.core import PLUGIN_NAME

    events = getattr(dask_worker.plugins.get(PLUGIN_NAME), "_task_events", None)
    if events is None:
        return False
    if on:
        events.__dict__.pop("event_of", None)
    else:
        events.event_of = lambda value: None
    return True


def produce(nbytes: int) -> Any:
    """Task: a float64 CuPy array of ``nbytes`` from CuPy's own memory, set to 1 (returned without waiting)."""
    import cupy

    with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
        return cupy.ones(max(nbytes // 8, 1), dtype="f8")


def drain() -> None:
    """client.run target: wait for this worker's GPU work (the spin kernels) between samples."""
    import cupy

    cupy.cuda.runtime.deviceSynchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="16MiB,64MiB")
    p.add_argument("--spin-ms", type=float, default=20.0)
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--placements", default="same,other")
    args = p.parse_args()
    places = H.gpu_placements(args.placements)
    sizes = [int(parse_bytes(s)) for s in args.sizes.split(",")]
    variants = [("event", True), ("default-stream", False)]
    rows: list[dict[str, Any]] = []
    for place, workers in places.items():
        plugin = GPUPool(kind="device", max_size="4 GiB")
        with H.cluster(workers, "tcp", plugin) as c:
            info = c.scheduler_info()["workers"]
            a, b = sorted(info, key=lambda w: str(info[w]["name"]))[:2]
            if not c.run(use_events, True, workers=[a])[a]:
                raise SystemExit("the producer has no table of task events (no CuPy, or not a device pool)")
            for load in ("idle", "busy"):
                for nbytes in sizes:
                    samples: dict[str, list[float]] = {v: [] for v, _ in variants}
                    for k in range(args.samples + 1):
                        for name, on in variants if k % 2 == 0 else variants[::-1]:
                            c.run(use_events, on, workers=[a])
                            x = c.submit(produce, nbytes, workers=[a], pure=False)
                            wait(x)
                            later = c.submit(T.spin, args.spin_ms, workers=[a], pure=False) if load == "busy" else None
                            if later is not None:
                                wait(later)
                            c.submit(H.consume, x, workers=[b], pure=False).result()
                            t = c.run(T.last_transfer, key=x.key, workers=[b])[b]
                            del x, later
                            c.run(drain, workers=[a])
                            H.between_samples(c, True)
                            if k and t is not None:
                                samples[name].append(t)
                    for name, _ in variants:
                        med = statistics.median(samples[name])
                        rows.append(
                            {"placement": place, "load": load, "variant": name, "nbytes": nbytes, "transfer_s": med}
                            | {"samples": samples[name]}
                        )
                        print(f"{place:6s} {load:5s} {name:15s} {format_bytes(nbytes):>10}: {med * 1e3:8.2f} ms")
            c.run(use_events, True, workers=[a])
    print(f"\nconsumer transfer time, median of {args.samples} (ms); later task: a {args.spin_ms:g} ms kernel")
    print(f"{'placement':<10}{'load':<6}{'variant':<16}" + "".join(f"{format_bytes(s):>12}" for s in sizes))
    for place in places:
        for load in ("idle", "busy"):
            for name, _ in variants:
                got = {
                    r["nbytes"]: r["transfer_s"]
                    for r in rows
                    if (r["placement"], r["load"], r["variant"]) == (place, load, name)
                }
                print(f"{place:<10}{load:<6}{name:<16}" + "".join(f"{got[s] * 1e3:12.2f}" for s in sizes))
    H.save_json("staged_behind_tasks", {"machine": H.machine(), "spin_ms": args.spin_ms, "rows": rows})


if __name__ == "__main__":
    main()
