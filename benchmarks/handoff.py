"""Handoff of one task result between two workers of one host, per method and size.

A result is made on worker A and consumed by a task pinned to worker B. For
each method, placement and size the benchmark records, median of
``--repeats``:

- ``transfer``: the consumer's own transfer duration from Dask's transfer log
  (``worker.transfer_incoming_log``): ``stop - start`` of its entry (not its
  ``duration``, which Dask clamps to at least 1 ms, so results from before
  2026-11-23 07:10 show 1.00 ms for anything faster);
- ``task``: the end-to-end time of the dependent task (submit to result, the
  result already in A's memory).

Methods:

============  ==========================================================
tcp           Dask over TCP, a CuPy array (NumPy on a host run): today's default
ucxx          Dask over UCXX, a CuPy array (only when distributed-ucxx imports)
gpupool       dask_gpupool at its defaults: an array over a pool buffer (copied in Dask's frames under
              64 KiB on host pools, ``dask_gpupool.tuning.HOST_HANDOFF_THRESHOLD``; every size handed over on
              device pools)
gpupool-plain  TCP with the plugin at its defaults, a plain CuPy array: staged into the pool from 64 KiB up
gpupool-copy  dask_gpupool's host-copy path, forced with different host ids
ucxx+gpupool  Dask over UCXX with the plugin at its defaults, an array over a pool buffer
ucxx+gpupool-plain  the same cluster, a plain CuPy array (the plugin must cost UCXX nothing)
ucxx+gpupool-staged  ucxx+gpupool with different host ids: pool memory as device frames, staged for UCX
============  ==========================================================

Placements: ``same`` (two workers on GPU 0) and ``other`` (one worker per
GPU, rotated ``CUDA_VISIBLE_DEVICES``, zero-copy where the GPUs have peer
access). With no GPU, one ``host`` placement with
NumPy arrays and host pools (a smoke run). The 1 KiB row of each method is
the floor of a Dask round trip on that comm.

Writes JSON (machine, GPUs, driver, versions, every sample) to
``benchmarks/results/`` and ``$OUT``, prints a table and draws a log-log plot
when matplotlib is there. Results are written after every method, so a run
cut short keeps what it measured.

    python benchmarks/handoff.py [--sizes 1KiB,1MiB,...] [--repeats 5] [--methods tcp,gpupool,...]
    python benchmarks/handoff.py --replot results/a.json results/b.log --stamp NAME

``--replot`` redraws the table and the plot from saved JSON results and from
this script's logs (a run stopped by a time limit leaves its log, whose row
lines carry the medians), labelling each line with the file it came from.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import dask
from dask.utils import format_bytes, parse_bytes
from distributed import wait

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import testing as T
from dask_gpupool.handoff.stats import quantile_s, subtract_hist
from dask_gpupool.memory.topology import device_memory, local_devices

DEFAULT_SIZES = "1KiB,1MiB,64MiB,256MiB,1GiB,4GiB,8GiB"
METHODS = (
    "tcp",
    "ucxx",
    "gpupool",
    "gpupool-plain",
    "gpupool-copy",
    "ucxx+gpupool",
    "ucxx+gpupool-plain",
    "ucxx+gpupool-staged",
)


# -- tasks (run on the workers) --------------------------------------------------------


def produce(nbytes: int, lib: str, pool: bool) -> Any:
    """A float64 array of ``nbytes`` (rounded down to 8), set to 1; over a pool buffer if ``pool``."""
    n = max(nbytes // 8, 1)
    if pool:
        buf = dask_gpupool.allocate(n * 8)
        arr = dask_gpupool.as_array(buf, (n,), "f8", like=lib)
        arr[...] = 1.0
    elif lib == "cupy":
        import cupy

        arr = cupy.ones(n, dtype="f8")
    else:
        import numpy as np

        arr = np.ones(n, dtype="f8")
    if lib == "cupy":
        import cupy

        cupy.cuda.runtime.deviceSynchronize()
    return arr


def consume(arr: Any) -> int:
    """The dependent task: touches nothing but the array's metadata (the handoff is what is timed)."""
    return int(arr.nbytes)


def device_used(dask_worker: Any) -> int:
    """Bytes in use on this worker's GPU (cuMemGetInfo), or 0 without one."""
    try:
        from cuda.bindings import driver
        from cuda.core import Device

        Device(0).set_current()
        err, free, total = driver.cuMemGetInfo()
        return int(total - free) if err == driver.CUresult.CUDA_SUCCESS else 0
    except Exception:
        return 0


