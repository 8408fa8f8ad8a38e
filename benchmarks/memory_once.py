"""Where the memory is when workers share values zero-copy, against plain Dask: host memory, spilling, pauses, restarts.

On one host with ``host`` pools and a ``memory_limit`` per worker (real Nanny workers; the nanny's ``terminate``
threshold on, as by default), three workloads run once per method: ``tcp`` (plain Dask: NumPy arrays copied over
TCP), ``gpupool`` (the plugin) and ``gpupool-plain`` (the plugin with Dask's own accounting: each worker's spill
buffer counting and spilling by ``sizeof``, and no page drop; :mod:`dask_gpupool.dask.spilling` taken out):

- ``broadcast``: one ``--value`` array made in the first worker's pool (a NumPy array for ``tcp``) and read (summed,
  and held) by each of ``--workers`` workers;
- ``fanout``: ``--count`` arrays of ``--part`` bytes made on a producer and held and read by one consumer whose
  ``--consumer-limit`` is smaller than their sum (plain Dask must spill some of them to disk there);
- ``pipeline``: a ``dask.array`` program on two workers of ``--pipeline-limit`` each, the plugin at its defaults
  (``GPUPool()``: tasks make plain NumPy blocks, staged into the sender's pool when a peer asks for one):
  ``x`` (``--pipeline-n`` squared float64, more than one worker's limit) persisted, ``y = x + x.T`` persisted, then
  ``y.sum(axis=0)`` checked.

Reported per run: peak host memory, counted once (sampled every 50 ms: each worker's private memory, ``Pss_Anon``
and ``Pss_File``, summed, plus each pool's resident bytes once, its memfd's allocated blocks, however many workers
map it), how much of it the workload added (over the figure before it; also as a multiple of the values' size), its
parts at the peak, the workers' summed proportional set size at its own peak (for comparison: read one process after
another, so a page mapped meanwhile can count twice), each worker's peak ``rss`` (what its nanny compares with
``memory_limit``), bytes each worker spilled to disk (Dask's ``disk-write`` bytes) and of those the borrowed values'
bytes, the seconds any worker was paused, the workers the nanny restarted, wall time, and whether every value read
back right. Not a test: run by hand, results JSON to ``benchmarks/results/`` (and ``$OUT``).

    python benchmarks/memory_once.py [--value 1GiB] [--workers 2,4] [--part 256MiB] [--count 6] \\
        [--consumer-limit 1GiB] [--pipeline-n 16384] [--pipeline-chunk 2048] [--pipeline-limit 1.5GiB] \\
        [--workloads broadcast,fanout,pipeline] [--methods tcp,gpupool,gpupool-plain]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

from dask.utils import format_bytes, parse_bytes

sys.path.insert(0, os.path.dirname(__file__))
import handoff as H  # benchmarks/handoff.py: save_json

GiB = 1 << 30


def make(nbytes: int, value: float, pool: bool) -> Any:
    """Task: ``nbytes`` of float64 equal to ``value``, in this worker's pool (``pool``) or a plain NumPy array."""
    import numpy as np

    n = nbytes // 8
    if not pool:
        return np.full(n, value)
    from dask_gpupool import allocate, as_array

    arr = as_array(allocate(nbytes), (n,), "f8")
    arr[...] = value
    return arr


def hold(x: Any) -> Any:
    """Task: the value itself (the worker running it holds it)."""
    return x


def read(x: Any) -> float:
    """Task: the sum of every element (reads every page)."""
    return float(x.sum())


def _dask_accounting(dask_worker: Any) -> None:
    """client.run target: the plugin's worker left with Dask's own accounting (the ``gpupool-plain`` method)."""
    from dask_gpupool.dask.spilling import count_plainly

    count_plainly(dask_worker.data)
    plugin = dask_worker.plugins["gpupool"]
    plugin._pages_check = None  # no page drop as tasks end
    if plugin._pages is not None:
        plugin._pages.stop()


def _watch_evictions(dask_worker: Any) -> None:
    """client.run target: tally the bytes of borrowed values the worker's spill buffer evicts (to disk)."""
    from dask.sizeof import sizeof

    from dask_gpupool.dask.spilling import borrowed

    dask_worker.memory_once_borrowed_spilled = 0

    def evicted(key: Any, value: Any) -> None:
        if borrowed(value):
            dask_worker.memory_once_borrowed_spilled += sizeof(value)

    dask_worker.data.fast.on_evict.append(evicted)


def _borrowed_spilled(dask_worker: Any) -> int:
    return int(getattr(dask_worker, "memory_once_borrowed_spilled", 0))


def _disk_written(dask_worker: Any) -> int:
    metrics = getattr(dask_worker.data, "cumulative_metrics", {})
    return int(metrics.get(("disk-write", "bytes"), 0))


