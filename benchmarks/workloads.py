"""Real ``dask.array`` programs with and without dask_gpupool at its defaults: wall time and bytes copied.

A user who adds the plugin should get zero-copy for what GPU Dask programs make,
without changing a line of task code, and never be slower than Dask over UCXX.
This runs each workload on the same cluster layout with each
method (a fresh cluster per method and round, interleaved; each round starts one method later than the one
before, so that no method always follows the same one) and reports:

- the wall time of ``.compute()`` (median of ``--repeats`` after one warm-up,
  then the median over ``--rounds`` clusters), from one input layout in every cluster
  (``--placement bands``: columns of blocks in one contiguous band per worker);
- the bytes Dask moved between workers that did *not* go zero-copy: the sum of
  every worker's ``transfer_incoming_log`` totals, less the plugin's
  ``zero_copy_bytes`` (all workers share one host here, so every such byte is a
  same-host copy);
- the plugin's fallbacks by reason, and where its handoffs' time went (``timings``: count, seconds and the
  histogram per step, summed over workers, of the last round, printed as mean and median; see
  ``dask_gpupool.handoff.stats.TIMED_STEPS``).

Workloads (``x`` is an ``n x n`` float64 array of ``chunk``-sized blocks, CuPy
when a GPU is visible, NumPy otherwise): ``elementwise`` ``(x + 2 * x.T).sum()``;
``matmul`` ``(x @ x).sum()``; ``tensordot`` ``tensordot(x, x, ([0], [0])).sum()``;
``rechunk`` to row panels (task rechunk); ``slicing`` strided slices and fancy
indexing; ``reduction`` ``x.mean(axis=0)`` and ``x.std()``; ``map_overlap``
a halo exchange of depth 8; ``rmm_objects`` every block copied into an ``rmm.DeviceBuffer`` (a value
distributed splits into device frames), each summed with the next block's. Methods: ``tcp`` and ``ucxx``
(plain Dask), ``local`` (the floor: one worker with the layout's threads on its first GPU, so nothing moves
between workers) and ``gpupool`` / ``ucxx+gpupool`` (``GPUPool()`` with no options), and variants with one option
``gpupool+legacy`` (``segment-memory: legacy``; ``ucxx+gpupool+legacy`` over UCX), ``ucxx+gpupool+vmm``
(``segment-memory: vmm``: VMM segments over UCX, where ``auto`` makes legacy ones); any of them
with ``-nohooks`` after it (``ucxx+gpupool-nohooks``): the plugin's ``get_data`` wrapper and CuPy serializers
swapped for distributed's own once it is registered, what the rest of the plugin costs; or ``-bare``: every
worker-side hook undone, only its pool, broker and copy server running; or ``-gone``: its worker plugin
unregistered again (what stays behind in the processes); or ``-ab``: one cluster, every repeat run with the hooks
in place and without them, back to back, the two sides alternating run by run (``ab:`` lines, ``ab_rounds`` in the
JSON); or ``-inline-ab``: the same with replies of device values and staged CuPy arrays serialized on the event loop
(``on``) or in Dask's offload thread (``off``); or ``-hostframes-ab``: small
CuPy arrays in UCX replies as one host frame (``dask_gpupool.tuning.UCX_HOST_FRAME_THRESHOLD`` at its value, ``on``)
or as device frames (``off``); or ``-receive-ab``: device frames received into the plugin's UCX receive pool (``on``,
:mod:`dask_gpupool.dask.ucx_receive`) or as distributed-ucxx does by itself (``off``). Layouts on a
GPU machine: ``two-per-gpu`` and ``one-per-gpu``; two workers without a GPU.

JSON rows ``{workload, layout, method, median_s, copied_bytes, ...}`` go to
``benchmarks/results/workloads-*.json`` (and ``$OUT``)::

    python benchmarks/workloads.py [--n 8192] [--chunk 2048] [--repeats 3] [--rounds 2]
        [--methods tcp,ucxx,gpupool] [--layouts two-per-gpu,one-per-gpu] [--workloads matmul,rechunk]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import dask.array as da
from distributed import wait
from handoff import (  # benchmarks/handoff.py (this directory is on sys.path when run as a script)
    cluster,
    results_dirs,
    save_json,
    steps_line,
    steps_since,
)
from ucx_pairs import (
    _set_hooks,  # benchmarks/ucx_pairs.py: the plugin's hooks swapped for distributed's own
    _set_host_frames,  # benchmarks/ucx_pairs.py: dask_gpupool.tuning.UCX_HOST_FRAME_THRESHOLD on every worker
    _set_inline,  # benchmarks/ucx_pairs.py: the plugin's inline replies switched on or off
    _set_receive,  # benchmarks/ucx_pairs.py: where distributed-ucxx receives device frames
)

import dask_gpupool
from dask_gpupool.memory.topology import local_devices
from dask_gpupool.tuning import UCX_HOST_FRAME_THRESHOLD


def _device_buffer(block: Any) -> Any:
    """A block's bytes as an ``rmm.DeviceBuffer`` (a NumPy copy without a GPU): a value made of device frames."""
    if not hasattr(block, "__cuda_array_interface__"):
        return block.copy()
    import rmm

    return rmm.DeviceBuffer(ptr=int(block.data.ptr), size=int(block.nbytes))


