"""Probe: what distributed-ucxx's receiver pays to allocate a device frame, with RMM's default resource and a pool.

distributed-ucxx receives every device frame into ``rmm.DeviceBuffer(size=n)`` from RMM's current device resource,
which on a plain Dask worker is ``CudaMemoryResource`` (``cudaMalloc``; the buffer's release is a ``cudaFree``). This
times one allocation and its release at each size, for that resource and for an RMM pool, in one process, after a
warm-up: medians of ``REPEATS``. Also the ``cuCtxSynchronize`` the receiver runs after allocating.

Run: ``python3 scripts/probes/recv_alloc.py`` (PROBE_REPEATS). Needs RMM and one GPU.
"""

from __future__ import annotations

import os
import statistics
import time

import rmm

REPEATS = int(os.environ.get("PROBE_REPEATS", 50))
SIZES = [4 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def timed(mr: rmm.mr.DeviceMemoryResource, n: int) -> tuple[float, float]:
    from cuda.bindings import driver

    allocs, frees = [], []
    for k in range(REPEATS + 1):
        t0 = time.perf_counter()
        buf = rmm.DeviceBuffer(size=n, mr=mr)
        driver.cuCtxSynchronize()
        t1 = time.perf_counter()
        del buf
        t2 = time.perf_counter()
        if k:
            allocs.append(t1 - t0)
            frees.append(t2 - t1)
    return statistics.median(allocs), statistics.median(frees)


def main() -> None:
    cuda = rmm.mr.CudaMemoryResource()
    pool = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=1 << 30)
    print(f"{'size':>10} {'cudaMalloc+sync':>16} {'cudaFree':>10} {'pool+sync':>10} {'pool free':>10}  (ms, median)")
    for n in SIZES:
        a, f = timed(cuda, n)
        pa, pf = timed(pool, n)
        print(f"{n >> 10:>8}Ki {a * 1e3:16.3f} {f * 1e3:10.3f} {pa * 1e3:10.3f} {pf * 1e3:10.3f}", flush=True)


if __name__ == "__main__":
    main()
