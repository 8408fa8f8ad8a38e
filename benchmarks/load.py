"""Load: many live leases, and a sustained stream of handoffs with flat resources.

Two measurements on real Nanny workers (``host`` pools without a GPU,
``device`` pools with one):

1. **Live leases.** The median time of a small handoff (producer → consumer,
   the consumer's transfer-log duration) with no lease open, then again while
   the consumer holds ``--leases`` imports of the producer's buffers (that many
   live leases on the producer).
2. **Sustained stream.** ``--workers`` workers in a ring: each round every
   worker makes ``--fan-in`` small buffers and a task on the next worker
   consumes them (``fan-in`` handoffs per task), for ``--seconds``. Reports
   handoffs per second (imports counted by the workers themselves) and each
   worker's RSS, fds, sockets, leases and pool bytes at the start and the end.

Writes JSON to ``$BENCH_RESULTS`` (default ``benchmarks/results/``) and ``$OUT`` and prints a summary.

    python benchmarks/load.py [--leases 10000] [--workers 4] [--seconds 60]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any

import dask

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import testing as T
from dask_gpupool.memory.topology import local_devices

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))
import handoff as H


def rss(dask_worker: Any) -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def dask_logs(dask_worker: Any) -> dict[str, int]:
    """Entries in the worker's bounded Dask logs (transfer logs, state-machine logs, log records)."""
    state = dask_worker.state
    handler = getattr(dask_worker, "_deque_handler", None)
    return {
        "transfer_incoming_log": len(dask_worker.transfer_incoming_log),
        "transfer_outgoing_log": len(dask_worker.transfer_outgoing_log),
        "state_log": len(state.log),
        "stimulus_log": len(state.stimulus_log),
        "log_records": len(handler.deque) if handler is not None else 0,
    }


def rss_without_dask_logs(dask_worker: Any) -> int:
    """RSS after emptying the worker's bounded Dask logs and returning free heap to the OS."""
    import ctypes
    import gc

    dask_worker.transfer_incoming_log.clear()
    dask_worker.transfer_outgoing_log.clear()
    dask_worker.state.log.clear()
    dask_worker.state.stimulus_log.clear()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    return rss(dask_worker)


def snapshot(c: Any) -> dict[str, dict[str, Any]]:
    res = c.run(T.resources)
    mem = c.run(rss)
    return {w: {**res[w], "rss": mem[w]} for w in res}


def consume(*xs: Any) -> int:
    return len(xs)


def small_handoffs(c: Any, a: str, b: str, n: int) -> float:
    times = []
    for _ in range(n):
        x = c.submit(T.make_buffer, 4096, b"s", workers=[a], pure=False)
        x.result()
        c.submit(consume, x, workers=[b], pure=False).result()
        t = c.run(T.last_transfer, key=x.key, workers=[b])[b]
        if t is not None:
            times.append(t)
        del x
    return statistics.median(times)


def live_leases(c: Any, nleases: int, probes: int) -> dict[str, Any]:
    from conftest import worker_addresses

    a, b = worker_addresses(c)[:2]
    quiet = small_handoffs(c, a, b, probes)
    t0 = time.perf_counter()
    xs = c.map(T.make_buffer, [4096] * nleases, [b"l"] * nleases, workers=[a], pure=False)
    ys = c.map(T.keep, xs, workers=[b], pure=False)
    c.gather(ys, errors="raise")
    setup_s = time.perf_counter() - t0
    leases = c.run(T.handoff_counters, workers=[a])[a]["leases"]
    loaded = small_handoffs(c, a, b, probes)
    del xs, ys
    t0 = time.perf_counter()
    while c.run(T.handoff_counters, workers=[a])[a]["leases"] and time.perf_counter() - t0 < 120:
        time.sleep(0.1)
    drain_s = time.perf_counter() - t0
    return {
        "leases": leases,
        "handoff_s_no_leases": quiet,
        "handoff_s_with_leases": loaded,
        "ratio": loaded / quiet,
        "setup_s": setup_s,
        "release_all_s": drain_s,
    }


