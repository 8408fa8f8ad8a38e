"""The package modules one worker's first handoff needs: a two-worker ``host``-pool handoff over TCP, measured.

    python scripts/handoff_modules.py

Two Nanny workers on loopback with ``host`` pools. A task on the producer
writes an array into its pool; a task on the consumer reads it (mapped, not
copied); then the consumer lets go and the producer's lease ends. On each
worker it records the ``dask_gpupool`` modules:

- *loaded*: in ``sys.modules`` after the handoff and not after ``import
  dask_gpupool`` (what every process of a cluster loads: the client, the
  scheduler, a worker before the plugin), that is the worker stack the
  plugin's setup and the handoff loaded; and among them those the handoff
  itself loaded (not there after the setup);
- *touched*: those whose functions ran during the handoff, from the
  producer's task to the lease's end, in any thread (a profile function set
  before the plugin's setup, so that the threads the service starts inherit
  it; only calls inside the handoff's window are recorded). The worker's
  periodic callbacks (stats pushed to the scheduler, memory sampling) run in
  that window too, as do Dask's comm reads of heartbeats: a window as long
  with no handoff is recorded after, and the modules touched in both are
  marked (*idle too*): they are a handoff's too or not (the broker's loop,
  a comm read run in both), which this cannot tell apart.

Prints the counts and the lists; ``--quiet`` prints the counts only.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from typing import Any

import dask_gpupool


def _loaded() -> list[str]:
    return sorted(m for m in sys.modules if m.startswith("dask_gpupool"))


def _trace(dask_worker: Any) -> None:
    """On a worker, before the plugin's setup: profile this thread and every thread started from now on, recording
    the package's modules whose functions are called while :func:`_record` is on (kept on the worker object)."""
    touched: set[str] = set()
    recording = threading.Event()
    probing = threading.local()  # set while this script's own probe runs in a thread: its calls are not the handoff's

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and recording.is_set() and not getattr(probing, "on", False):
            name = frame.f_globals.get("__name__") or ""
            if name.startswith("dask_gpupool"):
                touched.add(name)

    dask_worker.handoff_modules_trace = (touched, recording, probing)
    sys.setprofile(profile)
    threading.setprofile(profile)


def _record(on: bool, dask_worker: Any) -> list[str]:
    touched, recording, _ = dask_worker.handoff_modules_trace
    if on:
        touched.clear()
        recording.set()
    else:
        recording.clear()
    return sorted(touched)


def _leases_and_imports(dask_worker: Any) -> tuple[int, int]:
    """Live leases and imports of a worker: the wait for the lease's end (not recorded as the handoff's calls)."""
    from dask_gpupool.dask.worker_plugin import service_of

    probing = dask_worker.handoff_modules_trace[2]
    probing.on = True
    try:
        service = service_of(dask_worker)
        if service.importer.held.live():  # a worker that imported nothing has no releases to push
            service.importer.releaser.flush()
        return len(service.leases), service.importer.held.live()
    finally:
        probing.on = False


def produce(n: int) -> Any:
    buf = dask_gpupool.allocate(n)
    arr = dask_gpupool.as_array(buf, (n,), "u1")
    arr[...] = 7
    return arr


def consume(arr: Any) -> int:
    return int(arr[0]) + int(arr[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=1 << 20, help="bytes handed over (default 1 MiB)")
    parser.add_argument("--quiet", action="store_true", help="print the counts only")
    args = parser.parse_args()

    import dask
    from distributed import Client, Nanny, Scheduler, SpecCluster

    loopback = {"host": "127.0.0.1", "dashboard_address": None}
    workers = {
        f"w{i}": {"cls": Nanny, "options": {"nthreads": 1, "silence_logs": logging.WARNING, **loopback}}
        for i in range(2)
    }
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": None}}
    amm_off = dask.config.set({"distributed.scheduler.active-memory-manager.start": False})
    with amm_off, SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.WARNING) as cluster:
        with Client(cluster) as client:
            client.wait_for_workers(2)
            a, b = sorted(client.scheduler_info()["workers"])
            base = client.run(_loaded)
            client.run(_trace)
            client.register_plugin(dask_gpupool.GPUPool(kind="host", max_size="64 MiB"))
            setup = client.run(_loaded)
            client.run(_record, True)
            start = time.monotonic()
            arr = client.submit(produce, args.size, workers=[a], pure=False)
            total = client.submit(consume, arr, workers=[b], pure=False)
            assert total.result() == 14
            del arr, total
            deadline = time.monotonic() + 30
            while client.run(_leases_and_imports) != {a: (0, 0), b: (0, 0)} and time.monotonic() < deadline:
                time.sleep(0.05)
            touched = client.run(_record, False)
            took = time.monotonic() - start
            after = client.run(_loaded)
            imports = dask_gpupool.stats(client)[b]["imports"]
            client.run(_record, True)
            time.sleep(max(took, 1.0))
            idle = client.run(_record, False)
    assert imports == 1, f"the consumer mapped {imports} values, not 1"
    print(f"import dask_gpupool: {len(base[b])} modules")
    union_touched: set[str] = set()
    union_idle: set[str] = set()
    union_loaded: set[str] = set()
    for role, worker in (("producer", a), ("consumer", b)):
        loaded = sorted(set(after[worker]) - set(base[worker]))
        by_handoff = set(after[worker]) - set(setup[worker])
        union_touched |= set(touched[worker])
        union_idle |= set(idle[worker])
        union_loaded |= set(loaded)
        print(
            f"{role} {worker}: loaded {len(loaded)} modules beyond import dask_gpupool "
            f"({len(by_handoff)} by the handoff itself); the handoff touched {len(touched[worker])} "
            f"({len(set(touched[worker]) & set(idle[worker]))} of them idle too)"
        )
        if not args.quiet:
            for m in sorted(set(loaded) | set(touched[worker])):
                marks = [
                    w
                    for w, on in (
                        ("loaded", m in loaded),
                        ("by the handoff", m in by_handoff),
                        ("touched", m in touched[worker]),
                        ("idle too", m in touched[worker] and m in idle[worker]),
                    )
                    if on
                ]
                print(f"  {m}  ({', '.join(marks)})")
    print(
        f"both workers: loaded {len(union_loaded)} beyond import dask_gpupool; the handoff touched "
        f"{len(union_touched)} ({len(union_touched & union_idle)} of them idle too), "
        f"{len([m for m in union_touched if not m.startswith('dask_gpupool.dask')])} below the Dask adapters"
    )
    if not args.quiet:
        for m in sorted(union_touched):
            print(f"  {m}{'  (idle too)' if m in union_idle else ''}")


if __name__ == "__main__":
    main()
