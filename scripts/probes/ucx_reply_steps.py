"""Probe: what a ``get_data`` reply to another-"host" worker costs the producer inside a real UCXX worker.

``benchmarks/ucx_pairs.py -hooks-ab`` (one cluster, samples back to back) found the plugin's hooks add 0.1-0.2 ms to
an other-"host" transfer of a plain CuPy array that they do not change, and ``-pool-ab`` found a pool array 0.1-0.5 ms
slower than a plain one for such a pair; on the CPU the hooks cost at most 0.02 ms each
(``benchmarks/plugin_hooks.py``). This times, on the producer of a four-worker UCXX cluster (one GPU, two "hosts" by
``gpupool.host-id``), in the worker's event loop thread (``client.run``, where Dask serializes small replies):

- ``serialize``: distributed's ``serialize(x, serializers=("cuda", "dask", "pickle", "error"))`` of a plain CuPy
  array and of a pool array, as the reply to the other-host worker (``REQUEST`` set as the ``get_data`` hook sets it),
  with the plugin's CuPy serializers in place and with distributed's own;
- ``stage``: ``UcxStaging.copy_of`` of the pool array alone;
- ``request``: what the ``get_data`` hook does before Dask's handler (the ``Request`` and its routing).

Median and 90th percentile microseconds over ``PROBE_REPEATS`` calls after a warm-up. Run on the GPU machine with the
UCXX wheels: ``python3 scripts/probes/ucx_reply_steps.py`` (PROBE_SIZES, default "4096,65536,1048576,16777216";
PROBE_REPEATS, default 500).
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

SIZES = [int(s) for s in os.environ.get("PROBE_SIZES", "4096,65536,1048576,16777216").split(",")]
REPEATS = int(os.environ.get("PROBE_REPEATS", 500))


def steps(who: str, sizes: list[int], repeats: int, dask_worker: Any = None) -> list[dict[str, Any]]:
    """On the producer: each step's median and p90 microseconds for every size, as the reply to ``who``."""
    import os
    import statistics
    import time

    import cupy
    from distributed.protocol import cupy as distributed_cupy
    from distributed.protocol.cuda import cuda_serialize
    from distributed.protocol.serialize import serialize

    import dask_gpupool
    from dask_gpupool.dask.context import REQUEST, Request
    from dask_gpupool.handoff.active import active_service
    from dask_gpupool.memory.ucx_staging import UcxStaging

    service = active_service()
    assert service is not None
    families = ("cuda", "dask", "pickle", "error")
    plugin_dumps = cuda_serialize.dispatch(cupy.ndarray)

    def timed(fn: Any) -> tuple[float, float]:
        for _ in range(20):
            fn()
        samples = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t)
        samples.sort()
        return statistics.median(samples) * 1e6, samples[int(0.9 * len(samples))] * 1e6

    rows = []
    for nbytes in sizes:
        n = max(nbytes // 8, 1)
        with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
            plain = cupy.ones(n, dtype="f8")
        buf = service.allocate(n * 8)  # not a task: the service itself (allocate() is for tasks)
        pool = dask_gpupool.as_array(buf, (n,), "f8", like="cupy")
        pool[...] = 1.0
        cupy.cuda.runtime.deviceSynchronize()

        def request() -> Any:
            return Request(who, "ucxx", service, plain_reason=service.plain_copy_reason(who))

        token = REQUEST.set(request())
        try:
            for hooks in (True, False):
                cuda_serialize.register(cupy.ndarray)(
                    plugin_dumps if hooks else distributed_cupy.cuda_serialize_cupy_ndarray
                )
                for kind, x in (("plain", plain), ("pool", pool)):
                    med, p90 = timed(lambda x=x: serialize(x, serializers=families, on_error="raise"))
                    rows.append({"step": f"serialize {kind}", "hooks": hooks, "nbytes": nbytes, "med": med, "p90": p90})
        finally:
            cuda_serialize.register(cupy.ndarray)(plugin_dumps)
            REQUEST.reset(token)
            if os.environ.get("PROBE_PROFILE") and nbytes == sizes[-1]:  # where serialize pool's time goes
                import cProfile
                import io
                import pstats

                prof = cProfile.Profile()
                prof.enable()
                for _ in range(repeats):
                    serialize(pool, serializers=families, on_error="raise")
                prof.disable()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
                rows.append({"step": "profile", "text": out.getvalue()})
        med, p90 = timed(lambda ptr=int(pool.data.ptr), size=n * 8: UcxStaging.copy_of(ptr, size, 0))
        rows.append({"step": "stage", "hooks": True, "nbytes": nbytes, "med": med, "p90": p90})
        med, p90 = timed(request)
        rows.append({"step": "request", "hooks": True, "nbytes": nbytes, "med": med, "p90": p90})
    return rows


def main() -> None:
    import handoff as H  # benchmarks/handoff.py: its cluster

    from dask_gpupool import GPUPool

    workers = [
        {"env": {"CUDA_VISIBLE_DEVICES": "0"}, "config": {"gpupool": {"host-id": host}}}
        for host in ("host-a", "host-a", "host-b", "host-b")
    ]
    plugin = GPUPool(kind="device", max_size=f"{4 * max(SIZES) // (1 << 20) + 1024} MiB")
    with H.cluster(workers, "ucxx", plugin) as c:
        from dask_gpupool.testing import workers

        info = workers(c)  # not scheduler_info(): see dask_gpupool.testing.workers
        addrs = sorted(info, key=lambda w: str(info[w]["name"]))
        producer, other_host = addrs[0], addrs[2]
        rows = c.run(steps, other_host, SIZES, REPEATS, workers=[producer])[producer]
    for r in rows:
        if r["step"] == "profile":
            print(r["text"])
    rows = [r for r in rows if r["step"] != "profile"]
    print(f"producer {producer}, reply to other-host {other_host}; microseconds, median / p90 of {REPEATS}")
    print(f"{'step':<18}{'hooks':>6}" + "".join(f"{s:>18}" for s in SIZES))
    for step, hooks in dict.fromkeys((r["step"], r["hooks"]) for r in rows):
        cells = [next(r for r in rows if (r["step"], r["hooks"], r["nbytes"]) == (step, hooks, s)) for s in SIZES]
        print(f"{step:<18}{hooks!s:>6}" + "".join(f"{r['med']:>10.1f} /{r['p90']:>6.1f}" for r in cells))


if __name__ == "__main__":
    main()