def _statuses(dask_scheduler: Any) -> dict[str, str]:
    return {w: ws.status.name for w, ws in dask_scheduler.workers.items()}


class Sampler(threading.Thread):
    """Samples the workers' memory every 50 ms and, every 100 ms, their statuses on the scheduler; keeps the peaks,
    the parts of the peak sample and the paused time.

    Host memory, counted once: each worker's private memory (``Pss_Anon`` and ``Pss_File`` of
    ``/proc/<pid>/smaps_rollup``: its anonymous memory, and its share of mapped files) summed, plus each pool's
    resident bytes once (the allocated blocks of each distinct memfd a worker holds open, ``st_blocks``), however
    many workers map its pages. Also the workers' proportional set sizes summed (``Pss``: shared pages split between
    the processes mapping them; read one process after another, so a page mapped meanwhile can count in two).
    """

    def __init__(self, client: Any) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.stop = threading.Event()
        self.pids: dict[str, int] = client.run(os.getpid)
        self.baseline = self.sample()
        self.peak = self.baseline
        self.peak_pss = self.baseline["pss"]
        self.peak_rss: dict[str, int] = {}
        self.paused_s = 0.0

    def sample(self) -> dict[str, Any]:
        """One sample: ``host`` (counted once), ``pss``, and per worker its ``anon``, ``file`` and ``shmem`` (its
        share of shared memory: pools it maps) bytes and ``rss``; ``pools``: each memfd's resident bytes."""
        workers: dict[str, dict[str, int]] = {}
        pools: dict[tuple[int, int], int] = {}
        for worker, pid in list(self.pids.items()):
            got = _rollup(pid)
            if got is None:
                continue
            workers[worker] = {
                "anon": got.get("Pss_Anon", 0),
                "file": got.get("Pss_File", 0),
                "shmem": got.get("Pss_Shmem", 0),
                "pss": got["Pss"],
                "rss": got["Rss"],
            }
            pools.update(_memfds(pid))
        private = sum(w["anon"] + w["file"] for w in workers.values())
        return {
            "host": private + sum(pools.values()),
            "pss": sum(w["pss"] for w in workers.values()),
            "workers": workers,
            "pools": sorted(pools.values(), reverse=True),
        }

    def run(self) -> None:
        last_status = time.monotonic()
        while not self.stop.wait(0.05):
            got = self.sample()
            if got["host"] > self.peak["host"]:
                self.peak = got
            self.peak_pss = max(self.peak_pss, got["pss"])
            for worker, w in got["workers"].items():
                self.peak_rss[worker] = max(self.peak_rss.get(worker, 0), w["rss"])
            now = time.monotonic()
            if now - last_status >= 0.1:
                try:
                    statuses = self.client.run_on_scheduler(_statuses)
                except Exception:
                    statuses = {}
                if any(s == "paused" for s in statuses.values()):
                    self.paused_s += now - last_status
                last_status = now


def _memfds(pid: int) -> dict[tuple[int, int], int]:
    """The memfds (pools) process ``pid`` holds open, by (device, inode): their allocated bytes."""
    out = {}
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for name in names:
        path = f"/proc/{pid}/fd/{name}"
        try:
            if not os.readlink(path).startswith("/memfd:"):
                continue
            st = os.stat(path)
        except OSError:
            continue
        out[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return out


def _rollup(pid: int) -> dict[str, int] | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            out = {}
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1]) * 1024
            return out
    except OSError:
        return None


def cluster(limits: list[int], pool_size: int | None, plugin: bool) -> Any:
    """A SpecCluster of Nanny workers (one thread each, the given memory limits) and its Client; with ``plugin``,
    ``GPUPool(kind="host", max_size=pool_size)`` registered (``pool_size`` ``None``: ``GPUPool()``, the defaults)."""
    import contextlib

    from distributed import Client, Nanny, Scheduler, SpecCluster

    from dask_gpupool import GPUPool

    @contextlib.contextmanager
    def cm() -> Any:
        specs = {
            f"w{i}": {"cls": Nanny, "options": {"nthreads": 1, "memory_limit": limit, "dashboard_address": None}}
            for i, limit in enumerate(limits)
        }
        scheduler = {"cls": Scheduler, "options": {"dashboard_address": None}}
        with SpecCluster(workers=specs, scheduler=scheduler) as c, Client(c) as client:
            client.wait_for_workers(len(limits))
            if plugin:
                client.register_plugin(GPUPool() if pool_size is None else GPUPool(kind="host", max_size=pool_size))
            yield client

    return cm()


