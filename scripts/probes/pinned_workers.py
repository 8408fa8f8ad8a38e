"""Probe: a peer's pinned pool read inside real Dask workers, step by step (GPU machine).

``python3 scripts/probes/pinned_workers.py``: two Nanny workers on GPU 0 with pinned pools;
worker stderr carries faulthandler tracebacks if a step crashes one.
"""

from __future__ import annotations

import sys

MiB = 1 << 20


def main() -> None:
    from distributed import Client, Nanny, Scheduler, SpecCluster

    from dask_gpupool import GPUPool, pools
    from dask_gpupool import testing as T

    env = {"CUDA_VISIBLE_DEVICES": "0", "PYTHONFAULTHANDLER": "1"}
    specs = {f"w{i}": {"cls": Nanny, "options": {"nthreads": 1, "env": env}} for i in range(2)}
    with SpecCluster(workers=specs, scheduler={"cls": Scheduler, "options": {"dashboard_address": None}}) as cl:
        with Client(cl) as c:
            c.wait_for_workers(2)
            c.register_plugin(GPUPool(kind="pinned", max_size="1 GiB"))
            a, b = sorted((info := T.workers(c)), key=lambda w: info[w]["name"])
            rows = {r.worker: r for r in pools(c)}
            reader = sys.argv[1] if len(sys.argv) > 1 else "cpu"
            read = T.read_peer_on_gpu if reader == "gpu" else T.read_peer
            for i, size in enumerate([4096, 8 * MiB, 4096]):
                desc = c.submit(T.hold, f"k{i}", size, b"pinned!", workers=[a], pure=False).result()
                print(f"step {i}: hold {size} -> {desc}", flush=True)
                print(f"step {i}: map -> {c.submit(T.map_peer, rows[a].pool, workers=[b], pure=False).result()}")
                got = c.submit(read, desc, 7, workers=[b], pure=False).result()
                print(f"step {i}: {reader} read -> {got!r}", flush=True)
                c.submit(T.release, f"k{i}", workers=[a], pure=False).result()
                if i == 1:
                    c.submit(T.unmap, rows[a].pool, workers=[b], pure=False).result()
                    print(f"step {i}: unmapped", flush=True)
            print("OK", flush=True)


if __name__ == "__main__":
    main()
