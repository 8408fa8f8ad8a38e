"""``examples/etl_pipeline.py`` with and without the plugin at its defaults: interleaved rounds, per-stage times.

The example's tasks are plain NumPy (CuPy on a GPU) code; with the plugin registered, a chunk another worker asks
for is staged into the producer's pool and handed over. Each round starts a fresh cluster per method (``plain``:
no plugin; ``gpupool``: ``GPUPool`` as the example registers it), the order alternating round by round, and runs
the pipeline ``--repeats`` times after one warm-up. Per run: each stage's time and their sum, the bytes Dask moved
between the workers (the sum of their ``transfer_incoming_log`` totals), of which the plugin handed over zero-copy
(its ``zero_copy_bytes``); the rest were copied. Medians per round, then the median over rounds (with their
min-max), and the pair ratio of each round (plugin ÷ plain); with the plugin, where its handoffs' time went
(``timings``, as ``benchmarks/workloads.py`` prints them). JSON to ``benchmarks/results/etl_pipeline-*.json``::

    python benchmarks/etl_pipeline.py [--size 64MiB] [--chunks 16] [--workers 3] [--rounds 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import platform
import statistics
import sys
from typing import Any

import dask
from dask.utils import format_bytes, parse_bytes

sys.path.insert(0, os.path.dirname(__file__))
import handoff as H  # benchmarks/handoff.py: machine, save_json, steps_since, steps_line

import dask_gpupool
from dask_gpupool.memory.topology import local_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example() -> Any:
    """``examples/etl_pipeline.py`` as a module."""
    spec = importlib.util.spec_from_file_location("etl_pipeline", os.path.join(ROOT, "examples", "etl_pipeline.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _transferred(dask_worker: Any) -> int:
    return int(sum(t.get("total", 0) for t in dask_worker.transfer_incoming_log))


def one_cluster(etl: Any, method: str, args: argparse.Namespace, lib: str, workers: list[dict[str, Any]]) -> Any:
    """The pipeline's runs on a fresh cluster of ``method``: per run its stages, total and bytes."""
    size = int(parse_bytes(args.size))
    plugin = dask_gpupool.GPUPool(max_size=f"{4 * size // (1 << 20) + 64} MiB") if method == "gpupool" else None
    runs = []
    with dask.config.set({"distributed.scheduler.active-memory-manager.start": False}):
        cl, client = etl.cluster(workers, plugin)
        with cl, client:
            for i in range(args.repeats + 1):
                moved = sum(client.run(_transferred).values())
                stats = dask_gpupool.stats(client) if plugin is not None else {}
                r = etl.run(client, size, args.chunks, lib, plugin is not None)
                total = sum(r["stages"].values())  # the pipeline's own time: reading the counters is not timed
                moved = sum(client.run(_transferred).values()) - moved
                steps = H.steps_since(stats, dask_gpupool.stats(client)) if plugin is not None else {}
                if i:  # the first is a warm-up
                    runs.append(
                        {
                            "total_s": total,
                            "stages": r["stages"],
                            "check": r["check"],
                            "moved_bytes": moved,
                            "zero_copy_bytes": r["zero_copy_bytes"],
                            "copied_bytes": max(moved - r["zero_copy_bytes"], 0),
                            "timings": steps,
                        }
                    )
    if plugin is not None:
        print(f"   steps of the last run: {H.steps_line(runs[-1]['timings'])}", flush=True)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="64MiB", help="bytes of the generated data")
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    logging.getLogger("distributed").setLevel(logging.ERROR)
    etl = _example()
    gpus = len(local_devices().uuids)
    lib = "cupy" if gpus else "numpy"
    workers = [{"env": {"CUDA_VISIBLE_DEVICES": "0"}} if gpus else {} for _ in range(args.workers)]
    methods = ["plain", "gpupool"]
    rounds: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in methods}
    for r in range(args.rounds):
        for method in methods if r % 2 == 0 else methods[::-1]:
            runs = one_cluster(etl, method, args, lib, workers)
            rounds[method].append(runs)
            med = statistics.median(x["total_s"] for x in runs)
            zc = statistics.median(x["zero_copy_bytes"] for x in runs)
            cp = statistics.median(x["copied_bytes"] for x in runs)
            print(
                f"round {r} {method:8} {med * 1e3:8.1f} ms  "
                f"zero-copy {format_bytes(zc):>10}  copied {format_bytes(cp):>10}",
                flush=True,
            )
    summary: dict[str, Any] = {}
    stages = list(rounds["plain"][0][0]["stages"])
    for method in methods:
        per_round = {
            key: [statistics.median(run["stages"][key] if key in stages else run[key] for run in runs) for runs in rs]
            for rs in [rounds[method]]
            for key in [*stages, "total_s", "zero_copy_bytes", "copied_bytes"]
        }
        summary[method] = {k: {"median": statistics.median(v), "rounds": v} for k, v in per_round.items()}
    plugin_s, plain_s = summary["gpupool"]["total_s"]["rounds"], summary["plain"]["total_s"]["rounds"]
    ratios = [a / b for a, b in zip(plugin_s, plain_s, strict=True)]
    summary["ratio_rounds"] = ratios
    print(f"\n{format_bytes(parse_bytes(args.size))} in {args.chunks} chunks, {args.workers} workers, {lib}; ms")
    print(f"{'stage':16}{'plain Dask':>26}{'plugin':>26}")
    for key in [*stages, "total_s"]:
        cells = ""
        for method in methods:
            s = summary[method][key]
            cells += f"{s['median'] * 1e3:>10.1f} ({min(s['rounds']) * 1e3:.0f}-{max(s['rounds']) * 1e3:.0f})".rjust(26)
        print(f"{key.removesuffix('_s'):16}{cells}")
    for method in methods:
        s = summary[method]
        print(
            f"{method}: zero-copy {format_bytes(s['zero_copy_bytes']['median'])}, "
            f"copied {format_bytes(s['copied_bytes']['median'])}"
        )
    print(f"plugin / plain, per round: {', '.join(f'{x:.2f}' for x in ratios)}")
    checks = {run["check"] for rs in rounds.values() for runs in rs for run in runs}
    ok = max(checks) - min(checks) <= 1e-6 * max(abs(c) for c in checks)
    print("values agree" if ok else "VALUES DIFFER")
    out = {"host": platform.node(), "machine": {**H.machine(), "cpus": os.cpu_count()}, "args": vars(args)}
    H.save_json("etl_pipeline", {**out, "lib": lib, "summary": summary, "rounds": rounds})


if __name__ == "__main__":
    main()