def pipeline_input(n: int, chunk: int) -> Any:
    """The pipeline's input: an ``n x n`` float64 ``dask.array`` of ``chunk``-square blocks, ``x[i, j] = i``."""
    import dask.array as da

    return da.ones((n, n), chunks=chunk) * da.arange(n, chunks=chunk, dtype="f8")[:, None]


def pipeline(client: Any, args: argparse.Namespace) -> tuple[bool, list[Any]]:
    """``x`` persisted, ``y = x + x.T`` persisted (half its blocks need a block of the other worker), then
    ``y.sum(axis=0)``: twice ``x``'s bytes held at once, each column's sum checked (``n * j + n (n - 1) / 2``)."""
    import numpy as np
    from distributed import wait

    n = args.pipeline_n
    x = client.persist(pipeline_input(n, args.pipeline_chunk))
    wait(x, timeout=args.timeout)
    y = client.persist(x + x.T)
    wait(y, timeout=args.timeout)
    got = client.compute(y.sum(axis=0)).result(timeout=args.timeout)
    expected = n * np.arange(n, dtype="f8") + n * (n - 1) / 2
    return bool(np.array_equal(got, expected)), [x, y]


def run_one(workload: str, method: str, n_workers: int, args: argparse.Namespace) -> dict[str, Any]:
    from distributed import wait

    pool = method.startswith("gpupool")
    pool_size: int | None
    if workload == "broadcast":
        limits = [args.worker_limit] * n_workers
        pool_size = 2 * args.value + 64 * (1 << 20)  # half a pool per peer (dask_gpupool's pin bound) holds it
        value_bytes = args.value
    elif workload == "fanout":
        limits = [args.producer_limit, args.consumer_limit]
        pool_size = 2 * args.part * args.count + 64 * (1 << 20)
        value_bytes = args.part * args.count
    else:
        limits = [args.pipeline_limit] * n_workers
        pool_size = None  # the plugin at its defaults
        value_bytes = 8 * args.pipeline_n**2
    with cluster(limits, pool_size, pool) as client:
        workers = sorted(
            client.scheduler_info()["workers"], key=lambda w: client.scheduler_info()["workers"][w]["name"]
        )
        if method == "gpupool-plain":
            client.run(_dask_accounting)
        # Every module the tasks use imported on every worker first, so that the baseline includes it.
        client.gather(
            [
                client.submit(
                    read, client.submit(make, 4096, 0.0, pool, workers=[w], pure=False), workers=[w], pure=False
                )
                for w in workers
            ]
        )
        if workload == "pipeline":
            client.compute(pipeline_input(4 * args.pipeline_chunk, args.pipeline_chunk).sum()).result()
        client.run(_watch_evictions)
        restarts_before = len(client.get_events("worker-restart-memory"))
        sampler = Sampler(client)
        sampler.start()
        start = time.perf_counter()
        ok, failure = True, ""
        try:
            if workload == "broadcast":
                x = client.submit(make, args.value, 1.0, pool, workers=[workers[0]], pure=False)
                held = [client.submit(hold, x, workers=[w], pure=False) for w in workers[1:]]
                reads = [
                    client.submit(read, h, workers=[w], pure=False) for h, w in zip(held, workers[1:], strict=True)
                ]
                reads.append(client.submit(read, x, workers=[workers[0]], pure=False))
                wait(reads, timeout=args.timeout)
                sums = client.gather(reads)
                ok = sums == [float(args.value // 8)] * len(workers)
                futures = [x, *held]
            elif workload == "fanout":
                producer, consumer = workers
                xs = [
                    client.submit(make, args.part, float(i + 1), pool, workers=[producer], pure=False)
                    for i in range(args.count)
                ]
                held = [client.submit(hold, x, workers=[consumer], pure=False) for x in xs]
                wait(held, timeout=args.timeout)
                reads = [client.submit(read, h, workers=[consumer], pure=False) for h in held]
                wait(reads, timeout=args.timeout)
                sums = client.gather(reads)
                ok = sums == [float(args.part // 8 * (i + 1)) for i in range(args.count)]
                futures = [*xs, *held]
            else:
                ok, futures = pipeline(client, args)
            wall = time.perf_counter() - start
            time.sleep(0.5)  # a last sample or two of memory held
        except Exception as e:  # a worker restarted mid-run loses its values
            wall, ok, futures, failure = time.perf_counter() - start, False, [], f"{type(e).__name__}: {e}"
            print(f"  {workload}/{method}: failed: {failure}", flush=True)
        sampler.stop.set()
        sampler.join()
        spilled = client.run(_disk_written)
        borrowed_spilled = client.run(_borrowed_spilled)
        restarts = client.get_events("worker-restart-memory")[restarts_before:]
        del futures
    peak, base = sampler.peak, sampler.baseline
    return {
        "workload": workload,
        "method": method,
        "workers": len(limits),
        "memory_limits": limits,
        "value_bytes": value_bytes,
        "peak_host_bytes": peak["host"],
        "baseline_host_bytes": base["host"],
        "added_host_bytes": peak["host"] - base["host"],
        "peak_pss_bytes": sampler.peak_pss,
        "baseline_pss_bytes": base["pss"],
        "peak_parts": _parts(peak, workers),
        "baseline_parts": _parts(base, workers),
        "peak_rss_bytes": [sampler.peak_rss.get(w, 0) for w in workers],
        "spilled_bytes": [spilled.get(w, 0) for w in workers],
        "borrowed_spilled_bytes": [borrowed_spilled.get(w, 0) for w in workers],
        "paused_s": round(sampler.paused_s, 2),
        "restarts": len(restarts),
        "wall_s": round(wall, 3),
        "values_right": ok,
        "failure": failure,
    }


def _parts(got: dict[str, Any], workers: list[str]) -> dict[str, Any]:
    """A sample's parts, workers in order: anonymous, file and shared (pool) bytes each; each pool's resident."""
    by = got["workers"]
    return {key: [by.get(w, {}).get(key, 0) for w in workers] for key in ("anon", "file", "shmem", "rss")} | {
        "pools": got["pools"]
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--value", type=parse_bytes, default=GiB, help="broadcast value size")
    p.add_argument("--workers", default="2", help="broadcast: how many workers read the value (a list: 2,4)")
    p.add_argument("--worker-limit", type=parse_bytes, default=3 * GiB, help="broadcast: each worker's memory_limit")
    p.add_argument("--part", type=parse_bytes, default=256 << 20, help="fanout: each value's size")
    p.add_argument("--count", type=int, default=6, help="fanout: values")
    p.add_argument("--consumer-limit", type=parse_bytes, default=GiB, help="fanout: the consumer's memory_limit")
    p.add_argument("--producer-limit", type=parse_bytes, default=4 * GiB, help="fanout: the producer's memory_limit")
    p.add_argument("--pipeline-n", type=int, default=16384, help="pipeline: the array's side (float64)")
    p.add_argument("--pipeline-chunk", type=int, default=2048, help="pipeline: each block's side")
    p.add_argument(
        "--pipeline-limit", type=parse_bytes, default=1536 << 20, help="pipeline: each worker's memory_limit"
    )
    p.add_argument("--workloads", default="broadcast,fanout,pipeline")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a run may take before it counts as failed")
    p.add_argument("--methods", default="tcp,gpupool,gpupool-plain")
    args = p.parse_args()
    import dask_gpupool

    rows = []
    runs = [
        (w, n)
        for w in args.workloads.split(",")
        for n in (map(int, args.workers.split(",")) if w == "broadcast" else [2])
    ]
    for workload, n_workers in runs:
        for method in args.methods.split(","):
            row = run_one(workload, method, n_workers, args)
            rows.append(row)
            print(
                f"{workload:9s} {method:8s} workers {row['workers']}  "
                f"peak host {format_bytes(row['peak_host_bytes']):>10s} "
                f"(+{format_bytes(row['added_host_bytes'])}, {row['added_host_bytes'] / row['value_bytes']:.2f}x)  "
                f"peak rss {' '.join(format_bytes(r) for r in row['peak_rss_bytes'])}  "
                f"spilled {' '.join(format_bytes(s) for s in row['spilled_bytes'])} "
                f"(borrowed {' '.join(format_bytes(s) for s in row['borrowed_spilled_bytes'])})  "
                f"paused {row['paused_s']} s  restarts {row['restarts']}  wall {row['wall_s']} s  "
                f"values {'right' if row['values_right'] else 'WRONG or lost'}",
                flush=True,
            )
            peak, base = row["peak_parts"], row["baseline_parts"]
            added = {k: sum(peak[k]) - sum(base[k]) for k in ("anon", "file", "shmem")}
            print(
                f"{'':9s} at the peak, added: private anon {format_bytes(added['anon'])} "
                f"({' '.join(format_bytes(p - b) for p, b in zip(peak['anon'], base['anon'], strict=True))}), "
                f"file {format_bytes(added['file'])}, pools resident "
                f"{format_bytes(sum(peak['pools']) - sum(base['pools']))}, workers' shared (Pss_Shmem) "
                f"{format_bytes(added['shmem'])}; Pss summed "
                f"+{format_bytes(row['peak_pss_bytes'] - row['baseline_pss_bytes'])}",
                flush=True,
            )
    H.save_json(
        "memory_once",
        {"version": dask_gpupool.__version__, "cpus": os.cpu_count(), "args": vars(args), "rows": rows},
    )


if __name__ == "__main__":
    main()
