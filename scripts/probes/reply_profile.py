"""Probe: ``cProfile`` on a worker's event loop while other-"host" ``get_data`` requests are answered.

Four ``Nanny`` workers, ``gpupool.host-id`` set so that w0, w1 are "host-a" and w2, w3 "host-b"; w0 makes an
array of ``--nbytes`` and w2 consumes it, ``--repeats`` times, after three warm-up transfers. Over ``tcp`` (the
default) the pools are ``host`` pools and the arrays NumPy (runs without a GPU); over ``ucxx`` the pools are
``device`` pools and the arrays CuPy from CuPy's own pool (plain arrays: what a worker at the defaults sends; needs a
GPU and distributed-ucxx), so the profile covers the plugin's hooks on UCX device frames. The profile covers only the
thread it is enabled in: the producer's event loop, where ``get_data`` and the serializers run (``--side producer``,
the default), or the consumer's (``consumer``), where the reply is read and deserialized. Prints the profile's lines
of ``dask_gpupool``'s functions by cumulative time, and Python's total for the thread. The profiler inflates small
Python calls several-fold, so the result ranks the plugin's functions on a transfer rather than timing them.

Run: ``python3 scripts/probes/reply_profile.py [--nbytes 1048576] [--repeats 200] [--side producer|consumer]
[--protocol tcp|ucxx]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import handoff as H  # benchmarks/handoff.py: its cluster
from distributed import wait

from dask_gpupool import GPUPool


def _produce(nbytes: int, gpu: bool) -> Any:
    if gpu:
        import cupy

        arr = cupy.ones(max(nbytes // 8, 1))
        cupy.cuda.runtime.deviceSynchronize()
        return arr
    import numpy as np

    return np.ones(max(nbytes // 8, 1))


def _consume(x: Any) -> int:
    return int(x.nbytes)


def _profile_start(dask_worker: Any = None) -> None:
    import cProfile

    dask_worker._probe_profile = cProfile.Profile()
    dask_worker._probe_profile.enable()


def _profile_stop(dask_worker: Any = None) -> str:
    import io
    import pstats

    profile = dask_worker._probe_profile
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats("dask_gpupool", 40)
    return out.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nbytes", type=int, default=1 << 20)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--side", choices=("producer", "consumer"), default="producer")
    p.add_argument("--protocol", choices=("tcp", "ucxx"), default="tcp")
    args = p.parse_args()
    gpu = args.protocol == "ucxx"
    env = {"env": {"CUDA_VISIBLE_DEVICES": "0"}} if gpu else {}
    hosts = ("host-a", "host-a", "host-b", "host-b")
    workers = [{"config": {"gpupool": {"host-id": host}}, **env} for host in hosts]
    plugin = GPUPool(kind="device" if gpu else "host", max_size="1 GiB" if gpu else "256 MiB")
    with H.cluster(workers, args.protocol, plugin) as c:
        from dask_gpupool.testing import workers

        info = workers(c)  # not scheduler_info(): see dask_gpupool.testing.workers
        addrs = sorted(info, key=lambda w: str(info[w]["name"]))
        src, dst = addrs[0], addrs[2]
        profiled = src if args.side == "producer" else dst
        for k in range(3 + args.repeats):
            if k == 3:
                c.run(_profile_start, workers=[profiled])
            x = c.submit(_produce, args.nbytes, gpu, workers=[src], pure=False)
            wait(x)
            c.submit(_consume, x, workers=[dst], pure=False).result()
            del x
        print(f"{args.protocol}, {args.side}, {args.repeats} transfers of {args.nbytes} bytes to another 'host'")
        print(c.run(_profile_stop, workers=[profiled])[profiled])


if __name__ == "__main__":
    main()
