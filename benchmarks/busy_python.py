"""Transfers from a producer whose tasks hold the GIL: plain Dask and a handoff.

A worker thread that waits for the GIL behind a thread running Python code waits up to the interpreter's switch
interval (``sys.getswitchinterval()``, 5 ms by default) each time it needs it again; Dask's own transfer and a
handoff both need the producer's event loop. This times a value of ``--size`` made on worker A and read by a task
pinned to worker B (the dependent task's wall time from the client, median of ``--repeats``) with A idle and with a
thread on A spinning in pure Python, for plain Dask (``tcp``) and dask_gpupool at its defaults (``gpupool``: an array
over a pool buffer, handed over). Host pools and NumPy without a GPU; ``device`` pools and CuPy with one. JSON to
``benchmarks/results/`` (and ``$OUT``).

    python benchmarks/busy_python.py [--size 1MiB] [--repeats 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from typing import Any

from dask.utils import format_bytes, parse_bytes
from distributed import wait

sys.path.insert(0, os.path.dirname(__file__))
import handoff as H  # benchmarks/handoff.py: its cluster, produce and machine

from dask_gpupool import GPUPool
from dask_gpupool.memory.topology import local_devices

METHODS = ("tcp", "gpupool")


def spin(on: bool, dask_worker: Any = None) -> None:
    """client.run target: start (``on``) or stop a thread that runs pure Python (holding the GIL) on this worker."""
    if not on:
        stop = getattr(dask_worker, "_busy_python", None)
        if stop is not None:
            stop.set()
        return
    stop = threading.Event()
    dask_worker._busy_python = stop

    def loop() -> None:
        x = 0
        while not stop.is_set():
            for i in range(10_000):
                x += i

    threading.Thread(target=loop, daemon=True, name="busy-python").start()


def total(arr: Any) -> float:
    """The dependent task: reads every element (the whole value must have arrived)."""
    return float(arr.sum())


def timed(c: Any, a: str, b: str, nbytes: int, lib: str, pool: bool, repeats: int) -> float:
    samples = []
    for i in range(repeats + 1):
        x = c.submit(H.produce, nbytes, lib, pool, workers=[a], pure=False)
        wait(x)
        start = time.perf_counter()
        c.submit(total, x, workers=[b], pure=False).result()
        if i:  # the first is a warm-up
            samples.append(time.perf_counter() - start)
        del x
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1MiB")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--methods", default=",".join(METHODS))
    args = p.parse_args()
    nbytes = int(parse_bytes(args.size))
    gpu = bool(local_devices().uuids)
    lib = "cupy" if gpu else "numpy"
    workers = [{"env": {"CUDA_VISIBLE_DEVICES": "0"}} for _ in range(2)] if gpu else [{}, {}]
    rows = []
    for method in args.methods.split(","):
        plugin = GPUPool() if method == "gpupool" else None
        with H.cluster(workers, "tcp", plugin) as c:
            intervals = sorted(set(c.run(sys.getswitchinterval).values()))
            a, b = sorted(c.scheduler_info()["workers"])
            idle = timed(c, a, b, nbytes, lib, plugin is not None, args.repeats)
            c.run(spin, True, workers=[a])
            try:
                busy = timed(c, a, b, nbytes, lib, plugin is not None, args.repeats)
            finally:
                c.run(spin, False, workers=[a])
        rows.append({"method": method, "switch_s": intervals, "idle_s": idle, "busy_s": busy})
        print(f"{method:16} idle {idle * 1e3:7.2f} ms  producer busy {busy * 1e3:7.2f} ms", flush=True)
    print(f"\n{format_bytes(nbytes)} {lib} value A -> B, dependent task's wall time, median of {args.repeats}")
    print(f"{'method':16} {'switch interval':>16} {'idle ms':>9} {'busy ms':>9}")
    for r in rows:
        sw = ",".join(f"{s * 1e3:g}" for s in r["switch_s"]) + " ms"
        print(f"{r['method']:16} {sw:>16} {r['idle_s'] * 1e3:9.2f} {r['busy_s'] * 1e3:9.2f}")
    H.save_json("busy_python", {"machine": H.machine(), "size": nbytes, "lib": lib, "rows": rows})


if __name__ == "__main__":
    main()
