"""The sub-allocator inside segments: the in-tree arena against RMM's pool, on the same workload.

Issue 4 asks for RMM's ``PoolMemoryResource`` over an upstream that takes
IPC-exportable segments from the cuda.core pool, unless a home-made allocator
measures as fast and as robust. This script measures both, one process, one
GPU, the same seeded workload:

- ``arena``: :class:`~dask_gpupool.memory.arena.Arena` alone (offsets, no memory).
- ``segments-arena`` / ``segments-rmm``: :class:`~dask_gpupool.memory.segments.SegmentedResource`
  over an IPC-enabled cuda.core ``DeviceMemoryResource``, placing buffers with
  the in-tree arena or with RMM - what a ``device`` pool with segments runs: a
  cuda.core ``Buffer`` per allocation and a stream-ordered free.
- ``rmm``: bare ``rmm.mr.PoolMemoryResource`` over ``rmm.mr.CallbackMemoryResource``
  whose callbacks take segments from the same kind of cuda.core pool; each
  allocation wrapped in a cuda.core ``Buffer`` (the floor for ``segments-rmm``).
- ``cuda.core``: the IPC-enabled pool itself, one allocation per buffer (the
  layout without segments).

Workload: ``--live`` buffers of log-uniform sizes between 4 KiB and 16 MiB
stay alive; each step frees a random one and allocates a new one. Reports
microseconds per free + allocate pair (median of ``--repeats`` runs of
``--pairs`` steps) and the bytes reserved from the upstream pool at the end
against the live bytes (fragmentation). Without a GPU only ``arena`` runs.

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


def cuda_pool(dev: Any) -> Any:
    from cuda.core import DeviceMemoryResource, DeviceMemoryResourceOptions

    return DeviceMemoryResource(dev, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=16 * SEGMENT))


def segments_case(dev: Any, suballocator: str) -> Case:
    from dask_gpupool.memory.pool import ipc_payload
    from dask_gpupool.memory.segments import SegmentedResource

    mr = SegmentedResource(cuda_pool(dev), SEGMENT, dev.device_id, ipc_payload, suballocator)
    stream = dev.default_stream

    def alloc(n: int) -> Any:
        return mr.allocate(n, stream=stream)

    def free(buf: Any) -> None:
        buf.close(stream)

    return alloc, free, lambda: mr.attributes.reserved_mem_current, lambda: mr.close(free_segments=True)


def rmm_case(dev: Any) -> Case:
    import rmm.mr
    from cuda.core import Buffer

    upstream = cuda_pool(dev)
    stream = dev.default_stream
    segments: dict[int, Any] = {}

    def take(nbytes: int, _stream: Any) -> int:
        buf = upstream.allocate(nbytes, stream=stream)
        segments[int(buf.handle)] = buf
        return int(buf.handle)

    def give(ptr: int, nbytes: int, _stream: Any) -> None:
        segments.pop(ptr).close(stream)

    pool = rmm.mr.PoolMemoryResource(rmm.mr.CallbackMemoryResource(take, give), SEGMENT, 16 * SEGMENT)

    class Wrapped:
        __slots__ = ("buf", "n", "ptr")

    def alloc(n: int) -> Any:
        w = Wrapped()
        w.ptr, w.n = pool.allocate(n), n
        w.buf = Buffer.from_handle(w.ptr, n)  # the Buffer a pool must hand out; freed below
        return w

    def free(w: Any) -> None:
        w.buf.close()
        pool.deallocate(w.ptr, w.n)

    def close() -> None:
        nonlocal pool
        del pool  # gives its upstream blocks back through ``give``
        upstream.close()

    return alloc, free, lambda: sum(b.size for b in segments.values()), close


def core_case(dev: Any) -> Case:
    mr = cuda_pool(dev)
    stream = dev.default_stream
    return (
        (lambda n: mr.allocate(n, stream=stream)),
        (lambda b: b.close(stream)),
        lambda: mr.attributes.reserved_mem_current,
        mr.close,
    )


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
        cases["segments-arena"] = lambda: segments_case(dev, "arena")
        cases["cuda.core"] = lambda: core_case(dev)
        try:
            import rmm

            versions["rmm"] = rmm.__version__
            cases["rmm"] = lambda: rmm_case(dev)
            cases["segments-rmm"] = lambda: segments_case(dev, "rmm")
        except Exception as e:  # reported; the other cases still run
            print(f"rmm not available: {e}")
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