# -- the driver ------------------------------------------------------------------------


@contextlib.contextmanager
def cluster(workers: list[dict[str, Any]], protocol: str, plugin: Any) -> Iterator[Any]:
    from distributed import Client, Nanny, Scheduler, SpecCluster

    specs = {
        f"w{i}": {
            "cls": Nanny,
            "options": {
                "nthreads": 1,
                # No host memory limit: Dask counts a device array's nbytes as managed memory, and with the
                # default limit (host memory / cores: 8 GiB here) an 8 GiB result is spilled to disk through
                # a host copy and pauses the worker, which stalls the 8 GiB rows.
                "memory_limit": 0,
                "dashboard_address": None,
                "protocol": protocol,
                "silence_logs": logging.ERROR,
                **o,
            },
        }
        for i, o in enumerate(workers)
    }
    sched = {"cls": Scheduler, "options": {"dashboard_address": None, "protocol": protocol}}
    cfg = {"distributed.scheduler.active-memory-manager.start": False}
    if protocol == "ucxx":
        cfg.update({f"distributed.comm.ucx.{k}": True for k in ("create-cuda-context", "nvlink", "tcp", "cuda-copy")})
    with (
        dask.config.set(cfg),
        SpecCluster(workers=specs, scheduler=sched, silence_logs=logging.ERROR) as cl,
        Client(cl) as c,
    ):
        c.wait_for_workers(len(workers))
        if plugin is not None:
            c.register_plugin(plugin)
        yield c


def measure(
    c: Any,
    sizes: list[int],
    repeats: int,
    lib: str,
    pool: bool,
    deadline: float,
    log: Any,
    plugin_on: bool,
    rows: list[dict[str, Any]],
    save: Any,
) -> None:
    """Append a row per size to ``rows`` and ``save()`` after each (a run cut short keeps them)."""
    info = T.workers(c)  # not scheduler_info(): see T.workers
    a, b = sorted(info, key=lambda w: str(info[w]["name"]))
    for nbytes in sizes:
        samples: list[dict[str, float]] = []
        extra: int | None = None
        stats_before: dict[str, Any] = {}
        for i in range(repeats + 1):  # the first is a warm-up
            if i == 1 and plugin_on:  # the steps of the timed samples only
                stats_before = dask_gpupool.stats(c)
            if time.monotonic() > deadline:
                log(f"    {format_bytes(nbytes)}: out of time after {len(samples)} samples")
                break
            x = c.submit(produce, nbytes, lib, pool, workers=[a], pure=False)
            wait(x)  # not x.result(): that would copy the array to the client on every sample
            before = c.run(device_used, workers=[b])[b] if i == 1 else 0
            t0 = time.perf_counter()
            y = c.submit(consume, x, workers=[b], pure=False)
            y.result()
            task = time.perf_counter() - t0
            transfer = c.run(T.last_transfer, key=x.key, workers=[b])[b]
            if i == 1:  # B still holds what it received for x: the device memory the handoff took there
                extra = c.run(device_used, workers=[b])[b] - before
            del x, y
            between_samples(c, plugin_on)
            if i > 0 and transfer is not None:
                samples.append({"transfer_s": transfer, "task_s": task})
        if not samples:
            continue
        row: dict[str, Any] = {
            "nbytes": nbytes,
            "transfer_s": statistics.median(s["transfer_s"] for s in samples),
            "task_s": statistics.median(s["task_s"] for s in samples),
            "extra_device_bytes_on_consumer": extra,
            "samples": samples,
        }
        if plugin_on:  # pinned staging kept by each side of the pipelined copy path (0 when unused)
            row["staging_bytes"] = {w: s["staging_bytes"] for w, s in c.run(T.handoff_counters).items()}
            row["timings"] = steps_since(stats_before, dask_gpupool.stats(c))  # where the samples' time went
        rows.append(row)
        save()
        log(
            f"    {format_bytes(nbytes):>10}  transfer {row['transfer_s'] * 1e3:9.2f} ms  "
            f"task {row['task_s'] * 1e3:9.2f} ms  (n={len(samples)})"
        )
        if row.get("timings"):
            log(f"    {'':>10}  steps: {steps_line(row['timings'])}")


