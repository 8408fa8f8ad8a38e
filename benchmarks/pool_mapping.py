"""Cost of the pool layer on real workers: making a pool, mapping a peer's pool, importing buffers.

Runs two Nanny workers per placement (same GPU; one per GPU with rotated
CUDA_VISIBLE_DEVICES when two GPUs are visible; host pools otherwise) and
times, inside the importing worker, the first mapping of the peer's pool and
the import of one allocation per size (median of repeats). Prints a table and
writes JSON to $BENCH_RESULTS (default benchmarks/results/) and $OUT when set.

    python benchmarks/pool_mapping.py [--repeats 5]
    python benchmarks/pool_mapping.py --large   # single imports of 5-8 GiB, content checked

``--large`` checks whether importing one allocation larger than 5 GiB works
on this GPU (a driver crash was reported on others): the
producer fills each allocation with one byte value on the GPU, the importer
imports it, checks every byte on its own GPU, and releases it.
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
from dask_gpupool.testing import memory as held_buffers
from dask_gpupool.wire.handoff import BufferDescriptor

sys.path.insert(0, os.path.dirname(__file__))
import handoff as H

MiB = 1 << 20


def time_imports(descs: list[dict[str, Any]], repeats: int) -> dict[str, Any]:
    """Task on the importer: time mapping the pool once, then importing each buffer."""
    service = current_service()
    parsed = [BufferDescriptor.from_msg(d) for d in descs]
    t0 = time.perf_counter()
    mapped = service.importer.map_peer(parsed[0].pool)
    map_s = time.perf_counter() - t0
    imports = {}
    for d in parsed:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            buf = mapped.import_buffer(d)
            times.append(time.perf_counter() - t0)
            mapped.release(buf)
        imports[d.size] = statistics.median(times)
    service.importer.mapped.unmap(parsed[0].pool)
    return {"map_pool_s": map_s, "import_s": imports}


def step(name: str, *args: Any) -> float:
    """Task: one step of a large handoff, timed; buffers stay in ``dask_gpupool.testing.memory._held`` between steps."""
    service = current_service()
    t0 = time.perf_counter()
    if name == "allocate":  # producer
        key, nbytes = args
        buf = service.pool.allocate(nbytes)
        with held_buffers._held_lock:
            held_buffers._held[key] = buf
    elif name == "fill":  # producer: every byte set on the GPU
        key, value = args
        T.set_all(held_buffers._held[key], value)
    elif name == "import":  # importer
        key, desc = args
        d = BufferDescriptor.from_msg(desc)
        buf = service.importer.map_peer(d.pool).import_buffer(d)
        with held_buffers._held_lock:
            held_buffers._held[key] = buf
    elif name == "check":  # importer: every byte read on its GPU
        key, value = args
        if not T.all_equal(held_buffers._held[key], value):
            raise AssertionError("imported bytes differ from what the producer wrote")
    elif name == "release":  # importer: closed under the import lock, by its mapping
        key, desc = args
        with held_buffers._held_lock:
            buf = held_buffers._held.pop(key)
        service.importer.map_peer(BufferDescriptor.from_msg(desc).pool).release(buf)
    return time.perf_counter() - t0


def export(key: str) -> dict[str, Any]:
    """Task on the producer: the descriptor of a held buffer."""
    return current_service().pool.export(held_buffers._held[key]).to_msg()


def run_large(placement: str, workers: list[dict[str, Any]], sizes: list[int], kind: str = "device") -> dict[str, Any]:
    """One cluster per size (a pool of just that size); each step timed on its own, so a stall names its step."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from conftest import nanny_cluster, worker_addresses

    checks = []
    for i, n in enumerate(sizes):
        t0 = time.perf_counter()
        check: dict[str, Any] = {"size": n, "ok": False}
        try:
            with nanny_cluster(workers, GPUPool(kind=kind, max_size=f"{n // MiB + 64} MiB")) as c:
                a, b = worker_addresses(c)
                value = 0x40 + i
                plan: list[tuple[str, str, tuple[Any, ...]]] = [
                    ("allocate", a, ("L", n)),
                    ("fill", a, ("L", value)),
                    ("export", a, ()),
                    ("import", b, ()),
                    ("check", b, ("I", value)),
                    ("release", b, ()),
                ]
                desc = None
                for name, where, args in plan:
                    check["step"] = name
                    if name == "export":
                        desc = c.submit(export, "L", workers=[where], pure=False).result(timeout=60)
                        continue
                    call_args = ("I", desc) if name in ("import", "release") else args
                    check[f"{name}_s"] = c.submit(step, name, *call_args, workers=[where], pure=False).result(
                        timeout=60
                    )
                check["ok"], check["step"] = True, "done"
        except Exception as e:
            check["error"] = f"{type(e).__name__}: {e}"
        check["wall_s"] = time.perf_counter() - t0
        checks.append(check)
        print(placement, check, flush=True)
    return {"placement": placement, "kind": kind, "large": checks}


