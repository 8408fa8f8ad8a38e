"""A multi-stage ETL on ``dask.array``, with and without dask_gpupool.

Stages: **generate** (random values and integer keys), **transform**
(pairs of chunks merged, then elementwise), **reduce by key** (per-chunk sums by key, combined across
chunks), **combine** (join-like: every value meets the per-key table). The
tasks are plain NumPy or CuPy code: with the plugin registered, a chunk that
another worker on the host asks for is copied into the producer's pool and
handed over zero-copy (from :func:`dask_gpupool.handoff.routes.stage_threshold_of`); without the plugin the
same graph runs on plain Dask.

CuPy chunks on GPU pools when GPUs are visible (``--layout shared``: all
workers on GPU 0; ``--layout per-gpu``: one worker per GPU; ``--layout
dask-cuda``: dask-cuda's ``LocalCUDACluster``, one worker per GPU), NumPy chunks
on ``host`` pools otherwise. Across GPUs with peer access, handoffs are
zero-copy too. Prints the time of each stage, the bytes handed over zero-copy and copied,
and saves a bar plot when matplotlib is installed.

    python examples/etl_pipeline.py [--size 64MiB] [--chunks 16] [--workers 3] [--layout shared]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

import dask
from dask.utils import format_bytes, parse_bytes

import dask_gpupool

KEYS = 64


def xp_of(block: Any) -> Any:
    if type(block).__module__.startswith("cupy"):
        import cupy

        return cupy
    import numpy

    return numpy


def generate(block: Any, lib: str, block_info: Any = None) -> Any:
    """Stage 1: values in [0, 1) and keys in [0, KEYS) as a (2, n) float64 block (seeded by its position)."""
    import numpy as np

    rng = np.random.default_rng(block_info[None]["chunk-location"][1])
    data = np.stack([rng.random(block.shape[-1]), rng.integers(0, KEYS, block.shape[-1]).astype("f8")])
    if lib == "cupy":
        import cupy

        data = cupy.asarray(data)
    return data


def transform(block: Any) -> Any:
    """Stage 2: values * 2 + 1 (keys unchanged)."""
    xp = xp_of(block)
    return xp.stack([block[0] * 2 + 1, block[1]])


def partial_sums(block: Any) -> Any:
    """Stage 3a: per-key sums of one chunk, shape (1, KEYS)."""
    xp = xp_of(block)
    return xp.bincount(block[1].astype("i8"), weights=block[0], minlength=KEYS)[None, :]


def add_tables(*tables: Any) -> Any:
    """Stage 3b: the per-key totals of all chunks."""
    total = tables[0].copy()
    for t in tables[1:]:
        total += t
    return total


def combine(block: Any, table: Any) -> Any:
    """Stage 4: every value divided by its key's total (a join on the key)."""
    return block[0] / table[0][block[1].astype("i8")]


def total_of(block: Any) -> float:
    return float(block.sum())