def _pair_sum(a: Any, b: Any) -> float:
    """The float64 sum of two buffers' bytes, on the GPU for device buffers."""
    if not hasattr(a, "__cuda_array_interface__"):
        return float(a.sum() + b.sum())
    import cupy

    return float(cupy.asarray(a).view(cupy.float64).sum() + cupy.asarray(b).view(cupy.float64).sum())


def _rmm_objects(x: Any, c: int) -> list[Any]:
    """Every block as an ``rmm.DeviceBuffer``, each summed with the next one's: every buffer crosses to a neighbour."""
    import dask

    bufs = [dask.delayed(_device_buffer)(b) for b in x.to_delayed().ravel()]
    pairs = [dask.delayed(_pair_sum)(bufs[i], bufs[(i + 1) % len(bufs)]) for i in range(len(bufs))]
    return [dask.delayed(sum)(pairs)]


WORKLOADS: dict[str, Callable[[Any, int], list[Any]]] = {
    "elementwise": lambda x, c: [(x + 2 * x.T).sum()],
    "matmul": lambda x, c: [(x @ x).sum()],
    "tensordot": lambda x, c: [da.tensordot(x, x, axes=([0], [0])).sum()],
    "rechunk": lambda x, c: [x.rechunk((c // 2, x.shape[1]), method="tasks").sum()],
    "slicing": lambda x, c: [x[::3, 1::2].sum(), x[[1, 7, c + 3, 2 * c + 5, x.shape[0] - 1]].sum()],
    "reduction": lambda x, c: [x.mean(axis=0).sum(), x.std()],
    "map_overlap": lambda x, c: [x.map_overlap(lambda b: b * 0.5, depth=8, boundary="none").sum()],
    "rmm_objects": _rmm_objects,
}


#: Method suffixes after ``gpupool``: option overrides measured against the defaults (``""``).
VARIANTS: dict[str, dict[str, Any]] = {
    "": {},
    "+legacy": {"segment_memory": "legacy"},  # segments of cuMemAlloc memory shared by legacy IPC handles
    "+vmm": {"segment_memory": "vmm"},  # VMM segments over UCX too (auto makes legacy ones there since 2026-11-25)
}


#: Method suffix (after any variant): the plugin's ``get_data`` wrapper and CuPy serializers replaced by distributed's
#: own on every worker once the plugin is registered, its pool, threads and task events left in place: what the
#: plugin's presence costs apart from its hooks (``benchmarks/ucx_pairs.py``'s ``-hooks-ab`` switch).
NO_HOOKS = "-nohooks"
#: Method suffix: every worker-side hook of the plugin undone once it is registered (the ``get_data`` wrapper, the CuPy
#: serializers, the comm read wrapper, the process-memory wrapper, task events, the stats push), its pool, broker,
#: copy server and their threads left running: what those cost alone.
BARE = "-bare"
#: Method suffix: the plugin registered, then its worker plugin unregistered (its teardown: hooks undone, pool and
#: broker closed): what stays behind in the worker processes (modules, CUDA state) costs.
GONE = "-gone"
#: Method suffix: one cluster with the plugin, every repeat run twice back to back, with its ``get_data`` wrapper and
#: CuPy serializers in place (``on``) and swapped for distributed's own (``off``: the comm's own path, the pool idle),
#: in alternating order: the plugin's path against the comm's without the noise between clusters (on one H100,
#: 2026-11-24, one cluster's every workload ran 10% slower or faster than another's of the same method). Its row's
#: time is the ``on`` side's, its bytes those of both sides' runs; :func:`_print_ab` prints the pairs.
#:
#: The sides alternate run by run (on, off, on, off, ...; off first in odd rounds), so no two runs in a row are of
#: one side. Pairs that reverse the last one's order (off-on, on-off, ...) put a new cluster's sixth and seventh
#: runs of its first workload both on ``on``, and one of those is slow in a new cluster (UCXX alone too): on one
#: H100 (2026-11-24), in 23 new UCX clusters, the slower of the two took 1.85-3.7x the median of the cluster's other
#: runs, which made the plugin's hooks look 1.9x slower with three pairs
#: (``workloads-20261124-060452-h100x1-ucx-ab-defaults.json``); with alternating runs the slow run falls on either
#: side (``workloads-20261124-062514-h100x1-ucx-ab-alternating.json``).
AB = "-ab"
#: Method suffix: as ``-ab``, the two sides the plugin as it is (``on``) and with replies of device values and staged
#: CuPy arrays serialized in Dask's offload thread, the staging copy for UCX waited for (``off``;
#: ``benchmarks/ucx_pairs.py``'s ``-inline-ab`` switch).
INLINE_AB = "-inline-ab"
#: Method suffix: as ``-ab``, the two sides small CuPy arrays in UCX replies sent as one host frame
#: (``dask_gpupool.tuning.UCX_HOST_FRAME_THRESHOLD`` at its value, ``on``) and as device frames (the threshold 0,
#: ``off``).
HOSTFRAMES_AB = "-hostframes-ab"
#: Method suffix: as ``-ab``, the two sides device frames received into the plugin's UCX receive pool
#: (as the plugin sets it, ``on``) and as distributed-ucxx does by itself (``off``).
RECEIVE_AB = "-receive-ab"


def _bare(dask_worker: Any = None) -> None:
    """On a worker: the plugin's hooks undone, its service left running (the ``-bare`` methods)."""
    from dask_gpupool.dask.distributed_seam.workers import count_own_memory_only, fill_after_read
    from dask_gpupool.dask.worker_plugin import PLUGIN_NAME

    _set_hooks(["get_data", "serializers"], dask_worker=dask_worker)
    fill_after_read(dask_worker, undo=True)
    count_own_memory_only(dask_worker, undo=True)
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    if plugin is not None:
        plugin._task_events = None  # its transition hook returns at once
        if plugin._push is not None:
            plugin._push.stop()


def layouts(gpus: int) -> dict[str, list[dict[str, Any]]]:
    if gpus == 0:
        return {"cpu": [{}, {}]}
    order = list(range(gpus))
    rotated = [",".join(map(str, order[i:] + order[:i])) for i in range(gpus)]
    out = {"two-per-gpu": [{"env": {"CUDA_VISIBLE_DEVICES": r}} for r in rotated for _ in range(2)]}
    if gpus >= 2:
        out["one-per-gpu"] = [{"env": {"CUDA_VISIBLE_DEVICES": r}} for r in rotated]
    return out


def method_setup(method: str, gpus: int) -> tuple[str, Any] | None:
    """(protocol, plugin) for a method, or ``None`` where it cannot run here."""
    protocol = "ucxx" if method.startswith("ucxx") else "tcp"  # "local" too: one worker, no comm in use
    if protocol == "ucxx":
        if not gpus:
            return None
        try:
            import distributed_ucxx  # noqa: F401
        except ImportError:
            return None
    if "gpupool" not in method:
        return protocol, None
    variant = method.split("gpupool", 1)[1]
    # what is done to the plugin once registered, not options
    for suffix in (NO_HOOKS, BARE, GONE, INLINE_AB, HOSTFRAMES_AB, RECEIVE_AB, AB):
        variant = variant.removesuffix(suffix)
    return protocol, dask_gpupool.GPUPool(**VARIANTS[variant])


def _transferred(dask_worker: Any) -> int:
    return int(sum(t.get("total", 0) for t in dask_worker.transfer_incoming_log))


def _dask_seconds(dask_worker: Any) -> dict[str, float]:
    """Dask's own fine performance metrics of this worker (``digests_total``), in seconds, by what they measure:
    ``execute <activity>`` summed over every task, ``gather-dep <activity>`` and ``get-data <activity>``."""
    out: dict[str, float] = {}
    for key, value in dask_worker.digests_total.items():
        if not isinstance(key, tuple) or key[-1] != "seconds" or key[0] not in ("execute", "gather-dep", "get-data"):
            continue
        name = f"{key[0]} {key[-2]}"
        out[name] = out.get(name, 0.0) + float(value)
    return out


def _seconds_since(c: Any, before: dict[str, dict[str, float]]) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The change in :func:`_dask_seconds` summed over the workers since ``before``, and the new snapshot."""
    now = c.run(_dask_seconds)
    total: dict[str, float] = {}
    for w, d in now.items():
        for k, v in d.items():
            total[k] = total.get(k, 0.0) + v - before.get(w, {}).get(k, 0.0)
    return total, now


def _in_bands(c: Any, x: Any) -> Any:
    """``x`` persisted with its columns of blocks in contiguous bands, one band per worker (by address order).

    ``x.persist()`` leaves where each block lands to the scheduler, which differs between clusters: over twelve
    clusters of UCXX alone on one H100, map_overlap moved 47-243 MB a run and ``rmm_objects`` 973-1207 MB, and
    their times moved with them. Fixed bands make every cluster of every method start from the same layout. The
    values are those of ``x.persist()``: each block is computed by its own graph, pinned to its band's worker.
    Bands of columns, so that the task rechunk (into rows of the full width) gathers blocks from every worker; with
    bands of rows (4891319, two calls on 2026-11-24) it moved nothing.
    """
    import numpy as np

    addrs = sorted(c.scheduler_info()["workers"])
    blocks = x.to_delayed()
    rows, cols = blocks.shape
    futures = {
        (i, j): c.compute(blocks[i, j], workers=[addrs[j * len(addrs) // cols]], allow_other_workers=False)
        for i, j in np.ndindex(rows, cols)
    }
    wait(list(futures.values()))
    return da.block(
        [
            [
                da.from_delayed(futures[i, j], shape=(x.chunks[0][i], x.chunks[1][j]), dtype=x.dtype, meta=x._meta)
                for j in range(cols)
            ]
            for i in range(rows)
        ]
    )


def run(
    workers: list[dict[str, Any]], method: str, todo: list[str], args: argparse.Namespace, gpu: bool, round_: int = 0
) -> Any:
    setup = method_setup(method, len(local_devices().uuids))
    if setup is None:
        return None
    protocol, plugin = setup
    if method == "local":  # the floor: every task on one worker with all the layout's threads, nothing moves
        workers = [dict(workers[0], nthreads=len(workers))]
    out = {}
    with cluster(workers, protocol, plugin) as c:
        if method.endswith(NO_HOOKS):
            c.run(_set_hooks, off=["get_data", "serializers"])
        elif method.endswith(BARE):
            c.run(_bare)
        elif method.endswith(GONE):
            from dask_gpupool.dask.worker_plugin import PLUGIN_NAME

            c.unregister_worker_plugin(PLUGIN_NAME)
        x = da.random.default_rng(42).random((args.n, args.n), chunks=args.chunk)
        if gpu:
            import cupy

            x = x.map_blocks(cupy.asarray)
        x = _in_bands(c, x) if args.placement == "bands" else x.persist()
        wait(x)
        for name in todo:
            before = sum(c.run(_transferred).values())
            stats_before = dask_gpupool.stats(c) if plugin is not None else {}
            _, dask_before = _seconds_since(c, {})
            samples, values = [], []
            ab: dict[str, list[float]] = {"on": [], "off": []}
            ab_dask: dict[str, dict[str, float]] = {"on": {}, "off": {}}  # Dask's metrics of each side's timed runs
            for i in range(args.repeats + 1):
                if method.endswith(AB):  # both ways back to back, every run the other side (see AB)
                    for side in ("on", "off") if round_ % 2 == 0 else ("off", "on"):
                        if method.endswith(INLINE_AB):
                            c.run(_set_inline, side == "on")
                        elif method.endswith(HOSTFRAMES_AB):
                            c.run(_set_host_frames, UCX_HOST_FRAME_THRESHOLD if side == "on" else 0)
                        elif method.endswith(RECEIVE_AB):
                            c.run(_set_receive, "plugin" if side == "on" else "default")
                        else:
                            c.run(_set_hooks, off=[] if side == "on" else ["get_data", "serializers"])
                        _, side_before = _seconds_since(c, {})
                        t0 = time.perf_counter()
                        values = [float(v) for v in c.compute(WORKLOADS[name](x, args.chunk), sync=True)]
                        if i:
                            ab[side].append(time.perf_counter() - t0)
                            for k, v in _seconds_since(c, side_before)[0].items():
                                ab_dask[side][k] = ab_dask[side].get(k, 0.0) + v
                    if method.endswith(INLINE_AB):
                        c.run(_set_inline, True)
                    elif method.endswith(HOSTFRAMES_AB):
                        c.run(_set_host_frames, UCX_HOST_FRAME_THRESHOLD)
                    elif method.endswith(RECEIVE_AB):
                        c.run(_set_receive, "plugin")
                    else:
                        c.run(_set_hooks, off=[])
                    samples = ab["on"]
                    continue
                t0 = time.perf_counter()
                values = [float(v) for v in c.compute(WORKLOADS[name](x, args.chunk), sync=True)]
                if i:  # the first is a warm-up
                    samples.append(time.perf_counter() - t0)
            moved = sum(c.run(_transferred).values()) - before
            dask_s, _ = _seconds_since(c, dask_before)  # all runs, the warm-up's too
            zero_copy, fallbacks, timings = 0, {}, {}
            if plugin is not None:
                stats_after = dask_gpupool.stats(c)
                timings = steps_since(stats_before, stats_after)  # where the handoffs' time went, all workers
                for w, s in stats_after.items():
                    was = stats_before.get(w, {})
                    zero_copy += s.get("zero_copy_bytes", 0) - was.get("zero_copy_bytes", 0)
                    for reason, n in s.get("fallbacks", {}).items():
                        d = n - was.get("fallbacks", {}).get(reason, 0)
                        if d:
                            fallbacks[reason] = fallbacks.get(reason, 0) + d
            out[name] = {
                "median_s": statistics.median(samples),
                "samples": samples,
                "moved_bytes": moved,
                "zero_copy_bytes": zero_copy,
                "copied_bytes": max(moved - zero_copy, 0),
                "fallbacks": fallbacks,
                "timings": timings,
                "values": values,
                "dask_s": dask_s,
            }
            row = out[name]
            print(
                f"   {method:14} {name:12} {row['median_s'] * 1e3:9.1f} ms  copied {row['copied_bytes']:>13,} B"
                f"  zero-copy {zero_copy:>13,} B  {fallbacks or ''}",
                flush=True,
            )
            # where the workers' time went by Dask's own metrics, per run (ms, summed over the workers)
            per_run = {k: v / (args.repeats + 1) for k, v in dask_s.items() if v > 0}
            print(
                f"   {'':14} {'':12} dask: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(per_run.items())),
                flush=True,
            )
            if timings:  # mean (and median, from the histograms) per step over every handoff of the repeats
                print(f"   {'':14} {'':12} steps: {steps_line(timings)}", flush=True)
            if ab["off"]:
                out[name]["ab"] = {**ab, "dask_s": ab_dask}
                print(
                    f"   {'':14} {'':12} ab: on {statistics.median(ab['on']) * 1e3:.1f} ms, off "
                    f"{statistics.median(ab['off']) * 1e3:.1f} ms, on faster in "
                    f"{sum(a < b for a, b in zip(ab['on'], ab['off'], strict=True))} of {len(ab['on'])} pairs",
                    flush=True,
                )
                # Dask's metrics per run of each side (ms, summed over the workers), where they differ most
                n = len(ab["on"])
                diff = {
                    k: (ab_dask["on"].get(k, 0.0) - ab_dask["off"].get(k, 0.0)) / n
                    for k in {*ab_dask["on"], *ab_dask["off"]}
                }
                top = sorted(diff, key=lambda k: -abs(diff[k]))[:5]
                print(
                    f"   {'':14} {'':12} ab dask on/off: "
                    + ", ".join(
                        f"{k} {ab_dask['on'].get(k, 0.0) / n * 1e3:.1f}/{ab_dask['off'].get(k, 0.0) / n * 1e3:.1f}"
                        for k in top
                    ),
                    flush=True,
                )
    return out


def _print_ab(layout: str, rows: list[dict[str, Any]]) -> None:
    """The ``-ab`` methods' table: per workload both paths' median (ms), the median of the pairs' ratios (the
    plugin's path ÷ the comm's), and the pairs where the plugin's path was faster."""
    if not rows:
        return
    print(f"{layout}, both paths in one cluster (-ab): on / off ms, median pair ratio, on faster")
    for r in rows:
        on = [x for ab in r["ab_rounds"] for x in ab["on"]]
        off = [x for ab in r["ab_rounds"] for x in ab["off"]]
        ratio = statistics.median(a / b for a, b in zip(on, off, strict=True))
        faster = sum(a < b for a, b in zip(on, off, strict=True))
        print(
            f"  {r['method']:24} {r['workload']:12} {statistics.median(on) * 1e3:8.1f} / "
            f"{statistics.median(off) * 1e3:8.1f}  {ratio:5.2f}  {faster} of {len(on)}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--rounds", type=int, default=2, help="fresh clusters per method, interleaved, the order rotated each round"
    )
    p.add_argument("--methods", default="tcp,ucxx,gpupool,ucxx+gpupool")
    p.add_argument("--layouts", default="", help="comma-separated (default: all for this machine)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument(
        "--placement",
        choices=("bands", "scheduler"),
        default="bands",
        help="where the input's blocks live: columns in one band per worker (the same in every cluster), or wherever "
        "the scheduler puts them (before 2026-11-24 04:40)",
    )
    p.add_argument("--replot", metavar="FILE", help="a JSON result to draw again (runs nothing)")
    p.add_argument("--out", default="", help="with --replot: the PNG to write (default: beside the JSON)")
    args = p.parse_args()
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        plot(saved["rows"], args.out or args.replot.removesuffix(".json") + ".png")
        return
    gpus = len(local_devices().uuids)
    todo = [w for w in args.workloads.split(",") if w]
    unknown = set(todo) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}; known: {', '.join(WORKLOADS)}")
    places = layouts(gpus)
    if args.layouts:
        places = {k: v for k, v in places.items() if k in args.layouts.split(",")}
    methods = [m for m in args.methods.split(",") if m]
    hookless = [m for m in methods if "gpupool" not in m and m.endswith((NO_HOOKS, BARE, GONE, AB))]
    if hookless:
        p.error(f"{', '.join(hookless)}: {NO_HOOKS}, {BARE}, {GONE} and {AB} switch the plugin's hooks (gpupool only)")
    raw: dict[tuple[str, str], list[Any]] = {}
    for layout, workers in places.items():
        for r in range(args.rounds):
            for method in methods[r % len(methods) :] + methods[: r % len(methods)]:  # each round starts one later
                print(f"-- {layout}, round {r}, {method}", flush=True)
                raw.setdefault((layout, method), []).append(run(workers, method, todo, args, gpus > 0, r))
    rows = []
    for (layout, method), rounds in raw.items():
        if any(r is None for r in rounds):
            print(f"{layout} {method}: not available here")
            continue
        for name in todo:
            per = [r[name] for r in rounds]
            rows.append(
                {
                    "workload": name,
                    "layout": layout,
                    "method": method,
                    "median_s": statistics.median(x["median_s"] for x in per),
                    "copied_bytes": statistics.median(x["copied_bytes"] for x in per),
                    "zero_copy_bytes": statistics.median(x["zero_copy_bytes"] for x in per),
                    "fallbacks": per[-1]["fallbacks"],
                    "timings": per[-1]["timings"],
                    "rounds_s": [x["median_s"] for x in per],
                    "samples_rounds": [x["samples"] for x in per],  # each round's timed runs, in order
                    "dask_s_rounds": [x["dask_s"] for x in per],  # Dask's metrics of each round's runs, summed
                    "ab_rounds": [x["ab"] for x in per if "ab" in x],  # -ab: each round's samples both ways
                    "values": per[0]["values"],
                }
            )
    print(f"\n{args.n}x{args.n} f8 in {args.chunk}-chunks, {'CuPy' if gpus else 'NumPy'}; ms (copied MiB)")
    for layout in places:
        present = [m for m in methods if any(r["layout"] == layout and r["method"] == m for r in rows)]
        width = {m: max(22, len(m) + 2) for m in present}
        print(f"{layout:12} " + "".join(f"{m:>{width[m]}}" for m in present))
        for name in todo:
            cells = {r["method"]: r for r in rows if r["layout"] == layout and r["workload"] == name}
            print(
                f"  {name:10} "
                + "".join(
                    f"{cells[m]['median_s'] * 1e3:>{width[m] - 9}.1f} ({cells[m]['copied_bytes'] / 2**20:>6.0f})"
                    for m in present
                )
            )
        _print_ab(layout, [r for r in rows if r["layout"] == layout and r["ab_rounds"]])
    agree = all(
        all(abs(a - b) <= 1e-6 * max(abs(a), 1.0) for a, b in zip(r["values"], ref["values"], strict=True))
        for r in rows
        for ref in rows
        if ref["workload"] == r["workload"]
    )
    print("values agree across methods" if agree else "VALUES DIFFER between methods")
    out = {"host": platform.node(), "gpus": gpus, "args": vars(args), "rows": rows}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    save_json("workloads", out, stamp)
    for d in results_dirs():
        if d:
            plot(rows, os.path.join(d, f"workloads-{stamp}.png"))


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Bars of each workload's median per method, one panel per layout; each round's median as a dot.

    Nothing when matplotlib does not import (the GPU machine has none: ``--replot`` draws a saved JSON elsewhere).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    layouts_ = list(dict.fromkeys(r["layout"] for r in rows))
    names = list(dict.fromkeys(r["workload"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(len(layouts_), 1, figsize=(11, 3.6 * len(layouts_)), squeeze=False)
    width = 0.8 / len(methods)
    for ax, layout in zip(axes[:, 0], layouts_, strict=True):
        cells = {(r["workload"], r["method"]): r for r in rows if r["layout"] == layout}
        for i, method in enumerate(methods):
            xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(names))]
            got = [cells.get((n, method)) for n in names]
            ax.bar(xs, [c["median_s"] * 1e3 if c else 0 for c in got], width, label=method)
            for x, c in zip(xs, got, strict=True):
                if c:
                    ax.plot([x] * len(c["rounds_s"]), [v * 1e3 for v in c["rounds_s"]], "k.", markersize=3)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("wall time, median (ms)")
        ax.set_title(layout)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8, ncol=len(methods))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
