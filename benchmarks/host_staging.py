"""Where a plain NumPy result's time goes between two same-host workers on ``host`` pools: staged or Dask's TCP.

A task on worker A makes a plain NumPy array (``np.ones``, not pool memory); a task on worker B sums it. Three
clusters' ways are sampled one after another, sample by sample, in alternating order, all clusters up at once (two
Nanny workers each, TCP):

- ``staged``: the plugin's cluster, the producer staging every plain array into its ``host`` pool and handing it over
  (its stage threshold set to 1 byte, :func:`_stage_at`);
- ``comm``: the same cluster, nothing staged (threshold 0): Dask's own path through the plugin's serializer;
- ``defaults``: the same cluster at :func:`dask_gpupool.handoff.routes.stage_threshold_of`, what a user gets;
- ``plain``: a second cluster without the plugin (plain Dask).

Per sample: the consumer's transfer time (``stop - start`` of its transfer log entry), its first full read of the
array (``sum``, inside the task), the minor page faults of each worker process over the sample (``getrusage``), the
plugin's timed steps (``stage``: the copy into the pool with its allocation, ``stage-alloc``, ``export``: descriptor
and lease, ``import``: the consumer's mapping, ``reply``: the producer's whole reply up to the consumer's OK) and the
thread the staging copy ran on. Then, in the producer's process, one probe per size of its pool's memory itself
(:func:`_memfd_probe`): a copy into pages the pool gave back (holes punched), into pages still resident, what giving
a buffer's pages back costs, and the pool's resident bytes. Medians and the spread (min-max) per size; JSON to
``benchmarks/results/``.

    python benchmarks/host_staging.py [--sizes 1KiB,1MiB,64MiB,256MiB] [--samples 8] [--modes staged,comm,plain]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np
from dask.utils import format_bytes, parse_bytes
from distributed import wait

sys.path.insert(0, os.path.dirname(__file__))
import handoff as H  # benchmarks/handoff.py: its cluster, produce, machine and save_json

from dask_gpupool import GPUPool
from dask_gpupool import testing as T
from dask_gpupool.dask.worker_plugin import service_of
from dask_gpupool.handoff.routes import stage_threshold_of

STEPS = ("stage", "stage-alloc", "export", "import", "reply")
MODES = ("staged", "comm", "defaults", "plain")


# -- run on the workers ------------------------------------------------------------------


def read_all(arr: Any) -> dict[str, float]:
    """The consumer's task: its first full read of ``arr`` (a sum), timed."""
    t0 = time.perf_counter()
    total = float(arr.sum())
    return {"read_s": time.perf_counter() - t0, "sum": total, "writeable": bool(arr.flags.writeable)}