def run(client: Any, size: int, chunks: int, lib: str, pool: bool, show_progress: bool = False) -> dict[str, Any]:
    import dask.array as da
    from distributed import progress

    def wait(x: Any) -> None:
        """Dask's own progress bar (text in a terminal) when asked for; either way, until done."""
        from distributed import wait as _wait

        if show_progress:
            progress(x)
        _wait(x)

    n = size // 16  # two float64 rows
    per = max(n // chunks, 1)
    stages: dict[str, float] = {}
    before = _counters(client, pool)

    t0 = time.perf_counter()
    shape = da.zeros((2, per * chunks), chunks=(2, per), dtype="f8")
    raw = client.persist(shape.map_blocks(generate, lib, dtype="f8"))
    wait(raw)
    stages["generate"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    # Merging pairs of chunks makes most transform tasks read a chunk that another worker made.
    out = client.persist(raw.rechunk((2, 2 * per)).map_blocks(transform, dtype="f8"))
    wait(out)
    stages["transform"] = time.perf_counter() - t0

    # The last two stages use the persisted chunks' futures directly (a shuffle-free reduce and join).
    blocks = client.compute(list(out.to_delayed().ravel()))
    t0 = time.perf_counter()
    partials = [client.submit(partial_sums, b, pure=False) for b in blocks]
    table = client.submit(add_tables, *partials, pure=False)
    wait(table)
    stages["reduce by key"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    joined = [client.submit(combine, b, table, pure=False) for b in blocks]
    sums = [client.submit(total_of, j, pure=False) for j in joined]
    wait(sums)
    total = sum(client.gather(sums))
    stages["combine"] = time.perf_counter() - t0

    after = _counters(client, pool)
    return {
        "stages": stages,
        "check": total,
        "counted": pool,
        "zero_copy_bytes": after["zero_copy_bytes"] - before["zero_copy_bytes"],
        "copied_bytes": after["copied_bytes"] - before["copied_bytes"],
    }


def _counters(client: Any, pool: bool) -> dict[str, int]:
    if not pool:  # plain Dask: nothing counts handoffs
        return {"zero_copy_bytes": 0, "copied_bytes": 0}
    stats = dask_gpupool.stats(client)
    return {k: sum(s[k] for s in stats.values()) for k in ("zero_copy_bytes", "copied_bytes")}


def cluster(workers: list[dict[str, Any]], plugin: Any, dask_cuda: bool = False) -> Any:
    from distributed import Client, Nanny, Scheduler, SpecCluster

    if dask_cuda:
        from dask_cuda import LocalCUDACluster

        cl = LocalCUDACluster(
            host="127.0.0.1", threads_per_worker=1, dashboard_address="127.0.0.1:0", silence_logs=logging.WARNING
        )
    else:
        # on 127.0.0.1 only (dashboards included), as a LocalCluster does
        loopback = {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"}
        specs = {
            f"w{i}": {"cls": Nanny, "options": {"nthreads": 1, "silence_logs": logging.WARNING, **loopback, **w}}
            for i, w in enumerate(workers)
        }
        sched = {"cls": Scheduler, "options": loopback}
        cl = SpecCluster(workers=specs, scheduler=sched, silence_logs=logging.WARNING)
    client = Client(cl)
    client.wait_for_workers(len(workers))
    if plugin is not None:
        client.register_plugin(plugin)
    return cl, client


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="64MiB", help="bytes of the generated data")
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--workers", type=int, default=3, help="workers (on GPU 0 with --layout shared)")
    p.add_argument("--layout", choices=["shared", "per-gpu", "dask-cuda"], default="shared")
    p.add_argument("--plot", default="etl_pipeline.png")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=sys.stdout.isatty(),
        help="show Dask's progress bar for each stage (default: when printing to a terminal)",
    )
    args = p.parse_args()
    from dask_gpupool.memory.topology import local_devices

    gpus = len(local_devices().uuids)
    lib = "cupy" if gpus else "numpy"
    if gpus and args.layout != "shared":
        order = list(range(gpus))
        workers = [{"env": {"CUDA_VISIBLE_DEVICES": ",".join(map(str, order[i:] + order[:i]))}} for i in range(gpus)]
    else:
        workers = [{"env": {"CUDA_VISIBLE_DEVICES": "0"}} if gpus else {} for _ in range(args.workers)]
    size = int(parse_bytes(args.size))
    print(
        f"ETL on dask.array: {format_bytes(size)} in {args.chunks} chunks, {len(workers)} workers, "
        f"{lib} chunks, layout {args.layout if gpus else 'host (no GPU)'}"
    )
    results = {}
    for label, plugin in [
        ("plain Dask", None),
        (
            "dask_gpupool",
            dask_gpupool.GPUPool(max_size=f"{4 * size // (1 << 20) + 64} MiB"),
        ),
    ]:
        with dask.config.set({"distributed.scheduler.active-memory-manager.start": False}):
            cl, client = cluster(workers, plugin, dask_cuda=bool(gpus) and args.layout == "dask-cuda")
            with cl, client:
                print(f"-- {label}", flush=True)
                results[label] = run(client, size, args.chunks, lib, plugin is not None, args.progress)
    print(f"\n{'stage':16}" + "".join(f"{k:>16}" for k in results))
    for stage in next(iter(results.values()))["stages"]:
        print(f"{stage:16}" + "".join(f"{r['stages'][stage] * 1e3:>13.1f} ms" for r in results.values()))
    for label, r in results.items():
        moved = (
            f"zero-copy {format_bytes(r['zero_copy_bytes'])}, copied {format_bytes(r['copied_bytes'])}"
            if r["counted"]
            else "every transfer is Dask's own (no plugin, nothing counted)"
        )
        print(f"{label}: {moved}, check {r['check']:.3f}")
    checks = [r["check"] for r in results.values()]
    ok = all(abs(c - checks[0]) <= 1e-6 * abs(checks[0]) for c in checks)
    _plot(results, args.plot)
    print("OK" if ok else "MISMATCH")
    if not ok:
        raise SystemExit(1)


def _plot(results: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    stages = list(next(iter(results.values()))["stages"])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(results)
    for i, (label, r) in enumerate(results.items()):
        ax.bar([s + i * width for s in range(len(stages))], [r["stages"][s] * 1e3 for s in stages], width, label=label)
    ax.set_xticks([s + width * (len(results) - 1) / 2 for s in range(len(stages))], stages)
    ax.set_ylabel("ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