def run(placement: str, workers: list[dict[str, Any]], kind: str, sizes: list[int], repeats: int) -> dict[str, Any]:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from conftest import nanny_cluster, worker_addresses

    t0 = time.perf_counter()
    with nanny_cluster(workers, GPUPool(kind=kind, max_size=f"{2 * sum(sizes) // MiB + 64} MiB")) as c:
        setup_s = time.perf_counter() - t0
        a, b = worker_addresses(c)
        descs = [c.submit(T.hold, f"b{n}", n, b"x", workers=[a], pure=False).result() for n in sizes]
        result = c.submit(time_imports, descs, repeats, workers=[b], pure=False).result()
        for n in sizes:
            c.submit(T.release, f"b{n}", workers=[a], pure=False).result()
        rows = dask_gpupool.pools(c)
    return {"placement": placement, "kind": kind, "cluster_setup_s": setup_s, "pools": len(rows), **result}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--large", action="store_true", help="import single 5-8 GiB allocations and check them")
    p.add_argument("--large-sizes", default="5,6,8", help="GiB, comma-separated (with --large)")
    args = p.parse_args()
    uuids = local_devices().uuids
    runs = []
    if args.large:
        if not uuids:
            sys.exit("--large needs a GPU")
        sizes = [int(float(x) * (1 << 30)) for x in args.large_sizes.split(",")]
        runs.append(run_large("same GPU", [{"env": {"CUDA_VISIBLE_DEVICES": "0"}}] * 2, sizes))
        if len(uuids) >= 2:
            rot = [{"env": {"CUDA_VISIBLE_DEVICES": "0,1"}}, {"env": {"CUDA_VISIBLE_DEVICES": "1,0"}}]
            runs.append(run_large("other GPU", rot, sizes))
    elif uuids:
        sizes = [4096, MiB, 64 * MiB, 1024 * MiB]
        same = {"env": {"CUDA_VISIBLE_DEVICES": "0"}}
        runs.append(run("same GPU", [same, same], "device", sizes, args.repeats))
        if len(uuids) >= 2:
            rot = [{"env": {"CUDA_VISIBLE_DEVICES": "0,1"}}, {"env": {"CUDA_VISIBLE_DEVICES": "1,0"}}]
            runs.append(run("other GPU", rot, "device", sizes, args.repeats))
    else:
        runs.append(run("host", [{}, {}], "host", [4096, MiB, 64 * MiB], args.repeats))
    meta = {"python": platform.python_version(), "gpus": list(uuids), "host": platform.node(), "time": time.time()}
    try:
        import cuda.core

        meta["cuda_core"] = cuda.core.__version__
    except Exception:
        pass
    out = {"meta": meta, "runs": runs}
    H.save_json("pool_mapping", out)
    if args.large:
        print(f"\n{'placement':10} {'size':>8} {'import':>10}  result")
        for r in runs:
            for ch in r["large"]:
                t = f"{ch['import_s'] * 1e3:7.2f} ms" if "import_s" in ch else f"{'-':>10}"
                res = "all bytes right" if ch["ok"] else f"stopped at {ch.get('step')}: {ch.get('error')}"
                print(f"{r['placement']:10} {ch['size'] / (1 << 30):>5.2f} GiB {t}  {res}")
        return
    print(
        f"\n{'placement':10} {'kind':7} {'map pool':>10} "
        + " ".join(f"{'import ' + _h(n):>16}" for n in (4096, MiB, 64 * MiB, 1024 * MiB))
    )
    for r in runs:
        cells = [
            f"{r['import_s'][n] * 1e6:>13.1f} us" if n in r["import_s"] else f"{'-':>16}"
            for n in (4096, MiB, 64 * MiB, 1024 * MiB)
        ]
        print(f"{r['placement']:10} {r['kind']:7} {r['map_pool_s'] * 1e3:>7.2f} ms " + " ".join(cells))


def _h(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // 1024} KiB"


if __name__ == "__main__":
    main()
