"""Cost of the pool layer on real workers: mapping a peer's pool, and importing its buffers as a handoff does.

Runs two Nanny workers per pool kind and placement: ``host`` always; on a GPU
machine also ``device`` and ``pinned`` on one GPU, and on the other GPU
(rotated CUDA_VISIBLE_DEVICES) when two GPUs are visible. The producer
allocates one buffer per size from its pool and exports its descriptor
(``Pool.export``); the importer, in a task, maps the producer's pool through
its broker (``Importer.map_peer``, timed once) and imports each buffer through
``Importer.import_buffer``, the path a handoff takes without its lease: a
``device`` pool's buffer is a view into its segment, the segment mapped on
first use (its fd fetched from the producer's broker for VMM memory) and kept
mapped; a ``host`` or ``pinned`` pool's buffer is imported on its own. For
each size it times the first import (which maps the buffer's segment when no
earlier buffer mapped it) and the median of the later ones (import and
release, ``--repeats``), and checks the first byte of the import. Prints a
table and writes JSON to $BENCH_RESULTS (default benchmarks/results/) and
$OUT when set; exits 1 when a run failed (its error is in the table).

    python benchmarks/pool_mapping.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import testing as T
from dask_gpupool.dask.api import current_service
from dask_gpupool.memory.topology import local_devices
from dask_gpupool.wire.handoff import BufferDescriptor

sys.path.insert(0, os.path.dirname(__file__))
import handoff as H

MiB = 1 << 20
GPU_SIZES = [4096, MiB, 64 * MiB, 1024 * MiB]
HOST_SIZES = [4096, MiB, 64 * MiB]


def time_imports(descs: list[dict[str, Any]], repeats: int, first_byte: bytes) -> dict[str, Any]:
    """Task on the importer: time mapping the peer's pool once, then each buffer's first and later imports."""
    service = current_service()
    parsed = [BufferDescriptor.from_msg(d) for d in descs]
    t0 = time.perf_counter()
    mapped = service.importer.map_peer(parsed[0].pool)
    map_s = time.perf_counter() - t0
    first, again = {}, {}
    for d in parsed:
        t0 = time.perf_counter()
        buf = service.importer.import_buffer(d)
        first[d.size] = time.perf_counter() - t0
        try:
            if T.read_bytes(buf, 1) != first_byte:
                raise AssertionError(f"the import of {d.size} bytes does not hold what the producer wrote")
        finally:
            mapped.release(buf)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            buf = service.importer.import_buffer(d)
            times.append(time.perf_counter() - t0)
            mapped.release(buf)
        again[d.size] = statistics.median(times)
    segments = mapped.segments
    service.importer.mapped.unmap(parsed[0].pool)
    return {"map_pool_s": map_s, "first_import_s": first, "import_s": again, "segments_mapped": segments}


def run(placement: str, workers: list[dict[str, Any]], kind: str, sizes: list[int], repeats: int) -> dict[str, Any]:
    """One cluster of two workers with ``kind`` pools; the second imports what the first holds."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from conftest import nanny_cluster, worker_addresses

    out: dict[str, Any] = {"placement": placement, "kind": kind}
    t0 = time.perf_counter()
    try:
        with nanny_cluster(workers, GPUPool(kind=kind, max_size=f"{2 * sum(sizes) // MiB + 64} MiB")) as c:
            out["cluster_setup_s"] = time.perf_counter() - t0
            a, b = worker_addresses(c)
            descs = [c.submit(T.hold, f"b{n}", n, b"x", workers=[a], pure=False).result() for n in sizes]
            out.update(c.submit(time_imports, descs, repeats, b"x", workers=[b], pure=False).result())
            for n in sizes:
                c.submit(T.release, f"b{n}", workers=[a], pure=False).result()
            out["pools"] = len(dask_gpupool.pools(c))
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    print(placement, kind, {k: v for k, v in out.items() if k not in ("placement", "kind")}, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    uuids = local_devices().uuids
    runs = [run("host", [{}, {}], "host", HOST_SIZES, args.repeats)]
    if uuids:
        same = {"env": {"CUDA_VISIBLE_DEVICES": "0"}}
        rot = [{"env": {"CUDA_VISIBLE_DEVICES": "0,1"}}, {"env": {"CUDA_VISIBLE_DEVICES": "1,0"}}]
        for kind in ("device", "pinned"):
            runs.append(run("same GPU", [same, same], kind, GPU_SIZES, args.repeats))
            if len(uuids) >= 2:
                runs.append(run("other GPU", rot, kind, GPU_SIZES, args.repeats))
    meta = {"python": platform.python_version(), "gpus": list(uuids), "host": platform.node(), "time": time.time()}
    try:
        import cuda.core

        meta["cuda_core"] = cuda.core.__version__
    except Exception:
        pass
    H.save_json("pool_mapping", {"meta": meta, "runs": runs})
    print("\nfirst import / median of later imports (us); map pool: the first mapping of the peer's pool")
    print(f"{'placement':10} {'kind':7} {'map pool':>10} " + " ".join(f"{_h(n):>19}" for n in GPU_SIZES))
    for r in runs:
        if "error" in r:
            print(f"{r['placement']:10} {r['kind']:7} failed: {r['error']}")
            continue
        cells = [
            f"{r['first_import_s'][n] * 1e6:>9.1f} /{r['import_s'][n] * 1e6:>7.1f}" if n in r["import_s"] else "-"
            for n in GPU_SIZES
        ]
        row = f"{r['placement']:10} {r['kind']:7} {r['map_pool_s'] * 1e3:>7.2f} ms "
        print(row + " ".join(f"{c:>19}" for c in cells))
    if any("error" in r for r in runs):
        sys.exit(1)


def _h(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // 1024} KiB"


if __name__ == "__main__":
    main()
