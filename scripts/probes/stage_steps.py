"""Probe: where a worker's time goes when it stages a plain CuPy array into its pool for a same-host worker.

``benchmarks/workloads.py`` puts 0.7-3.0 ms per staging (``stage``) and 0.3-0.6 ms per export in the replies of the
workloads that stage (rechunk: 0.91 and 0.41 ms for 32 MiB chunks), where the copy itself is microseconds of GPU
time. This times each step of :func:`dask_gpupool.dask.plain_arrays.stage` on a worker of a two-worker TCP cluster
with the plugin, in the worker's event loop thread (``client.run``, where Dask serializes a reply): the pool
allocation (``allocate``), the CuPy view over it (``as_array``), the copy's launch (``copy``), the wait for it
(``sync``: what the export's synchronize of the legacy default stream waits for), the buffer's descriptor
(``describe``), and the buffer's release (``free``). ``idle``: nothing else on the GPU; ``busy``: the worker's task
thread keeps queueing 2048x2048 matrix products on the legacy default stream meanwhile, as a worker computing
while it answers does. Median and 90th percentile microseconds over ``PROBE_REPEATS`` after a warm-up.

Run on the GPU machine: ``python3 scripts/probes/stage_steps.py`` (PROBE_SIZES, default "1048576,33554432";
PROBE_REPEATS, default 200).
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

SIZES = [int(s) for s in os.environ.get("PROBE_SIZES", "1048576,33554432").split(",")]
REPEATS = int(os.environ.get("PROBE_REPEATS", 200))


def steps(sizes: list[int], repeats: int, dask_worker: Any = None) -> list[dict[str, Any]]:
    """On a worker: each step's median and p90 microseconds for every size."""
    import time

    import cupy

    from dask_gpupool.dask.views import as_array
    from dask_gpupool.handoff.registry import active_service

    service = active_service()
    assert service is not None
    rows = []
    for nbytes in sizes:
        n = nbytes // 8
        with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
            src = cupy.ones(n, dtype="f8")
        cupy.cuda.runtime.deviceSynchronize()
        times: dict[str, list[float]] = {k: [] for k in ("allocate", "as_array", "copy", "sync", "describe", "free")}
        stream = cupy.cuda.Stream.null
        for i in range(repeats + 10):
            t0 = time.perf_counter()
            buf = service.pool.allocate(nbytes)
            t1 = time.perf_counter()
            out = as_array(buf, (n,), "f8", like="cupy")
            t2 = time.perf_counter()
            out[...] = src
            t3 = time.perf_counter()
            stream.synchronize()
            t4 = time.perf_counter()
            service.pool.export(buf)
            t5 = time.perf_counter()
            del out
            buf.close()
            t6 = time.perf_counter()
            if i >= 10:
                for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5), strict=True):
                    times[k].append(dt)
        for k, v in times.items():
            v.sort()
            rows.append({"step": k, "nbytes": nbytes, "med": v[len(v) // 2] * 1e6, "p90": v[int(0.9 * len(v))] * 1e6})
    return rows


def busy(seconds: float) -> int:
    """A task: queue 2048x2048 matrix products on the legacy default stream for ``seconds`` (no synchronize between)."""
    import time

    import cupy

    a = cupy.ones((2048, 2048), dtype="f8")
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        for _ in range(4):
            a @ a
        n += 4
        if n % 64 == 0:  # at most 64 products (about 20 ms) queued
            cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.runtime.deviceSynchronize()
    return n


def main() -> None:
    import time

    import handoff as H  # benchmarks/handoff.py: its cluster

    from dask_gpupool import GPUPool

    workers = [{"env": {"CUDA_VISIBLE_DEVICES": "0"}}, {"env": {"CUDA_VISIBLE_DEVICES": "0"}}]
    plugin = GPUPool(kind="device", max_size=f"{4 * max(SIZES) // (1 << 20) + 1024} MiB")
    results: dict[str, list[dict[str, Any]]] = {}
    with H.cluster(workers, "tcp", plugin) as c:
        from dask_gpupool.testing import workers

        info = workers(c)  # not scheduler_info(): see dask_gpupool.testing.workers
        w = sorted(info, key=lambda a: str(info[a]["name"]))[0]
        results["idle"] = c.run(steps, SIZES, REPEATS, workers=[w])[w]
        load = c.submit(busy, 60.0, workers=[w], pure=False)
        time.sleep(2.0)
        results["busy"] = c.run(steps, SIZES, REPEATS, workers=[w])[w]
        load.cancel()
    print(f"microseconds, median / p90 of {REPEATS}, worker's event loop thread")
    print(f"{'step':<10}" + "".join(f"{state + ' ' + str(s >> 10) + 'K':>22}" for state in results for s in SIZES))
    for step in dict.fromkeys(r["step"] for r in results["idle"]):
        cells = []
        for rows in results.values():
            for s in SIZES:
                r = next(r for r in rows if (r["step"], r["nbytes"]) == (step, s))
                cells.append(f"{r['med']:>12.1f} /{r['p90']:>8.1f}")
        print(f"{step:<10}" + "".join(cells))


if __name__ == "__main__":
    main()