def steps_since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Where the handoffs' time went between two ``dask_gpupool.stats`` snapshots, summed over the workers: per
    timed step its count, total seconds, the largest (since the worker started) and the histogram of the interval."""
    timings: dict[str, dict[str, Any]] = {}
    for w, s in after.items():
        was = before.get(w, {}).get("timings", {})
        for step, t in s.get("timings", {}).items():
            t0 = was.get(step, {"count": 0, "total_s": 0.0, "max_s": 0.0})
            sum_ = timings.setdefault(step, {"count": 0, "total_s": 0.0, "max_s": 0.0, "hist": {}})
            sum_["count"] += t["count"] - t0["count"]
            sum_["total_s"] += t["total_s"] - t0["total_s"]
            sum_["max_s"] = max(sum_["max_s"], t["max_s"])
            for b, n in subtract_hist(t.get("hist", {}), t0.get("hist", {})).items():
                sum_["hist"][b] = sum_["hist"].get(b, 0) + n
    return timings


def steps_line(timings: dict[str, dict[str, Any]]) -> str:
    """``step mean ms (p50 median ms) xcount`` for each step of :func:`steps_since` that ran."""
    return ", ".join(
        f"{step} {t['total_s'] / t['count'] * 1e3:.2f} ms (p50 {(quantile_s(t['hist'], 0.5) or 0) * 1e3:.2f})"
        f" x{t['count']}"
        for step, t in sorted(timings.items())
        if t["count"]
    )


def between_samples(c: Any, plugin_on: bool, timeout: float = 30.0) -> None:
    """Between samples, the same for every method: a full garbage collection on each worker, then, with the
    plugin, until the producer's leases are released (its memory is free again).

    The collection frees pool buffers held in reference cycles, so leases end. It is run for methods without the
    plugin too: on a 2-vCPU container a ``gc.collect()`` on the workers before a sample made that sample's dependent
    task 2-5 ms slower end to end, with or without the plugin (``docs/performance.md``), and before 2026-11-23 07:20
    only the plugin's methods ran it, which charged them that cost.
    """
    if not plugin_on:
        c.run(gc.collect)
        return
    deadline = time.monotonic() + timeout
    while any(s["leases"] for s in c.run(T.handoff_counters).values()) and time.monotonic() < deadline:
        time.sleep(0.01)


def machine() -> dict[str, Any]:
    import distributed

    m: dict[str, Any] = {
        "host": platform.node(),
        "python": sys.version.split()[0],
        "dask": dask.__version__,
        "distributed": distributed.__version__,
        "dask_gpupool": dask_gpupool.__version__,
    }
    with contextlib.suppress(Exception):
        q = "name,driver_version,memory.total,uuid"
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True, check=True
        )
        m["gpus"] = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    for mod in ("cuda.core", "cuda.bindings", "cupy", "distributed_ucxx", "ucxx", "rmm"):
        with contextlib.suppress(Exception):
            m[mod] = __import__(mod, fromlist=["__version__"]).__version__
    return m


def placements(gpus: int) -> dict[str, list[dict[str, Any]]]:
    if gpus == 0:
        return {"host": [{}, {}]}
    out = {"same": [{"env": {"CUDA_VISIBLE_DEVICES": "0"}}] * 2}
    if gpus >= 2:
        out["other"] = [{"env": {"CUDA_VISIBLE_DEVICES": "0,1"}}, {"env": {"CUDA_VISIBLE_DEVICES": "1,0"}}]
    return out


def gpu_placements(names: str) -> dict[str, list[dict[str, Any]]]:
    """The GPU placements named in ``names`` (comma-separated: ``same``, ``other``) that this machine has; exits
    without a GPU."""
    gpus = len(local_devices().uuids)
    if not gpus:
        raise SystemExit("needs a GPU")
    return {k: v for k, v in placements(gpus).items() if k in names.split(",")}


def method_setup(
    method: str,
    workers: list[dict[str, Any]],
    gpus: int,
    max_size: str,
    kind: str = "",
) -> tuple[str, list[dict[str, Any]], Any, bool] | None:
    """(protocol, worker options, plugin, pool) for a method, or None when it cannot run here.

    ``kind``: the plugin's pool kind (``""``: ``device`` on a GPU, else ``host``), to tell what the plugin's mere
    presence costs from what its pool does (``--kind host`` with ``ucxx+gpupool-plain``).
    """
    kind = kind or ("device" if gpus else "host")
    if method == "tcp":
        return "tcp", workers, None, False
    if method.startswith("ucxx"):
        if not gpus:
            return None
        try:
            import distributed_ucxx  # noqa: F401
        except ImportError:
            return None
        if method == "ucxx":
            return "ucxx", workers, None, False
        if method == "ucxx+gpupool-staged":
            workers = [{**w, "config": {"gpupool": {"host-id": f"bench-host-{i}"}}} for i, w in enumerate(workers)]
        plugin = GPUPool(kind=kind, max_size=max_size)
        return "ucxx", workers, plugin, method != "ucxx+gpupool-plain"
    plugin = GPUPool(
        kind=kind,
        max_size=max_size,
    )
    if method == "gpupool":
        return "tcp", workers, plugin, True
    if method == "gpupool-plain":  # plain cupy.ones: staged into the pool
        return "tcp", workers, plugin, False
    hosts = [{**w, "config": {"gpupool": {"host-id": f"bench-host-{i}"}}} for i, w in enumerate(workers)]
    return "tcp", hosts, plugin, True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--methods",
        default="gpupool,ucxx,gpupool-copy,tcp",
        help="comma-separated; PLACEMENT:METHOD runs a method in that placement only",
    )
    p.add_argument("--placements", default="")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every method this many times, interleaved (A B A B ...): a fresh cluster each, the table shows "
        "the median over rounds, so cluster-to-cluster drift does not pass for a method's cost",
    )
    p.add_argument("--budget", type=float, default=540.0, help="seconds; later sizes are skipped past it")
    p.add_argument("--kind", default="", help="the plugin's pool kind (default: device on a GPU, else host)")
    p.add_argument("--replot", nargs="+", metavar="FILE", help="JSON results or logs to redraw (runs nothing)")
    p.add_argument("--stamp", default=None, help="name part of the files --replot writes")
    args = p.parse_args()
    if args.replot:
        merged = replot(args.replot)
        table(merged)
        plot(merged, args.stamp or time.strftime("%Y%m%d-%H%M%S") + "-replot")
        return
    sizes = [int(parse_bytes(s)) for s in args.sizes.split(",")]
    gpus = len(local_devices().uuids)
    lib = "cupy" if gpus else "numpy"
    if not gpus:
        sizes = [s for s in sizes if s <= 256 << 20]
    max_size = f"{3 * max(sizes) // (1 << 20) + 1024} MiB"
    if gpus and 3 * max(sizes) + (1 << 30) > 0.9 * device_memory(0):
        max_size = "90%"  # a limit, not a reservation: two pools of one GPU may each have it (32 GiB on an H100)
    start = time.monotonic()
    deadline = start + args.budget
    stamp = time.strftime("%Y%m%d-%H%M%S")
    result: dict[str, Any] = {
        "machine": machine(),
        "lib": lib,
        "repeats": args.repeats,
        "gpupool_config": dask.config.get("gpupool"),  # with DASK_GPUPOOL__* from the environment
        "runs": [],
    }
    places = placements(gpus)
    if args.placements:
        places = {k: v for k, v in places.items() if k in args.placements.split(",")}

    def log(msg: str) -> None:
        print(msg, flush=True)

    todo = []
    for place, workers in places.items():
        for token in args.methods.split(","):
            only, _, method = token.rpartition(":")  # "other:gpupool": that placement only
            if only and only != place:
                continue
            setup = method_setup(method, workers, gpus, max_size, args.kind)
            if setup is None:
                log(f"{place:5s} {method}: not available here, skipped")
            else:
                todo.append((place, method, setup))
    todo = todo * args.rounds
    for i, (place, method, (protocol, wopts, plugin, pool)) in enumerate(todo):
        # An equal share of what is left of the budget, so that a slow method cannot starve the rest.
        share = time.monotonic() + (deadline - time.monotonic()) / (len(todo) - i)
        log(f"{place:5s} {method} ({protocol})")
        run: dict[str, Any] = {"placement": place, "method": method, "rows": [], "stats": {}}
        if args.rounds > 1:
            run["round"] = i * args.rounds // len(todo)
        result["runs"].append(run)
        try:
            with cluster(wopts, protocol, plugin) as c:
                measure(
                    c,
                    sizes,
                    args.repeats,
                    lib,
                    pool,
                    share,
                    log,
                    plugin is not None,
                    run["rows"],
                    lambda: write(result, stamp),
                )
                run["stats"] = dask_gpupool.stats(c) if plugin is not None else {}
        except Exception as e:  # one method failing must not lose the others
            log(f"    FAILED: {type(e).__name__}: {e}")
            run["stats"] = {"error": {"message": f"{type(e).__name__}: {e}"}}
        write(result, stamp)
    table(result)
    plot(result, stamp)


def replot(paths: list[str]) -> dict[str, Any]:
    """Runs from saved JSON results and logs, each method labelled ``method (file)``."""
    import re

    runs: list[dict[str, Any]] = []
    lib = "cupy"
    for path in paths:
        name = os.path.basename(path)
        if path.endswith(".json"):
            with open(path) as f:
                saved = json.load(f)
            lib = saved.get("lib", lib)
            runs += [{**r, "method": f"{r['method']} ({name})"} for r in saved["runs"] if r["rows"]]
            continue
        run: dict[str, Any] | None = None
        with open(path) as f:
            for line in f:
                head = re.match(r"^(\w+)\s+(\S+) \((\w+)\)$", line.strip())
                row = re.match(r"^\s*([\d.]+ \w+)\s+transfer\s+([\d.]+) ms\s+task\s+([\d.]+) ms", line)
                if head:
                    run = {"placement": head.group(1), "method": f"{head.group(2)} ({name})", "rows": []}
                    runs.append(run)
                elif row and run is not None:
                    nbytes = int(parse_bytes(row.group(1).replace(" ", "")))
                    run["rows"].append(
                        {"nbytes": nbytes, "transfer_s": float(row.group(2)) / 1e3, "task_s": float(row.group(3)) / 1e3}
                    )
    return {"lib": lib, "runs": [r for r in runs if r["rows"]]}


def write(result: dict[str, Any], stamp: str) -> None:
    save_json("handoff", result, stamp)


def results_dirs() -> list[str]:
    """Where results go: ``$BENCH_RESULTS`` (default ``benchmarks/results/``) and ``$OUT`` (when set)."""
    own = os.environ.get("BENCH_RESULTS") or os.path.join(os.path.dirname(__file__), "results")
    return [d for d in (own, os.environ.get("OUT")) if d]


def save_json(prefix: str, result: dict[str, Any], stamp: str | None = None) -> None:
    """Write ``result`` as ``<prefix>-<stamp>.json`` to :func:`results_dirs`."""
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    for d in results_dirs():
        if d:
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"{prefix}-{stamp}.json"), "w") as f:
                json.dump(result, f, indent=1, default=str)


def table(result: dict[str, Any]) -> None:
    runs = _over_rounds(result["runs"])
    sizes = sorted({r["nbytes"] for run in runs for r in run["rows"]})
    print("\nconsumer transfer time, median (ms); [end-to-end dependent task]")
    width = max([13, *(len(run["method"]) for run in runs)])
    print(f"{'placement':9s} {'method':{width}s}" + "".join(f"{format_bytes(s):>18s}" for s in sizes))
    for run in runs:
        by = {r["nbytes"]: r for r in run["rows"]}
        cells = "".join(
            f"{by[s]['transfer_s'] * 1e3:9.2f} [{by[s]['task_s'] * 1e3:6.1f}]" if s in by else f"{'-':>18s}"
            for s in sizes
        )
        print(f"{run['placement']:9s} {run['method']:{width}s}{cells}")


def _over_rounds(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One run per (placement, method): with ``--rounds``, each size's median over the rounds' medians."""
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs:
        grouped.setdefault((run["placement"], run["method"]), []).append(run)
    out = []
    for (place, method), group in grouped.items():
        by_size: dict[int, list[dict[str, Any]]] = {}
        for run in group:
            for row in run["rows"]:
                by_size.setdefault(row["nbytes"], []).append(row)
        rows = [
            {
                "nbytes": n,
                "transfer_s": statistics.median(r["transfer_s"] for r in rs),
                "task_s": statistics.median(r["task_s"] for r in rs),
            }
            for n, rs in sorted(by_size.items())
        ]
        out.append({"placement": place, "method": method, "rows": rows})
    return out


def plot(result: dict[str, Any], stamp: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    runs = _over_rounds(result["runs"])
    places = sorted({run["placement"] for run in runs})
    fig, axes = plt.subplots(1, len(places), figsize=(6 * len(places), 4.5), squeeze=False)
    for ax, place in zip(axes[0], places, strict=True):
        for run in runs:
            if run["placement"] != place or not run["rows"]:
                continue
            xs = [r["nbytes"] for r in run["rows"]]
            ax.loglog(xs, [r["transfer_s"] * 1e3 for r in run["rows"]], marker="o", label=run["method"])
        ax.set_title(f"{place} ({result['lib']})")
        ax.set_xlabel("bytes")
        ax.set_ylabel("consumer transfer time (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    for d in results_dirs():
        if d:
            fig.savefig(os.path.join(d, f"handoff-{stamp}.png"), dpi=110)


if __name__ == "__main__":
    main()
