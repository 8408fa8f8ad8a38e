"""A dask.array program with and without the plugin at its default settings: what registering it costs.

Registering dask_gpupool should never make a cluster slower where it does not
help. This runs one program on the same cluster layout twice (a
fresh cluster each time), plain Dask and ``GPUPool()`` with no options, and
times each stage (median of ``--repeats``, after one warm-up), on ``--rounds`` fresh clusters per
method, interleaved, reporting the median over rounds and plain Dask's own spread between rounds:

- ``transpose``: ``(x + x.T).sum()`` — every chunk meets the chunk mirrored across the diagonal;
- ``rechunk``: ``x.rechunk(..., method="tasks")`` to row panels, then ``.sum()``;
- ``matmul``: ``(x @ x).sum()``.

Chunks are CuPy arrays when a GPU is visible (two workers per GPU, rotated
``CUDA_VISIBLE_DEVICES``), NumPy otherwise (two workers). The comm is TCP
(``--protocol ucxx`` for UCXX). Prints a table and the plugin's zero-copy and
copied bytes; writes JSON to ``benchmarks/results/`` (and ``$OUT``).

    python benchmarks/dask_array.py [--n 8192] [--chunks 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import dask.array as da
from distributed import wait
from handoff import cluster, save_json  # benchmarks/handoff.py (this directory is on sys.path when run as a script)

import dask_gpupool
from dask_gpupool.memory.topology import local_devices

STAGES = ("transpose", "rechunk", "matmul")


def program(x: Any, stage: str, chunk: int) -> Any:
    if stage == "transpose":
        return (x + x.T).sum()
    if stage == "rechunk":
        return x.rechunk((chunk // 2, x.shape[1]), method="tasks").sum()
    return (x @ x).sum()


def run(workers: list[dict[str, Any]], plugin: Any, args: argparse.Namespace, gpu: bool) -> dict[str, Any]:
    with cluster(workers, args.protocol, plugin) as c:  # the handoff benchmark's cluster: same options
        x = da.random.default_rng(42).random((args.n, args.n), chunks=args.chunks)  # the same values in each run
        if gpu:
            import cupy

            x = x.map_blocks(cupy.asarray)
        x = x.persist()
        wait(x)
        times: dict[str, float] = {}
        checks: dict[str, float] = {}
        for stage in STAGES:
            samples = []
            for i in range(args.repeats + 1):
                t0 = time.perf_counter()
                total = float(program(x, stage, args.chunks).compute())
                if i:  # the first is a warm-up
                    samples.append(time.perf_counter() - t0)
            times[stage] = statistics.median(samples)
            checks[stage] = total
        moved = {"zero_copy_bytes": 0, "copied_bytes": 0}
        if plugin is not None:
            for s in dask_gpupool.stats(c).values():
                for k in moved:
                    moved[k] += s.get(k, 0)
        return {"times": times, "checks": checks, **moved}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--chunks", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--protocol", default="tcp", choices=["tcp", "ucxx"])
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="fresh clusters per method, interleaved (plain, plugin, plain, ...); the table shows the median over "
        "rounds and the spread of plain Dask between its own rounds (fresh clusters differ by 15%% on CPU)",
    )
    args = p.parse_args()
    gpus = len(local_devices().uuids)
    gpu = gpus > 0
    if gpus >= 2:
        order = list(range(gpus))
        rotated = [",".join(map(str, order[i:] + order[:i])) for i in range(gpus)]
        workers = [{"env": {"CUDA_VISIBLE_DEVICES": r}} for r in rotated for _ in range(2)]
    else:
        workers = [{}, {}]
    labels = ("plain Dask", "with GPUPool()")
    rounds: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    for r in range(args.rounds):
        for label in labels:
            got = run(workers, None if label == "plain Dask" else dask_gpupool.GPUPool(), args, gpu)
            rounds[label].append(got)
            print(f"-- round {r}, {label}: " + ", ".join(f"{s} {t * 1e3:.1f} ms" for s, t in got["times"].items()))
    results = {
        label: {
            "times": {s: statistics.median(g["times"][s] for g in rounds[label]) for s in STAGES},
            "checks": rounds[label][0]["checks"],
            "zero_copy_bytes": sum(g["zero_copy_bytes"] for g in rounds[label]),
            "copied_bytes": sum(g["copied_bytes"] for g in rounds[label]),
            "rounds": rounds[label],
        }
        for label in labels
    }
    base, pool = results["plain Dask"], results["with GPUPool()"]
    print(
        f"\n{args.n}x{args.n} f8 in {args.chunks}-chunks, {len(workers)} workers, {'CuPy' if gpu else 'NumPy'}, "
        f"{args.protocol}; median of {args.repeats} per cluster, median over {args.rounds} clusters (ms)"
    )
    print(f"{'stage':10} {'plain Dask':>12} {'GPUPool()':>12} {'ratio':>7} {'plain spread':>13}")
    for s in STAGES:
        plain = [g["times"][s] for g in rounds["plain Dask"]]
        print(
            f"{s:10} {base['times'][s] * 1e3:>12.1f} {pool['times'][s] * 1e3:>12.1f} "
            f"{pool['times'][s] / base['times'][s]:>7.2f} {max(plain) / min(plain):>12.2f}x"
        )
    print(f"plugin: zero-copy {pool['zero_copy_bytes']} B, copied {pool['copied_bytes']} B")
    same = all(
        abs(g["checks"][s] - base["checks"][s]) <= 1e-6 * abs(base["checks"][s])
        for label in labels
        for g in rounds[label]
        for s in STAGES
    )
    print("values agree" if same else "VALUES DIFFER")
    out = {"host": platform.node(), "gpus": gpus, "args": vars(args), "results": results}
    save_json("dask_array", out)


if __name__ == "__main__":
    main()