def _faults() -> int:
    """Minor page faults of this process so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _stage_at(dask_worker: Any, threshold: int | None) -> None:
    """This worker's stage threshold: ``None`` the product's (:func:`~dask_gpupool.handoff.routes.stage_threshold_of`),
    else ``threshold`` over TCP (0: never)."""
    routes = service_of(dask_worker).routes
    if threshold is None:
        routes.stage_threshold_of = stage_threshold_of
    else:
        routes.stage_threshold_of = lambda kind, over_tcp: threshold if over_tcp else 0


def _watch_stage_thread() -> None:
    """Record the thread each staging copy runs on (the plugin's ``stage``, wrapped in this process; the names are
    kept on the wrapper, since this function's own globals are a copy per ``client.run``)."""
    from dask_gpupool.dask import plain_arrays

    inner = plain_arrays.stage
    if hasattr(inner, "threads"):
        return
    threads: list[str] = []

    def stage(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return inner(*args, **kwargs)

    stage.threads = threads  # type: ignore[attr-defined]
    plain_arrays.stage = stage


def _take_threads() -> list[str]:
    """The threads staging copies ran on since the last call (:func:`_watch_stage_thread`)."""
    from dask_gpupool.dask import plain_arrays

    threads: list[str] = getattr(plain_arrays.stage, "threads", [])
    out = list(threads)
    threads.clear()
    return out


def _steps(dask_worker: Any) -> dict[str, tuple[int, float]]:
    """This worker's timed steps so far: step -> (count, total seconds)."""
    timings = service_of(dask_worker).handoffs.to_msg().get("timings", {})
    return {s: (t["count"], t["total_s"]) for s, t in timings.items() if s in STEPS}


def _memfd_probe(dask_worker: Any, nbytes: int) -> dict[str, float]:
    """In this worker's ``host`` pool: seconds to copy ``nbytes`` into a new buffer's pages as the pool leaves them
    (``copy_first``), again into the same pages (``copy_resident``), to free the buffer (``free``: its pages given
    back, or kept) and to copy into a new buffer at the same place after that (``copy_after_free``); and the pool's
    resident bytes after."""
    pool = service_of(dask_worker).pool
    src = np.ones(max(nbytes // 8, 1))
    out: dict[str, float] = {}
    buf = pool.allocate(src.nbytes)
    dst = np.frombuffer(pool.resource.memoryview(buf), dtype="f8")
    for name in ("copy_first", "copy_resident"):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        out[name] = time.perf_counter() - t0
    del dst
    t0 = time.perf_counter()
    buf.close()
    out["free"] = time.perf_counter() - t0
    buf = pool.allocate(src.nbytes)
    dst = np.frombuffer(pool.resource.memoryview(buf), dtype="f8")
    t0 = time.perf_counter()
    np.copyto(dst, src)
    out["copy_after_free"] = time.perf_counter() - t0
    del dst
    buf.close()
    out["resident_bytes"] = float(pool.stats().reserved)
    return out


# -- the driver ----------------------------------------------------------------------------


def _sample(c: Any, mode: str, nbytes: int) -> dict[str, Any]:
    info = T.workers(c)
    a, b = sorted(info, key=lambda w: str(info[w]["name"]))
    plugin = mode != "plain"
    if plugin:
        c.run(_stage_at, threshold={"staged": 1, "comm": 0, "defaults": None}[mode], workers=[a])
        steps0 = c.run(_steps)
    faults0 = c.run(_faults)
    x = c.submit(H.produce, nbytes, "numpy", False, workers=[a], pure=False)
    wait(x)
    got = c.submit(read_all, x, workers=[b], pure=False).result()
    faults1 = c.run(_faults)
    row: dict[str, Any] = {
        "transfer_s": c.run(T.last_transfer, key=x.key, workers=[b])[b],
        "read_s": got["read_s"],
        "ok": got["sum"] == float(max(nbytes // 8, 1)),
        "writeable": got["writeable"],
        "faults_producer": faults1[a] - faults0[a],
        "faults_consumer": faults1[b] - faults0[b],
    }
    del x
    if plugin:
        steps1 = c.run(_steps)
        for step in STEPS:
            n = sum(steps1[w].get(step, (0, 0.0))[0] - steps0[w].get(step, (0, 0.0))[0] for w in steps1)
            s = sum(steps1[w].get(step, (0, 0.0))[1] - steps0[w].get(step, (0, 0.0))[1] for w in steps1)
            row[step + "_s"] = s if n else None
        row["threads"] = c.run(_take_threads, workers=[a])[a]
    H.between_samples(c, plugin)
    return row


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(xs) if xs else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1KiB,1MiB,64MiB,256MiB")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--modes", default="staged,comm,plain", help=f"any of {', '.join(MODES)}")
    args = p.parse_args()
    sizes = [int(parse_bytes(s)) for s in args.sizes.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - set(MODES):
        p.error(f"unknown modes {sorted(set(modes) - set(MODES))}")
    plugin = GPUPool(kind="host", max_size=f"{4 * max(sizes) // (1 << 20) + 256} MiB")
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {(m, n): [] for m in modes for n in sizes}
    probes: dict[int, dict[str, float]] = {}
    with contextlib.ExitStack() as stack:
        cp = stack.enter_context(H.cluster([{}, {}], "tcp", plugin))
        cd = stack.enter_context(H.cluster([{}, {}], "tcp", None)) if "plain" in modes else None
        cp.run(_watch_stage_thread)
        for nbytes in sizes:
            for k in range(args.samples + 2):  # the first two warm the comms and the pool's pages up
                order = modes if k % 2 else modes[::-1]
                for mode in order:
                    row = _sample(cd if mode == "plain" else cp, mode, nbytes)
                    if k >= 2:
                        samples[mode, nbytes].append(row)
            info = T.workers(cp)
            a = sorted(info, key=lambda w: str(info[w]["name"]))[0]
            probes[nbytes] = cp.run(_memfd_probe, nbytes=nbytes, workers=[a])[a]
        counters = cp.run(T.handoff_counters)
    print(f"host pools, plain NumPy arrays, two Nanny workers over TCP; median of {args.samples} samples (ms)")
    head = f"{'size':>9} {'mode':>8} {'transfer':>9} {'spread':>15} {'read':>7} {'flt P':>7} {'flt C':>7}"
    print(head + "".join(f"{s:>12}" for s in STEPS) + "  thread")
    rows = []
    for nbytes in sizes:
        for mode in modes:
            got = samples[mode, nbytes]
            if not got:
                continue
            tr = [r["transfer_s"] for r in got if r["transfer_s"] is not None]
            row: dict[str, Any] = {"nbytes": nbytes, "mode": mode, "n": len(got), "all_ok": all(r["ok"] for r in got)}
            for key in ("transfer_s", "read_s", "faults_producer", "faults_consumer", *(s + "_s" for s in STEPS)):
                row[key] = _median(got, key)
            row["transfer_min_s"], row["transfer_max_s"] = min(tr), max(tr)
            threads = sorted({t for r in got for t in r.get("threads", [])})
            row["threads"] = threads
            rows.append(row)
            cells = "".join(
                f"{row[s + '_s'] * 1e3:12.2f}" if row[s + "_s"] is not None else f"{'-':>12}" for s in STEPS
            )
            print(
                f"{format_bytes(nbytes):>9} {mode:>8} {row['transfer_s'] * 1e3:9.2f} "
                f"{row['transfer_min_s'] * 1e3:7.2f}-{row['transfer_max_s'] * 1e3:<7.2f} {row['read_s'] * 1e3:7.2f} "
                f"{row['faults_producer']:7.0f} {row['faults_consumer']:7.0f}{cells}  {','.join(threads)}"
            )
        if "staged" in modes and ("comm" in modes or "plain" in modes):
            base = "plain" if "plain" in modes else "comm"
            st, bs = samples["staged", nbytes], samples[base, nbytes]
            pairs = zip(st, bs, strict=False)
            wins = sum(x["transfer_s"] + x["read_s"] < y["transfer_s"] + y["read_s"] for x, y in pairs)
            print(f"{'':>9} staged transfer+read faster than {base} in {wins} of {min(len(st), len(bs))} pairs")
    print("producer's pool, one probe per size (ms): copy into given-back pages, resident pages; free; copy after")
    for nbytes, pr in probes.items():
        print(
            f"{format_bytes(nbytes):>9} {pr['copy_first'] * 1e3:9.2f} {pr['copy_resident'] * 1e3:9.2f} "
            f"{pr['free'] * 1e3:9.2f} {pr['copy_after_free'] * 1e3:9.2f}  resident {format_bytes(pr['resident_bytes'])}"
        )
    fallbacks = {w: counters[w].get("fallbacks", {}) for w in counters}
    print("fallbacks:", fallbacks)
    result = {"machine": H.machine(), "args": vars(args), "rows": rows, "probes": probes, "fallbacks": fallbacks}
    result["samples"] = {f"{m}-{n}": v for (m, n), v in samples.items()}
    H.save_json("host_staging", result)


if __name__ == "__main__":
    main()