def stream(c: Any, seconds: float, fan_in: int) -> dict[str, Any]:
    from conftest import worker_addresses

    workers = worker_addresses(c)

    def one_round() -> list[Any]:
        out = []
        for i, w in enumerate(workers):
            nxt = workers[(i + 1) % len(workers)]
            xs = c.map(T.make_buffer, [4096] * fan_in, [b"s"] * fan_in, workers=[w], pure=False)
            out.append(c.submit(consume, *xs, workers=[nxt], pure=False))
        return out

    def settle() -> None:
        t1 = time.perf_counter()
        while any(v["leases"] for v in c.run(T.handoff_counters).values()) and time.perf_counter() - t1 < 60:
            time.sleep(0.1)

    c.gather(one_round())  # warm-up: links, mappings and comms that then stay open
    settle()
    start = snapshot(c)
    before = c.run(T.handoff_counters)
    t0 = time.perf_counter()
    rounds = 0
    pending: list[Any] = []
    samples = []  # RSS along the way: growth that levels off is the heap settling, growth that does not is a leak
    next_sample = t0
    while time.perf_counter() - t0 < seconds:
        if time.perf_counter() >= next_sample:
            handoffs = sum(v["imports"] for v in c.run(T.handoff_counters).values())
            samples.append({"t": time.perf_counter() - t0, "handoffs": handoffs, "rss": c.run(rss)})
            next_sample += seconds / 8
        pending.extend(one_round())
        rounds += 1
        if len(pending) >= 8 * len(workers):  # keep a bounded window in flight
            c.gather(pending[: 4 * len(workers)])
            del pending[: 4 * len(workers)]
    c.gather(pending)
    elapsed = time.perf_counter() - t0
    pending.clear()
    after = c.run(T.handoff_counters)
    imports = sum(after[w]["imports"] - before[w]["imports"] for w in workers)
    copies = sum(after[w]["copied_bytes"] - before[w]["copied_bytes"] for w in workers)
    settle()
    end = snapshot(c)
    logs = c.run(dask_logs)
    # Where the RSS growth went: Dask's own logs are bounded (transfer logs 100,000 entries, the
    # state machine's log and stimulus log, log records), so growth they hold levels off.
    trimmed = c.run(rss_without_dask_logs)
    for w in end:
        end[w]["dask_logs"] = logs[w]
        end[w]["rss_without_dask_logs"] = trimmed[w]
    return {
        "seconds": elapsed,
        "rounds": rounds,
        "handoffs": imports,
        "handoffs_per_s": imports / elapsed,
        "copied_bytes": copies,
        "rss_samples": samples,
        "start": start,
        "end": end,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--leases", type=int, default=10000)
    p.add_argument("--probes", type=int, default=15)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--fan-in", type=int, default=16)
    args = p.parse_args()
    from conftest import nanny_cluster

    gpus = len(local_devices().uuids)
    kind = "device" if gpus else "host"
    env = [{"env": {"CUDA_VISIBLE_DEVICES": "0"}}] if gpus else [{}]
    result: dict[str, Any] = {
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "dask": dask.__version__,
        "dask_gpupool": dask_gpupool.__version__,
        "kind": kind,
        "args": vars(args),
    }
    with nanny_cluster(env * 2, GPUPool(kind=kind, max_size="1 GiB")) as c:
        result["live_leases"] = live_leases(c, args.leases, args.probes)
    ll = result["live_leases"]
    print(
        f"live leases: {ll['leases']}; small handoff {ll['handoff_s_no_leases'] * 1e3:.2f} ms with none, "
        f"{ll['handoff_s_with_leases'] * 1e3:.2f} ms with them (x{ll['ratio']:.2f}); "
        f"all released in {ll['release_all_s']:.1f} s",
        flush=True,
    )
    with nanny_cluster(env * args.workers, GPUPool(kind=kind, max_size="1 GiB")) as c:
        result["stream"] = stream(c, args.seconds, args.fan_in)
    st = result["stream"]
    print(
        f"stream: {st['handoffs']} handoffs in {st['seconds']:.1f} s = {st['handoffs_per_s']:.0f}/s "
        f"across {args.workers} workers, copied bytes {st['copied_bytes']}",
        flush=True,
    )
    for sample in st["rss_samples"]:
        mib = sorted(v >> 20 for v in sample["rss"].values())
        print(f"  at {sample['t']:5.1f} s, {sample['handoffs']:6d} handoffs: worker RSS {mib} MiB", flush=True)
    for w in st["start"]:
        s, e = st["start"][w], st["end"][w]
        print(
            f"  {w}: rss {s['rss'] >> 20} -> {e['rss'] >> 20} MiB, fds {s['fds']} -> {e['fds']}, "
            f"sockets {s['sockets']} -> {e['sockets']}, leases {s['leases']} -> {e['leases']}, "
            f"pool used {s['used']} -> {e['used']}; rss {e['rss_without_dask_logs'] >> 20} MiB with Dask's "
            f"logs emptied ({e['dask_logs']})",
            flush=True,
        )
    H.save_json("load", result)


if __name__ == "__main__":
    main()
