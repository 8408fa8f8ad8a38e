"""The placement allocator inside segments: the in-tree arena, alone and as a ``device`` pool runs it.

Every pool kind places buffers with :class:`~dask_gpupool.memory.arena.Arena`
(docs/design.md, "Alternatives measured and removed", says why not RMM). This
script measures, one process, one GPU, the same seeded workload:

- ``arena``: :class:`~dask_gpupool.memory.arena.Arena` alone (offsets, no memory).
- ``segments``: a ``device`` :class:`~dask_gpupool.memory.pool.Pool` (its
  :class:`~dask_gpupool.memory.segments.SegmentedResource`, segments of VMM or
  legacy IPC memory): a cuda.core ``Buffer`` per allocation and a
  stream-ordered free, on the GPU's default stream.

Workload: ``--live`` buffers of log-uniform sizes between 4 KiB and 16 MiB
stay alive; each step frees a random one and allocates a new one. Reports
microseconds per free + allocate pair (median of ``--repeats`` runs of
``--pairs`` steps) and the bytes reserved at the end against the live bytes
(fragmentation). Without a GPU only ``arena`` runs.

    python benchmarks/suballocator.py [--pairs 20000] [--live 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from dask_gpupool.memory.arena import Arena
from dask_gpupool.memory.topology import local_devices

MiB = 1 << 20
SEGMENT = 1 << 30


def sizes(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    lo, hi = math.log2(4096), math.log2(16 * MiB)
    return [int(2 ** rng.uniform(lo, hi)) for _ in range(n)]


def run(alloc: Callable[[int], Any], free: Callable[[Any], None], live: int, pairs: int, seed: int) -> float:
    """Microseconds per free + allocate pair."""
    rng = random.Random(seed + 1)
    want = sizes(live + pairs, seed)
    slots = [alloc(n) for n in want[:live]]
    t0 = time.perf_counter()
    for n in want[live:]:
        i = rng.randrange(live)
        free(slots[i])
        slots[i] = alloc(n)
    dt = time.perf_counter() - t0
    for s in slots:
        free(s)
    return dt / pairs * 1e6


Case = tuple[Callable[[int], Any], Callable[[Any], None], Callable[[], int], Callable[[], None]]


def arena_case() -> Case:
    arena = Arena(8 * SEGMENT, 512)
    return arena.allocate, arena.free, lambda: arena.extent, lambda: None


def segments_case(dev: Any) -> Case:
    from dask_gpupool.config import PoolOptions
    from dask_gpupool.memory.pool import Pool

    pool = Pool.create(PoolOptions.from_overrides(kind="device", max_size=16 * SEGMENT), local_devices())
    stream = dev.default_stream

    def alloc(n: int) -> Any:
        return pool.allocate(n, stream=stream)

    def free(buf: Any) -> None:
        buf.close(stream)

    def close() -> None:
        segmented = pool.segmented
        if segmented is not None:
            segmented.close(free_segments=True)  # no peer mapped them
        pool.close()

    return alloc, free, lambda: pool.stats().reserved, close


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=20000)
    p.add_argument("--live", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    cases: dict[str, Callable[[], Any]] = {"arena": arena_case}
    versions: dict[str, str] = {"python": platform.python_version()}
    gpu = None
    if local_devices().uuids:
        import cuda.core
        from cuda.core import Device

        dev = Device(0)
        dev.set_current()
        gpu = dev.name
        versions["cuda.core"] = cuda.core.__version__
        cases["segments"] = lambda: segments_case(dev)
    rows = []
    live_bytes = sum(sizes(args.live + args.pairs, 7)[-args.live :])
    for name, make in cases.items():
        us, reserved = [], 0
        for _ in range(args.repeats):
            alloc, free, reserved_of, close = make()
            us.append(run(alloc, free, args.live, args.pairs, seed=7))
            reserved = max(reserved, reserved_of())
            close()
        rows.append({"case": name, "us_per_pair": statistics.median(us), "runs": us, "reserved_at_end": reserved})
        print(f"{name:14s} {statistics.median(us):8.2f} us per free+allocate pair   runs {[round(u, 2) for u in us]}")
    result = {"gpu": gpu, "versions": versions, "args": vars(args), "live_bytes_last": live_bytes, "rows": rows}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for d in ("benchmarks/results", os.environ.get("OUT")):
        if d and os.path.isdir(d):
            with open(os.path.join(d, f"suballocator-{stamp}.json"), "w") as f:
                json.dump(result, f, indent=1)
    print(f"{'case':14s} {'us/pair':>8s}")
    for row in rows:
        print(f"{row['case']:14s} {row['us_per_pair']:8.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
