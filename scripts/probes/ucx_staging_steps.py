"""Probe: where the 0.16-0.39 ms of ``device-stage`` per value goes, in one process with the GPU to itself.

``benchmarks/ucx_pairs.py`` times staging pool memory for UCX (``UcxStaging.copy_of`` and, for CuPy arrays,
``cuda_family._stage_cupy``) at 0.16-0.39 ms per value on one H100 shared by four workers, for a copy of a few KiB
to 16 MiB that the GPU does in microseconds. This times each step of it on its own, ``REPEATS`` times (median,
microseconds): making the GPU current (cuda.core ``Device.set_current``), ``cuCtxGetCurrent``, the device-to-device
copy on the legacy default stream with its synchronize, the finalizer, the whole ``copy_of`` (which also takes kept
staging memory), and the serializer-side wrap (CuPy ``UnownedMemory`` + ``ndarray``) and distributed's serializer.
With the GPU to itself these are the host-side costs; the difference from the benchmark's figure is what sharing the
GPU with other processes (context switches) adds.

Run: ``python3 scripts/probes/ucx_staging_steps.py`` (PROBE_SIZES, default "4096,65536,1048576,16777216";
PROBE_REPEATS, default 2000). Needs a GPU, CuPy and distributed.
"""

from __future__ import annotations

import os
import statistics
import time
import weakref
from collections.abc import Callable

SIZES = [int(s) for s in os.environ.get("PROBE_SIZES", "4096,65536,1048576,16777216").split(",")]
REPEATS = int(os.environ.get("PROBE_REPEATS", 2000))


def timed(fn: Callable[[], object]) -> float:
    """Median microseconds of ``fn()`` over ``REPEATS`` calls (after 20 warm-up calls)."""
    for _ in range(20):
        fn()
    samples = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


def steps_of(nbytes: int) -> dict[str, float]:
    """Each step's median microseconds for a value of ``nbytes``."""
    import cupy
    from cuda.bindings import driver
    from distributed.protocol.cuda import cuda_serialize

    from dask_gpupool.memory.topology import current_gpu
    from dask_gpupool.memory.ucx_staging import UcxStaging

    src = cupy.ones(nbytes // 8, dtype="f8")
    cupy.cuda.runtime.deviceSynchronize()
    ptr = int(src.data.ptr)
    kept = UcxStaging(nbytes, 0)
    stream = driver.CUstream(0)

    def copy_sync() -> None:
        driver.cuMemcpyDtoDAsync(kept.ptr, ptr, nbytes, stream)
        driver.cuStreamSynchronize(stream)

    def wrap() -> object:
        mem = cupy.cuda.UnownedMemory(kept.ptr, nbytes, kept, device_id=0)
        return cupy.ndarray((nbytes // 8,), "f8", cupy.cuda.MemoryPointer(mem, 0))

    staged_array = wrap()
    steps: dict[str, Callable[[], object]] = {
        "current_gpu (Device(0).set_current)": lambda: current_gpu(0),
        "cuCtxGetCurrent": driver.cuCtxGetCurrent,
        "cuMemcpyDtoDAsync + cuStreamSynchronize": copy_sync,
        "weakref.finalize": lambda: weakref.finalize(kept, int).detach(),
        "UcxStaging.copy_of (all of it)": lambda: UcxStaging.copy_of(ptr, nbytes, 0),
        "CuPy wrap (UnownedMemory + ndarray)": wrap,
        "distributed's cuda_serialize": lambda: cuda_serialize(staged_array),
    }
    return {name: timed(fn) for name, fn in steps.items()}


def main() -> None:
    from dask_gpupool.memory.topology import current_gpu

    current_gpu(0)
    print(f"{'step':<44}" + "".join(f"{n:>12}" for n in SIZES) + "   (median us)")
    by_size = [steps_of(nbytes) for nbytes in SIZES]
    for name in by_size[0]:
        print(f"{name:<44}" + "".join(f"{steps[name]:12.1f}" for steps in by_size))


if __name__ == "__main__":
    main()
